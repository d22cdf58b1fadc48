"""Which middle tokens a sparse-offload layer attends to at a decode step: one replaceable object per layer
(`SparseOffloadCache.selector`), so ablations subclass it and probes wrap it instead of patching functions.

`select` runs inside the decode step (device work, static shapes for the layer's plan) and returns absolute
positions [B, Hkv, K] into the host store; the layer masks the ones past its middle (the selector may return
them when the middle is shorter than K) and reads their K and V rows itself.
"""
from __future__ import annotations

import torch

from tailorkv.engine.policies.row_cache import RowCache
from tailorkv.ops.host_gather import gather_rows
from tailorkv.ops.row_cache import refresh_rows
from tailorkv.ops.attention import softmax_scale
from tailorkv.ops.sparse_select import (approx_scores, channel_scores, combine_heads, head_scores, topk_channels,
                                       topk_tokens)


class TokenSelector:
    fetches_ahead = False  # True: prefetch() has work to start on the copy stream from the predicted query
    row_cache = None       # a RowCache of the rows it chose last step, if the selector keeps one for its layer
    COUNTERS = ("rows_read", "rows_chosen")  # the row cache's counts, as totals() names them

    def buffers(self, layer) -> dict:
        """The scheduler buffers this selector fills for the layer's decode step: name -> (shape of this step,
        the largest shape it will ever need, dtype) (SparseOffloadCache._plan_buffers)."""
        return {}

    def reset(self) -> None:
        """Forget what earlier steps left (the layer's cache was reset)."""
        if self.row_cache is not None:
            self.row_cache.reset()

    def middle_changed(self) -> None:
        """The middle [sink, tail_start) grew (a flush): rows fetched over the old one are stale."""

    def device_bytes(self) -> int:
        """Device memory the selector keeps for its layer (not the scheduler's shared buffers)."""
        return self.row_cache.device_bytes() if self.row_cache is not None else 0

    def totals(self) -> dict:
        """Its device counters since reset (LayerCache.totals): with a row cache, rows read from host and rows
        chosen."""
        if self.row_cache is None:
            return {}
        return dict(zip(self.COUNTERS, self.row_cache.counts.tolist()))

    def rows(self, layer):
        """(K rows, V rows) [B, Hkv, K, D] of the selected positions when the selector gathered them into device
        buffers; None: the attention reads them from the host store in place."""
        return None

    def prefetch(self, layer, q_sel: torch.Tensor) -> None:
        """What can be fetched before the layer's own query exists, from q_sel (its prediction, or the query
        itself): runs on the side streams (prefetch_ahead) while the layer before computes."""

    def prefetch_ahead(self, layer, q_sel: torch.Tensor, event: str) -> None:
        """prefetch() on the scheduler's side streams, done when `event` is (the layer waits for it)."""
        with layer.scheduler.copy_stream(event):
            self.prefetch(layer, q_sel)

    def select(self, layer, q: torch.Tensor) -> torch.Tensor:
        """q: the layer's query [B, Hq, 1, D] -> absolute positions [B, Hkv, K]."""
        raise NotImplementedError


class ChannelSelector(TokenSelector):
    """The paper's path: channel scores (by default the paper's |mean over the GQA group of q_hat| * max|K|) pick
    r channels per KV head; their K^T rows over the middle come from host memory; approximate scores of the
    current query over those channels, the group's heads combined by `rule` (the paper's: summed logits; lse /
    psum: ops.sparse_select.combine_heads), pick the top-K tokens per KV head. A middle of at most K tokens is
    taken whole (no scoring). With a row cache (--kt-cache) the layer keeps its last step's K^T rows on the device
    and reads only the channels it did not choose the step before (the rows' slots are then in the cache's order)."""
    fetches_ahead = True
    # Consecutive steps choose mostly the same channels (SmolLM2-135M over essay text at 4k on the CPU: 75% of a
    # layer's r = 12 picks were the step before's; with random weights 73%: bench/probes/channel_reuse.py; random
    # Llama-3.1-8B weights on the GPU: 10%); the rows are refetched whole after a flush (every FLUSH steps). Costs
    # each layer r rows over the largest middle.
    COUNTERS = ("kt_rows_read", "kt_rows_chosen")
    # The K^T gather's grid (ops.host_gather's `blocks`) by bytes per K^T element. 16 bits: the step waits on PCIe,
    # so one block per row. 8 bits (e4m3): half the bytes, the step waits on its compute stream, and a block per
    # row held the SMs its kernels need; 4 blocks (128k, 24 GiB cap, an H100: 16.2-16.4 -> 13.5 ms/token; 8
    # blocks 14.0, 16 15.9, 2 17.3; one block per row kept for 16 bits: 19.6-19.8 against 20.5 with 4 or 8).
    KT_GATHER_BLOCKS = {1: 4}  # other sizes: 0

    def __init__(self, rule: str, channel_rule: str, spec=None, r: int = 0, kt_dtype=None, keep_rows: bool = False):
        self.rule, self.channel_rule = rule, channel_rule
        use = keep_rows and spec is not None and r > 0
        self.row_cache = RowCache(spec, r, spec.max_len, kt_dtype) if use else None

    def middle_changed(self) -> None:
        if self.row_cache is not None:
            self.row_cache.forget()

    def buffers(self, layer):
        s, n, most = layer.spec, layer.middle_bucket, layer.most_middle()
        B, H, r = s.batch, s.n_kv_heads, layer.r
        held = {} if self.row_cache is not None else {"kt_rows": ((B, H, r, n), (B * H * r * most,), layer.kt.dtype)}
        return {**held, "scores": ((B, H, n), (B * H * most,), torch.float32),
                "channels": ((B, H, r), (B * H * r,), torch.long)}

    def prefetch(self, layer, q_sel):
        """The r channels per KV head from q_sel and their K^T rows over the middle's bucket, into the layer's
        buffers `channels` [B, Hkv, r] and `kt_rows` [B, Hkv, r, n] (or its row cache)."""
        lo, n = layer.sink, layer.middle_bucket
        chans = layer.buffer("channels")
        chans.copy_(self.channels(layer, q_sel))
        host = layer.kt.host[:, :, :, lo:lo + n]
        if self.row_cache is None:
            gather_rows(host, chans, q_sel.device, out=layer.buffer("kt_rows"),
                        blocks=self.KT_GATHER_BLOCKS.get(host.element_size(), 0))
        else:
            cache = self.row_cache
            refresh_rows(host, chans, cache.slots, cache.view(n), 0, layer.spec.head_dim, cache.counts)

    def held_rows(self, layer):
        """(channels [B, Hkv, r], their K^T rows [B, Hkv, r, n]) of this step, slot by slot."""
        if self.row_cache is None:
            return layer.buffer("channels"), layer.buffer("kt_rows")
        return self.row_cache.slots, self.row_cache.view(layer.middle_bucket)

    def select(self, layer, q):
        lo, n, k = layer.sink, layer.middle_bucket, layer.topk
        if layer.middle_whole:
            return layer.whole_middle(q)
        chans, rows = self.held_rows(layer)
        scale = softmax_scale(q.shape[-1])
        q = layer.kt.query(q)  # scaled as the rows are stored
        if self.rule in ("sum", "lse"):  # one fused pass: the paper's summed logits, or their lse
            scores = approx_scores(q, rows, chans, out=layer.buffer("scores"), rule=self.rule, sm_scale=scale,
                                   end=layer.tail_start_dev, offset=lo)
        else:
            past = torch.arange(lo, lo + n, device=q.device) >= layer.tail_start_dev
            logits = head_scores(q, rows, chans).masked_fill(past, float("-inf"))
            scores = combine_heads(logits, layer.spec.n_kv_heads, self.rule, scale)
        return topk_tokens(scores, k, lo)

    def channels(self, layer, q_sel):
        """The r channels per KV head [B, Hkv, r] whose K^T rows are fetched, from the query q_sel."""
        return topk_channels(channel_scores(q_sel, layer.kmax_before(), self.channel_rule), layer.r)


class ObservedSelector(TokenSelector):
    """Wraps a selector and hands every selection to `observe(layer, q, positions)` (probes, tests)."""

    def __init__(self, inner: TokenSelector, observe):
        self.inner, self.observe = inner, observe

    @property
    def fetches_ahead(self):
        return self.inner.fetches_ahead

    def prefetch(self, layer, q_sel):
        self.inner.prefetch(layer, q_sel)

    def prefetch_ahead(self, layer, q_sel, event):
        self.inner.prefetch_ahead(layer, q_sel, event)

    def buffers(self, layer):
        return self.inner.buffers(layer)

    def reset(self):
        self.inner.reset()

    def middle_changed(self):
        self.inner.middle_changed()

    def device_bytes(self):
        return self.inner.device_bytes()

    def totals(self):
        return self.inner.totals()

    def rows(self, layer):
        return self.inner.rows(layer)

    def select(self, layer, q):
        pos = self.inner.select(layer, q)
        self.observe(layer, q, pos)
        return pos

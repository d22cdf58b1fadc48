"""`--select sketch`: beyond the paper, a sparse layer keeps a low-bit copy of its middle keys on the device and
scores every channel of it, so only the chosen tokens' K and V rows cross PCIe (the paper's path fetches r rows
of K^T over the whole middle at every step).

The sketch is ops/quant.py's quantize_sketch (KIVI's key quantization: per channel, groups of `group` tokens
along time, fp16 scale and min; the codes packed per token into int32 words) over positions sink, sink + 1, ...
of the middle. The middle grows by
any number of tokens, as on the paper's path (the tail keeps exactly `recent` prompt tokens): a partial last
group is quantized over the tokens it has and again when it fills.
At a decode step the query's scores over the sketch (`sketch_scores`: the packed-key attention kernel with the
heads of a GQA group combined by the layer's rule in its epilogue) pick the top-K positions (SketchSelector).
"""
from __future__ import annotations

import math

import torch

from tailorkv.engine.policies.selection import TokenSelector
from tailorkv.engine.policies.row_cache import RowCache
from tailorkv.ops.host_gather import gather_rows
from tailorkv.ops.row_cache import refresh_rows
from tailorkv.ops.attention import softmax_scale
from tailorkv.ops.quant import codes_per_word, quantize_sketch
from tailorkv.ops.sparse_select import sketch_scores, topk_tokens
from tailorkv.ops.topk_carry import TopKCarry


class KeySketch:
    CARRY = True  # on the GPU, each step's top-K leaves a threshold for the next (ops/topk_carry.py)

    def __init__(self, spec, bits: int, group: int, capacity: int, topk: int = 0):
        self.bits, self.group = bits, group
        use = self.CARRY and topk > 0 and spec.device.type == "cuda"
        self.carry = TopKCarry(spec.batch * spec.n_kv_heads, topk, spec.device) if use else None
        n, codes, scales = self.shapes(spec.batch, spec.n_kv_heads, spec.head_dim, capacity, bits, group)
        self.codes = torch.zeros(codes, dtype=torch.int32, device=spec.device)
        self.scale = torch.zeros(scales, dtype=torch.float16, device=spec.device)
        self.min = torch.zeros_like(self.scale)
        self.capacity = n
        self.n = 0            # tokens sketched
        self.pending = None   # the exact keys of the last group while it is partial

    @staticmethod
    def shapes(batch: int, heads: int, head_dim: int, capacity: int, bits: int, group: int):
        """(positions held: the whole groups covering capacity, the codes' shape, the scales' and mins' shape)."""
        n = -(-capacity // group) * group
        return n, (batch, heads, n, head_dim // codes_per_word(bits)), (batch, heads, n // group, head_dim)

    @classmethod
    def bytes_for(cls, batch: int, heads: int, head_dim: int, capacity: int, bits: int, group: int) -> int:
        """Device bytes of a sketch of that size (int32 codes, fp16 scales and mins)."""
        _, codes, scales = cls.shapes(batch, heads, head_dim, capacity, bits, group)
        return 4 * math.prod(codes) + 2 * 2 * math.prod(scales)

    def reset(self) -> None:
        self.n, self.pending = 0, None
        if self.carry is not None:
            self.carry.reset()

    def append(self, k: torch.Tensor) -> None:
        """k [B, H, m, D] on the device: the next m middle tokens. A partial last group is quantized over its
        own tokens (padded with its last one, so its min and max are its own) and again, whole, once it fills."""
        m = k.shape[2]
        if not m:
            return
        g = self.group
        r = self.n % g
        x = k if self.pending is None else torch.cat([self.pending, k], 2)
        a, t = self.n - r, r + m          # x holds positions a .. a + t - 1, a on a group boundary
        whole = -(-t // g) * g
        if whole > t:
            x = torch.cat([x, x[:, :, t - 1:t].expand(-1, -1, whole - t, -1)], 2)
        codes, scale, mn = quantize_sketch(x, self.bits, g)
        self.codes[:, :, a:a + whole] = codes
        self.scale[:, :, a // g:(a + whole) // g] = scale
        self.min[:, :, a // g:(a + whole) // g] = mn
        self.n += m
        rem = t % g
        self.pending = x[:, :, t - rem:t].clone() if rem else None

    def scores(self, q: torch.Tensor, n: int, end: torch.Tensor, offset: int, rule: str,
               blocks_per_sm: float | None = None) -> torch.Tensor:
        """q [B, Hq, 1, D] -> [B, Hkv, n] fp32: the scaled logits over the first n sketched positions (n a
        multiple of the group), -inf from absolute position `end` on (positions past self.n hold stale or
        padded data), the group's heads combined by `rule`; position i of the sketch is absolute offset + i.
        blocks_per_sm: the kernel's grid (None: its own full wave)."""
        g = self.group
        return sketch_scores(q, self.codes[:, :, :n], self.scale[:, :, :n // g], self.min[:, :, :n // g],
                             self.bits, g, end, offset, rule, softmax_scale(q.shape[-1]), carry=self.carry,
                             blocks_per_sm=blocks_per_sm)

    def device_bytes(self) -> int:
        carry = self.carry.device_bytes() if self.carry is not None else 0
        return carry + sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.min))

    def totals(self) -> dict:
        """With a carry: the top-K rows searched whole, of all selected (the rest chose among the tokens their
        carry listed: ops/topk_carry.py)."""
        if self.carry is None:
            return {}
        whole, selected = self.carry.searches.tolist()
        return {"topk_searched_whole": whole, "topk_selected": selected}


class SketchSelector(TokenSelector):
    """Scores over the sketch pick the top-K middle tokens per KV head. By default from the layer's own query,
    inside the step; the attention then reads their K and V rows from the host store in place. ahead=True
    (`--select sketch-ahead`): from the query predicted one layer early, on the copy stream while the layer
    before computes, which also gathers the chosen rows into device buffers there (what that costs in recall:
    eval/results/2026-11-30-cpu-prediction-variants). A layer that gets no prediction does the same from its
    own query, inside the step. With a row cache (REUSE_ROWS) the gather reads only the chosen rows the layer's
    cache does not hold from the last step, and the attention reads the rows in the cache's slot order."""

    # the scores and top-K of sketch-ahead on their own stream (False: on the copy stream, before the gather)
    SELECT_STREAM = True
    # sketch-ahead keeps each layer's last rows on the device and reads only the new ones (engine/policies/
    # row_cache.py). Off: on the H200 with random Llama-3.1-8B weights at 128k consecutive steps share 1% of their
    # rows, and the row cache cost 6.49 -> 6.69-6.97 ms/token; real weights share far more (SmolLM2-135M at 8k on
    # the H200: 81%, PCIe 19.0 -> 3.6 MiB/token), not yet timed on a real 8B.
    REUSE_ROWS = False
    # the sketch kernel's grid ahead of its layer, in blocks per SM, by how many layers early the query is predicted
    # (--predict-ahead 1, 2 or more): a partial wave leaves room on every SM for the compute stream's GEMVs.
    # On the H200 at 128k: 1 ahead (4 bits) 6.09-6.12 ms/token with the full wave of 4 per SM, 5.93-5.96 with
    # 1.5, 5.97-6.00 with 2, 5.95 with 2.5, 6.01 with 3, 6.17 with 1, 6.92 with 0.5 (32k 5.51 -> 5.37, 8k 5.20 ->
    # 5.15; bench/results/2026-12-01-h200-seventeenth-session); 2 ahead (2 bits) 6.38 -> 6.10-6.12 with 1,
    # 4 ahead 6.00-6.04 (bench/results/2026-12-01-h200-fourteenth-session)
    AHEAD_BLOCKS_PER_SM = {1: 1.5, 2: 1.0}

    @classmethod
    def of(cls, settings, spec, topk: int) -> "SketchSelector":
        grid = cls.AHEAD_BLOCKS_PER_SM[min(settings.predict_ahead, 2)]
        return cls(settings.combine_rule, settings.select == "sketch-ahead", spec, topk, grid)

    def __init__(self, rule: str = "lse", ahead: bool = False, spec=None, topk: int = 0,
                 ahead_grid: float | None = None):
        self.rule, self.ahead, self.ahead_grid = rule, ahead, ahead_grid
        use = ahead and self.REUSE_ROWS and spec is not None and topk > 0
        self.row_cache = RowCache(spec, topk) if use else None  # its counts: the plan counts every chosen row

    @property
    def fetches_ahead(self) -> bool:
        return self.ahead

    def buffers(self, layer):
        if not self.ahead:
            return {}
        s, k = layer.spec, layer.topk
        B, H, D = s.batch, s.n_kv_heads, s.head_dim
        chosen = {"positions": ((B, H, k), (B * H * k,), torch.long)}
        if self.row_cache is None:
            chosen["rows"] = ((B, H, k, 2 * D), (B * H * k * 2 * D,), s.dtype)
        return chosen

    def prefetch(self, layer, q_sel):
        if self.ahead:
            self._gather(layer, self._pick(layer, q_sel, out=layer.buffer("positions")))

    def prefetch_ahead(self, layer, q_sel, event):
        """The scores and top-K on the select stream, the gather on the copy stream after them: the next
        layer's choice need not wait behind this layer's gather (bound by PCIe, not by the SMs)."""
        if not self.SELECT_STREAM:
            return super().prefetch_ahead(layer, q_sel, event)
        if not self.ahead:
            return
        picked = event + ":picked"
        with layer.scheduler.select_stream(picked):
            pos = self._pick(layer, q_sel, out=layer.buffer("positions"), grid=self.ahead_grid)
        with layer.scheduler.copy_stream(event, after=(picked,)):
            self._gather(layer, pos)

    def _gather(self, layer, pos):
        B, H, N, _, D = layer.host_kv.shape
        host, cache = layer.host_kv.view(B, H, N, 2 * D), self.row_cache
        if cache is None:
            gather_rows(host, pos, pos.device, out=layer.buffer("rows"))
        else:
            refresh_rows(host, pos, cache.slots, cache.rows, layer.sink, layer.middle_bucket, cache.counts)

    def select(self, layer, q):
        if layer.middle_whole:
            return layer.whole_middle(q)
        if not self.ahead:
            return self._pick(layer, q)
        return layer.buffer("positions") if self.row_cache is None else self.row_cache.slots

    def rows(self, layer):
        if not self.ahead or layer.middle_whole:
            return None
        r = layer.buffer("rows") if self.row_cache is None else self.row_cache.rows
        D = layer.spec.head_dim
        return r[..., :D], r[..., D:]

    def _pick(self, layer, q, out=None, grid: float | None = None):
        """Absolute positions [B, Hkv, K] of the top-K middle tokens by q's scores over the sketch (into out)."""
        lo, n = layer.sink, layer.middle_bucket
        scores = layer.sketch.scores(q, n, layer.tail_start_dev, lo, self.rule, grid)
        return topk_tokens(scores, layer.topk, lo, out, carry=layer.sketch.carry)

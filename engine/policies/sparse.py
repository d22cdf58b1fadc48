"""`sparse`: TailorKV's sparsity-friendly layers (DESIGN.md, method point 3).

Regions, by absolute position (every held token is in exactly one):
- sink   [0, min(sink, held))    on the device, slots [0, sink) of `dev_k` / `dev_v`
- middle [sink, tail_start)      in the host store only (GPU-mapped when the device is CUDA, ops/host_memory.py)
- tail   [tail_start, held)      on the device, slots sink + (position - tail_start): the prompt's last
                                 `recent` tokens and every token generated since the last flush
The host store is preallocated to max_len and indexed by absolute position: token-major K and V side by side
[B, Hkv, max_len, 2, D] (host_k, host_v: its views) and, for the paper's selection, channel-major K^T
[B, Hkv, D, max_len] (kt_store.py; `--select sketch` keeps none). max|K| per (KV head, channel) [B, Hkv, D]
stays on the device and grows with every token added (prompt and generated).

- Multi-token step (prefill, or a later chat turn): exact causal attention of the new queries over every
  held token (the whole middle is copied back from the host) plus the new ones. The new tokens are stored as
  the step runs: the sink fills first, then the tail, cut to its last `recent` tokens (the older ones join
  the middle in the host store).
- Decode (static shapes for a graph): the token goes to its device slot; the selector picks K = top-K middle
  positions (channel scores from the predicted query pick r channels, their K^T rows over a bucket of the
  middle come from the host, approximate scores of the current query pick the tokens; a middle of at most K
  tokens is taken whole); their K and V rows are gathered from the host; one exact softmax over the device
  slots and the gathered rows, each masked to what is held. `commit` then flushes: when the tail reaches
  recent + FLUSH tokens, all but its newest `recent` move to the host store (one copy per FLUSH steps).
"""
from __future__ import annotations

import math

import torch

from tailorkv.engine.cache import LayerCache, LayerSpec
from tailorkv.engine.policies.kt_store import KtStore
from tailorkv.engine.policies.selection import ChannelSelector
from tailorkv.engine.policies.sketch import KeySketch, SketchSelector
from tailorkv.engine.settings import MethodSettings
from tailorkv.engine.step import fine_bucket
from tailorkv.ops.attention import causal_attention, sparse_decode_attention
from tailorkv.ops.host_copy import host_copy
from tailorkv.ops.host_memory import host_empty
from tailorkv.ops.kv_store import store_kv

FLUSH = 128  # generated tokens the tail may hold beyond `recent` before they move to the host store
STORE_CHUNK = 16384  # prompt tokens copied to the host store at a time
# A K^T prefetch up to this size starts after the previous layer's attention (it then fits under that layer's
# MLP and the next projections: ~180 us of an 8B model's step on an H200, ~9 MB at PCIe Gen5 speed); a larger
# one starts with the previous layer, sharing the link with its reads of host rows (measured on the H200:
# 32k tokens, 6 MB per layer: 10.4 ms/token late vs 12.2 early; 128k, 25 MB: 27.0 late vs 20.4 early). The
# sketch's selection and gather start with the previous layer (its attention reads device buffers, not the link).
LATE_PREFETCH_BYTES = 8 << 20


class SparseOffloadCache(LayerCache):
    name = "sparse"
    wants_query_prediction = True
    selects_tokens = True
    graph_safe = True

    def __init__(self, spec: LayerSpec, settings: MethodSettings):
        super().__init__(spec)
        self.sink, self.recent = min(settings.sink, spec.max_len), settings.recent
        self.topk = settings.topk
        self.r = min(settings.channels, spec.head_dim)
        self.cap = self.recent + FLUSH
        if spec.layer_idx in (settings.own_query_layers or []):  # its one-layer-early prediction is poor
            self.wants_query_prediction = False
        self.sketch = None
        self.kt = KtStore(spec, settings.kt_bits) if not settings.sketched else None  # the paper's K^T
        if settings.sketched:
            self.sketch = KeySketch(spec, settings.sketch_bits, settings.group, spec.max_len - self.sink, self.topk)
            self.selector = SketchSelector.of(settings, spec, self.topk)
        else:
            self.selector = ChannelSelector(settings.combine_rule, settings.channel_rule, spec, self.r, self.kt.dtype,
                                            settings.kt_cache)
        B, H, N, D = spec.batch, spec.n_kv_heads, spec.max_len, spec.head_dim
        # a token's K and V rows side by side (one 2D-row run per token and head): the decode step reads both;
        # sketch-ahead reads its rows beside the GEMVs, from large GPU pages (ops/host_memory.py)
        self.host_kv = host_empty((B, H, N, 2, D), spec.dtype, spec.device, settings.select == "sketch-ahead")
        self.host_k, self.host_v = self.host_kv[:, :, :, 0], self.host_kv[:, :, :, 1]
        dev = dict(dtype=spec.dtype, device=spec.device)
        self.dev_k = torch.zeros(B, H, self.sink + self.cap, D, **dev)
        self.dev_v = torch.zeros_like(self.dev_k)
        # max |K| per KV head and channel (the paper's channel scores): a step writes kmax_next, commit copies it
        self.tracks_kmax = self.sketch is None
        self.kmax, self.kmax_next = (torch.zeros(B, H, D, dtype=torch.float32, device=spec.device) for _ in range(2))
        self.tail_start_dev = torch.zeros((), dtype=torch.long, device=spec.device)
        self.reset()

    # --- bookkeeping ------------------------------------------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.held = 0
        self._set_tail_start(self.sink)  # always >= sink; the middle is [sink, tail_start)
        for t in (self.kmax, self.kmax_next):
            t.zero_()
        if self.sketch is not None:
            self.sketch.reset()
        self.selector.reset()
        if self.kt is not None:
            self.kt.reset()
        self.q_hat = None
        self.middle_bucket, self.middle_whole, self.whole_width, self.prefetched = 0, False, 0, False
        self._fetched = f"kt_rows:{self.spec.layer_idx}"

    def _set_tail_start(self, pos: int) -> None:
        self.tail_start = pos
        self.tail_start_dev.fill_(pos)
        self.selector.middle_changed()

    def regions(self) -> dict[str, range]:
        return {"sink": range(0, min(self.sink, self.held)),
                "middle": range(self.sink, self.tail_start),
                "tail": range(self.tail_start, max(self.tail_start, self.held))}

    def held_kv(self, pending: int = 0, new=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held token's K and V in position order, on the device (copies the middle back).
        pending: also the tokens of the step in flight that run() already put on the device (inside run);
        new: (k, v) of tokens not held yet, appended in the same allocation (no second copy of the whole)."""
        n = self.held + pending
        dev, ns, tl = self.spec.device, min(self.sink, n), max(0, n - self.tail_start)
        lo, hi = self.sink, self.tail_start
        held = ns + (hi - lo) + tl
        extra = 0 if new is None else new[0].shape[2]
        k, v = (torch.empty(*b.shape[:2], held + extra, b.shape[3], dtype=b.dtype, device=dev)
                for b in (self.dev_k, self.dev_v))
        for i, (dst, src, host) in enumerate(((k, self.dev_k, self.host_k), (v, self.dev_v, self.host_v))):
            dst[:, :, :ns] = src[:, :, :ns]
            host_copy(dst[:, :, ns:ns + hi - lo], host[:, :, lo:hi])  # one DMA of the strided middle
            dst[:, :, ns + hi - lo:held] = src[:, :, lo:lo + tl]
            if new is not None:
                dst[:, :, held:] = new[i]
        return k, v

    def truncate(self, length: int) -> None:
        if length >= self.held:
            return
        if length == 0:
            self.reset()
        elif length < self.tail_start and self.tail_start > self.sink:
            raise RuntimeError(f"the sparse cache cannot drop tokens already moved to host memory (cut at "
                               f"{length}, host holds up to {self.tail_start}); start a new chat (/reset)")
        else:
            self.held = length  # max|K| keeps the dropped tokens: an over-estimate, harmless for scoring

    def predict_query(self, q_hat: torch.Tensor) -> None:
        """At the layer before this one: keep the prediction and start fetching the K^T rows it selects on
        the copy stream, while that layer computes (run() waits for them)."""
        self.q_hat = q_hat
        if self.middle_bucket and self.selector.fetches_ahead:
            self.selector.prefetch_ahead(self, q_hat, self._fetched)
            self.prefetched = True

    def kmax_before(self) -> torch.Tensor:
        """max |K| [B, Hkv, D] over the tokens held before this step (kept by the channels path only)."""
        return self.kmax

    def totals(self) -> dict:
        return {**(self.sketch.totals() if self.sketch is not None else {}), **self.selector.totals()}

    def device_bytes(self) -> int:
        sketch = self.sketch.device_bytes() if self.sketch is not None else 0
        held = (self.dev_k, self.dev_v, self.kmax, self.kmax_next)
        return sketch + self.selector.device_bytes() + sum(t.numel() * t.element_size() for t in held)

    def whole_middle(self, q) -> torch.Tensor:
        """A middle of at most top-K tokens taken whole: positions sink .. sink + n - 1, n its bucket capped at
        K (not K: a budget far past the context would read that many rows), those past it masked [B, Hkv, n]."""
        k = self.whole_width
        pos = torch.arange(self.sink, self.sink + k, device=q.device).clamp_max(self.spec.max_len - 1)
        return pos.expand(q.shape[0], self.spec.n_kv_heads, k)

    def host_bytes(self) -> int:
        return self.host_kv.numel() * self.host_kv.element_size() + (self.kt.nbytes() if self.kt else 0)

    # --- one step -----------------------------------------------------------------------------------------
    def plan(self, step):
        mid = self.tail_start - self.sink
        s = self.spec
        row = s.batch * s.n_kv_heads * s.head_dim * self.host_k.element_size()  # a token's K (or V) row, all heads
        if not step.decode:
            self.middle_bucket, self.middle_whole = 0, False
            self.last = {"tokens_fetched": mid, "bytes_fetched": 2 * mid * row, "middle_tokens": mid,
                         "tokens_attended": self.held + step.n}
            return None
        self.middle_whole = 0 < mid <= self.topk
        self.middle_bucket = min(fine_bucket(mid), self.most_middle()) if mid > self.topk else 0
        self.whole_width = min(fine_bucket(mid), self.topk) if self.middle_whole else 0
        self._plan_buffers()
        fetched = min(mid, self.topk)
        kt_rows = 0 if self.sketch is not None else self.r * self.middle_bucket
        kt_bytes = self.spec.batch * self.spec.n_kv_heads * kt_rows * (self.kt.host.element_size() if self.kt else 0)
        self.prefetch_after_attention = self.sketch is None and kt_bytes <= LATE_PREFETCH_BYTES
        gathered = self.whole_width if self.middle_whole else self.topk if mid > 0 else 0
        on_device = min(self.sink, step.end) + max(0, step.end - self.tail_start)
        self.last = {"tokens_fetched": fetched, "bytes_fetched": kt_bytes + 2 * gathered * row,
                     "kt_bytes": kt_bytes, "middle_tokens": mid, "tokens_attended": on_device + fetched}
        kind = "whole" if self.middle_whole else "none" if mid <= 0 else "select"
        return kind, self.whole_width or self.middle_bucket

    def most_middle(self) -> int:
        """The largest middle bucket: the whole middle, or the sketch's whole groups covering it."""
        return self.spec.max_len - self.sink if self.sketch is None else self.sketch.capacity

    def _plan_buffers(self) -> None:
        """Views of the scheduler's buffers (the set of this layer's index modulo their count) that this decode
        step fills (the selector's). The first request allocates each at the size the largest middle needs."""
        self._buffers = {}
        for name, (shape, most_shape, dtype) in self.selector.buffers(self).items():
            full = self.scheduler.buffer(name, self.spec.layer_idx, most_shape, dtype)
            self._buffers[name] = full[:math.prod(shape)].view(shape)

    def buffer(self, name: str) -> torch.Tensor:
        """This step's view of a scheduler buffer the selector asked for (_plan_buffers)."""
        return self._buffers[name]

    def run(self, q, k, v, step):
        # a prediction serves one step only; the copy stream may still read it, so it stays referenced until
        # this step has queued its wait for the prefetch (else the compute stream could reuse its memory first)
        q_hat, self.q_hat = self.q_hat, None  # noqa: F841
        prefetched, self.prefetched = self.prefetched, False
        if step.decode:
            return self._decode(q, k, v, prefetched, step.positions)
        out = self._attend_many(q, k, v, step.start)
        self._store(k, v)
        self.held = step.end
        return out

    def commit(self, step) -> None:
        if step.decode:
            if self.tracks_kmax:
                self.kmax.copy_(self.kmax_next)
            self.held += 1
            if self._tail_len() >= self.cap:
                self._flush(self._tail_len() - self.recent)
        self.scheduler.join()  # the next step reads the host store: after its writes

    def _attend_many(self, q, k, v, start):
        """Exact causal attention over all held tokens (middle fetched whole) and the new ones."""
        if start == 0:
            return causal_attention(q, k, v, 0, into_q=True)
        keys, vals = self.held_kv(new=(k, v))
        return causal_attention(q, keys, vals, start)

    def _decode(self, q, k, v, prefetched, p):
        S = self.sink
        store_kv(self.dev_k, self.dev_v, p, k, v, self.tail_start_dev, S)   # the sink's slot or the tail's
        if self.tracks_kmax:
            torch.maximum(self.kmax, k.abs().amax(2).float(), out=self.kmax_next)
        pos = None
        if self.middle_whole or self.middle_bucket:
            if self.middle_bucket and not prefetched:  # no prediction came: fetch from the current query
                self.selector.prefetch(self, q)
            elif prefetched:
                self.scheduler.wait(self._fetched)
            pos = self.selector.select(self, q)                                          # [B, Hkv, K]
            rows = self.selector.rows(self)
            if rows is not None:  # gathered into device buffers by the selector
                return sparse_decode_attention(q, self.dev_k, self.dev_v, *rows, pos, p, self.tail_start_dev, S,
                                               rows_gathered=True)
        # one op: the device slots and the selected rows of the host store (read zero-copy, not gathered into
        # buffers), each masked to what is held, in one fp32 softmax
        return sparse_decode_attention(q, self.dev_k, self.dev_v, self.host_k, self.host_v, pos, p,
                                       self.tail_start_dev, S)

    # --- storing ------------------------------------------------------------------------------------------
    def _store(self, k, v) -> None:
        """Append a multi-token step's tokens at positions held..: the sink first, then the tail; all but
        the tail's newest `recent` tokens go to the host store."""
        start, end, S = self.held, self.held + k.shape[2], self.sink
        for s in range(0, k.shape[2] if self.tracks_kmax else 0, STORE_CHUNK):  # in chunks: no [T] temporary
            torch.maximum(self.kmax, k[:, :, s:s + STORE_CHUNK].abs().amax(2).float(), out=self.kmax)
        ns = max(0, min(S, end) - start)
        if ns:
            self.dev_k[:, :, start:start + ns] = k[:, :, :ns]
            self.dev_v[:, :, start:start + ns] = v[:, :, :ns]
            k, v = k[:, :, ns:], v[:, :, ns:]
        t = k.shape[2]
        if t == 0:
            return
        tl = start + ns - self.tail_start  # tail tokens held before these
        n = tl + t
        m = max(0, n - self.recent)  # oldest tokens of (tail + new) that move to the host
        if m == 0:
            self.dev_k[:, :, S + tl:S + n] = k
            self.dev_v[:, :, S + tl:S + n] = v
            return
        a = min(tl, m)           # ... of which from the old tail
        self._to_host(self.dev_k[:, :, S:S + a], self.dev_v[:, :, S:S + a], self.tail_start)
        self._to_host(k[:, :, :m - a], v[:, :, :m - a], self.tail_start + a)
        keep_k = torch.cat([self.dev_k[:, :, S + a:S + tl], k[:, :, m - a:]], 2)  # new tensors: no overlap
        keep_v = torch.cat([self.dev_v[:, :, S + a:S + tl], v[:, :, m - a:]], 2)
        self.dev_k[:, :, S:S + n - m] = keep_k
        self.dev_v[:, :, S:S + n - m] = keep_v
        self._set_tail_start(self.tail_start + m)

    def _flush(self, m: int) -> None:
        """Move the tail's oldest m tokens to the host store."""
        S, tl = self.sink, self._tail_len()
        self._to_host(self.dev_k[:, :, S:S + m], self.dev_v[:, :, S:S + m], self.tail_start)
        self.dev_k[:, :, S:S + tl - m] = self.dev_k[:, :, S + m:S + tl].clone()
        self.dev_v[:, :, S:S + tl - m] = self.dev_v[:, :, S + m:S + tl].clone()
        self._set_tail_start(self.tail_start + m)

    def _to_host(self, k, v, pos: int) -> None:
        """Write tokens [pos, pos + m) to the host store on the copy stream (K^T transposed on the device
        first), so the layers after this one compute meanwhile; commit() joins the streams. The device copies
        go through the scheduler's two staging slots: at most two chunks in flight, whatever the layer."""
        B, H, _, D = k.shape
        for s in range(0, k.shape[2], STORE_CHUNK):  # chunks bound the device copies of a prompt
            kc, vc = k[:, :, s:s + STORE_CHUNK], v[:, :, s:s + STORE_CHUNK]
            m, a = kc.shape[2], pos + s
            (kvc,), event = self.scheduler.staging("store", [(B, H, m, 2, D)], kc.dtype)  # K and V as stored
            torch.stack([kc, vc], 3, out=kvc)
            if self.kt is not None:
                self.kt.write(self.scheduler, kc, a, self.kmax)
            if self.sketch is not None:
                self.sketch.append(kc)
            with self.scheduler.copy_stream(event):
                host_copy(self.host_kv[:, :, a:a + m], kvc)

    def _tail_len(self) -> int:
        return max(0, self.held - self.tail_start)

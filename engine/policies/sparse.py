"""`sparse`: TailorKV's sparsity-friendly layers (DESIGN.md, method point 3).

Regions, by absolute position (every held token is in exactly one):
- sink   [0, min(sink, length))      on the device (sink_k/sink_v)
- middle [sink, tail_start)          in the host store only (pinned when the device is CUDA)
- tail   [tail_start, length)        on the device (tail_k/tail_v): the prompt's last `recent` tokens and
                                     every token generated since the last flush
The host store is preallocated to max_len and indexed by absolute position: token-major K and V
[B, Hkv, max_len, D] and channel-major K^T [B, Hkv, D, max_len]. max|K| per (KV head, channel) [B, Hkv, D]
stays on the device and grows with every token added (prompt and generated).

Storing happens after the attention of a step, so the middle a step scores is fixed before it starts.
- Multi-token attend (prefill, or a later chat turn): exact causal attention of the new queries over every
  held token (the whole middle is copied back from the host) plus the new ones, causally. Then the new tokens
  are stored and the tail is cut to its last `recent` tokens (the older ones join the middle).
- Decode (one token): channel scores from the predicted query (else the current one) pick r channels per KV
  head; their K^T rows over the middle come to the device; approximate scores of the current query over the
  middle pick the top-K tokens per KV head; their K and V rows are gathered from the host; one exact softmax
  over sink + top-K + tail + the new token. A middle of at most top-K tokens is taken whole (so a budget of
  at least the context reproduces `full`). Then the token joins the tail; when the tail exceeds
  recent + FLUSH tokens, all but its newest `recent` move to the host store (one copy per FLUSH steps).
"""
from __future__ import annotations

import torch

from tailorkv.engine.cache import LayerCache, LayerSpec
from tailorkv.engine.settings import MethodSettings
from tailorkv.ops.attention import attention_with_mask, causal_attention
from tailorkv.ops.host_gather import gather_rows
from tailorkv.ops.sparse_select import approx_scores, channel_scores, topk_channels, topk_tokens

FLUSH = 128  # generated tokens the tail may hold beyond `recent` before they move to the host store


class SparseOffloadCache(LayerCache):
    name = "sparse"
    wants_query_prediction = True

    def __init__(self, spec: LayerSpec, settings: MethodSettings):
        super().__init__(spec)
        self.sink, self.recent = settings.sink, settings.recent
        self.topk = settings.topk
        self.r = min(settings.channels, spec.head_dim)
        self.cap = self.recent + FLUSH
        B, H, N, D = spec.batch, spec.n_kv_heads, spec.max_len, spec.head_dim
        host = dict(dtype=spec.dtype, device="cpu", pin_memory=spec.device.type == "cuda")
        self.host_k = torch.empty(B, H, N, D, **host)
        self.host_v = torch.empty(B, H, N, D, **host)
        self.host_kt = torch.empty(B, H, D, N, **host)
        dev = dict(dtype=spec.dtype, device=spec.device)
        self.sink_k = torch.zeros(B, H, min(self.sink, N), D, **dev)
        self.sink_v = torch.zeros_like(self.sink_k)
        self.tail_k = torch.zeros(B, H, self.cap, D, **dev)
        self.tail_v = torch.zeros_like(self.tail_k)
        self.kmax = torch.zeros(B, H, D, dtype=torch.float32, device=spec.device)
        self.reset()

    # --- bookkeeping ------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.length = 0
        self.tail_start = self.sink  # always >= sink; the middle is [sink, tail_start)
        self.kmax.zero_()
        self.q_hat = None
        self._stats = {"tokens_fetched": 0, "bytes_fetched": 0, "middle_tokens": 0}

    def regions(self) -> dict[str, range]:
        return {"sink": range(0, min(self.sink, self.length)),
                "middle": range(self.sink, self.tail_start),
                "tail": range(self.tail_start, max(self.tail_start, self.length))}

    def truncate(self, length: int) -> None:
        if length >= self.length:
            return
        if length == 0:
            self.reset()
        elif length < self.tail_start and self.tail_start > self.sink:
            raise RuntimeError(f"the sparse cache cannot drop tokens already moved to host memory (cut at "
                               f"{length}, host holds up to {self.tail_start}); start a new chat (/reset)")
        else:
            self.length = length  # max|K| keeps the dropped tokens: an over-estimate, harmless for scoring

    def predict_query(self, q_hat: torch.Tensor) -> None:
        self.q_hat = q_hat

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.sink_k, self.sink_v, self.tail_k, self.tail_v,
                                                          self.kmax))

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.host_k, self.host_v, self.host_kt))

    def stats(self) -> dict:
        return dict(self._stats)

    # --- attention ----------------------------------------------------------------------------------------
    def attend(self, q, k, v, start_pos):
        self.admit(start_pos, k.shape[2])
        q_hat, self.q_hat = self.q_hat, None  # a prediction serves one step only
        if k.shape[2] == 1:
            out = self._decode(q, k, v, q_hat)
        else:
            out = self._attend_many(q, k, v, start_pos)
        self._store(k, v, force=k.shape[2] > 1)
        return out

    def _attend_many(self, q, k, v, start_pos):
        """Exact causal attention over all held tokens (middle fetched whole) and the new ones."""
        mid = self.tail_start - self.sink
        self._count(mid, mid * 2 * self._row_bytes(), mid)
        if start_pos == 0:
            return causal_attention(q, k, v, 0)
        dev = self.spec.device
        lo, hi, n, tl = self.sink, self.tail_start, min(self.sink, self.length), self._tail_len()
        keys = torch.cat([self.sink_k[:, :, :n], self.host_k[:, :, lo:hi].to(dev), self.tail_k[:, :, :tl], k], 2)
        vals = torch.cat([self.sink_v[:, :, :n], self.host_v[:, :, lo:hi].to(dev), self.tail_v[:, :, :tl], v], 2)
        return causal_attention(q, keys, vals, start_pos)

    def _decode(self, q, k, v, q_hat):
        dev = self.spec.device
        lo, hi = self.sink, self.tail_start
        mid, n, tl = hi - lo, min(self.sink, self.length), self._tail_len()
        keys, vals = [self.sink_k[:, :, :n]], [self.sink_v[:, :, :n]]
        if 0 < mid <= self.topk:  # small middle: take it whole, no scoring
            keys.append(self.host_k[:, :, lo:hi].to(dev))
            vals.append(self.host_v[:, :, lo:hi].to(dev))
            self._count(mid, mid * 2 * self._row_bytes(), mid)
        elif mid > 0 and self.topk > 0:
            chans = topk_channels(channel_scores(q if q_hat is None else q_hat, self.kmax), self.r)
            rows = gather_rows(self.host_kt[:, :, :, lo:hi], chans, dev)           # [B, Hkv, r, mid]
            idx = topk_tokens(approx_scores(q, rows, chans), self.topk) + lo       # absolute positions
            keys.append(gather_rows(self.host_k, idx, dev))
            vals.append(gather_rows(self.host_v, idx, dev))
            elt = self.host_k.element_size()
            B, H = self.spec.batch, self.spec.n_kv_heads
            self._count(self.topk, B * H * self.r * mid * elt + self.topk * 2 * self._row_bytes(), mid)
        else:
            self._count(0, 0, mid)
        keys += [self.tail_k[:, :, :tl], k]
        vals += [self.tail_v[:, :, :tl], v]
        return attention_with_mask(q, torch.cat(keys, 2), torch.cat(vals, 2))

    # --- storing ------------------------------------------------------------------------------------------
    def _store(self, k, v, force: bool):
        """Append tokens at positions length..: the sink first, then the tail. When the tail grows past its
        limit (`recent` if force, else recent + FLUSH), all but its newest `recent` tokens go to the host."""
        torch.maximum(self.kmax, k.abs().amax(2).float(), out=self.kmax)
        start, end = self.length, self.length + k.shape[2]
        ns = max(0, min(self.sink, end) - start)
        if ns:
            self.sink_k[:, :, start:start + ns] = k[:, :, :ns]
            self.sink_v[:, :, start:start + ns] = v[:, :, :ns]
            k, v = k[:, :, ns:], v[:, :, ns:]
        self.length = end
        t = k.shape[2]
        if t == 0:
            return
        tl = start + ns - self.tail_start  # tail tokens held before these
        n = tl + t
        if n <= (self.recent if force else self.cap):
            self.tail_k[:, :, tl:n] = k
            self.tail_v[:, :, tl:n] = v
            return
        m = n - self.recent      # oldest tokens of (tail + new) that move to the host
        a = min(tl, m)           # ... of which from the old tail
        self._to_host(self.tail_k[:, :, :a], self.tail_v[:, :, :a], self.tail_start)
        self._to_host(k[:, :, :m - a], v[:, :, :m - a], self.tail_start + a)
        keep_k = torch.cat([self.tail_k[:, :, a:tl], k[:, :, m - a:]], 2)  # a new tensor: no overlap below
        keep_v = torch.cat([self.tail_v[:, :, a:tl], v[:, :, m - a:]], 2)
        self.tail_k[:, :, :self.recent] = keep_k
        self.tail_v[:, :, :self.recent] = keep_v
        self.tail_start += m

    def _to_host(self, k, v, pos: int) -> None:
        m = k.shape[2]
        if m:
            self.host_k[:, :, pos:pos + m].copy_(k)
            self.host_v[:, :, pos:pos + m].copy_(v)
            self.host_kt[:, :, :, pos:pos + m].copy_(k.transpose(2, 3))

    def _tail_len(self) -> int:
        return max(0, self.length - self.tail_start)

    def _row_bytes(self) -> int:
        """Bytes of one token's K (or V) row over all batch entries and KV heads."""
        s = self.spec
        return s.batch * s.n_kv_heads * s.head_dim * self.host_k.element_size()

    def _count(self, tokens: int, nbytes: int, middle: int) -> None:
        self._stats = {"tokens_fetched": tokens, "bytes_fetched": nbytes, "middle_tokens": middle}

"""`quant`: TailorKV's quantization-friendly layers. The whole KV stays on the device at 1 or 2 bits
(KIVI-style, layouts in ops/quant.py) plus a full-precision residual of recent tokens.

- Keys (per-channel groups along time): the `nkq` oldest tokens are quantized (a multiple of R =
  settings.residual); the rest, fewer than R after a step, sit exactly in `k_res`, slot j = position - nkq.
  When the residual holds R tokens they are quantized as one block.
- Values (per-token groups): the newest R tokens stay exact in a ring of R + 1 slots (slot = position % (R+1));
  every older token is quantized alone, at its position in `v_codes`, as it leaves the window.
- Attention always sees a step's new tokens exactly. A multi-token step with no past attends over the exact
  prompt (as KIVI does); with a past, over [dequantized quantized part ; exact residual ; new tokens] with the
  causal mask; it stores as it goes.
- Decode (static shapes for a graph; `nkq` is also a device scalar): the quantized keys of a bucket of
  `kb` >= nkq positions (those past nkq masked) weight the values quantized before the window and the ring's
  after it (`quant_decode_attention`: one op, one kernel); the R residual slots weight their values from the
  ring; the two parts merge by their logsumexps (one softmax over both). The token leaving the value window
  still counts exactly in this step (the ring's extra slot holds it) and is quantized in the same step for the
  ones after (so running the step twice gives the same state).

After storing L tokens: keys [0, nkq) quantized, [nkq, L) exact; values [0, max(0, L-R)) quantized, the rest
exact. Buffers are preallocated; `truncate` goes to 0 or back by what is still exact (see there).
"""
from __future__ import annotations

import math

import torch

from tailorkv.engine.cache import LayerCache, LayerSpec
from tailorkv.engine.settings import MethodSettings, quant_shape_error
from tailorkv.engine.step import bucket_for
from tailorkv.ops.attention import causal_attention, softmax_scale
from tailorkv.ops.quant import codes_per_word, dequantize_keys, dequantize_values, quantize_keys, quantize_values
from tailorkv.ops.quant_attention import quant_decode_attention

STORE_CHUNK = 16384  # prompt tokens quantized at a time


class QuantCache(LayerCache):
    name = "quant"
    graph_safe = True

    def __init__(self, spec: LayerSpec, settings: MethodSettings):
        super().__init__(spec)
        self.bits, self.group, self.R = settings.bits, settings.group, settings.residual
        cpw = codes_per_word(self.bits)
        D, R = spec.head_dim, self.R
        self.vgroup = min(self.group, D)  # value groups run along head_dim
        if self.group % cpw or R < self.group or R % self.group:
            raise ValueError(f"quant cache: group ({self.group}) must be a multiple of {cpw} and residual "
                             f"({R}) a positive multiple of group")
        err = quant_shape_error(D, self.bits, self.group)
        if err:
            raise ValueError(f"quant cache: {err}")
        buffers = self.buffers(spec.batch, spec.n_kv_heads, D, spec.max_len, self.bits, self.group, R, spec.dtype)
        for name, (shape, dtype) in buffers.items():
            setattr(self, name, torch.zeros(shape, dtype=dtype, device=spec.device))
        self._buffer_names = tuple(buffers)
        self.reset()

    @staticmethod
    def buffers(B: int, H: int, D: int, max_len: int, bits: int, group: int, R: int, dtype) -> dict:
        """name -> (shape, dtype) of every device buffer (the memory plan sizes a layer from them too)."""
        cpw, vgroup = codes_per_word(bits), min(group, D)
        nk = -(-max_len // R) * R          # key positions a decode bucket may cover
        nv = nk + R                        # value positions the decode step's probabilities cover
        f16, i32 = torch.float16, torch.int32
        return {"k_codes": ((B, H, nk // cpw, D), i32), "k_scale": ((B, H, nk // group, D), f16),
                "k_min": ((B, H, nk // group, D), f16), "v_codes": ((B, H, nv, D // cpw), i32),
                "v_scale": ((B, H, nv, D // vgroup), f16), "v_min": ((B, H, nv, D // vgroup), f16),
                "k_res": ((B, H, R, D), dtype), "v_ring": ((B, H, R + 1, D), dtype), "nkq_dev": ((), torch.long)}

    @classmethod
    def bytes_for(cls, *args) -> int:
        """device_bytes() of a layer built with buffers(*args)."""
        return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size()
                   for shape, dtype in cls.buffers(*args).values())

    def reset(self) -> None:
        super().reset()
        self.held = 0   # tokens stored
        self.nkq = 0    # quantized key tokens
        self.nkq_dev.zero_()
        self._kb = 0

    @property
    def nvq(self) -> int:
        return max(0, self.held - self.R)

    def truncate(self, length: int) -> None:
        """To 0, or back while every token kept is exact where it must be: keys not below nkq, and the window's
        values still in the ring, which holds one token past the window (a chat's stop string cut one token)."""
        if length == 0:
            self.reset()
        elif length != self.held:
            if not (self.nkq <= length < self.held and max(0, length - self.R) >= max(0, self.held - self.R - 1)):
                raise RuntimeError("the quant cache cannot be truncated there (quantized tokens cannot be "
                                   "un-stored); start a new chat (/reset)")
            self.held = length

    # --- views of what is held -------------------------------------------------------------------------
    def _ring_slots(self, lo: int, hi: int) -> torch.Tensor:
        return torch.arange(lo, hi, device=self.spec.device) % (self.R + 1)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All held tokens as the policy sees them: K, V [B, Hkv, held, D] in spec.dtype."""
        dt, cpw, g, n = self.spec.dtype, codes_per_word(self.bits), self.group, self.nkq
        k = dequantize_keys(self.k_codes[:, :, :n // cpw], self.k_scale[:, :, :n // g], self.k_min[:, :, :n // g],
                            self.bits, self.group, dt)
        m = self.nvq
        v = dequantize_values(self.v_codes[:, :, :m], self.v_scale[:, :, :m], self.v_min[:, :, :m], self.bits,
                              self.vgroup, dt)
        window = self.v_ring.index_select(2, self._ring_slots(m, self.held))
        return torch.cat([k, self.k_res[:, :, :self.held - n]], 2), torch.cat([v, window], 2)

    # --- one step -----------------------------------------------------------------------------------------
    def plan(self, step):
        self.last = {"tokens_attended": step.end}
        if not step.decode:
            return None
        self._kb = bucket_for(self.nkq, self.k_codes.shape[2] * codes_per_word(self.bits)) if self.nkq else 0
        return self._kb

    def run(self, q, k, v, step):
        if step.decode:
            return self._decode(q, k, v, step.positions)
        if self.held == 0:
            out = causal_attention(q, k, v, 0, into_q=True)  # prefill: exact prompt K/V
        else:
            kp, vp = self.dequantized()
            out = causal_attention(q, torch.cat([kp, k], 2), torch.cat([vp, v], 2), step.start)
        self._store_values(v, step.start)
        self._store_keys(k)
        self.held = step.end
        return out

    def commit(self, step) -> None:
        if not step.decode:
            return
        self.held += 1
        if self.held - self.nkq == self.R:
            self._flush_keys(self.k_res)

    def _decode(self, q, k, v, p):
        B, Hq, _, D = q.shape
        H, R, G, dev = self.spec.n_kv_heads, self.R, Hq // self.spec.n_kv_heads, q.device
        sm = softmax_scale(D)
        # store: the key joins the residual; the value leaving the window (position p - R) is quantized
        j = p - self.nkq_dev
        self.k_res.index_copy_(2, j, k)
        leaving = self.v_ring.index_select(2, (p + 1) % (R + 1))
        self._put_values(quantize_values(leaving, self.bits, self.vgroup), (p - R).clamp_min(0))
        self.v_ring.index_copy_(2, p % (R + 1), v)
        # the residual keys (positions nkq + i, exact) with their values from the ring, as one softmax part
        slots = self.nkq_dev + torch.arange(R, device=dev)
        s_res = (q.float().reshape(B, H, G, D) @ self.k_res.float().transpose(-1, -2) * sm).reshape(B, Hq, 1, R)
        s_res = s_res.masked_fill(torch.arange(R, device=dev) > j, float("-inf"))
        lse = torch.logsumexp(s_res, -1, keepdim=True)
        v_res = self.v_ring.index_select(2, slots % (R + 1)).float()
        out = (torch.exp(s_res - lse).reshape(B, H, G, R) @ v_res).reshape(B, Hq, 1, D)
        kb = self._kb
        if kb:  # the quantized keys of the bucket (values quantized before p - R, the ring's after): merged by lse
            cpw, g = codes_per_word(self.bits), self.group
            o_q, lse_q = quant_decode_attention(
                q, self.k_codes[:, :, :kb // cpw], self.k_scale[:, :, :kb // g], self.k_min[:, :, :kb // g],
                self.v_codes, self.v_scale, self.v_min, self.v_ring, self.nkq_dev, p, self.bits, self.group,
                self.vgroup, sm)
            top = torch.maximum(lse, lse_q.unsqueeze(-1))
            w_r, w_q = torch.exp(lse - top), torch.exp(lse_q.unsqueeze(-1) - top)
            out = (out * w_r + o_q * w_q) / (w_r + w_q)
        return out.to(q.dtype)

    # --- storing ------------------------------------------------------------------------------------------
    def _flush_keys(self, block: torch.Tensor) -> None:
        """Quantize `block` [B, H, n, D] (n a multiple of R) onto the end of the quantized keys."""
        n = block.shape[2]
        cpw = codes_per_word(self.bits)
        codes, scale, mn = quantize_keys(block, self.bits, self.group)
        a, g = self.nkq, self.group
        self.k_codes[:, :, a // cpw:(a + n) // cpw] = codes
        self.k_scale[:, :, a // g:(a + n) // g] = scale
        self.k_min[:, :, a // g:(a + n) // g] = mn
        self.nkq += n
        self.nkq_dev.fill_(self.nkq)

    def _store_keys(self, k: torch.Tensor) -> None:
        res = self.held - self.nkq
        allk = torch.cat([self.k_res[:, :, :res], k], 2) if res else k
        nflush = allk.shape[2] // self.R * self.R
        whole = math.lcm(self.R, self.group)  # a part is whole residual blocks and whole groups
        part = max(1, STORE_CHUNK // whole) * whole
        for s in range(0, nflush, part):  # a long prompt in parts (whole groups): bounded fp32 temporaries
            self._flush_keys(allk[:, :, s:min(nflush, s + part)])
        self.k_res[:, :, :allk.shape[2] - nflush] = allk[:, :, nflush:]

    def _put_values(self, quantized, at: torch.Tensor) -> None:
        for dst, src in zip((self.v_codes, self.v_scale, self.v_min), quantized):
            dst.index_copy_(2, at, src)

    def _store_values(self, v: torch.Tensor, start: int) -> None:
        """Quantize the values that leave the window in this multi-token step; the ring takes the newest."""
        end = start + v.shape[2]
        lo, hi = self.nvq, max(0, end - self.R)
        if hi > lo:  # values are quantized per token: the ring's leaving tokens, then the new ones in parts
            old = self.v_ring.index_select(2, self._ring_slots(lo, min(start, hi)))
            if old.shape[2]:
                self._put_values(quantize_values(old, self.bits, self.vgroup),
                                 torch.arange(lo, lo + old.shape[2], device=v.device))
            for s in range(max(lo, start), hi, STORE_CHUNK):
                e = min(hi, s + STORE_CHUNK)
                self._put_values(quantize_values(v[:, :, s - start:e - start], self.bits, self.vgroup),
                                 torch.arange(s, e, device=v.device))
        first = max(start, end - self.R - 1)
        self.v_ring.index_copy_(2, self._ring_slots(first, end), v[:, :, first - start:])

    # --- accounting ---------------------------------------------------------------------------------------
    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in self._buffer_names))

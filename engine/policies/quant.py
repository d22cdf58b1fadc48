"""`quant`: TailorKV's quantization-friendly layers. The whole KV stays on the device at 1 or 2 bits
(KIVI-style, layouts in ops/quant.py) plus a full-precision residual of recent tokens.

- Keys (per-channel groups along time) keep a residual of fewer than R = settings.residual tokens; when it
  reaches R, the R tokens are quantized as one block (a multiple of `group`) and the residual empties.
- Values (per-token groups) keep the newest R tokens exact as a sliding window; each older token is
  quantized alone as it leaves the window.
- Attention always sees a step's new tokens exactly: storing (flush/evict) happens after the attention.
  Prefill with no past attends over the exact prompt (as KIVI does); a multi-token turn with a past attends
  over [dequantized quantized part ; exact residual ; new tokens] with the causal mask.
- Decode (one token): scores = [qk_quant over packed keys ; q.K_res], one fp32 softmax,
  output = av_quant over packed values + probs_res . V_res.

So after storing L tokens: keys [0, L//R*R) quantized, the rest exact; values [0, max(0, L-R)) quantized,
the rest exact. All buffers are preallocated to spec.max_len. `truncate` only supports a no-op or 0.
"""
from __future__ import annotations

import torch

from tailorkv.engine.cache import LayerCache, LayerSpec
from tailorkv.engine.settings import MethodSettings
from tailorkv.ops.attention import causal_attention, softmax_scale
from tailorkv.ops.quant import codes_per_word, dequantize_keys, dequantize_values, quantize_keys, quantize_values
from tailorkv.ops.quant_attention import av_quant, qk_quant


class QuantCache(LayerCache):
    name = "quant"

    def __init__(self, spec: LayerSpec, settings: MethodSettings):
        super().__init__(spec)
        self.bits, self.group, self.R = settings.bits, settings.group, settings.residual
        cpw = codes_per_word(self.bits)
        D = spec.head_dim
        self.vgroup = min(self.group, D)  # value groups run along head_dim
        if self.group % cpw or self.R < self.group or self.R % self.group:
            raise ValueError(f"quant cache: group ({self.group}) must be a multiple of {cpw} and residual "
                             f"({self.R}) a positive multiple of group")
        if D % self.vgroup or D % cpw:
            raise ValueError(f"quant cache: head_dim {D} must be a multiple of {self.vgroup} and {cpw}")
        B, H, dev = spec.batch, spec.n_kv_heads, spec.device
        nk = spec.max_len // self.R * self.R       # most key tokens ever quantized
        nv = max(0, spec.max_len - self.R)         # most value tokens ever quantized
        f16, i32 = torch.float16, torch.int32
        self.k_codes = torch.zeros(B, H, nk // cpw, D, dtype=i32, device=dev)
        self.k_scale = torch.zeros(B, H, nk // self.group, D, dtype=f16, device=dev)
        self.k_min = torch.zeros_like(self.k_scale)
        self.v_codes = torch.zeros(B, H, nv, D // cpw, dtype=i32, device=dev)
        self.v_scale = torch.zeros(B, H, nv, D // self.vgroup, dtype=f16, device=dev)
        self.v_min = torch.zeros_like(self.v_scale)
        self.k_res = torch.zeros(B, H, self.R, D, dtype=spec.dtype, device=dev)
        self.v_res = torch.zeros(B, H, 2 * self.R, D, dtype=spec.dtype, device=dev)  # window at [v0, v0+nvr)
        self.reset()

    def reset(self) -> None:
        self.length = 0
        self.nkq = 0   # quantized key tokens
        self.nkr = 0   # exact key tokens in k_res
        self.nvq = 0   # quantized value tokens
        self.v0 = 0    # start of the value window in v_res
        self.nvr = 0   # exact value tokens in the window

    def truncate(self, length: int) -> None:
        if length == 0:
            self.reset()
        elif length != self.length:
            raise RuntimeError("the quant cache cannot be truncated (quantized tokens cannot be un-stored); "
                               "start a new chat (/reset)")

    # --- views of what is held -------------------------------------------------------------------------
    def _keys_q(self):
        cpw = codes_per_word(self.bits)
        n, g = self.nkq, self.group
        return self.k_codes[:, :, :n // cpw], self.k_scale[:, :, :n // g], self.k_min[:, :, :n // g]

    def _values_q(self):
        n = self.nvq
        return self.v_codes[:, :, :n], self.v_scale[:, :, :n], self.v_min[:, :, :n]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All held tokens as the policy sees them: K, V [B, Hkv, length, D] in spec.dtype."""
        dt = self.spec.dtype
        k = torch.cat([dequantize_keys(*self._keys_q(), self.bits, self.group, dt), self.k_res[:, :, :self.nkr]], 2)
        v = torch.cat([dequantize_values(*self._values_q(), self.bits, self.vgroup, dt),
                       self.v_res[:, :, self.v0:self.v0 + self.nvr]], 2)
        return k, v

    # --- attention ----------------------------------------------------------------------------------------
    def attend(self, q, k, v, start_pos):
        T = k.shape[2]
        self.admit(start_pos, T)
        if T == 1:
            out = self._decode(q, k, v)
        else:
            if self.length == 0:
                out = causal_attention(q, k, v, 0)  # prefill: exact prompt K/V
            else:
                kp, vp = self.dequantized()
                out = causal_attention(q, torch.cat([kp, k], 2), torch.cat([vp, v], 2), start_pos)
            self._store_keys(k)
            self._store_values(v)
        self.length = start_pos + T
        return out

    def _decode(self, q, k, v):
        B, Hq, _, D = q.shape
        H = self.spec.n_kv_heads
        sm = softmax_scale(D)
        self.k_res[:, :, self.nkr:self.nkr + 1] = k
        self.nkr += 1
        self._append_value_window(v)
        kr = self.k_res[:, :, :self.nkr]
        vr = self.v_res[:, :, self.v0:self.v0 + self.nvr]
        qg = q.float().reshape(B, H, Hq // H, D)
        s_res = (qg @ kr.float().transpose(-1, -2) * sm).reshape(B, Hq, 1, self.nkr)
        if self.nkq:
            s_q = qk_quant(q, *self._keys_q(), self.bits, self.group, sm_scale=sm)
            scores = torch.cat([s_q, s_res], -1)
        else:
            scores = s_res
        probs = torch.softmax(scores, -1)
        p_res = probs[..., self.nvq:].reshape(B, H, Hq // H, self.nvr)
        out = (p_res @ vr.float()).reshape(B, Hq, 1, D)
        if self.nvq:
            out = out + av_quant(probs[..., :self.nvq].contiguous(), *self._values_q(), self.bits, self.vgroup)
        # store: flush a full key residual, move values beyond the window into the quantized part
        if self.nkr == self.R:
            self._flush_keys(self.k_res)
            self.nkr = 0
        self._evict_values()
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

    def _store_keys(self, k: torch.Tensor) -> None:
        allk = torch.cat([self.k_res[:, :, :self.nkr], k], 2)
        nflush = allk.shape[2] // self.R * self.R
        if nflush:
            self._flush_keys(allk[:, :, :nflush])
        tail = allk.shape[2] - nflush
        self.k_res[:, :, :tail] = allk[:, :, nflush:]
        self.nkr = tail

    def _quantize_values(self, block: torch.Tensor) -> None:
        n = block.shape[2]
        codes, scale, mn = quantize_values(block, self.bits, self.vgroup)
        a = self.nvq
        self.v_codes[:, :, a:a + n] = codes
        self.v_scale[:, :, a:a + n] = scale
        self.v_min[:, :, a:a + n] = mn
        self.nvq += n

    def _append_value_window(self, v: torch.Tensor) -> None:
        """Append one token to the exact value window (the window may briefly hold R + 1 tokens)."""
        if self.v0 + self.nvr == self.v_res.shape[2]:  # at the end of the buffer: move the window to 0
            self.v_res[:, :, :self.nvr] = self.v_res[:, :, self.v0:self.v0 + self.nvr].clone()
            self.v0 = 0
        self.v_res[:, :, self.v0 + self.nvr:self.v0 + self.nvr + 1] = v
        self.nvr += 1

    def _evict_values(self) -> None:
        extra = self.nvr - self.R
        if extra > 0:
            self._quantize_values(self.v_res[:, :, self.v0:self.v0 + extra])
            self.v0 += extra
            self.nvr -= extra

    def _store_values(self, v: torch.Tensor) -> None:
        allv = torch.cat([self.v_res[:, :, self.v0:self.v0 + self.nvr], v], 2)
        extra = max(0, allv.shape[2] - self.R)
        if extra:
            self._quantize_values(allv[:, :, :extra])
        keep = allv.shape[2] - extra
        self.v_res[:, :, :keep] = allv[:, :, extra:]
        self.v0, self.nvr = 0, keep

    # --- accounting ---------------------------------------------------------------------------------------
    def device_bytes(self) -> int:
        bufs = (self.k_codes, self.k_scale, self.k_min, self.v_codes, self.v_scale, self.v_min, self.k_res, self.v_res)
        return sum(t.numel() * t.element_size() for t in bufs)

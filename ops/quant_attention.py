"""Decode-time attention over packed 1/2-bit KV (layouts in ops/quant.py), GQA without repeat_kv.

Query head h reads KV head h // (Hq // Hkv): q is viewed as [B, Hkv, group, D], so each KV head's packed data
is read once for its whole query group. The torch references dequantize a chunk of tokens at a time (bounded
memory) and multiply in fp32; the fused CUDA kernels (ops/qk_quant_cuda.py, ops/av_quant_cuda.py) replace them
through the dispatch rule.
"""
from __future__ import annotations

import torch

from tailorkv.ops import av_quant_cuda, qk_quant_cuda
from tailorkv.ops.dispatch import op, register_kernel
from tailorkv.ops.quant import codes_per_word, dequantize_keys, dequantize_values

CHUNK = 8192  # tokens dequantized at once by the references (a multiple of every group size in use)


@op("qk_quant")
def qk_quant(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_min: torch.Tensor,
             bits: int = 1, group: int = 64, sm_scale: float = 1.0) -> torch.Tensor:
    """q [B, Hq, 1, D]; k_codes [B, Hkv, T/CPW, D] int32; k_scale, k_min [B, Hkv, T/group, D] fp16
    -> scores [B, Hq, 1, T] fp32 = sm_scale * q . dequant(K)^T."""
    B, Hq, _, D = q.shape
    Hkv = k_codes.shape[1]
    cpw = codes_per_word(bits)
    T = k_codes.shape[2] * cpw
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D) * sm_scale
    out = torch.empty(B, Hkv, Hq // Hkv, T, dtype=torch.float32, device=q.device)
    for s in range(0, T, CHUNK):
        e = min(T, s + CHUNK)
        k = dequantize_keys(k_codes[:, :, s // cpw:e // cpw], k_scale[:, :, s // group:e // group],
                            k_min[:, :, s // group:e // group], bits, group)
        out[..., s:e] = qg @ k.transpose(-1, -2)
    return out.reshape(B, Hq, 1, T)


@op("av_quant")
def av_quant(probs: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor, v_min: torch.Tensor,
             bits: int = 1, group: int = 64) -> torch.Tensor:
    """probs [B, Hq, 1, T]; v_codes [B, Hkv, T, D/CPW] int32; v_scale, v_min [B, Hkv, T, D/group] fp16
    -> [B, Hq, 1, D] fp32 = probs @ dequant(V)."""
    B, Hq, _, T = probs.shape
    Hkv = v_codes.shape[1]
    D = v_codes.shape[3] * codes_per_word(bits)
    pg = probs.float().reshape(B, Hkv, Hq // Hkv, T)
    out = torch.zeros(B, Hkv, Hq // Hkv, D, dtype=torch.float32, device=probs.device)
    for s in range(0, T, CHUNK):
        e = min(T, s + CHUNK)
        v = dequantize_values(v_codes[:, :, s:e], v_scale[:, :, s:e], v_min[:, :, s:e], bits, group)
        out += pg[..., s:e] @ v
    return out.reshape(B, Hq, 1, D)


register_kernel("qk_quant", lambda: qk_quant_cuda.load(qk_quant.reference))
register_kernel("av_quant", lambda: av_quant_cuda.load(av_quant.reference))

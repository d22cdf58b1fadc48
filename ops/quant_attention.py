"""Decode-time attention over packed 1/2-bit KV (layouts in ops/quant.py), GQA without repeat_kv.

Query head h reads KV head h // (Hq // Hkv): q is viewed as [B, Hkv, group, D], so each KV head's packed data
is read once for its whole query group. The torch references dequantize a chunk of tokens at a time (bounded
memory) and multiply in fp32; the CUDA kernels (ops/qk_quant_cuda.py, ops/av_quant_cuda.py,
ops/quant_decode_cuda.py) replace them through the dispatch rule. `quant_decode_attention` is the whole decode
attention of a quantized layer's packed part (scores, softmax, values) in one op: its reference composes qk_quant
and av_quant; its kernel reads the packed bytes once, with no [Hq, T] scores in memory.
"""
from __future__ import annotations

import torch

from tailorkv.ops import av_quant_cuda, qk_quant_cuda, quant_decode_cuda
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


@op("quant_decode_attention")
def quant_decode_attention(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_min: torch.Tensor,
                           v_codes: torch.Tensor, v_scale: torch.Tensor, v_min: torch.Tensor, v_ring: torch.Tensor,
                           nk: torch.Tensor, p: torch.Tensor, bits: int = 1, group: int = 64, vgroup: int = 64,
                           sm_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query over the quantized keys of a bucket, positions [0, nk) (nk a device scalar, at most the
    T = k_codes.shape[2] * CPW positions the bucket covers): values quantized before p - R (v_codes, at least T
    rows), exact from there on in the ring v_ring [B, Hkv, R + 1, D] (slot = position % (R + 1)).
    -> (o [B, Hq, 1, D] fp32, the softmax-weighted values over those positions; lse [B, Hq, 1] fp32, the
    logsumexp of their scores), so a caller merges further parts (a residual) exactly; nk = 0: o = 0, lse = -inf."""
    B, Hq, _, D = q.shape
    Hkv, R1 = k_codes.shape[1], v_ring.shape[2]
    T = k_codes.shape[2] * codes_per_word(bits)
    dev = q.device
    t = torch.arange(T, device=dev)
    s = qk_quant(q, k_codes, k_scale, k_min, bits, group, sm_scale).masked_fill(t >= nk, float("-inf"))
    lse = torch.logsumexp(s, -1)
    probs = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # nk = 0: every score -inf, lse -inf
    vq = (p - (R1 - 1)).clamp_min(0)                             # positions before it: quantized values
    o = av_quant(probs * (t < vq), v_codes[:, :, :T], v_scale[:, :, :T], v_min[:, :, :T], bits, vgroup)
    held = p - (p - torch.arange(R1, device=dev)) % R1           # the position ring slot i holds (p - R .. p)
    w = probs.gather(3, held.clamp(0, T - 1).expand(B, Hq, 1, R1)) * ((held >= vq) & (held < nk))
    o = o + (w.reshape(B, Hkv, Hq // Hkv, R1) @ v_ring.float()).reshape(B, Hq, 1, D)
    return o, lse


register_kernel("qk_quant", lambda: qk_quant_cuda.load(qk_quant.fallback))
register_kernel("quant_decode_attention", lambda: quant_decode_cuda.load(quant_decode_attention.fallback))
register_kernel("av_quant", lambda: av_quant_cuda.load(av_quant.fallback))

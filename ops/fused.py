"""Fused elementwise ops of a decode step (and fine for prefill): RMSNorm, residual add + RMSNorm, RoPE on q and k
together, SiLU(gate) * up. Each torch reference below is the math of models/llama.py and models/rope.py, step for
step (the CPU tests check they agree bit for bit); the CUDA kernels (ops/fused_cuda.py) do the same in one launch.

In place, by design (no copies in a step): add_rms_norm updates `residual`, rope_ rotates q and k."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tailorkv.ops import fused_cuda
from tailorkv.ops.dispatch import op, register_kernel


@op("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), the norm in fp32 (models.llama.RMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@op("add_rms_norm")
def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """residual += x (in place, in residual's dtype, as `h = h + x`), then -> (rms_norm(residual), residual).
    One launch for the block's `h = h + attn; y = norm(h)` and for `h = h + mlp; next layer's x = norm(h)`."""
    residual.add_(x)
    return rms_norm.reference(residual, weight, eps), residual


@op("rope")
def rope_(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor):
    """Rotates q [B, Hq, T, D] and k [B, Hkv, T, D] (or None: q alone) in place (any strides; views of one qkv
    buffer are fine) for absolute positions [T] (int64, on the device), inv_freq [D/2] fp32 as
    models.rope.inv_frequencies makes it. Rotate-half layout; angle = position * inv_freq in fp32, cos/sin in fp32
    cast to the activation dtype, then out = (x * cos) -/+ rotate_half(x) * sin rounded as models.rope.Rope
    rounds it. Returns (q, k)."""
    ang = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    for x in (q,) if k is None else (q, k):
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        half = x.shape[-1] // 2
        out = x * c
        out[..., :half].addcmul_(x[..., half:], s[:, :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], s[:, half:])
        x.copy_(out)
    return q, k


@op("silu_mul")
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in the input dtype. gate and up may be the two halves of one fused gate/up projection's
    output (see silu_mul_halves): views whose rows have one stride are fine."""
    return F.silu(gate) * up


def silu_mul_halves(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * hidden] = cat(gate, up) along the last dim (a fused gate/up projection) -> [..., hidden]."""
    hidden = gate_up.shape[-1] // 2
    return silu_mul(gate_up[..., :hidden], gate_up[..., hidden:])


register_kernel("rms_norm", lambda: fused_cuda.load_rms_norm(rms_norm.fallback, add=False))
register_kernel("add_rms_norm", lambda: fused_cuda.load_rms_norm(add_rms_norm.fallback, add=True))
register_kernel("rope", lambda: fused_cuda.load_rope(rope_.fallback))
register_kernel("silu_mul", lambda: fused_cuda.load_silu_mul(silu_mul.fallback))

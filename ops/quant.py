"""KIVI-style asymmetric min-max quantization at 1, 2 or 4 bits (torch references; the attention kernels of
ops/quant_attention.py take 1 and 2 bits, qk_quant and sketch_scores also 4).

Keys are quantized per channel: groups of `group` tokens along time, one fp16 scale and min per
(head, token-group, channel). Values are quantized per token: groups of `group` channels along head_dim,
one fp16 scale and min per (head, token, channel-group), so any single token can be quantized alone.

    x ~= code * scale + min,   scale = (max - min) / (2^bits - 1),   code = round((x - min) / scale)

The fp16 min is rounded down and the fp16 scale up, so every element lies inside the representable range
and the error bound |x - dequant(x)| <= scale / 2 holds for the stored (fp16) scale. A group whose range is
zero stores scale 0 and codes 0 (dequantizes to its min exactly).

Packing: codes go LSB-first into int32 words, CPW = 32 // bits codes per word; code j of a word sits at bits
[j*bits, (j+1)*bits). Layouts ([B, H, T, D] inputs, T tokens, D = head_dim):

    keys    codes [B, H, T/CPW, D]   int32   packed along TIME: word (w, d) holds channel d of tokens
                                             w*CPW .. w*CPW+CPW-1. One row w is D contiguous words that
                                             cover CPW tokens, so the q.K^T GEMV reads contiguous rows, and
                                             appending a flushed block appends whole rows.
            scale, min [B, H, T/group, D]  fp16   (contiguous over channels, like q)
    values  codes [B, H, T, D/CPW]   int32   packed along CHANNELS: token t is D/CPW contiguous words, so the
                                             a.V GEMV streams token rows and one token can be appended alone.
            scale, min [B, H, T, D/group]  fp16

Requirements: keys T % group == 0 and group % CPW == 0; values D % group == 0 and D % CPW == 0 (callers use
group = min(group, head_dim) for values).

The key sketch of `--select sketch` (quantize_sketch) groups like the keys and packs like the values:

    sketch  codes [B, H, T, D/CPW]   int32   token t is D/CPW contiguous words; a word's CPW channels sit
                                             even ones in its low 16 bits, odd ones in its high 16 bits
                                             (channel 2j at bits [j*bits, ..), 2j+1 at [16 + j*bits, ..)), so
                                             one shift and one mask give a channel pair as two fp16 halves
            scale, min [B, H, ceil(T/group), D]  fp16  (as for keys; T any length)
"""
from __future__ import annotations

import torch

from tailorkv.ops.dispatch import op


def codes_per_word(bits: int) -> int:
    if bits not in (1, 2, 4):
        raise ValueError(f"bits must be 1, 2 or 4, got {bits}")
    return 32 // bits


def pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Integer codes in [0, 2^bits) -> int32 words, CPW consecutive codes along `dim` per word (LSB-first).
    The size of `dim` must be a multiple of CPW; it shrinks by CPW."""
    cpw = codes_per_word(bits)
    x = codes.movedim(dim, -1)
    n = x.shape[-1]
    if n % cpw:
        raise ValueError(f"pack: size {n} along dim {dim} is not a multiple of {cpw}")
    x = x.reshape(*x.shape[:-1], n // cpw, cpw).to(torch.int32)
    shifts = torch.arange(cpw, device=codes.device, dtype=torch.int32) * bits
    # disjoint bit fields: the int32 sum equals the bitwise OR (bit 31 wraps to the sign, as intended)
    words = (x << shifts).sum(-1, dtype=torch.int32)
    return words.movedim(-1, dim).contiguous()


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack`: int32 words -> uint8 codes, `dim` grows by CPW."""
    cpw = codes_per_word(bits)
    x = words.movedim(dim, -1)
    shifts = torch.arange(cpw, device=words.device, dtype=torch.int32) * bits
    codes = (x.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(*x.shape[:-1], x.shape[-1] * cpw).to(torch.uint8)
    return codes.movedim(-1, dim).contiguous()


def _minmax_params(mn: torch.Tensor, mx: torch.Tensor, bits: int):
    """fp32 group min/max -> fp16 (scale, min) with min rounded down and scale rounded up."""
    levels = (1 << bits) - 1
    mn16 = mn.to(torch.float16)
    mn16 = torch.where(mn16.float() > mn, torch.nextafter(mn16, torch.full_like(mn16, float("-inf"))), mn16)
    scale = (mx - mn16.float()) / levels
    sc16 = scale.to(torch.float16)
    sc16 = torch.where(sc16.float() < scale, torch.nextafter(sc16, torch.full_like(sc16, float("inf"))), sc16)
    return sc16, mn16


def _codes(x: torch.Tensor, scale16: torch.Tensor, min16: torch.Tensor, bits: int) -> torch.Tensor:
    """x, scale16, min16 broadcastable; nearest code, clamped; zero-range groups get code 0."""
    s = scale16.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    c = torch.round((x - min16.float()) / safe).clamp_(0, (1 << bits) - 1)
    return torch.where(s > 0, c, torch.zeros_like(c)).to(torch.uint8)


def _quantize_along(x: torch.Tensor, axis: int, bits: int):
    """fp32 x grouped so that `axis` runs over one group -> (codes like x, scale, min without `axis`)."""
    scale, mn = _minmax_params(x.amin(axis), x.amax(axis), bits)
    return _codes(x, scale.unsqueeze(axis), mn.unsqueeze(axis), bits), scale, mn


def _dequantize_along(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, axis: int) -> torch.Tensor:
    """Inverse of _quantize_along -> fp32 like codes."""
    return codes.float() * scale.float().unsqueeze(axis) + mn.float().unsqueeze(axis)


@op("quantize_keys")
def quantize_keys(k: torch.Tensor, bits: int = 1, group: int = 64):
    """k [B, H, T, D], T % group == 0 -> (codes [B, H, T/CPW, D] int32, scale [B, H, T/group, D] fp16,
    min [B, H, T/group, D] fp16). Per-channel groups of `group` tokens."""
    B, H, T, D = k.shape
    cpw = codes_per_word(bits)
    if T % group or group % cpw:
        raise ValueError(f"quantize_keys: T={T} must be a multiple of group={group} (itself a multiple of {cpw})")
    codes, scale, mn = _quantize_along(k.float().reshape(B, H, T // group, group, D), 3, bits)
    return pack(codes.reshape(B, H, T, D), bits, dim=2), scale, mn


@op("dequantize_keys")
def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int = 1, group: int = 64,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_keys -> [B, H, T, D] in `dtype` (T = codes.shape[2] * CPW)."""
    c = unpack(codes, bits, dim=2)
    B, H, T, D = c.shape
    x = _dequantize_along(c.reshape(B, H, T // group, group, D), scale, mn, 3)
    return x.reshape(B, H, T, D).to(dtype)


@op("quantize_values")
def quantize_values(v: torch.Tensor, bits: int = 1, group: int = 64):
    """v [B, H, T, D], D % group == 0 -> (codes [B, H, T, D/CPW] int32, scale [B, H, T, D/group] fp16,
    min [B, H, T, D/group] fp16). Per-token groups of `group` channels."""
    B, H, T, D = v.shape
    if D % group:
        raise ValueError(f"quantize_values: head_dim {D} must be a multiple of group={group}")
    codes, scale, mn = _quantize_along(v.float().reshape(B, H, T, D // group, group), 4, bits)
    return pack(codes.reshape(B, H, T, D), bits, dim=3), scale, mn


@op("dequantize_values")
def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int = 1, group: int = 64,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_values -> [B, H, T, D] in `dtype` (D = codes.shape[3] * CPW)."""
    c = unpack(codes, bits, dim=3)
    B, H, T, D = c.shape
    x = _dequantize_along(c.reshape(B, H, T, D // group, group), scale, mn, 4)
    return x.reshape(B, H, T, D).to(dtype)


def _sketch_order(bits: int, d: int, device) -> torch.Tensor:
    """Channel at each packing slot of a sketch token: per word of CPW channels, the even ones, then the odd
    (built on `device` with device ops, so a CUDA graph can capture it)."""
    cpw = codes_per_word(bits)
    i = torch.arange(d, device=device)
    p, half = i % cpw, cpw // 2
    return i - p + torch.where(p < half, 2 * p, 2 * (p - half) + 1)


@op("quantize_sketch")
def quantize_sketch(k: torch.Tensor, bits: int = 2, group: int = 64):
    """k [B, H, T, D], T % group == 0 -> (codes [B, H, T, D/CPW] int32 in the sketch's packing, scale and min
    [B, H, T/group, D] fp16): quantize_keys' groups and values, packed per token."""
    B, H, T, D = k.shape
    if T % group or D % codes_per_word(bits):
        raise ValueError(f"quantize_sketch: T={T} must be a multiple of group={group}, D={D} of {codes_per_word(bits)}")
    codes, scale, mn = _quantize_along(k.float().reshape(B, H, T // group, group, D), 3, bits)
    codes = codes.reshape(B, H, T, D)[..., _sketch_order(bits, D, k.device)]
    return pack(codes, bits, dim=3), scale, mn


@op("dequantize_sketch")
def dequantize_sketch(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int = 2, group: int = 64,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_sketch -> [B, H, T, D] in `dtype`, T = codes.shape[2] tokens (any T: the last
    group may be partial; scale and min need ceil(T / group) rows)."""
    packed = unpack(codes, bits, dim=3)
    c = torch.empty_like(packed)
    c[..., _sketch_order(bits, packed.shape[3], codes.device)] = packed
    T = c.shape[2]
    sc = scale.float().repeat_interleave(group, 2)[:, :, :T]
    return (c.float() * sc + mn.float().repeat_interleave(group, 2)[:, :, :T]).to(dtype)

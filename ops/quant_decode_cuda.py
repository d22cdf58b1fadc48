"""CUDA kernels for quant_decode_attention: the CUDA C is ops/quant_decode.cu (how it works is written there);
here the support check, the shared-memory bound, compiling per shape and launching the two kernels."""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import aligned, compile_module, cu_source, launch, ptr, rows_contiguous
from tailorkv.ops.quant_common_cuda import C_TYPES, HELPERS

WARPS, GROUP = 4, 64
# a block's chunk is WARPS * this many tokens (whole 64-token groups); resident blocks per SM the compiler keeps
# registers for, up to 4 query heads per KV head (1 bit: 124 registers, 2 bits: 116, no spill). Measured at 128k
# (bench/quant_decode_variants.py, op time): 1 bit 256/3 44.2 us, 256/4 42.2, 512/3 41.7, 512/4 39.5, 1024/3 39.9,
# 512/5 47.1; 2 bits 256/3 51.8, 512/4 46.2, 1024/3 45.7
TOKENS_PER_WARP = 512
BLOCKS_PER_SM = {1: 4, 2: 4}
SMEM_LIMIT = 48 * 1024
P_STRIDE = 36  # words per (head, hi/lo) row of p in shared memory: 64 fp16 + 4 words of padding (bank offsets)


def stage_words(bits: int, d: int) -> int:
    """Words of one warp's stage (the CUDA source's layout): a 64-token group's key codes, key scales and mins,
    value codes, value scales and mins."""
    cpw, ngd = 32 // bits, d // min(64, d)
    return (64 // cpw) * d + d + 64 * (d // cpw) + 64 * ngd


def shared_bytes(bits: int, d: int, g: int, stages: int) -> int:
    """Static shared memory of the partial kernel: the warps' stages and rows of p (hi and lo for 4 heads per
    column tile), which later hold the warps' sums."""
    p_words = 4 * -(-g // 4) * 2 * P_STRIDE
    return 4 * (max(WARPS * (stages * stage_words(bits, d) + p_words), WARPS * g * d + 2 * WARPS * g) + WARPS)


def stages_for(bits: int, d: int, g: int) -> int:
    """cp.async stages per warp: three where they fit, else two (0: not even two)."""
    return next((s for s in (3, 2) if shared_bytes(bits, d, g, s) <= SMEM_LIMIT), 0)


def source(bits: int, d: int, g: int, s: int, qdtype: torch.dtype, vdtype: torch.dtype,
           tokens_per_warp: int = TOKENS_PER_WARP, blocks_per_sm: int = 1) -> str:
    defines = dict(BITS=bits, D=d, G=g, CT=WARPS * tokens_per_warp, S=s, STAGES=stages_for(bits, d, g),
                   WARPS=WARPS, MINB=blocks_per_sm, P_STRIDE=P_STRIDE)
    types = dict(qtype=C_TYPES[str(qdtype)], vtype=C_TYPES[str(vdtype)])
    return cu_source("quant_decode.cu", defines, types, HELPERS)


def _supported(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, v_ring, nk, p, bits, group, vgroup) -> bool:
    B, Hq, one, D = q.shape
    Hkv = k_codes.shape[1]
    if one != 1 or Hkv == 0 or Hq % Hkv or bits not in (1, 2) or group != GROUP or D not in (64, 128):
        return False
    G, T = Hq // Hkv, k_codes.shape[2] * (32 // bits)
    dev = q.device
    packed = (k_codes, k_scale, k_min, v_codes, v_scale, v_min)
    return (str(q.dtype) in C_TYPES and str(v_ring.dtype) in C_TYPES and vgroup == min(64, D) and G <= 16
            and stages_for(bits, D, G) > 0
            and q.stride(-1) == 1 and k_codes.dtype == torch.int32 and v_codes.dtype == torch.int32
            and all(t.dtype == torch.float16 for t in (k_scale, k_min, v_scale, v_min))
            and k_codes.shape[:2] == (B, Hkv) and k_codes.shape[3] == D
            and k_scale.shape[:2] == (B, Hkv) and k_scale.shape[3] == D and k_scale.shape[2] * group >= T
            and k_min.shape == k_scale.shape
            and v_codes.shape[:2] == (B, Hkv) and v_codes.shape[2] >= T and v_codes.shape[3] * (32 // bits) == D
            and v_scale.shape[:3] == v_codes.shape[:3] and v_scale.shape[3] == D // vgroup
            and v_min.shape == v_scale.shape and v_ring.shape[:2] == (B, Hkv) and v_ring.shape[3] == D
            and v_ring.stride(-1) == 1 and v_ring.stride(-2) == D
            and nk.numel() == 1 and p.numel() == 1 and nk.dtype == torch.long and p.dtype == torch.long
            and all(t.is_cuda and t.device == dev for t in packed + (v_ring, nk, p))
            and all(rows_contiguous(t, 2) and aligned(t, 16, (0, 1)) for t in packed) and T % GROUP == 0)


def load(reference):
    """reference: the torch quant_decode_attention, for the arguments the kernel does not take."""
    # fail early, on the variant Llama-3.1-8B runs (what dispatch.preload compiles before a first turn)
    mod = compile_module(source(1, 128, 4, 1, torch.bfloat16, torch.bfloat16, TOKENS_PER_WARP, BLOCKS_PER_SM[1]))
    mod.get_function("quant_attn_partial")
    mod.get_function("quant_attn_reduce")
    kernels = {}

    def quant_decode_attention(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, v_ring, nk, p, bits: int = 1,
                               group: int = 64, vgroup: int = 64, sm_scale: float = 1.0):
        """Kernel for bits 1/2, key group 64 (a bucket of whole groups), value group min(64, head_dim),
        head_dim 64/128, up to 16 query heads per KV head, q fp16/bf16/fp32, packed rows
        contiguous with 16-byte aligned heads, a ring of rows contiguous; else the torch reference."""
        if not _supported(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, v_ring, nk, p, bits, group, vgroup):
            return reference(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, v_ring, nk, p, bits, group,
                             vgroup, sm_scale)
        B, Hq, _, D = q.shape
        Hkv = k_codes.shape[1]
        G, T = Hq // Hkv, k_codes.shape[2] * (32 // bits)
        out = torch.empty(B, Hq, 1, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, Hq, 1, dtype=torch.float32, device=q.device)
        if B == 0:
            return out, lse
        s = 2 if q.dtype == torch.float32 else 1
        tpw = TOKENS_PER_WARP
        minb = BLOCKS_PER_SM.get(bits, 1) if G <= 4 else 1   # more heads: more registers
        key = (bits, D, G, s, q.dtype, v_ring.dtype, tpw, minb)
        if key not in kernels:
            mod = compile_module(source(*key))
            kernels[key] = (mod.get_function("quant_attn_partial"), mod.get_function("quant_attn_reduce"))
        partial, reduce = kernels[key]
        chunks = max(1, -(-T // (WARPS * tpw)))
        part = torch.empty(chunks, B * Hkv, G, D, dtype=torch.float32, device=q.device)
        pm = torch.empty(chunks, B * Hkv, G, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        st = lambda t: (np.int64(t.stride(0)), np.int64(t.stride(1)))  # noqa: E731 - batch and head strides
        launch(partial, (chunks, B * Hkv), (WARPS * 32,),
               (ptr(q), *st(q), ptr(k_codes), *st(k_codes), ptr(k_scale), *st(k_scale), ptr(k_min), *st(k_min),
                ptr(v_codes), *st(v_codes), ptr(v_scale), *st(v_scale), ptr(v_min), *st(v_min),
                ptr(v_ring), *st(v_ring), ptr(nk), ptr(p), np.int32(v_ring.shape[2] - 1),
                ptr(part), ptr(pm), ptr(pl), np.int32(Hkv), np.int32(T), np.float32(sm_scale)), q.device)
        launch(reduce, (B * Hq, D // 32), (256,), (ptr(part), ptr(pm), ptr(pl), ptr(out), ptr(lse), np.int32(chunks),
                                         np.int32(Hkv)), q.device)
        return out, lse

    return quant_decode_attention

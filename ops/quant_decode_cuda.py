"""CUDA kernels for quant_decode_attention: the CUDA C is ops/quant_decode.cu (how it works is written there);
here the support check, the shared-memory bound, compiling per shape and launching the two kernels."""
from __future__ import annotations

import os

import numpy as np
import torch

from tailorkv.ops.cuda_launch import aligned, compile_module, launch, ptr, rows_contiguous
from tailorkv.ops.quant_common_cuda import C_TYPES, HELPERS

WARPS, GROUP = 4, 64
SMEM_LIMIT = 48 * 1024
CU_FILE = os.path.join(os.path.dirname(__file__), "quant_decode.cu")


def _mtv(G: int) -> int:
    """MMA row tiles of the value product: rows part * G + head for the exponentials' two fp16 parts."""
    return -(-2 * G // 16)


def shared_bytes(bits: int, d: int, g: int, ct: int) -> int:
    """Static shared memory of the partial kernel (the CUDA source's layout, computed here to pick the chunk and
    to refuse what does not fit before compiling)."""
    cpw = 32 // bits
    ngd = d // min(64, d)
    stage = (ct // 64) * ((64 // cpw) * d + d) + ct * (d // cpw) + ct * ngd
    after = WARPS * g * d + 2 * g * (d + 1) + 2 * g * ngd
    return 4 * (max(stage, after) + g * ct + WARPS)


def chunk_tokens(bits: int, d: int, g: int) -> int:
    """Tokens per block: the most (512 at most) whose keys, values and scores fit the shared memory."""
    return next((ct for ct in (512, 256, 128, 64) if shared_bytes(bits, d, g, ct) <= SMEM_LIMIT), 0)


def source(bits: int, d: int, g: int, s: int, qdtype: torch.dtype, vdtype: torch.dtype) -> str:
    defines = dict(BITS=bits, D=d, G=g, CT=chunk_tokens(bits, d, g), S=s, MTV=_mtv(g), WARPS=WARPS)
    with open(CU_FILE) as f:
        body = f.read()
    return (HELPERS + "".join(f"#define {k} {v}\n" for k, v in defines.items())
            + f"typedef {C_TYPES[str(qdtype)]} qtype;\ntypedef {C_TYPES[str(vdtype)]} vtype;\n" + body)


def _supported(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, v_ring, nk, p, bits, group, vgroup) -> bool:
    B, Hq, one, D = q.shape
    Hkv = k_codes.shape[1]
    if one != 1 or Hkv == 0 or Hq % Hkv or bits not in (1, 2) or group != GROUP or D not in (64, 128):
        return False
    G, T = Hq // Hkv, k_codes.shape[2] * (32 // bits)
    dev = q.device
    packed = (k_codes, k_scale, k_min, v_codes, v_scale, v_min)
    return (str(q.dtype) in C_TYPES and str(v_ring.dtype) in C_TYPES and vgroup == min(64, D) and G <= 16
            and _mtv(G) <= (1 if D == 128 else 2) and chunk_tokens(bits, D, G) > 0
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
    mod = compile_module(source(1, 128, 4, 1, torch.bfloat16, torch.bfloat16))  # fail early
    mod.get_function("quant_attn_partial")
    mod.get_function("quant_attn_reduce")
    kernels = {}

    def quant_decode_attention(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, v_ring, nk, p, bits: int = 1,
                               group: int = 64, vgroup: int = 64, sm_scale: float = 1.0):
        """Kernel for bits 1/2, key group 64 (a bucket of whole groups), value group min(64, head_dim),
        head_dim 64/128, up to 16 query heads per KV head (8 at head_dim 128), q fp16/bf16/fp32, packed rows
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
        key = (bits, D, G, s, q.dtype, v_ring.dtype)
        if key not in kernels:
            mod = compile_module(source(*key))
            kernels[key] = (mod.get_function("quant_attn_partial"), mod.get_function("quant_attn_reduce"))
        partial, reduce = kernels[key]
        chunks = max(1, -(-T // chunk_tokens(bits, D, G)))
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

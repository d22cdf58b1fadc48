"""CUDA kernels for attend_decode (flash-decoding over a preallocated KV buffer with a device-side length); the
CUDA C is ops/attention_decode.cu, here the support check, the grid, compiling per shape and launching.

Pass 1: a grid of `splits` x (batch, KV head) blocks, `splits` fixed from the SM count so that the grid is one
wave; every block reads the length on the device and takes an equal share of the keys below it (so the whole GPU
streams K and V at any length, and slots from the length on are never read). A block's warps take interleaved
steps of 16 * NS keys; a step is two tensor-core products (mma m16n8k16, fp32 accumulation) whose operands come
straight from 16-byte loads into registers, with no shared memory:
  S = q K^T  (A = q: 16 query-head rows, G of them used; B = K^T: a lane loads key `gid` of an 8-key tile),
  O^T += V^T P^T  (A = V^T: a lane loads keys 2t, 2t+1, 2t+8, 2t+9 and pairs them with a byte permute;
                   B = P^T: the S accumulator of two 8-key tiles, as bf16 / fp16 pairs, is already B's layout).
The channels of a K row are permuted alike in q and K (a dot product does not care) so that a lane's share of a
row is whole uint4s; the output channels that V^T's rows stand for are chosen the same way. The next step's K is
loaded as soon as S is computed and its V as soon as the product with V is issued, so a warp holds a step's
K and V (8 KB per 16 keys) in flight. The warps merge in a fixed order in shared memory; pass 2 merges the splits
of each (batch, query head) in a fixed order (4 runs of splits per channel, then the runs). No atomics: the result
is deterministic.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tailorkv.ops.cuda_launch import aligned, compile_module, cu_source, launch, ptr
from tailorkv.ops.quant_common_cuda import C_TYPES

# warps: per block; keys_per_step: 16 or 32 keys a warp loads per step (G > 8 always takes 16: the second
# 8-head half of the accumulators needs the registers); blocks_per_sm: blocks resident per SM that the grid is
# sized for (one wave); min_blocks: __launch_bounds__' minimum blocks per SM (0: none; caps the registers at
# 64K / (min_blocks * warps * 32), which spills if set too high); max_splits: cap on blocks per (batch, KV head);
# load: "" for __ldg, else the cache qualifiers of an ld.global.nc.<load>.v4.u32 (one of LOADS).
CONFIG = dict(warps=2, keys_per_step=32, blocks_per_sm=4, min_blocks=0, max_splits=512, load="")  # fastest of ATTEND_VARIANTS on the H200
LOADS = ("", "L2::256B", "L1::no_allocate.L2::256B")


def _config(config=None) -> dict:
    cfg = dict(CONFIG, **(config or {}))
    if (cfg["keys_per_step"] not in (16, 32) or not 1 <= cfg["warps"] <= 32 or cfg["blocks_per_sm"] < 1
            or cfg["min_blocks"] < 0 or cfg["max_splits"] < 1 or cfg["load"] not in LOADS):
        raise ValueError(f"attend_decode config {cfg}")
    return cfg


def _steps(cfg: dict, g: int) -> int:
    return 1 if g > 8 else cfg["keys_per_step"] // 16


def source(d: int, g: int, dtype: torch.dtype, config: dict | None = None) -> str:
    cfg = _config(config)
    defines = dict(D=d, G=g, W=cfg["warps"], NS=_steps(cfg, g), MINB=cfg["min_blocks"],
                   KBF16=int(dtype == torch.bfloat16), ktype=C_TYPES[str(dtype)])
    if cfg["load"]:
        defines["LOAD"] = f'"{cfg["load"]}"'
    head = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"   # before the defines: single letters (D, G, W)
    return cu_source("attention_decode.cu", defines, head=head)


def splits_for(bh: int, n: int, g: int, sms: int, config: dict | None = None) -> int:
    """Blocks per (batch, KV head): one wave of blocks_per_sm blocks on every SM, at most one per step of keys."""
    cfg = _config(config)
    unit = 16 * _steps(cfg, g)
    return max(1, min(sms * cfg["blocks_per_sm"] // bh, cfg["max_splits"], -(-n // unit)))


def _supported(q, k, v, length) -> bool:
    B, Hq, one, D = q.shape
    Hkv = k.shape[1]
    return (one == 1 and Hkv > 0 and Hq % Hkv == 0 and Hq // Hkv <= 16 and D in (64, 128)
            and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
            and k.shape[:2] == (B, Hkv) and k.shape[3] == D and v.shape == k.shape
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and aligned(k, 16) and aligned(v, 16)
            and length.dtype == torch.int64 and length.numel() in (1, B) and length.dim() <= 1
            and all(t.is_cuda and t.device == q.device for t in (k, v, length)))


def load(reference, config: dict | None = None):
    cfg = _config(config)
    compile_module(source(128, 4, torch.bfloat16, cfg)).get_function("attend_partial")  # fail early
    kernels, sms = {}, {}

    def attend_decode(q, k, v, length, sm_scale=None):
        """Kernel for head_dim 64/128, bf16/fp16 (q, k, v alike), up to 16 query heads per KV head, unit
        channel stride and 16-byte aligned K/V rows; else the torch reference (fp32 inputs included)."""
        if not _supported(q, k, v, length):
            return reference(q, k, v, length, sm_scale)
        B, Hq, _, D = q.shape
        Hkv, N = k.shape[1], k.shape[2]
        G = Hq // Hkv
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if out.numel() == 0:
            return out
        if N == 0:
            return out.zero_()
        key = (D, G, q.dtype)
        if key not in kernels:
            mod = compile_module(source(*key, cfg))
            kernels[key] = (mod.get_function("attend_partial"), mod.get_function("attend_reduce"))
        partial, reduce = kernels[key]
        if q.device not in sms:
            sms[q.device] = torch.cuda.get_device_properties(q.device).multi_processor_count
        splits = splits_for(B * Hkv, N, G, sms[q.device], cfg)
        pm = torch.empty(splits, B * Hkv, G, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(splits, B * Hkv, G, D, dtype=torch.float32, device=q.device)
        len_stride = length.stride(0) if length.dim() == 1 and length.numel() == B else 0
        scale = (1.0 / math.sqrt(D) if sm_scale is None else sm_scale) * math.log2(math.e)
        launch(partial, (splits, B * Hkv), (cfg["warps"] * 32,),
               (ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
                ptr(k), np.int64(k.stride(0)), np.int64(k.stride(1)), np.int64(k.stride(2)),
                ptr(v), np.int64(v.stride(0)), np.int64(v.stride(1)), np.int64(v.stride(2)),
                ptr(length), np.int32(len_stride), np.int32(N), np.int32(Hkv),
                np.float32(scale), ptr(pm), ptr(pl), ptr(pacc)), q.device)
        launch(reduce, (B * Hq,), (D, 4), (ptr(pm), ptr(pl), ptr(pacc), np.int32(splits), ptr(out)), q.device)
        return out

    attend_decode.config = cfg
    return attend_decode

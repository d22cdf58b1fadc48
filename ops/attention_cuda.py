"""CUDA kernel for attend_decode (decode attention over a preallocated KV buffer with a device-side length), built
on the shared tile math of ops/attention_tiles_cuda.py (tensor-core tiles of 64 keys, fp32 softmax state, the
last block of each (batch, KV head) merges the partials: one launch).

Grid (P splits, B * Hkv) with P from the GPU's multiprocessor count (about two resident blocks per multiprocessor
over all (batch, KV head) pairs), never from the buffer size N: a CUDA graph's grid stays static while the
length moves. Each split reads ceil(length / P) keys rounded up to whole tiles, the length read on the device:
splits past the length exit at once, so a short length in a long buffer costs what the length costs. A 3-stage
cp.async pipeline keeps two tiles (64 KiB at D = 128) in flight per block while the third is computed.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tailorkv.ops import attention_tiles_cuda as tiles
from tailorkv.ops.attention_tiles_cuda import COUNTERS, TILE, WARPS, Kernels, merge_floats, tile_bytes
from tailorkv.ops.cuda_launch import aligned, launch, ptr

STAGES = 3
MAX_SPLITS = 128            # splits per (batch, KV head)
BLOCKS_PER_SM = 2           # blocks resident per multiprocessor (shared memory allows 2 at D = 128)

_KERNEL = r"""
#define STAGES {stages}
// K and V rows key0 .. key0 + TILE - 1 (those below `end`; the rest zero-filled, never read) -> swizzled tiles
__device__ __forceinline__ void load_tile(ktype* Ks, ktype* Vs, const ktype* kb, long long ksn, const ktype* vb,
                                          long long vsn, int key0, int end) {{
    #pragma unroll
    for (int it = 0; it < TILE * CH / (WARPS * 32); ++it) {{
        const int c = threadIdx.x + it * WARPS * 32, row = c / CH, ch = c % CH;
        const bool ok = key0 + row < end;
        const long long key = ok ? key0 + row : key0;   // a readable address when nothing is copied
        cp_async16(Ks + swz(row, ch), kb + key * ksn + ch * 8, ok ? 16u : 0u);
        cp_async16(Vs + swz(row, ch), vb + key * vsn + ch * 8, ok ? 16u : 0u);
    }}
}}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 2) attend_decode_kernel(
        const ktype* __restrict__ q, const long long qsb, const long long qsh,
        const ktype* __restrict__ k, const long long ksb, const long long ksh, const long long ksn,
        const ktype* __restrict__ v, const long long vsb, const long long vsh, const long long vsn,
        const long long* __restrict__ length, const int len_stride, const int N, const int Hkv,
        const float scale_log2, float* __restrict__ part, int* __restrict__ counter, ktype* __restrict__ out) {{
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ __align__(16) ktype ps[WARPS][GP][PST];
    ktype* stage = reinterpret_cast<ktype*>(smem);      // STAGES x (K tile, V tile)
    const int bh = blockIdx.y, b = bh / Hkv, kvh = bh % Hkv, P = gridDim.x, split = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long L = length[(long long)b * len_stride];
    const int len = (int)(L < 0 ? 0 : (L > N ? N : L));
    if (len == 0) {{                                     // no keys: zeros, from split 0 alone
        if (split == 0)
            for (int i = threadIdx.x; i < G * D; i += WARPS * 32) out[(long long)bh * G * D + i] = TO_K(0.f);
        return;
    }}
    const int per = ((len + P - 1) / P + TILE - 1) / TILE * TILE;
    const int active = (len + per - 1) / per, c0 = split * per;
    if (c0 >= len) return;                              // past the length: no ticket either
    const int c1 = min(c0 + per, len), ntiles = (c1 - c0 + TILE - 1) / TILE;

    const ktype* kb = k + b * ksb + kvh * ksh;
    const ktype* vb = v + b * vsb + kvh * vsh;
    #pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {{
        if (s < ntiles) load_tile(stage + 2 * s * TILE * D, stage + (2 * s + 1) * TILE * D, kb, ksn, vb, vsn,
                                  c0 + s * TILE, c1);
        cp_async_commit();
    }}
    unsigned qf[DT][NB][2];
    load_q(qf, q + b * qsb + (long long)kvh * G * qsh, qsh, lane);
    Softmax st;
    softmax_init(st);
    for (int t = 0; t < ntiles; ++t) {{
        cp_async_wait<STAGES - 2>();                    // tile t has landed (this thread's copies) ...
        __syncthreads();                                // ... everyone's, and tile t - 1 is no longer read
        const int nt = t + STAGES - 1;
        if (nt < ntiles) {{
            const int sb = nt % STAGES;
            load_tile(stage + 2 * sb * TILE * D, stage + (2 * sb + 1) * TILE * D, kb, ksn, vb, vsn,
                      c0 + nt * TILE, c1);
        }}
        cp_async_commit();
        const int key0 = c0 + t * TILE + 16 * warp;
        if (key0 < c1) {{                                // warp-uniform
            const int n = c1 - key0;
            const int sb = t % STAGES;
            warp_keys(stage + 2 * sb * TILE * D, stage + (2 * sb + 1) * TILE * D, 16 * warp,
                      n >= 16 ? 0xffffu : (1u << n) - 1u, qf, scale_log2, ps[warp], st, lane);
        }}
    }}
    cp_async_wait<0>();
    __syncthreads();                                    // the stages are free: the merge reuses them
    finish(reinterpret_cast<float*>(smem), st, part, active, split, gridDim.y, bh, counter, out, lane, warp);
}}

"""


def attend_smem(d: int, g: int) -> int:
    return max(STAGES * tile_bytes(d), 4 * merge_floats(d, g))


def splits(bh: int, device: torch.device) -> int:
    """Splits per (batch, KV head): about BLOCKS_PER_SM blocks on every multiprocessor in all. Depends on the GPU
    and B * Hkv only (a CUDA graph's grid is static)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, BLOCKS_PER_SM * sms // max(bh, 1)))


def source(d: int, g: int, dtype: torch.dtype) -> str:
    return tiles.source(_KERNEL, d, g, dtype, stages=STAGES)


def _attend_supported(q, k, v, length) -> bool:
    B, Hq, one, D = q.shape
    Hkv = k.shape[1]
    return (one == 1 and Hkv > 0 and Hq % Hkv == 0 and Hq // Hkv <= 16 and D in (64, 128)
            and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype and v.dtype == q.dtype
            and k.shape[:2] == (B, Hkv) and k.shape[3] == D and v.shape == k.shape
            and 0 < B * Hkv < COUNTERS and k.shape[2] < 2**31 - TILE
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and aligned(k, 16) and aligned(v, 16)
            and length.dtype == torch.int64 and length.numel() in (1, B) and length.dim() <= 1
            and all(t.is_cuda and t.device == q.device for t in (k, v, length)))


def load(reference):
    """reference: the torch attend_decode, for the arguments the kernel does not take."""
    kernels = Kernels(_KERNEL, stages=STAGES)
    kernels.get("attend_decode_kernel", 128, 4, torch.bfloat16, torch.device("cuda", torch.cuda.current_device()),
                attend_smem(128, 4))  # fail early

    def attend_decode(q, k, v, length, sm_scale=None):
        """Kernel for head_dim 64/128, bf16/fp16 (q, k, v alike), up to 16 query heads per KV head, unit
        channel stride and 16-byte aligned K/V rows; else the torch reference (fp32 inputs included)."""
        if not _attend_supported(q, k, v, length):
            return reference(q, k, v, length, sm_scale)
        B, Hq, _, D = q.shape
        Hkv, N = k.shape[1], k.shape[2]
        G, BH = Hq // Hkv, B * Hkv
        out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
        if N == 0:
            return out.zero_()
        P = splits(BH, q.device)
        smem = attend_smem(D, G)
        if P * G > smem // 4:  # the last block's merge weights live in shared memory
            return reference(q, k, v, length, sm_scale)
        fn = kernels.get("attend_decode_kernel", D, G, q.dtype, q.device, smem)
        part = torch.empty(P * BH * G * (D + 2), dtype=torch.float32, device=q.device)
        len_stride = length.stride(0) if length.dim() == 1 and length.numel() == B else 0
        scale = (1.0 / math.sqrt(D) if sm_scale is None else sm_scale) * math.log2(math.e)
        launch(fn, (P, BH), (WARPS * 32,),
               (ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
                ptr(k), np.int64(k.stride(0)), np.int64(k.stride(1)), np.int64(k.stride(2)),
                ptr(v), np.int64(v.stride(0)), np.int64(v.stride(1)), np.int64(v.stride(2)),
                ptr(length), np.int32(len_stride), np.int32(N), np.int32(Hkv), np.float32(scale),
                ptr(part), ptr(kernels.counter("attend", q.device)), ptr(out)), q.device, shared_mem=smem)
        return out

    attend_decode.kernels = kernels
    return attend_decode

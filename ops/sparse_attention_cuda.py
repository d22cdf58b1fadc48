"""CUDA kernel for sparse_decode_attention: a sparse layer's decode attention over its device slots and the
selected rows of its pinned host store, in one launch, built on the shared tile math of
ops/attention_tiles_cuda.py (tensor-core tiles of 64 keys, fp32 softmax state, the last block of each
(batch, KV head) merges the partials).

Grid (tiles of the device slots + tiles of the selected host rows, B * Hkv), one tile per block. Every thread
reads the row sources of its 8 rows first (index loads), then issues its 16-byte loads of K and V; a row that is
not held is never read (zero-filled, score -inf). Host rows are read zero-copy over PCIe (UVA: a pinned host
pointer is a device pointer), ~112 blocks x 32 KiB at Llama-3.1-8B shape with K = 896, so the PCIe link, not
the latency of a row, bounds the time.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tailorkv.ops import attention_tiles_cuda as tiles
from tailorkv.ops.attention_tiles_cuda import COUNTERS, TILE, WARPS, Kernels, merge_floats, tile_bytes
from tailorkv.ops.cuda_launch import aligned, launch, ptr

_KERNEL = r"""
// 16 bytes of a device buffer or of pinned host memory (zero-copy over PCIe): a plain global load (no
// read-only path: the host store is rewritten between steps), as the gather kernel does
__device__ __forceinline__ uint4 load16(const ktype* p) {{ return *reinterpret_cast<const uint4*>(p); }}

extern "C" __global__ void __launch_bounds__(WARPS * 32) sparse_decode_attention_kernel(
        const ktype* __restrict__ q, const long long qsb, const long long qsh,
        const ktype* __restrict__ dk, const long long dksb, const long long dksh, const long long dksn,
        const ktype* __restrict__ dv, const long long dvsb, const long long dvsh, const long long dvsn,
        const int SC, const ktype* hk, const long long hksb, const long long hksh, const long long hksn,
        const ktype* hv, const long long hvsb, const long long hvsh, const long long hvsn,
        const long long* __restrict__ pos, const long long psb, const long long psh, const long long pss,
        const int K, const long long pos_offset, const long long* __restrict__ position,
        const long long* __restrict__ tail_start, const int sink, const int Hkv, const int dev_tiles,
        const float scale_log2, float* __restrict__ part, int* __restrict__ counter, ktype* __restrict__ out) {{
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ __align__(16) ktype ps[WARPS][GP][PST];
    ktype* Ks = reinterpret_cast<ktype*>(smem);
    ktype* Vs = Ks + TILE * D;
    const int bh = blockIdx.y, b = bh / Hkv, kvh = bh % Hkv, tile = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool on_device = tile < dev_tiles;            // block-uniform
    const int r0 = (on_device ? tile : tile - dev_tiles) * TILE;
    const long long p = position[0], ts = tail_start[0];
    const long long* pb = pos + b * psb + kvh * psh;
    // row r of this tile: is it held, and where does it live
    auto row_src = [&](int r, long long& src) -> bool {{
        const int i = r0 + r;
        if (on_device) {{
            src = i;
            return i < SC && (i < sink ? i <= p : i - sink <= p - ts);
        }}
        if (i >= K) return false;
        src = pb[i * pss] + pos_offset;
        return src >= sink && src < ts;
    }};
    constexpr int NL = TILE * CH / (WARPS * 32);      // 16-byte chunks per thread and tensor
    long long src[NL];
    bool ok[NL];
    #pragma unroll
    for (int it = 0; it < NL; ++it) {{                    // the row sources first: independent index loads
        src[it] = 0;
        ok[it] = row_src((threadIdx.x + it * WARPS * 32) / CH, src[it]);
    }}
    const int ch = threadIdx.x % CH;                    // the same chunk of every row this thread copies
    const ktype* kb = on_device ? dk + b * dksb + kvh * dksh : hk + b * hksb + kvh * hksh;
    const ktype* vb = on_device ? dv + b * dvsb + kvh * dvsh : hv + b * hvsb + kvh * hvsh;
    const long long ksn = on_device ? dksn : hksn, vsn = on_device ? dvsn : hvsn;
    uint4 kr[NL], vr[NL];
    #pragma unroll
    for (int it = 0; it < NL; ++it) {{                    // then every load, before any is used
        kr[it] = ok[it] ? load16(kb + src[it] * ksn + ch * 8) : make_uint4(0u, 0u, 0u, 0u);
        vr[it] = ok[it] ? load16(vb + src[it] * vsn + ch * 8) : make_uint4(0u, 0u, 0u, 0u);
    }}
    #pragma unroll
    for (int it = 0; it < NL; ++it) {{
        const int row = (threadIdx.x + it * WARPS * 32) / CH;
        *reinterpret_cast<uint4*>(Ks + swz(row, ch)) = kr[it];
        *reinterpret_cast<uint4*>(Vs + swz(row, ch)) = vr[it];
    }}
    long long s16 = 0;
    const unsigned valid = __ballot_sync(FULL, lane < 16 && row_src(16 * warp + lane, s16)) & 0xffffu;
    unsigned qf[DT][NB][2];
    load_q(qf, q + b * qsb + (long long)kvh * G * qsh, qsh, lane);
    Softmax st;
    softmax_init(st);
    __syncthreads();
    if (valid) warp_keys(Ks, Vs, 16 * warp, valid, qf, scale_log2, ps[warp], st, lane);
    __syncthreads();                                    // the tiles are free: the merge reuses them
    finish(reinterpret_cast<float*>(smem), st, part, gridDim.x, tile, gridDim.y, bh, counter, out, lane, warp);
}}
"""


def sparse_smem(d: int, g: int) -> int:
    return max(tile_bytes(d), 4 * merge_floats(d, g))


def source(d: int, g: int, dtype: torch.dtype) -> str:
    return tiles.source(_KERNEL, d, g, dtype)


def _sparse_supported(q, dev_k, dev_v, host_k, host_v, pos, position, tail_start) -> bool:
    B, Hq, one, D = q.shape
    Hkv = dev_k.shape[1]
    if not (one == 1 and Hkv > 0 and Hq % Hkv == 0 and Hq // Hkv <= 16 and D in (64, 128)
            and q.dtype in (torch.bfloat16, torch.float16) and dev_k.dtype == q.dtype and dev_v.dtype == q.dtype
            and dev_k.shape[:2] == (B, Hkv) and dev_k.shape[3] == D and dev_v.shape == dev_k.shape
            and 0 < B * Hkv < COUNTERS and q.stride(-1) == 1 and dev_k.stride(-1) == 1 and dev_v.stride(-1) == 1
            and aligned(dev_k, 16) and aligned(dev_v, 16)
            and position.dtype == torch.int64 and position.numel() == 1
            and tail_start.dtype == torch.int64 and tail_start.numel() == 1
            and all(t.is_cuda and t.device == q.device for t in (dev_k, dev_v, position, tail_start))):
        return False
    if pos is None:
        return True
    return (pos.dtype == torch.int64 and pos.dim() == 3 and pos.shape[:2] == (B, Hkv)
            and pos.is_cuda and pos.device == q.device
            and host_k is not None and host_v is not None
            and host_k.dtype == q.dtype and host_v.dtype == q.dtype
            and host_k.shape[:2] == (B, Hkv) and host_k.shape[3] == D and host_v.shape == host_k.shape
            and host_k.stride(-1) == 1 and host_v.stride(-1) == 1 and aligned(host_k, 16) and aligned(host_v, 16)
            and all(t.is_cuda and t.device == q.device or t.is_pinned() for t in (host_k, host_v)))


def load(reference):
    import cupy

    if not cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["unifiedAddressing"]:
        raise RuntimeError("no unified addressing: pinned host pointers are not device pointers")
    kernels = Kernels(_KERNEL)
    kernels.get("sparse_decode_attention_kernel", 128, 4, torch.bfloat16,
                torch.device("cuda", torch.cuda.current_device()), sparse_smem(128, 4))  # fail early

    def sparse_decode_attention(q, dev_k, dev_v, host_k, host_v, pos, position, tail_start, sink: int,
                                pos_offset: int = 0, sm_scale=None):
        """Kernel for head_dim 64/128, bf16/fp16 everywhere, up to 16 query heads per KV head, unit channel
        stride and 16-byte aligned rows (host stores pinned or on the device); else the torch reference."""
        if not _sparse_supported(q, dev_k, dev_v, host_k, host_v, pos, position, tail_start):
            return reference(q, dev_k, dev_v, host_k, host_v, pos, position, tail_start, sink, pos_offset,
                             sm_scale)
        B, Hq, _, D = q.shape
        Hkv, SC = dev_k.shape[1], dev_k.shape[2]
        G, BH = Hq // Hkv, B * Hkv
        K = 0 if pos is None else pos.shape[2]
        dev_tiles, host_tiles = -(-SC // TILE), -(-K // TILE)
        nparts = dev_tiles + host_tiles
        out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
        smem = sparse_smem(D, G)
        if nparts == 0:
            return out.zero_()
        if nparts * G > smem // 4 or nparts > 65535:
            return reference(q, dev_k, dev_v, host_k, host_v, pos, position, tail_start, sink, pos_offset,
                             sm_scale)
        fn = kernels.get("sparse_decode_attention_kernel", D, G, q.dtype, q.device, smem)
        part = torch.empty(nparts * BH * G * (D + 2), dtype=torch.float32, device=q.device)
        scale = (1.0 / math.sqrt(D) if sm_scale is None else sm_scale) * math.log2(math.e)
        hk = host_k if K else dev_k   # unread when K == 0
        hv = host_v if K else dev_v
        ps = pos if K else position
        pstr = (pos.stride(0), pos.stride(1), pos.stride(2)) if K else (0, 0, 0)
        launch(fn, (nparts, BH), (WARPS * 32,),
               (ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
                ptr(dev_k), np.int64(dev_k.stride(0)), np.int64(dev_k.stride(1)), np.int64(dev_k.stride(2)),
                ptr(dev_v), np.int64(dev_v.stride(0)), np.int64(dev_v.stride(1)), np.int64(dev_v.stride(2)),
                np.int32(SC), np.uint64(hk.data_ptr()), np.int64(hk.stride(0)), np.int64(hk.stride(1)),
                np.int64(hk.stride(2)), np.uint64(hv.data_ptr()), np.int64(hv.stride(0)), np.int64(hv.stride(1)),
                np.int64(hv.stride(2)), ptr(ps), *(np.int64(s) for s in pstr), np.int32(K),
                np.int64(pos_offset), ptr(position), ptr(tail_start), np.int32(sink), np.int32(Hkv),
                np.int32(dev_tiles), np.float32(scale), ptr(part), ptr(kernels.counter("sparse", q.device)),
                ptr(out)), q.device, shared_mem=smem)
        return out

    sparse_decode_attention.kernels = kernels
    return sparse_decode_attention

"""CUDA kernels for attend_decode (flash-decoding over a preallocated KV buffer with a device-side length).

Pass 1 splits the keys into chunks: one block per (chunk, batch, KV head) handles the chunk's keys for all G
query heads of that KV head (K and V are read once), keeping the running max, sum and output in fp32; a block
whose chunk starts at or past `length` exits at once, so a long buffer holding few keys costs what the keys
cost. Each warp takes a run of 64-key tiles: one key per lane and tile half for the scores (q broadcast from
shared memory), then its 4 (D=128) or 2 (D=64) channels of every V row. Pass 2 merges the chunks' partials of
each (batch, query head) in a fixed order. Only key slots below `length` are ever read.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tailorkv.ops.cuda_launch import aligned, compile_module, launch, ptr
from tailorkv.ops.quant_common_cuda import C_TYPES

WARPS, TILE, MAX_CHUNKS = 4, 64, 64

_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define D {d}
#define G {g}
#define GP ((G + 3) / 4 * 4)
#define PAD (GP > G ? GP - G : 1)
#define NEG_INF __int_as_float(0xff800000u)    // NVRTC has no INFINITY
#define CPL (D / 32)
#define WARPS {warps}
#define TILE {tile}
typedef {kt} ktype;

__device__ __forceinline__ float to_float(__half x) {{ return __half2float(x); }}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {{ return __bfloat162float(x); }}
__device__ __forceinline__ void unpack8(const uint4 u, float* f) {{
    const ktype* h = reinterpret_cast<const ktype*>(&u);
    #pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = to_float(h[i]);
}}

extern "C" __global__ void __launch_bounds__(WARPS * 32) attend_partial(
        const ktype* __restrict__ q, const long long qsb, const long long qsh,
        const ktype* __restrict__ k, const long long ksb, const long long ksh, const long long ksn,
        const ktype* __restrict__ v, const long long vsb, const long long vsh, const long long vsn,
        const long long* __restrict__ length, const int len_stride, const int N, const int Hkv,
        const int tiles_per_warp, const float scale_log2,
        float* __restrict__ pm, float* __restrict__ pl, float* __restrict__ pacc) {{
    __shared__ __align__(16) float qsm[G][D];
    __shared__ __align__(16) float sp[WARPS][TILE][GP];
    __shared__ float wm[WARPS][G], wl[WARPS][G], bm[G];
    __shared__ float wacc[G][D];
    const int bh = blockIdx.y, b = bh / Hkv, kvh = bh % Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long L = length[(long long)b * len_stride];
    const int len = (int)(L < 0 ? 0 : (L > N ? N : L));
    const int chunk = WARPS * TILE * tiles_per_warp, c0 = blockIdx.x * chunk;
    if (c0 >= len) return;

    for (int i = threadIdx.x; i < G * D; i += blockDim.x)
        qsm[i / D][i % D] = to_float(q[b * qsb + (long long)(kvh * G + i / D) * qsh + i % D]);
    if (GP > G)  // the padding of the probability rows is read (as part of a float4), never used
        for (int i = threadIdx.x; i < WARPS * TILE * PAD; i += blockDim.x)
            sp[i / (TILE * PAD)][i / PAD % TILE][G + i % PAD] = 0.f;
    __syncthreads();

    const ktype* kb = k + b * ksb + kvh * ksh;
    const ktype* vb = v + b * vsb + kvh * vsh;
    float m[G], l[G], acc[G][CPL];
    #pragma unroll
    for (int g = 0; g < G; ++g) {{
        m[g] = NEG_INF; l[g] = 0.f;
        #pragma unroll
        for (int j = 0; j < CPL; ++j) acc[g][j] = 0.f;
    }}
    const int w0 = c0 + warp * TILE * tiles_per_warp;
    for (int tile = 0; tile < tiles_per_warp; ++tile) {{
        const int t0 = w0 + tile * TILE;
        if (t0 >= len) break;                                   // warp-uniform
        float s[2][G];
        bool ok[2];
        #pragma unroll
        for (int j = 0; j < 2; ++j) {{
            ok[j] = t0 + 32 * j + lane < len;
            #pragma unroll
            for (int g = 0; g < G; ++g) s[j][g] = 0.f;
        }}
        #pragma unroll 4
        for (int dc = 0; dc < D / 8; ++dc) {{
            float kf[2][8];
            #pragma unroll
            for (int j = 0; j < 2; ++j) {{
                uint4 u = make_uint4(0u, 0u, 0u, 0u);
                if (ok[j]) u = __ldg(reinterpret_cast<const uint4*>(kb + (long long)(t0 + 32 * j + lane) * ksn + 8 * dc));
                unpack8(u, kf[j]);
            }}
            #pragma unroll
            for (int g = 0; g < G; ++g) {{
                const float4 qa = *reinterpret_cast<const float4*>(&qsm[g][8 * dc]);
                const float4 qb = *reinterpret_cast<const float4*>(&qsm[g][8 * dc + 4]);
                #pragma unroll
                for (int j = 0; j < 2; ++j)
                    s[j][g] += kf[j][0] * qa.x + kf[j][1] * qa.y + kf[j][2] * qa.z + kf[j][3] * qa.w
                             + kf[j][4] * qb.x + kf[j][5] * qb.y + kf[j][6] * qb.z + kf[j][7] * qb.w;
            }}
        }}
        #pragma unroll
        for (int g = 0; g < G; ++g) {{
            float mx = fmaxf(ok[0] ? s[0][g] * scale_log2 : NEG_INF, ok[1] ? s[1][g] * scale_log2 : NEG_INF);
            for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float mn = fmaxf(m[g], mx);                   // finite: the tile holds a key
            const float alpha = exp2f(m[g] - mn);
            m[g] = mn;
            const float p0 = ok[0] ? exp2f(s[0][g] * scale_log2 - mn) : 0.f;
            const float p1 = ok[1] ? exp2f(s[1][g] * scale_log2 - mn) : 0.f;
            l[g] = l[g] * alpha + p0 + p1;                       // this lane's share; summed over lanes at the end
            sp[warp][lane][g] = p0;
            sp[warp][32 + lane][g] = p1;
            #pragma unroll
            for (int j = 0; j < CPL; ++j) acc[g][j] *= alpha;
        }}
        __syncwarp();
        const int nk = min(TILE, len - t0);
        const ktype* vt = vb + (long long)t0 * vsn + lane * CPL;
        #pragma unroll 8
        for (int kk = 0; kk < nk; ++kk) {{                    // 8 V rows in flight per lane
            float vf[CPL];
            if (CPL == 4) {{
                const uint2 u = __ldg(reinterpret_cast<const uint2*>(vt + (long long)kk * vsn));
                const ktype* h = reinterpret_cast<const ktype*>(&u);
                #pragma unroll
                for (int j = 0; j < CPL; ++j) vf[j] = to_float(h[j]);
            }} else {{
                const unsigned u = __ldg(reinterpret_cast<const unsigned*>(vt + (long long)kk * vsn));
                const ktype* h = reinterpret_cast<const ktype*>(&u);
                #pragma unroll
                for (int j = 0; j < CPL; ++j) vf[j] = to_float(h[j]);
            }}
            #pragma unroll
            for (int g4 = 0; g4 < GP; g4 += 4) {{
                const float4 p = *reinterpret_cast<const float4*>(&sp[warp][kk][g4]);
                const float pg[4] = {{p.x, p.y, p.z, p.w}};
                #pragma unroll
                for (int gg = 0; gg < 4; ++gg)
                    if (g4 + gg < G)
                        #pragma unroll
                        for (int j = 0; j < CPL; ++j) acc[g4 + gg][j] += pg[gg] * vf[j];
            }}
        }}
        __syncwarp();
    }}

    // merge the warps in a fixed order: w_i = 2^(m_i - M), out = sum w_i acc_i, sum = sum w_i l_i
    #pragma unroll
    for (int g = 0; g < G; ++g) {{
        float lt = l[g];
        for (int o = 16; o; o >>= 1) lt += __shfl_xor_sync(0xffffffffu, lt, o);
        if (lane == 0) {{ wm[warp][g] = m[g]; wl[warp][g] = lt; }}
    }}
    __syncthreads();
    if (threadIdx.x < G) {{
        float M = wm[0][threadIdx.x];                            // warp 0 always holds a key
        for (int w = 1; w < WARPS; ++w) M = fmaxf(M, wm[w][threadIdx.x]);
        bm[threadIdx.x] = M;
    }}
    __syncthreads();
    for (int w = 0; w < WARPS; ++w) {{
        if (warp == w) {{
            #pragma unroll
            for (int g = 0; g < G; ++g) {{
                const float f = wm[w][g] == NEG_INF ? 0.f : exp2f(wm[w][g] - bm[g]);
                #pragma unroll
                for (int j = 0; j < CPL; ++j) {{
                    float& r = wacc[g][lane * CPL + j];
                    r = w ? r + f * acc[g][j] : f * acc[g][j];
                }}
            }}
        }}
        __syncthreads();
    }}
    const long long o = ((long long)blockIdx.x * gridDim.y + bh) * G;
    if (threadIdx.x < G) {{
        float lt = 0.f;
        for (int w = 0; w < WARPS; ++w)
            lt += wm[w][threadIdx.x] == NEG_INF ? 0.f : exp2f(wm[w][threadIdx.x] - bm[threadIdx.x]) * wl[w][threadIdx.x];
        pm[o + threadIdx.x] = bm[threadIdx.x];
        pl[o + threadIdx.x] = lt;
    }}
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) pacc[o * D + i] = wacc[i / D][i % D];
}}

// one block per (batch, KV head, query head of its group), one thread per channel
extern "C" __global__ void attend_reduce(const float* __restrict__ pm, const float* __restrict__ pl,
        const float* __restrict__ pacc, const long long* __restrict__ length, const int len_stride, const int N,
        const int Hkv, const int chunk, ktype* __restrict__ out) {{
    __shared__ float wt[{max_chunks}];
    __shared__ float tot;
    const int bhg = blockIdx.x, bh = bhg / G, g = bhg % G, b = bh / Hkv;
    const int BH = gridDim.x / G;
    const long long L = length[(long long)b * len_stride];
    const int len = (int)(L < 0 ? 0 : (L > N ? N : L));
    const int nc = (len + chunk - 1) / chunk;
    if (threadIdx.x < 32) {{
        float M = NEG_INF;
        for (int c = threadIdx.x; c < nc; c += 32) M = fmaxf(M, pm[((long long)c * BH + bh) * G + g]);
        for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
        float s = 0.f;
        for (int c = threadIdx.x; c < nc; c += 32) {{
            const long long i = ((long long)c * BH + bh) * G + g;
            wt[c] = exp2f(pm[i] - M);
            s += wt[c] * pl[i];
        }}
        for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (threadIdx.x == 0) tot = s;
    }}
    __syncthreads();
    float a = 0.f;
    #pragma unroll 16
    for (int c = 0; c < nc; ++c) a += wt[c] * pacc[(((long long)c * BH + bh) * G + g) * D + threadIdx.x];
    out[(long long)bhg * D + threadIdx.x] = (ktype)(nc ? a / tot : 0.f);
}}
"""


def source(d: int, g: int, dtype: torch.dtype) -> str:
    return _SOURCE.format(d=d, g=g, kt=C_TYPES[str(dtype)], warps=WARPS, tile=TILE, max_chunks=MAX_CHUNKS)


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


def load(reference):
    compile_module(source(128, 4, torch.bfloat16)).get_function("attend_partial")  # fail early
    kernels = {}

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
            mod = compile_module(source(*key))
            kernels[key] = (mod.get_function("attend_partial"), mod.get_function("attend_reduce"))
        partial, reduce = kernels[key]
        tpw = -(-N // (WARPS * TILE * MAX_CHUNKS))
        chunk = WARPS * TILE * tpw
        chunks = -(-N // chunk)
        pm = torch.empty(chunks, B * Hkv, G, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(chunks, B * Hkv, G, D, dtype=torch.float32, device=q.device)
        len_stride = length.stride(0) if length.dim() == 1 and length.numel() == B else 0
        scale = (1.0 / math.sqrt(D) if sm_scale is None else sm_scale) * math.log2(math.e)
        launch(partial, (chunks, B * Hkv), (WARPS * 32,),
               (ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
                ptr(k), np.int64(k.stride(0)), np.int64(k.stride(1)), np.int64(k.stride(2)),
                ptr(v), np.int64(v.stride(0)), np.int64(v.stride(1)), np.int64(v.stride(2)),
                ptr(length), np.int32(len_stride), np.int32(N), np.int32(Hkv), np.int32(tpw),
                np.float32(scale), ptr(pm), ptr(pl), ptr(pacc)), q.device)
        launch(reduce, (B * Hq,), (D,),
               (ptr(pm), ptr(pl), ptr(pacc), ptr(length), np.int32(len_stride), np.int32(N), np.int32(Hkv),
                np.int32(chunk), ptr(out)), q.device)
        return out

    return attend_decode

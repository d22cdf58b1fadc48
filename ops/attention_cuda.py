"""CUDA kernels for decode attention with one query per head: attend_decode (a preallocated KV buffer with a
device-side length) and sparse_decode_attention (a sparse layer's device slots plus rows read straight from
pinned host memory). Both compile from one source per (head_dim, query heads per KV head, dtype).

Shared tile math (tensor cores, fp32 softmax state). A block has 4 warps and works on tiles of 64 keys held in
shared memory (K and V rows of 16-byte chunks, XOR-swizzled so that ldmatrix reads are free of bank conflicts);
each warp takes 16 keys of a tile and keeps its own running max m, sum l and output O for the G query heads of
the KV head (GQA without repeat: K and V are read once for all G heads):
  S^T[16 keys x 8 heads] = K[16 x D] . Q^T       mma m16n8k16, K via ldmatrix, Q (exact in bf16/fp16) in registers
  m, l, O rescaled in fp32; P = exp2(S * scale * log2 e - m) rounded to the input dtype for the next product
  O^T[D x 8 heads] += V^T[D x 16 keys] . P^T     mma m16n8k16, V via ldmatrix.trans
Heads beyond G (G is padded to 8 or 16) have a zero query and are never written. Keys that are not held are
never read: their rows are zero-filled and their scores set to -inf, so NaN in unused slots cannot leak.
At the end the block merges its warps (fixed order) into one partial (m, l, acc[G][D]) in global memory; the
last block of each (batch, KV head) to finish (a ticket counter in device memory, reset by that block) merges
all partials in a fixed order and writes the output. One launch per call, graph-capturable.

attend_decode_kernel: grid (P splits, B * Hkv) with P from the GPU's multiprocessor count (about two resident
    blocks per multiprocessor over all (batch, KV head) pairs), never from the buffer size N. Each split reads
    ceil(length / P) keys rounded up to a whole tile, the length read on the device: splits past the length
    exit at once, so a short length in a long buffer costs what the length costs. A 3-stage cp.async pipeline
    keeps two tiles (64 KiB at D=128) in flight per block while the third is computed.
sparse_decode_attention_kernel: grid (tiles of the device slots + tiles of the selected host rows, B * Hkv),
    one tile per block. Every thread issues all of its 16-byte loads of the tile (K and V) before using any,
    so about 32 KiB per block of PCIe reads are in flight at once; host rows are read zero-copy (UVA).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tailorkv.ops.cuda_launch import aligned, compile_module, launch, ptr
from tailorkv.ops.quant_common_cuda import C_TYPES, HELPERS

WARPS, TILE, STAGES = 4, 64, 3
MAX_SPLITS = 128            # attend_decode splits per (batch, KV head)
BLOCKS_PER_SM = 2           # attend_decode blocks resident per multiprocessor (shared memory allows 2 at D=128)
COUNTERS = 1 << 16          # ticket counters per device and kernel (one per batch x KV head)

_SOURCE = r"""
#define D {d}
#define G {g}
#define NB ((G + 7) / 8)            // 8-head column blocks of the mma
#define GP (NB * 8)
#define WARPS {warps}
#define TILE {tile}                 // keys per tile, 16 per warp
#define STAGES {stages}
#define CH (D / 8)                  // 16-byte chunks per row
#define DT (D / 16)                 // 16-wide steps over the head dimension
#define PST 24                      // row stride (elements) of a warp's P tile [GP][16 keys]: conflict-free reads
#define RS (D + 4)                  // row stride (floats) of the warp-merge buffer: conflict-free writes
#define NEG_INF __int_as_float(0xff800000u)    // NVRTC has no INFINITY
#define FULL 0xffffffffu
typedef {kt} ktype;
#define MMA {mma}
#define TO_K {to_k}

__device__ __forceinline__ unsigned smem_u32(const void* p) {{ return (unsigned)__cvta_generic_to_shared(p); }}

__device__ __forceinline__ void ldsm4(unsigned* r, const ktype* p) {{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%0,%1,%2,%3}}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}}

__device__ __forceinline__ void ldsm4t(unsigned* r, const ktype* p) {{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{%0,%1,%2,%3}}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}}

// element offset of 16-byte chunk c of row `row` in a swizzled [rows][D] tile
__device__ __forceinline__ int swz(int row, int c) {{ return row * D + ((c ^ (row & 7)) << 3); }}

__device__ __forceinline__ unsigned pack2(ktype lo, ktype hi) {{
    return (unsigned)(*reinterpret_cast<const unsigned short*>(&lo))
         | ((unsigned)(*reinterpret_cast<const unsigned short*>(&hi)) << 16);
}}

struct Softmax {{                    // one warp's running state for the heads of its lane
    float m[NB][2], l[NB][2];        // heads nb * 8 + 2 * (lane % 4) + e
    float o[DT][NB][4];              // O^T: channels 16 i + lane / 4 (+ 8), heads as above
}};

__device__ __forceinline__ void softmax_init(Softmax& st) {{
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb) {{
        #pragma unroll
        for (int e = 0; e < 2; ++e) {{ st.m[nb][e] = NEG_INF; st.l[nb][e] = 0.f; }}
        #pragma unroll
        for (int i = 0; i < DT; ++i)
            #pragma unroll
            for (int c = 0; c < 4; ++c) st.o[i][nb][c] = 0.f;
    }}
}}

// the B operand of S^T = K . Q^T: qf[j][nb] = Q[nb * 8 + lane / 4][16 j + 2 (lane % 4) + {{0, 1}} (+ 8)]
__device__ __forceinline__ void load_q(unsigned (&qf)[DT][NB][2], const ktype* qh, long long qsh, int lane) {{
    const int t = lane & 3, gi = lane >> 2;
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb) {{
        const int g = nb * 8 + gi;
        const ktype* r = qh + (long long)(g < G ? g : 0) * qsh + 2 * t;
        #pragma unroll
        for (int j = 0; j < DT; ++j) {{
            qf[j][nb][0] = g < G ? pack2(r[16 * j], r[16 * j + 1]) : 0u;
            qf[j][nb][1] = g < G ? pack2(r[16 * j + 8], r[16 * j + 9]) : 0u;
        }}
    }}
}}

// one warp: the 16 keys at rows r0.. of the K and V tiles; bit i of `valid` = key r0 + i is held
__device__ __forceinline__ void warp_keys(const ktype* Kt, const ktype* Vt, int r0, unsigned valid,
                                          const unsigned (&qf)[DT][NB][2], float scale_log2,
                                          ktype (*ps)[PST], Softmax& st, int lane) {{
    const int t = lane & 3, gi = lane >> 2;
    float s[NB][4], s2[NB][4];       // two accumulators: two independent mma chains
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb)
        #pragma unroll
        for (int c = 0; c < 4; ++c) {{ s[nb][c] = 0.f; s2[nb][c] = 0.f; }}
    {{
        const int row = r0 + (lane & 15), hi = lane >> 4;
        #pragma unroll
        for (int j = 0; j < DT; ++j) {{
            unsigned a[4];
            ldsm4(a, Kt + swz(row, 2 * j + hi));
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) {{
                if (j & 1) MMA(s2[nb], a, qf[j][nb][0], qf[j][nb][1]);
                else MMA(s[nb], a, qf[j][nb][0], qf[j][nb][1]);
            }}
        }}
    }}
    const bool v0 = (valid >> gi) & 1u, v1 = (valid >> (gi + 8)) & 1u;
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb)
        #pragma unroll
        for (int e = 0; e < 2; ++e) {{
            const float x0 = v0 ? (s[nb][e] + s2[nb][e]) * scale_log2 : NEG_INF;          // key gi
            const float x1 = v1 ? (s[nb][2 + e] + s2[nb][2 + e]) * scale_log2 : NEG_INF;  // key gi + 8
            float mx = fmaxf(x0, x1);
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 16));
            const float mn = fmaxf(st.m[nb][e], mx);
            const float ms = mn == NEG_INF ? 0.f : mn;      // nothing held yet: alpha = p = 0, no NaN
            const float alpha = exp2f(st.m[nb][e] - ms);
            const float p0 = exp2f(x0 - ms), p1 = exp2f(x1 - ms);
            st.m[nb][e] = mn;
            st.l[nb][e] = st.l[nb][e] * alpha + p0 + p1;   // this lane's share; summed over lanes at the end
            #pragma unroll
            for (int i = 0; i < DT; ++i) {{ st.o[i][nb][e] *= alpha; st.o[i][nb][2 + e] *= alpha; }}
            ps[nb * 8 + 2 * t + e][gi] = TO_K(p0);
            ps[nb * 8 + 2 * t + e][gi + 8] = TO_K(p1);
        }}
    __syncwarp();
    unsigned pb[NB][2];               // B operand of O^T += V^T . P^T: P[head lane / 4][keys 2t, 2t+1 (+ 8)]
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb) {{
        pb[nb][0] = *reinterpret_cast<const unsigned*>(&ps[nb * 8 + gi][2 * t]);
        pb[nb][1] = *reinterpret_cast<const unsigned*>(&ps[nb * 8 + gi][2 * t + 8]);
    }}
    {{
        const int row = r0 + (lane & 7) + ((lane >> 4) << 3), hi = (lane >> 3) & 1;
        #pragma unroll
        for (int i = 0; i < DT; ++i) {{
            unsigned a[4];
            ldsm4t(a, Vt + swz(row, 2 * i + hi));
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) MMA(st.o[i][nb], a, pb[nb][0], pb[nb][1]);
        }}
    }}
    __syncwarp();                     // ps is rewritten by the next call
}}

// The block's warps -> one partial (m, l, acc) at index `part`; the last of the `nparts` blocks of (b, kvh) to
// arrive merges every partial and writes out[G][D]. red: shared memory of >= max(WARPS * GP * RS, nparts * G)
// floats, free to overwrite. Returns nothing; every thread of the block must call it.
__device__ void finish(float* red, Softmax& st, float* __restrict__ part, int nparts, int part_idx, int BH,
                       int bh, int* __restrict__ counter, ktype* __restrict__ out, int lane, int warp) {{
    __shared__ float wm[WARPS][GP], wl[WARPS][GP], sinv[GP];
    __shared__ int s_last;
    float* pm = part;                                   // [nparts][BH][G]
    float* pl = part + (long long)nparts * BH * G;      // [nparts][BH][G]
    float* pacc = part + 2LL * nparts * BH * G;         // [nparts][BH][G][D]
    const int t = lane & 3, gi = lane >> 2;
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb)
        #pragma unroll
        for (int e = 0; e < 2; ++e) {{
            float l = st.l[nb][e];
            l += __shfl_xor_sync(FULL, l, 4);
            l += __shfl_xor_sync(FULL, l, 8);
            l += __shfl_xor_sync(FULL, l, 16);
            if (gi == 0) {{ wm[warp][nb * 8 + 2 * t + e] = st.m[nb][e]; wl[warp][nb * 8 + 2 * t + e] = l; }}
        }}
    __syncthreads();
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb)
        #pragma unroll
        for (int e = 0; e < 2; ++e) {{
            const int h = nb * 8 + 2 * t + e;
            float M = wm[0][h];
            #pragma unroll
            for (int w = 1; w < WARPS; ++w) M = fmaxf(M, wm[w][h]);
            const float f = wm[warp][h] == NEG_INF ? 0.f : exp2f(wm[warp][h] - M);
            float* r = red + ((long long)warp * GP + h) * RS;
            #pragma unroll
            for (int i = 0; i < DT; ++i) {{
                r[16 * i + gi] = st.o[i][nb][e] * f;
                r[16 * i + gi + 8] = st.o[i][nb][2 + e] * f;
            }}
        }}
    const long long po = (long long)part_idx * BH + bh;
    if (threadIdx.x < G) {{
        const int h = threadIdx.x;
        float M = wm[0][h];
        for (int w = 1; w < WARPS; ++w) M = fmaxf(M, wm[w][h]);
        float L = 0.f;
        for (int w = 0; w < WARPS; ++w) L += wm[w][h] == NEG_INF ? 0.f : exp2f(wm[w][h] - M) * wl[w][h];
        pm[po * G + h] = M;
        pl[po * G + h] = L;
    }}
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {{
        const int h = i / D, d = i % D;
        float a = 0.f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) a += red[((long long)w * GP + h) * RS + d];
        pacc[po * G * D + i] = a;
    }}
    __threadfence();                                    // the partial is visible before the ticket is taken
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(counter + bh, 1) == nparts - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // the last block: merge all partials of (b, kvh) in index order; weights 2^(m_p - M) in red[p * G + h]
    for (int h = warp; h < G; h += WARPS) {{
        float M = NEG_INF;
        for (int p = lane; p < nparts; p += 32) M = fmaxf(M, __ldcg(pm + ((long long)p * BH + bh) * G + h));
        for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(FULL, M, o));
        float L = 0.f;
        for (int p = lane; p < nparts; p += 32) {{
            const long long i = ((long long)p * BH + bh) * G + h;
            const float mp = __ldcg(pm + i);
            const float w = mp == NEG_INF ? 0.f : exp2f(mp - M);
            red[p * G + h] = w;
            L += w * __ldcg(pl + i);
        }}
        for (int o = 16; o; o >>= 1) L += __shfl_xor_sync(FULL, L, o);
        if (lane == 0) sinv[h] = L > 0.f ? 1.f / L : 0.f;   // nothing held: zeros
    }}
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {{
        const int h = i / D;
        float a = 0.f;
        #pragma unroll 4
        for (int p = 0; p < nparts; ++p) a += red[p * G + h] * __ldcg(pacc + ((long long)p * BH + bh) * G * D + i);
        out[(long long)bh * G * D + i] = TO_K(a * sinv[h]);
    }}
    if (threadIdx.x == 0) counter[bh] = 0;              // ready for the next launch
}}

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


def source(d: int, g: int, dtype: torch.dtype) -> str:
    bf16 = dtype == torch.bfloat16
    return HELPERS + _SOURCE.format(d=d, g=g, kt=C_TYPES[str(dtype)], warps=WARPS, tile=TILE, stages=STAGES,
                                    mma="mma_bf16" if bf16 else "mma_f16",
                                    to_k="__float2bfloat16_rn" if bf16 else "__float2half_rn")


def tile_bytes(d: int) -> int:
    """Shared memory of one K tile and one V tile."""
    return 2 * TILE * d * 2


def merge_floats(d: int, g: int) -> int:
    """Floats of shared memory the warp merge needs (finish's `red`)."""
    return WARPS * (-(-g // 8) * 8) * (d + 4)


def attend_smem(d: int, g: int) -> int:
    return max(STAGES * tile_bytes(d), 4 * merge_floats(d, g))


def sparse_smem(d: int, g: int) -> int:
    return max(tile_bytes(d), 4 * merge_floats(d, g))


def splits(bh: int, device: torch.device) -> int:
    """attend_decode splits per (batch, KV head): about BLOCKS_PER_SM blocks on every multiprocessor in all.
    Depends on the GPU and B * Hkv only (a CUDA graph's grid is static)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, BLOCKS_PER_SM * sms // max(bh, 1)))


class Kernels:
    """Compiled kernels per (D, G, dtype), their dynamic shared memory opted in per device, and the ticket
    counters (zeroed once, reset by the kernels themselves; one array per device and kernel: the two ops must
    not run concurrently on two streams of one device, which the engine never does)."""

    def __init__(self):
        self.mods, self.fns, self.counters = {}, {}, {}

    def get(self, name: str, d: int, g: int, dtype: torch.dtype, device: torch.device, smem: int):
        key = (name, d, g, dtype, device.index)
        if key not in self.fns:
            if (d, g, dtype) not in self.mods:
                self.mods[(d, g, dtype)] = compile_module(source(d, g, dtype))
            fn = self.mods[(d, g, dtype)].get_function(name)
            import cupy
            with cupy.cuda.Device(device.index):
                fn.max_dynamic_shared_size_bytes = smem  # above the 48 KiB default (attend: 96 KiB at D=128)
            self.fns[key] = fn
        return self.fns[key]

    def counter(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, device.index)
        if key not in self.counters:
            if torch.cuda.is_current_stream_capturing():
                # never cache memory of a graph's private pool: this graph gets its own zeroed counters
                return torch.zeros(COUNTERS, dtype=torch.int32, device=device)
            self.counters[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
        return self.counters[key]


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


def load():
    kernels = Kernels()
    kernels.mods[(128, 4, torch.bfloat16)] = compile_module(source(128, 4, torch.bfloat16))
    kernels.mods[(128, 4, torch.bfloat16)].get_function("attend_decode_kernel")  # fail early
    from tailorkv.ops.attention import attend_decode as op
    reference = op.reference

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


def load_sparse():
    import cupy

    if not cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["unifiedAddressing"]:
        raise RuntimeError("no unified addressing: pinned host pointers are not device pointers")
    kernels = Kernels()
    kernels.mods[(128, 4, torch.bfloat16)] = compile_module(source(128, 4, torch.bfloat16))
    kernels.mods[(128, 4, torch.bfloat16)].get_function("sparse_decode_attention_kernel")  # fail early
    from tailorkv.ops.attention import sparse_decode_attention as op
    reference = op.reference

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

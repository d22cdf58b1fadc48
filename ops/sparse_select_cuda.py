"""CUDA kernels for the token selection of sparse layers (ops/sparse_select.py): approx_scores and topk_tokens.

approx_scores: one thread per 8 (bf16/fp16) or 4 (fp32) consecutive tokens of one (batch, KV head), the r
    summed query channels in shared memory, 16-byte loads of each K^T row: a stream at memory speed.
topk_tokens: one block of 1024 threads per row. A radix select on the float's order-preserving bit pattern
    (12 + 12 + 8 bits: three histogram passes, each over the elements that match the digits found so far)
    finds the k-th largest key exactly; then one counting pass and one writing pass emit the indices of every
    element above it and of the first ties (lowest indices) up to k, in ascending index order. The row is
    read 5 times (once from HBM, then from L2). Each warp owns a contiguous run of 4-element slots, so the
    output order is the index order; slots that stick out of the row are read element by element.
"""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import aligned, compile_module, launch, ptr
from tailorkv.ops.quant_common_cuda import C_TYPES

_APPROX = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef {qt} qtype;
typedef {kt} ktype;
#define VEC {vec}
__device__ __forceinline__ float to_float(float x) {{ return x; }}
__device__ __forceinline__ float to_float(__half x) {{ return __half2float(x); }}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {{ return __bfloat162float(x); }}

extern "C" __global__ void __launch_bounds__(128) approx_scores_kernel(
        const qtype* __restrict__ q, const long long qsb, const long long qsh, const int D,
        const ktype* __restrict__ kt, const long long ksb, const long long ksh, const long long ksr,
        const long long* __restrict__ ch, const long long csb, const long long csh, const long long csr,
        float* __restrict__ out, const long long osb, const long long osh,
        const int Hkv, const int G, const int r, const int N) {{
    __shared__ float qsum[256];
    const int bh = blockIdx.y, b = bh / Hkv, h = bh % Hkv;
    for (int j = threadIdx.x; j < r; j += blockDim.x) {{
        long long c = ch[b * csb + h * csh + j * csr];
        c = c < 0 ? 0 : (c >= D ? D - 1 : c);                  // never read outside q
        float s = 0.f;
        for (int g = 0; g < G; ++g) s += to_float(q[b * qsb + (long long)(h * G + g) * qsh + c]);
        qsum[j] = s;
    }}
    __syncthreads();
    const long long n0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (n0 >= N) return;
    const ktype* base = kt + b * ksb + h * ksh + n0;
    float* o = out + b * osb + h * osh + n0;
    if (VEC > 1 && n0 + VEC <= N) {{
        float acc[VEC];
        #pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
        #pragma unroll 4
        for (int j = 0; j < r; ++j) {{
            const uint4 u = __ldg(reinterpret_cast<const uint4*>(base + j * ksr));
            const ktype* x = reinterpret_cast<const ktype*>(&u);
            #pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] += qsum[j] * to_float(x[i]);
        }}
        #pragma unroll
        for (int i = 0; i < VEC; i += 4) *reinterpret_cast<float4*>(o + i) = make_float4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]);
    }} else {{
        const int n = (int)min((long long)VEC, N - n0);
        for (int i = 0; i < n; ++i) {{
            float a = 0.f;
            for (int j = 0; j < r; ++j) a += qsum[j] * to_float(base[j * ksr + i]);
            o[i] = a;
        }}
    }}
}}
"""

_TOPK = r"""
#define THREADS 1024
#define WARPS (THREADS / 32)
#define BATCH 4                        // slots each lane has in flight
#define FULL 0xffffffffu

__device__ __forceinline__ unsigned fkey(float f) {   // larger float -> larger key (NaN above +inf)
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// slot V covers row indices 4V - off .. 4V - off + 3 (off makes full slots 16-byte aligned); vmask: valid ones
__device__ __forceinline__ unsigned load_slot(const float* row, long long V, int off, int N, unsigned* key) {
    const long long i0 = 4 * V - off;
    if (i0 >= 0 && i0 + 4 <= N) {
        const float4 x = __ldcg(reinterpret_cast<const float4*>(row + i0));
        key[0] = fkey(x.x); key[1] = fkey(x.y); key[2] = fkey(x.z); key[3] = fkey(x.w);
        return 0xFu;
    }
    unsigned vmask = 0;
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        key[j] = 0u;
        if (i0 + j >= 0 && i0 + j < N) { key[j] = fkey(__ldcg(row + i0 + j)); vmask |= 1u << j; }
    }
    return vmask;
}

// exclusive prefix sum over the block (thread order); *total gets the sum. Holds two __syncthreads.
__device__ __forceinline__ int block_exclusive_scan(int v, int* wsum, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) { const int y = __shfl_up_sync(FULL, x, o); if (lane >= o) x += y; }
    if (lane == 31) wsum[warp] = x;
    __syncthreads();
    int w = lane < WARPS ? wsum[lane] : 0, incl = w;
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) { const int y = __shfl_up_sync(FULL, incl, o); if (lane >= o) incl += y; }
    const int before = __shfl_sync(FULL, incl - w, warp);
    *total = __shfl_sync(FULL, incl, WARPS - 1);
    __syncthreads();
    return before + x - v;
}

extern "C" __global__ void __launch_bounds__(THREADS) topk_rows(
        const float* __restrict__ scores, const long long ssb, const long long ssh, const int Hkv, const int N,
        const int k, long long* __restrict__ out) {
    __shared__ int hist[4096];
    __shared__ int wsum[WARPS], wgt[WARPS], weq[WARPS];
    __shared__ unsigned s_digit;
    __shared__ int s_above;
    const int bh = blockIdx.x, b = bh / Hkv, h = bh % Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* row = scores + b * ssb + h * ssh;
    const int off = (int)((reinterpret_cast<unsigned long long>(row) >> 2) & 3);
    const long long nslots = (N + off + 3) / 4;
    const long long per_warp = (nslots + WARPS * 32 - 1) / (WARPS * 32) * 32;
    const long long s0 = warp * per_warp, s1 = min(nslots, s0 + per_warp);

    unsigned prefix = 0u, mask = 0u;
    int kk = k;                              // how many of the elements matching `prefix` are still to take
    #pragma unroll 1
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = pass == 0 ? 20 : (pass == 1 ? 8 : 0), nb = pass < 2 ? 4096 : 256;
        for (int i = threadIdx.x; i < nb; i += THREADS) hist[i] = 0;
        __syncthreads();
        for (long long V = s0 + lane; V < s1; V += 32 * BATCH) {
            unsigned key[BATCH][4], vm[BATCH];
            #pragma unroll
            for (int u = 0; u < BATCH; ++u) vm[u] = V + 32 * u < s1 ? load_slot(row, V + 32 * u, off, N, key[u]) : 0u;
            #pragma unroll
            for (int u = 0; u < BATCH; ++u)
            #pragma unroll
            for (int j = 0; j < 4; ++j)
                if ((vm[u] >> j & 1u) && (key[u][j] & mask) == prefix)
                    atomicAdd(&hist[(key[u][j] >> shift) & (nb - 1)], 1);
        }
        __syncthreads();
        // bins from the top: thread t owns bins nb-1-t*per .. nb-per-t*per
        const int per = nb / THREADS > 0 ? nb / THREADS : 1;
        int s = 0;
        if (threadIdx.x * per < nb)
            for (int j = 0; j < per; ++j) s += hist[nb - 1 - (threadIdx.x * per + j)];
        int total;
        int above = block_exclusive_scan(s, wsum, &total);
        if (threadIdx.x * per < nb && above < kk && kk <= above + s)
            for (int j = 0; j < per; ++j) {
                const int bin = nb - 1 - (threadIdx.x * per + j), c = hist[bin];
                if (above + c >= kk) { s_digit = bin; s_above = above; break; }
                above += c;
            }
        __syncthreads();
        kk -= s_above;
        prefix |= s_digit << shift;
        mask |= (unsigned)(nb - 1) << shift;
        __syncthreads();
    }
    // prefix is now the k-th largest key: take every key above it and the first kk keys equal to it
    int gt = 0, eq = 0;
    for (long long V = s0 + lane; V < s1; V += 32 * BATCH) {
        unsigned key[BATCH][4], vm[BATCH];
        #pragma unroll
        for (int u = 0; u < BATCH; ++u) vm[u] = V + 32 * u < s1 ? load_slot(row, V + 32 * u, off, N, key[u]) : 0u;
        #pragma unroll
        for (int u = 0; u < BATCH; ++u)
        #pragma unroll
        for (int j = 0; j < 4; ++j) if (vm[u] >> j & 1u) { gt += key[u][j] > prefix; eq += key[u][j] == prefix; }
    }
    #pragma unroll
    for (int o = 16; o; o >>= 1) { gt += __shfl_xor_sync(FULL, gt, o); eq += __shfl_xor_sync(FULL, eq, o); }
    if (lane == 0) { wgt[warp] = gt; weq[warp] = eq; }
    __syncthreads();
    int gbase = 0, ebase = 0;
    for (int w = 0; w < warp; ++w) { gbase += wgt[w]; ebase += weq[w]; }
    long long* o = out + (long long)bh * k;
    for (long long V0 = s0; V0 < s1; V0 += 32 * BATCH) {  // warp-uniform loop: BATCH steps of 32 slots
        unsigned key[BATCH][4], vm[BATCH];
        #pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const long long V = V0 + 32 * u + lane;
            vm[u] = V < s1 ? load_slot(row, V, off, N, key[u]) : 0u;
        }
        #pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            int cg = 0, ce = 0;
            #pragma unroll
            for (int j = 0; j < 4; ++j) if (vm[u] >> j & 1u) { cg += key[u][j] > prefix; ce += key[u][j] == prefix; }
            int ig = cg, ie = ce;                          // inclusive scans over the lanes
            #pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int yg = __shfl_up_sync(FULL, ig, d), ye = __shfl_up_sync(FULL, ie, d);
                if (lane >= d) { ig += yg; ie += ye; }
            }
            int g_before = gbase + ig - cg, e_before = ebase + ie - ce;
            const long long V = V0 + 32 * u + lane;
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (!(vm[u] >> j & 1u)) continue;
                const bool is_gt = key[u][j] > prefix, is_eq = key[u][j] == prefix;
                if (is_gt || (is_eq && e_before < kk)) o[g_before + min(e_before, kk)] = 4 * V - off + j;
                g_before += is_gt;
                e_before += is_eq;
            }
            gbase += __shfl_sync(FULL, ig, 31);
            ebase += __shfl_sync(FULL, ie, 31);
        }
    }
}
"""


def approx_source(qdtype: torch.dtype, kdtype: torch.dtype, vec: int) -> str:
    return _APPROX.format(qt=C_TYPES[str(qdtype)], kt=C_TYPES[str(kdtype)], vec=vec)


def topk_source() -> str:
    return _TOPK


def load_approx_scores():
    compile_module(approx_source(torch.bfloat16, torch.bfloat16, 8)).get_function("approx_scores_kernel")
    kernels = {}
    from tailorkv.ops.sparse_select import approx_scores as op
    reference = op.reference

    def approx_scores(q, kt_rows, channels, out=None):
        """Kernel for q and kt_rows of fp32/fp16/bf16 with unit token stride, r <= 256 channels; out (if given)
        fp32 [B, Hkv, N] with unit token stride. Channel indices are clamped to [0, D). Else the reference."""
        B, Hq, one, D = q.shape
        _, Hkv, r, N = kt_rows.shape
        ok = (one == 1 and Hkv > 0 and Hq % Hkv == 0 and r <= 256 and q.stride(-1) == 1
              and kt_rows.stride(-1) == 1 and str(q.dtype) in C_TYPES and str(kt_rows.dtype) in C_TYPES
              and channels.dtype == torch.int64 and channels.shape == (B, Hkv, r)
              and (out is None or (out.shape == (B, Hkv, N) and out.dtype == torch.float32
                                   and out.stride(-1) == 1))
              and all(t.is_cuda and t.device == q.device for t in (kt_rows, channels)))
        if not ok:
            return reference(q, kt_rows, channels, out)
        if out is None:
            out = torch.empty(B, Hkv, N, dtype=torch.float32, device=q.device)
        if out.numel() == 0:
            return out
        vec = 16 // kt_rows.element_size()
        if not (aligned(kt_rows, 16) and aligned(out, 16)):
            vec = 1
        key = (q.dtype, kt_rows.dtype, vec)
        if key not in kernels:
            kernels[key] = compile_module(approx_source(*key)).get_function("approx_scores_kernel")
        launch(kernels[key], (-(-N // (128 * vec)), B * Hkv), (128,),
               (ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)), np.int32(D),
                ptr(kt_rows), np.int64(kt_rows.stride(0)), np.int64(kt_rows.stride(1)), np.int64(kt_rows.stride(2)),
                ptr(channels), np.int64(channels.stride(0)), np.int64(channels.stride(1)),
                np.int64(channels.stride(2)), ptr(out), np.int64(out.stride(0)), np.int64(out.stride(1)),
                np.int32(Hkv), np.int32(Hq // Hkv), np.int32(r), np.int32(N)), q.device)
        return out

    return approx_scores


def load_topk_tokens():
    kernel = compile_module(topk_source()).get_function("topk_rows")
    from tailorkv.ops.sparse_select import topk_tokens as op
    reference = op.reference

    def topk_tokens(scores, k: int):
        """Kernel for fp32 scores [B, Hkv, N] with unit token stride: the SET of the min(k, N) largest, as
        indices in ascending order (where the k-th score ties, the lowest tied indices). Else the reference
        (which orders by score)."""
        B, Hkv, N = scores.shape
        if scores.dtype != torch.float32 or scores.stride(-1) != 1 or N >= 2**31 - 4:
            return reference(scores, k)
        k = min(k, N)
        if k <= 0 or B * Hkv == 0:
            return torch.empty(B, Hkv, max(k, 0), dtype=torch.int64, device=scores.device)
        if k == N:
            return torch.arange(N, device=scores.device).expand(B, Hkv, N).contiguous()
        out = torch.empty(B, Hkv, k, dtype=torch.int64, device=scores.device)
        launch(kernel, (B * Hkv,), (1024,),
               (ptr(scores), np.int64(scores.stride(0)), np.int64(scores.stride(1)), np.int32(Hkv), np.int32(N),
                np.int32(k), ptr(out)), scores.device)
        return out

    return topk_tokens

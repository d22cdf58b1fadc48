"""CUDA kernels for Quest's page ops (ops/page_select.py).

quest_page_scores: every page's upper bound of q . k, the max over the query heads of its KV head's GQA group, in
one launch that reads the pages' min and max in their own dtype (the reference converts both to fp32 and runs two
matmuls, an add and a max: ~8 launches and twice the bytes).

A thread per page: it reads the page's min and max rows 16 bytes at a time and sums q+ * max + q- * min per query
head of the group (q+ = max(q, 0), q- = min(q, 0) in shared memory, read by the whole warp at once: no shuffles);
then the group's max as fp32.

quest_bound_page: a decode step's page min and max, recomputed from the page's stored keys up to the new token's
position (read on the device), one block per (batch, KV head), a thread per channel (the reference: 13 launches).

quest_page_slots: a sparse step's positions from its top pages, one block per (batch, KV head): a warp finds the
page to drop (the lowest score, the first on a tie) where asked, then the threads write every page's positions and
the last page's (the reference: ~10 launches)."""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import aligned, compile_module, launch, ptr, ptr_or_null
from tailorkv.ops.quant_common_cuda import C_TYPES

THREADS = 128

_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define D {d}
#define G {g}
#define THREADS {threads}
typedef {kt} ktype;
#define VEC (16 / (int)sizeof(ktype))   // channels per 16-byte load
__device__ __forceinline__ float to_float(__half x) {{ return __half2float(x); }}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {{ return __bfloat162float(x); }}
__device__ __forceinline__ float to_float(float x) {{ return x; }}
// element j of 16 loaded bytes (j known at compile time: no local memory)
__device__ __forceinline__ unsigned word(const uint4& v, int i) {{ return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }}
__device__ __forceinline__ float elem(const uint4& v, int j, const __nv_bfloat16*) {{
    const unsigned w = word(v, j / 2);
    return __uint_as_float(j % 2 ? w & 0xffff0000u : w << 16);
}}
__device__ __forceinline__ float elem(const uint4& v, int j, const __half*) {{
    const unsigned w = word(v, j / 2);
    return __half2float(__ushort_as_half((unsigned short)(j % 2 ? w >> 16 : w & 0xffffu)));
}}
__device__ __forceinline__ float elem(const uint4& v, int j, const float*) {{ return __uint_as_float(word(v, j)); }}

extern "C" __global__ void __launch_bounds__(THREADS) page_scores(
        const ktype* __restrict__ q, const long long qsb, const long long qsh,
        const ktype* __restrict__ kmin, const ktype* __restrict__ kmax, const long long ksb, const long long ksh,
        const long long ksp, float* __restrict__ out, const long long osb, const long long osh, const int P,
        const int Hkv, const long long* __restrict__ length, const int page) {{
    __shared__ __align__(16) float qp[G][D], qn[G][D];   // the group's q+ = max(q, 0) and q- = min(q, 0)
    const int bh = blockIdx.y, b = bh / Hkv, h = bh % Hkv;
    for (int i = threadIdx.x; i < G * D; i += THREADS) {{
        const float x = to_float(q[b * qsb + (long long)(h * G + i / D) * qsh + i % D]);
        qp[i / D][i % D] = fmaxf(x, 0.f);
        qn[i / D][i % D] = fminf(x, 0.f);
    }}
    __syncthreads();
    const int p = blockIdx.x * THREADS + threadIdx.x;
    if (p >= P) return;
    const long long at = b * ksb + h * ksh + (long long)p * ksp;
    const uint4* lo = reinterpret_cast<const uint4*>(kmin + at);
    const uint4* hi = reinterpret_cast<const uint4*>(kmax + at);
    float acc[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) acc[g] = 0.f;
    #pragma unroll 4
    for (int v = 0; v < D / VEC; ++v) {{
        const uint4 l4 = lo[v], h4 = hi[v];
        #pragma unroll
        for (int j = 0; j < VEC; ++j) {{
            const float l = elem(l4, j, kmin), u = elem(h4, j, kmax);
            #pragma unroll
            for (int g = 0; g < G; ++g) acc[g] = fmaf(qp[g][v * VEC + j], u, fmaf(qn[g][v * VEC + j], l, acc[g]));
        }}
    }}
    float best = acc[0];
    #pragma unroll
    for (int g = 1; g < G; ++g) best = fmaxf(best, acc[g]);
    const long long masked = length ? (length[0] - 1) / page : P;   // pages from it on: -inf
    out[b * osb + h * osh + p] = p < masked ? best : __int_as_float(0xff800000u);
}}
"""


def load(reference):
    """reference: the torch page_scores, for the arguments the kernel does not take."""
    compile_module(_SOURCE.format(d=128, g=4, threads=THREADS, kt=C_TYPES["torch.bfloat16"])).get_function(
        "page_scores")  # fail early
    kernels = {}

    def page_scores(q, kmin, kmax, length=None, page=1):
        """q [B, Hq, D] and kmin/kmax [B, Hkv, P, D] of one dtype (bf16, fp16 or fp32) on one GPU, head dim a
        multiple of 32 up to 256, at most 8 query heads per KV head, unit channel stride, kmin and kmax of one
        layout with 16-byte aligned rows, a length's one int64 there. Else the reference."""
        B, Hq, D = q.shape
        Hkv, P = kmin.shape[1], kmin.shape[2]
        ok = (kmin.dim() == 4 and kmin.shape == kmax.shape and kmin.shape[0] == B and kmin.shape[3] == D
              and D % 32 == 0 and D <= 256 and Hkv > 0 and Hq % Hkv == 0 and Hq // Hkv <= 8
              and str(q.dtype) in C_TYPES and all(t.dtype == q.dtype for t in (kmin, kmax))
              and all(t.is_cuda and t.device == q.device and t.stride(-1) == 1 for t in (q, kmin, kmax))
              and kmin.stride() == kmax.stride() and aligned(kmin, 16) and aligned(kmax, 16) and page > 0
              and (length is None or (length.numel() == 1 and length.dtype == torch.int64
                                      and length.device == q.device)))
        if not ok:
            return reference(q, kmin, kmax, length, page)
        out = torch.empty(B, Hkv, P, dtype=torch.float32, device=q.device)
        if P == 0 or B == 0:
            return out
        G = Hq // Hkv
        key = (q.dtype, D, G)
        if key not in kernels:
            kernels[key] = compile_module(_SOURCE.format(d=D, g=G, threads=THREADS, kt=C_TYPES[str(q.dtype)])
                                          ).get_function("page_scores")
        ks = kmin.stride()
        launch(kernels[key], (-(-P // THREADS), B * Hkv), (THREADS,),
               (ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)), ptr(kmin), ptr(kmax), np.int64(ks[0]),
                np.int64(ks[1]), np.int64(ks[2]), ptr(out), np.int64(out.stride(0)), np.int64(out.stride(1)),
                np.int32(P), np.int32(Hkv), ptr_or_null(length), np.int32(page)),
               q.device)
        return out

    return page_scores


_BOUND_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef {kt} ktype;
__device__ __forceinline__ float to_float(__half x) {{ return __half2float(x); }}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {{ return __bfloat162float(x); }}
__device__ __forceinline__ float to_float(float x) {{ return x; }}

extern "C" __global__ void bound_page(
        const ktype* __restrict__ k, const long long ksb, const long long ksh, const long long kst,
        ktype* __restrict__ kmin, ktype* __restrict__ kmax, const long long msb, const long long msh,
        const long long msp, const long long* __restrict__ position, const int page, const int D, const int Hkv) {{
    const int b = blockIdx.x / Hkv, h = blockIdx.x % Hkv;
    const long long p = position[0], first = p - p % page;
    for (int c = threadIdx.x; c < D; c += blockDim.x) {{
        float lo = __int_as_float(0x7f800000u), hi = __int_as_float(0xff800000u);
        for (long long t = first; t <= p; ++t) {{
            const float x = to_float(k[b * ksb + h * ksh + t * kst + c]);
            lo = fminf(lo, x);
            hi = fmaxf(hi, x);
        }}
        const long long at = b * msb + h * msh + (first / page) * msp + c;
        kmin[at] = (ktype)lo;
        kmax[at] = (ktype)hi;
    }}
}}
"""


def load_bound_page(reference):
    """reference: the torch bound_page, for the arguments the kernel does not take."""
    compile_module(_BOUND_SOURCE.format(kt=C_TYPES["torch.bfloat16"])).get_function("bound_page")  # fail early
    kernels = {}

    def bound_page(k, kmin, kmax, position, page):
        """k and kmin/kmax of one dtype (bf16, fp16 or fp32) on one GPU, unit channel stride, kmin and kmax of one
        layout, position a one-element int64 tensor there. Else the reference."""
        B, H, N, D = k.shape
        ok = (kmin.shape == kmax.shape == (B, H, -(-N // page), D) and str(k.dtype) in C_TYPES
              and all(t.dtype == k.dtype and t.is_cuda and t.device == k.device and t.stride(-1) == 1
                      for t in (kmin, kmax)) and k.is_cuda and k.stride(-1) == 1 and kmin.stride() == kmax.stride()
              and position.numel() == 1 and position.dtype == torch.int64 and position.device == k.device)
        if not ok:
            return reference(k, kmin, kmax, position, page)
        if B * H == 0 or D == 0:
            return None
        if k.dtype not in kernels:
            kernels[k.dtype] = compile_module(_BOUND_SOURCE.format(kt=C_TYPES[str(k.dtype)])).get_function("bound_page")
        ks, ms = k.stride(), kmin.stride()
        launch(kernels[k.dtype], (B * H,), (min(D, 256),),
               (ptr(k), np.int64(ks[0]), np.int64(ks[1]), np.int64(ks[2]), ptr(kmin), ptr(kmax), np.int64(ms[0]),
                np.int64(ms[1]), np.int64(ms[2]), ptr(position), np.int32(page), np.int32(D), np.int32(H)), k.device)
        return None

    return bound_page


_SLOTS_SOURCE = r"""
extern "C" __global__ void page_slots(
        const long long* __restrict__ pages, const float* __restrict__ scores, const long long ssb,
        const long long ssh, const long long* __restrict__ length, const int page, const int top, const int drop,
        const long long none, long long* __restrict__ slots, const int Hkv) {
    __shared__ int dropped;
    const int bh = blockIdx.x, b = bh / Hkv, h = bh % Hkv;
    const long long* pg = pages + (long long)bh * top;
    if (threadIdx.x < 32) {
        int at = -1;
        if (drop) {
            float lo = __int_as_float(0x7f800000u);
            for (int j = threadIdx.x; j < top; j += 32) {
                const float s = scores[b * ssb + h * ssh + pg[j]];
                if (at < 0 || s < lo) { lo = s; at = j; }
            }
            for (int o = 16; o > 0; o >>= 1) {
                const float s = __shfl_xor_sync(0xffffffffu, lo, o);
                const int j = __shfl_xor_sync(0xffffffffu, at, o);
                if (j >= 0 && (at < 0 || s < lo || (s == lo && j < at))) { lo = s; at = j; }
            }
        }
        if (threadIdx.x == 0) dropped = at;
    }
    __syncthreads();
    const long long last = (length[0] - 1) / page;
    long long* out = slots + (long long)bh * (top + 1) * page;
    for (int i = threadIdx.x; i < (top + 1) * page; i += blockDim.x) {
        const int j = i / page;
        const long long p = j == top ? last : j == dropped ? none : pg[j];
        out[i] = p * page + i % page;
    }
}
"""


def load_page_slots(reference):
    """reference: the torch page_slots, for the arguments the kernel does not take."""
    kernel = compile_module(_SLOTS_SOURCE).get_function("page_slots")  # fail early

    def page_slots(pages, scores, length, page, drop, none, slots):
        """pages and slots contiguous int64, scores (read where `drop`) fp32 [B, H, P] with unit page stride,
        length one int64, all on one GPU. Else the reference."""
        B, H, top = pages.shape
        ok = (pages.dtype == torch.int64 and pages.is_contiguous() and slots.dtype == torch.int64
              and slots.is_contiguous() and slots.shape == (B, H, (top + 1) * page) and page > 0
              and scores.dim() == 3 and (not drop or (scores.dtype == torch.float32 and scores.shape[:2] == (B, H)
                                                      and scores.stride(-1) == 1))
              and length.numel() == 1 and length.dtype == torch.int64
              and all(t.is_cuda and t.device == slots.device for t in (pages, scores, length)))
        if not ok:
            return reference(pages, scores, length, page, drop, none, slots)
        if B * H == 0:
            return slots
        launch(kernel, (B * H,), (256,), (ptr(pages), ptr(scores), np.int64(scores.stride(0)),
                                          np.int64(scores.stride(1)), ptr(length), np.int32(page), np.int32(top),
                                          np.int32(bool(drop)), np.int64(none), ptr(slots), np.int32(H)),
               slots.device)
        return slots

    return page_slots

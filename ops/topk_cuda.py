"""CUDA kernel for topk_tokens (ops/sparse_select.py): the k largest of each row of fp32 scores, exact.

One block of 1024 threads per row; nothing outside shared memory but the row and the output (no workspace,
no memsets: in a CUDA graph torch.topk's memset nodes stalled behind the copy stream's PCIe reads).
Radix select on the order-preserving 32-bit key of each float, in three histogram passes over the row
(bits 31-21, 20-10, 9-0, each counting only the keys that match the bits fixed so far), gives the k-th
largest key T and how many keys equal to T are needed. A last pass writes the keys > T in index order, then
the needed keys == T, lowest indices first (so the result is the set torch.topk returns when it breaks ties
by the lowest index), from block-wide prefix sums over tiles of 8 consecutive keys per thread.
NaN sorts above +inf (as in torch.topk).
"""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import compile_module, launch, ptr

THREADS = 1024

_SOURCE = r"""
#define THREADS 1024
#define PER 8

__device__ __forceinline__ unsigned key_of(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// block-wide exclusive prefix sum of v; *total gets the sum over the block. Uses warp_sums[32].
__device__ __forceinline__ unsigned block_exclusive_scan(unsigned v, unsigned* warp_sums, unsigned* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned x = v;
    #pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        unsigned w = warp_sums[lane];
        #pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        warp_sums[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const unsigned before = (warp > 0 ? warp_sums[warp - 1] : 0u) + x - v;
    *total = warp_sums[31];
    __syncthreads();  // warp_sums is reused by the next call
    return before;
}

extern "C" __global__ void __launch_bounds__(THREADS) topk_rows(
        const float* __restrict__ scores, const long long row_stride, const int N, const int K,
        long long* __restrict__ out, const long long out_stride) {
    __shared__ unsigned hist[2048];
    __shared__ unsigned warp_sums[32];
    __shared__ unsigned s_bin, s_above;
    const float* x = scores + (long long)blockIdx.x * row_stride;
    long long* o = out + (long long)blockIdx.x * out_stride;
    const int t = threadIdx.x;
    unsigned prefix = 0u, mask = 0u;
    unsigned need = (unsigned)K;  // keys still to take among those matching prefix/mask
    const int shifts[3] = {21, 10, 0};
    const int widths[3] = {11, 11, 10};
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = shifts[pass], nbins = 1 << widths[pass];
        for (int i = t; i < 2048; i += THREADS) hist[i] = 0u;
        __syncthreads();
        for (int base = t; base < N; base += THREADS * PER) {  // PER loads in flight before the atomics
            unsigned ks[PER];
            #pragma unroll
            for (int v = 0; v < PER; ++v) {
                const int i = base + v * THREADS;
                ks[v] = i < N ? key_of(x[i]) : 0u;
            }
            #pragma unroll
            for (int v = 0; v < PER; ++v)
                if (base + v * THREADS < N && (ks[v] & mask) == prefix)
                    atomicAdd(&hist[(ks[v] >> shift) & (nbins - 1)], 1u);
        }
        __syncthreads();
        // thread t owns bins in descending order: top = nbins - 1 - t * per ... - (per - 1)
        const int per = nbins / THREADS;  // 2 or 1
        const int top = nbins - 1 - t * per;
        unsigned mine = 0u;
        for (int j = 0; j < per; ++j) mine += hist[top - j];
        unsigned total;
        unsigned run = block_exclusive_scan(mine, warp_sums, &total);  // keys in bins above this thread's
        for (int j = 0; j < per; ++j) {
            const unsigned c = hist[top - j];
            if (run < need && run + c >= need) { s_bin = (unsigned)(top - j); s_above = run; }
            run += c;
        }
        __syncthreads();
        prefix |= s_bin << shift;
        mask |= (unsigned)(nbins - 1) << shift;
        need -= s_above;
        __syncthreads();
    }
    // prefix is the k-th largest key T; need (>= 1) keys equal to T are taken, K - need keys are above it
    const unsigned T = prefix, above = (unsigned)K - need;
    unsigned base_gt = 0u, base_eq = 0u;
    for (int tile = 0; tile < N; tile += THREADS * PER) {
        const int i0 = tile + t * PER;
        unsigned keys[PER];
        unsigned gt = 0u, eq = 0u;
        #pragma unroll
        for (int v = 0; v < PER; ++v) {
            keys[v] = (i0 + v < N) ? key_of(x[i0 + v]) : 0u;
            const bool in = i0 + v < N;
            gt += (in && keys[v] > T);
            eq += (in && keys[v] == T);
        }
        unsigned total;
        const unsigned before = block_exclusive_scan(gt | (eq << 16), warp_sums, &total);
        unsigned pg = base_gt + (before & 0xffffu), pe = base_eq + (before >> 16);
        #pragma unroll
        for (int v = 0; v < PER; ++v) {
            if (i0 + v >= N) break;
            if (keys[v] > T) { o[pg++] = i0 + v; }
            else if (keys[v] == T) { if (pe < need) o[above + pe] = i0 + v; ++pe; }
        }
        base_gt += total & 0xffffu;
        base_eq += total >> 16;
    }
}
"""


def load(reference):
    """reference: the torch topk_tokens, for the arguments the kernel does not take."""
    fn = compile_module(_SOURCE).get_function("topk_rows")

    def topk_tokens(scores: torch.Tensor, k: int) -> torch.Tensor:
        """fp32 scores [B, H, N] with unit stride along N and rows at one stride, N < 2^31, k <= N; the
        result is in index order within its two parts (keys above the k-th, then those equal to it)."""
        B, H, N = scores.shape
        k = min(k, N)
        rows_ok = scores.dim() == 3 and (B == 1 or scores.stride(0) == H * scores.stride(1))
        if scores.dtype != torch.float32 or scores.stride(-1) != 1 or not rows_ok or N >= 2**31:
            return reference(scores, k)
        out = torch.empty(B, H, k, dtype=torch.int64, device=scores.device)
        if k == 0 or B * H == 0:
            return out
        launch(fn, (B * H,), (THREADS,),
               (ptr(scores), np.int64(scores.stride(1) if H > 1 else scores.stride(0)), np.int32(N),
                np.int32(k), ptr(out), np.int64(k)), scores.device)
        return out

    return topk_tokens

"""CUDA kernel for refresh_rows (ops/row_cache.py): one block per (batch, head) row of the selection.
A bitmap of the row's range [lo, lo + n) in shared memory marks the new positions; each cached slot tests and clears
its position's bit (a kept slot); a prefix sum over the slots not kept lists the free ones in slot order, one over
the bitmap's words lists the positions still marked in ascending order, and the j-th goes to the j-th free slot.
Then the block reads those rows from pinned host memory (the widest word of 16, 8, 4, 2 or 1 bytes that divides the
row length, strides and base; UNROLL reads in flight per thread) into
their slots. One block per row keeps the read off most SMs (the compute stream's); the reads in flight, 8 rows x
1024 threads x UNROLL x 16 bytes, cover PCIe's latency."""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import compile_module, launch, ptr, ptr_or_null
from tailorkv.ops.host_gather_cuda import WORDS, widest_word
from tailorkv.ops.radix_select_cuda import RADIX_SELECT

THREADS, UNROLL = 1024, 4

_HEADER = """
#define THREADS {threads}
#define PER 4
#define UNROLL {unroll}
"""
_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(THREADS) refresh_rows_wN(
        const unsigned long long src_addr, const long long* __restrict__ pos, long long* __restrict__ slots,
        WORD* __restrict__ rows, const int H, const int K, const long long sb, const long long sh,
        const long long sn, const int words, const long long lo, const int n,
        unsigned long long* __restrict__ counts) {
    extern __shared__ unsigned smem[];
    __shared__ unsigned warp_sums[32];
    const int nw = (n + 31) >> 5;
    unsigned* bits = smem;                    // nw words: the new selection, then what is left to fetch
    int* free_slot = (int*)(smem + nw);       // K: the slots not kept, ascending
    int* fetch = free_slot + K;               // K: the positions to fetch (minus lo), ascending
    const int r = blockIdx.x, t = threadIdx.x;
    const long long* P = pos + (long long)r * K;
    long long* S = slots + (long long)r * K;
    for (int i = t; i < nw; i += THREADS) bits[i] = 0u;
    __syncthreads();
    for (int i = t; i < K; i += THREADS) {
        const long long p = P[i] - lo;
        if (p >= 0 && p < n) atomicOr(&bits[p >> 5], 1u << (p & 31));
    }
    __syncthreads();
    int nfree = 0;
    for (int base = 0; base < K; base += THREADS) {
        const int s = base + t;
        bool is_free = false;
        if (s < K) {
            const long long p = S[s] - lo;
            bool kept = false;
            if (p >= 0 && p < n) {
                const unsigned bit = 1u << (p & 31);
                kept = (atomicAnd(&bits[p >> 5], ~bit) & bit) != 0u;
            }
            is_free = !kept;
        }
        unsigned total;
        const unsigned at = block_exclusive_scan(is_free ? 1u : 0u, warp_sums, &total);
        if (is_free) free_slot[nfree + at] = s;
        nfree += (int)total;
    }
    __syncthreads();
    const int per = (nw + THREADS - 1) / THREADS;   // bitmap words per thread, contiguous
    const int w0 = min(nw, t * per), w1 = min(nw, w0 + per);
    unsigned mine = 0u;
    for (int w = w0; w < w1; ++w) mine += __popc(bits[w]);
    unsigned marked;
    unsigned at = block_exclusive_scan(mine, warp_sums, &marked);
    for (int w = w0; w < w1; ++w) {
        unsigned x = bits[w];
        while (x) {
            if (at < (unsigned)nfree) fetch[at] = 32 * w + __ffs(x) - 1;
            x &= x - 1u;
            ++at;
        }
    }
    __syncthreads();
    const int nnew = min((int)marked, nfree);
    for (int j = t; j < nnew; j += THREADS) S[free_slot[j]] = lo + fetch[j];
    if (t == 0 && counts) {
        atomicAdd(counts, (unsigned long long)nnew);
        atomicAdd(counts + 1, (unsigned long long)K);
    }
    const int b = r / H, h = r % H;
    const WORD* src = (const WORD*)src_addr + b * sb + h * sh;
    WORD* dst = rows + (long long)r * K * words;
    const int items = nnew * words;
    for (int base = t; base < items; base += THREADS * UNROLL) {
        WORD v[UNROLL];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int it = base + u * THREADS;
            if (it < items) v[u] = src[(lo + fetch[it / words]) * sn + it % words];
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int it = base + u * THREADS;
            if (it < items) dst[(long long)free_slot[it / words] * words + it % words] = v[u];
        }
    }
}
"""


def shared_bytes(n: int, k: int) -> int:
    return 4 * (-(-n // 32) + 2 * k)


def load(reference):
    """reference: the torch refresh_rows, for the arguments the kernel does not take."""
    import cupy

    source = _HEADER.format(threads=THREADS, unroll=UNROLL) + RADIX_SELECT + "".join(
        _SOURCE.replace("WORD", t).replace("_wN", f"_w{w}") for w, t in WORDS.items())
    mod = compile_module(source)
    kernels = {w: mod.get_function(f"refresh_rows_w{w}") for w in WORDS}
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    if not props["unifiedAddressing"]:
        raise RuntimeError("no unified addressing: pinned host pointers are not device pointers")
    most_shared = props.get("sharedMemPerBlockOptin", 48 * 1024) - 1024   # less the static warp sums

    def refresh_rows(host, pos, slots, rows, lo, n, counts=None):
        """The kernel needs rows of unit stride, contiguous int64 pos and slots and a contiguous `rows` on pos'
        device, an int64 `counts` (or none) there, and the bitmap of n bits and two K lists in shared memory; else
        the torch reference."""
        B, H, K = pos.shape
        X, elt = host.shape[-1], host.element_size()
        shared = shared_bytes(n, K)
        if (host.stride(-1) != 1 or shared > most_shared
                or pos.dtype != torch.int64 or slots.dtype != torch.int64 or not pos.is_contiguous()
                or not slots.is_contiguous() or slots.shape != pos.shape or not rows.is_contiguous()
                or rows.shape != (B, H, K, X) or rows.dtype != host.dtype
                or any(t.device != pos.device for t in (slots, rows))
                or (counts is not None and (counts.dtype != torch.int64 or counts.device != pos.device))
                or B * H == 0 or K == 0 or X == 0 or n >= 2**31 or K * X * elt >= 2**31):
            return reference(host, pos, slots, rows, lo, n, counts)
        w = widest_word(host)
        kernel = kernels[w]
        if shared > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = shared
        launch(kernel, (B * H,), (THREADS,),
               (np.uint64(host.data_ptr()), ptr(pos), ptr(slots), ptr(rows), np.int32(H), np.int32(K),
                np.int64(host.stride(0) * elt // w), np.int64(host.stride(1) * elt // w),
                np.int64(host.stride(2) * elt // w), np.int32(X * elt // w), np.int64(lo), np.int32(n),
                ptr_or_null(counts)), pos.device, shared_mem=shared)

    return refresh_rows

"""What the top-K kernels share, as CUDA source: the order-preserving 32-bit key of a float (and its inverse), a
block-wide exclusive prefix sum, and a block's radix select of the k-th largest key in three histogram passes
(bits 31-21, 20-10, 9-0, each counting only the keys that match the bits fixed so far). Blocks of THREADS
threads, PER loads in flight per thread; the caller defines both."""

RADIX_SELECT = r"""
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
        unsigned w = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0u;  // blocks of fewer than 32 warps
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

__device__ __forceinline__ float float_of(unsigned k) {  // the inverse of key_of
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The k-th largest (1 <= k) of the keys key_at(i), i < n, that are >= floor_key (at least k of them), by radix
// select in three histogram passes; *need_out gets how many keys equal to it are among the k largest.
template <class KeyAt>
__device__ unsigned radix_kth(const int n, const int k, const unsigned floor_key, KeyAt key_at, unsigned* hist,
                              unsigned* warp_sums, unsigned* s_pick, unsigned* need_out) {
    const int t = threadIdx.x;
    unsigned prefix = 0u, mask = 0u;
    unsigned need = (unsigned)k;  // keys still to take among those matching prefix/mask
    const int shifts[3] = {21, 10, 0};
    const int widths[3] = {11, 11, 10};
    for (int pass = 0; pass < 3; ++pass) {
        const int shift = shifts[pass], nbins = 1 << widths[pass];
        for (int i = t; i < 2048; i += THREADS) hist[i] = 0u;
        __syncthreads();
        for (int base = t; base < n; base += THREADS * PER) {  // PER loads in flight before the atomics
            unsigned ks[PER];
            #pragma unroll
            for (int v = 0; v < PER; ++v) {
                const int i = base + v * THREADS;
                ks[v] = i < n ? key_at(i) : 0u;
            }
            #pragma unroll
            for (int v = 0; v < PER; ++v)
                if (base + v * THREADS < n && (ks[v] & mask) == prefix && ks[v] >= floor_key)
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
            const unsigned cnt = hist[top - j];
            if (run < need && run + cnt >= need) { s_pick[0] = (unsigned)(top - j); s_pick[1] = run; }
            run += cnt;
        }
        __syncthreads();
        prefix |= s_pick[0] << shift;
        mask |= (unsigned)(nbins - 1) << shift;
        need -= s_pick[1];
        __syncthreads();
    }
    *need_out = need;
    return prefix;
}
"""

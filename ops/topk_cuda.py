"""CUDA kernels for topk_tokens (ops/sparse_select.py), the token selection's top-K per (batch, KV head) row.

Exact, spread over about one block per multiprocessor in all (chunks of 2048..8192 elements of a
row per block), three launches of 512-thread blocks, graph-capturable (a zeroed workspace that every call
leaves zeroed again; no sync). Keys are the float's order-preserving bit patterns.
1. topk_hist: each chunk's histogram of the top 12 bits (sign, exponent, 3 mantissa bits) goes into the row's
   histogram (global atomics of the non-empty bins); the last chunk of the row to finish (a ticket) finds the
   bin T1 that holds the k-th largest key and the count above it.
2. topk_refine: each chunk counts its keys above T1 and appends its keys in T1 (with indices) to the row's
   candidate list (a few hundred for real scores at N = 128k; the whole row if all are equal); the last chunk
   finds the exact k-th largest key by two 10-bit histogram passes over the candidates, then per chunk its
   output offset and how many of its keys equal to the k-th it takes (ties: the lowest indices of the row).
3. topk_write: each chunk writes its selected indices in ascending index order from its offset.
The row is read from HBM once and twice more from L2.
"""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import compile_module, launch, ptr

_TOPK = r"""
#define THREADS 512
#define WARPS (THREADS / 32)
#define EPT 16                         // elements per thread at most: chunks of <= THREADS * EPT elements
#define BINS 4096                      // first digit: the key's top 12 bits (sign, exponent, 3 mantissa bits)
#define BINS2 1024                     // second and third digits: 10 bits each
#define MAXC 1024                      // chunks per row at most
#define FULL 0xffffffffu

__device__ __forceinline__ unsigned fkey(float f) {    // larger float -> larger key (NaN above +inf)
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
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

// Over a histogram h of nb bins (nb a multiple of THREADS), the bin holding the need-th largest key counted from
// the top: *bin, and *above = how many keys lie in higher bins. Every thread calls it; holds 3 __syncthreads.
__device__ __forceinline__ void find_bin(const int* h, int nb, int need, int* wsum, int* s_bin, int* s_above,
                                         bool ldcg) {
    const int per = nb / THREADS;
    int c[BINS / THREADS], s = 0;
    #pragma unroll
    for (int j = 0; j < BINS / THREADS; ++j)
        if (j < per) {
            const int bin = nb - 1 - (threadIdx.x * per + j);
            c[j] = ldcg ? __ldcg(h + bin) : h[bin];
            s += c[j];
        }
    int total, above = block_exclusive_scan(s, wsum, &total);
    if (above < need && need <= above + s) {
        #pragma unroll
        for (int j = 0; j < BINS / THREADS; ++j)
            if (j < per) {
                if (above + c[j] >= need) { s_bin[0] = nb - 1 - (threadIdx.x * per + j); *s_above = above; break; }
                above += c[j];
            }
    }
    __syncthreads();
}

// A row's chunk as keys in registers: element c0 + j * THREADS + threadIdx.x (coalesced)
__device__ __forceinline__ void load_keys(const float* row, int c0, int c1, unsigned* key) {
    #pragma unroll
    for (int j = 0; j < EPT; ++j) key[j] = c0 + j * THREADS + (int)threadIdx.x < c1 ? fkey(row[c0 + j * THREADS + threadIdx.x]) : 0u;
}

// The partial results of this block are written: is it the last of the row's `C` blocks to get here?
__device__ __forceinline__ bool last_of_row(int* ticket, int C, int* s_last) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *s_last = atomicAdd(ticket, 1) == C - 1;
    __syncthreads();
    if (*s_last) __threadfence();
    return *s_last;
}

// Pass 1, grid (chunks, rows): each chunk's histogram of the first digit is added into the row's histogram (in
// the zeroed workspace); the last chunk of the row to finish finds the bin of the k-th largest key (T1) and how
// many keys lie above it.
extern "C" __global__ void __launch_bounds__(THREADS) topk_hist(
        const float* __restrict__ scores, const long long ssb, const long long ssh, const int Hkv, const int N,
        const int CS, const int k, int* __restrict__ ws, const int R, int* __restrict__ meta) {
    __shared__ int hist[BINS];
    __shared__ int scratch[WARPS + 1];
    __shared__ int s_above, s_last;
    const int r = blockIdx.y, chunk = blockIdx.x, C = gridDim.x;
    const float* row = scores + (r / Hkv) * ssb + (r % Hkv) * ssh;
    for (int i = threadIdx.x; i < BINS; i += THREADS) hist[i] = 0;
    __syncthreads();
    const int c0 = chunk * CS, c1 = min(c0 + CS, N);
    unsigned key[EPT];
    load_keys(row, c0, c1, key);
    #pragma unroll
    for (int j = 0; j < EPT; ++j)
        if (c0 + j * THREADS + (int)threadIdx.x < c1) atomicAdd(&hist[key[j] >> 20], 1);
    __syncthreads();
    int* gh = ws + (long long)r * BINS;
    for (int i = threadIdx.x; i < BINS; i += THREADS) if (hist[i]) atomicAdd(gh + i, hist[i]);
    if (!last_of_row(ws + (long long)R * BINS + r, C, &s_last)) return;
    find_bin(gh, BINS, k, scratch + 1, scratch, &s_above, true);
    if (threadIdx.x == 0) {
        meta[4 * r] = scratch[0], meta[4 * r + 1] = s_above;
        ws[(long long)R * BINS + r] = 0;                     // ticket reset for the next call
    }
}

// Pass 2: each chunk counts its keys above bin T1 and appends the keys in bin T1 (with their indices) to the
// row's candidate list; the last chunk to finish finds the exact k-th largest key among the candidates (two
// 10-bit digits), then per chunk where its selected indices start in the output and how many of its keys equal
// to the k-th largest it takes (ties: the lowest indices of the row), and resets the workspace.
extern "C" __global__ void __launch_bounds__(THREADS) topk_refine(
        const float* __restrict__ scores, const long long ssb, const long long ssh, const int Hkv, const int N,
        const int CS, const int k, int* __restrict__ ws, const int R, int* __restrict__ meta,
        int* __restrict__ cinfo, unsigned* __restrict__ ckey, int* __restrict__ cidx) {
    __shared__ int hist[BINS2];
    __shared__ int cg[MAXC], ce[MAXC];
    __shared__ int scratch[WARPS + 1];
    __shared__ int s_above, s_last, s_n;
    const int r = blockIdx.y, chunk = blockIdx.x, C = gridDim.x;
    const int lane = threadIdx.x & 31;
    const float* row = scores + (r / Hkv) * ssb + (r % Hkv) * ssh;
    const unsigned T1 = (unsigned)meta[4 * r];
    const int above1 = meta[4 * r + 1];
    int* ncand = ws + (long long)R * BINS + 2 * R + r;
    unsigned* ck = ckey + (long long)r * N;
    int* ci = cidx + (long long)r * N;
    const int c0 = chunk * CS, c1 = min(c0 + CS, N);
    unsigned key[EPT];
    load_keys(row, c0, c1, key);
    int gt = 0;
    #pragma unroll
    for (int j = 0; j < EPT; ++j) {
        const int i = c0 + j * THREADS + (int)threadIdx.x;
        const bool ok = i < c1;
        gt += ok && (key[j] >> 20) > T1;
        const bool cand = ok && (key[j] >> 20) == T1;
        const unsigned m = __ballot_sync(FULL, cand);           // one atomic per warp and round
        int base = 0;
        if (m && lane == __ffs(m) - 1) base = atomicAdd(ncand, __popc(m));
        base = __shfl_sync(FULL, base, __ffs(m | 1u) - 1);
        if (cand) {
            const int at = base + __popc(m & ((1u << lane) - 1u));
            ck[at] = key[j];
            ci[at] = i;
        }
    }
    int total;
    gt = block_exclusive_scan(gt, scratch + 1, &total);
    if (threadIdx.x == 0) cinfo[3 * ((long long)r * C + chunk)] = total;
    if (!last_of_row(ws + (long long)R * BINS + R + r, C, &s_last)) return;
    if (threadIdx.x == 0) s_n = __ldcg(ncand);
    __syncthreads();
    const int n = s_n;
    int need = k - above1;                                   // 1 .. number of candidates
    unsigned prefix = T1 << 20;
    #pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {                   // bits 19..10, then 9..0
        const int shift = pass ? 0 : 10;
        const unsigned mask = pass ? 0xfffffc00u : 0xfff00000u;
        for (int i = threadIdx.x; i < BINS2; i += THREADS) hist[i] = 0;
        __syncthreads();
        for (int c = threadIdx.x; c < n; c += THREADS) {
            const unsigned x = __ldcg(ck + c);
            if ((x & mask) == prefix) atomicAdd(&hist[(x >> shift) & (BINS2 - 1)], 1);
        }
        __syncthreads();
        find_bin(hist, BINS2, need, scratch + 1, scratch, &s_above, false);
        prefix |= (unsigned)scratch[0] << shift;
        need -= s_above;
        __syncthreads();
    }
    const unsigned thr = prefix;                             // the k-th largest key; `need` of its ties are taken
    for (int c = threadIdx.x; c < C; c += THREADS) { cg[c] = __ldcg(cinfo + 3 * ((long long)r * C + c)); ce[c] = 0; }
    __syncthreads();
    for (int c = threadIdx.x; c < n; c += THREADS) {
        const unsigned x = __ldcg(ck + c);
        const int ch = __ldcg(ci + c) / CS;
        if (x > thr) atomicAdd(&cg[ch], 1);
        else if (x == thr) atomicAdd(&ce[ch], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int off = 0, taken = 0;
        for (int c = 0; c < C; ++c) {                        // chunks in index order
            const int take = min(ce[c], need - taken);
            int* info = cinfo + 3 * ((long long)r * C + c);
            info[1] = off, info[2] = take;
            off += cg[c] + take;
            taken += take;
        }
        meta[4 * r + 2] = (int)thr;
        *ncand = 0;                                          // workspace reset for the next call
        ws[(long long)R * BINS + R + r] = 0;
    }
    int* gh = ws + (long long)r * BINS;
    for (int i = threadIdx.x; i < BINS; i += THREADS) gh[i] = 0;
}

// Pass 3: each chunk writes the indices of its keys above the k-th largest and of its first `take` keys equal
// to it, in ascending index order, from its offset on.
extern "C" __global__ void __launch_bounds__(THREADS) topk_write(
        const float* __restrict__ scores, const long long ssb, const long long ssh, const int Hkv, const int N,
        const int CS, const int k, const int* __restrict__ meta, const int* __restrict__ cinfo,
        long long* __restrict__ out) {
    __shared__ int pg[EPT * WARPS], pe[EPT * WARPS];
    __shared__ int scratch[WARPS];
    const int r = blockIdx.y, chunk = blockIdx.x, C = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* row = scores + (r / Hkv) * ssb + (r % Hkv) * ssh;
    const unsigned thr = (unsigned)meta[4 * r + 2];
    const int* info = cinfo + 3 * ((long long)r * C + chunk);
    const int off = info[1], take = info[2];
    const int c0 = chunk * CS, c1 = min(c0 + CS, N);
    unsigned key[EPT], bg[EPT], be[EPT];
    load_keys(row, c0, c1, key);
    #pragma unroll
    for (int j = 0; j < EPT; ++j) {
        const bool ok = c0 + j * THREADS + (int)threadIdx.x < c1;
        bg[j] = __ballot_sync(FULL, ok && key[j] > thr);
        be[j] = __ballot_sync(FULL, ok && key[j] == thr);
        if (lane == 0) { pg[j * WARPS + warp] = __popc(bg[j]); pe[j * WARPS + warp] = __popc(be[j]); }
    }
    __syncthreads();
    // exclusive prefix over (round j, warp) in that order = index order
    int vg = threadIdx.x < EPT * WARPS ? pg[threadIdx.x] : 0, ve = threadIdx.x < EPT * WARPS ? pe[threadIdx.x] : 0;
    int tg, te, xg = block_exclusive_scan(vg, scratch, &tg), xe = block_exclusive_scan(ve, scratch, &te);
    if (threadIdx.x < EPT * WARPS) { pg[threadIdx.x] = xg; pe[threadIdx.x] = xe; }
    __syncthreads();
    long long* o = out + (long long)r * k + off;
    const unsigned lt = (1u << lane) - 1u;
    #pragma unroll
    for (int j = 0; j < EPT; ++j) {
        const bool is_gt = (bg[j] >> lane) & 1u, is_eq = (be[j] >> lane) & 1u;
        if (!is_gt && !is_eq) continue;
        const int g_before = pg[j * WARPS + warp] + __popc(bg[j] & lt);
        const int e_before = pe[j * WARPS + warp] + __popc(be[j] & lt);
        if (is_gt || e_before < take) o[g_before + min(e_before, take)] = c0 + j * THREADS + (int)threadIdx.x;
    }
}
"""


TOPK_THREADS, TOPK_EPT, TOPK_BINS, TOPK_MAXC = 512, 16, 4096, 1024


def topk_chunk(N: int, rows: int, device: torch.device) -> int:
    """Elements per block: enough blocks for about one per multiprocessor over all rows, between 2048 and
    THREADS * EPT = 8192 per block (a multiple of THREADS)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-N * rows // sms)
    cs = -(-want // TOPK_THREADS) * TOPK_THREADS
    return max(2048, min(TOPK_THREADS * TOPK_EPT, cs))


def load(reference):
    """reference: the torch topk_tokens, for the arguments the kernel does not take."""
    mod = compile_module(_TOPK)
    kernels = [mod.get_function(n) for n in ("topk_hist", "topk_refine", "topk_write")]
    workspaces = {}

    def workspace(R: int, device: torch.device) -> torch.Tensor:
        """Zeroed int32 per row: the first digit's histogram, two tickets, the candidate count; every call leaves
        it zeroed (the last block of each row resets its part). Kept for the process: graphs hold its address."""
        key = (R, device.index)
        if key not in workspaces:
            if torch.cuda.is_current_stream_capturing():  # never cache memory of a graph's private pool
                return torch.zeros(R * (TOPK_BINS + 3), dtype=torch.int32, device=device)
            workspaces[key] = torch.zeros(R * (TOPK_BINS + 3), dtype=torch.int32, device=device)
        return workspaces[key]

    def topk_tokens(scores, k: int):
        """Kernel for fp32 scores [B, Hkv, N] with unit token stride: the SET of the min(k, N) largest, as
        indices in ascending order; where the k-th largest value ties, the lowest tied indices (NaN counts as
        larger than +inf). Else the reference (which orders by score)."""
        B, Hkv, N = scores.shape
        R = B * Hkv
        if (scores.dtype != torch.float32 or scores.stride(-1) != 1 or N >= 2**31 - TOPK_THREADS * TOPK_EPT
                or not 0 < R <= 65535):
            return reference(scores, k)
        k = min(k, N)
        if k <= 0:
            return torch.empty(B, Hkv, max(k, 0), dtype=torch.int64, device=scores.device)
        if k == N:
            return torch.arange(N, device=scores.device).expand(B, Hkv, N).contiguous()
        cs = topk_chunk(N, R, scores.device)
        C = -(-N // cs)
        if C > TOPK_MAXC:
            return reference(scores, k)
        ws = workspace(R, scores.device)
        scratch = torch.empty(4 * R + 3 * R * C + 2 * R * N, dtype=torch.int32, device=scores.device)
        meta, cinfo, ckey, cidx = scratch.split([4 * R, 3 * R * C, R * N, R * N])
        out = torch.empty(B, Hkv, k, dtype=torch.int64, device=scores.device)
        common = (ptr(scores), np.int64(scores.stride(0)), np.int64(scores.stride(1)), np.int32(Hkv), np.int32(N),
                  np.int32(cs), np.int32(k))
        grid, block = (C, R), (TOPK_THREADS,)
        launch(kernels[0], grid, block, common + (ptr(ws), np.int32(R), ptr(meta)), scores.device)
        launch(kernels[1], grid, block, common + (ptr(ws), np.int32(R), ptr(meta), ptr(cinfo), ptr(ckey), ptr(cidx)),
               scores.device)
        launch(kernels[2], grid, block, common + (ptr(meta), ptr(cinfo), ptr(out)), scores.device)
        return out

    return topk_tokens

"""CUDA kernel for topk_tokens (ops/sparse_select.py): the k largest of each row of fp32 scores, exact.

A block of 1024 threads selects within a stretch of a row using nothing outside shared memory but its input and
output (no workspace to clear, no memsets: in a CUDA graph torch.topk's memset nodes stalled behind the copy
stream's PCIe reads). Radix select on the order-preserving 32-bit key of each float (ops/radix_select_cuda.py:
three histogram passes, bits 31-21, 20-10, 9-0, each counting only the keys that match the bits fixed so far)
gives the k-th largest key T and how many keys equal to T are needed; a last pass writes the keys > T and the
first needed keys == T in index order (so the set is the one torch.topk returns when it breaks ties by the lowest
index), from block-wide prefix sums over tiles of 8 consecutive keys per thread. NaN sorts above +inf (as in
torch.topk).

A long row would leave most of the GPU idle with one block per row (8 rows at 128k: 8 blocks on 132 SMs), so it
is cut into S stretches: stage 1 takes the k best of each stretch (index order, -1 where a stretch is short) with
their keys and the stretch's k-th largest key (its floor), stage 2 the k best of those S * k candidates, reading
their keys as stage 1 wrote them; the row's k-th largest is at least the largest floor, so stage 2 counts only
the candidates at or above it. The candidates come in index order, so ties still go to the lowest index.
(Adding a warp's lanes that count the same bin once, with __match_any_sync, made stage 1 slower: 15.1 -> 18.9 us.)

With a carry (ops/topk_carry.py) that lists K .. cap tokens of a row, stage 1's blocks for that row return at
once and stage 2 selects among the listed ones (unordered: ties at T go to the lowest indices by a second radix
select over their inverted indices), marks the chosen tokens in a bitmap of the row in shared memory and writes
them in index order by a prefix sum over its words. Alone at 128k (8 rows, K 1024, bench/topk_carry_probe.py):
the sketch scores and this top-K 52 us against 69 us with the whole search.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tailorkv.ops.cuda_launch import compile_module, launch, ptr, ptr_or_null
from tailorkv.ops.radix_select_cuda import RADIX_SELECT
from tailorkv.ops.topk_carry import TopKCarry

THREADS = 1024
CARRY_MAX_N = 8 * 36 * 1024   # one bit per token in the dynamic shared memory beside the 8 KiB histogram
ONE_STAGE_MAX_N = 16384       # rows this short take one stage whatever the split rule says (see stretches)

_SOURCE = r"""
#define THREADS 1024
#define PER 8
""" + RADIX_SELECT + r"""

extern "C" __global__ void __launch_bounds__(THREADS) topk_rows(
        const float* __restrict__ scores, const long long row_stride, const int N, const int K,
        const long long* __restrict__ cand, const unsigned* __restrict__ cand_keys,
        const unsigned* __restrict__ floors, const int n_floors, const int stretch, const int S,
        long long* __restrict__ out, unsigned* __restrict__ out_keys, unsigned* __restrict__ out_floor,
        const long long out_stride, const long long add,
        int* __restrict__ c_count, const int* __restrict__ c_index, const float* __restrict__ c_score,
        float* __restrict__ c_threshold, float* __restrict__ c_margin, const float* __restrict__ c_qnorm,
        const int cap,
        unsigned long long* __restrict__ c_searches, const int last, const int row_n) {
    // block (row, s) of S per row takes elements [s * stretch, min(N, (s + 1) * stretch)) of its row: the keys
    // of scores x[i] (cand null), or over the row's N candidates their indices cand and keys cand_keys (index -1:
    // none, key 0). It writes min(K, n) indices in index order, each plus `add`, to out + block * out_stride, then
    // -1 up to K when S > 1, and (out_keys not null) their keys the same way and its k-th largest key to
    // out_floor[block] (0 when the stretch holds fewer than K). floors (not null): n_floors floors per row
    // (stage 1's); the K-th largest of the whole row is at least their largest, so keys below it are left out of
    // the counting passes.
    // c_count not null (ops/topk_carry.py; K <= the row's length row_n): where the row's listed tokens number
    // K .. cap, the first stage's blocks return at once and the last (`last`, one block per row) selects among
    // the listed ones; the last stage then sets the row's next threshold and clears its count.
    __shared__ unsigned hist[2048];
    __shared__ unsigned warp_sums[32];
    __shared__ unsigned s_pick[2];
    extern __shared__ unsigned bits[];  // the last stage with a carry: one bit per token of the row
    const int row = blockIdx.x / S, seg = blockIdx.x % S, t = threadIdx.x;
    const int listed = c_count ? c_count[row] : -1;
    const bool fast = c_count && listed >= K && listed <= cap;
    if (fast && !last) return;
    const float* x = scores + (long long)row * row_stride;
    long long* o = out + (long long)blockIdx.x * out_stride;
    unsigned T = 0u;
    int k = K;
    if (fast) {
        const float* cs = c_score + (long long)row * cap;
        const int* ci = c_index + (long long)row * cap;
        auto ckey = [&](int i) -> unsigned { return key_of(cs[i]); };
        unsigned need;
        T = radix_kth(listed, K, 0u, ckey, hist, warp_sums, s_pick, &need);
        unsigned eq = 0u, total;
        for (int i = t; i < listed; i += THREADS) eq += ckey(i) == T;
        block_exclusive_scan(eq, warp_sums, &total);
        unsigned cut = 0xffffffffu;  // keys equal to T are taken up to this index: the `need` lowest
        if (total > need) {
            unsigned unused;
            cut = ~radix_kth(listed, need, 1u, [&](int i) -> unsigned { return ckey(i) == T ? ~(unsigned)ci[i] : 0u; },
                             hist, warp_sums, s_pick, &unused);
        }
        const int words = (row_n + 31) >> 5;
        for (int w = t; w < words; w += THREADS) bits[w] = 0u;
        __syncthreads();
        for (int i = t; i < listed; i += THREADS) {
            const unsigned kv = ckey(i), idx = (unsigned)ci[i];
            if (kv > T || (kv == T && idx <= cut)) atomicOr(&bits[idx >> 5], 1u << (idx & 31));
        }
        __syncthreads();
        unsigned done = 0u;
        for (int tile = 0; tile < words; tile += THREADS * 4) {  // the marked tokens in index order
            const int w0 = tile + 4 * t;
            unsigned wv[4], cnt = 0u;
            #pragma unroll
            for (int v = 0; v < 4; ++v) { wv[v] = w0 + v < words ? bits[w0 + v] : 0u; cnt += __popc(wv[v]); }
            unsigned slot = done + block_exclusive_scan(cnt, warp_sums, &total);
            #pragma unroll
            for (int v = 0; v < 4; ++v)
                for (unsigned m = wv[v]; m; m &= m - 1) o[slot++] = (long long)(32 * (w0 + v) + __ffs(m) - 1) + add;
            done += total;
        }
    } else {
        const long long* c = cand ? cand + (long long)row * N : nullptr;
        const unsigned* ck = cand ? cand_keys + (long long)row * N : nullptr;
        const int lo = seg * stretch, n = min(N - lo, stretch);
        k = min(K, n);
        unsigned floor_key = 0u;
        for (int s = 0; s < n_floors; ++s) floor_key = max(floor_key, floors[row * n_floors + s]);
        auto key_at = [&](int i) -> unsigned { return c ? ck[lo + i] : key_of(x[lo + i]); };  // i < n
        auto index_at = [&](int i) -> long long { return c ? c[lo + i] : (long long)(lo + i); };
        unsigned need = 0u;
        if (k > 0) T = radix_kth(n, k, floor_key, key_at, hist, warp_sums, s_pick, &need);
        // T is the k-th largest key; need (>= 1) keys equal to T are taken, k - need keys are above it.
        // An element's slot: the keys > T before it plus the taken keys == T before it (index order).
        unsigned base_gt = 0u, base_eq = 0u;
        for (int tile = 0; tile < n && k > 0; tile += THREADS * PER) {
            const int i0 = tile + t * PER;
            unsigned keys[PER];
            unsigned gt = 0u, eq = 0u;
            #pragma unroll
            for (int v = 0; v < PER; ++v) {
                const bool in = i0 + v < n;
                keys[v] = in ? key_at(i0 + v) : 0u;
                gt += (in && keys[v] > T);
                eq += (in && keys[v] == T);
            }
            unsigned total;
            const unsigned before = block_exclusive_scan(gt | (eq << 16), warp_sums, &total);
            unsigned pg = base_gt + (before & 0xffffu), pe = base_eq + (before >> 16);
            #pragma unroll
            for (int v = 0; v < PER; ++v) {
                if (i0 + v >= n) break;
                int slot = -1;
                if (keys[v] > T) { slot = pg + min(pe, need); ++pg; }
                else if (keys[v] == T) { if (pe < need) slot = pg + pe; ++pe; }
                if (slot >= 0) {
                    o[slot] = index_at(i0 + v) + add;
                    if (out_keys) out_keys[(long long)blockIdx.x * out_stride + slot] = keys[v];
                }
            }
            base_gt += total & 0xffffu;
            base_eq += total >> 16;
        }
        if (S > 1)
            for (int i = k + t; i < K; i += THREADS) {
                o[i] = -1;
                if (out_keys) out_keys[(long long)blockIdx.x * out_stride + i] = 0u;
            }
        if (out_floor && t == 0) out_floor[blockIdx.x] = k == K ? T : 0u;
    }
    if (!c_count || !last) return;
    __syncthreads();  // every thread has read the count
    if (t == 0) {  // the row's next threshold: a margin below its K-th largest score, in units of the query norm
        const float top = float_of(T) / c_qnorm[row];
        float m = c_margin[row];
        if (!(m > 0.f)) {  // the row's first selection: a quarter of the way down to its lowest stretch's floor
            unsigned low = 0xffffffffu;
            for (int s = 0; s < n_floors && !fast; ++s)
                if (floors[row * n_floors + s]) low = min(low, floors[row * n_floors + s]);
            m = low != 0xffffffffu ? 0.25f * (top - float_of(low) / c_qnorm[row]) : 0.05f * fabsf(top);
        } else if (listed < K) {
            m *= 2.f;
        } else if (listed > cap) {
            m *= 0.5f;
        } else if (4 * listed < 5 * K) {
            m *= 1.5f;
        } else if (listed > 3 * K) {
            m *= 0.75f;
        }
        if (!(isfinite(m) && m > 0.f)) m = isfinite(top) && top != 0.f ? 0.05f * fabsf(top) : 1.f;
        m = fmaxf(m, 1e-6f * fabsf(top));
        c_margin[row] = m;
        c_threshold[row] = top - m;
        c_count[row] = 0;
        atomicAdd(&c_searches[0], fast ? 0ull : 1ull);
        atomicAdd(&c_searches[1], 1ull);
    }
}
"""


def stretches(rows: int, n: int, k: int, sms: int) -> int:
    """How many stretches to cut each row into: sqrt(n / k) balances the two stages (a stretch of n / s keys,
    s * k candidates), at most about two blocks per SM over all rows; 1 = one stage. Rows of up to
    ONE_STAGE_MAX_N keys take one stage: the second launch costs more than the split saves (H100, 8 rows, top 63:
    8,192 keys 11.5 us in one stage, 19.8-20.8 in 2-16 stretches; 16,384 keys 16.7 vs 20.7-21.7)."""
    if n <= ONE_STAGE_MAX_N:
        return 1
    s = min(-(-2 * sms // rows), math.isqrt(n // max(1, k)))
    return s if s >= 2 else 1


def load(reference):
    """reference: the torch topk_tokens, for the arguments the kernel does not take."""
    fn = compile_module(_SOURCE).get_function("topk_rows")

    def topk_tokens(scores: torch.Tensor, k: int, offset: int = 0, out: torch.Tensor | None = None,
                    carry: TopKCarry | None = None) -> torch.Tensor:
        """fp32 scores [B, H, N] with unit stride along N and rows at one stride, N < 2^31, k <= N, `out`
        (if given) contiguous int64 [B, H, k] on their device; the result is in index order. A carry (of B * H
        rows, this k, on this device, N <= CARRY_MAX_N) selects among the tokens the scoring listed, when it
        listed enough."""
        B, H, N = scores.shape
        k = min(k, N)
        rows_ok = scores.dim() == 3 and (B == 1 or scores.stride(0) == H * scores.stride(1))
        out_ok = out is None or (out.shape == (B, H, k) and out.dtype == torch.int64 and out.is_contiguous()
                                 and out.device == scores.device)
        if scores.dtype != torch.float32 or scores.stride(-1) != 1 or not rows_ok or N >= 2**31 or not out_ok:
            return reference(scores, k, offset, out, carry)
        out = torch.empty(B, H, k, dtype=torch.int64, device=scores.device) if out is None else out
        if k == 0 or B * H == 0:
            return out
        rows, row_stride = B * H, np.int64(scores.stride(1) if H > 1 else scores.stride(0))
        if carry is not None and not (carry.fits(rows, scores.device) and carry.k == k and N <= CARRY_MAX_N):
            carry = None
        carry_args = ((ptr(carry.count), ptr(carry.index), ptr(carry.score), ptr(carry.threshold),
                       ptr(carry.margin), ptr(carry.qnorm), np.int32(carry.cap), ptr(carry.searches))
                      if carry is not None else (np.uint64(0),) * 6 + (np.int32(0), np.uint64(0)))

        def select(n, cand, stretch, segs, dst, keys_out=None, floor_out=None, add=0, last=True):
            """each of rows x segs blocks: the k best of its stretch into dst (cand: (indices, keys, floors))"""
            c_idx, c_keys, c_floors = cand if cand is not None else (None, None, None)
            args = (ptr(scores), row_stride, np.int32(n), np.int32(k), ptr_or_null(c_idx), ptr_or_null(c_keys),
                    ptr_or_null(c_floors), np.int32(c_floors.shape[-1] if c_floors is not None else 0),
                    np.int32(stretch), np.int32(segs), ptr(dst), ptr_or_null(keys_out), ptr_or_null(floor_out),
                    np.int64(k), np.int64(add)) + carry_args + (np.int32(last), np.int32(N))
            bitmap = 4 * -(-N // 32) if carry is not None and last else 0
            launch(fn, (rows * segs,), (THREADS,), args, scores.device, shared_mem=bitmap)

        s = stretches(rows, N, k, torch.cuda.get_device_properties(scores.device).multi_processor_count)
        if s == 1:
            select(N, None, N, 1, out, add=offset)
            return out
        dev = scores.device
        cand = torch.empty(rows, s, k, dtype=torch.int64, device=dev)
        keys = torch.empty(rows, s, k, dtype=torch.int32, device=dev)     # the candidates' keys (uint32 bits)
        floors = torch.empty(rows, s, dtype=torch.int32, device=dev)
        select(N, None, -(-N // s), s, cand, keys, floors, last=False)    # stage 1: the k best of each stretch
        select(s * k, (cand, keys, floors), s * k, 1, out, add=offset)   # stage 2: the k best of the candidates
        return out

    return topk_tokens

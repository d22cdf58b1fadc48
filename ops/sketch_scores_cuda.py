"""CUDA kernel for sketch_scores (ops/sparse_select.py): one score per KV head and token over a key sketch
(ops/quant.py's quantize_sketch layout), the group's query heads combined in registers (RULE 1: sum of the
logits, 2: logsumexp), masked from a device-side end on.

Tensor cores do the products (mma m16n8k16, fp16 in, fp32 accumulate), one warp per group of 64 tokens:
    A [16 tokens x 16 channels] = the codes: a token's word holds even channels in its low half and odd ones in
        its high half, so (word >> shift) & mask is a channel pair as two fp16 halves (the code as a subnormal,
        code * 2^-24: exact, and one shift and one AND per pair);
    B [16 channels x 8 query heads] = w = q * scale of the group, rounded to fp16 (q * 2^e and scale / 2^E are
        normalised first so that w cannot overflow): 11 significant bits per channel's weight, the only rounding
        besides fp32 accumulation;
    the min term (q . min, exact: q * 2^e is exact in fp16 for a bf16/fp16 q) is an MMA per group that seeds the
        accumulators.
Compared with the qk_quant kernel (query heads as the MMA rows, one bit plane per MMA), this takes about a third
of the instructions per token. The codes and the group's scales and mins are staged global -> shared with
cp.async, STAGES deep per warp.
"""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import aligned, compile_module, launch, ptr, rows_contiguous, units_per_block
from tailorkv.ops.quant_common_cuda import C_TYPES, HELPERS

WARPS, GROUP, SMEM_LIMIT = 4, 64, 48 * 1024
RULES = {"sum": 1, "lse": 2}  # sketch_scores' combine rules the kernel takes (psum needs every token first)

_SOURCE = r"""
#define BITS {bits}
#define D {d}
#define G {g}
#define RULE {rule}
#define WARPS {warps}
#define STAGES {stages}
#define GROUP {group}
typedef {qt} qtype;
#define CPW (32 / BITS)
#define WPT (D / CPW)               // words per token
#define KT (D / 16)
#define RPW (16 / BITS)             // channel pairs per word
#define MASK ((BITS == 1 ? 1u : BITS == 2 ? 3u : 15u) * 0x00010001u)
#define HI (BITS < 4 ? 4 * BITS : 0)      // 1 and 2 bits: a word holds both pairs of a k-tile, HI bits apart
#define QL (G <= 2 ? 1 : G <= 4 ? 2 : 4)   // lanes of a quad that hold this group's heads (2 per lane)
#define STAGE_WORDS (GROUP * WPT + D)       // codes, then D fp16 scales and D fp16 mins
#define NEG_INF __int_as_float(0xff800000u)

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ unsigned h2u(__half2 h) {{ return *reinterpret_cast<unsigned*>(&h); }}

// a channel pair's codes (the bits of `mask` in each half, within its low 10) as two fp16 values:
// (1024 + code 2^shift) - 1024, exact
__device__ __forceinline__ unsigned code2(unsigned x, unsigned mask = MASK) {{
    x = (x & mask) | 0x64006400u;
    return h2u(__hsub2(*reinterpret_cast<const __half2*>(&x), __float2half2_rn(1024.f)));
}}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 4) sketch_scores_kernel(
        const qtype* __restrict__ q, const long long qsb, const long long qsh,
        const unsigned* __restrict__ codes, const long long csb, const long long csh,
        const __half* __restrict__ scale, const long long ssb, const long long ssh,
        const __half* __restrict__ mins, const long long msb, const long long msh,
        float* __restrict__ out, const int Hkv, const int N, const int ngroups, const int groups_per_block,
        const float sm_scale, const long long* __restrict__ end, const long long offset,
        int* __restrict__ c_count, int* __restrict__ c_index, float* __restrict__ c_score,
        const float* __restrict__ c_threshold, float* __restrict__ c_qnorm, const int cap) {{
    __shared__ __align__(16) unsigned stage[WARPS][STAGES][STAGE_WORDS];
    const int bh = blockIdx.y, b = bh / Hkv, kvh = bh % Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long endv = *end;

    // B operand of head g (zero past G): channels 16 kt + 2c, +1 (k = 2c, 2c+1) and 16 kt + 2c + 8, +9
    float qv[KT][4];
    float amax = 0.f, qsq = 0.f;
    #pragma unroll
    for (int kt = 0; kt < KT; ++kt)
    #pragma unroll
    for (int j = 0; j < 4; ++j) {{
        const int ch = 16 * kt + 2 * c + (j & 1) + 8 * (j >> 1);
        qv[kt][j] = g < G ? to_float(q[b * qsb + (long long)(kvh * G + g) * qsh + ch]) : 0.f;
        amax = fmaxf(amax, fabsf(qv[kt][j]));
        qsq += qv[kt][j] * qv[kt][j];
    }}
    #pragma unroll
    for (int o = 16; o; o >>= 1) {{
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        qsq += __shfl_xor_sync(0xffffffffu, qsq, o);
    }}
    // a carry's thresholds are in units of the group's query norm (the rank-K score scales with it)
    const float qnorm = fmaxf(sqrtf(qsq), 1e-30f);
    const float thr = c_count ? c_threshold[bh] * qnorm : 0.f;
    if (c_count && blockIdx.x == 0 && threadIdx.x == 0) c_qnorm[bh] = qnorm;
    int e = 0;  // q * 2^e has its largest |value| in [2^14, 2^15): exact in fp16 for a bf16/fp16 q
    if (amax > 0.f) e = 14 - ilogbf(amax);
    __half2 qh[KT][2];
    #pragma unroll
    for (int kt = 0; kt < KT; ++kt) {{
        qh[kt][0] = __floats2half2_rn(ldexpf(qv[kt][0], e), ldexpf(qv[kt][1], e));
        qh[kt][1] = __floats2half2_rn(ldexpf(qv[kt][2], e), ldexpf(qv[kt][3], e));
    }}

    const unsigned* cbase = codes + b * csb + kvh * csh;
    const __half* sbase = scale + b * ssb + kvh * ssh;
    const __half* mbase = mins + b * msb + kvh * msh;
    const int first = blockIdx.x * groups_per_block + warp;
    const int last = min(ngroups, (blockIdx.x + 1) * groups_per_block);
    const int mine = first < last ? (last - first + WARPS - 1) / WARPS : 0;

    auto issue = [&](int i) {{
        const int grp = first + i * WARPS;
        unsigned* dst = stage[warp][i % STAGES];
        const int ntok = min(GROUP, N - grp * GROUP);
        stage_copy<16>(dst, cbase + (long long)grp * GROUP * WPT, GROUP * WPT * 4, ntok * WPT * 4, lane);
        stage_copy<16>(dst + GROUP * WPT, sbase + (long long)grp * D, 2 * D, 2 * D, lane);
        stage_copy<16>(dst + GROUP * WPT + D / 2, mbase + (long long)grp * D, 2 * D, 2 * D, lane);
    }};
    warp_pipeline<STAGES>(mine, issue, [&](int i) {{
        const int grp = first + i * WARPS;
        const unsigned* sc = stage[warp][i % STAGES];
        const __half2* ss = reinterpret_cast<const __half2*>(sc + GROUP * WPT);
        const __half2* sm = ss + D / 2;

        // w = (q 2^e) * (scale 2^p) in fp16, p normalising the group's largest scale below 1
        __half2 sv[KT][2];
        __half2 mx = __float2half2_rn(0.f);
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt) {{
            sv[kt][0] = ss[8 * kt + c];
            sv[kt][1] = ss[8 * kt + 4 + c];
            mx = __hmax2(mx, __hmax2(sv[kt][0], sv[kt][1]));
        }}
        float ms = fmaxf(__low2float(mx), __high2float(mx));
        ms = fmaxf(ms, __shfl_xor_sync(0xffffffffu, ms, 1));
        ms = fmaxf(ms, __shfl_xor_sync(0xffffffffu, ms, 2));
        int p = 0;
        if (ms > 0.f) p = min(-1 - ilogbf(ms), 15);
        const __half2 p2 = __float2half2_rn(ldexpf(1.f, p));
        unsigned wv[KT][2];
        // the high pair's codes come in as code 2^HI (no second shift): its weights times 2^-HI, exact
        const __half2 down = __float2half2_rn(ldexpf(1.f, -HI));
        float seed[4] = {{0.f, 0.f, 0.f, 0.f}};
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt) {{
            wv[kt][0] = h2u(__hmul2(__hmul2(sv[kt][0], p2), qh[kt][0]));
            wv[kt][1] = h2u(__hmul2(__hmul2(__hmul2(sv[kt][1], p2), qh[kt][1]), down));
            const unsigned m0 = h2u(sm[8 * kt + c]), m1 = h2u(sm[8 * kt + 4 + c]);
            const unsigned a[4] = {{m0, m0, m1, m1}};
            mma_f16(seed, a, h2u(qh[kt][0]), h2u(qh[kt][1]));   // q 2^e . min, in every row
        }}
        #pragma unroll
        for (int j = 0; j < 4; ++j) seed[j] = ldexpf(seed[j], p);
        const float mult = ldexpf(sm_scale * LOG2E, -p - e);   // logits in log2 units until the end

        // the group's 4 tiles of 16 tokens side by side (4 independent MMA chains); past N the codes are zeros
        float acc[4][4];
        #pragma unroll
        for (int t = 0; t < 4; ++t)
        #pragma unroll
        for (int j = 0; j < 4; ++j) acc[t][j] = seed[j];
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt) {{
            // pairs 8 kt + c (k = 2c, 2c+1) and 8 kt + 4 + c (k = 2c+8, 2c+9) of a token's D / 2
            const int k0 = (8 * kt) / RPW, k1 = (8 * kt + 4) / RPW;
            const unsigned s0 = BITS * ((8 * kt) % RPW + c), s1 = BITS * ((8 * kt + 4) % RPW + c);
            #pragma unroll
            for (int t = 0; t < 4; ++t) {{
                const unsigned* r = sc + (16 * t + g) * WPT;
#if HI
                const unsigned x0 = r[k0] >> s0, x1 = r[8 * WPT + k0] >> s0;   // k1 == k0, s1 == s0 + HI
                const unsigned a[4] = {{code2(x0), code2(x1), code2(x0, MASK << HI), code2(x1, MASK << HI)}};
#else
                const unsigned a[4] = {{code2(r[k0] >> s0), code2(r[8 * WPT + k0] >> s0),
                                       code2(r[k1] >> s1), code2(r[8 * WPT + k1] >> s1)}};
#endif
                mma_f16(acc[t], a, wv[kt][0], wv[kt][1]);
            }}
        }}
        // acc[t]: tokens 16t + g (0, 1) and + 8 (2, 3); heads 2c (0, 2) and 2c + 1 (1, 3)
        const bool h0 = 2 * c < G, h1 = 2 * c + 1 < G;
        float r[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i) {{
            const float v0 = acc[i / 2][2 * (i % 2)] * mult, v1 = acc[i / 2][2 * (i % 2) + 1] * mult;
#if RULE == 1
            r[i] = (h0 ? v0 : 0.f) + (h1 ? v1 : 0.f);
#else
            r[i] = fmaxf(h0 ? v0 : NEG_INF, h1 ? v1 : NEG_INF);
            acc[i / 2][2 * (i % 2)] = v0; acc[i / 2][2 * (i % 2) + 1] = v1;
#endif
        }}
        #pragma unroll
        for (int o = 1; o < QL; o <<= 1)
        #pragma unroll
        for (int i = 0; i < 8; ++i)
            r[i] = RULE == 1 ? r[i] + __shfl_xor_sync(0xffffffffu, r[i], o) : fmaxf(r[i], __shfl_xor_sync(0xffffffffu, r[i], o));
#if RULE == 2
        float sum[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i)
            sum[i] = (h0 ? exp2f(acc[i / 2][2 * (i % 2)] - r[i]) : 0.f) + (h1 ? exp2f(acc[i / 2][2 * (i % 2) + 1] - r[i]) : 0.f);
        #pragma unroll
        for (int o = 1; o < QL; o <<= 1)
        #pragma unroll
        for (int i = 0; i < 8; ++i) sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], o);
        #pragma unroll
        for (int i = 0; i < 8; ++i) r[i] = (r[i] + __log2f(sum[i])) * LN2;
#else
        #pragma unroll
        for (int i = 0; i < 8; ++i) r[i] *= LN2;
#endif
        // masked from `end` on: the group's tokens from row `held` on (64-bit arithmetic once per group)
        const int held = (int)max(-1ll, min((long long)GROUP, endv - offset - (long long)grp * GROUP));
        #pragma unroll
        for (int i = 0; i < 8; ++i) r[i] = 8 * i + g >= held ? NEG_INF : r[i];
        if (c == 0) {{
            #pragma unroll
            for (int i = 0; i < 8; ++i) {{
                const int tok = grp * GROUP + 8 * i + g;   // tile i / 2, row g + 8 (i % 2)
                if (tok < N) out[(long long)bh * N + tok] = r[i];
            }}
        }}
        if (c_count) {{  // list the tokens at or above the row's threshold (NaN too): one atomic per warp and group
            unsigned listed[8];
            int total = 0;
            #pragma unroll
            for (int i = 0; i < 8; ++i) {{
                listed[i] = __ballot_sync(0xffffffffu, c == 0 && grp * GROUP + 8 * i + g < N && !(r[i] < thr));
                total += __popc(listed[i]);
            }}
            if (total) {{
                int at = 0;
                if (lane == 0) at = atomicAdd(c_count + bh, total);
                at = __shfl_sync(0xffffffffu, at, 0);
                #pragma unroll
                for (int i = 0; i < 8; ++i) {{
                    const int pos = at + __popc(listed[i] & ((1u << lane) - 1u));
                    if ((listed[i] >> lane) & 1u && pos < cap) {{
                        c_index[(long long)bh * cap + pos] = grp * GROUP + 8 * i + g;
                        c_score[(long long)bh * cap + pos] = r[i];
                    }}
                    at += __popc(listed[i]);
                }}
            }}
        }}
    }});
}}
"""


def stages(bits: int) -> int:
    return 3 if bits < 4 else 2  # 4-bit groups are twice the words: two stages fit the shared memory


def shared_bytes(bits: int, d: int) -> int:
    return 4 * WARPS * stages(bits) * (GROUP * d * bits // 32 + d)


def source(bits: int, d: int, g: int, qdtype: torch.dtype, rule: int) -> str:
    return HELPERS + _SOURCE.format(bits=bits, d=d, g=g, rule=rule, qt=C_TYPES[str(qdtype)], warps=WARPS,
                                    stages=stages(bits), group=GROUP)


def supported(q, k_codes, k_scale, k_min, bits, group) -> bool:
    B, Hq, one, D = q.shape
    Hkv = k_codes.shape[1]
    if one != 1 or Hkv == 0 or Hq % Hkv or bits not in (1, 2, 4) or group != GROUP or D not in (64, 128):
        return False
    N = k_codes.shape[2]
    return (str(q.dtype) in C_TYPES and Hq // Hkv <= 8 and shared_bytes(bits, D) <= SMEM_LIMIT
            and q.stride(-1) == 1 and k_codes.dtype == torch.int32
            and k_scale.dtype == torch.float16 and k_min.dtype == torch.float16
            and k_codes.shape[:2] == (B, Hkv) and k_codes.shape[3] * (32 // bits) == D
            and k_scale.shape[:2] == (B, Hkv) and k_scale.shape[3] == D and k_scale.shape[2] * group >= N
            and k_min.shape == k_scale.shape
            and all(t.is_cuda and t.device == q.device for t in (k_codes, k_scale, k_min))
            and all(rows_contiguous(t, 2) and aligned(t, 16, (0, 1)) for t in (k_codes, k_scale, k_min)))


def load(reference):
    """reference: the torch sketch_scores (ops/sparse_select.py)."""
    compile_module(source(2, 128, 4, torch.bfloat16, 2)).get_function("sketch_scores_kernel")  # fail early
    kernels = {}

    def sketch_scores(q, k_codes, k_scale, k_min, bits, group, end, offset=0, rule="lse", sm_scale=1.0, carry=None,
                      blocks_per_sm=None):
        """The kernel for 1/2/4 bits, group 64, head_dim 64/128, up to 8 query heads per KV head, rule sum or
        lse, a one-element int64 `end` on q's device, code/scale/min rows contiguous with 16-byte aligned
        heads; else the torch reference. A carry (ops/topk_carry.py, of B * Hkv rows on q's device) gets the
        tokens at or above its thresholds listed."""
        if (rule not in RULES or not supported(q, k_codes, k_scale, k_min, bits, group)
                or end.numel() != 1 or end.dtype != torch.int64 or end.device != q.device):
            return reference(q, k_codes, k_scale, k_min, bits, group, end, offset, rule, sm_scale, carry, blocks_per_sm)
        B, Hq, _, D = q.shape
        Hkv, N = k_codes.shape[1], k_codes.shape[2]
        out = torch.empty(B, Hkv, N, dtype=torch.float32, device=q.device)
        if out.numel() == 0:
            return out
        key = (bits, D, Hq // Hkv, q.dtype, RULES[rule])
        if key not in kernels:
            kernels[key] = compile_module(source(*key)).get_function("sketch_scores_kernel")
        c = carry if carry is not None and carry.fits(B * Hkv, q.device) else None
        listing = ((ptr(c.count), ptr(c.index), ptr(c.score), ptr(c.threshold), ptr(c.qnorm), np.int32(c.cap))
                   if c is not None else (np.uint64(0),) * 5 + (np.int32(0),))
        ngroups = -(-N // GROUP)
        grid = () if blocks_per_sm is None else (blocks_per_sm,)   # None: units_per_block's full wave
        gpb = units_per_block(ngroups * B * Hkv, WARPS, q.device, *grid)
        launch(kernels[key], (-(-ngroups // gpb), B * Hkv), (WARPS * 32,),
               (ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
                ptr(k_codes), np.int64(k_codes.stride(0)), np.int64(k_codes.stride(1)),
                ptr(k_scale), np.int64(k_scale.stride(0)), np.int64(k_scale.stride(1)),
                ptr(k_min), np.int64(k_min.stride(0)), np.int64(k_min.stride(1)),
                ptr(out), np.int32(Hkv), np.int32(N), np.int32(ngroups), np.int32(gpb), np.float32(sm_scale),
                ptr(end), np.int64(offset)) + listing, q.device)
        return out

    return sketch_scores

// sketch_scores_kernel (ops/sketch_scores_cuda.py compiles it with BITS, D, G, RULE, WARPS, STAGES, GROUP and
// qtype defined; how it works is written there)
#define CPW (32 / BITS)
#define WPT (D / CPW)               // words per token
#define KT (D / 16)
#define PPW (16 / BITS)             // channel pairs per word
#define PPL (D / 8)                 // pairs per lane of a quad: lane c takes pairs c * PPL .. c * PPL + PPL - 1
#define LW ((PPL + PPW - 1) / PPW)  // words per lane and token
#define QL (G <= 2 ? 1 : G <= 4 ? 2 : 4)   // lanes of a quad that hold this group's heads (2 per lane)
#define STAGE_WORDS (GROUP * WPT + D)       // codes, then D fp16 scales and D fp16 mins
#define NEG_INF __int_as_float(0xff800000u)

#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ unsigned h2u(__half2 h) { return *reinterpret_cast<unsigned*>(&h); }

// pair i of a lane (bits BITS * (i % PPW) of each half of its word i / PPW) goes to mantissa bits P of fp16
__device__ __forceinline__ int place(int i) {
    const int off = BITS * (i % PPW);
    return off >= 4 && off <= 10 - BITS ? off : 6 + off % 4;
}

// the pair as two fp16 values 2^(10-P) + code, exact
__device__ __forceinline__ unsigned code_pair(const unsigned (&w)[LW], int i) {
    const int off = BITS * (i % PPW), P = place(i);
    const unsigned x = P >= off ? w[i / PPW] << (P - off) : w[i / PPW] >> (off - P);
    const unsigned mask = (((1u << BITS) - 1u) << P) * 0x00010001u, exponent = ((25u - P) << 10) * 0x00010001u;
    unsigned y;   // (x & mask) | exponent in one LOP3: both constants in registers (immediates would take two)
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(y) : "r"(x), "r"(mask), "r"(exponent));
    return y;
}

// -2^(10-P) in both halves: the offset the pair's A carries, taken off the seed
__device__ __forceinline__ unsigned neg_offset(int i) { return (((25u - place(i)) << 10) | 0x8000u) * 0x00010001u; }

__device__ __forceinline__ void load_words(unsigned (&w)[LW], const unsigned* p, unsigned preshift) {
#if LW == 4
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
#elif LW == 2
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x; w[1] = v.y;
#else
    w[0] = p[0] >> preshift;   // PPL < PPW (1 bit, D 64): two lanes share a word
#endif
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 4) sketch_scores_kernel(
        const qtype* __restrict__ q, const long long qsb, const long long qsh,
        const unsigned* __restrict__ codes, const long long csb, const long long csh,
        const __half* __restrict__ scale, const long long ssb, const long long ssh,
        const __half* __restrict__ mins, const long long msb, const long long msh,
        float* __restrict__ out, const int Hkv, const int N, const int ngroups, const int groups_per_block,
        const float sm_scale, const long long* __restrict__ end, const long long offset,
        int* __restrict__ c_count, int* __restrict__ c_index, float* __restrict__ c_score,
        const float* __restrict__ c_threshold, float* __restrict__ c_qnorm, const int cap) {
    __shared__ __align__(16) unsigned stage[WARPS][STAGES][STAGE_WORDS];
    const int bh = blockIdx.y, b = bh / Hkv, kvh = bh % Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long endv = *end;

    // B operand of head g (zero past G): k = 2c, 2c+1 of k-tile kt = pair c PPL + 2 kt, k = 2c+8, 2c+9 the next
    float qv[KT][4];
    float amax = 0.f, qsq = 0.f;
    #pragma unroll
    for (int kt = 0; kt < KT; ++kt)
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int ch = 2 * PPL * c + 4 * kt + j;
        qv[kt][j] = g < G ? to_float(q[b * qsb + (long long)(kvh * G + g) * qsh + ch]) : 0.f;
        amax = fmaxf(amax, fabsf(qv[kt][j]));
        qsq += qv[kt][j] * qv[kt][j];
    }
    #pragma unroll
    for (int o = 16; o; o >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        qsq += __shfl_xor_sync(0xffffffffu, qsq, o);
    }
    // a carry's thresholds are in units of the group's query norm (the rank-K score scales with it)
    const float qnorm = fmaxf(sqrtf(qsq), 1e-30f);
    const float thr = c_count ? c_threshold[bh] * qnorm : 0.f;
    if (c_count && blockIdx.x == 0 && threadIdx.x == 0) c_qnorm[bh] = qnorm;
    int e = 0;  // q * 2^e has its largest |value| in [2^14, 2^15): exact in fp16 for a bf16/fp16 q
    if (amax > 0.f) e = 14 - ilogbf(amax);
    const float mult_e = ldexpf(sm_scale * LOG2E, -e);
    __half2 qh[KT][2];
    #pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
        qh[kt][0] = __floats2half2_rn(ldexpf(qv[kt][0], e), ldexpf(qv[kt][1], e));
        qh[kt][1] = __floats2half2_rn(ldexpf(qv[kt][2], e), ldexpf(qv[kt][3], e));
    }

    const unsigned* cbase = codes + b * csb + kvh * csh;
    const __half* sbase = scale + b * ssb + kvh * ssh;
    const __half* mbase = mins + b * msb + kvh * msh;
    const int first = blockIdx.x * groups_per_block + warp;
    const int last = min(ngroups, (blockIdx.x + 1) * groups_per_block);
    const int mine = first < last ? (last - first + WARPS - 1) / WARPS : 0;

    auto issue = [&](int i, int) {
        const int grp = first + i * WARPS;
        unsigned* dst = stage[warp][i % STAGES];
        const int ntok = min(GROUP, N - grp * GROUP);
        stage_copy<16>(dst, cbase + (long long)grp * GROUP * WPT, GROUP * WPT * 4, ntok * WPT * 4, lane);
        stage_copy<16>(dst + GROUP * WPT, sbase + (long long)grp * D, 2 * D, 2 * D, lane);
        stage_copy<16>(dst + GROUP * WPT + D / 2, mbase + (long long)grp * D, 2 * D, 2 * D, lane);
    };
    warp_pipeline<STAGES>(mine, issue, [&](int i, int) {
        const int grp = first + i * WARPS;
        const unsigned* sc = stage[warp][i % STAGES];
        const __half2* ss = reinterpret_cast<const __half2*>(sc + GROUP * WPT);
        const __half2* sm = ss + D / 2;

        // w = (q 2^e) * (scale 2^p) in fp16, p normalising the group's largest scale below 1
        __half2 sv[KT][2];
        __half2 mx = __float2half2_rn(0.f);
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
            sv[kt][0] = ss[PPL * c + 2 * kt];
            sv[kt][1] = ss[PPL * c + 2 * kt + 1];
            mx = __hmax2(mx, __hmax2(sv[kt][0], sv[kt][1]));
        }
        float ms = fmaxf(__low2float(mx), __high2float(mx));
        ms = fmaxf(ms, __shfl_xor_sync(0xffffffffu, ms, 1));
        ms = fmaxf(ms, __shfl_xor_sync(0xffffffffu, ms, 2));
        int p = 0;
        if (ms > 0.f) p = min(-1 - ilogbf(ms), 15);
        const float pw = __int_as_float((127 + p) << 23);   // 2^p, p in [-16, 15]
        const __half2 p2 = __float2half2_rn(pw);
        unsigned wv[KT][2];
        float seed[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
            wv[kt][0] = h2u(__hmul2(__hmul2(sv[kt][0], p2), qh[kt][0]));
            wv[kt][1] = h2u(__hmul2(__hmul2(sv[kt][1], p2), qh[kt][1]));
            const unsigned m0 = h2u(sm[PPL * c + 2 * kt]), m1 = h2u(sm[PPL * c + 2 * kt + 1]);
            const unsigned a[4] = {m0, m0, m1, m1};
            mma_f16(seed, a, h2u(qh[kt][0]), h2u(qh[kt][1]));   // q 2^e . min, in every row
        }
        #pragma unroll
        for (int j = 0; j < 4; ++j) seed[j] *= pw;
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt) {   // minus sum_c 2^(10-P) w: the codes' offsets, exact products
            const unsigned a[4] = {neg_offset(2 * kt), neg_offset(2 * kt), neg_offset(2 * kt + 1), neg_offset(2 * kt + 1)};
            mma_f16(seed, a, wv[kt][0], wv[kt][1]);
        }
        const float mult = mult_e * __int_as_float((127 - p) << 23);   // logits in log2 units until the end

        // the group's 4 tiles of 16 tokens side by side (4 independent MMA chains); past N the codes are zeros.
        // Tile t's rows: tokens 16t + g (A rows g) and 16t + g + 8; this lane's words of each
        unsigned wd[4][2][LW];
        const int w0 = (PPL * c) / PPW;
        const unsigned pre = BITS * ((PPL * c) % PPW);
        #pragma unroll
        for (int t = 0; t < 4; ++t)
        #pragma unroll
        for (int h = 0; h < 2; ++h) load_words(wd[t][h], sc + (16 * t + g + 8 * h) * WPT + w0, pre);
        float acc[4][4];
        #pragma unroll
        for (int t = 0; t < 4; ++t)
        #pragma unroll
        for (int j = 0; j < 4; ++j) acc[t][j] = seed[j];
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt)
        #pragma unroll
        for (int t = 0; t < 4; ++t) {
            const unsigned a[4] = {code_pair(wd[t][0], 2 * kt), code_pair(wd[t][1], 2 * kt),
                                   code_pair(wd[t][0], 2 * kt + 1), code_pair(wd[t][1], 2 * kt + 1)};
            mma_f16(acc[t], a, wv[kt][0], wv[kt][1]);
        }
        // acc[t]: tokens 16t + g (0, 1) and + 8 (2, 3); heads 2c (0, 2) and 2c + 1 (1, 3)
        const bool h0 = 2 * c < G, h1 = 2 * c + 1 < G;
        float r[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float v0 = acc[i / 2][2 * (i % 2)] * mult, v1 = acc[i / 2][2 * (i % 2) + 1] * mult;
#if RULE == 1
            r[i] = (h0 ? v0 : 0.f) + (h1 ? v1 : 0.f);
#else
            r[i] = fmaxf(h0 ? v0 : NEG_INF, h1 ? v1 : NEG_INF);
            acc[i / 2][2 * (i % 2)] = v0; acc[i / 2][2 * (i % 2) + 1] = v1;
#endif
        }
        #pragma unroll
        for (int o = 1; o < QL; o <<= 1)
        #pragma unroll
        for (int i = 0; i < 8; ++i)
            r[i] = RULE == 1 ? r[i] + __shfl_xor_sync(0xffffffffu, r[i], o) : fmaxf(r[i], __shfl_xor_sync(0xffffffffu, r[i], o));
#if RULE == 2
        float sum[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i)
            sum[i] = (h0 ? ex2(acc[i / 2][2 * (i % 2)] - r[i]) : 0.f) + (h1 ? ex2(acc[i / 2][2 * (i % 2) + 1] - r[i]) : 0.f);
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
        if (c == 0) {
            #pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int tok = grp * GROUP + 8 * i + g;   // tile i / 2, row g + 8 (i % 2)
                if (tok < N) out[(long long)bh * N + tok] = r[i];
            }
        }
        if (c_count) {  // list the tokens at or above the row's threshold (NaN too): one atomic per warp and group
            unsigned listed[8];
            int total = 0;
            #pragma unroll
            for (int i = 0; i < 8; ++i) {
                listed[i] = __ballot_sync(0xffffffffu, c == 0 && grp * GROUP + 8 * i + g < N && !(r[i] < thr));
                total += __popc(listed[i]);
            }
            if (total) {
                int at = 0;
                if (lane == 0) at = atomicAdd(c_count + bh, total);
                at = __shfl_sync(0xffffffffu, at, 0);
                #pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const int pos = at + __popc(listed[i] & ((1u << lane) - 1u));
                    if ((listed[i] >> lane) & 1u && pos < cap) {
                        c_index[(long long)bh * cap + pos] = grp * GROUP + 8 * i + g;
                        c_score[(long long)bh * cap + pos] = r[i];
                    }
                    at += __popc(listed[i]);
                }
            }
        }
    });
}

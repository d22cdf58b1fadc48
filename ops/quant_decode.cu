// quant_decode_attention kernels (ops/quant_decode_cuda.py compiles them with BITS, D, G, CT, S, STAGES, WARPS,
// qtype and vtype defined): a decode query's whole attention over packed 1/2-bit keys and values (layouts in
// ops/quant.py) in one pass over the packed bytes, split over the tokens (flash-decoding).
//
// quant_attn_partial: one block per (chunk of CT tokens, batch row and KV head), all G query heads of it. Each
// warp owns CT / WARPS consecutive tokens and walks them one 64-token key group at a time (the group's packed
// keys, values, scales and mins staged with cp.async, STAGES deep), flash-attention style, in registers:
//   1. the group's scores on the tensor cores: A = q * 2^e in fp16 (rows g, g + 8 = heads), B = code bit ?
//      scale : 0 (the code words rotated so that a lane's token bit is a byte's sign, which a byte permute
//      replicates into a mask over the scale), the min term seeding the accumulators;
//   2. an online softmax per head in log2 units: the running max m and sum l, the value accumulators rescaled
//      only when some lane's max grows; each probability splits into two fp16 parts, hi + lo;
//   3. the values on the tensor cores, A straight from the score accumulators (the C fragments of two 8-token
//      tiles are the A fragment of one 16-token tile): G <= 8: rows g = hi, g + 8 = lo of head g; G > 8: rows
//      g, g + 8 = heads g, g + 8, one MMA per part. B = code bit ? scale : 0 (bit 1 of a 2-bit code:
//      2 * scale); the tokens' mins one more MMA (B column = channel group). Positions from p - R on are staged
//      as zero codes and take their exact values from the ring (slot = position % (R + 1));
//   4. the warps' (m, l, sums) merged in shared memory into the block's.
// quant_attn_reduce: per (batch row, query head, 32 channels), the chunks merged in order: o = sum w_c acc_c /
// sum w_c l_c with w_c = exp(m_c - max m), lse = max m + log(sum w_c l_c). Deterministic, no atomics.
#define CPW (32 / BITS)
#define KT (D / 16)
#define KROWS (64 / CPW)            // key code word rows per 64-token group
#define NT (CPW / 8)                // 8-token MMA tiles per key word row
#define NTG 8                       // 8-token tiles per group
#define WPT (D / CPW)               // value code words per token
#define VG (D < 64 ? D : 64)        // channels per value scale group
#define NGD (D / VG)
#define NTILE (D / 8)               // 8-channel tiles of the value product
#define TPW (CPW / 8)               // 8-channel tiles per value word
#define TW (CT / WARPS)             // tokens per warp
#define RH (G > 8 ? 2 : 1)          // heads per lane (g, and g + 8 when G > 8), and value MMAs per tile: one
                                    // (rows g, g + 8 = hi, lo) or one per part (rows = heads)
#define OFF_KS (KROWS * D)          // a stage: key codes, D fp16 scales + D fp16 mins,
#define OFF_V (OFF_KS + D)          //   value codes [64][WPT],
#define OFF_VS (OFF_V + 64 * WPT)   //   value fp16 scales [64][NGD], then mins
#define STAGE_WORDS (OFF_VS + 64 * NGD)
#define MERGE_WORDS (WARPS * G * D + 2 * WARPS * G)   // after the walk: the warps' sums, maxima and totals
#define SMEM_WORDS (WARPS * STAGES * STAGE_WORDS > MERGE_WORDS ? WARPS * STAGES * STAGE_WORDS : MERGE_WORDS)
#define NTHR (WARPS * 32)
#define NEG_INF (-__int_as_float(0x7f800000))
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// fp16 pairs hi = (x, y), lo = (x, y) - hi
__device__ __forceinline__ void split_pair(float x, float y, unsigned& hi, unsigned& lo) {
    const __half2 h = __floats2half2_rn(x, y);
    const float2 f = __half22float2(h);
    const __half2 l = __floats2half2_rn(x - f.x, y - f.y);
    hi = *reinterpret_cast<const unsigned*>(&h);
    lo = *reinterpret_cast<const unsigned*>(&l);
}

__device__ __forceinline__ unsigned twice(unsigned s) {   // 2 * an fp16 pair (exact)
    __half2 h = *reinterpret_cast<__half2*>(&s);
    h = __hadd2(h, h);
    return *reinterpret_cast<unsigned*>(&h);
}

extern "C" __global__ void __launch_bounds__(NTHR, MINB) quant_attn_partial(
        const qtype* __restrict__ q, const long long qsb, const long long qsh,
        const unsigned* __restrict__ kcodes, const long long kcb, const long long kch,
        const __half* __restrict__ kscale, const long long ksb, const long long ksh,
        const __half* __restrict__ kmin, const long long kmb, const long long kmh,
        const unsigned* __restrict__ vcodes, const long long vcb, const long long vch,
        const __half* __restrict__ vscale, const long long vsb, const long long vsh,
        const __half* __restrict__ vmin, const long long vmb, const long long vmh,
        const vtype* __restrict__ ring, const long long rsb, const long long rsh,
        const long long* __restrict__ nk_ptr, const long long* __restrict__ p_ptr, const int R,
        float* __restrict__ part, float* __restrict__ pm, float* __restrict__ pl,
        const int Hkv, const int T, const float sm_scale) {
    __shared__ __align__(16) unsigned smem[SMEM_WORDS];
    __shared__ float wred[WARPS];
    const int chunk = gridDim.x - 1 - blockIdx.x;          // the last chunk (the ring's) starts first
    const int bh = blockIdx.y, b = bh / Hkv, kvh = bh % Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long nk = min(*nk_ptr, (long long)T), pos = *p_ptr;
    const long long vq = pos - R > 0 ? pos - R : 0;       // positions before it: quantized values
    const long long t0 = (long long)chunk * CT;
    float* acc_out = part + ((long long)chunk * gridDim.y + bh) * G * D;
    float* m_out = pm + ((long long)chunk * gridDim.y + bh) * G;
    float* l_out = pl + ((long long)chunk * gridDim.y + bh) * G;
    if (t0 >= nk) {
        for (int i = threadIdx.x; i < G * D; i += NTHR) acc_out[i] = 0.f;
        for (int i = threadIdx.x; i < G; i += NTHR) { m_out[i] = NEG_INF; l_out[i] = 0.f; }
        return;
    }

    // ---- q as MMA A fragments: rows g, g + 8 (heads past G: zero), k slots 2c, 2c+1, 2c+8, 2c+9 = channels
    //      16 kt + 4c + 0..3 (any order works if A and B agree) ----
    const qtype* qb = q + b * qsb + (long long)kvh * G * qsh;
    float amax = 0.f;
    for (int i = threadIdx.x; i < G * D; i += NTHR) amax = fmaxf(amax, fabsf(to_float(qb[(i / D) * qsh + i % D])));
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) wred[warp] = amax;
    __syncthreads();
    for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, wred[w]);
    int e = 0;  // q * 2^e has its largest |value| in [2^14, 2^15): fp16 keeps every bit of a bf16/fp16 q
    if (amax > 0.f) { int E; frexpf(amax, &E); e = 15 - E; }
    const float xs = ldexpf(sm_scale, -e) * LOG2E;         // accumulator -> score in log2 units
    unsigned qa[S][KT][4];
    #pragma unroll
    for (int s = 0; s < S; ++s)
    #pragma unroll
    for (int kt = 0; kt < KT; ++kt) {
        const int d = 16 * kt + 4 * c;
        #pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
            const int row = g + 8 * ri;
            float x[4];
            #pragma unroll
            for (int j = 0; j < 4; ++j) x[j] = row < G ? to_float(qb[row * qsh + d + j]) : 0.f;
            qa[s][kt][ri] = q_part(x[0], x[1], e, s);
            qa[s][kt][2 + ri] = q_part(x[2], x[3], e, s);
        }
    }

    // ---- each warp's tokens, group by group ----
    const long long w0 = t0 + (long long)warp * TW;
    const int nval = (int)max(0LL, min((long long)TW, nk - w0));
    const int ngrp = (nval + 63) / 64;
    unsigned* wst = smem + warp * STAGES * STAGE_WORDS;
    const unsigned* kc_b = kcodes + b * kcb + kvh * kch;
    const __half* ks_b = kscale + b * ksb + kvh * ksh;
    const __half* km_b = kmin + b * kmb + kvh * kmh;
    const unsigned* vc_b = vcodes + b * vcb + kvh * vch;
    const __half* vs_b = vscale + b * vsb + kvh * vsh;
    const __half* vm_b = vmin + b * vmb + kvh * vmh;
    const vtype* rg_b = ring + b * rsb + kvh * rsh;

    float o[NTILE][4], macc[4], m_run[RH], l_run[RH];
    #pragma unroll
    for (int nt = 0; nt < NTILE; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    macc[0] = macc[1] = macc[2] = macc[3] = 0.f;
    #pragma unroll
    for (int r = 0; r < RH; ++r) { m_run[r] = NEG_INF; l_run[r] = 0.f; }
    unsigned rot[BITS];   // key token / value channel 8t + g: bit pb lands on the sign bit of byte t * BITS
    #pragma unroll
    for (int pb = 0; pb < BITS; ++pb) rot[pb] = (unsigned)(7 - BITS * g - pb) & 31u;

    auto issue = [&](int i) {
        unsigned* st = wst + (i % STAGES) * STAGE_WORDS;
        const long long tg = w0 + 64LL * i;
        const int nv = (int)max(0LL, min(64LL, vq - tg));                   // quantized values in the group
        stage_copy<16>(st, kc_b + (tg / CPW) * D, KROWS * D * 4, KROWS * D * 4, lane);
        stage_copy<16>(st + OFF_KS, ks_b + (tg / 64) * D, D * 2, D * 2, lane);
        stage_copy<16>(st + OFF_KS + D / 2, km_b + (tg / 64) * D, D * 2, D * 2, lane);
        stage_copy<16>(st + OFF_V, vc_b + tg * WPT, 64 * WPT * 4, nv * WPT * 4, lane);
        stage_copy<16>(st + OFF_VS, vs_b + tg * NGD, 64 * NGD * 2, nv * NGD * 2, lane);
        stage_copy<16>(st + OFF_VS + 32 * NGD, vm_b + tg * NGD, 64 * NGD * 2, nv * NGD * 2, lane);
    };

    auto body = [&](int i) {
        const unsigned* st = wst + (i % STAGES) * STAGE_WORDS;
        const long long tg = w0 + 64LL * i;
        // ---- 1. scores: x[nt][j] for tokens tg + 8 nt + 2c + (j & 1), rows g (j < 2), g + 8 (j >= 2) ----
        const __half* ks = reinterpret_cast<const __half*>(st + OFF_KS);
        const __half* km = ks + D;
        float bias[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
            const uint2 mn = *reinterpret_cast<const uint2*>(km + 16 * kt + 4 * c);
            #pragma unroll
            for (int s = 0; s < S; ++s) mma_f16(bias, qa[s][kt], mn.x, mn.y);
        }
        float x[NTG][4];
        #pragma unroll
        for (int rr = 0; rr < KROWS; ++rr) {
            float acc[NT][BITS][4];
            #pragma unroll
            for (int t = 0; t < NT; ++t)
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                acc[t][0][j] = bias[j];
                if (BITS == 2) acc[t][BITS - 1][j] = 0.f;
            }
            #pragma unroll
            for (int kt = 0; kt < KT; ++kt) {
                const uint4 w = *reinterpret_cast<const uint4*>(st + rr * D + 16 * kt + 4 * c);
                const uint2 sp = *reinterpret_cast<const uint2*>(ks + 16 * kt + 4 * c);
                #pragma unroll
                for (int pb = 0; pb < BITS; ++pb) {
                    const unsigned w0r = rotl(w.x, rot[pb]), w1r = rotl(w.y, rot[pb]);
                    const unsigned w2r = rotl(w.z, rot[pb]), w3r = rotl(w.w, rot[pb]);
                    #pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        const unsigned bi = t * BITS;
                        const unsigned sel = (8u | bi) | ((8u | bi) << 4) | ((12u | bi) << 8) | ((12u | bi) << 12);
                        const unsigned m0 = prmt(w0r, w1r, sel) & sp.x, m1 = prmt(w2r, w3r, sel) & sp.y;
                        #pragma unroll
                        for (int s = 0; s < S; ++s) mma_f16(acc[t][pb], qa[s][kt], m0, m1);
                    }
                }
            }
            #pragma unroll
            for (int t = 0; t < NT; ++t)
            #pragma unroll
            for (int j = 0; j < 4; ++j)
                x[rr * NT + t][j] = (acc[t][0][j] + (BITS == 2 ? 2.f * acc[t][BITS - 1][j] : 0.f)) * xs;
        }
        if (tg + 64 > nk) {
            #pragma unroll
            for (int nt = 0; nt < NTG; ++nt)
            #pragma unroll
            for (int j = 0; j < 4; ++j)
                if (tg + 8 * nt + 2 * c + (j & 1) >= nk) x[nt][j] = NEG_INF;
        }

        // ---- 2. online softmax per head ----
        float p[NTG][RH][2];
        bool grows = false;
        float m_new[RH];
        #pragma unroll
        for (int r = 0; r < RH; ++r) {
            float gm = NEG_INF;
            #pragma unroll
            for (int nt = 0; nt < NTG; ++nt) gm = fmaxf(gm, fmaxf(x[nt][2 * r], x[nt][2 * r + 1]));
            gm = fmaxf(gm, __shfl_xor_sync(0xffffffffu, gm, 1));
            gm = fmaxf(gm, __shfl_xor_sync(0xffffffffu, gm, 2));
            m_new[r] = fmaxf(m_run[r], gm);
            grows |= m_new[r] > m_run[r];
        }
        if (__any_sync(0xffffffffu, grows)) {
            float f[RH];
            #pragma unroll
            for (int r = 0; r < RH; ++r) {
                f[r] = ex2(m_run[r] - m_new[r]);   // the first group: ex2(-inf) = 0
                l_run[r] *= f[r];
                m_run[r] = m_new[r];
            }
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float fj = f[RH == 1 ? 0 : j / 2];
                macc[j] *= fj;
                #pragma unroll
                for (int nt = 0; nt < NTILE; ++nt) o[nt][j] *= fj;
            }
        }
        #pragma unroll
        for (int nt = 0; nt < NTG; ++nt)
        #pragma unroll
        for (int r = 0; r < RH; ++r)
        #pragma unroll
        for (int j = 0; j < 2; ++j) {
            p[nt][r][j] = ex2(x[nt][2 * r + j] - m_run[r]);
            l_run[r] += p[nt][r][j];
        }

        // ---- 3. values: 16-token tiles u, this lane's tokens ta, ta + 1 (b0) and ta + 8, ta + 9 (b1) ----
        const unsigned* vw = st + OFF_V;                       // [64][WPT]
        const __half* vs = reinterpret_cast<const __half*>(st + OFF_VS);
        const __half* vm = vs + 64 * NGD;
        #pragma unroll
        for (int u = 0; u < 4; ++u) {
            unsigned af[RH][4];
            if (RH == 1) {
                split_pair(p[2 * u][0][0], p[2 * u][0][1], af[0][0], af[0][1]);
                split_pair(p[2 * u + 1][0][0], p[2 * u + 1][0][1], af[0][2], af[0][3]);
            } else {
                #pragma unroll
                for (int h = 0; h < 2; ++h)
                #pragma unroll
                for (int r = 0; r < 2; ++r)
                    split_pair(p[2 * u + h][r % RH][0], p[2 * u + h][r % RH][1], af[0][2 * h + r],
                               af[RH - 1][2 * h + r]);
            }
            const int ta = 16 * u + 2 * c;
            unsigned wv[4][WPT];                               // the code words of tokens ta, ta + 1, ta + 8, ta + 9
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned* row = vw + (ta + (j & 1) + 8 * (j >> 1)) * WPT;
                #pragma unroll
                for (int k = 0; k < WPT; k += (WPT % 4 ? 2 : 4)) {
                    if (WPT % 4) {
                        const uint2 x2 = *reinterpret_cast<const uint2*>(row + k);
                        wv[j][k] = x2.x; wv[j][k + 1] = x2.y;
                    } else {
                        const uint4 x4 = *reinterpret_cast<const uint4*>(row + k);
                        wv[j][k] = x4.x; wv[j][k + 1] = x4.y; wv[j][k + 2] = x4.z; wv[j][k + 3] = x4.w;
                    }
                }
            }
            unsigned sc[2][NGD], mc[2][NGD];                   // {scale, scale} of (ta, ta + 1), (ta + 8, ta + 9)
            #pragma unroll
            for (int hf = 0; hf < 2; ++hf) {
                const int tk = ta + 8 * hf;
                if (NGD == 1) {
                    sc[hf][0] = *reinterpret_cast<const unsigned*>(vs + tk);
                    mc[hf][0] = *reinterpret_cast<const unsigned*>(vm + tk);
                } else {                                       // a word holds groups 0, 1 of one token
                    const uint2 s2 = *reinterpret_cast<const uint2*>(vs + tk * NGD);
                    const uint2 m2 = *reinterpret_cast<const uint2*>(vm + tk * NGD);
                    sc[hf][0] = prmt(s2.x, s2.y, 0x5410u); sc[hf][NGD - 1] = prmt(s2.x, s2.y, 0x7632u);
                    mc[hf][0] = prmt(m2.x, m2.y, 0x5410u); mc[hf][NGD - 1] = prmt(m2.x, m2.y, 0x7632u);
                }
            }
            unsigned sc2[2][NGD];                              // bit 1 of a 2-bit code weighs 2 * scale (exact)
            #pragma unroll
            for (int hf = 0; hf < 2; ++hf)
            #pragma unroll
            for (int gd = 0; gd < NGD; ++gd) sc2[hf][gd] = BITS == 2 ? twice(sc[hf][gd]) : sc[hf][gd];
            {   // the mins: B column n = channel group n
                const unsigned b0 = g == 0 ? mc[0][0] : (NGD > 1 && g == 1) ? mc[0][NGD - 1] : 0u;
                const unsigned b1 = g == 0 ? mc[1][0] : (NGD > 1 && g == 1) ? mc[1][NGD - 1] : 0u;
                #pragma unroll
                for (int pp = 0; pp < RH; ++pp) mma_f16(macc, af[pp], b0, b1);
            }
            #pragma unroll
            for (int k = 0; k < WPT; ++k) {
                #pragma unroll
                for (int pb = 0; pb < BITS; ++pb) {
                    const unsigned r0 = rotl(wv[0][k], rot[pb]), r1 = rotl(wv[1][k], rot[pb]);
                    const unsigned r2 = rotl(wv[2][k], rot[pb]), r3 = rotl(wv[3][k], rot[pb]);
                    #pragma unroll
                    for (int tt = 0; tt < TPW; ++tt) {
                        const int nt = k * TPW + tt, gd = nt * 8 / VG;
                        const unsigned bi = tt * BITS;
                        const unsigned sel = (8u | bi) | ((8u | bi) << 4) | ((12u | bi) << 8) | ((12u | bi) << 12);
                        const unsigned s0 = pb ? sc2[0][gd] : sc[0][gd], s1 = pb ? sc2[1][gd] : sc[1][gd];
                        const unsigned b0 = prmt(r0, r1, sel) & s0, b1 = prmt(r2, r3, sel) & s1;
                        #pragma unroll
                        for (int pp = 0; pp < RH; ++pp) mma_f16(o[nt], af[pp], b0, b1);
                    }
                }
            }
        }

        // ---- positions from p - R on: their exact values from the ring ----
        if (tg + 64 > vq) {
            #pragma unroll
            for (int nt = 0; nt < NTG; ++nt)
            for (int cc = 0; cc < 4; ++cc)
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                const long long tok = tg + 8 * nt + 2 * cc + j;
                if (tok < vq || tok >= nk) continue;
                float pv[RH];
                #pragma unroll
                for (int r = 0; r < RH; ++r) pv[r] = __shfl_sync(0xffffffffu, p[nt][r][j], 4 * g + cc);
                const vtype* row = rg_b + (tok % (R + 1)) * D + 2 * c;
                #pragma unroll
                for (int n2 = 0; n2 < NTILE; ++n2) {
                    const float v0 = to_float(row[8 * n2]), v1 = to_float(row[8 * n2 + 1]);
                    o[n2][0] += pv[0] * v0; o[n2][1] += pv[0] * v1;
                    if (RH == 2) { o[n2][2] += pv[RH - 1] * v0; o[n2][3] += pv[RH - 1] * v1; }
                }
            }
        }
    };
    warp_pipeline<STAGES>(ngrp, issue, body);

    // ---- 4. the warp's sums per head (row set r: head g + 8 r), then the block's ----
    float mt[RH][NGD];                                         // the min term per head and channel group
    #pragma unroll
    for (int r = 0; r < RH; ++r) {
        l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
        l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
        #pragma unroll
        for (int gd = 0; gd < NGD; ++gd) {
            const float v = RH == 1 ? macc[gd] + macc[2 + gd] : macc[2 * r + gd];   // lane c = 0: columns 0, 1
            mt[r][gd] = __shfl_sync(0xffffffffu, v, 4 * g);
        }
    }
    __syncthreads();   // every warp is done with its stages: they become the warps' sums
    float* wo = reinterpret_cast<float*>(smem);                // [WARPS][G][D]
    float* wm = wo + WARPS * G * D;                            // [WARPS][G]
    float* wl = wm + WARPS * G;
    #pragma unroll
    for (int r = 0; r < RH; ++r) {
        const int h = g + 8 * r;
        if (h < G) {
            #pragma unroll
            for (int nt = 0; nt < NTILE; ++nt)
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                const float v = RH == 1 ? o[nt][j] + o[nt][2 + j] : o[nt][2 * r + j];
                wo[(warp * G + h) * D + 8 * nt + 2 * c + j] = v + mt[r][nt * 8 / VG];
            }
            if (c == 0) { wm[warp * G + h] = m_run[r]; wl[warp * G + h] = l_run[r]; }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += NTHR) {
        const int h = i / D;
        float M = NEG_INF;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, wm[w * G + h]);
        float O = 0.f, L = 0.f;
        if (M != NEG_INF) {
            #pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float f = ex2(wm[w * G + h] - M);
                O += f * wo[(w * G + h) * D + i % D];
                L += f * wl[w * G + h];
            }
        }
        acc_out[i] = O;
        if (i % D == 0) { m_out[h] = M == NEG_INF ? NEG_INF : M * LN2; l_out[h] = L; }
    }
}

// per (batch row and query head, 32 channels): the chunks merged in order -> o [B*Hq, D], lse [B*Hq]
#define RWARPS 8
extern "C" __global__ void __launch_bounds__(RWARPS * 32) quant_attn_reduce(
        const float* __restrict__ part, const float* __restrict__ pm, const float* __restrict__ pl,
        float* __restrict__ out, float* __restrict__ lse, const int chunks, const int Hkv) {
    __shared__ float sm_m[RWARPS], sm_l[RWARPS], sm_o[RWARPS][32];
    const int bq = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, d = 32 * blockIdx.y + lane;
    const int b = bq / (Hkv * G), hq = bq % (Hkv * G);
    const long long bh = (long long)b * Hkv + hq / G, h = hq % G;
    const long long nbh = (long long)gridDim.x / G;            // B * Hkv
    float M = NEG_INF;
    for (int k = threadIdx.x; k < chunks; k += RWARPS * 32) M = fmaxf(M, pm[(k * nbh + bh) * G + h]);
    for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    if (lane == 0) sm_m[warp] = M;
    __syncthreads();
    for (int w = 0; w < RWARPS; ++w) M = fmaxf(M, sm_m[w]);
    float L = 0.f, o = 0.f;
    if (M != NEG_INF) {
        #pragma unroll 4
        for (int k = warp; k < chunks; k += RWARPS) {
            const long long i = (k * nbh + bh) * G + h;
            const float m = pm[i];
            const float w = m == NEG_INF ? 0.f : expf(m - M);
            L += w * pl[i];
            o += w * (d < D ? part[i * D + d] : 0.f);
        }
    }
    if (lane == 0) sm_l[warp] = L;
    sm_o[warp][lane] = o;
    __syncthreads();
    if (warp == 0) {
        float Ls = 0.f, os = 0.f;
        for (int w = 0; w < RWARPS; ++w) { Ls += sm_l[w]; os += sm_o[w][lane]; }
        if (d < D) out[(long long)bq * D + d] = Ls > 0.f ? os / Ls : 0.f;
        if (blockIdx.y == 0 && lane == 0) lse[bq] = Ls > 0.f ? M + logf(Ls) : NEG_INF;
    }
}

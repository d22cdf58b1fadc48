// quant_decode_attention kernels (ops/quant_decode_cuda.py compiles them with BITS, D, G, CT, S, MTV, WARPS,
// qtype and vtype defined): a decode query's whole attention over packed 1/2-bit keys and values (layouts in
// ops/quant.py) in one pass over the packed bytes, split over the tokens (flash-decoding).
//
// quant_attn_partial: one block per (chunk of CT tokens, batch row and KV head), all G query heads of it:
//   0. the chunk's packed keys and values go to shared memory at once (two cp.async groups), so the loads of a
//      block are all in flight while its query fragments are built;
//   1. scores of the chunk's 64-token key groups on the tensor cores (A = q * 2^e in fp16, B = code bit ? scale
//      : 0, the min term seeding the accumulators), into shared memory;
//   2. per head the chunk's max m and sum l of exp(score - m); each score becomes its exponential split into
//      two fp16 parts (hi, lo) in place;
//   3. the values on the tensor cores for positions before p - R: A rows part * G + head = the exponentials'
//      parts, B = code bit ? scale : 0 (bit 1 of a 2-bit code: 2 * scale), and one more product with B = the
//      tokens' mins; positions from p - R on take their exact values from the ring (slot = position % (R + 1));
//   4. the block's sum [G, D] (each warp owns NTILE / WARPS 8-channel tiles of the value product), m and l.
// quant_attn_reduce: per (batch row, query head, 32 channels), the chunks merged in order: o = sum w_c acc_c /
// sum w_c l_c with w_c = exp(m_c - max m), lse = max m + log(sum w_c l_c). Deterministic, no atomics.
#define CPW (32 / BITS)
#define KT (D / 16)
#define KROWS (64 / CPW)            // key code word rows per 64-token group
#define NT (CPW / 8)                // 8-token MMA tiles per key word row
#define WPT (D / CPW)               // value code words per token
#define VG (D < 64 ? D : 64)        // channels per value scale group
#define NGD (D / VG)
#define NTILE (D / 8)
#define TPW (CPW / 8)               // 8-channel tiles per value word
#define NKG (CT / 64)               // key groups per chunk
#define KSTAGE (KROWS * D + D)      // words: a key group's codes, then D fp16 scales and D fp16 mins
#define OFF_V (NKG * KSTAGE)        // the chunk's value codes (CT * WPT words)
#define OFF_VS (OFF_V + CT * WPT)   // their fp16 scales [CT][NGD], then mins
#define OFF_VM (OFF_VS + CT * NGD / 2)
#define STAGE_WORDS (OFF_VM + CT * NGD / 2)
#define ROWS (2 * G)                // value product rows: part * G + head
#define RING_WORDS (WARPS * G * D)  // after the values: the warps' ring sums, then the block's sums
#define RED_WORDS (ROWS * (D + 1) + ROWS * NGD)
#define UNION_WORDS (STAGE_WORDS > RING_WORDS + RED_WORDS ? STAGE_WORDS : RING_WORDS + RED_WORDS)
#define NTHR (WARPS * 32)
#define NEG_INF (-__int_as_float(0x7f800000))

extern "C" __global__ void __launch_bounds__(NTHR) quant_attn_partial(
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
    __shared__ __align__(16) unsigned smem[UNION_WORDS];
    __shared__ __align__(16) float sc[G][CT];
    __shared__ float wred[WARPS];
    const int chunk = gridDim.x - 1 - blockIdx.x;          // the last chunk (the ring's) starts first
    const int bh = blockIdx.y, b = bh / Hkv, kvh = bh % Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long nk = min(*nk_ptr, (long long)T), pos = *p_ptr;
    const long long vq = pos - R > 0 ? pos - R : 0;       // positions before it: quantized values
    const int t0 = chunk * CT;
    const int n_here = (int)max(0LL, min((long long)CT, nk - t0));                 // key positions < nk
    const int nq = (int)max(0LL, min((long long)n_here, vq - t0));                 // of which quantized values
    float* acc_out = part + ((long long)chunk * gridDim.y + bh) * G * D;
    float* m_out = pm + ((long long)chunk * gridDim.y + bh) * G;
    float* l_out = pl + ((long long)chunk * gridDim.y + bh) * G;
    if (n_here == 0) {
        for (int i = threadIdx.x; i < G * D; i += NTHR) acc_out[i] = 0.f;
        for (int i = threadIdx.x; i < G; i += NTHR) { m_out[i] = NEG_INF; l_out[i] = 0.f; }
        return;
    }

    // ---- 0. the chunk's packed keys (group 0) and values (group 1) to shared memory ----
    const int ngrp = (n_here + 63) / 64, ntile = (nq + 15) / 16;
    {
        const unsigned* kc = kcodes + b * kcb + kvh * kch + (long long)(t0 / 64) * KROWS * D;
        const __half* ks = kscale + b * ksb + kvh * ksh + (long long)(t0 / 64) * D;
        const __half* km = kmin + b * kmb + kvh * kmh + (long long)(t0 / 64) * D;
        constexpr int KU = KROWS * D / 4, SU = D / 8;     // 16-byte units of a group's codes / scales
        for (int u = threadIdx.x; u < ngrp * KU; u += NTHR)
            cp_async16(smem + (u / KU) * KSTAGE + 4 * (u % KU), kc + (long long)(u / KU) * KROWS * D + 4 * (u % KU), 16);
        for (int u = threadIdx.x; u < ngrp * SU; u += NTHR) {
            const int gi = u / SU, j = u % SU;
            cp_async16(smem + gi * KSTAGE + KROWS * D + 4 * j, ks + (long long)gi * D + 8 * j, 16);
            cp_async16(smem + gi * KSTAGE + KROWS * D + D / 2 + 4 * j, km + (long long)gi * D + 8 * j, 16);
        }
        cp_async_commit();
        const long long tv = t0;
        stage_copy<16>(smem + OFF_V, vcodes + b * vcb + kvh * vch + tv * WPT, ntile * 16 * WPT * 4, nq * WPT * 4,
                       threadIdx.x, NTHR);
        stage_copy<16>(smem + OFF_VS, vscale + b * vsb + kvh * vsh + tv * NGD, ntile * 32 * NGD, nq * NGD * 2,
                       threadIdx.x, NTHR);
        stage_copy<16>(smem + OFF_VM, vmin + b * vmb + kvh * vmh + tv * NGD, ntile * 32 * NGD, nq * NGD * 2,
                       threadIdx.x, NTHR);
        cp_async_commit();
    }

    // ---- 1. scores ----
    const qtype* qb = q + b * qsb + (long long)kvh * G * qsh;
    float amax = 0.f;
    for (int i = threadIdx.x; i < G * D; i += NTHR) amax = fmaxf(amax, fabsf(to_float(qb[(i / D) * qsh + i % D])));
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) wred[warp] = amax;
    __syncthreads();
    for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, wred[w]);
    int e = 0;  // q * 2^e has its largest |value| in [2^14, 2^15): fp16 keeps every bit of a bf16/fp16 q
    if (amax > 0.f) { int E; frexpf(amax, &E); e = 15 - E; }
    const float mult = ldexpf(sm_scale, -e);
    unsigned a[S][KT][4];
    {
        const int r0 = g, r1 = g + 8;
        #pragma unroll
        for (int s = 0; s < S; ++s)
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
            const int d = 16 * kt + 4 * c;
            float x0[4], x1[4];
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                x0[j] = r0 < G ? to_float(qb[r0 * qsh + d + j]) : 0.f;
                x1[j] = r1 < G ? to_float(qb[r1 * qsh + d + j]) : 0.f;
            }
            a[s][kt][0] = q_part(x0[0], x0[1], e, s);
            a[s][kt][1] = q_part(x1[0], x1[1], e, s);
            a[s][kt][2] = q_part(x0[2], x0[3], e, s);
            a[s][kt][3] = q_part(x1[2], x1[3], e, s);
        }
    }
    cp_async_wait<1>();
    __syncthreads();
    for (int lgrp = warp; lgrp < ngrp; lgrp += WARPS) {
        const unsigned* st = smem + lgrp * KSTAGE;
        const __half* ss = reinterpret_cast<const __half*>(st + KROWS * D);
        const __half* sm = ss + D;
        float bias[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
            const uint2 mn = *reinterpret_cast<const uint2*>(sm + 16 * kt + 4 * c);
            #pragma unroll
            for (int s = 0; s < S; ++s) mma_f16(bias, a[s][kt], mn.x, mn.y);
        }
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
                const uint2 sp = *reinterpret_cast<const uint2*>(ss + 16 * kt + 4 * c);
                #pragma unroll
                for (int pb = 0; pb < BITS; ++pb) {
                    // token 8t+g's bit pb lands on the sign bit of byte t*BITS
                    const unsigned rot = (unsigned)(7 - BITS * g - pb) & 31u;
                    const unsigned w0 = rotl(w.x, rot), w1 = rotl(w.y, rot), w2 = rotl(w.z, rot), w3 = rotl(w.w, rot);
                    #pragma unroll
                    for (int t = 0; t < NT; ++t) {
                        const unsigned bi = t * BITS;
                        const unsigned sel = (8u | bi) | ((8u | bi) << 4) | ((12u | bi) << 8) | ((12u | bi) << 12);
                        const unsigned m0 = prmt(w0, w1, sel) & sp.x, m1 = prmt(w2, w3, sel) & sp.y;
                        #pragma unroll
                        for (int s = 0; s < S; ++s) mma_f16(acc[t][pb], a[s][kt], m0, m1);
                    }
                }
            }
            #pragma unroll
            for (int t = 0; t < NT; ++t) {
                const int tl = lgrp * 64 + rr * CPW + 8 * t + 2 * c;   // chunk-local token of v[0] (v[1]: +1)
                const long long tg = (long long)t0 + tl;
                float v[4];
                #pragma unroll
                for (int j = 0; j < 4; ++j)
                    v[j] = (acc[t][0][j] + (BITS == 2 ? 2.f * acc[t][BITS - 1][j] : 0.f)) * mult;
                if (g < G) {
                    sc[g][tl] = tg < nk ? v[0] : NEG_INF;
                    sc[g][tl + 1] = tg + 1 < nk ? v[1] : NEG_INF;
                }
                if (g + 8 < G) {
                    sc[g + 8][tl] = tg < nk ? v[2] : NEG_INF;
                    sc[g + 8][tl + 1] = tg + 1 < nk ? v[3] : NEG_INF;
                }
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // ---- 2. per head: max, sum of exponentials; each score becomes its exponential as fp16 {hi, lo} ----
    unsigned (*ex)[CT] = reinterpret_cast<unsigned (*)[CT]>(&sc[0][0]);
    const int n16 = (n_here + 15) & ~15;
    for (int h = warp; h < G; h += WARPS) {
        float mx = NEG_INF;
        for (int i = lane; i < n_here; i += 32) mx = fmaxf(mx, sc[h][i]);
        for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float sum = 0.f;
        for (int i = lane; i < n16; i += 32) {
            const float x = i < n_here ? expf(sc[h][i] - mx) : 0.f;
            const __half hi = __float2half_rn(x), lo = __float2half_rn(x - __half2float(hi));
            __half2 hl = __halves2half2(hi, lo);
            ex[h][i] = *reinterpret_cast<unsigned*>(&hl);
            sum += x;
        }
        for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) { m_out[h] = mx; l_out[h] = sum; }
    }
    __syncthreads();

    // ---- 3. values quantized before vq, each warp its NPW 8-channel tiles over every 16-token tile: this lane's
    //      tokens of a tile are 4c .. 4c+3 (A's k slots 2c, 2c+1, 2c+8, 2c+9 and B's the same, a permutation of
    //      the 16 tokens that both operands share) ----
    constexpr int NPW = NTILE / WARPS;                         // 8-channel tiles per warp
    constexpr int TPK = NPW < TPW ? NPW : TPW, KPW = NPW / TPK;   // per code word, words per warp
    const int nt0 = warp * NPW, k0 = nt0 / TPW, tw0 = nt0 % TPW;
    const int gdw = nt0 * 8 / VG;                              // the warp's value scale group
    const bool min_warp = (nt0 * 8) % VG == 0;                 // the group's first warp adds the min term
    float vacc[MTV][NPW][4], macc[MTV][4];
    #pragma unroll
    for (int mt = 0; mt < MTV; ++mt) {
        #pragma unroll
        for (int j = 0; j < 4; ++j) macc[mt][j] = 0.f;
        #pragma unroll
        for (int i = 0; i < NPW; ++i) vacc[mt][i][0] = vacc[mt][i][1] = vacc[mt][i][2] = vacc[mt][i][3] = 0.f;
    }
    int arow[MTV][2];                                          // head of A row 16 mt + g (+ 8), -1 past 2G
    unsigned asel[MTV][2];                                     // its part's halves of two {hi, lo} words
    #pragma unroll
    for (int mt = 0; mt < MTV; ++mt)
    #pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
        const int r = 16 * mt + g + 8 * ri;
        arow[mt][ri] = r < ROWS ? r % G : -1;
        asel[mt][ri] = r < G ? 0x5410u : 0x7632u;
    }
    unsigned rot[BITS];
    #pragma unroll
    for (int pb = 0; pb < BITS; ++pb) rot[pb] = (unsigned)(7 - BITS * g - pb) & 31u;
    const unsigned gsel = gdw & 1 ? 0x7632u : 0x5410u;
    const unsigned* vst = smem + OFF_V;
    const __half* vss = reinterpret_cast<const __half*>(smem + OFF_VS);
    const __half* vsm = reinterpret_cast<const __half*>(smem + OFF_VM);
    for (int tile = 0; tile < ntile; ++tile) {
        const int tk = 16 * tile + 4 * c;                      // this lane's first token
        unsigned af[MTV][4];
        #pragma unroll
        for (int mt = 0; mt < MTV; ++mt)
        #pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
            if (arow[mt][ri] >= 0) {
                const uint4 x = *reinterpret_cast<const uint4*>(&ex[arow[mt][ri]][tk]);
                af[mt][ri] = prmt(x.x, x.y, asel[mt][ri]);
                af[mt][2 + ri] = prmt(x.z, x.w, asel[mt][ri]);
            } else {
                af[mt][ri] = af[mt][2 + ri] = 0u;
            }
        }
        unsigned sp[2], mp[2];                                 // {scale, scale} of tokens (4c, 4c+1), (4c+2, 4c+3)
        if (NGD == 1) {
            const uint2 s2 = *reinterpret_cast<const uint2*>(vss + tk);
            sp[0] = s2.x; sp[1] = s2.y;
            if (min_warp) { const uint2 m2 = *reinterpret_cast<const uint2*>(vsm + tk); mp[0] = m2.x; mp[1] = m2.y; }
        } else {                                               // a word holds groups 0, 1 of one token
            const uint4 s4 = *reinterpret_cast<const uint4*>(vss + tk * NGD);
            sp[0] = prmt(s4.x, s4.y, gsel); sp[1] = prmt(s4.z, s4.w, gsel);
            if (min_warp) {
                const uint4 m4 = *reinterpret_cast<const uint4*>(vsm + tk * NGD);
                mp[0] = prmt(m4.x, m4.y, gsel); mp[1] = prmt(m4.z, m4.w, gsel);
            }
        }
        if (min_warp) {                                        // B's column 0: the tokens' mins
            const unsigned b0 = g == 0 ? mp[0] : 0u, b1 = g == 0 ? mp[1] : 0u;
            #pragma unroll
            for (int mt = 0; mt < MTV; ++mt) mma_f16(macc[mt], af[mt], b0, b1);
        }
        unsigned s2x[2] = {sp[0], sp[1]};                      // bit 1 of a 2-bit code weighs 2 * scale (exact)
        if (BITS == 2) {
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                __half2 h = *reinterpret_cast<__half2*>(&s2x[j]);
                h = __hadd2(h, h);
                s2x[j] = *reinterpret_cast<unsigned*>(&h);
            }
        }
        #pragma unroll
        for (int kk = 0; kk < KPW; ++kk) {
            unsigned w[4];
            #pragma unroll
            for (int j = 0; j < 4; ++j) w[j] = vst[(tk + j) * WPT + k0 + kk];
            #pragma unroll
            for (int pb = 0; pb < BITS; ++pb) {
                // channel 8 t + g of the word's tile t: its bit pb lands on the sign bit of byte t * BITS
                const unsigned w0 = rotl(w[0], rot[pb]), w1 = rotl(w[1], rot[pb]);
                const unsigned w2 = rotl(w[2], rot[pb]), w3 = rotl(w[3], rot[pb]);
                const unsigned s0 = pb ? s2x[0] : sp[0], s1 = pb ? s2x[1] : sp[1];
                #pragma unroll
                for (int tt = 0; tt < TPK; ++tt) {
                    const unsigned bi = (tw0 + tt) * BITS;
                    const unsigned sel = (8u | bi) | ((8u | bi) << 4) | ((12u | bi) << 8) | ((12u | bi) << 12);
                    const unsigned b0 = prmt(w0, w1, sel) & s0, b1 = prmt(w2, w3, sel) & s1;
                    #pragma unroll
                    for (int mt = 0; mt < MTV; ++mt) mma_f16(vacc[mt][kk * TPK + tt], af[mt], b0, b1);
                }
            }
        }
    }
    __syncthreads();   // the staging memory becomes the ring's and the warps' sums

    // ---- the ring's exact values for positions vq .. nk of this chunk: warps split tokens, lanes channels ----
    float* rsum = reinterpret_cast<float*>(smem);            // [WARPS][G][D]
    const bool has_ring = nq < n_here;
    if (has_ring) {
        constexpr int CPL = D / 32;
        float racc[G][CPL];
        #pragma unroll
        for (int h = 0; h < G; ++h)
        #pragma unroll
        for (int j = 0; j < CPL; ++j) racc[h][j] = 0.f;
        const vtype* rbase = ring + b * rsb + kvh * rsh;
        for (int tk = nq + warp; tk < n_here; tk += WARPS) {
            const vtype* row = rbase + (long long)((t0 + tk) % (R + 1)) * D + CPL * lane;
            float v[CPL];
            #pragma unroll
            for (int j = 0; j < CPL; ++j) v[j] = to_float(row[j]);
            #pragma unroll
            for (int h = 0; h < G; ++h) {
                const __half2 hl = *reinterpret_cast<const __half2*>(&ex[h][tk]);
                const float pw = __low2float(hl) + __high2float(hl);
                #pragma unroll
                for (int j = 0; j < CPL; ++j) racc[h][j] += pw * v[j];
            }
        }
        #pragma unroll
        for (int h = 0; h < G; ++h)
        #pragma unroll
        for (int j = 0; j < CPL; ++j) rsum[(warp * G + h) * D + CPL * lane + j] = racc[h][j];
    }

    // ---- 4. the block's sum: each warp stores its channels of every row ----
    float (*red)[D + 1] = reinterpret_cast<float (*)[D + 1]>(smem + RING_WORDS);
    float (*redm)[NGD] = reinterpret_cast<float (*)[NGD]>(smem + RING_WORDS + ROWS * (D + 1));
    #pragma unroll
    for (int mt = 0; mt < MTV; ++mt)
    #pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
        const int r = 16 * mt + g + 8 * ri;
        if (r < ROWS) {
            #pragma unroll
            for (int i = 0; i < NPW; ++i)
            #pragma unroll
            for (int j = 0; j < 2; ++j) red[r][8 * (nt0 + i) + 2 * c + j] = vacc[mt][i][2 * ri + j];
            if (min_warp && c == 0) redm[r][gdw] = macc[mt][2 * ri];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += NTHR) {
        const int h = i / D, d = i % D;
        float ring_sum = 0.f;
        if (has_ring)
            for (int w = 0; w < WARPS; ++w) ring_sum += rsum[(w * G + h) * D + d];
        acc_out[i] = ((red[h][d] + red[G + h][d]) + (redm[h][d / VG] + redm[G + h][d / VG])) + ring_sum;
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

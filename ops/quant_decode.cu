// quant_decode_attention kernels (ops/quant_decode_cuda.py compiles them with BITS, D, G, CT, S, MTV, qtype,
// vtype, WARPS and STAGES defined): a decode query's whole attention over packed 1/2-bit keys and values
// (layouts in ops/quant.py) in one pass over the packed bytes, split over the tokens (flash-decoding).
// 
// quant_attn_partial: one block per (chunk of CT tokens, batch row and KV head), all G query heads of it:
//   1. scores of the chunk's 64-token key groups on the tensor cores, as qk_quant computes them (A = q * 2^e in
//      fp16, B = code bit ? scale : 0, the min term seeding the accumulators), into shared memory; positions
//      >= nk are -inf;
//   2. per head the chunk's max m and sum l of exp(score - m); the scores become those exponentials;
//   3. the values, as av_quant computes them (A = p * scale in three bf16 parts, B = the codes; the min term on
//      the CUDA cores) for positions before p - R, and from the exact ring (slot = position % (R + 1)) after;
//   4. the block's sum [G, D] (warps added in a fixed order), m and l.
// quant_attn_reduce: per (batch row, query head), the chunks merged in order: o = sum w_c acc_c / sum w_c l_c with
// w_c = exp(m_c - max m), lse = max m + log(sum w_c l_c). Deterministic, no atomics.
#define CPW (32 / BITS)
#define KT (D / 16)
#define KROWS (64 / CPW)            // key code word rows per 64-token group
#define NT (CPW / 8)                // 8-token MMA tiles per key word row
#define WPT (D / CPW)               // value code words per token
#define VG (D < 64 ? D : 64)        // channels per value scale group
#define NGD (D / VG)
#define NTILE (D / 8)
#define TPW (CPW / 8)               // 8-channel tiles per value word
#define KSTAGE (KROWS * D + D)      // words: a key group's codes, then D fp16 scales and D fp16 mins
#define VOFF_S (16 * WPT)           // words: 16 tokens' value codes, then their scales and mins
#define VOFF_M (VOFF_S + 8 * NGD)
#define VSTAGE (VOFF_M + 8 * NGD)
#define STAGE_WORDS (KSTAGE > VSTAGE ? KSTAGE : VSTAGE)
#define RED_WORDS (16 * MTV * (D + 1))
#define UNION_WORDS (WARPS * STAGES * STAGE_WORDS > RED_WORDS ? WARPS * STAGES * STAGE_WORDS : RED_WORDS)
#define NEG_INF (-__int_as_float(0x7f800000))

extern "C" __global__ void __launch_bounds__(WARPS * 32) quant_attn_partial(
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
    __shared__ float sc[G][CT];
    __shared__ __align__(16) unsigned smem[UNION_WORDS];   // staging, then the warps' sums
    __shared__ float bred[G][NGD];
    __shared__ float wred[WARPS];
    const int bh = blockIdx.y, b = bh / Hkv, kvh = bh % Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long nk = min(*nk_ptr, (long long)T), pos = *p_ptr;
    const long long vq = pos - R > 0 ? pos - R : 0;       // positions before it: quantized values
    const int t0 = blockIdx.x * CT;
    const int n_here = (int)max(0LL, min((long long)CT, nk - t0));                 // key positions < nk
    const int nq = (int)max(0LL, min((long long)n_here, vq - t0));                 // of which quantized values
    float* acc_out = part + ((long long)blockIdx.x * gridDim.y + bh) * G * D;
    float* m_out = pm + ((long long)blockIdx.x * gridDim.y + bh) * G;
    float* l_out = pl + ((long long)blockIdx.x * gridDim.y + bh) * G;
    if (n_here == 0) {
        for (int i = threadIdx.x; i < G * D; i += blockDim.x) acc_out[i] = 0.f;
        for (int i = threadIdx.x; i < G; i += blockDim.x) { m_out[i] = NEG_INF; l_out[i] = 0.f; }
        return;
    }
    unsigned (*stage)[STAGES][STAGE_WORDS] = reinterpret_cast<unsigned (*)[STAGES][STAGE_WORDS]>(smem);

    // ---- 1. scores ----
    const qtype* qb = q + b * qsb + (long long)kvh * G * qsh;
    float amax = 0.f;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) amax = fmaxf(amax, fabsf(to_float(qb[(i / D) * qsh + i % D])));
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
    const unsigned* kcbase = kcodes + b * kcb + kvh * kch;
    const __half* ksbase = kscale + b * ksb + kvh * ksh;
    const __half* kmbase = kmin + b * kmb + kvh * kmh;
    const int ngrp = (n_here + 63) / 64;
    const int kmine = warp < ngrp ? (ngrp - warp + WARPS - 1) / WARPS : 0;
    auto kissue = [&](int i) {
        const int grp = t0 / 64 + warp + i * WARPS;
        unsigned* dst = stage[warp][i % STAGES];
        const unsigned* src = kcbase + (long long)grp * KROWS * D;
        for (int j = lane; j < KROWS * D / 4; j += 32) cp_async16(dst + 4 * j, src + 4 * j, 16);
        for (int j = lane; j < D / 8; j += 32) {
            cp_async16(dst + KROWS * D + 4 * j, ksbase + (long long)grp * D + 8 * j, 16);
            cp_async16(dst + KROWS * D + D / 2 + 4 * j, kmbase + (long long)grp * D + 8 * j, 16);
        }
    };
    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) { if (i < kmine) kissue(i); cp_async_commit(); }
    for (int i = 0; i < kmine; ++i) {
        if (i + STAGES - 1 < kmine) kissue(i + STAGES - 1);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const int lgrp = warp + i * WARPS;                 // group within the chunk
        const unsigned* st = stage[warp][i % STAGES];
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
        __syncwarp();
    }
    cp_async_wait<0>();
    __syncthreads();

    // ---- 2. per head: max, exponentials, sum ----
    for (int h = warp; h < G; h += WARPS) {
        float mx = NEG_INF;
        for (int i = lane; i < n_here; i += 32) mx = fmaxf(mx, sc[h][i]);
        for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float sum = 0.f;
        for (int i = lane; i < n_here; i += 32) {
            const float ex = expf(sc[h][i] - mx);
            sc[h][i] = ex;
            sum += ex;
        }
        for (int o = 16; o; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) { m_out[h] = mx; l_out[h] = sum; }
    }
    __syncthreads();

    // ---- 3. values: quantized before vq (tensor cores), the ring's from there on (below) ----
    const unsigned* vcbase = vcodes + b * vcb + kvh * vch;
    const __half* vsbase = vscale + b * vsb + kvh * vsh;
    const __half* vmbase = vmin + b * vmb + kvh * vmh;
    int part_of[MTV][2], head_of[MTV][2];
    #pragma unroll
    for (int mt = 0; mt < MTV; ++mt)
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = mt * 16 + g + 8 * i;
        part_of[mt][i] = r < 3 * G ? r / G : -1;
        head_of[mt][i] = r < 3 * G ? r % G : 0;
    }
    float vacc[MTV][NTILE][4];
    #pragma unroll
    for (int mt = 0; mt < MTV; ++mt)
    #pragma unroll
    for (int nt = 0; nt < NTILE; ++nt) vacc[mt][nt][0] = vacc[mt][nt][1] = vacc[mt][nt][2] = vacc[mt][nt][3] = 0.f;
    float bacc[MTV][2][NGD];
    #pragma unroll
    for (int mt = 0; mt < MTV; ++mt)
    #pragma unroll
    for (int gd = 0; gd < NGD; ++gd) bacc[mt][0][gd] = bacc[mt][1][gd] = 0.f;
    const int ntile = (nq + 15) / 16;
    const int vmine = warp < ntile ? (ntile - warp + WARPS - 1) / WARPS : 0;
    auto vissue = [&](int i) {
        const int tl = (warp + i * WARPS) * 16, nval = min(16, nq - tl);
        const long long tg = (long long)t0 + tl;
        unsigned* dst = stage[warp][i % STAGES];
        stage_copy<16>(dst, vcbase + tg * WPT, 64 * WPT, nval * WPT * 4, lane);
        stage_copy<16>(dst + VOFF_S, vsbase + tg * NGD, 32 * NGD, nval * NGD * 2, lane);
        stage_copy<16>(dst + VOFF_M, vmbase + tg * NGD, 32 * NGD, nval * NGD * 2, lane);
    };
    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) { if (i < vmine) vissue(i); cp_async_commit(); }
    for (int i = 0; i < vmine; ++i) {
        if (i + STAGES - 1 < vmine) vissue(i + STAGES - 1);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        const int tl = (warp + i * WARPS) * 16;
        const unsigned* st = stage[warp][i % STAGES];
        const __half* ss = reinterpret_cast<const __half*>(st + VOFF_S);
        const __half* sm = reinterpret_cast<const __half*>(st + VOFF_M);
        float pr[MTV][2][4];
        #pragma unroll
        for (int mt = 0; mt < MTV; ++mt)
        #pragma unroll
        for (int ri = 0; ri < 2; ++ri)
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int tk = tl + 4 * c + j;
            pr[mt][ri][j] = part_of[mt][ri] >= 0 && tk < nq ? sc[head_of[mt][ri]][tk] : 0.f;
        }
        value_tile_mma<BITS, D, MTV>(vacc, bacc, pr, part_of, st, ss, sm, g, c);
        __syncwarp();
    }
    cp_async_wait<0>();
    __syncthreads();   // the staging memory becomes the warps' sums

    // ---- 4. the block's sum in a fixed order: warp 0 stores, the others add one after another ----
    float (*red)[D + 1] = reinterpret_cast<float (*)[D + 1]>(smem);
    #pragma unroll
    for (int mt = 0; mt < MTV; ++mt)
    #pragma unroll
    for (int ri = 0; ri < 2; ++ri)
    #pragma unroll
    for (int gd = 0; gd < NGD; ++gd) {
        bacc[mt][ri][gd] += __shfl_xor_sync(0xffffffffu, bacc[mt][ri][gd], 1);
        bacc[mt][ri][gd] += __shfl_xor_sync(0xffffffffu, bacc[mt][ri][gd], 2);
    }
    for (int wv = 0; wv < WARPS; ++wv) {
        if (warp == wv) {
            #pragma unroll
            for (int mt = 0; mt < MTV; ++mt)
            #pragma unroll
            for (int nt = 0; nt < NTILE; ++nt)
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                float& r = red[mt * 16 + g + 8 * (j >> 1)][8 * nt + 2 * c + (j & 1)];
                r = wv ? r + vacc[mt][nt][j] : vacc[mt][nt][j];
            }
            #pragma unroll
            for (int mt = 0; mt < MTV; ++mt)
            #pragma unroll
            for (int ri = 0; ri < 2; ++ri)
                if (c == 0 && part_of[mt][ri] == 0)
                    #pragma unroll
                    for (int gd = 0; gd < NGD; ++gd) {
                        float& r = bred[head_of[mt][ri]][gd];
                        r = wv ? r + bacc[mt][ri][gd] : bacc[mt][ri][gd];
                    }
        }
        __syncthreads();
    }
    const vtype* rbase = ring + b * rsb + kvh * rsh;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int h = i / D, d = i % D;
        float ring_sum = 0.f;                                  // positions vq .. nk of this chunk: exact values
        for (int tk = nq; tk < n_here; ++tk)
            ring_sum += sc[h][tk] * to_float(rbase[(long long)((t0 + tk) % (R + 1)) * D + d]);
        acc_out[i] = (red[h][d] + red[G + h][d]) + red[2 * G + h][d] + bred[h][d / VG] + ring_sum;
    }
}

// per (batch row, query head): the chunks merged in order -> o [B*Hq, D], lse [B*Hq]
extern "C" __global__ void quant_attn_reduce(const float* __restrict__ part, const float* __restrict__ pm,
                                             const float* __restrict__ pl, float* __restrict__ out,
                                             float* __restrict__ lse, const int chunks, const int Hkv) {
    const int bq = blockIdx.x, d = threadIdx.x;
    const int b = bq / (Hkv * G), hq = bq % (Hkv * G);
    const long long bh = (long long)b * Hkv + hq / G, h = hq % G;
    const long long nbh = (long long)gridDim.x / G;            // B * Hkv
    float M = NEG_INF;
    for (int k = 0; k < chunks; ++k) M = fmaxf(M, pm[(k * nbh + bh) * G + h]);
    float L = 0.f, o = 0.f;
    if (M != NEG_INF)
        for (int k = 0; k < chunks; ++k) {
            const long long i = (k * nbh + bh) * G + h;
            const float m = pm[i];
            if (m == NEG_INF) continue;
            const float w = expf(m - M);
            L += w * pl[i];
            o += w * part[i * D + d];
        }
    out[(long long)bq * D + d] = L > 0.f ? o / L : 0.f;
    if (d == 0) lse[bq] = L > 0.f ? M + logf(L) : NEG_INF;
}

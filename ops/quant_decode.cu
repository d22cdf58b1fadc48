// quant_decode_attention kernels (ops/quant_decode_cuda.py compiles them with BITS, D, G, CT, S, STAGES, WARPS,
// MINB, P_STRIDE (words per (head, hi/lo) row of p) and qtype, vtype defined): a decode query's whole attention over
// packed 1/2-bit keys and values (layouts in ops/quant.py) in one pass over the packed bytes, split over the tokens
// (flash-decoding).
//
// quant_attn_partial: one block per (chunk of CT tokens, batch row and KV head), all G query heads of it. Each warp
// walks CT / WARPS consecutive tokens one 64-token group at a time (the group's packed keys, values, scales and mins
// staged with cp.async, STAGES deep). Both products put the packed side in the MMA's A operand, where one AND turns
// a shifted copy of the code word into a fragment register of exact fp16 values code * code_unit(j), the row's
// 1 / code_unit applied to its accumulators afterwards. B carries the fp16 operand split over the columns: column
// 2h = hi, 2h + 1 = lo of query head 4 nn + h (NN tiles of 4 heads), so a lane's accumulator pair (c0 + c1) is one
// head's sum to about fp32 precision.
//   1. scores: M = 64 tokens (row g + 8h of m-tile mt = token 8g + 2mt + h: lane g's tokens are the byte / half
//      word g of the group's codes), K = channels (k 2c, 2c+1 | 2c+8, 2c+9 of k-tile 2kp + h = channels
//      32kp + 8c + 2h + 0, 1 | + 4, 5: a lane reads its 8 channels of a k-tile pair as 16 bytes), B = q * key scale
//      (per group and channel) as hi = q*s, lo = fma(q, s, -hi) in fp16; the min term q . min one more MMA per
//      k-tile with A = the lane's 8 mins as loaded (row g holds k-tile 2kp's, row g + 8 k-tile 2kp + 1's: no copies)
//      and B = q, so its sums are row g of one accumulator plus row g + 8 of another;
//   2. an online softmax per head in log2 units (lane c holds head 4nn + c, tokens 8g .. 8g + 7);
//   3. values: M = channels (row g + 8h of m-tile mt = channel 64 gd + 8g + 2 (mt % 4) + h, gd = its scale
//      group), K = 64 tokens (k 2c, 2c+1, 2c+8, 2c+9 of k-tile kt = tokens 16kt + 4c + 0..3), B = p * value
//      scale (per token) split hi / lo from p's fp16 hi + lo, which go through shared memory (written in the
//      score layout, read in the B layout); the value mins one MMA per k-tile (A row gd = the tokens' mins of
//      group gd, B = p hi / lo). Positions from p - R on are staged as zero codes and take their exact values
//      from the ring (slot = position % (R + 1));
//   4. the warps' (m, l, sums) merged in shared memory into the block's, in quant_attn_reduce's input format.
#define CPW (32 / BITS)
#define KT (D / 16)                 // 16-channel k-tiles of the scores
#define KROWS (64 / CPW)            // key code word rows per 64-token group
#define WPT (D / CPW)               // value code words per token
#define VG (D < 64 ? D : 64)        // channels per value scale group
#define NGD (D / VG)
#define MTV (D / 16)                // 16-channel m-tiles of the values
#define NN ((G + 3) / 4)            // 4-head column tiles
#define TW (CT / WARPS)             // tokens per warp
#define OFF_KS (KROWS * D)          // a stage: key codes, D fp16 scales + D fp16 mins,
#define OFF_V (OFF_KS + D)          //   value codes [64][WPT],
#define OFF_VS (OFF_V + 64 * WPT)   //   value fp16 scales [64][NGD], then mins
#define STAGE_WORDS (OFF_VS + 64 * NGD)
#define P_WORDS (4 * NN * 2 * P_STRIDE)
#define WARP_WORDS (STAGES * STAGE_WORDS + P_WORDS)
#define MERGE_WORDS (WARPS * G * D + 2 * WARPS * G)   // after the walk: the warps' sums, maxima and totals
#define SMEM_WORDS (WARPS * WARP_WORDS > MERGE_WORDS ? WARPS * WARP_WORDS : MERGE_WORDS)
#define NTHR (WARPS * 32)
#define NEG_INF (-__int_as_float(0x7f800000))
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

__device__ __forceinline__ float pow2(int k) { return __int_as_float((127 + k) << 23); }   // |k| < 127

// fp16 pairs hi = (x, y), lo = (x, y) - hi
__device__ __forceinline__ void split_pair(float x, float y, unsigned& hi, unsigned& lo) {
    const __half2 h = __floats2half2_rn(x, y);
    const float2 f = __half22float2(h);
    const __half2 l = __floats2half2_rn(x - f.x, y - f.y);
    hi = *reinterpret_cast<const unsigned*>(&h);
    lo = *reinterpret_cast<const unsigned*>(&l);
}

__device__ __forceinline__ unsigned h2mul(unsigned a, unsigned b) {
    const __half2 r = __hmul2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b));
    return *reinterpret_cast<const unsigned*>(&r);
}

__device__ __forceinline__ unsigned h2fma(unsigned a, unsigned b, unsigned c) {
    const __half2 r = __hfma2(*reinterpret_cast<__half2*>(&a), *reinterpret_cast<__half2*>(&b),
                              *reinterpret_cast<__half2*>(&c));
    return *reinterpret_cast<const unsigned*>(&r);
}

// A fragment registers from a lane's two 8-code fields (low and high half word of x, code j at bits [j BITS,
// (j + 1) BITS)): copies of x shifted so that code j sits at bit code_pos(j) of each half, and one AND per register.
// The fp16 value is code * code_unit(j): positions 6..9 are subnormals >= 2^-18 (the tensor cores keep ~24 bits
// of products of subnormals down to about 2^-17 and lose one more per power of two below: bench/probes), 1-bit
// positions 10..14 are the exponent's bits, so a set bit is the normal number 2^(2^(P - 10) - 15).
#define NCOPY (BITS == 1 ? 1 : 4)
__device__ __forceinline__ void code_copies(unsigned x, unsigned (&y)[NCOPY]) {
    if (BITS == 1) { y[0] = x << 7; }
    else { y[0] = x << 6; y[NCOPY - 3] = x << 2; y[NCOPY - 2] = x >> 2; y[NCOPY - 1] = x >> 6; }
}
__device__ __forceinline__ constexpr int code_pos(int j) { return BITS == 1 ? 7 + j : (j % 2 ? 8 : 6); }
__device__ __forceinline__ unsigned code_bits(const unsigned (&y)[NCOPY], int j) {
    return y[BITS == 1 ? 0 : j / 2] & ((BITS == 1 ? 0x00010001u : 0x00030003u) << code_pos(j));
}
__device__ __forceinline__ float code_unit(int j) {
    const int P = code_pos(j);
    return P <= 9 ? pow2(P - 24) : pow2((1 << (P - 10)) - 15);
}

// fp16 pairs (ph + plo) * s split over the lanes: hi = ph s where kneg = 0 (even lanes, plo = 0 there), lo =
// plo s + (ph s - hi) where kneg = -1 (odd lanes); fp16 multiplies only, off the integer pipe (ph s is finite)
__device__ __forceinline__ unsigned split_product(unsigned ph, unsigned s, unsigned kneg) {
    return h2fma(ph, s, h2mul(h2mul(ph, s), kneg));
}
__device__ __forceinline__ unsigned split_product(unsigned ph, unsigned plo, unsigned s, unsigned kneg) {
    return h2fma(plo, s, split_product(ph, s, kneg));
}

// 16 bytes from global src to the shared address dst, all of them valid
__device__ __forceinline__ void cp_async16s(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src));
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
    // B column 2h + 1 holds the lo part: (kneg, klo, khi) are the fp16 pairs of -1, 1, 0 there and 0, 0, 1 in 2h
    const unsigned kneg = g & 1 ? 0xBC00BC00u : 0u, klo = g & 1 ? 0x3C003C00u : 0u, khi = klo ^ 0x3C003C00u;
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

    // ---- q * 2^e (its largest |value| in [0.5, 1): q * scale stays in fp16's range) as B fragments: column g =
    //      head 4 nn + g / 2, k rows 2c, 2c+1 (reg 0) and 2c+8, 2c+9 (reg 1) = channels 16 kt + 4c + 0..3;
    //      part s of an fp32 q (hi, lo) ----
    const qtype* qb = q + b * qsb + (long long)kvh * G * qsh;
    float amax = 0.f;
    for (int i = threadIdx.x; i < G * D; i += NTHR) amax = fmaxf(amax, fabsf(to_float(qb[(i / D) * qsh + i % D])));
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) wred[warp] = amax;
    __syncthreads();
    for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, wred[w]);
    int e = 0;
    if (amax > 0.f) e = 126 - (int)((__float_as_uint(amax) >> 23) & 0xff);   // amax * 2^e in [0.5, 1)
    e = max(e, -126);                                      // (an fp32 subnormal amax: its largest power of two)
    const float qscale = pow2(e), xs = sm_scale * pow2(-e) * LOG2E;   // score sum -> score in log2 units
    unsigned qf[S][NN][KT][2];
    #pragma unroll
    for (int s = 0; s < S; ++s)
    #pragma unroll
    for (int nn = 0; nn < NN; ++nn)
    #pragma unroll
    for (int kt = 0; kt < KT; ++kt)
    #pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int h = 4 * nn + g / 2, d = 32 * (kt / 2) + 8 * c + 2 * (kt % 2) + 4 * r;
        const float x0 = h < G ? to_float(qb[h * qsh + d]) : 0.f, x1 = h < G ? to_float(qb[h * qsh + d + 1]) : 0.f;
        const __half2 hi = __floats2half2_rn(x0 * qscale, x1 * qscale);
        if (s == 0) {
            qf[s][nn][kt][r] = *reinterpret_cast<const unsigned*>(&hi);
        } else {                                           // an fp32 q: its lo part
            const float2 f = __half22float2(hi);
            const __half2 lo = __floats2half2_rn(x0 * qscale - f.x, x1 * qscale - f.y);
            qf[s][nn][kt][r] = *reinterpret_cast<const unsigned*>(&lo);
        }
    }
    float fs[8];                                           // per code i: the row factor 2^(24 - shift) * xs
    #pragma unroll
    for (int i = 0; i < 8; ++i) fs[i] = xs / code_unit(i);
    const unsigned bsel = (g * BITS) % 4;                  // the byte of a word where this lane's field starts
    const unsigned fsel = BITS == 1 ? bsel | (bsel << 4) | ((4 + bsel) << 8) | ((4 + bsel) << 12)
                                    : bsel | ((bsel + 1) << 4) | ((4 + bsel) << 8) | ((5 + bsel) << 12);

    // ---- each warp's tokens, group by group ----
    const long long w0 = t0 + (long long)warp * TW;
    const int nval = (int)max(0LL, min((long long)TW, nk - w0));
    const int ngrp = (nval + 63) / 64;
    unsigned* wst = smem + warp * WARP_WORDS;
    unsigned* pw = wst + STAGES * STAGE_WORDS;             // p: [4 NN heads][hi, lo][64 tokens] fp16, rows padded
    const unsigned* kc_b = kcodes + b * kcb + kvh * kch;
    const __half* ks_b = kscale + b * ksb + kvh * ksh;
    const __half* km_b = kmin + b * kmb + kvh * kmh;
    const unsigned* vc_b = vcodes + b * vcb + kvh * vch;
    const __half* vs_b = vscale + b * vsb + kvh * vsh;
    const __half* vm_b = vmin + b * vmb + kvh * vmh;
    const vtype* rg_b = ring + b * rsb + kvh * rsh;

    float o[NN][MTV][4], macc[NN][4], m_run[NN], l_run[NN];
    #pragma unroll
    for (int nn = 0; nn < NN; ++nn) {
        #pragma unroll
        for (int mt = 0; mt < MTV; ++mt) o[nn][mt][0] = o[nn][mt][1] = o[nn][mt][2] = o[nn][mt][3] = 0.f;
        macc[nn][0] = macc[nn][1] = macc[nn][2] = macc[nn][3] = 0.f;
        m_run[nn] = NEG_INF;
        l_run[nn] = 0.f;
    }

    // each lane's 16-byte pieces of the warp's first group (the next groups' lie a fixed stride further): its
    // pieces of the key codes and value codes (one per 512 bytes), one of the key scales + mins (D + D fp16), one
    // of the value scales + mins (64 NGD + 64 NGD fp16); the stage holds each pair of arrays back to back
    const char* kc_src = reinterpret_cast<const char*>(kc_b + (w0 / CPW) * D) + 16 * lane;
    const char* ksm_src = lane < D / 8 ? reinterpret_cast<const char*>(ks_b + (w0 / 64) * D) + 16 * lane
                                       : reinterpret_cast<const char*>(km_b + (w0 / 64) * D) + 16 * (lane - D / 8);
    const char* vc_src = reinterpret_cast<const char*>(vc_b + w0 * WPT) + 16 * lane;
    const char* vsm_src = lane < 8 * NGD ? reinterpret_cast<const char*>(vs_b + w0 * NGD) + 16 * lane
                                         : reinterpret_cast<const char*>(vm_b + w0 * NGD) + 16 * (lane - 8 * NGD);
    const unsigned st0 = (unsigned)__cvta_generic_to_shared(wst) + 16 * lane;
    auto issue = [&](int i, int stg) {
        const unsigned st = st0 + stg * (STAGE_WORDS * 4);
        const long long tg = w0 + 64LL * i;
        #pragma unroll
        for (int j = 0; j < KROWS * D / 128; ++j)
            cp_async16s(st + 512 * j, kc_src + (long long)i * (KROWS * D * 4) + 512 * j);
        if (lane < D / 4)
            cp_async16s(st + OFF_KS * 4, ksm_src + (long long)i * (D * 2));
        if (vq - tg >= 64) {
            #pragma unroll
            for (int j = 0; j < WPT * 64 / 128; ++j)
                cp_async16s(st + OFF_V * 4 + 512 * j, vc_src + (long long)i * (64 * WPT * 4) + 512 * j);
            if (lane < 16 * NGD)
                cp_async16s(st + OFF_VS * 4, vsm_src + (long long)i * (64 * NGD * 2));
        } else {                                                            // zeros from position vq on
            unsigned* stp = wst + stg * STAGE_WORDS;
            const int nv = (int)max(0LL, vq - tg);
            stage_copy<16>(stp + OFF_V, vc_b + tg * WPT, 64 * WPT * 4, nv * WPT * 4, lane);
            stage_copy<16>(stp + OFF_VS, vs_b + tg * NGD, 64 * NGD * 2, nv * NGD * 2, lane);
            stage_copy<16>(stp + OFF_VS + 32 * NGD, vm_b + tg * NGD, 64 * NGD * 2, nv * NGD * 2, lane);
        }
    };

    auto body = [&](int i, int stg) {
        const unsigned* st = wst + stg * STAGE_WORDS;
        const long long tg = w0 + 64LL * i;
        // ---- 1. scores ----
        const unsigned* kw = st + (g * BITS / 4) * D;     // the code row holding this lane's tokens
        const __half* ks = reinterpret_cast<const __half*>(st + OFF_KS);
        const __half* km = ks + D;
        float acc[NN][4][4], bias[2][NN][4];   // bias[0]: row g, bias[1]: row g + 8 (see the k mapping)
        #pragma unroll
        for (int nn = 0; nn < NN; ++nn) {
            bias[0][nn][0] = bias[0][nn][1] = bias[0][nn][2] = bias[0][nn][3] = 0.f;
            bias[1][nn][0] = bias[1][nn][1] = bias[1][nn][2] = bias[1][nn][3] = 0.f;
            #pragma unroll
            for (int mt = 0; mt < 4; ++mt) acc[nn][mt][0] = acc[nn][mt][1] = acc[nn][mt][2] = acc[nn][mt][3] = 0.f;
        }
#ifndef QD_SKIP_KEYS   // bench/probes/qd_ab.py times the kernel without its key (or value) products
        #pragma unroll
        for (int kp = 0; kp < KT / 2; ++kp) {               // k-tiles 2 kp, 2 kp + 1: channels 32 kp + 8c + 0..7
            const uint4 wl = *reinterpret_cast<const uint4*>(kw + 32 * kp + 8 * c);
            const uint4 wh = *reinterpret_cast<const uint4*>(kw + 32 * kp + 8 * c + 4);
            const uint4 sp = *reinterpret_cast<const uint4*>(ks + 32 * kp + 8 * c);
            const uint4 mn = *reinterpret_cast<const uint4*>(km + 32 * kp + 8 * c);
            const unsigned am[4] = {mn.x, mn.y, mn.z, mn.w};
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int kt = 2 * kp + h;
                unsigned x01[NCOPY], x23[NCOPY];
                code_copies(prmt(h ? wl.z : wl.x, h ? wl.w : wl.y, fsel), x01);
                code_copies(prmt(h ? wh.z : wh.x, h ? wh.w : wh.y, fsel), x23);
                #pragma unroll
                for (int s = 0; s < S; ++s)
                #pragma unroll
                for (int nn = 0; nn < NN; ++nn) {
                    const unsigned b0 = split_product(qf[s][nn][kt][0], h ? sp.y : sp.x, kneg);
                    const unsigned b1 = split_product(qf[s][nn][kt][1], h ? sp.w : sp.z, kneg);
                    mma_f16(bias[h][nn], am, qf[s][nn][kt][0], qf[s][nn][kt][1]);   // column 2h: q . min
                    #pragma unroll
                    for (int mt = 0; mt < 4; ++mt) {
                        const unsigned a[4] = {code_bits(x01, 2 * mt), code_bits(x01, 2 * mt + 1),
                                               code_bits(x23, 2 * mt), code_bits(x23, 2 * mt + 1)};
                        mma_f16(acc[nn][mt], a, b0, b1);
                    }
                }
            }
        }
#endif
        float x[NN][8];                                    // head 4 nn + c, token 8g + j, log2 units
        #pragma unroll
        for (int nn = 0; nn < NN; ++nn) {
            const float bs = (bias[0][nn][0] + bias[1][nn][2]) * xs;
            #pragma unroll
            for (int mt = 0; mt < 4; ++mt) {
                x[nn][2 * mt] = fmaf(acc[nn][mt][0] + acc[nn][mt][1], fs[2 * mt], bs);
                x[nn][2 * mt + 1] = fmaf(acc[nn][mt][2] + acc[nn][mt][3], fs[2 * mt + 1], bs);
            }
        }
        if (tg + 64 > nk) {
            #pragma unroll
            for (int nn = 0; nn < NN; ++nn)
            #pragma unroll
            for (int j = 0; j < 8; ++j)
                if (tg + 8 * g + j >= nk) x[nn][j] = NEG_INF;
        }

        // ---- 2. online softmax per head; p hi / lo to shared memory ----
        float p[NN][8];
        bool grows = false;
        float m_new[NN];
        #pragma unroll
        for (int nn = 0; nn < NN; ++nn) {
            float gm = x[nn][0];
            #pragma unroll
            for (int j = 1; j < 8; ++j) gm = fmaxf(gm, x[nn][j]);
            gm = fmaxf(gm, __shfl_xor_sync(0xffffffffu, gm, 4));
            gm = fmaxf(gm, __shfl_xor_sync(0xffffffffu, gm, 8));
            gm = fmaxf(gm, __shfl_xor_sync(0xffffffffu, gm, 16));
            m_new[nn] = fmaxf(m_run[nn], gm);
            grows |= m_new[nn] > m_run[nn];
        }
        if (__any_sync(0xffffffffu, grows)) {
            #pragma unroll
            for (int nn = 0; nn < NN; ++nn) {
                const float f = ex2(m_run[nn] - m_new[nn]);   // the first group: ex2(-inf) = 0
                l_run[nn] *= f;
                m_run[nn] = m_new[nn];
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    macc[nn][j] *= f;
                    #pragma unroll
                    for (int mt = 0; mt < MTV; ++mt) o[nn][mt][j] *= f;
                }
            }
        }
        #pragma unroll
        for (int nn = 0; nn < NN; ++nn) {
            unsigned hi[4], lo[4];
            #pragma unroll
            for (int j = 0; j < 8; ++j) {
                p[nn][j] = ex2(x[nn][j] - m_run[nn]);
                l_run[nn] += p[nn][j];
            }
            #pragma unroll
            for (int j = 0; j < 4; ++j) split_pair(p[nn][2 * j], p[nn][2 * j + 1], hi[j], lo[j]);
            unsigned* row = pw + (4 * nn + c) * 2 * P_STRIDE + 4 * g;
            *reinterpret_cast<uint4*>(row) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
            *reinterpret_cast<uint4*>(row + P_STRIDE) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        }
        __syncwarp();

        // ---- 3. values ----
        const unsigned* vw = st + OFF_V;                       // [64][WPT]
        const __half* vs = reinterpret_cast<const __half*>(st + OFF_VS);
        const __half* vm = vs + 64 * NGD;
#ifndef QD_SKIP_VALUES
        #pragma unroll
        for (int kt = 0; kt < 4; ++kt) {
            const int ta = 16 * kt + 4 * c;                    // this lane's tokens ta .. ta + 3
            unsigned xv[2][NGD][NCOPY];                        // [token pair][scale group][copy]
            if (BITS == 1 && D == 128) {                       // byte g + 8 gd of a token's 16-byte row
                const unsigned char* vb = reinterpret_cast<const unsigned char*>(vw + ta * WPT) + g;
                #pragma unroll
                for (int gd = 0; gd < NGD; ++gd)
                #pragma unroll
                for (int pr = 0; pr < 2; ++pr) {               // code_copies of (ta + 2pr's byte) | (next's) << 16
                    const unsigned lo8 = vb[32 * pr + 8 * gd], hi8 = vb[32 * pr + 16 + 8 * gd];
                    xv[pr][gd][0] = hi8 * (1u << 23) + lo8 * (1u << 7);
                }
            } else {
                unsigned tw[4][NGD];                           // the words of this lane's channels, per token
                #pragma unroll
                for (int j = 0; j < 4; ++j)
                #pragma unroll
                for (int gd = 0; gd < NGD; ++gd) tw[j][gd] = vw[(ta + j) * WPT + gd * (VG * BITS / 32) + g * BITS / 4];
                #pragma unroll
                for (int gd = 0; gd < NGD; ++gd)
                #pragma unroll
                for (int pr = 0; pr < 2; ++pr) code_copies(prmt(tw[2 * pr][gd], tw[2 * pr + 1][gd], fsel), xv[pr][gd]);
            }
            unsigned sc[2][NGD], mc[2];                        // scale pairs of (ta, ta + 1), (ta + 2, ta + 3)
            if (NGD == 1) {
                const uint2 s2 = *reinterpret_cast<const uint2*>(vs + ta);
                const uint2 m2 = *reinterpret_cast<const uint2*>(vm + ta);
                sc[0][0] = s2.x; sc[1][0] = s2.y;
                mc[0] = g == 0 ? m2.x : 0u; mc[1] = g == 0 ? m2.y : 0u;
            } else {                                           // a word holds groups 0, 1 of one token
                const uint4 s4 = *reinterpret_cast<const uint4*>(vs + ta * NGD);
                const uint4 m4 = *reinterpret_cast<const uint4*>(vm + ta * NGD);
                sc[0][0] = prmt(s4.x, s4.y, 0x5410u); sc[0][NGD - 1] = prmt(s4.x, s4.y, 0x7632u);
                sc[1][0] = prmt(s4.z, s4.w, 0x5410u); sc[1][NGD - 1] = prmt(s4.z, s4.w, 0x7632u);
                const unsigned msel = g == 0 ? 0x5410u : 0x7632u;
                mc[0] = g < NGD ? prmt(m4.x, m4.y, msel) : 0u;
                mc[1] = g < NGD ? prmt(m4.z, m4.w, msel) : 0u;
            }
            const unsigned am[4] = {mc[0], 0u, mc[1], 0u};     // row gd: the mins of scale group gd
            #pragma unroll
            for (int nn = 0; nn < NN; ++nn) {
                const unsigned* prow = pw + (4 * nn + g / 2) * 2 * P_STRIDE + ta / 2;
                const uint2 ph = *reinterpret_cast<const uint2*>(prow);
                const uint2 pl = *reinterpret_cast<const uint2*>(prow + P_STRIDE);
                const unsigned plo0 = h2mul(pl.x, klo), plo1 = h2mul(pl.y, klo);   // 0 in the hi columns
                mma_f16(macc[nn], am, h2fma(ph.x, khi, plo0), h2fma(ph.y, khi, plo1));   // hi columns ph, lo pl
                #pragma unroll
                for (int gd = 0; gd < NGD; ++gd) {
                    const unsigned b0 = split_product(ph.x, plo0, sc[0][gd], kneg);
                    const unsigned b1 = split_product(ph.y, plo1, sc[1][gd], kneg);
                    #pragma unroll
                    for (int m4 = 0; m4 < VG / 16; ++m4) {
                        const unsigned a[4] = {code_bits(xv[0][gd], 2 * m4), code_bits(xv[0][gd], 2 * m4 + 1),
                                               code_bits(xv[1][gd], 2 * m4), code_bits(xv[1][gd], 2 * m4 + 1)};
                        mma_f16(o[nn][gd * (VG / 16) + m4], a, b0, b1);
                    }
                }
            }
        }
#endif

        // ---- positions from p - R on: their exact values from the ring ----
        if (tg + 64 > vq) {
            const long long e0 = max(tg, vq), e1 = min(tg + 64, nk);
            for (long long tok = e0; tok < e1; ++tok) {
                const int j = (int)(tok - tg);
                const vtype* row = rg_b + (tok % (R + 1)) * D;
                #pragma unroll
                for (int nn = 0; nn < NN; ++nn) {
                    const __half* ph = reinterpret_cast<const __half*>(pw + (4 * nn + c) * 2 * P_STRIDE);
                    const float pv = __half2float(ph[j]) + __half2float(ph[2 * P_STRIDE + j]);
                    #pragma unroll
                    for (int mt = 0; mt < MTV; ++mt) {
                        const int i = 2 * (mt % (VG / 16)), ch = VG * (mt / (VG / 16)) + 8 * g + i;
                        o[nn][mt][0] += pv * code_unit(i) * to_float(row[ch]);
                        o[nn][mt][2] += pv * code_unit(i + 1) * to_float(row[ch + 1]);
                    }
                }
            }
        }
    };
    warp_pipeline<STAGES>(ngrp, issue, body);

    // ---- 4. the warp's sums per head (lane c: head 4 nn + c), then the block's ----
    float mterm[NN][NGD];                                      // the min term per head and scale group
    #pragma unroll
    for (int nn = 0; nn < NN; ++nn) {
        #pragma unroll
        for (int o2 = 4; o2 < 32; o2 <<= 1) l_run[nn] += __shfl_xor_sync(0xffffffffu, l_run[nn], o2);
        const float v = macc[nn][0] + macc[nn][1];             // lane (g < NGD, c): group g, head 4 nn + c
        #pragma unroll
        for (int gd = 0; gd < NGD; ++gd) mterm[nn][gd] = __shfl_sync(0xffffffffu, v, 4 * gd + c);
    }
    __syncthreads();   // every warp is done with its stages: they become the warps' sums
    float* wo = reinterpret_cast<float*>(smem);                // [WARPS][G][D]
    float* wm = wo + WARPS * G * D;                            // [WARPS][G]
    float* wl = wm + WARPS * G;
    #pragma unroll
    for (int nn = 0; nn < NN; ++nn) {
        const int h = 4 * nn + c;
        if (h < G) {
            #pragma unroll
            for (int mt = 0; mt < MTV; ++mt) {
                const int gd = mt / (VG / 16), i = 2 * (mt % (VG / 16)), ch = VG * gd + 8 * g + i;
                wo[(warp * G + h) * D + ch] = (o[nn][mt][0] + o[nn][mt][1]) / code_unit(i) + mterm[nn][gd];
                wo[(warp * G + h) * D + ch + 1] =
                    (o[nn][mt][2] + o[nn][mt][3]) / code_unit(i + 1) + mterm[nn][gd];
            }
            if (g == 0) { wm[warp * G + h] = m_run[nn]; wl[warp * G + h] = l_run[nn]; }
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

// quant_attn_reduce: per (batch row and query head, 32 channels) the chunks merged in one pass -> o [B*Hq, D],
// lse [B*Hq]: each warp merges its chunks (warp, warp + RWARPS, ...; RU of them loaded at once) with a running
// maximum, then warp 0 merges the warps: o = sum w_c acc_c / sum w_c l_c, w_c = exp(m_c - max m), lse = max m +
// log(sum w_c l_c). Deterministic, no atomics.
#define RWARPS 8
#define RU 8
extern "C" __global__ void __launch_bounds__(RWARPS * 32) quant_attn_reduce(
        const float* __restrict__ part, const float* __restrict__ pm, const float* __restrict__ pl,
        float* __restrict__ out, float* __restrict__ lse, const int chunks, const int Hkv) {
    __shared__ float sm_m[RWARPS], sm_l[RWARPS], sm_o[RWARPS][32];
    const int bq = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, d = 32 * blockIdx.y + lane;
    const int b = bq / (Hkv * G), hq = bq % (Hkv * G);
    const long long bh = (long long)b * Hkv + hq / G, h = hq % G;
    const long long nbh = (long long)gridDim.x / G;            // B * Hkv
    float M = NEG_INF, L = 0.f, o = 0.f;
    for (int k0 = warp; k0 < chunks; k0 += RWARPS * RU) {
        float m[RU], l[RU], x[RU];
        #pragma unroll
        for (int u = 0; u < RU; ++u) {
            const int k = k0 + u * RWARPS;
            const long long i = (k * nbh + bh) * G + h;
            m[u] = k < chunks ? pm[i] : NEG_INF;
            l[u] = k < chunks ? pl[i] : 0.f;
            x[u] = k < chunks && d < D ? part[i * D + d] : 0.f;
        }
        float mb = M;
        #pragma unroll
        for (int u = 0; u < RU; ++u) mb = fmaxf(mb, m[u]);
        if (mb != NEG_INF) {
            const float f = M == NEG_INF ? 0.f : expf(M - mb);
            L *= f;
            o *= f;
            #pragma unroll
            for (int u = 0; u < RU; ++u) {
                const float w = m[u] == NEG_INF ? 0.f : expf(m[u] - mb);
                L += w * l[u];
                o += w * x[u];
            }
            M = mb;
        }
    }
    if (lane == 0) { sm_m[warp] = M; sm_l[warp] = L; }
    sm_o[warp][lane] = o;
    __syncthreads();
    if (warp == 0) {
        float Mx = NEG_INF;
        for (int w = 0; w < RWARPS; ++w) Mx = fmaxf(Mx, sm_m[w]);
        float Ls = 0.f, os = 0.f;
        if (Mx != NEG_INF) {
            for (int w = 0; w < RWARPS; ++w) {
                const float f = sm_m[w] == NEG_INF ? 0.f : expf(sm_m[w] - Mx);
                Ls += f * sm_l[w];
                os += f * sm_o[w][lane];
            }
        }
        if (d < D) out[(long long)bq * D + d] = Ls > 0.f ? os / Ls : 0.f;
        if (blockIdx.y == 0 && lane == 0) lse[bq] = Ls > 0.f ? Mx + logf(Ls) : NEG_INF;
    }
}

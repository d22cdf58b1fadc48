// attend_decode's CUDA kernels (ops/attention_cuda.py compiles them per shape and launches them; how they work
// is written there). Defined before this text, after the two includes: D (64 / 128), G (query heads per KV
// head, 1..16), W (warps per block), NS (16-key tiles per warp step), MINB (__launch_bounds__' minimum blocks
// per SM, 0: none), KBF16 (1: bf16, 0: fp16), ktype, and LOAD (cache qualifiers of the 16-byte loads as a
// string; undefined: __ldg).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define NH (G > 8 ? 2 : 1)        // 8-head halves of the output tile
#define KS (D / 16)               // k-steps of S = q K^T; m-tiles of O^T
#define U (D / 32)                // uint4 per lane of a key row
#define H (D / 64)                // uint4 per lane of a value row
#define UNIT (16 * NS)
#define NEG_INF __int_as_float(0xff800000u)    // NVRTC has no INFINITY
#if KBF16
#define MMA_T "bf16"
#else
#define MMA_T "f16"
#endif

__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32." MMA_T "." MMA_T ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned pack2(float lo, float hi) {
#if KBF16
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
#else
    __half2 h = __floats2half2_rn(lo, hi);
#endif
    return *reinterpret_cast<unsigned*>(&h);
}

__device__ __forceinline__ uint4 load16(const uint4* p) {
#ifndef LOAD
    return __ldg(p);
#else
    uint4 r;
    asm volatile("ld.global.nc." LOAD ".v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
#endif
}

__device__ __forceinline__ unsigned word(const uint4& u, int i) {
    return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}

// uint4 u of a lane's share of a key row: channels 32 u + 8 tig .. +7; k-step 2u + e takes words 2e, 2e+1
__device__ __forceinline__ void load_k(uint4 (&kr)[NS][2][U], const ktype* kb, long long ksn, int k0, int len,
                                       int gid, int tig) {
    #pragma unroll
    for (int st = 0; st < NS; ++st)
    #pragma unroll
    for (int t = 0; t < 2; ++t) {
        const int key = k0 + 16 * st + 8 * t + gid;
        const uint4* p = reinterpret_cast<const uint4*>(kb + (long long)key * ksn + 8 * tig);
        #pragma unroll
        for (int u = 0; u < U; ++u) kr[st][t][u] = key < len ? load16(p + 4 * u) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// row r of a lane's value keys: 2 tig + (r & 1) + 8 (r >> 1); uint4 h: channels 64 h + 8 gid .. +7
__device__ __forceinline__ void load_v(uint4 (&vr)[NS][4][H], const ktype* vb, long long vsn, int k0, int len,
                                       int gid, int tig) {
    #pragma unroll
    for (int st = 0; st < NS; ++st)
    #pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int key = k0 + 16 * st + 2 * tig + (r & 1) + 8 * (r >> 1);
        const uint4* p = reinterpret_cast<const uint4*>(vb + (long long)key * vsn + 8 * gid);
        #pragma unroll
        for (int h = 0; h < H; ++h) vr[st][r][h] = key < len ? load16(p + 8 * h) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// the output channel of row gid + 8 rh of m-tile mt (the element of the value uint4s that A takes there)
__device__ __forceinline__ int channel(int mt, int rh, int gid) {
    const int idx = rh * KS + mt;
    return 64 * (idx / 8) + 8 * gid + idx % 8;
}

#if MINB > 0
#define BOUNDS __launch_bounds__(W * 32, MINB)
#else
#define BOUNDS __launch_bounds__(W * 32)
#endif

extern "C" __global__ void BOUNDS attend_partial(
        const ktype* __restrict__ q, const long long qsb, const long long qsh,
        const ktype* __restrict__ k, const long long ksb, const long long ksh, const long long ksn,
        const ktype* __restrict__ v, const long long vsb, const long long vsh, const long long vsn,
        const long long* __restrict__ length, const int len_stride, const int N, const int Hkv,
        const float scale_log2, float* __restrict__ pm, float* __restrict__ pl, float* __restrict__ pacc) {
    __shared__ float wm[W][8 * NH], wl[W][8 * NH];
    __shared__ float oacc[G * D];
    const int bh = blockIdx.y, b = bh / Hkv, kvh = bh % Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    const long long L = length[(long long)b * len_stride];
    const int len = (int)(L < 0 ? 0 : (L > N ? N : L));
    const int units = (len + UNIT - 1) / UNIT;
    const int u0 = (int)((long long)blockIdx.x * units / gridDim.x);
    const int u1 = (int)((long long)(blockIdx.x + 1) * units / gridDim.x);

    // A of S = q K^T: rows gid, gid + 8 (heads of the group, zero past G); k-step 2u + e, lane tig holds
    // channels 32 u + 8 tig + 4 e + {0, 1} (a0, a1) and + {2, 3} (a2, a3), as in load_k
    unsigned qa[KS][4];
    {
        const unsigned short* qh =
            reinterpret_cast<const unsigned short*>(q + b * qsb + (long long)(kvh * G) * qsh);
        #pragma unroll
        for (int s = 0; s < KS; ++s)
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int head = gid + 8 * (i & 1), c = 32 * (s / 2) + 8 * tig + 4 * (s % 2) + 2 * (i >> 1);
            const bool used = head < G && !((i & 1) && G <= 8);
            qa[s][i] = used ? (unsigned)qh[head * qsh + c] | ((unsigned)qh[head * qsh + c + 1] << 16) : 0u;
        }
    }

    const ktype* kb = k + b * ksb + kvh * ksh;
    const ktype* vb = v + b * vsb + kvh * vsh;
    float m[NH], l[NH], acc[KS][NH][4];
    #pragma unroll
    for (int i = 0; i < NH; ++i) { m[i] = NEG_INF; l[i] = 0.f; }
    #pragma unroll
    for (int mt = 0; mt < KS; ++mt)
    #pragma unroll
    for (int nh = 0; nh < NH; ++nh)
    #pragma unroll
    for (int j = 0; j < 4; ++j) acc[mt][nh][j] = 0.f;

    uint4 kr[NS][2][U], vr[NS][4][H];
    int unit = u0 + warp;
    if (unit < u1) {
        load_k(kr, kb, ksn, unit * UNIT, len, gid, tig);
        load_v(vr, vb, vsn, unit * UNIT, len, gid, tig);
    }
    for (; unit < u1; unit += W) {
        const int k0 = unit * UNIT, next = unit + W;
        // s[st][t][j]: head gid + 8 (j >> 1), key k0 + 16 st + 8 t + 2 tig + (j & 1)
        float s[NS][2][4];
        #pragma unroll
        for (int st = 0; st < NS; ++st)
        #pragma unroll
        for (int t = 0; t < 2; ++t) {
            #pragma unroll
            for (int j = 0; j < 4; ++j) s[st][t][j] = 0.f;
            #pragma unroll
            for (int ks = 0; ks < KS; ++ks)
                mma(s[st][t], qa[ks], word(kr[st][t][ks / 2], 2 * (ks % 2)),
                    word(kr[st][t][ks / 2], 2 * (ks % 2) + 1));
        }
        if (next < u1) load_k(kr, kb, ksn, next * UNIT, len, gid, tig);

        float mx[NH];
        #pragma unroll
        for (int i = 0; i < NH; ++i) mx[i] = NEG_INF;
        #pragma unroll
        for (int st = 0; st < NS; ++st)
        #pragma unroll
        for (int t = 0; t < 2; ++t)
        #pragma unroll
        for (int j = 0; j < 2 * NH; ++j) {
            const bool ok = k0 + 16 * st + 8 * t + 2 * tig + (j & 1) < len;
            s[st][t][j] = ok ? s[st][t][j] * scale_log2 : NEG_INF;
            mx[j >> 1] = fmaxf(mx[j >> 1], s[st][t][j]);
        }
        float alpha[NH];
        #pragma unroll
        for (int i = 0; i < NH; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            const float mn = fmaxf(m[i], mx[i]);                   // finite: key k0 is below the length
            alpha[i] = exp2f(m[i] - mn);
            m[i] = mn;
            l[i] *= alpha[i];
        }
        // B of O^T += V^T P^T: pb[st][nh][0] keys 2 tig, 2 tig + 1 and [1] keys 8 + 2 tig, 9 + 2 tig of head
        // 8 nh + gid
        unsigned pb[NS][NH][2];
        #pragma unroll
        for (int st = 0; st < NS; ++st)
        #pragma unroll
        for (int nh = 0; nh < NH; ++nh)
        #pragma unroll
        for (int t = 0; t < 2; ++t) {
            const float p0 = exp2f(s[st][t][2 * nh] - m[nh]), p1 = exp2f(s[st][t][2 * nh + 1] - m[nh]);
            l[nh] += p0 + p1;
            pb[st][nh][t] = pack2(p0, p1);
        }
        // the accumulators hold heads 8 nh + 2 tig + {0, 1}: their scale comes from the lanes of those rows
        #pragma unroll
        for (int nh = 0; nh < NH; ++nh) {
            const float a0 = __shfl_sync(0xffffffffu, alpha[nh], 8 * tig);
            const float a1 = __shfl_sync(0xffffffffu, alpha[nh], 8 * tig + 4);
            #pragma unroll
            for (int mt = 0; mt < KS; ++mt) {
                acc[mt][nh][0] *= a0; acc[mt][nh][1] *= a1; acc[mt][nh][2] *= a0; acc[mt][nh][3] *= a1;
            }
        }
        #pragma unroll
        for (int st = 0; st < NS; ++st)
        #pragma unroll
        for (int mt = 0; mt < KS; ++mt) {
            const int i0 = mt, i1 = KS + mt;                       // rows gid, gid + 8 of the m-tile
            const unsigned sel = mt % 2 ? 0x7632u : 0x5410u;       // the low / high halves of two words
            unsigned a[4];
            a[0] = __byte_perm(word(vr[st][0][i0 / 8], i0 % 8 / 2), word(vr[st][1][i0 / 8], i0 % 8 / 2), sel);
            a[1] = __byte_perm(word(vr[st][0][i1 / 8], i1 % 8 / 2), word(vr[st][1][i1 / 8], i1 % 8 / 2), sel);
            a[2] = __byte_perm(word(vr[st][2][i0 / 8], i0 % 8 / 2), word(vr[st][3][i0 / 8], i0 % 8 / 2), sel);
            a[3] = __byte_perm(word(vr[st][2][i1 / 8], i1 % 8 / 2), word(vr[st][3][i1 / 8], i1 % 8 / 2), sel);
            #pragma unroll
            for (int nh = 0; nh < NH; ++nh) mma(acc[mt][nh], a, pb[st][nh][0], pb[st][nh][1]);
        }
        if (next < u1) load_v(vr, vb, vsn, next * UNIT, len, gid, tig);
    }

    // merge the warps in a fixed order: w_i = 2^(m_i - M), out = sum w_i acc_i, sum = sum w_i l_i
    #pragma unroll
    for (int i = 0; i < NH; ++i) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        if (tig == 0) { wm[warp][gid + 8 * i] = m[i]; wl[warp][gid + 8 * i] = l[i]; }
    }
    __syncthreads();
    float f[NH][2];                                                // this warp's weight of heads 8 nh + 2 tig + j
    #pragma unroll
    for (int nh = 0; nh < NH; ++nh)
    #pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int h = 8 * nh + 2 * tig + j;
        float M = wm[0][h];
        for (int w = 1; w < W; ++w) M = fmaxf(M, wm[w][h]);
        f[nh][j] = wm[warp][h] == NEG_INF ? 0.f : exp2f(wm[warp][h] - M);
    }
    for (int w = 0; w < W; ++w) {
        if (warp == w) {
            #pragma unroll
            for (int mt = 0; mt < KS; ++mt)
            #pragma unroll
            for (int nh = 0; nh < NH; ++nh)
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int h = 8 * nh + 2 * tig + (j & 1);
                if (h < G) {
                    float& r = oacc[h * D + channel(mt, j >> 1, gid)];
                    r = (w ? r : 0.f) + f[nh][j & 1] * acc[mt][nh][j];
                }
            }
        }
        __syncthreads();
    }
    const long long o = ((long long)blockIdx.x * gridDim.y + bh) * G;
    if (threadIdx.x < G) {
        const int h = threadIdx.x;
        float M = wm[0][h];
        for (int w = 1; w < W; ++w) M = fmaxf(M, wm[w][h]);
        float lt = 0.f;
        for (int w = 0; w < W; ++w) lt += wm[w][h] == NEG_INF ? 0.f : exp2f(wm[w][h] - M) * wl[w][h];
        pm[o + h] = M;
        pl[o + h] = lt;
    }
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) pacc[o * D + i] = oacc[i];
}

__device__ __forceinline__ void merge(float& M, float& l, float& a, float mc, float lc, float ac) {
    const float mn = fmaxf(M, mc);
    const float sa = M == NEG_INF ? 0.f : exp2f(M - mn), sc = mc == NEG_INF ? 0.f : exp2f(mc - mn);
    l = l * sa + lc * sc;
    a = a * sa + ac * sc;
    M = mn;
}

#define RG 4        // split groups of the reduce
#define RB 12       // splits a thread loads at once

// one block per (batch, KV head, query head of its group), one thread per (channel, group of splits): each group
// merges its run of splits in order, then group 0 merges the groups in order
extern "C" __global__ void __launch_bounds__(D * RG) attend_reduce(const float* __restrict__ pm,
        const float* __restrict__ pl, const float* __restrict__ pacc, const int splits, ktype* __restrict__ out) {
    __shared__ float gm[RG], gl[RG], ga[RG][D];
    const int bhg = blockIdx.x, bh = bhg / G, g = bhg % G, BH = gridDim.x / G;
    const int ch = threadIdx.x, r = threadIdx.y, c1 = (r + 1) * splits / RG;
    float M = NEG_INF, l = 0.f, a = 0.f;
    for (int c0 = r * splits / RG; c0 < c1; c0 += RB) {
        float mc[RB], lc[RB], ac[RB];
        #pragma unroll
        for (int j = 0; j < RB; ++j) {
            const long long i = ((long long)(c0 + j) * BH + bh) * G + g;
            const bool ok = c0 + j < c1;
            mc[j] = ok ? pm[i] : NEG_INF;
            lc[j] = ok ? pl[i] : 0.f;
            ac[j] = ok ? pacc[i * D + ch] : 0.f;
        }
        #pragma unroll
        for (int j = 0; j < RB; ++j) merge(M, l, a, mc[j], lc[j], ac[j]);
    }
    if (ch == 0) { gm[r] = M; gl[r] = l; }
    ga[r][ch] = a;
    __syncthreads();
    if (r == 0) {
        M = NEG_INF; l = 0.f; a = 0.f;
        #pragma unroll
        for (int i = 0; i < RG; ++i) merge(M, l, a, gm[i], gl[i], ga[i][ch]);
        out[(long long)bhg * D + ch] = (ktype)(l > 0.f ? a / l : 0.f);
    }
}

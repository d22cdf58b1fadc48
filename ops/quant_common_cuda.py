"""CUDA C helpers shared by the packed 1/2-bit kernels (qk_quant_cuda, av_quant_cuda, quant_decode_cuda): warp
MMA m16n8k16 with fp32 accumulation, the fp16 / bf16 splits of its operands, byte permute, rotate, 2^x, and cp.async
staging (global -> shared, zero-filled past the end)."""

HELPERS = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ void mma_f16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// bytes of {b, a} (a: 0-3, b: 4-7) picked by the four selector nibbles; a nibble's bit 3 replicates the sign
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ float ex2(float x) {   // 2^x, one MUFU (tiny results flush to 0)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ unsigned rotl(unsigned x, unsigned r) { return __funnelshift_l(x, x, r); }
__device__ __forceinline__ unsigned rotr(unsigned x, unsigned r) { return __funnelshift_r(x, x, r); }

// copies `valid` (0..16) of 16 bytes and zero-fills the rest; src must be a readable address even when valid = 0
__device__ __forceinline__ void cp_async16(void* dst, const void* src, unsigned valid) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(d), "l"(src), "r"(valid));
}

__device__ __forceinline__ void cp_async8(void* dst, const void* src, unsigned valid) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" :: "r"(d), "l"(src), "r"(valid));
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src, unsigned valid) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(d), "l"(src), "r"(valid));
}

// nthr threads (a warp by default; thread `lane` of them) stage `total` bytes from src to shared dst in units of
// U bytes (16/8/4: cp.async; 2: plain loads), zero-filling from byte `valid` on; src (and dst) must be U-byte
// aligned and src readable
template <int U> __device__ __forceinline__ void stage_copy(void* dst, const void* src, int total, int valid,
                                                            int lane, int nthr = 32) {
    for (int j = lane; j < total / U; j += nthr) {
        const int v = min(max(valid - U * j, 0), U);
        const char* s = static_cast<const char*>(src) + (v > 0 ? U * j : 0);
        char* d = static_cast<char*>(dst) + U * j;
        if (U == 16) cp_async16(d, s, v);
        else if (U == 8) cp_async8(d, s, v);
        else if (U == 4) cp_async4(d, s, v);
        else *reinterpret_cast<unsigned short*>(d) = v > 0 ? *reinterpret_cast<const unsigned short*>(s) : 0;
    }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// A warp's cp.async pipeline over its `count` items, STAGES deep: issue(i, stage) stages item i (cp.async into
// stage = i % STAGES, counted without a division; one commit group per item), body(i, stage) runs once item i has
// landed; the warp syncs before and after a body, so no lane refills a stage that another lane still reads.
template <int STAGES, class Issue, class Body>
__device__ __forceinline__ void warp_pipeline(int count, Issue&& issue, Body&& body) {
    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) { if (i < count) issue(i, i); cp_async_commit(); }
    int next = STAGES - 1, now = 0;
    for (int i = 0; i < count; ++i) {
        if (i + STAGES - 1 < count) issue(i + STAGES - 1, next);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();
        __syncwarp();
        body(i, now);
        __syncwarp();
        next = next == STAGES - 1 ? 0 : next + 1;
        now = now == STAGES - 1 ? 0 : now + 1;
    }
}

// q split for fp16 MMA operands: part s (0: hi, 1: lo) of (x, y) * 2^e
__device__ __forceinline__ unsigned q_part(float x, float y, int e, int s) {
    x = ldexpf(x, e); y = ldexpf(y, e);
    __half hx = __float2half_rn(x), hy = __float2half_rn(y);
    if (s == 1) { hx = __float2half_rn(x - __half2float(hx)); hy = __float2half_rn(y - __half2float(hy)); }
    __half2 h = __halves2half2(hx, hy);
    return *reinterpret_cast<unsigned*>(&h);
}

// part s (0, 1, 2) of x in bf16: hi + mid + lo carry about 24 bits
__device__ __forceinline__ float bf16_part(float x, int s) {
    float hi = __bfloat162float(__float2bfloat16_rn(x));
    if (s == 0) return hi;
    x -= hi; hi = __bfloat162float(__float2bfloat16_rn(x));
    if (s == 1) return hi;
    return __bfloat162float(__float2bfloat16_rn(x - hi));
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// One 16-token tile of a value product (av_quant): A row r = part * G + head holds part `part_of`
// (of 3, bf16) of p * scale for this lane's 4 tokens (pr[mt][ri][j]: rows r0 = 16 mt + g, r1 = r0 + 8; tokens
// 4c + j); B = the codes of the tile's 16 tokens staged at st (WPT words each), as bf16 0..3; acc += A B and, for
// part 0, bacc += p * min. ss, sm: the tile's fp16 scales and mins (NGD per token).
template <int BITS, int D, int MT>
__device__ __forceinline__ void value_tile_mma(float (&acc)[MT][D / 8][4], float (&bacc)[MT][2][D < 64 ? 1 : D / 64],
                                               const float (&pr)[MT][2][4], const int (&part_of)[MT][2],
                                               const unsigned* st, const __half* ss, const __half* sm, int g, int c) {
    constexpr int CPW = 32 / BITS, WPT = D / CPW, VG = D < 64 ? D : 64, NGD = D / VG, NTILE = D / 8, TPW = CPW / 8;
    unsigned a[NGD][MT][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int ri = 0; ri < 2; ++ri)
    #pragma unroll
    for (int gd = 0; gd < NGD; ++gd) {
        float x[4];
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int tk = 4 * c + j;
            x[j] = bf16_part(pr[mt][ri][j] * __half2float(ss[tk * NGD + gd]), part_of[mt][ri]);
            if (part_of[mt][ri] == 0) bacc[mt][ri][gd] += pr[mt][ri][j] * __half2float(sm[tk * NGD + gd]);
        }
        a[gd][mt][ri] = pack_bf16(x[0], x[1]);       // rows r0 (ri 0) / r1 (ri 1), k = 2c, 2c+1
        a[gd][mt][2 + ri] = pack_bf16(x[2], x[3]);   // k = 2c+8, 2c+9
    }
    unsigned w[4][WPT];                              // this lane's 4 tokens, rotated for channel g
    #pragma unroll
    for (int j = 0; j < 4; ++j)
    #pragma unroll
    for (int k = 0; k < WPT; ++k) w[j][k] = rotr(st[(4 * c + j) * WPT + k], BITS * g);
    const unsigned mask = BITS == 1 ? 0x00010001u : 0x00030003u;
    const __nv_bfloat162 base = __floats2bfloat162_rn(128.f, 128.f);
    #pragma unroll
    for (int nt = 0; nt < NTILE; ++nt) {
        const int k = nt / TPW;
        const unsigned by = (nt % TPW) * BITS;
        const unsigned sel = by | (by << 4) | ((4u + by) << 8) | ((4u + by) << 12);
        unsigned x0 = (prmt(w[0][k], w[1][k], sel) & mask) | 0x43004300u;
        unsigned x1 = (prmt(w[2][k], w[3][k], sel) & mask) | 0x43004300u;
        __nv_bfloat162 y0 = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&x0), base);
        __nv_bfloat162 y1 = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&x1), base);
        const int gd = nt * 8 / VG;
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            mma_bf16(acc[mt][nt], a[gd][mt], *reinterpret_cast<unsigned*>(&y0), *reinterpret_cast<unsigned*>(&y1));
    }
}
"""

C_TYPES = {"torch.float32": "float", "torch.float16": "__half", "torch.bfloat16": "__nv_bfloat16"}

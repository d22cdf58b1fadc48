"""CUDA kernel for ops/linear.py: y = W x for one row x. A block of 256 threads takes ROWS rows of W; its threads
stride over K in 16-byte chunks (x from L1, W streamed past L1), each thread keeping ROWS fp32 sums, then one
block reduction per row and one rounding to the output dtype. Many small blocks (N / ROWS) spread the weight
over every SM without a tail wave; each thread has ROWS * UNROLL loads in flight."""
from __future__ import annotations

import functools

import numpy as np
import torch

from tailorkv.ops.cuda_launch import aligned, compile_module, launch, ptr

THREADS, ROWS = 256, 4
_SOURCE = r"""
#define THREADS %(threads)d
#define ROWS %(rows)d
struct bf16 { unsigned short b; };
struct f16 { unsigned short b; };
__device__ __forceinline__ float lo_f(unsigned w, bf16) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(unsigned w, bf16) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float lo_f(unsigned w, f16) {
    float f; asm("cvt.f32.f16 %%0, %%1;" : "=f"(f) : "h"((unsigned short)(w & 0xffffu))); return f; }
__device__ __forceinline__ float hi_f(unsigned w, f16) {
    float f; asm("cvt.f32.f16 %%0, %%1;" : "=f"(f) : "h"((unsigned short)(w >> 16))); return f; }
__device__ __forceinline__ unsigned short round_to(float x, bf16) {
    unsigned short r; asm("cvt.rn.bf16.f32 %%0, %%1;" : "=h"(r) : "f"(x)); return r; }
__device__ __forceinline__ unsigned short round_to(float x, f16) {
    unsigned short r; asm("cvt.rn.f16.f32 %%0, %%1;" : "=h"(r) : "f"(x)); return r; }

__device__ __forceinline__ uint4 load_stream(const uint4* p) {  // read once: do not keep it in L1
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%%0, %%1, %%2, %%3}, [%%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

template <typename T>
__device__ __forceinline__ float dot8(const uint4 w, const float* xf) {
    return lo_f(w.x, T{}) * xf[0] + hi_f(w.x, T{}) * xf[1] + lo_f(w.y, T{}) * xf[2] + hi_f(w.y, T{}) * xf[3]
         + lo_f(w.z, T{}) * xf[4] + hi_f(w.z, T{}) * xf[5] + lo_f(w.w, T{}) * xf[6] + hi_f(w.w, T{}) * xf[7];
}

__device__ __forceinline__ float dot16_fp8(const uint4 w, const float* xf) {  // 16 e4m3 codes, byte i = element i
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
    float s = 0.f;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        unsigned lo, hi;  // elements 4i, 4i + 1 and 4i + 2, 4i + 3 as f16x2 (the low byte to the low half)
        asm("{ .reg .b16 a, b;\n mov.b32 {a, b}, %%2;\n cvt.rn.f16x2.e4m3x2 %%0, a;\n cvt.rn.f16x2.e4m3x2 %%1, b; }"
            : "=r"(lo), "=r"(hi) : "r"(words[i]));
        s += lo_f(lo, f16{}) * xf[4 * i] + hi_f(lo, f16{}) * xf[4 * i + 1] + lo_f(hi, f16{}) * xf[4 * i + 2]
           + hi_f(hi, f16{}) * xf[4 * i + 3];
    }
    return s;
}

template <typename T>
struct Halves {   // a 16-byte chunk of a weight row: 8 bf16/fp16 values; x's 8 values
    static constexpr int UNROLL = 4;
    float xf[8];
    __device__ __forceinline__ Halves(const uint4* x, const int c) {
        const uint4 v = __ldg(x + c);
        const unsigned u[4] = {v.x, v.y, v.z, v.w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) { xf[2 * i] = lo_f(u[i], T{}); xf[2 * i + 1] = hi_f(u[i], T{}); }
    }
    __device__ __forceinline__ float dot(const uint4 w) const { return dot8<T>(w, xf); }
};

template <typename T>
struct E4m3 {     // a 16-byte chunk of a weight row: 16 e4m3 codes; x's 16 values (two uint4)
    static constexpr int UNROLL = 2;
    float xf[16];
    __device__ __forceinline__ E4m3(const uint4* x, const int c) {
        const uint4 a = __ldg(x + 2 * c), b = __ldg(x + 2 * c + 1);
        const unsigned u[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        #pragma unroll
        for (int i = 0; i < 8; ++i) { xf[2 * i] = lo_f(u[i], T{}); xf[2 * i + 1] = hi_f(u[i], T{}); }
    }
    __device__ __forceinline__ float dot(const uint4 w) const { return dot16_fp8(w, xf); }
};

// y = (W x) [* scale per row]: kc 16-byte chunks per row of W, ldw its row stride in chunks
template <typename T, typename Chunk>
__device__ __forceinline__ void gemv(const uint4* x, const uint4* w, const float* scale, unsigned short* y,
                                     const int N, const int kc, const long long ldw) {
    __shared__ float part[THREADS / 32][ROWS];
    const int r0 = blockIdx.x * ROWS;
    const int nr = min(ROWS, N - r0);
    float acc[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
    #pragma unroll Chunk::UNROLL
    for (int c = threadIdx.x; c < kc; c += THREADS) {
        const Chunk chunk(x, c);
        #pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (r < nr) acc[r] += chunk.dot(load_stream(w + (r0 + r) * ldw + c));
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        for (int o = 16; o; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
        if (lane == 0) part[warp][r] = acc[r];
    }
    __syncthreads();
    if (threadIdx.x < nr) {
        float s = 0.f;
        #pragma unroll
        for (int i = 0; i < THREADS / 32; ++i) s += part[i][threadIdx.x];
        y[r0 + threadIdx.x] = round_to(scale ? s * scale[r0 + threadIdx.x] : s, T{});
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) gemv_fp8_bf16(const uint4* x, const uint4* w,
        const float* scale, unsigned short* y, const int N, const int kc, const long long ldw) {
    gemv<bf16, E4m3<bf16>>(x, w, scale, y, N, kc, ldw);
}
extern "C" __global__ void __launch_bounds__(THREADS) gemv_fp8_f16(const uint4* x, const uint4* w,
        const float* scale, unsigned short* y, const int N, const int kc, const long long ldw) {
    gemv<f16, E4m3<f16>>(x, w, scale, y, N, kc, ldw);
}

extern "C" __global__ void __launch_bounds__(THREADS) gemv_bf16(const uint4* x, const uint4* w, unsigned short* y,
                                                                const int N, const int kc, const long long ldw) {
    gemv<bf16, Halves<bf16>>(x, w, nullptr, y, N, kc, ldw);
}
extern "C" __global__ void __launch_bounds__(THREADS) gemv_f16(const uint4* x, const uint4* w, unsigned short* y,
                                                               const int N, const int kc, const long long ldw) {
    gemv<f16, Halves<f16>>(x, w, nullptr, y, N, kc, ldw);
}
"""
NAMES = {torch.bfloat16: "gemv_bf16", torch.float16: "gemv_f16"}
FP8_NAMES = {torch.bfloat16: "gemv_fp8_bf16", torch.float16: "gemv_fp8_f16"}


def source() -> str:
    return _SOURCE % dict(threads=THREADS, rows=ROWS)


@functools.cache
def _module():
    return compile_module(source())


def _gemv(kernel, x: torch.Tensor, n: int, weight_args: tuple, kc: int, ldw: int) -> torch.Tensor:
    """y [..., n] in x's dtype from one launch over the weight's rows (weight_args: its pointer, and its scales')."""
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if n:
        launch(kernel, (-(-n // ROWS),), (THREADS,), (ptr(x), *weight_args, ptr(y), np.int32(n), np.int32(kc),
                                                      np.int64(ldw)), x.device)
    return y


def load(reference):
    kernels = {dt: _module().get_function(name) for dt, name in NAMES.items()}

    def linear(x, weight):
        """Kernel for one row (x.numel() == K) of bf16/fp16 with weight rows contiguous, K % 8 == 0 and 16-byte
        aligned rows; else F.linear."""
        K = x.shape[-1] if x.dim() else 0
        if x.numel() != K:  # several rows (prefill, batch > 1): cuBLAS's case, not a fallback
            return reference.uncounted(x, weight)
        ok = (x.dtype in kernels and weight.dtype == x.dtype and weight.dim() == 2 and weight.shape[1] == K
              and K % 8 == 0 and K > 0 and x.stride(-1) == 1 and weight.stride(1) == 1
              and weight.stride(0) % 8 == 0 and x.is_cuda and weight.is_cuda and x.device == weight.device
              and aligned(x, 16) and aligned(weight, 16))
        if not ok:
            return reference(x, weight)
        return _gemv(kernels[x.dtype], x, weight.shape[0], (ptr(weight),), K // 8, weight.stride(0) // 8)

    return linear


def load_fp8(reference):
    kernels = {dt: _module().get_function(name) for dt, name in FP8_NAMES.items()}

    def linear_fp8(x, codes, scale):
        """Kernel for one row of bf16/fp16 (x.numel() == K) with e4m3 rows contiguous, K % 16 == 0, 16-byte aligned
        rows and fp32 scales [N] contiguous; else the reference."""
        K = x.shape[-1] if x.dim() else 0
        if x.numel() != K:  # several rows: the reference's case, not a fallback
            return reference.uncounted(x, codes, scale)
        ok = (x.dtype in kernels and codes.dtype == torch.float8_e4m3fn and codes.dim() == 2 and codes.shape[1] == K
              and K % 16 == 0 and K > 0 and x.stride(-1) == 1 and codes.stride(1) == 1
              and codes.stride(0) % 16 == 0 and scale.dtype == torch.float32 and scale.is_contiguous()
              and scale.shape == (codes.shape[0],) and all(t.is_cuda and t.device == x.device for t in (codes, scale))
              and aligned(x, 16) and aligned(codes, 16))
        if not ok:
            return reference(x, codes, scale)
        return _gemv(kernels[x.dtype], x, codes.shape[0], (ptr(codes), ptr(scale)), K // 16, codes.stride(0) // 16)

    return linear_fp8

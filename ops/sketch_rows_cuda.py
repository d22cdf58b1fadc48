"""CUDA kernel for sketch_rows (ops/sketch_rows.py): one thread per output element (a chosen row's channel): its
code from the sketch word (channel 2j of a word at bits [j * bits, ..), 2j + 1 at [16 + j * bits, ..)), times the
group's fp16 scale, plus its min, in fp32 with the reference's two roundings, then rounded to the output dtype."""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import compile_module, launch, ptr
from tailorkv.ops.quant_common_cuda import C_TYPES

THREADS = 256
_HEAD = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"
_SOURCE = r"""
__device__ __forceinline__ void put(float* p, float x) { *p = x; }
__device__ __forceinline__ void put(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void put(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

extern "C" __global__ void sketch_rows_kernel(
        const unsigned* __restrict__ codes, const long long cb, const long long ch, const long long cn,
        const __half* __restrict__ scale, const long long sb, const long long sh, const long long sn,
        const __half* __restrict__ mins, const long long mb, const long long mh, const long long mnn,
        const long long* __restrict__ pos, otype* __restrict__ out, const int H, const int K, const int D,
        const int bits, const int group, const long long offset, const long long elements) {
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= elements) return;
    const long long row = e / D;
    const int c = (int)(e % D), b = (int)(row / ((long long)H * K)), h = (int)((row / K) % H);
    const long long i = pos[row] - offset, g = i / group;
    const int cpw = 32 / bits, p = c % cpw;
    const unsigned word = codes[b * cb + h * ch + i * cn + c / cpw];
    const unsigned code = (word >> ((p & 1) * 16 + (p >> 1) * bits)) & ((1u << bits) - 1u);
    const float s = __half2float(scale[b * sb + h * sh + g * sn + c]);
    const float m = __half2float(mins[b * mb + h * mh + g * mnn + c]);
    put(out + e, __fadd_rn(__fmul_rn((float)code, s), m));
}
"""


def load(reference):
    """reference: the torch sketch_rows, for the arguments the kernel does not take."""
    kernels = {}

    def kernel(dtype):
        if dtype not in kernels:
            source = _HEAD + f"typedef {C_TYPES[str(dtype)]} otype;\n" + _SOURCE
            kernels[dtype] = compile_module(source).get_function("sketch_rows_kernel")
        return kernels[dtype]
    kernel(torch.bfloat16)  # fail early

    def sketch_rows(codes, scale, mn, bits, group, pos, offset, out):
        """The kernel for int32 codes, fp16 scale / min, unit stride along their last dim, int64 pos, a
        contiguous out of fp32 / fp16 / bf16, all on one device; else the torch reference."""
        dev = pos.device
        if (str(out.dtype) not in C_TYPES or not out.is_contiguous() or pos.dtype != torch.int64
                or codes.dtype != torch.int32 or scale.dtype != torch.float16 or mn.dtype != torch.float16
                or any(t.stride(-1) != 1 or not t.is_cuda or t.device != dev for t in (codes, scale, mn, out))
                or not pos.is_cuda or bits not in (1, 2, 4)):
            return reference(codes, scale, mn, bits, group, pos, offset, out)
        B, H, K = pos.shape
        n = out.numel()
        if n == 0:
            return out
        p = pos if pos.is_contiguous() else pos.contiguous()
        st = lambda t: tuple(np.int64(s) for s in t.stride()[:3])  # noqa: E731 - batch, head and row strides
        launch(kernel(out.dtype), (-(-n // THREADS),), (THREADS,),
               (ptr(codes), *st(codes), ptr(scale), *st(scale), ptr(mn), *st(mn), ptr(p), ptr(out),
                np.int32(H), np.int32(K), np.int32(out.shape[-1]), np.int32(bits), np.int32(group),
                np.int64(offset), np.int64(n)), dev)
        return out

    return sketch_rows

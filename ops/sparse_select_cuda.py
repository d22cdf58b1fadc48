"""CUDA kernel for the token selection of sparse layers (ops/sparse_select.py): approx_scores.

approx_scores: one thread per 8 (bf16/fp16) or 4 (fp32) consecutive tokens of one (batch, KV head), the r
    summed query channels in shared memory, 16-byte loads of each K^T row: a stream at memory speed.
topk_tokens has none: torch.topk serves.
"""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import aligned, compile_module, launch, ptr
from tailorkv.ops.quant_common_cuda import C_TYPES

_APPROX = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef {qt} qtype;
typedef {kt} ktype;
#define VEC {vec}
__device__ __forceinline__ float to_float(float x) {{ return x; }}
__device__ __forceinline__ float to_float(__half x) {{ return __half2float(x); }}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {{ return __bfloat162float(x); }}

extern "C" __global__ void __launch_bounds__(128) approx_scores_kernel(
        const qtype* __restrict__ q, const long long qsb, const long long qsh, const int D,
        const ktype* __restrict__ kt, const long long ksb, const long long ksh, const long long ksr,
        const long long* __restrict__ ch, const long long csb, const long long csh, const long long csr,
        float* __restrict__ out, const long long osb, const long long osh,
        const int Hkv, const int G, const int r, const int N) {{
    __shared__ float qsum[256];
    const int bh = blockIdx.y, b = bh / Hkv, h = bh % Hkv;
    for (int j = threadIdx.x; j < r; j += blockDim.x) {{
        long long c = ch[b * csb + h * csh + j * csr];
        c = c < 0 ? 0 : (c >= D ? D - 1 : c);                  // never read outside q
        float s = 0.f;
        for (int g = 0; g < G; ++g) s += to_float(q[b * qsb + (long long)(h * G + g) * qsh + c]);
        qsum[j] = s;
    }}
    __syncthreads();
    const long long n0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (n0 >= N) return;
    const ktype* base = kt + b * ksb + h * ksh + n0;
    float* o = out + b * osb + h * osh + n0;
    if (VEC > 1 && n0 + VEC <= N) {{
        float acc[VEC];
        #pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
        #pragma unroll 4
        for (int j = 0; j < r; ++j) {{
            const uint4 u = __ldg(reinterpret_cast<const uint4*>(base + j * ksr));
            const ktype* x = reinterpret_cast<const ktype*>(&u);
            #pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] += qsum[j] * to_float(x[i]);
        }}
        #pragma unroll
        for (int i = 0; i < VEC; i += 4) *reinterpret_cast<float4*>(o + i) = make_float4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]);
    }} else {{
        const int n = (int)min((long long)VEC, N - n0);
        for (int i = 0; i < n; ++i) {{
            float a = 0.f;
            for (int j = 0; j < r; ++j) a += qsum[j] * to_float(base[j * ksr + i]);
            o[i] = a;
        }}
    }}
}}
"""

def approx_source(qdtype: torch.dtype, kdtype: torch.dtype, vec: int) -> str:
    return _APPROX.format(qt=C_TYPES[str(qdtype)], kt=C_TYPES[str(kdtype)], vec=vec)


def load_approx_scores(reference):
    """reference: the torch approx_scores, for the arguments the kernel does not take."""
    compile_module(approx_source(torch.bfloat16, torch.bfloat16, 8)).get_function("approx_scores_kernel")
    kernels = {}

    def approx_scores(q, kt_rows, channels, out=None):
        """Kernel for q and kt_rows of fp32/fp16/bf16 with unit token stride, r <= 256 channels; out (if given)
        fp32 [B, Hkv, N] with unit token stride. Channel indices are clamped to [0, D). Else the reference."""
        B, Hq, one, D = q.shape
        _, Hkv, r, N = kt_rows.shape
        ok = (one == 1 and Hkv > 0 and Hq % Hkv == 0 and r <= 256 and q.stride(-1) == 1
              and kt_rows.stride(-1) == 1 and str(q.dtype) in C_TYPES and str(kt_rows.dtype) in C_TYPES
              and channels.dtype == torch.int64 and channels.shape == (B, Hkv, r)
              and (out is None or (out.shape == (B, Hkv, N) and out.dtype == torch.float32
                                   and out.stride(-1) == 1))
              and all(t.is_cuda and t.device == q.device for t in (kt_rows, channels)))
        if not ok:
            return reference(q, kt_rows, channels, out)
        if out is None:
            out = torch.empty(B, Hkv, N, dtype=torch.float32, device=q.device)
        if out.numel() == 0:
            return out
        vec = 16 // kt_rows.element_size()
        if not (aligned(kt_rows, 16) and aligned(out, 16)):
            vec = 1
        key = (q.dtype, kt_rows.dtype, vec)
        if key not in kernels:
            kernels[key] = compile_module(approx_source(*key)).get_function("approx_scores_kernel")
        launch(kernels[key], (-(-N // (128 * vec)), B * Hkv), (128,),
               (ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)), np.int32(D),
                ptr(kt_rows), np.int64(kt_rows.stride(0)), np.int64(kt_rows.stride(1)), np.int64(kt_rows.stride(2)),
                ptr(channels), np.int64(channels.stride(0)), np.int64(channels.stride(1)),
                np.int64(channels.stride(2)), ptr(out), np.int64(out.stride(0)), np.int64(out.stride(1)),
                np.int32(Hkv), np.int32(Hq // Hkv), np.int32(r), np.int32(N)), q.device)
        return out

    return approx_scores

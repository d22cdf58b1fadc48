"""CUDA kernel for the token selection of sparse layers (ops/sparse_select.py): approx_scores.

approx_scores: one thread per 8 (e4m3, bf16/fp16) or 4 (fp32) consecutive tokens of one (batch, KV head), the r
    summed query channels in shared memory, LOAD_BYTES-wide loads of each K^T row: a stream at memory speed.
    With rule "lse" each thread keeps the G heads' logits apart and writes their logsumexp (scaled); tokens
    at or past `end - offset` score -inf. topk_tokens' kernel is in ops/topk_cuda.py.
"""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import aligned, compile_module, launch, ptr
from tailorkv.ops.quant_common_cuda import C_TYPES

K_TYPES = {**C_TYPES, "torch.float8_e4m3fn": "__nv_fp8_e4m3"}  # K^T rows may be stored in 8 bits (kt_store.py)

_APPROX = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
typedef {qt} qtype;
typedef {kt} ktype;
#define VEC {vec}
#define LOAD {load}
#define G {g}
#define LSE {lse}
#define NEG_INF __int_as_float(0xff800000u)
__device__ __forceinline__ float to_float(float x) {{ return x; }}
__device__ __forceinline__ float to_float(__half x) {{ return __half2float(x); }}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {{ return __bfloat162float(x); }}
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) {{ return float(x); }}

// one score per token from the group's G per-head logits over the r channels
__device__ __forceinline__ float combine(const float* a, const float scale) {{
#if LSE
    float m = NEG_INF;
    #pragma unroll
    for (int g = 0; g < G; ++g) m = fmaxf(m, a[g] * scale);
    float s = 0.f;
    #pragma unroll
    for (int g = 0; g < G; ++g) s += __expf(a[g] * scale - m);
    return m + __logf(s);
#else
    return a[0];
#endif
}}

extern "C" __global__ void __launch_bounds__(128) approx_scores_kernel(
        const qtype* __restrict__ q, const long long qsb, const long long qsh, const int D,
        const ktype* __restrict__ kt, const long long ksb, const long long ksh, const long long ksr,
        const long long* __restrict__ ch, const long long csb, const long long csh, const long long csr,
        float* __restrict__ out, const long long osb, const long long osh,
        const int Hkv, const int r, const int N, const float scale,
        const unsigned long long end_addr, const long long offset) {{
    // LSE: the r selected channels of each of the G heads; else their sum over the group (one row)
    __shared__ float qs[LSE ? G : 1][256];
    const int bh = blockIdx.y, b = bh / Hkv, h = bh % Hkv;
    for (int j = threadIdx.x; j < r; j += blockDim.x) {{
        long long c = ch[b * csb + h * csh + j * csr];
        c = c < 0 ? 0 : (c >= D ? D - 1 : c);                  // never read outside q
        float s = 0.f;
        for (int g = 0; g < G; ++g) {{
            const float x = to_float(q[b * qsb + (long long)(h * G + g) * qsh + c]);
            if (LSE) qs[LSE ? g : 0][j] = x; else s += x;
        }}
        if (!LSE) qs[0][j] = s;
    }}
    __syncthreads();
    const long long n0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (n0 >= N) return;
    long long lim = N;                                          // tokens n >= lim score -inf
    if (end_addr) {{ lim = *reinterpret_cast<const long long*>(end_addr) - offset; lim = lim < 0 ? 0 : lim; }}
    const ktype* base = kt + b * ksb + h * ksh + n0;
    float* o = out + b * osb + h * osh + n0;
    constexpr int NG = LSE ? G : 1;
    if (VEC > 1 && n0 + VEC <= N) {{
        float acc[VEC][NG];
        #pragma unroll
        for (int i = 0; i < VEC; ++i)
            #pragma unroll
            for (int g = 0; g < NG; ++g) acc[i][g] = 0.f;
        #pragma unroll 4
        for (int j = 0; j < r; ++j) {{
            const LOAD u = __ldg(reinterpret_cast<const LOAD*>(base + j * ksr));
            const ktype* x = reinterpret_cast<const ktype*>(&u);
            #pragma unroll
            for (int i = 0; i < VEC; ++i) {{
                const float xv = to_float(x[i]);
                #pragma unroll
                for (int g = 0; g < NG; ++g) acc[i][g] += qs[g][j] * xv;
            }}
        }}
        float res[VEC];
        #pragma unroll
        for (int i = 0; i < VEC; ++i) res[i] = (n0 + i < lim) ? combine(acc[i], scale) : NEG_INF;
        #pragma unroll
        for (int i = 0; i < VEC; i += 4) *reinterpret_cast<float4*>(o + i) = make_float4(res[i], res[i + 1], res[i + 2], res[i + 3]);
    }} else {{
        const int n = (int)min((long long)VEC, N - n0);
        for (int i = 0; i < n; ++i) {{
            float a[NG];
            for (int g = 0; g < NG; ++g) {{
                a[g] = 0.f;
                for (int j = 0; j < r; ++j) a[g] += qs[g][j] * to_float(base[j * ksr + i]);
            }}
            o[i] = (n0 + i < lim) ? combine(a, scale) : NEG_INF;
        }}
    }}
}}
"""

# By element size: the bytes of a row each thread loads at once. e4m3 rows in 8: 3.7 / 4.3 / 9.2 us at 8k / 32k / 128k
# tokens against 4.8 / 5.4 / 9.2 in 16 (bf16 rows in 16: 4.1 / 4.7 / 10.8; H100, bench/probes/approx_e4m3.py).
LOAD_BYTES = {1: 8, 2: 16, 4: 16}


def approx_source(qdtype: torch.dtype, kdtype: torch.dtype, vec: int, g: int, lse: bool) -> str:
    load = {16: "uint4", 8: "uint2", 4: "unsigned int"}[max(4, vec * kdtype.itemsize)]
    return _APPROX.format(qt=C_TYPES[str(qdtype)], kt=K_TYPES[str(kdtype)], vec=vec, g=g, lse=int(lse), load=load)


def load_approx_scores(reference):
    """reference: the torch approx_scores, for the arguments the kernel does not take."""
    compile_module(approx_source(torch.bfloat16, torch.bfloat16, 8, 4, True)).get_function("approx_scores_kernel")
    kernels = {}

    def approx_scores(q, kt_rows, channels, out=None, rule="sum", sm_scale=1.0, end=None, offset=0):
        """Kernel for q of fp32/fp16/bf16 and kt_rows of those or e4m3, with unit token stride, r <= 256 channels, groups of at
        most 16 heads, rule sum or lse; out (if given) fp32 [B, Hkv, N] with unit token stride; end a one-element
        int64 tensor on the device. Channel indices are clamped to [0, D). Else the reference."""
        B, Hq, one, D = q.shape
        _, Hkv, r, N = kt_rows.shape
        ok = (one == 1 and Hkv > 0 and Hq % Hkv == 0 and Hq // Hkv <= 16 and r <= 256 and rule in ("sum", "lse")
              and q.stride(-1) == 1 and kt_rows.stride(-1) == 1 and str(q.dtype) in C_TYPES
              and str(kt_rows.dtype) in K_TYPES
              and channels.dtype == torch.int64 and channels.shape == (B, Hkv, r)
              and (out is None or (out.shape == (B, Hkv, N) and out.dtype == torch.float32
                                   and out.stride(-1) == 1))
              and (end is None or (end.numel() == 1 and end.dtype == torch.int64 and end.is_cuda
                                   and end.device == q.device))
              and all(t.is_cuda and t.device == q.device for t in (kt_rows, channels)))
        if not ok:
            return reference(q, kt_rows, channels, out, rule, sm_scale, end, offset)
        if out is None:
            out = torch.empty(B, Hkv, N, dtype=torch.float32, device=q.device)
        if out.numel() == 0:
            return out
        load = LOAD_BYTES[kt_rows.element_size()]
        vec = load // kt_rows.element_size()
        if not (aligned(kt_rows, load) and aligned(out, 16)):
            vec = 1
        key = (q.dtype, kt_rows.dtype, vec, Hq // Hkv, rule == "lse")
        if key not in kernels:
            kernels[key] = compile_module(approx_source(*key)).get_function("approx_scores_kernel")
        launch(kernels[key], (-(-N // (128 * vec)), B * Hkv), (128,),
               (ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)), np.int32(D),
                ptr(kt_rows), np.int64(kt_rows.stride(0)), np.int64(kt_rows.stride(1)), np.int64(kt_rows.stride(2)),
                ptr(channels), np.int64(channels.stride(0)), np.int64(channels.stride(1)),
                np.int64(channels.stride(2)), ptr(out), np.int64(out.stride(0)), np.int64(out.stride(1)),
                np.int32(Hkv), np.int32(r), np.int32(N), np.float32(sm_scale),
                np.uint64(0 if end is None else end.data_ptr()), np.int64(offset)), q.device)
        return out

    return approx_scores

"""CUDA kernel for sparse_decode_attention (ops/attention.py): a sparse layer's device slots and its selected
rows of the pinned host store in one softmax, the host rows read zero-copy (UVA) inside the attention, so no
gather, cat or mask tensors exist (or, with rows_gathered, the same rows gathered before into a [B, Hkv, K, D]
buffer, read by slot).

Pass 1: the keys (device slots, then the K selected positions) are split into contiguous chunks, one block
per (chunk, batch, KV head); each warp takes every WARPS-th key of the chunk, decides from the device scalars
whether it is held (a key that is not held is never read), loads its K and V rows together (lane l holds
channels l*CPL .. l*CPL+CPL-1), reduces the G heads' dot products over the warp and keeps a running max, sum
and output per head in fp32. The block's warps merge in shared memory and write one partial per (chunk, head).
Pass 2 merges the chunks of each (batch, query head) in a fixed order; no key held -> zeros.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tailorkv.ops.cuda_launch import compile_module, launch, ptr
from tailorkv.ops.host_memory import gpu_readable
from tailorkv.ops.quant_common_cuda import C_TYPES

WARPS = 8

_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define D {d}
#define G {g}
#define WARPS {warps}
#define CPL (D / 32)
#define NEG_INF __int_as_float(0xff800000u)
typedef {kt} ktype;
__device__ __forceinline__ float to_float(__half x) {{ return __half2float(x); }}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {{ return __bfloat162float(x); }}

extern "C" __global__ void __launch_bounds__(WARPS * 32) sparse_attend_partial(
        const ktype* __restrict__ q, const long long qsb, const long long qsh,
        const ktype* __restrict__ dk, const ktype* __restrict__ dv, const long long dsb, const long long dsh,
        const long long dsn, const int SC,
        const unsigned long long hk_addr, const unsigned long long hv_addr, const long long hsb,
        const long long hsh, const long long hsn, const long long N,
        const long long* __restrict__ pos, const long long psb, const long long psh, const int K,
        const long long offset, const long long* __restrict__ position, const long long* __restrict__ tail_start,
        const int sink, const int Hkv, const int chunk, const float scale_log2, const int by_slot,
        float* __restrict__ pm, float* __restrict__ pl, float* __restrict__ pacc) {{
    __shared__ float wm[WARPS][G], wl[WARPS][G];
    __shared__ float wacc[WARPS][G][D];
    const int bh = blockIdx.y, b = bh / Hkv, h = bh % Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long p = position[0], ts = tail_start[0];
    const int J = SC + K, j0 = blockIdx.x * chunk, j1 = min(J, j0 + chunk);
    const ktype* hk = reinterpret_cast<const ktype*>(hk_addr);
    const ktype* hv = reinterpret_cast<const ktype*>(hv_addr);
    float qf[G][CPL];
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int c = 0; c < CPL; ++c)
            qf[g][c] = to_float(q[b * qsb + (long long)(h * G + g) * qsh + lane * CPL + c]);
    float m[G], l[G], acc[G][CPL];
    #pragma unroll
    for (int g = 0; g < G; ++g) {{
        m[g] = NEG_INF; l[g] = 0.f;
        #pragma unroll
        for (int c = 0; c < CPL; ++c) acc[g][c] = 0.f;
    }}
    for (int j = j0 + warp; j < j1; j += WARPS) {{
        const ktype *kp, *vp;
        if (j < SC) {{
            const bool held = j < sink ? (long long)j <= p : (long long)(j - sink) <= p - ts;
            if (!held) continue;
            kp = dk + b * dsb + h * dsh + (long long)j * dsn;
            vp = dv + b * dsb + h * dsh + (long long)j * dsn;
        }} else {{
            const long long a = pos[b * psb + h * psh + (j - SC)] + offset;
            if (a < sink || a >= ts || a >= N) continue;
            const long long row = by_slot ? (long long)(j - SC) : a;  // gathered rows, or the whole store
            kp = hk + b * hsb + h * hsh + row * hsn;
            vp = hv + b * hsb + h * hsh + row * hsn;
        }}
        float kf[CPL], vf[CPL];
        #pragma unroll
        for (int c = 0; c < CPL; ++c) {{ kf[c] = to_float(kp[lane * CPL + c]); vf[c] = to_float(vp[lane * CPL + c]); }}
        #pragma unroll
        for (int g = 0; g < G; ++g) {{
            float s = 0.f;
            #pragma unroll
            for (int c = 0; c < CPL; ++c) s += qf[g][c] * kf[c];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            s *= scale_log2;
            const float mn = fmaxf(m[g], s), corr = exp2f(m[g] - mn), e = exp2f(s - mn);
            l[g] = l[g] * corr + e;
            #pragma unroll
            for (int c = 0; c < CPL; ++c) acc[g][c] = acc[g][c] * corr + e * vf[c];
            m[g] = mn;
        }}
    }}
    #pragma unroll
    for (int g = 0; g < G; ++g) {{
        if (lane == 0) {{ wm[warp][g] = m[g]; wl[warp][g] = l[g]; }}
        #pragma unroll
        for (int c = 0; c < CPL; ++c) wacc[warp][g][lane * CPL + c] = acc[g][c];
    }}
    __syncthreads();
    const long long part = ((long long)blockIdx.x * gridDim.y + bh) * G;   // [chunk][b*Hkv + h][g]
    for (int t = threadIdx.x; t < G * D; t += WARPS * 32) {{
        const int g = t / D, c = t % D;
        float M = NEG_INF;
        for (int w = 0; w < WARPS; ++w) M = fmaxf(M, wm[w][g]);
        float L = 0.f, A = 0.f;
        if (M != NEG_INF)
            for (int w = 0; w < WARPS; ++w) {{
                const float f = exp2f(wm[w][g] - M);   // a warp with no key: m = -inf, f = 0
                L += wl[w][g] * f;
                A += wacc[w][g][c] * f;
            }}
        pacc[(part + g) * D + c] = A;
        if (c == 0) {{ pm[part + g] = M; pl[part + g] = L; }}
    }}
}}

extern "C" __global__ void sparse_attend_merge(
        const float* __restrict__ pm, const float* __restrict__ pl, const float* __restrict__ pacc,
        const int chunks, const int BH, ktype* __restrict__ out, const long long osb, const long long osh,
        const int Hkv) {{
    const int bhg = blockIdx.x;                 // (b * Hkv + h) * G + g
    const int bh = bhg / G, g = bhg % G, b = bh / Hkv, h = bh % Hkv, c = threadIdx.x;
    float M = NEG_INF;
    for (int s = 0; s < chunks; ++s) M = fmaxf(M, pm[(long long)s * BH * G + bhg]);
    float L = 0.f, A = 0.f;
    if (M != NEG_INF)
        for (int s = 0; s < chunks; ++s) {{
            const long long i = (long long)s * BH * G + bhg;
            const float f = exp2f(pm[i] - M);
            L += pl[i] * f;
            A += pacc[i * D + c] * f;
        }}
    const float o = L > 0.f ? A / L : 0.f;
    out[b * osb + (long long)(h * G + g) * osh + c] = (ktype)o;
}}
"""


def load(reference):
    """reference: the torch sparse_decode_attention, for the arguments the kernel does not take."""
    compile_module(_SOURCE.format(d=128, g=4, warps=WARPS, kt=C_TYPES["torch.bfloat16"])).get_function(
        "sparse_attend_partial")  # fail early
    kernels = {}

    def sparse_decode_attention(q, dev_k, dev_v, host_k, host_v, pos, position, tail_start, sink,
                                pos_offset=0, sm_scale=None, rows_gathered=False):
        """Kernel for bf16/fp16 inputs of one dtype, head dim 64 or 128, groups of at most 8 heads, unit channel
        stride, dev_k/dev_v and host_k/host_v each of one layout, host rows pinned or on the device, int64
        pos/position/tail_start on q's device. Else the reference."""
        B, Hq, one, D = q.shape
        Hkv, SC = dev_k.shape[1], dev_k.shape[2]
        K = 0 if pos is None else pos.shape[-1]
        args = (q, dev_k, dev_v, host_k, host_v, pos, position, tail_start, sink, pos_offset, sm_scale, rows_gathered)
        dev = q.device
        ok = (one == 1 and D in (64, 128) and Hkv > 0 and Hq % Hkv == 0 and Hq // Hkv <= 8
              and str(q.dtype) in ("torch.bfloat16", "torch.float16")
              and all(t.dtype == q.dtype and t.stride(-1) == 1 for t in (q, dev_k, dev_v))
              and dev_k.stride() == dev_v.stride() and dev_k.is_cuda and dev_v.is_cuda and dev_k.device == dev
              and position.dtype == torch.int64 and tail_start.dtype == torch.int64
              and position.device == dev and tail_start.device == dev)
        if ok and K > 0:
            ok = (host_k is not None and host_v is not None and host_k.dtype == q.dtype
                  and host_v.dtype == q.dtype and host_k.stride() == host_v.stride() and host_k.stride(-1) == 1
                  and host_k.shape == host_v.shape and host_k.shape[:2] == (B, Hkv)
                  and all(t.device == dev if t.is_cuda else gpu_readable(t) for t in (host_k, host_v))
                  and pos.dtype == torch.int64 and pos.device == dev and pos.shape == (B, Hkv, K)
                  and pos.stride(-1) == 1 and (not rows_gathered or host_k.shape[2] == K))
        if not ok:
            return reference(*args)
        G = Hq // Hkv
        scale = (1.0 / math.sqrt(D)) if sm_scale is None else sm_scale
        key = (q.dtype, D, G)
        if key not in kernels:
            mod = compile_module(_SOURCE.format(d=D, g=G, warps=WARPS, kt=C_TYPES[str(q.dtype)]))
            kernels[key] = (mod.get_function("sparse_attend_partial"), mod.get_function("sparse_attend_merge"))
        partial, merge = kernels[key]
        J = SC + K
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        chunks = max(1, min(-(-J // WARPS), -(-2 * sms // (B * Hkv))))
        chunk = -(-J // chunks)
        chunks = -(-J // chunk)
        pm = torch.empty(chunks, B * Hkv, G, dtype=torch.float32, device=dev)
        pl = torch.empty_like(pm)
        pacc = torch.empty(chunks, B * Hkv, G, D, dtype=torch.float32, device=dev)
        out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=dev)
        if K > 0:
            hk, hv = host_k.data_ptr(), host_v.data_ptr()  # pinned memory under UVA: the host address works
            hs = host_k.stride()
            N = host_k.shape[2] if not rows_gathered else 2**62  # gathered rows: no store length to check
            pst = (pos.stride(0), pos.stride(1))
            pos_ptr = ptr(pos)
        else:
            hk = hv = 0
            hs, N, pst, pos_ptr = (0, 0, 0, 0), 0, (0, 0), np.uint64(0)
        launch(partial, (chunks, B * Hkv), (WARPS * 32,),
               (ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
                ptr(dev_k), ptr(dev_v), np.int64(dev_k.stride(0)), np.int64(dev_k.stride(1)),
                np.int64(dev_k.stride(2)), np.int32(SC),
                np.uint64(hk), np.uint64(hv), np.int64(hs[0]), np.int64(hs[1]), np.int64(hs[2]), np.int64(N),
                pos_ptr, np.int64(pst[0]), np.int64(pst[1]), np.int32(K), np.int64(pos_offset),
                ptr(position), ptr(tail_start), np.int32(sink), np.int32(Hkv), np.int32(chunk),
                np.float32(scale * math.log2(math.e)), np.int32(bool(rows_gathered)), ptr(pm), ptr(pl), ptr(pacc)),
               dev)
        launch(merge, (B * Hkv * G,), (D,),
               (ptr(pm), ptr(pl), ptr(pacc), np.int32(chunks), np.int32(B * Hkv), ptr(out),
                np.int64(out.stride(0)), np.int64(out.stride(1)), np.int32(Hkv)), dev)
        return out

    return sparse_decode_attention

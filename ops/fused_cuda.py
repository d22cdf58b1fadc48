"""CUDA kernels for ops/fused.py: RMSNorm (optionally adding the residual first), RoPE on q and k in one launch,
SiLU(gate) * up. Each kernel reproduces its torch reference's rounding steps (fp32 math, a cast to the activation
dtype wherever the reference casts), so they agree to the last bit except where a reduction order or a libm ulp
differs. No headers: bf16/fp16 conversions are PTX cvt instructions (sm_80+), so NVRTC needs no CUDA include path.
Launches go on torch's current stream, allocate nothing in CuPy and never sync: a CUDA graph can capture them.
Arguments a kernel does not cover (dtype, layout, odd sizes) go to the reference."""
from __future__ import annotations

import functools

import numpy as np
import torch

_SOURCE = r"""
struct bf16 { unsigned short b; };
struct f16 { unsigned short b; };
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __uint_as_float(((unsigned)x.b) << 16); }
__device__ __forceinline__ float to_f(f16 x) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.b)); return f; }
template <typename T> __device__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) {
    bf16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.b) : "f"(x)); return r; }
template <> __device__ __forceinline__ f16 from_f<f16>(float x) {
    f16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.b) : "f"(x)); return r; }
template <typename T> __device__ __forceinline__ float rnd(float x) { return to_f(from_f<T>(x)); }

template <typename T, typename V> union Pack { V v; T e[sizeof(V) / sizeof(T)]; };

__device__ __forceinline__ float block_sum(float v) {  // blockDim.x a multiple of 32; every thread gets the sum
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < (blockDim.x >> 5) ? part[threadIdx.x & 31] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#define RMS_VPT 4  // 16-byte vectors per thread, held in registers between the sum and the scaling
template <typename T, bool ADD>
__device__ __forceinline__ void rms_norm_row(const unsigned long long x_addr, const unsigned long long w_addr,
                                             const unsigned long long res_addr, const unsigned long long y_addr,
                                             const int nvec, const float inv_n, const float eps) {
    constexpr int E = 16 / sizeof(T);
    const long long base = (long long)blockIdx.x * nvec;
    const uint4* x = (const uint4*)x_addr + base;
    uint4* res = (uint4*)res_addr + base;
    const uint4* w = (const uint4*)w_addr;
    uint4* y = (uint4*)y_addr + base;
    Pack<T, uint4> v[RMS_VPT], wv[RMS_VPT];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < RMS_VPT; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < nvec) {
            v[i].v = x[c];
            wv[i].v = w[c];
            if (ADD) {  // h = residual + x, rounded to T as torch's add does; written back into the residual
                Pack<T, uint4> r;
                r.v = res[c];
#pragma unroll
                for (int e = 0; e < E; ++e) v[i].e[e] = from_f<T>(__fadd_rn(to_f(r.e[e]), to_f(v[i].e[e])));
                res[c] = v[i].v;
            }
#pragma unroll
            for (int e = 0; e < E; ++e) { const float f = to_f(v[i].e[e]); ss += f * f; }
        }
    }
    const float r = rsqrtf(__fadd_rn(__fmul_rn(block_sum(ss), inv_n), eps));
#pragma unroll
    for (int i = 0; i < RMS_VPT; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < nvec) {
            Pack<T, uint4> o;
#pragma unroll
            for (int e = 0; e < E; ++e)  // weight * (x * r).to(T)
                o.e[e] = from_f<T>(__fmul_rn(to_f(wv[i].e[e]), rnd<T>(__fmul_rn(to_f(v[i].e[e]), r))));
            y[c] = o.v;
        }
    }
}

template <typename T>  // one thread per (row of q or k, rotation pair j); x updated in place
__device__ __forceinline__ void rope_pair(const unsigned long long q_addr, const unsigned long long k_addr,
                                          const unsigned long long pos_addr, const unsigned long long inv_addr,
                                          const int hq, const int hkv, const int t_len, const int half,
                                          const long long qb, const long long qh, const long long qt,
                                          const long long kb, const long long kh, const long long kt) {
    const int j = threadIdx.x, h = blockIdx.y * blockDim.y + threadIdx.y;
    if (h >= hq + hkv || j >= half) return;
    const int b = blockIdx.x / t_len, t = blockIdx.x - b * t_len;
    T* x = h < hq ? (T*)q_addr + b * qb + h * qh + t * qt : (T*)k_addr + b * kb + (h - hq) * kh + t * kt;
    // torch: outer(pos.float(), inv_freq) in fp32; cos/sin in fp32, cast to T
    const float a = __fmul_rn((float)((const long long*)pos_addr)[t], ((const float*)inv_addr)[j]);
    float s, c;
    sincosf(a, &s, &c);
    s = rnd<T>(s);
    c = rnd<T>(c);
    const float x1 = to_f(x[j]), x2 = to_f(x[j + half]);
    // models/rope.py: out = (x * cos).to(T), then out[:half] -= x2 * sin, out[half:] += x1 * sin (each rounded)
    x[j] = from_f<T>(__fsub_rn(rnd<T>(__fmul_rn(x1, c)), __fmul_rn(x2, s)));
    x[j + half] = from_f<T>(__fadd_rn(rnd<T>(__fmul_rn(x2, c)), __fmul_rn(x1, s)));
}

template <typename T, typename V>  // grid (rows, column blocks); strides in units of V
__device__ __forceinline__ void silu_mul_vec(const unsigned long long g_addr, const unsigned long long u_addr,
                                             const unsigned long long y_addr, const long long gs,
                                             const long long us, const int nvec) {
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= nvec) return;
    const long long row = blockIdx.x;
    Pack<T, V> g, u, y;
    g.v = ((const V*)g_addr)[row * gs + c];
    u.v = ((const V*)u_addr)[row * us + c];
#pragma unroll
    for (int e = 0; e < (int)(sizeof(V) / sizeof(T)); ++e) {  // torch: silu in fp32 -> T, then * up -> T
        const float gf = to_f(g.e[e]);
        y.e[e] = from_f<T>(__fmul_rn(rnd<T>(gf / (1.0f + expf(-gf))), to_f(u.e[e])));
    }
    ((V*)y_addr)[row * nvec + c] = y.v;
}
"""

_ENTRIES = r"""
extern "C" __global__ void __launch_bounds__(1024) rms_norm_{n}(const unsigned long long x, const unsigned long long w,
        const unsigned long long res, const unsigned long long y, const int nvec, const float inv_n, const float eps) {{
    rms_norm_row<{t}, false>(x, w, res, y, nvec, inv_n, eps); }}
extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_{n}(const unsigned long long x,
        const unsigned long long w, const unsigned long long res, const unsigned long long y, const int nvec,
        const float inv_n, const float eps) {{
    rms_norm_row<{t}, true>(x, w, res, y, nvec, inv_n, eps); }}
extern "C" __global__ void rope_{n}(const unsigned long long q, const unsigned long long k,
        const unsigned long long pos, const unsigned long long inv, const int hq, const int hkv, const int t_len,
        const int half, const long long qb, const long long qh, const long long qt, const long long kb,
        const long long kh, const long long kt) {{
    rope_pair<{t}>(q, k, pos, inv, hq, hkv, t_len, half, qb, qh, qt, kb, kh, kt); }}
extern "C" __global__ void silu_mul_{n}_v16(const unsigned long long g, const unsigned long long u,
        const unsigned long long y, const long long gs, const long long us, const int nvec) {{
    silu_mul_vec<{t}, uint4>(g, u, y, gs, us, nvec); }}
extern "C" __global__ void silu_mul_{n}_v1(const unsigned long long g, const unsigned long long u,
        const unsigned long long y, const long long gs, const long long us, const int nvec) {{
    silu_mul_vec<{t}, {t}>(g, u, y, gs, us, nvec); }}
"""
DTYPES = {torch.bfloat16: ("bf16", "bf16"), torch.float16: ("f16", "f16"), torch.float32: ("f32", "float")}
KERNELS = [f"{k}_{n}" for n, _ in DTYPES.values() for k in ("rms_norm", "add_rms_norm", "rope")] + \
          [f"silu_mul_{n}_{v}" for n, _ in DTYPES.values() for v in ("v16", "v1")]


def source() -> str:
    return _SOURCE + "".join(_ENTRIES.format(n=n, t=t) for n, t in DTYPES.values())


def _empty(shape, dtype, device) -> torch.Tensor:  # outputs (tests swap in NaN-filled ones)
    return torch.empty(shape, dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def _module(device_index: int):
    import cupy

    from tailorkv.ops.cuda_launch import compile_module
    with cupy.cuda.Device(device_index):
        mod = compile_module(source())
        kernels = {name: mod.get_function(name) for name in KERNELS}
        for k in kernels.values():
            k.num_regs  # compiles and loads now, not inside a graph capture
    return kernels


_STREAMS: dict[int, object] = {}


def _launch(kernel, grid, block, args, device: torch.device) -> None:
    import cupy

    ts = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index):
        stream = _STREAMS.get(ts.cuda_stream)
        if stream is None:
            try:  # CuPy 14: foreign streams through __cuda_stream__ (ExternalStream is deprecated there)
                stream = cupy.cuda.Stream.from_external(ts)
            except AttributeError:  # CuPy 13, or a torch stream without __cuda_stream__
                stream = cupy.cuda.ExternalStream(ts.cuda_stream, device.index)
            _STREAMS[ts.cuda_stream] = stream
        with stream:
            kernel(grid, block, args)


def attributes(device_index: int = 0) -> dict:
    """Registers and local memory of each compiled kernel (for reports)."""
    return {name: {"num_regs": k.num_regs, "local_bytes": k.local_size_bytes}
            for name, k in _module(device_index).items()}


def _aligned(*tensors) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _ptr(t: torch.Tensor):
    return np.uint64(t.data_ptr())


def load_rms_norm(reference, add: bool):
    """The kernel for rms_norm (add=False, args (x, weight, eps)) or add_rms_norm (args (residual, x, weight, eps))."""
    _module(torch.cuda.current_device())

    def norm_ok(x, weight, *others):  # 16-byte rows of at most 4 vectors per thread, 1024 threads
        n, elt = (x.shape[-1] if x.dim() else 0), x.element_size()
        return (x.dtype in DTYPES and weight.dtype == x.dtype and weight.shape == (n,) and weight.device == x.device
                and all(t.shape == x.shape and t.dtype == x.dtype and t.device == x.device for t in others)
                and all(t.is_contiguous() for t in (x, weight, *others)) and _aligned(x, weight, *others)
                and n * elt % 16 == 0 and 0 < n * elt // 16 <= 1024 * 4)

    def launch(x, weight, residual, eps):
        y = _empty(x.shape, x.dtype, x.device)
        rows, nvec = x.numel() // x.shape[-1], x.shape[-1] * x.element_size() // 16
        if rows:
            name = f"{'add_' if residual is not None else ''}rms_norm_{DTYPES[x.dtype][0]}"
            threads = max(32, (-(-nvec // 4) + 31) // 32 * 32)  # <= 1024: nvec <= 4096
            _launch(_module(x.device.index)[name], (rows,), (threads,),
                    (_ptr(x), _ptr(weight), np.uint64(0 if residual is None else residual.data_ptr()), _ptr(y),
                     np.int32(nvec), np.float32(1.0) / np.float32(x.shape[-1]), np.float32(eps)), x.device)
        return y

    if add:
        def add_rms_norm(residual, x, weight, eps):
            if not norm_ok(x, weight, residual):
                return reference(residual, x, weight, eps)
            return launch(x, weight, residual, eps), residual
        return add_rms_norm

    def rms_norm(x, weight, eps):
        return launch(x, weight, None, eps) if norm_ok(x, weight) else reference(x, weight, eps)
    return rms_norm


def load_rope(reference):
    _module(torch.cuda.current_device())

    def rope(q, k_or_none, positions, inv_freq):
        B, hq, T, D = q.shape if q.dim() == 4 else (0, 0, 0, 0)
        k = q[:, :0] if k_or_none is None and q.dim() == 4 else k_or_none
        if not (q.dtype in DTYPES and k is not None and k.dtype == q.dtype and k.dim() == 4 and k.shape[0] == B
                and k.shape[2:] == q.shape[2:] and D % 2 == 0 and 0 < D // 2 <= 1024 and q.stride(-1) == 1
                and k.stride(-1) == 1 and positions.dtype == torch.int64 and positions.shape == (T,)
                and positions.is_contiguous() and inv_freq.dtype == torch.float32 and inv_freq.shape == (D // 2,)
                and inv_freq.is_contiguous() and q.device == k.device == positions.device == inv_freq.device):
            return reference(q, k_or_none, positions, inv_freq)
        heads, half = hq + k.shape[1], D // 2
        if B * T and heads:
            hy = max(1, min(heads, 256 // half))
            _launch(_module(q.device.index)[f"rope_{DTYPES[q.dtype][0]}"], (B * T, -(-heads // hy)), (half, hy),
                    (_ptr(q), _ptr(k), _ptr(positions), _ptr(inv_freq), np.int32(hq), np.int32(k.shape[1]),
                     np.int32(T), np.int32(half), *(np.int64(s) for s in q.stride()[:3]),
                     *(np.int64(s) for s in k.stride()[:3])), q.device)
        return q, k_or_none
    return rope


def load_silu_mul(reference):
    _module(torch.cuda.current_device())

    def silu_mul(gate, up):
        H = gate.shape[-1] if gate.dim() else 0
        ok = (gate.dtype in DTYPES and up.dtype == gate.dtype and up.shape == gate.shape and H > 0
              and gate.stride(-1) == 1 and up.stride(-1) == 1 and gate.device == up.device)
        try:  # rows of H with one row stride each (a [..., :H] / [..., H:] split of a fused projection is fine)
            g2, u2 = (gate.view(-1, H), up.view(-1, H)) if ok else (None, None)
        except RuntimeError:
            ok = False
        if not ok:
            return reference(gate, up)
        y = _empty(gate.shape, gate.dtype, gate.device)
        rows, e = g2.shape[0], 16 // gate.element_size()
        if rows:
            vec = H % e == 0 and g2.stride(0) % e == 0 and u2.stride(0) % e == 0 and _aligned(gate, up)
            e = e if vec else 1
            nvec = H // e
            threads = min(256, -(-nvec // 32) * 32)
            _launch(_module(gate.device.index)[f"silu_mul_{DTYPES[gate.dtype][0]}_{'v16' if vec else 'v1'}"],
                    (rows, -(-nvec // threads)), (threads,),
                    (_ptr(gate), _ptr(up), _ptr(y), np.int64(g2.stride(0) // e), np.int64(u2.stride(0) // e),
                     np.int32(nvec)), gate.device)
        return y
    return silu_mul

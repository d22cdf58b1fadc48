"""Shared tile math of the decode-attention kernels (attend_decode in ops/attention_cuda.py,
sparse_decode_attention in ops/sparse_attention_cuda.py): CUDA C that each kernel's module compiles with its own
entry point, per (head_dim, query heads per KV head, dtype).

A block has 4 warps and works on tiles of 64 keys held in shared memory (K and V rows of 16-byte chunks,
XOR-swizzled so that ldmatrix reads are free of bank conflicts); each warp takes 16 keys of a tile and keeps its
own running max m, sum l and output O for the G query heads of the KV head (GQA without repeat: K and V are read
once for all G heads):
  S^T[16 keys x 8 heads] = K[16 x D] . Q^T       mma m16n8k16, K via ldmatrix, Q (exact in bf16/fp16) in registers
  m, l, O rescaled in fp32; P = exp2(S * scale * log2 e - m) rounded to the input dtype for the next product
  O^T[D x 8 heads] += V^T[D x 16 keys] . P^T     mma m16n8k16, V via ldmatrix.trans
Heads beyond G (G is padded to 8 or 16) have a zero query and are never written. Keys that are not held are
never read: their rows are zero-filled and their scores set to -inf, so NaN in unused slots cannot leak.
`finish` merges the block's warps (fixed order) into one partial (m, l, acc[G][D]) in global memory; the last
block of each (batch, KV head) to finish (a ticket counter in device memory, reset by that block) merges all
partials in a fixed order and writes the output. One launch per call, no sync: graph-capturable.
"""
from __future__ import annotations

import torch

from tailorkv.ops.cuda_launch import compile_module
from tailorkv.ops.quant_common_cuda import C_TYPES, HELPERS

WARPS, TILE = 4, 64
COUNTERS = 1 << 16          # ticket counters per device and kernel (one per batch x KV head)

_TILES = r"""
#define D {d}
#define G {g}
#define NB ((G + 7) / 8)            // 8-head column blocks of the mma
#define GP (NB * 8)
#define WARPS {warps}
#define TILE {tile}                 // keys per tile, 16 per warp
#define CH (D / 8)                  // 16-byte chunks per row
#define DT (D / 16)                 // 16-wide steps over the head dimension
#define PST 24                      // row stride (elements) of a warp's P tile [GP][16 keys]: conflict-free reads
#define RS (D + 4)                  // row stride (floats) of the warp-merge buffer: conflict-free writes
#define NEG_INF __int_as_float(0xff800000u)    // NVRTC has no INFINITY
#define FULL 0xffffffffu
typedef {kt} ktype;
#define MMA {mma}
#define TO_K {to_k}

__device__ __forceinline__ unsigned smem_u32(const void* p) {{ return (unsigned)__cvta_generic_to_shared(p); }}

__device__ __forceinline__ void ldsm4(unsigned* r, const ktype* p) {{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%0,%1,%2,%3}}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}}

__device__ __forceinline__ void ldsm4t(unsigned* r, const ktype* p) {{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{%0,%1,%2,%3}}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}}

// element offset of 16-byte chunk c of row `row` in a swizzled [rows][D] tile
__device__ __forceinline__ int swz(int row, int c) {{ return row * D + ((c ^ (row & 7)) << 3); }}

__device__ __forceinline__ unsigned pack2(ktype lo, ktype hi) {{
    return (unsigned)(*reinterpret_cast<const unsigned short*>(&lo))
         | ((unsigned)(*reinterpret_cast<const unsigned short*>(&hi)) << 16);
}}

struct Softmax {{                    // one warp's running state for the heads of its lane
    float m[NB][2], l[NB][2];        // heads nb * 8 + 2 * (lane % 4) + e
    float o[DT][NB][4];              // O^T: channels 16 i + lane / 4 (+ 8), heads as above
}};

__device__ __forceinline__ void softmax_init(Softmax& st) {{
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb) {{
        #pragma unroll
        for (int e = 0; e < 2; ++e) {{ st.m[nb][e] = NEG_INF; st.l[nb][e] = 0.f; }}
        #pragma unroll
        for (int i = 0; i < DT; ++i)
            #pragma unroll
            for (int c = 0; c < 4; ++c) st.o[i][nb][c] = 0.f;
    }}
}}

// the B operand of S^T = K . Q^T: qf[j][nb] = Q[nb * 8 + lane / 4][16 j + 2 (lane % 4) + {{0, 1}} (+ 8)]
__device__ __forceinline__ void load_q(unsigned (&qf)[DT][NB][2], const ktype* qh, long long qsh, int lane) {{
    const int t = lane & 3, gi = lane >> 2;
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb) {{
        const int g = nb * 8 + gi;
        const ktype* r = qh + (long long)(g < G ? g : 0) * qsh + 2 * t;
        #pragma unroll
        for (int j = 0; j < DT; ++j) {{
            qf[j][nb][0] = g < G ? pack2(r[16 * j], r[16 * j + 1]) : 0u;
            qf[j][nb][1] = g < G ? pack2(r[16 * j + 8], r[16 * j + 9]) : 0u;
        }}
    }}
}}

// one warp: the 16 keys at rows r0.. of the K and V tiles; bit i of `valid` = key r0 + i is held
__device__ __forceinline__ void warp_keys(const ktype* Kt, const ktype* Vt, int r0, unsigned valid,
                                          const unsigned (&qf)[DT][NB][2], float scale_log2,
                                          ktype (*ps)[PST], Softmax& st, int lane) {{
    const int t = lane & 3, gi = lane >> 2;
    float s[NB][4], s2[NB][4];       // two accumulators: two independent mma chains
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb)
        #pragma unroll
        for (int c = 0; c < 4; ++c) {{ s[nb][c] = 0.f; s2[nb][c] = 0.f; }}
    {{
        const int row = r0 + (lane & 15), hi = lane >> 4;
        #pragma unroll
        for (int j = 0; j < DT; ++j) {{
            unsigned a[4];
            ldsm4(a, Kt + swz(row, 2 * j + hi));
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) {{
                if (j & 1) MMA(s2[nb], a, qf[j][nb][0], qf[j][nb][1]);
                else MMA(s[nb], a, qf[j][nb][0], qf[j][nb][1]);
            }}
        }}
    }}
    const bool v0 = (valid >> gi) & 1u, v1 = (valid >> (gi + 8)) & 1u;
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb)
        #pragma unroll
        for (int e = 0; e < 2; ++e) {{
            const float x0 = v0 ? (s[nb][e] + s2[nb][e]) * scale_log2 : NEG_INF;          // key gi
            const float x1 = v1 ? (s[nb][2 + e] + s2[nb][2 + e]) * scale_log2 : NEG_INF;  // key gi + 8
            float mx = fmaxf(x0, x1);
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 16));
            const float mn = fmaxf(st.m[nb][e], mx);
            const float ms = mn == NEG_INF ? 0.f : mn;      // nothing held yet: alpha = p = 0, no NaN
            const float alpha = exp2f(st.m[nb][e] - ms);
            const float p0 = exp2f(x0 - ms), p1 = exp2f(x1 - ms);
            st.m[nb][e] = mn;
            st.l[nb][e] = st.l[nb][e] * alpha + p0 + p1;   // this lane's share; summed over lanes at the end
            #pragma unroll
            for (int i = 0; i < DT; ++i) {{ st.o[i][nb][e] *= alpha; st.o[i][nb][2 + e] *= alpha; }}
            ps[nb * 8 + 2 * t + e][gi] = TO_K(p0);
            ps[nb * 8 + 2 * t + e][gi + 8] = TO_K(p1);
        }}
    __syncwarp();
    unsigned pb[NB][2];               // B operand of O^T += V^T . P^T: P[head lane / 4][keys 2t, 2t+1 (+ 8)]
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb) {{
        pb[nb][0] = *reinterpret_cast<const unsigned*>(&ps[nb * 8 + gi][2 * t]);
        pb[nb][1] = *reinterpret_cast<const unsigned*>(&ps[nb * 8 + gi][2 * t + 8]);
    }}
    {{
        const int row = r0 + (lane & 7) + ((lane >> 4) << 3), hi = (lane >> 3) & 1;
        #pragma unroll
        for (int i = 0; i < DT; ++i) {{
            unsigned a[4];
            ldsm4t(a, Vt + swz(row, 2 * i + hi));
            #pragma unroll
            for (int nb = 0; nb < NB; ++nb) MMA(st.o[i][nb], a, pb[nb][0], pb[nb][1]);
        }}
    }}
    __syncwarp();                     // ps is rewritten by the next call
}}

// The block's warps -> one partial (m, l, acc) at index `part`; the last of the `nparts` blocks of (b, kvh) to
// arrive merges every partial and writes out[G][D]. red: shared memory of >= max(WARPS * GP * RS, nparts * G)
// floats, free to overwrite. Returns nothing; every thread of the block must call it.
__device__ void finish(float* red, Softmax& st, float* __restrict__ part, int nparts, int part_idx, int BH,
                       int bh, int* __restrict__ counter, ktype* __restrict__ out, int lane, int warp) {{
    __shared__ float wm[WARPS][GP], wl[WARPS][GP], sinv[GP];
    __shared__ int s_last;
    float* pm = part;                                   // [nparts][BH][G]
    float* pl = part + (long long)nparts * BH * G;      // [nparts][BH][G]
    float* pacc = part + 2LL * nparts * BH * G;         // [nparts][BH][G][D]
    const int t = lane & 3, gi = lane >> 2;
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb)
        #pragma unroll
        for (int e = 0; e < 2; ++e) {{
            float l = st.l[nb][e];
            l += __shfl_xor_sync(FULL, l, 4);
            l += __shfl_xor_sync(FULL, l, 8);
            l += __shfl_xor_sync(FULL, l, 16);
            if (gi == 0) {{ wm[warp][nb * 8 + 2 * t + e] = st.m[nb][e]; wl[warp][nb * 8 + 2 * t + e] = l; }}
        }}
    __syncthreads();
    #pragma unroll
    for (int nb = 0; nb < NB; ++nb)
        #pragma unroll
        for (int e = 0; e < 2; ++e) {{
            const int h = nb * 8 + 2 * t + e;
            float M = wm[0][h];
            #pragma unroll
            for (int w = 1; w < WARPS; ++w) M = fmaxf(M, wm[w][h]);
            const float f = wm[warp][h] == NEG_INF ? 0.f : exp2f(wm[warp][h] - M);
            float* r = red + ((long long)warp * GP + h) * RS;
            #pragma unroll
            for (int i = 0; i < DT; ++i) {{
                r[16 * i + gi] = st.o[i][nb][e] * f;
                r[16 * i + gi + 8] = st.o[i][nb][2 + e] * f;
            }}
        }}
    const long long po = (long long)part_idx * BH + bh;
    if (threadIdx.x < G) {{
        const int h = threadIdx.x;
        float M = wm[0][h];
        for (int w = 1; w < WARPS; ++w) M = fmaxf(M, wm[w][h]);
        float L = 0.f;
        for (int w = 0; w < WARPS; ++w) L += wm[w][h] == NEG_INF ? 0.f : exp2f(wm[w][h] - M) * wl[w][h];
        pm[po * G + h] = M;
        pl[po * G + h] = L;
    }}
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {{
        const int h = i / D, d = i % D;
        float a = 0.f;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) a += red[((long long)w * GP + h) * RS + d];
        pacc[po * G * D + i] = a;
    }}
    __threadfence();                                    // the partial is visible before the ticket is taken
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(counter + bh, 1) == nparts - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // the last block: merge all partials of (b, kvh) in index order; weights 2^(m_p - M) in red[p * G + h]
    for (int h = warp; h < G; h += WARPS) {{
        float M = NEG_INF;
        for (int p = lane; p < nparts; p += 32) M = fmaxf(M, __ldcg(pm + ((long long)p * BH + bh) * G + h));
        for (int o = 16; o; o >>= 1) M = fmaxf(M, __shfl_xor_sync(FULL, M, o));
        float L = 0.f;
        for (int p = lane; p < nparts; p += 32) {{
            const long long i = ((long long)p * BH + bh) * G + h;
            const float mp = __ldcg(pm + i);
            const float w = mp == NEG_INF ? 0.f : exp2f(mp - M);
            red[p * G + h] = w;
            L += w * __ldcg(pl + i);
        }}
        for (int o = 16; o; o >>= 1) L += __shfl_xor_sync(FULL, L, o);
        if (lane == 0) sinv[h] = L > 0.f ? 1.f / L : 0.f;   // nothing held: zeros
    }}
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += WARPS * 32) {{
        const int h = i / D;
        float a = 0.f;
        #pragma unroll 4
        for (int p = 0; p < nparts; ++p) a += red[p * G + h] * __ldcg(pacc + ((long long)p * BH + bh) * G * D + i);
        out[(long long)bh * G * D + i] = TO_K(a * sinv[h]);
    }}
    if (threadIdx.x == 0) counter[bh] = 0;              // ready for the next launch
}}

"""


def source(kernel: str, d: int, g: int, dtype: torch.dtype, **extra) -> str:
    """The shared tile code followed by `kernel` (CUDA C written for str.format, like _TILES)."""
    bf16 = dtype == torch.bfloat16
    return HELPERS + (_TILES + kernel).format(d=d, g=g, kt=C_TYPES[str(dtype)], warps=WARPS, tile=TILE,
                                              mma="mma_bf16" if bf16 else "mma_f16",
                                              to_k="__float2bfloat16_rn" if bf16 else "__float2half_rn", **extra)


def tile_bytes(d: int) -> int:
    """Shared memory of one K tile and one V tile."""
    return 2 * TILE * d * 2


def merge_floats(d: int, g: int) -> int:
    """Floats of shared memory the warp merge needs (finish's `red`)."""
    return WARPS * (-(-g // 8) * 8) * (d + 4)


class Kernels:
    """Compiled kernels per (D, G, dtype), their dynamic shared memory opted in per device, and the ticket
    counters (zeroed once, reset by the kernels themselves; one array per device and kernel: the two ops must
    not run concurrently on two streams of one device, which the engine never does)."""

    def __init__(self, kernel: str, **extra):
        self.kernel, self.extra = kernel, extra
        self.mods, self.fns, self.counters = {}, {}, {}

    def get(self, name: str, d: int, g: int, dtype: torch.dtype, device: torch.device, smem: int):
        key = (name, d, g, dtype, device.index)
        if key not in self.fns:
            if (d, g, dtype) not in self.mods:
                self.mods[(d, g, dtype)] = compile_module(source(self.kernel, d, g, dtype, **self.extra))
            fn = self.mods[(d, g, dtype)].get_function(name)
            import cupy
            with cupy.cuda.Device(device.index):
                fn.max_dynamic_shared_size_bytes = smem  # above the 48 KiB default (attend: 96 KiB at D=128)
            self.fns[key] = fn
        return self.fns[key]

    def counter(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, device.index)
        if key not in self.counters:
            if torch.cuda.is_current_stream_capturing():
                # never cache memory of a graph's private pool: this graph gets its own zeroed counters
                return torch.zeros(COUNTERS, dtype=torch.int32, device=device)
            self.counters[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
        return self.counters[key]

"""CUDA kernel for qk_quant: scores = sm_scale * q . (code * scale + min) over packed 1/2-bit keys (ops/quant.py).

Tensor cores do the arithmetic (mma m16n8k16, fp16 in, fp32 accumulate), one warp per group of 64 tokens:
    A [16 query heads x 16 channels] = q * 2^e in fp16 (S parts: 1 for fp16/bf16 q, which is then exact; 2 for
        fp32 q, hi + lo), the same for every group, so it lives in registers for the whole block;
    B [16 channels x 8 tokens] = code bit ? scale : 0, exact in fp16: the code words are rotated so that each
        lane's token bit is a byte's sign bit, which a byte permute replicates into a 16-bit mask over the scale
        (2-bit codes: two bit planes, the second weighted 2);
    the min term is one more MMA per group with B = min, which seeds the accumulators.
Each KV head's packed data is read once for its whole query group. Groups are staged global -> shared with
cp.async, three deep per warp. The MMA's k index runs over channels in the order 16*kt + 4*c + (0, 1, 2, 3) for
k = (2c, 2c+1, 2c+8, 2c+9), so that every lane reads 4 adjacent channels (any order works if A and B agree).
4-bit codes take four bit planes, weighted 1, 2, 4, 8, two stages deep (the key sketch has its own kernel,
ops/sketch_scores_cuda.py).
"""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import (
    aligned,
    compile_module,
    launch,
    ptr,
    rows_contiguous,
    units_per_block,
)
from tailorkv.ops.quant_common_cuda import C_TYPES, HELPERS

WARPS, STAGES, GROUP = 4, 3, 64

_SOURCE = r"""
#define BITS {bits}
#define D {d}
#define S {s}
#define MT {mt}
typedef {qt} qtype;
#define CPW (32 / BITS)
#define KT (D / 16)
#define ROWS ({group} / CPW)       // word rows per group
#define NT (CPW / 8)               // 8-token MMA tiles per word row
#define WARPS {warps}
#define STAGES {stages}
#define STAGE_WORDS (ROWS * D + D) // code rows, then D fp16 scales and D fp16 mins

extern "C" __global__ void __launch_bounds__(WARPS * 32) qk_quant_kernel(
        const qtype* __restrict__ q, const long long qsb, const long long qsh,
        const unsigned* __restrict__ codes, const long long csb, const long long csh,
        const __half* __restrict__ scale, const long long ssb, const long long ssh,
        const __half* __restrict__ mins, const long long msb, const long long msh,
        float* __restrict__ out, const int Hkv, const int G, const int nrows, const int ngroups,
        const int groups_per_block, const float sm_scale) {{
    __shared__ float qs[MT * 16][D];
    __shared__ __align__(16) unsigned stage[WARPS][STAGES][STAGE_WORDS];
    __shared__ float red[WARPS];
    const int bh = blockIdx.y, b = bh / Hkv, kvh = bh % Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long T = (long long)nrows * CPW;

    float amax = 0.f;
    for (int i = threadIdx.x; i < MT * 16 * D; i += blockDim.x) {{
        const int r = i / D, d = i % D;
        const float v = r < G ? to_float(q[b * qsb + (long long)(kvh * G + r) * qsh + d]) : 0.f;
        qs[r][d] = v;
        amax = fmaxf(amax, fabsf(v));
    }}
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (lane == 0) red[warp] = amax;
    __syncthreads();
    for (int w = 0; w < WARPS; ++w) amax = fmaxf(amax, red[w]);
    int e = 0;  // q * 2^e has its largest |value| in [2^14, 2^15): fp16 keeps every bit of a bf16/fp16 q
    if (amax > 0.f) {{ int E; frexpf(amax, &E); e = 15 - E; }}
    const float mult = ldexpf(sm_scale, -e);

    unsigned a[S][MT][KT][4];
    #pragma unroll
    for (int s = 0; s < S; ++s)
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int kt = 0; kt < KT; ++kt) {{
        const int r0 = mt * 16 + g, r1 = r0 + 8, d = 16 * kt + 4 * c;
        a[s][mt][kt][0] = q_part(qs[r0][d], qs[r0][d + 1], e, s);
        a[s][mt][kt][1] = q_part(qs[r1][d], qs[r1][d + 1], e, s);
        a[s][mt][kt][2] = q_part(qs[r0][d + 2], qs[r0][d + 3], e, s);
        a[s][mt][kt][3] = q_part(qs[r1][d + 2], qs[r1][d + 3], e, s);
    }}

    const unsigned* cbase = codes + b * csb + kvh * csh;
    const __half* sbase = scale + b * ssb + kvh * ssh;
    const __half* mbase = mins + b * msb + kvh * msh;
    const int first = blockIdx.x * groups_per_block + warp;
    const int last = min(ngroups, (blockIdx.x + 1) * groups_per_block);
    const int mine = first < last ? (last - first + WARPS - 1) / WARPS : 0;

    auto issue = [&](int i, int) {{
        const int grp = first + i * WARPS;
        unsigned* dst = stage[warp][i % STAGES];
        const int nr = min(ROWS, nrows - grp * ROWS);
        const unsigned* src = cbase + (long long)grp * ROWS * D;
        for (int j = lane; j < nr * (D / 4); j += 32) cp_async16(dst + 4 * j, src + 4 * j, 16);
        for (int j = lane; j < D / 8; j += 32) {{
            cp_async16(dst + ROWS * D + 4 * j, sbase + (long long)grp * D + 8 * j, 16);
            cp_async16(dst + ROWS * D + D / 2 + 4 * j, mbase + (long long)grp * D + 8 * j, 16);
        }}
    }};
    warp_pipeline<STAGES>(mine, issue, [&](int i, int) {{
        const int grp = first + i * WARPS;
        const unsigned* sc = stage[warp][i % STAGES];
        const __half* ss = reinterpret_cast<const __half*>(sc + ROWS * D);
        const __half* sm = ss + D;

        float bias[MT][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) bias[mt][0] = bias[mt][1] = bias[mt][2] = bias[mt][3] = 0.f;
        #pragma unroll
        for (int kt = 0; kt < KT; ++kt) {{
            const uint2 mn = *reinterpret_cast<const uint2*>(sm + 16 * kt + 4 * c);
            #pragma unroll
            for (int s = 0; s < S; ++s)
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) mma_f16(bias[mt], a[s][mt][kt], mn.x, mn.y);
        }}

        const int nr = min(ROWS, nrows - grp * ROWS);
        for (int rr = 0; rr < nr; ++rr) {{
            float acc[MT][NT][BITS][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int t = 0; t < NT; ++t)
            #pragma unroll
            for (int j = 0; j < 4; ++j) {{
                acc[mt][t][0][j] = bias[mt][j];
                #pragma unroll
                for (int p = 1; p < BITS; ++p) acc[mt][t][p][j] = 0.f;
            }}
            #pragma unroll
            for (int kt = 0; kt < KT; ++kt) {{
                const uint4 w = *reinterpret_cast<const uint4*>(sc + rr * D + 16 * kt + 4 * c);
                const uint2 sp = *reinterpret_cast<const uint2*>(ss + 16 * kt + 4 * c);
                #pragma unroll
                for (int p = 0; p < BITS; ++p) {{
                    // token 8t+g's bit p lands on the sign bit of byte t*BITS
                    const unsigned rot = (unsigned)(7 - BITS * g - p) & 31u;
                    const unsigned w0 = rotl(w.x, rot), w1 = rotl(w.y, rot), w2 = rotl(w.z, rot), w3 = rotl(w.w, rot);
                    #pragma unroll
                    for (int t = 0; t < NT; ++t) {{
                        const unsigned bi = t * BITS;
                        const unsigned sel = (8u | bi) | ((8u | bi) << 4) | ((12u | bi) << 8) | ((12u | bi) << 12);
                        const unsigned m0 = prmt(w0, w1, sel) & sp.x, m1 = prmt(w2, w3, sel) & sp.y;
                        #pragma unroll
                        for (int s = 0; s < S; ++s)
                        #pragma unroll
                        for (int mt = 0; mt < MT; ++mt) mma_f16(acc[mt][t][p], a[s][mt][kt], m0, m1);
                    }}
                }}
            }}
            const long long tok0 = (long long)(grp * ROWS + rr) * CPW;
            #pragma unroll
            for (int t = 0; t < NT; ++t) {{
                float v[MT][4];
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int j = 0; j < 4; ++j) {{
                    float x = acc[mt][t][0][j];
                    #pragma unroll
                    for (int p = 1; p < BITS; ++p) x += (float)(1 << p) * acc[mt][t][p][j];
                    v[mt][j] = x * mult;
                }}
                const long long tok = tok0 + 8 * t + 2 * c;
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {{
                    const int h0 = mt * 16 + g, h1 = h0 + 8;
                    if (h0 < G) *reinterpret_cast<float2*>(out + ((long long)bh * G + h0) * T + tok) = make_float2(v[mt][0], v[mt][1]);
                    if (h1 < G) *reinterpret_cast<float2*>(out + ((long long)bh * G + h1) * T + tok) = make_float2(v[mt][2], v[mt][3]);
                }}
            }}
        }}
    }});
}}
"""


SMEM_LIMIT = 48 * 1024  # static shared memory of a block


def stages(bits: int) -> int:
    return STAGES if bits < 4 else 2  # 4-bit groups are twice the words: two stages fit the shared memory


def shared_bytes(bits: int, d: int, mt: int) -> int:
    rows = GROUP * bits // 32
    return 4 * (mt * 16 * d + WARPS * stages(bits) * (rows * d + d) + WARPS)


def source(bits: int, d: int, s: int, mt: int, qdtype: torch.dtype) -> str:
    return HELPERS + _SOURCE.format(bits=bits, d=d, s=s, mt=mt, qt=C_TYPES[str(qdtype)], group=GROUP,
                                    warps=WARPS, stages=stages(bits))


def _supported(q, k_codes, k_scale, k_min, bits, group) -> bool:
    B, Hq, one, D = q.shape
    Hkv = k_codes.shape[1]
    if one != 1 or Hkv == 0 or Hq % Hkv or bits not in (1, 2, 4) or group != GROUP or D not in (64, 128):
        return False
    G, T = Hq // Hkv, k_codes.shape[2] * (32 // bits)
    s, mt = (2 if q.dtype == torch.float32 else 1), -(-G // 16)
    return (str(q.dtype) in C_TYPES and s * mt <= 2 and shared_bytes(bits, D, mt) <= SMEM_LIMIT
            and q.stride(-1) == 1 and k_codes.dtype == torch.int32
            and k_scale.dtype == torch.float16 and k_min.dtype == torch.float16
            and k_codes.shape[:2] == (B, Hkv) and k_codes.shape[3] == D
            and k_scale.shape[:2] == (B, Hkv) and k_scale.shape[3] == D and k_scale.shape[2] * group >= T
            and k_min.shape == k_scale.shape
            and all(t.is_cuda and t.device == q.device for t in (k_codes, k_scale, k_min))
            and all(rows_contiguous(t, 2) and aligned(t, 16, (0, 1)) for t in (k_codes, k_scale, k_min)))


def load(reference):
    """reference: the torch qk_quant, for the arguments the kernel does not take."""
    compile_module(source(1, 128, 1, 1, torch.bfloat16)).get_function("qk_quant_kernel")  # fail early
    kernels = {}

    def run(q, k_codes, k_scale, k_min, bits, sm_scale, out):
        B, Hq, _, D = q.shape
        Hkv, nrows = k_codes.shape[1], k_codes.shape[2]
        G = Hq // Hkv
        s, mt = (2 if q.dtype == torch.float32 else 1), -(-G // 16)
        key = (bits, D, s, mt, q.dtype)
        if key not in kernels:
            kernels[key] = compile_module(source(*key)).get_function("qk_quant_kernel")
        ngroups = -(-nrows // (GROUP * bits // 32))
        gpb = units_per_block(ngroups * B * Hkv, WARPS, q.device)
        launch(kernels[key], (-(-ngroups // gpb), B * Hkv), (WARPS * 32,),
               (ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
                ptr(k_codes), np.int64(k_codes.stride(0)), np.int64(k_codes.stride(1)),
                ptr(k_scale), np.int64(k_scale.stride(0)), np.int64(k_scale.stride(1)),
                ptr(k_min), np.int64(k_min.stride(0)), np.int64(k_min.stride(1)),
                ptr(out), np.int32(Hkv), np.int32(G), np.int32(nrows), np.int32(ngroups), np.int32(gpb),
                np.float32(sm_scale)), q.device)
        return out

    def qk_quant(q, k_codes, k_scale, k_min, bits: int = 1, group: int = 64, sm_scale: float = 1.0):
        """Kernel for bits 1/2/4, group 64, head_dim 64/128, q fp16/bf16 (up to 32 query heads per KV head; 16 at
        4 bits and head_dim 128) or fp32 (up to 16), code/scale/min rows contiguous with 16-byte aligned heads;
        else the torch reference."""
        if not _supported(q, k_codes, k_scale, k_min, bits, group):
            return reference(q, k_codes, k_scale, k_min, bits, group, sm_scale)
        B, Hq, _, D = q.shape
        out = torch.empty(B, Hq, 1, k_codes.shape[2] * (32 // bits), dtype=torch.float32, device=q.device)
        return out if out.numel() == 0 else run(q, k_codes, k_scale, k_min, bits, sm_scale, out)

    return qk_quant

"""CUDA kernels for av_quant: out = probs @ (code * scale + min) over packed 1/2-bit values (ops/quant.py).

The tokens are split over many blocks (one chunk per block and KV head, all G query heads of it); each block
writes a partial [G, D] in fp32 and a second kernel sums the partials in a fixed order (deterministic, no
atomics). Tensor cores do the arithmetic (mma m16n8k16, bf16 in, fp32 accumulate), per 16-token tile:
    A [16 rows x 16 tokens]: row s*G + h holds part s (of 3) of probs[h, t] * scale[t] in bf16 (hi, mid, lo:
        24 bits, about fp32), so no fp16 range limit applies and the parts are summed once per block;
    B [16 tokens x 8 channels] = the code (0..3), exact in bf16: the code words are rotated so that each lane's
        channel code sits at the bottom of a byte, a byte permute pairs two tokens, and OR-ing 128.0 then
        subtracting it gives the code;
    the min term (sum over t of probs * min) is accumulated in fp32 on the CUDA cores.
The MMA's k index runs over tokens in the order 4*c + (0, 1, 2, 3) for k = (2c, 2c+1, 2c+8, 2c+9), so each lane
reads 4 adjacent tokens. Tiles are staged global -> shared with cp.async, three deep per warp; the tokens past T
are zero-filled (never read).
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
from tailorkv.ops.quant_common_cuda import HELPERS

WARPS, STAGES = 4, 3

_SOURCE = r"""
#define BITS {bits}
#define D {d}
#define MT {mt}
#define CU {cu}                        // staging units (bytes) of the codes and of the scales / mins
#define SU {su}
#define CPW (32 / BITS)
#define WPT (D / CPW)                 // code words per token
#define VG (D < 64 ? D : 64)          // channels per scale group
#define NGD (D / VG)
#define NTILE (D / 8)
#define TPW (CPW / 8)                 // 8-channel tiles per word
#define GMAX (16 * MT / 3)
#define WARPS {warps}
#define STAGES {stages}
#define OFF_S (16 * WPT)              // stage layout in words: codes, scales, mins, probs
#define OFF_M (OFF_S + 8 * NGD)
#define OFF_P (OFF_M + 8 * NGD)
#define STAGE_WORDS (OFF_P + 16 * GMAX)

extern "C" __global__ void __launch_bounds__(WARPS * 32) av_quant_partial(
        const float* __restrict__ probs, const long long psb, const long long psh,
        const unsigned* __restrict__ codes, const long long csb, const long long csh,
        const __half* __restrict__ scale, const long long ssb, const long long ssh,
        const __half* __restrict__ mins, const long long msb, const long long msh,
        float* __restrict__ part, const int Hkv, const int G, const int T, const int tiles_per_block) {{
    __shared__ __align__(16) unsigned stage[WARPS][STAGES][STAGE_WORDS];
    __shared__ float red[16 * MT][D + 1];
    __shared__ float bred[GMAX][NGD];
    const int bh = blockIdx.y, b = bh / Hkv, kvh = bh % Hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int ntiles = (T + 15) / 16;
    const int first = blockIdx.x * tiles_per_block + warp;
    const int last = min(ntiles, (blockIdx.x + 1) * tiles_per_block);
    const int mine = first < last ? (last - first + WARPS - 1) / WARPS : 0;
    const unsigned* cbase = codes + b * csb + kvh * csh;
    const __half* sbase = scale + b * ssb + kvh * ssh;
    const __half* mbase = mins + b * msb + kvh * msh;
    const float* pbase = probs + b * psb + (long long)kvh * G * psh;

    auto issue = [&](int i, int) {{
        const int t0 = (first + i * WARPS) * 16, nval = min(16, T - t0);
        unsigned* dst = stage[warp][i % STAGES];
        stage_copy<CU>(dst, cbase + (long long)t0 * WPT, 64 * WPT, nval * WPT * 4, lane);   // 16 tokens x WPT words
        stage_copy<SU>(dst + OFF_S, sbase + (long long)t0 * NGD, 32 * NGD, nval * NGD * 2, lane);
        stage_copy<SU>(dst + OFF_M, mbase + (long long)t0 * NGD, 32 * NGD, nval * NGD * 2, lane);
        for (int j = lane; j < 16 * G; j += 32) {{    // probs rows may be unaligned: 4 bytes at a time
            const int h = j >> 4, t = j & 15;
            cp_async4(dst + OFF_P + j, t < nval ? pbase + h * psh + t0 + t : pbase, t < nval ? 4 : 0);
        }}
    }};

    // this lane's A rows r0 = mt*16 + g and r1 = r0 + 8 stand for (part, head) = (r / G, r % G)
    int part_of[MT][2], head_of[MT][2];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int i = 0; i < 2; ++i) {{
        const int r = mt * 16 + g + 8 * i;
        part_of[mt][i] = r < 3 * G ? r / G : -1;
        head_of[mt][i] = r < 3 * G ? r % G : 0;
    }}
    float acc[MT][NTILE][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int nt = 0; nt < NTILE; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
    float bacc[MT][2][NGD];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int gd = 0; gd < NGD; ++gd) bacc[mt][0][gd] = bacc[mt][1][gd] = 0.f;

    warp_pipeline<STAGES>(mine, issue, [&](int i, int) {{
        const unsigned* st = stage[warp][i % STAGES];
        const __half* ss = reinterpret_cast<const __half*>(st + OFF_S);
        const __half* sm = reinterpret_cast<const __half*>(st + OFF_M);
        const float* sp = reinterpret_cast<const float*>(st + OFF_P);

        float pr[MT][2][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int ri = 0; ri < 2; ++ri) {{
            pr[mt][ri][0] = pr[mt][ri][1] = pr[mt][ri][2] = pr[mt][ri][3] = 0.f;
            if (part_of[mt][ri] >= 0) {{
                const float4 p4 = *reinterpret_cast<const float4*>(sp + head_of[mt][ri] * 16 + 4 * c);
                pr[mt][ri][0] = p4.x; pr[mt][ri][1] = p4.y; pr[mt][ri][2] = p4.z; pr[mt][ri][3] = p4.w;
            }}
        }}
        value_tile_mma<BITS, D, MT>(acc, bacc, pr, part_of, st, ss, sm, g, c);
    }});

    // block sum in a fixed order: warp 0 stores, the others add one after another
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
    #pragma unroll
    for (int ri = 0; ri < 2; ++ri)
    #pragma unroll
    for (int gd = 0; gd < NGD; ++gd) {{
        bacc[mt][ri][gd] += __shfl_xor_sync(0xffffffffu, bacc[mt][ri][gd], 1);
        bacc[mt][ri][gd] += __shfl_xor_sync(0xffffffffu, bacc[mt][ri][gd], 2);
    }}
    for (int w = 0; w < WARPS; ++w) {{
        if (warp == w) {{
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int nt = 0; nt < NTILE; ++nt)
            #pragma unroll
            for (int j = 0; j < 4; ++j) {{
                float& r = red[mt * 16 + g + 8 * (j >> 1)][8 * nt + 2 * c + (j & 1)];
                r = w ? r + acc[mt][nt][j] : acc[mt][nt][j];
            }}
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int ri = 0; ri < 2; ++ri)
                if (c == 0 && part_of[mt][ri] == 0)
                    #pragma unroll
                    for (int gd = 0; gd < NGD; ++gd) {{
                        float& r = bred[head_of[mt][ri]][gd];
                        r = w ? r + bacc[mt][ri][gd] : bacc[mt][ri][gd];
                    }}
        }}
        __syncthreads();
    }}
    float* dst = part + ((long long)blockIdx.x * gridDim.y + bh) * G * D;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {{
        const int h = i / D, d = i % D;
        dst[i] = (red[h][d] + red[G + h][d]) + red[2 * G + h][d] + bred[h][d / VG];
    }}
}}

// out[b, kvh*G + h, 0, d] = sum over the chunks of part[chunk, b*Hkv + kvh, h, d], chunk 0 first
extern "C" __global__ void av_quant_reduce(const float* __restrict__ part, float* __restrict__ out,
                                           const int chunks, const long long n) {{
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = 0.f;
    for (int k = 0; k < chunks; ++k) s += part[k * n + i];
    out[i] = s;
}}
"""


def source(bits: int, d: int, mt: int, cu: int = 16, su: int = 16) -> str:
    return HELPERS + _SOURCE.format(bits=bits, d=d, mt=mt, cu=cu, su=su, warps=WARPS, stages=STAGES)


def _unit(tensors, units) -> int:
    """The widest copy unit that every tensor's base and (batch, head) strides are aligned to."""
    return next(u for u in units if all(aligned(t, u, (0, 1)) for t in tensors))


def _supported(probs, v_codes, v_scale, v_min, bits, group) -> bool:
    B, Hq, one, T = probs.shape
    Hkv = v_codes.shape[1]
    if one != 1 or Hkv == 0 or Hq % Hkv or bits not in (1, 2):
        return False
    D = v_codes.shape[3] * (32 // bits)
    mt = -(-3 * (Hq // Hkv) // 16)
    return (D in (64, 128) and group == min(64, D) and mt <= (3 if D == 64 else 2) and probs.stride(-1) == 1
            and probs.dtype in (torch.float32, torch.float16, torch.bfloat16) and v_codes.dtype == torch.int32
            and v_scale.dtype == torch.float16 and v_min.dtype == torch.float16
            and v_codes.shape[:3] == (B, Hkv, T) and v_scale.shape == (B, Hkv, T, D // group)
            and v_min.shape == v_scale.shape
            and all(t.is_cuda and t.device == probs.device for t in (v_codes, v_scale, v_min))
            and all(rows_contiguous(t, 2) for t in (v_codes, v_scale, v_min)))


def load(reference):
    """reference: the torch av_quant, for the arguments the kernel does not take."""
    compile_module(source(1, 128, 1)).get_function("av_quant_partial")  # fail early
    kernels = {}

    def av_quant(probs, v_codes, v_scale, v_min, bits: int = 1, group: int = 64):
        """Kernel for bits 1/2, head_dim 64 (up to 16 query heads per KV head) or 128 (up to 10), value group
        min(64, head_dim), code/scale/min rows contiguous with 16-byte aligned heads; probs of any float dtype
        (read as fp32). Anything else: the torch reference."""
        if not _supported(probs, v_codes, v_scale, v_min, bits, group):
            return reference(probs, v_codes, v_scale, v_min, bits, group)
        B, Hq, _, T = probs.shape
        Hkv, D = v_codes.shape[1], v_codes.shape[3] * (32 // bits)
        G = Hq // Hkv
        if T == 0 or B == 0:
            return torch.zeros(B, Hq, 1, D, dtype=torch.float32, device=probs.device)
        p = probs if probs.dtype == torch.float32 else probs.float()
        mt = -(-3 * G // 16)
        key = (bits, D, mt, _unit([v_codes], (16, 8, 4)), _unit([v_scale, v_min], (16, 8, 4, 2)))
        if key not in kernels:
            mod = compile_module(source(*key))
            kernels[key] = (mod.get_function("av_quant_partial"), mod.get_function("av_quant_reduce"))
        partial, reduce = kernels[key]
        ntiles = -(-T // 16)
        tpb = units_per_block(ntiles * B * Hkv, WARPS, probs.device)
        chunks = -(-ntiles // tpb)
        out = torch.empty(B, Hq, 1, D, dtype=torch.float32, device=probs.device)
        part = torch.empty(chunks, B * Hkv, G, D, dtype=torch.float32, device=probs.device)
        launch(partial, (chunks, B * Hkv), (WARPS * 32,),
               (ptr(p), np.int64(p.stride(0)), np.int64(p.stride(1)),
                ptr(v_codes), np.int64(v_codes.stride(0)), np.int64(v_codes.stride(1)),
                ptr(v_scale), np.int64(v_scale.stride(0)), np.int64(v_scale.stride(1)),
                ptr(v_min), np.int64(v_min.stride(0)), np.int64(v_min.stride(1)),
                ptr(part), np.int32(Hkv), np.int32(G), np.int32(T), np.int32(tpb)), probs.device)
        n = B * Hq * D
        launch(reduce, (-(-n // 256),), (256,), (ptr(part), ptr(out), np.int32(chunks), np.int64(n)), probs.device)
        return out

    return av_quant

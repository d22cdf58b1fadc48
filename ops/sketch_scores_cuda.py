"""CUDA kernel for sketch_scores (ops/sparse_select.py): one score per KV head and token over a key sketch
(ops/quant.py's quantize_sketch layout), the group's query heads combined in registers (RULE 1: sum of the
logits, 2: logsumexp), masked from a device-side end on.

Tensor cores do the products (mma m16n8k16, fp16 in, fp32 accumulate), one warp per group of 64 tokens:
    A [16 tokens x 16 channels] = the codes: lane c of a quad reads its quarter of a token's words at once; a
        word holds even channels in its low half and odd ones in its high half, so one shift and one LOP3 make a
        channel pair into two fp16 values 2^(10-P) + code (the code ORed into mantissa bits P.., P >= 4, under the
        exponent of 2^(10-P): exact); pairs already at such bits need no shift;
    B [16 channels x 8 query heads] = w = q * scale of the group, rounded to fp16 (q * 2^e and scale / 2^E are
        normalised first so that w cannot overflow): 11 significant bits per channel's weight, the only rounding
        besides fp32 accumulation;
    the min term (q . min, exact: q * 2^e is exact in fp16 for a bf16/fp16 q) minus the offsets' sum_c 2^(10-P) w
        (both MMAs per group) seed the accumulators.
The codes and the group's scales and mins are staged global -> shared with cp.async, STAGES deep per warp.
"""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import aligned, compile_module, cu_source, launch, ptr, rows_contiguous, units_per_block
from tailorkv.ops.quant_common_cuda import C_TYPES, HELPERS

WARPS, GROUP, SMEM_LIMIT = 4, 64, 48 * 1024
RULES = {"sum": 1, "lse": 2}  # sketch_scores' combine rules the kernel takes (psum needs every token first)


def stages(bits: int) -> int:
    return 3 if bits < 4 else 2  # 4-bit groups are twice the words: two stages fit the shared memory


def shared_bytes(bits: int, d: int) -> int:
    return 4 * WARPS * stages(bits) * (GROUP * d * bits // 32 + d)


def source(bits: int, d: int, g: int, qdtype: torch.dtype, rule: int) -> str:
    defines = dict(BITS=bits, D=d, G=g, RULE=rule, WARPS=WARPS, STAGES=stages(bits), GROUP=GROUP)
    return cu_source("sketch_scores.cu", defines, dict(qtype=C_TYPES[str(qdtype)]), HELPERS)


def supported(q, k_codes, k_scale, k_min, bits, group) -> bool:
    B, Hq, one, D = q.shape
    Hkv = k_codes.shape[1]
    if one != 1 or Hkv == 0 or Hq % Hkv or bits not in (1, 2, 4) or group != GROUP or D not in (64, 128):
        return False
    N = k_codes.shape[2]
    return (str(q.dtype) in C_TYPES and Hq // Hkv <= 8 and shared_bytes(bits, D) <= SMEM_LIMIT
            and q.stride(-1) == 1 and k_codes.dtype == torch.int32
            and k_scale.dtype == torch.float16 and k_min.dtype == torch.float16
            and k_codes.shape[:2] == (B, Hkv) and k_codes.shape[3] * (32 // bits) == D
            and k_scale.shape[:2] == (B, Hkv) and k_scale.shape[3] == D and k_scale.shape[2] * group >= N
            and k_min.shape == k_scale.shape
            and all(t.is_cuda and t.device == q.device for t in (k_codes, k_scale, k_min))
            and all(rows_contiguous(t, 2) and aligned(t, 16, (0, 1)) for t in (k_codes, k_scale, k_min)))


def load(reference):
    """reference: the torch sketch_scores (ops/sparse_select.py)."""
    compile_module(source(2, 128, 4, torch.bfloat16, 2)).get_function("sketch_scores_kernel")  # fail early
    kernels = {}

    def sketch_scores(q, k_codes, k_scale, k_min, bits, group, end, offset=0, rule="lse", sm_scale=1.0, carry=None,
                      blocks_per_sm=None):
        """The kernel for 1/2/4 bits, group 64, head_dim 64/128, up to 8 query heads per KV head, rule sum or
        lse, a one-element int64 `end` on q's device, code/scale/min rows contiguous with 16-byte aligned
        heads; else the torch reference. A carry (ops/topk_carry.py, of B * Hkv rows on q's device) gets the
        tokens at or above its thresholds listed."""
        if (rule not in RULES or not supported(q, k_codes, k_scale, k_min, bits, group)
                or end.numel() != 1 or end.dtype != torch.int64 or end.device != q.device):
            return reference(q, k_codes, k_scale, k_min, bits, group, end, offset, rule, sm_scale, carry, blocks_per_sm)
        B, Hq, _, D = q.shape
        Hkv, N = k_codes.shape[1], k_codes.shape[2]
        out = torch.empty(B, Hkv, N, dtype=torch.float32, device=q.device)
        if out.numel() == 0:
            return out
        key = (bits, D, Hq // Hkv, q.dtype, RULES[rule])
        if key not in kernels:
            kernels[key] = compile_module(source(*key)).get_function("sketch_scores_kernel")
        c = carry if carry is not None and carry.fits(B * Hkv, q.device) else None
        listing = ((ptr(c.count), ptr(c.index), ptr(c.score), ptr(c.threshold), ptr(c.qnorm), np.int32(c.cap))
                   if c is not None else (np.uint64(0),) * 5 + (np.int32(0),))
        ngroups = -(-N // GROUP)
        grid = () if blocks_per_sm is None else (blocks_per_sm,)   # None: units_per_block's full wave
        gpb = units_per_block(ngroups * B * Hkv, WARPS, q.device, *grid)
        launch(kernels[key], (-(-ngroups // gpb), B * Hkv), (WARPS * 32,),
               (ptr(q), np.int64(q.stride(0)), np.int64(q.stride(1)),
                ptr(k_codes), np.int64(k_codes.stride(0)), np.int64(k_codes.stride(1)),
                ptr(k_scale), np.int64(k_scale.stride(0)), np.int64(k_scale.stride(1)),
                ptr(k_min), np.int64(k_min.stride(0)), np.int64(k_min.stride(1)),
                ptr(out), np.int32(Hkv), np.int32(N), np.int32(ngroups), np.int32(gpb), np.float32(sm_scale),
                ptr(end), np.int64(offset)) + listing, q.device)
        return out

    return sketch_scores

"""CUDA kernel for sketch_scores (ops/sparse_select.py): the packed-key attention kernel of ops/qk_quant_cuda.py
with its combining epilogue (RULE 1: the sum of a token's query-group logits, 2: their logsumexp), masked from a
device-side end on, one fp32 score per KV head and token."""
from __future__ import annotations

import torch

from tailorkv.ops.cuda_launch import compile_module
from tailorkv.ops.qk_quant_cuda import launcher, supported, source

RULES = {"sum": 1, "lse": 2}  # sketch_scores' combine rules the kernel takes (psum needs every token first)


def load(reference):
    """reference: the torch sketch_scores (ops/sparse_select.py)."""
    compile_module(source(2, 128, 1, 1, torch.bfloat16, 2)).get_function("qk_quant_kernel")  # fail early
    run = launcher()

    def sketch_scores(q, k_codes, k_scale, k_min, bits, group, end, offset=0, rule="lse", sm_scale=1.0):
        """The kernel for qk_quant's arguments with rule sum or lse and a one-element int64 `end` on q's device;
        else the torch reference."""
        if (rule not in RULES or not supported(q, k_codes, k_scale, k_min, bits, group)
                or end.numel() != 1 or end.dtype != torch.int64 or end.device != q.device):
            return reference(q, k_codes, k_scale, k_min, bits, group, end, offset, rule, sm_scale)
        B, Hkv = q.shape[0], k_codes.shape[1]
        out = torch.empty(B, Hkv, k_codes.shape[2] * (32 // bits), dtype=torch.float32, device=q.device)
        if out.numel() == 0:
            return out
        return run(q, k_codes, k_scale, k_min, bits, sm_scale, out, RULES[rule], end, offset)

    return sketch_scores

"""The projections of a decode step: one input row times a weight [N, K] (a GEMV, bound by reading the weight).
On the GPU one row of bf16/fp16 goes to a CUDA kernel that streams the weight with 16-byte loads over many
blocks; anything else (prefill rows, fp32, odd layouts) to F.linear. linear_fp8 does the same from e4m3 codes of
the weight with a scale per row (half the bytes; for the predicted queries, which only choose tokens)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tailorkv.ops import linear_cuda
from tailorkv.ops.dispatch import op, register_kernel


@op("linear")
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K], weight [N, K] -> x @ weight^T [..., N] (no bias), accumulated in fp32, in x's dtype."""
    return F.linear(x, weight)


register_kernel("linear", lambda: linear_cuda.load(linear.fallback))


def fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 codes [N, K], fp32 scales [N]): each row scaled so that its largest |w| is 448."""
    scale = weight.abs().amax(-1).float().clamp_min(1e-30) / 448.0
    return (weight.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


@op("linear_fp8")
def linear_fp8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] times the weight fp8_rows coded [N, K] -> [..., N] in x's dtype: the products and sums in fp32,
    each output scaled by its row's scale at the end."""
    return (F.linear(x.float(), codes.float()) * scale).to(x.dtype)


register_kernel("linear_fp8", lambda: linear_cuda.load_fp8(linear_fp8.fallback))

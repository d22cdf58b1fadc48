"""The projections of a decode step: one input row times a weight [N, K] (a GEMV, bound by reading the weight).
On the GPU one row of bf16/fp16 goes to a CUDA kernel that streams the weight with 16-byte loads over many
blocks; anything else (prefill rows, fp32, odd layouts) to F.linear."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tailorkv.ops import linear_cuda
from tailorkv.ops.dispatch import op, register_kernel


@op("linear")
def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K], weight [N, K] -> x @ weight^T [..., N] (no bias), accumulated in fp32, in x's dtype."""
    return F.linear(x, weight)


register_kernel("linear", lambda: linear_cuda.load(linear.reference))

"""linear: the decode step's GEMV. The reference is F.linear; the kernel (one row, bf16/fp16) equals an fp32
product up to the output's rounding, on fresh random inputs, with any N (not a multiple of a block's rows) and K."""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from tailorkv.ops import dispatch
from tailorkv.ops.linear import linear

SEED = int(os.environ.get("TAILORKV_SEED", random.randrange(2**31)))
print(f"test_linear seed: TAILORKV_SEED={SEED}")


def test_reference_is_f_linear():
    g = torch.Generator().manual_seed(SEED)
    x, w = torch.randn(2, 3, 40, generator=g), torch.randn(24, 40, generator=g)
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.cuda
@pytest.mark.parametrize("N, K, dtype", [(6144, 4096, torch.bfloat16), (4099, 1544, torch.float16),
                                         (1, 8, torch.bfloat16), (49152, 576, torch.bfloat16), (7, 14336, torch.float16)])
def test_kernel_equals_fp32_product(N, K, dtype):
    g = torch.Generator().manual_seed(SEED + N)
    x = torch.randn(1, 1, K, generator=g).to(dtype).cuda()
    w = (torch.randn(N, K, generator=g) * 0.05).to(dtype).cuda()
    assert dispatch.kernel_for("linear", x, w) is not None
    torch.full((N,), float("nan"), dtype=dtype, device="cuda")  # freed: the output's block starts as NaN
    y = linear(x, w)
    want = x.float() @ w.float().t()
    assert y.shape == (1, 1, N) and y.dtype == dtype and not torch.isnan(y).any()
    err = ((y.float() - want).abs() / want.abs().clamp_min(1e-3 * want.abs().max())).max().item()
    assert err < 2 ** -7  # the output's own rounding (2^-8 for bf16) plus a reordered fp32 sum


@pytest.mark.cuda
def test_rows_of_many_tokens_go_to_cublas():
    x = torch.randn(1, 5, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(linear(x, w), F.linear(x, w))

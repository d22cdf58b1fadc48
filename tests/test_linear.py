"""linear: the decode step's GEMV. The reference is F.linear; the kernel (one row, bf16/fp16) equals an fp32
product up to the output's rounding, on fresh random inputs, with any N (not a multiple of a block's rows) and K."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tailorkv.ops import dispatch
from tailorkv.ops.linear import fp8_rows, linear, linear_fp8
from helpers import SEED


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


def test_fp8_rows_keep_each_weight_within_e4m3_rounding():
    g = torch.Generator().manual_seed(SEED)
    w = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g)  # rows of different magnitudes
    codes, scale = fp8_rows(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (64,)
    back = codes.float() * scale[:, None]
    assert (back.abs().amax(-1) - w.abs().amax(-1)).abs().max() <= 1e-6 * w.abs().max()  # row max exact
    normal = w.abs() >= scale[:, None] * 2 ** -6                                         # not subnormal in e4m3
    assert ((back - w).abs() <= w.abs() * 2 ** -4 + 1e-12)[normal].all()                 # 3 mantissa bits


def test_fp8_reference_scales_an_fp32_product_of_the_codes():
    g = torch.Generator().manual_seed(SEED + 1)
    x, w = torch.randn(1, 1, 96, generator=g).bfloat16(), torch.randn(40, 96, generator=g)
    codes, scale = fp8_rows(w)
    want = (x.double() @ codes.double().t() * scale.double()).to(torch.bfloat16)
    assert ((linear_fp8(x, codes, scale).float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all()
    exact = x.float() @ w.t()
    cos = F.cosine_similarity(linear_fp8(x, codes, scale).float().flatten(), exact.flatten(), dim=0)
    assert cos > 0.998  # what the predicted query loses to fp8 weights: little


@pytest.mark.cuda
@pytest.mark.parametrize("N, K, dtype", [(4096, 4096, torch.bfloat16), (4099, 1552, torch.float16),
                                         (1, 16, torch.bfloat16), (960, 576, torch.bfloat16), (7, 14336, torch.float16)])
def test_fp8_kernel_equals_its_reference(N, K, dtype):
    g = torch.Generator().manual_seed(SEED + N + 1)
    x = torch.randn(1, 1, K, generator=g).to(dtype).cuda()
    codes, scale = fp8_rows((torch.randn(N, K, generator=g) * 0.05).cuda())
    assert dispatch.kernel_for("linear_fp8", x, codes, scale) is not None
    torch.full((N,), float("nan"), dtype=dtype, device="cuda")  # freed: the output's block starts as NaN
    y = linear_fp8(x, codes, scale)
    want = (x.double() @ codes.double().t()) * scale.double()
    assert y.shape == (1, 1, N) and y.dtype == dtype and not torch.isnan(y).any()
    err = ((y.double() - want).abs() / want.abs().clamp_min(1e-3 * want.abs().max())).max().item()
    assert err < 2 ** -7

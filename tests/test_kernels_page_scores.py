"""quest_page_scores: the torch reference against the plain formula (CPU), the CUDA kernel against both on fresh
random inputs (poisoned output, strided queries, every dtype and group size it takes; NaN never passes).
quest_bound_page: reference and kernel against the page's min and max taken directly, keys past the position
NaN (never read), other pages untouched.

Inputs are random with a fresh seed per run (shown beside a failure; set TAILORKV_SEED to replay one)."""
from __future__ import annotations

import pytest
import torch

from helpers import SEED, rel_err
from tailorkv.ops import dispatch
from tailorkv.ops.page_select import bound_page, page_scores


def formula(q, kmin, kmax):
    """fp64: per KV head, the max over its query heads of sum_d max(q_d * min_d, q_d * max_d)."""
    B, Hq, D = q.shape
    H = kmin.shape[1]
    qg = q.double().reshape(B, H, Hq // H, 1, D)
    lo, hi = kmin.double()[:, :, None], kmax.double()[:, :, None]
    return torch.maximum(qg * lo, qg * hi).sum(-1).amax(2)


def inputs(g, B, Hq, H, P, D, dtype, device="cpu"):
    """q as the model hands it (a [B, Hq, 1, D] view's token 0, heads strided), kmin <= kmax."""
    q = torch.randn(B, 1, Hq, 2 * D, generator=g)[..., :D].to(device, dtype).transpose(1, 2)[:, :, 0]
    a, b = (torch.randn(B, H, P, D, generator=g) * 2 for _ in range(2))
    return q, torch.minimum(a, b).to(device, dtype), torch.maximum(a, b).to(device, dtype)


SHAPES = [(1, 32, 8, 2048, 128), (2, 9, 3, 37, 64), (1, 8, 1, 1, 128), (3, 4, 4, 130, 32), (1, 16, 2, 515, 256)]


@pytest.mark.parametrize("B,Hq,H,P,D", SHAPES)
def test_reference_equals_the_formula(B, Hq, H, P, D):
    g = torch.Generator().manual_seed(SEED + P + Hq)
    q, kmin, kmax = inputs(g, B, Hq, H, P, D, torch.float32)
    assert rel_err(page_scores.reference(q, kmin, kmax), formula(q, kmin, kmax)) < 1e-6


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,Hq,H,P,D", SHAPES)
def test_kernel_equals_the_reference(B, Hq, H, P, D, dtype):
    g = torch.Generator().manual_seed(SEED + 7 * P + D)
    q, kmin, kmax = inputs(g, B, Hq, H, P, D, dtype, "cuda")
    calls = dispatch.FALLBACKS["quest_page_scores"]
    for n in (1 << 12, 1 << 16, 1 << 20):  # poison the blocks the output may come from
        torch.full((n,), float("nan"), device="cuda")
    got = page_scores(q, kmin, kmax)
    assert dispatch.FALLBACKS["quest_page_scores"] == calls  # the kernel ran, not its reference
    want = formula(q, kmin, kmax)
    assert got.dtype == torch.float32 and got.shape == (B, H, P)
    assert rel_err(got, want) < 1e-5
    assert rel_err(page_scores.reference(q, kmin, kmax), want) < 1e-5


def _bound_case(g, B, H, N, D, page, pos, dtype, device):
    k = torch.randn(B, H, N, D, generator=g).to(device, dtype)
    k[:, :, pos + 1:] = float("nan")  # beyond the new token: stale slots, never read
    P = -(-N // page)
    kmin, kmax = (torch.randn(B, H, P, D, generator=g).to(device, dtype) for _ in range(2))
    first = pos - pos % page
    want_min, want_max = kmin.clone(), kmax.clone()
    want_min[:, :, first // page] = k[:, :, first:pos + 1].amin(2)
    want_max[:, :, first // page] = k[:, :, first:pos + 1].amax(2)
    return k, kmin, kmax, torch.tensor([pos], device=device), want_min, want_max


BOUNDS = [(1, 8, 100, 128, 16, 0), (2, 3, 100, 64, 16, 47), (1, 2, 100, 32, 16, 99), (2, 4, 37, 128, 16, 33),
          (1, 1, 64, 256, 32, 63)]


@pytest.mark.parametrize("B,H,N,D,page,pos", BOUNDS)
def test_bound_page_reference(B, H, N, D, page, pos):
    g = torch.Generator().manual_seed(SEED + pos + D)
    k, kmin, kmax, position, want_min, want_max = _bound_case(g, B, H, N, D, page, pos, torch.float32, "cpu")
    bound_page(k, kmin, kmax, position, page)
    assert torch.equal(kmin, want_min) and torch.equal(kmax, want_max)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("B,H,N,D,page,pos", BOUNDS)
def test_bound_page_kernel(B, H, N, D, page, pos, dtype):
    g = torch.Generator().manual_seed(SEED + 3 * pos + D)
    k, kmin, kmax, position, want_min, want_max = _bound_case(g, B, H, N, D, page, pos, dtype, "cuda")
    calls = dispatch.FALLBACKS["quest_bound_page"]
    bound_page(k, kmin, kmax, position, page)
    assert dispatch.FALLBACKS["quest_bound_page"] == calls  # the kernel ran, not its reference
    assert torch.equal(kmin, want_min) and torch.equal(kmax, want_max)  # min and max are exact

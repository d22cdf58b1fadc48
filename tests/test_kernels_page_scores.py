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
from tailorkv.ops.page_select import bound_page, page_scores, page_slots


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


# --- the masked scores and quest_page_slots (a sparse decode step's positions) -----------------------------------
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("length,page", [(1, 16), (16, 16), (17, 16), (500, 16), (2048, 32)])
def test_scores_from_the_last_page_on_are_minus_inf(length, page, device):
    g = torch.Generator().manual_seed(SEED + length + page)
    P = -(-2048 // page)
    q, kmin, kmax = inputs(g, 2, 8, 2, P, 64, torch.float32, device)
    got = page_scores(q, kmin, kmax, torch.tensor([length], device=device), page)
    want = formula(q, kmin, kmax)
    last = (length - 1) // page
    assert torch.isneginf(got[..., last:]).all()
    assert rel_err(got[..., :last], want[..., :last]) < 1e-5 if last else got[..., :last].numel() == 0


def slots_formula(pages, scores, length, page, drop, none):
    """Row by row in Python: each page's positions in turn (the lowest-scoring one, first on a tie, as `none`
    where dropping), then the last page's."""
    out = []
    for b in range(pages.shape[0]):
        rows = []
        for h in range(pages.shape[1]):
            pg = pages[b, h].tolist()
            if drop and pg:
                s = [scores[b, h, p].item() for p in pg]
                pg[s.index(min(s))] = none
            row = [p * page + o for p in pg for o in range(page)]
            rows.append(row + [(length - 1) // page * page + o for o in range(page)])
        out.append(rows)
    return torch.tensor(out, dtype=torch.long)


SLOTS = [(1, 8, 2048, 16, 63, 1500), (2, 3, 37, 16, 5, 590), (1, 2, 9, 32, 0, 280), (3, 1, 300, 8, 40, 2399)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("B,H,P,page,top,length", SLOTS)
def test_page_slots(B, H, P, page, top, length, drop, device):
    g = torch.Generator().manual_seed(SEED + P + top + drop)
    scores = torch.randn(B, H, P, generator=g).to(device)
    scores[..., ::7] = scores[..., 3:4]  # ties: the first chosen page of the lowest score goes
    pages = torch.stack([torch.randperm(P, generator=g)[:top] for _ in range(B * H)]).reshape(B, H, top).to(device)
    slots = torch.full((B, H, (top + 1) * page), -7, dtype=torch.long, device=device)  # poisoned: fully written
    calls = dispatch.FALLBACKS["quest_page_slots"]
    got = page_slots(pages, scores, torch.tensor([length], device=device), page, drop, 10**6, slots)
    assert dispatch.FALLBACKS["quest_page_slots"] == calls  # on a GPU the kernel ran, not its reference
    assert got.data_ptr() == slots.data_ptr()
    assert torch.equal(slots.cpu(), slots_formula(pages.cpu(), scores.cpu(), length, page, drop, 10**6))

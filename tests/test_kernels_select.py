"""Token selection of sparse layers: approx_scores (reference with out=, against a plain formula; kernel against
the reference) and the topk_tokens kernel (the SET of indices against torch.topk on distinct scores).

Inputs are random with a fresh seed per run (printed; set TAILORKV_SEED to replay one)."""
from __future__ import annotations

import os
import random

import pytest
import torch

from tailorkv.ops import dispatch
from tailorkv.ops.sparse_select import approx_scores, topk_tokens

SEED = int(os.environ.get("TAILORKV_SEED", random.randrange(2**31)))
print(f"test_kernels_select seed: TAILORKV_SEED={SEED}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any() and not torch.isnan(b).any(), "NaN in the result"
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def plain_scores(q, kt_rows, channels):
    B, Hq = q.shape[:2]
    _, Hkv, r, N = kt_rows.shape
    G = Hq // Hkv
    out = torch.zeros(B, Hkv, N, dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            for j in range(r):
                c = channels[b, h, j]
                out[b, h] += q[b, h * G:(h + 1) * G, 0, c].double().sum() * kt_rows[b, h, j].double()
    return out


def inputs(g, B, Hq, Hkv, D, r, N, dtype, device="cpu"):
    q = torch.randn(B, Hq, 1, D, generator=g).to(device, dtype)
    kt = torch.randn(B, Hkv, D, N + 11, generator=g).to(device, dtype)
    channels = torch.stack([torch.randperm(D, generator=g)[:r] for _ in range(B * Hkv)]).reshape(B, Hkv, r)
    channels = channels.to(device)
    rows = kt.gather(2, channels[..., None].expand(B, Hkv, r, N + 11))
    return q, rows, channels


@pytest.mark.parametrize("B,Hq,Hkv,D,r,N", [(1, 8, 2, 16, 4, 50), (2, 9, 3, 8, 8, 33), (1, 4, 4, 8, 1, 7)])
def test_approx_scores_reference_equals_plain_formula_and_fills_out(B, Hq, Hkv, D, r, N):
    g = torch.Generator().manual_seed(SEED + N)
    q, rows, channels = inputs(g, B, Hq, Hkv, D, r, N, torch.float32)
    rows = rows[..., 3:3 + N]
    want = plain_scores(q, rows, channels)
    assert rel_err(approx_scores(q, rows, channels), want) < 1e-6
    out = torch.full((B, Hkv, N), float("nan"))
    assert approx_scores(q, rows, channels, out=out) is out
    assert rel_err(out, want) < 1e-6
    with pytest.raises(ValueError, match="out is"):
        approx_scores(q, rows, channels, out=torch.empty(B, Hkv, N + 1))


APPROX_CASES = [  # (B, Hq, Hkv, D, r, N, dtype, start of the token window in the rows)
    (1, 32, 8, 128, 12, 131072, torch.bfloat16, 0), (1, 32, 8, 128, 8, 4099, torch.float16, 3),
    (2, 9, 3, 64, 64, 1000, torch.float32, 0), (1, 9, 3, 64, 5, 17, torch.bfloat16, 1),
    (2, 4, 4, 128, 128, 256, torch.bfloat16, 8),
]


@pytest.mark.cuda
@pytest.mark.parametrize("B,Hq,Hkv,D,r,N,dtype,start", APPROX_CASES)
def test_approx_scores_kernel_equals_reference(B, Hq, Hkv, D, r, N, dtype, start):
    g = torch.Generator().manual_seed(SEED + N + r)
    q, rows, channels = inputs(g, B, Hq, Hkv, D, r, N, dtype, "cuda")
    rows = rows[..., start:start + N]          # a window of a wider buffer, as the policy's static buffers give
    kernel = dispatch.kernel_for("approx_scores", q, rows, channels)
    assert kernel is not None, "the approx_scores kernel did not load (CuPy missing?)"
    want = approx_scores.reference(q, rows, channels)
    torch.full((B * Hkv * N,), float("nan"), device="cuda")   # poison the block the output reuses
    assert rel_err(kernel(q, rows, channels), want) < 1e-5   # fp32 sums in another order
    out = torch.full((B, Hkv, N), float("nan"), device="cuda")
    assert kernel(q, rows, channels, out=out) is out
    assert rel_err(out, want) < 1e-5


def distinct_scores(g, B, H, N, device="cuda"):
    """Distinct fp32 scores spread like real ones (a random permutation of distinct values)."""
    base = torch.sort(torch.randn(N * 2, generator=g, dtype=torch.float64) * 5).values[::2].float()
    base = torch.unique(base)
    while base.numel() < N:  # never in practice: pad with distinct large values
        base = torch.cat([base, base.max() + torch.arange(1, N - base.numel() + 1)])
    return torch.stack([base[torch.randperm(base.numel(), generator=g)[:N]] for _ in range(B * H)]).reshape(B, H, N).to(device)


TOPK_CASES = [(1, 8, 131072, 896), (2, 8, 8191, 1024), (1, 3, 5000, 31), (2, 2, 1000, 999), (1, 1, 7, 3),
              (1, 4, 300, 300), (1, 4, 300, 500), (3, 2, 65537, 1), (1, 8, 8192, 896), (1, 8, 32768, 896),
              (1, 8, 131072, 8192), (1, 2, 1 << 20, 896), (1, 1, 10000, 9999), (64, 8, 4096, 128)]


@pytest.mark.cuda
@pytest.mark.parametrize("B,H,N,k", TOPK_CASES)
def test_topk_tokens_kernel_selects_the_set_of_torch_topk(B, H, N, k):
    g = torch.Generator().manual_seed(SEED + N + k)
    wide = distinct_scores(g, B, H, N + 5)
    for scores in (wide[..., :N].contiguous(), wide[..., 1:N + 1]):   # contiguous rows, and misaligned views
        kernel = dispatch.kernel_for("topk_tokens", scores)
        assert kernel is not None, "the topk_tokens kernel did not load (CuPy missing?)"
        for n in (B * H * min(k, N) * 2, B * H * N * 4):   # poison the blocks the output and scratch reuse
            torch.full((n,), -1, dtype=torch.int32, device="cuda")
        got = kernel(scores, k)
        assert got.shape == (B, H, min(k, N)) and got.dtype == torch.int64
        assert (got >= 0).all() and (got < N).all()
        assert (got.diff(dim=-1) > 0).all(), "indices are ascending (hence distinct)"
        want = scores.topk(min(k, N), dim=-1).indices.sort(-1).values
        assert torch.equal(got, want)
        assert torch.equal(kernel(scores, k), got), "a second call (workspace reset) gives the same"


@pytest.mark.cuda
def test_topk_tokens_kernel_takes_the_lowest_tied_indices():
    scores = torch.tensor([[[1.0, 3.0, 2.0, 2.0, 0.0, 2.0, 3.0, 2.0]]], device="cuda")
    assert topk_tokens(scores, 4).tolist() == [[[1, 2, 3, 6]]]
    zeros = topk_tokens(torch.zeros(1, 2, 5000, device="cuda"), 10)
    assert torch.equal(zeros.cpu(), torch.arange(10).expand(1, 2, 10))


def lowest_ties_topk(scores, k):
    """The SET of the k largest, ties at the k-th value broken by the lowest index, ascending (on the CPU)."""
    _, perm = torch.sort(-scores.double().cpu(), dim=-1, stable=True)
    return perm[..., :k].sort(-1).values


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["ties", "all_equal", "neg_inf_padding", "negative"])
def test_topk_tokens_kernel_on_ties_padding_and_signs(kind):
    g = torch.Generator().manual_seed(SEED + len(kind))
    B, H, N, k = 1, 8, 40000, 896
    s = torch.randn(B, H, N, generator=g) * 3
    if kind == "ties":
        s = s.round()                      # a few distinct values: the k-th ties with thousands
    elif kind == "all_equal":
        s = torch.full((B, H, N), 0.5)
    elif kind == "neg_inf_padding":
        s[..., N - 1500:] = float("-inf")  # the policy's bucket padding past the middle
    else:
        s = -s.abs() - 1e4
    s = s.cuda()
    kernel = dispatch.kernel_for("topk_tokens", s)
    got = kernel(s, k)
    want = lowest_ties_topk(s, k).cuda()
    assert torch.equal(got, want)
    assert torch.equal(topk_tokens(s, k), got)


@pytest.mark.cuda
def test_topk_tokens_dispatch_calls_the_kernel_and_replays_in_a_graph(monkeypatch):
    g = torch.Generator().manual_seed(SEED + 23)
    scores = distinct_scores(g, 1, 8, 20000)
    kernel = dispatch.kernel_for("topk_tokens", scores)
    assert kernel is not None
    calls = []
    monkeypatch.setitem(dispatch._KERNELS, "topk_tokens", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    topk_tokens(scores, 896)
    assert calls == [1]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(scores, 896)
    for i in range(4):
        scores.copy_(distinct_scores(g, 1, 8, 20000))
        if i == 2:
            scores[..., :100] = 1e9        # the winners move
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, scores.topk(896, dim=-1).indices.sort(-1).values), i

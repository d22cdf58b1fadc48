"""Token selection of sparse layers: approx_scores (reference with out=, against a plain formula; kernel against
the reference) and the topk_tokens kernel (the SET of indices against torch.topk on distinct scores).

Inputs are random with a fresh seed per run (shown beside a failure; set TAILORKV_SEED to replay one)."""
from __future__ import annotations

import pytest
import torch

from helpers import SEED, lowest_ties_topk, rel_err
from tailorkv.ops import dispatch
from tailorkv.ops.sparse_select import approx_scores

E4M3 = torch.float8_e4m3fn


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
    """q in dtype (bf16 where dtype is e4m3: the K^T store's 8 bits are for the rows only) and K^T rows."""
    q = torch.randn(B, Hq, 1, D, generator=g).to(device, torch.bfloat16 if dtype == E4M3 else dtype)
    W = N + 16 + (-N) % 16  # rows 16-element aligned: a window starting at 0 (or 16 bytes in) takes 16-byte loads
    kt = torch.randn(B, Hkv, D, W, generator=g)
    channels = torch.stack([torch.randperm(D, generator=g)[:r] for _ in range(B * Hkv)]).reshape(B, Hkv, r)
    rows = kt.gather(2, channels[..., None].expand(B, Hkv, r, W)).to(device, dtype)
    return q, rows, channels.to(device)


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


def test_approx_scores_reference_takes_e4m3_rows():
    g = torch.Generator().manual_seed(SEED + 5)
    q, rows, channels = inputs(g, 1, 8, 2, 16, 4, 40, E4M3)
    want = plain_scores(q, rows.float(), channels)
    for rule in ("sum", "lse"):
        got = approx_scores(q, rows, channels, rule=rule)
        assert got.dtype == torch.float32 and not got.isnan().any()
    assert rel_err(approx_scores(q, rows, channels), want) < 1e-6


APPROX_CASES = [  # (B, Hq, Hkv, D, r, N, dtype, start of the token window in the rows: 16-byte aligned or not)
    (1, 32, 8, 128, 12, 131072, torch.bfloat16, 0), (1, 32, 8, 128, 8, 4099, torch.float16, 3),
    (2, 9, 3, 64, 64, 1000, torch.float32, 0), (1, 9, 3, 64, 5, 17, torch.bfloat16, 1),
    (2, 4, 4, 128, 128, 256, torch.bfloat16, 8),
    (1, 32, 8, 128, 12, 131072, E4M3, 0), (1, 9, 3, 64, 5, 17, E4M3, 1), (2, 4, 4, 128, 16, 4099, E4M3, 0),
    (1, 8, 2, 64, 8, 4099, torch.bfloat16, 0), (1, 8, 2, 64, 8, 1000, E4M3, 16),
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
              (1, 8, 131072, 8192), (1, 2, 1 << 20, 896), (1, 1, 10000, 9999), (64, 8, 4096, 128),
              (1, 8, 100003, 900), (1, 3, 20000, 4999), (2, 1, 65536, 2)]  # two stages, short last stretches


@pytest.mark.cuda
@pytest.mark.parametrize("B,Hq,Hkv,D,r,N,dtype,start", APPROX_CASES)
def test_approx_scores_lse_kernel_with_end_equals_reference(B, Hq, Hkv, D, r, N, dtype, start):
    g = torch.Generator().manual_seed(SEED + 7 * N + r)
    q, rows, channels = inputs(g, B, Hq, Hkv, D, r, N, dtype, "cuda")
    rows = rows[..., start:start + N]
    kernel = dispatch.kernel_for("approx_scores", q, rows, channels)
    assert kernel is not None
    scale, offset = 1 / D ** 0.5, 16
    for end in (None, torch.tensor([offset + N // 2 + 1], device="cuda"), torch.tensor([3], device="cuda")):
        want = approx_scores.reference(q, rows, channels, None, "lse", scale, end, offset)
        out = torch.full((B, Hkv, N), float("nan"), device="cuda")
        got = kernel(q, rows, channels, out, "lse", scale, end, offset)
        assert got is out and not torch.isnan(got).any()
        assert torch.equal(torch.isinf(got), torch.isinf(want))
        fin = ~torch.isinf(want)
        if fin.any():
            assert rel_err(got[fin], want[fin]) < 1e-5
        got_sum = kernel(q, rows, channels, None, "sum", 1.0, end, offset)
        want_sum = approx_scores.reference(q, rows, channels, None, "sum", 1.0, end, offset)
        assert torch.equal(torch.isinf(got_sum), torch.isinf(want_sum))
        if fin.any():
            assert rel_err(got_sum[fin], want_sum[fin]) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("B,H,N,k", TOPK_CASES)
def test_topk_tokens_kernel_returns_the_set_of_the_k_largest(B, H, N, k):
    from tailorkv.ops.sparse_select import topk_tokens
    g = torch.Generator().manual_seed(SEED + N + k)
    scores = distinct_scores(g, B, H, N)
    kernel = dispatch.kernel_for("topk_tokens", scores)
    assert kernel is not None, "the topk_tokens kernel did not load"
    got = kernel(scores, k)
    assert got.shape == (B, H, min(k, N)) and got.dtype == torch.int64
    assert torch.equal(got.cpu(), lowest_ties_topk(scores, min(k, N)))  # the set, in index order
    assert torch.equal(topk_tokens(scores, k).sort(-1).values.cpu(), lowest_ties_topk(scores, min(k, N)))
    out = torch.full((B, H, min(k, N)), -5, dtype=torch.int64, device=scores.device)
    assert kernel(scores, k, 1000, out) is out                          # an offset, into a caller's buffer
    assert torch.equal(out.cpu(), lowest_ties_topk(scores, min(k, N)) + 1000)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["ties", "all-equal", "-inf tail", "view of a wider buffer"])
def test_topk_tokens_kernel_breaks_ties_by_the_lowest_index(kind):
    g = torch.Generator().manual_seed(SEED + len(kind))
    B, H, N, k = 1, 8, 40000, 896
    if kind == "ties":
        scores = torch.randint(0, 7, (B, H, N), generator=g).float()
    elif kind == "all-equal":
        scores = torch.full((B, H, N), 0.5)
    elif kind == "-inf tail":
        scores = torch.randn(B, H, N, generator=g)
        scores[..., 1000:] = float("-inf")
    else:
        scores = torch.randn(B, H, N + 64, generator=g)[..., 7:7 + N]
    scores = scores.cuda()
    kernel = dispatch.kernel_for("topk_tokens", scores)
    got = kernel(scores, k)
    assert torch.equal(got.cpu(), lowest_ties_topk(scores, k))


def test_topk_stretches_balance_the_two_stages():
    from tailorkv.ops.topk_cuda import stretches
    assert stretches(8, 131072, 896, 132) == 12      # sqrt(146): 10.9k keys per stretch, 10.8k candidates
    assert stretches(512, 4096, 128, 132) == 1       # rows fill the GPU: one stage
    assert stretches(8, 2048, 896, 132) == 1         # a short row: one stage
    assert stretches(1, 1 << 20, 1, 132) == 264      # capped at two blocks per SM
    assert stretches(8, 8192, 63, 132) == 1          # up to ONE_STAGE_MAX_N keys: one stage
    assert stretches(8, 16385, 63, 132) == 16        # just past it: the split rule


@pytest.mark.cuda
def test_topk_tokens_kernel_replays_in_a_cuda_graph():
    g = torch.Generator().manual_seed(SEED)
    scores = distinct_scores(g, 1, 8, 32768)
    kernel = dispatch.kernel_for("topk_tokens", scores)
    kernel(scores, 1024)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(scores, 1024)
    for _ in range(3):
        scores.copy_(distinct_scores(g, 1, 8, 32768))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.sort(-1).values.cpu(), lowest_ties_topk(scores, 1024))

"""The selection ops of ops/sparse_select.py against brute force: per-head scores, the ways of combining a GQA
group's heads (the paper's summed logits, logsumexp, summed probabilities) and the channel rules."""
import math

import pytest
import torch

from tailorkv.ops.sparse_select import (approx_scores, channel_scores, combine_heads, head_scores, topk_channels,
                                        topk_tokens)
from helpers import SEED

B, HQ, HKV, D, N = 2, 6, 2, 16, 40
G = HQ // HKV


def _data(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, 1, D, generator=g).to(dtype)
    k = (torch.randn(B, HKV, N, D, generator=g) * torch.linspace(0.2, 3, D)).to(dtype)  # unequal channels
    return q, k


def _rows(k, chans):
    """K^T rows of `chans` [B, Hkv, r] -> [B, Hkv, r, N]."""
    return k.transpose(2, 3).gather(2, chans[..., None].expand(-1, -1, -1, k.shape[2]))


def _exact_logits(q, k):
    """[B, Hq, N]: q_h . k over all channels, each query head against its KV head h // G (float64)."""
    out = torch.empty(B, HQ, N, dtype=torch.float64)
    for b in range(B):
        for h in range(HQ):
            out[b, h] = k[b, h // G].double() @ q[b, h, 0].double()
    return out


def test_head_scores_with_every_channel_are_the_exact_logits():
    q, k = _data()
    every = torch.arange(D).expand(B, HKV, D)
    got = head_scores(q, _rows(k, every), every)
    assert got.shape == (B, HQ, N) and got.dtype == torch.float32
    assert torch.allclose(got.double(), _exact_logits(q, k), atol=1e-4)


def test_head_scores_on_some_channels_and_sum_equals_the_papers_rule():
    q, k = _data(1)
    chans = topk_channels(channel_scores(q, k.abs().amax(2)), 5)
    rows = _rows(k, chans)
    got = head_scores(q, rows, chans)
    for b in range(B):
        for h in range(HQ):
            c = chans[b, h // G]
            want = k[b, h // G][:, c].double() @ q[b, h, 0, c].double()
            assert torch.allclose(got[b, h].double(), want, atol=1e-4)
    paper = approx_scores(q, rows, chans)
    summed = combine_heads(got, HKV, "sum")
    assert torch.allclose(summed, paper, atol=1e-4)
    assert torch.equal(topk_tokens(summed, 7).sort(-1).values, topk_tokens(paper, 7).sort(-1).values)


@pytest.mark.parametrize("rule", ["lse", "psum"])
def test_combine_with_every_channel_matches_brute_force(rule):
    q, k = _data(2)
    scale = 1 / math.sqrt(D)
    every = torch.arange(D).expand(B, HKV, D)
    got = combine_heads(head_scores(q, _rows(k, every), every), HKV, rule, scale)
    logits = _exact_logits(q, k) * scale
    want = torch.empty(B, HKV, N, dtype=torch.float64)
    for b in range(B):
        for kv in range(HKV):
            heads = logits[b, kv * G:(kv + 1) * G]
            if rule == "lse":
                want[b, kv] = torch.log(heads.exp().sum(0))
            else:
                want[b, kv] = (heads.exp() / heads.exp().sum(1, keepdim=True)).sum(0)
    assert got.shape == (B, HKV, N) and torch.allclose(got.double(), want, atol=1e-5)
    assert torch.equal(topk_tokens(got, 9).sort(-1).values, topk_tokens(want, 9).sort(-1).values)


def test_lse_and_psum_keep_a_token_that_one_head_wants():
    """Two heads of one group: head 0 wants token 3 (a needle), head 1 spreads its logits with a big negative
    offset on it. Summed logits rank token 3 last; logsumexp and summed probabilities keep it first."""
    n = 8
    head0 = torch.zeros(n)
    head0[3] = 6.0
    head1 = torch.linspace(1.0, 2.0, n)
    head1[3] = -12.0
    scores = torch.stack([head0, head1])[None]      # [1, Hq 2, N] with one KV head
    assert int(combine_heads(scores, 1, "sum").argmax()) != 3
    assert int(combine_heads(scores, 1, "lse").argmax()) == 3
    assert int(combine_heads(scores, 1, "psum").argmax()) == 3


def test_channel_rules_hand_made():
    q_hat = torch.tensor([[1.0, -1.0, 0.5, 0.0], [1.0, 3.0, -0.5, 0.0], [-2.0, 1.0, 0.0, 0.2]]).reshape(1, 3, 1, 4)
    kmax = torch.tensor([[[1.0, 2.0, 4.0, 10.0]]])   # one KV head, group of 3
    assert torch.allclose(channel_scores(q_hat, kmax), torch.tensor([[[0.0, 2.0, 0.0, 2 / 3]]]), atol=1e-6)
    assert torch.allclose(channel_scores(q_hat, kmax, "paper"), channel_scores(q_hat, kmax))
    assert torch.allclose(channel_scores(q_hat, kmax, "max"), torch.tensor([[[2.0, 6.0, 2.0, 2.0]]]))
    l2 = torch.tensor([[[math.sqrt(6) * 1, math.sqrt(11) * 2, math.sqrt(0.5) * 4, 0.2 * 10]]])
    assert torch.allclose(channel_scores(q_hat, kmax, "l2"), l2, atol=1e-5)


def test_bf16_inputs_give_fp32_scores():
    q, k = _data(3, torch.bfloat16)
    chans = topk_channels(channel_scores(q, k.abs().amax(2).float(), "max"), 4)
    s = head_scores(q, _rows(k, chans), chans)
    assert s.dtype == torch.float32 and combine_heads(s, HKV, "psum", 0.25).dtype == torch.float32


def test_unknown_rules_are_one_clear_error():
    q, k = _data()
    with pytest.raises(ValueError, match="unknown channel rule 'mean': use paper, max, l2"):
        channel_scores(q, k.abs().amax(2), "mean")
    with pytest.raises(ValueError, match="unknown select rule 'max': use sum, lse, psum"):
        combine_heads(torch.zeros(B, HQ, N), HKV, "max")


def test_approx_scores_lse_rule_and_end_mask_equal_the_two_step_path():
    q, k = _data(3)
    chans = topk_channels(channel_scores(q, k.abs().amax(2)), 6)
    rows = _rows(k, chans)
    scale = 1 / math.sqrt(D)
    want = combine_heads(head_scores(q, rows, chans), HKV, "lse", scale)
    assert torch.allclose(approx_scores(q, rows, chans, rule="lse", sm_scale=scale), want, atol=1e-5)
    end, offset = torch.tensor(30), 5  # tokens n with n + 5 >= 30 are past the scored range
    got = approx_scores(q, rows, chans, rule="lse", sm_scale=scale, end=end, offset=offset)
    assert torch.equal(torch.isinf(got), (torch.arange(N) >= 25).expand(B, HKV, N))
    assert torch.allclose(got[..., :25], want[..., :25], atol=1e-5) and (got[..., 25:] < 0).all()
    with pytest.raises(ValueError, match="psum"):
        approx_scores(q, rows, chans, rule="psum")


def test_topk_tokens_reference_adds_the_offset_and_fills_out():
    scores = torch.tensor([[[0.5, 3.0, -1.0, 2.0, 7.0]]])
    out = torch.empty(1, 1, 2, dtype=torch.int64)
    assert topk_tokens(scores, 2, 10, out) is out
    assert sorted(out.flatten().tolist()) == [11, 14] and sorted(topk_tokens(scores, 2).flatten().tolist()) == [1, 4]


def test_combine_heads_lse_equals_torch_logsumexp_with_masked_tokens():
    """The lse rule is written out (max, exp, sum, log): it must equal torch.logsumexp, tokens that every head or
    one head masks (-inf) included, with no NaN."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(B, HQ, N, generator=g) * 20
    s[0, :G, :4] = float("-inf")   # a token the whole first group masks
    s[1, 0, 9] = float("-inf")     # a token one head masks
    got = combine_heads(s, HKV, "lse", 0.25)
    want = torch.logsumexp(s.reshape(B, HKV, G, N) * 0.25, 2)
    assert not torch.isnan(got).any()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.allclose(got[torch.isfinite(want)], want[torch.isfinite(want)], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("rule", ["sum", "lse", "psum"])
def test_sketch_scores_reference_equals_the_logits_over_dequantized_keys(bits, rule):
    """The sketch layout (packed per token) dequantizes as the keys' layout does; scores past `end` are -inf
    and never NaN; each combine rule as brute force in float64."""
    from tailorkv.ops.quant import dequantize_keys, quantize_keys, quantize_sketch
    from tailorkv.ops.sparse_select import sketch_scores
    g = torch.Generator().manual_seed(SEED + bits)
    n, dim, group, offset, end, scale = 320, 64, 64, 7, 250, 1 / math.sqrt(64)
    q = torch.randn(B, HQ, 1, dim, generator=g)
    k = torch.randn(B, HKV, n, dim, generator=g) * torch.linspace(0.2, 3, dim)
    got = sketch_scores(q, *quantize_sketch(k, bits, group), bits, group, torch.tensor([end]), offset, rule, scale)
    keys = dequantize_keys(*quantize_keys(k, bits, group), bits, group, torch.float32).double()
    logits = torch.stack([keys[:, h // G] @ q[:, h, 0].double()[:, :, None] for h in range(HQ)], 1)[..., 0] * scale
    logits[..., torch.arange(n) + offset >= end] = float("-inf")                       # [B, Hq, n]
    heads = logits.reshape(B, HKV, G, n)
    want = {"sum": heads.sum(2), "lse": torch.logsumexp(heads, 2),
            "psum": torch.softmax(heads, -1).sum(2)}[rule]
    live = torch.arange(n) + offset < end
    assert not got.isnan().any()
    if rule == "psum":
        assert torch.equal(got[..., ~live], torch.zeros_like(got[..., ~live]))
    else:
        assert torch.isneginf(got[..., ~live]).all()
    assert (got[..., live].double() - want[..., live]).abs().max() <= 1e-5 * want[..., live].abs().max()

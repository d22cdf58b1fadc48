"""TailorKV's token selection for sparsity-friendly layers, as torch references (fp32 math).

GQA: query head h belongs to KV head h // G (G = Hq // Hkv), so q [B, Hq, 1, D] is viewed as [B, Hkv, G, D].
1. channel_scores: per KV head and channel, how much it can move the group's logits -> [B, Hkv, D]
   ("paper": |mean over the group of q_hat| * max|K|; "max": max over the group of |q_hat_h| * max|K|;
   "l2": the group's L2 norm of q_hat * max|K|)
2. topk_channels:  the r best channels per KV head              -> [B, Hkv, r]
3. scoring over those r channels only:
   approx_scores:  q . K summed over the group (the paper's rule), or its lse, in one pass -> [B, Hkv, N]
   head_scores:    q_h . K per query head                          -> [B, Hq, N]
   combine_heads:  one score per KV head from its heads' scores    -> [B, Hkv, N]
   ("sum": summed logits = approx_scores; "lse": logsumexp of the heads' scaled logits; "psum": sum of the
   heads' softmax probabilities over the N tokens)
4. topk_tokens:    the K best tokens per KV head                 -> [B, Hkv, K]
`--select sketch` scores the whole middle instead, from a low-bit copy of K on the device:
   sketch_scores:  q . dequant(sketch) per query head, masked past `end`, combined per KV head -> [B, Hkv, N]
   (the sketch: K quantized per channel over groups of tokens, packed per token; ops/quant.py)
A CUDA kernel may replace each one through the dispatch rule (ops.dispatch); approx_scores (sum and lse) has one
in ops/sparse_select_cuda.py, topk_tokens in ops/topk_cuda.py, sketch_scores (sum and lse) in ops/sketch_scores_cuda.py.
"""
from __future__ import annotations

import torch

from tailorkv.ops import sketch_scores_cuda, sparse_select_cuda, topk_cuda
from tailorkv.ops.dispatch import op, register_kernel
from tailorkv.ops.quant import dequantize_sketch
from tailorkv.ops.quant_attention import CHUNK
from tailorkv.ops.select_rules import CHANNEL_RULES, COMBINE_RULES
from tailorkv.ops.topk_carry import TopKCarry


def _grouped(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """q [B, Hq, 1, D] -> [B, Hkv, G, D] fp32."""
    B, Hq, T, D = q.shape
    assert T == 1, "selection works on one decode query"
    return q.float().reshape(B, n_kv, Hq // n_kv, D)


@op("channel_scores")
def channel_scores(q_hat: torch.Tensor, kmax: torch.Tensor, rule: str = "paper") -> torch.Tensor:
    """q_hat [B, Hq, 1, D]; kmax [B, Hkv, D] (max |K| per KV head and channel) -> [B, Hkv, D] fp32."""
    qg = _grouped(q_hat, kmax.shape[1])
    if rule == "paper":
        q = qg.mean(2).abs()
    elif rule == "max":
        q = qg.abs().amax(2)
    elif rule == "l2":
        q = qg.square().sum(2).sqrt()
    else:
        raise ValueError(f"unknown channel rule {rule!r}: use {', '.join(CHANNEL_RULES)}")
    return q * kmax.float()


@op("topk_channels")
def topk_channels(scores: torch.Tensor, r: int) -> torch.Tensor:
    """scores [B, Hkv, D] -> channel indices [B, Hkv, r] (int64), best first."""
    return scores.topk(min(r, scores.shape[-1]), dim=-1).indices


@op("approx_scores")
def approx_scores(q: torch.Tensor, kt_rows: torch.Tensor, channels: torch.Tensor,
                  out: torch.Tensor | None = None, rule: str = "sum", sm_scale: float = 1.0,
                  end: torch.Tensor | None = None, offset: int = 0) -> torch.Tensor:
    """q [B, Hq, 1, D]; kt_rows [B, Hkv, r, N] (rows of K^T for `channels`, N tokens); channels [B, Hkv, r]
    -> [B, Hkv, N] fp32, one score per KV head and token from the group's logits q_h[channels] . K^T[channels]:
    rule "sum" (the paper's) their sum = (sum over the group of q[channels]) . K^T[channels]; "lse" the
    logsumexp of sm_scale * logits (combine_heads). end: a one-element int64 tensor; tokens n with
    n + offset >= end score -inf (past the scored range). With `out` ([B, Hkv, N] fp32) the scores are written
    there and `out` is returned."""
    if rule == "sum":
        qg = _grouped(q, kt_rows.shape[1])                                # [B, Hkv, G, D]
        idx = channels[:, :, None, :].expand(-1, -1, qg.shape[2], -1)
        qsum = qg.gather(3, idx).sum(2)                                   # [B, Hkv, r]
        scores = (qsum[:, :, None, :] @ kt_rows.float()).squeeze(2)
    elif rule == "lse":
        scores = combine_heads(head_scores(q, kt_rows, channels), kt_rows.shape[1], "lse", sm_scale)
    else:
        raise ValueError(f"approx_scores: rule {rule!r} is not sum or lse (psum: head_scores + combine_heads)")
    if end is not None:
        n = torch.arange(kt_rows.shape[-1], device=scores.device) + offset
        scores = scores.masked_fill(n >= end.reshape(()).to(scores.device), float("-inf"))
    if out is None:
        return scores
    if out.shape != scores.shape or out.dtype != torch.float32:
        raise ValueError(f"approx_scores: out is {tuple(out.shape)} {out.dtype}, expected {tuple(scores.shape)} "
                         f"torch.float32")
    return out.copy_(scores)


@op("head_scores")
def head_scores(q: torch.Tensor, kt_rows: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, 1, D]; kt_rows [B, Hkv, r, N]; channels [B, Hkv, r] -> [B, Hq, N] fp32: for query head h,
    q_h[channels] . K^T[channels] over the rows of its KV head h // G (unscaled logits)."""
    B, Hq = q.shape[:2]
    qg = _grouped(q, kt_rows.shape[1])                                    # [B, Hkv, G, D]
    idx = channels[:, :, None, :].expand(-1, -1, qg.shape[2], -1)
    return (qg.gather(3, idx) @ kt_rows.float()).reshape(B, Hq, -1)      # [B, Hkv, G, N] -> [B, Hq, N]


@op("combine_heads")
def combine_heads(scores: torch.Tensor, n_kv: int, rule: str = "lse", sm_scale: float = 1.0) -> torch.Tensor:
    """scores [B, Hq, N] (head_scores' logits) -> [B, Hkv, N] fp32, one score per KV head and token, from the
    G = Hq // n_kv heads of its group: "sum" the logits (the paper's rule; equals approx_scores); "lse"
    logsumexp of sm_scale * logits (a token one head wants stays high); "psum" the sum over the heads of
    softmax(sm_scale * logits) over the N tokens (each head's probability mass)."""
    B, Hq, N = scores.shape
    s = scores.float().reshape(B, n_kv, Hq // n_kv, N)
    if rule == "sum":
        return s.sum(2)
    if rule == "lse":  # as torch.logsumexp(x, 2), whose reduction over a strided dim is slower on a CPU
        x = s * sm_scale
        m = x.amax(2)
        m = m.masked_fill(m == float("-inf"), 0.0)
        return (x - m[:, :, None]).exp_().sum(2).log_().add_(m)
    if rule == "psum":
        return torch.softmax(s * sm_scale, -1).sum(2)
    raise ValueError(f"unknown select rule {rule!r}: use {', '.join(COMBINE_RULES)}")


@op("sketch_scores")
def sketch_scores(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_min: torch.Tensor, bits: int,
                  group: int, end: torch.Tensor, offset: int = 0, rule: str = "lse",
                  sm_scale: float = 1.0, carry: TopKCarry | None = None,
                  blocks_per_sm: float | None = None) -> torch.Tensor:
    """q [B, Hq, 1, D] over a key sketch (ops/quant.py's quantize_sketch layout, N = k_codes.shape[2] tokens)
    -> [B, Hkv, N] fp32: the scaled logits sm_scale * q_h . dequant(K), -inf where n + offset >= end (a
    one-element int64 tensor), combined over each KV head's query heads by `rule` (combine_heads with sm_scale 1:
    the logits are scaled). `carry` (ops/topk_carry.py) only lets the kernel list tokens for topk_tokens'.
    blocks_per_sm: the kernel's grid (None: a full wave; fewer leave more of each SM to kernels on other streams);
    no effect here."""
    B, Hkv, N = k_codes.shape[:3]
    qg = _grouped(q, Hkv) * sm_scale                                                  # [B, Hkv, G, D]
    logits = torch.empty(B, Hkv, qg.shape[2], N, dtype=torch.float32, device=q.device)
    for s in range(0, N, CHUNK):  # CHUNK tokens dequantized at once, a multiple of the group
        e = min(N, s + CHUNK)
        keys = dequantize_sketch(k_codes[:, :, s:e], k_scale[:, :, s // group:-(-e // group)],
                                 k_min[:, :, s // group:-(-e // group)], bits, group)
        logits[..., s:e] = qg @ keys.transpose(-1, -2)
    n = torch.arange(N, device=logits.device) + offset
    logits = logits.masked_fill(n >= end.reshape(()).to(logits.device), float("-inf"))
    return combine_heads(logits.reshape(B, -1, N), Hkv, rule)


@op("topk_tokens")
def topk_tokens(scores: torch.Tensor, k: int, offset: int = 0, out: torch.Tensor | None = None,
                carry: TopKCarry | None = None) -> torch.Tensor:
    """scores [B, Hkv, N] -> token indices [B, Hkv, min(k, N)] (int64, offset + the index in the scored range),
    in no promised order (this reference: torch's unsorted top-k, 2.5x faster than the sorted one on a CPU for
    896 of 4k; the kernel: index order); written into `out` if given.
    `carry` (ops/topk_carry.py) only lets the kernel select among the tokens sketch_scores' kernel listed."""
    idx = scores.topk(min(k, scores.shape[-1]), dim=-1, sorted=False).indices + offset
    return idx if out is None else out.copy_(idx)


register_kernel("approx_scores", lambda: sparse_select_cuda.load_approx_scores(approx_scores.fallback))
register_kernel("sketch_scores", lambda: sketch_scores_cuda.load(sketch_scores.fallback))
register_kernel("topk_tokens", lambda: topk_cuda.load(topk_tokens.fallback))

"""TailorKV's token selection for sparsity-friendly layers, as torch references (fp32 math).

GQA: query head h belongs to KV head h // G (G = Hq // Hkv), so q [B, Hq, 1, D] is viewed as [B, Hkv, G, D].
1. channel_scores: s = |mean over the group of q_hat| * max|K|  -> [B, Hkv, D]
2. topk_channels:  the r best channels per KV head              -> [B, Hkv, r]
3. approx_scores:  q . K over those r channels only, summed over the group -> [B, Hkv, N]
4. topk_tokens:    the K best tokens per KV head                 -> [B, Hkv, K]
A CUDA kernel may replace each one through the dispatch rule (ops.dispatch); approx_scores and topk_tokens
have one (ops/sparse_select_cuda.py, ops/topk_cuda.py).
"""
from __future__ import annotations

import torch

from tailorkv.ops import sparse_select_cuda, topk_cuda
from tailorkv.ops.dispatch import op, register_kernel


def _grouped(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """q [B, Hq, 1, D] -> [B, Hkv, G, D] fp32."""
    B, Hq, T, D = q.shape
    assert T == 1, "selection works on one decode query"
    return q.float().reshape(B, n_kv, Hq // n_kv, D)


@op("channel_scores")
def channel_scores(q_hat: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q_hat [B, Hq, 1, D]; kmax [B, Hkv, D] (max |K| per KV head and channel) -> [B, Hkv, D] fp32."""
    return _grouped(q_hat, kmax.shape[1]).mean(2).abs() * kmax.float()


@op("topk_channels")
def topk_channels(scores: torch.Tensor, r: int) -> torch.Tensor:
    """scores [B, Hkv, D] -> channel indices [B, Hkv, r] (int64), best first."""
    return scores.topk(min(r, scores.shape[-1]), dim=-1).indices


@op("approx_scores")
def approx_scores(q: torch.Tensor, kt_rows: torch.Tensor, channels: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, 1, D]; kt_rows [B, Hkv, r, N] (rows of K^T for `channels`, N tokens); channels [B, Hkv, r]
    -> [B, Hkv, N] fp32: sum over the query group of q[channels] . K^T[channels]. With `out` ([B, Hkv, N] fp32)
    the scores are written there and `out` is returned."""
    qg = _grouped(q, kt_rows.shape[1])                                    # [B, Hkv, G, D]
    idx = channels[:, :, None, :].expand(-1, -1, qg.shape[2], -1)
    qsum = qg.gather(3, idx).sum(2)                                       # [B, Hkv, r]
    scores = (qsum[:, :, None, :] @ kt_rows.float()).squeeze(2)
    if out is None:
        return scores
    if out.shape != scores.shape or out.dtype != torch.float32:
        raise ValueError(f"approx_scores: out is {tuple(out.shape)} {out.dtype}, expected {tuple(scores.shape)} "
                         f"torch.float32")
    return out.copy_(scores)


@op("topk_tokens")
def topk_tokens(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [B, Hkv, N] -> token indices [B, Hkv, min(k, N)] (int64, relative to the scored range)."""
    return scores.topk(min(k, scores.shape[-1]), dim=-1).indices


register_kernel("approx_scores", lambda: sparse_select_cuda.load_approx_scores(approx_scores.reference))
register_kernel("topk_tokens", lambda: topk_cuda.load(topk_tokens.reference))

"""Which middle tokens a sparse-offload layer attends to at a decode step: one replaceable object per layer
(`SparseOffloadCache.selector`), so ablations subclass it and probes wrap it instead of patching functions.

`select` runs inside the decode step (device work, static shapes for the layer's plan) and returns absolute
positions [B, Hkv, K] into the host store; the layer masks the ones past its middle (the selector may return
them when the middle is shorter than K) and gathers the K and V rows itself.
"""
from __future__ import annotations

import torch

from tailorkv.ops.host_gather import gather_rows
from tailorkv.ops.sparse_select import approx_scores, channel_scores, topk_channels, topk_tokens


class TokenSelector:
    def select(self, layer, q: torch.Tensor, q_hat: torch.Tensor | None) -> torch.Tensor:
        """q: the layer's query [B, Hq, 1, D]; q_hat: its prediction from the layer before (or None)."""
        raise NotImplementedError


class ChannelSelector(TokenSelector):
    """The paper's rule: channel scores |mean over the GQA group of q_hat| * max|K| pick r channels per KV head;
    their K^T rows over the middle come from host memory; approximate scores of the current query over those
    channels, summed over the group, pick the top-K tokens per KV head. A middle of at most K tokens is taken
    whole (no scoring)."""

    def select(self, layer, q, q_hat):
        lo, n, k = layer.sink, layer.middle_bucket, layer.topk
        dev = q.device
        if layer.middle_whole:
            pos = torch.arange(lo, lo + k, device=dev).clamp_max(layer.spec.max_len - 1)
            return pos.expand(q.shape[0], layer.spec.n_kv_heads, k)
        chans = self.channels(layer, q if q_hat is None else q_hat)
        rows = gather_rows(layer.host_kt[:, :, :, lo:lo + n], chans, dev, out=layer.buffer("kt_rows"))  # [B,Hkv,r,n]
        scores = approx_scores(q, rows, chans, out=layer.buffer("scores"))
        scores = scores.masked_fill(torch.arange(lo, lo + n, device=dev) >= layer.tail_start_dev, float("-inf"))
        return topk_tokens(scores, k) + lo

    def channels(self, layer, q_sel):
        """The r channels per KV head [B, Hkv, r] whose K^T rows are fetched, from the query q_sel."""
        return topk_channels(channel_scores(q_sel, layer.kmax), layer.r)


class ObservedSelector(TokenSelector):
    """Wraps a selector and hands every selection to `observe(layer, q, positions)` (probes, tests)."""

    def __init__(self, inner: TokenSelector, observe):
        self.inner, self.observe = inner, observe

    def select(self, layer, q, q_hat):
        pos = self.inner.select(layer, q, q_hat)
        self.observe(layer, q, pos)
        return pos

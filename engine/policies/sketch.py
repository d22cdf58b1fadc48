"""`--select sketch`: beyond the paper, a sparse layer keeps a low-bit copy of its middle keys on the device and
scores every channel of it, so only the chosen tokens' K and V rows cross PCIe (the paper's path fetches r rows
of K^T over the whole middle at every step).

The sketch is the KIVI key layout of ops/quant.py (per channel, groups of `group` tokens along time, fp16 scale
and min, codes packed into int32 words) over positions sink, sink + 1, ... of the middle; the layer keeps its
middle a whole number of groups long (SparseOffloadCache.align), so every sketched group is complete.
At a decode step the query's scores over the sketch come from the 1/2-bit attention kernel (`qk_quant`), the
heads of a GQA group are combined by the layer's rule, and the top-K positions are taken, less as many as the
tail holds prompt tokens beyond `recent` (the remainder of the last group, up to group - 1 tokens, stays exact
in the tail), so the sketch attends as many tokens as the paper's path; nothing is fetched before the layer's
own query exists.
"""
from __future__ import annotations

import torch

from tailorkv.engine.policies.selection import TokenSelector
from tailorkv.ops.attention import softmax_scale
from tailorkv.ops.quant import codes_per_word, quantize_keys
from tailorkv.ops.quant_attention import qk_quant
from tailorkv.ops.sparse_select import combine_heads, topk_tokens


class KeySketch:
    def __init__(self, spec, bits: int, group: int, capacity: int):
        self.bits, self.group = bits, group
        cpw = codes_per_word(bits)
        n = capacity // group * group
        B, H, D, dev = spec.batch, spec.n_kv_heads, spec.head_dim, spec.device
        self.codes = torch.zeros(B, H, n // cpw, D, dtype=torch.int32, device=dev)
        self.scale = torch.zeros(B, H, n // group, D, dtype=torch.float16, device=dev)
        self.min = torch.zeros_like(self.scale)
        self.capacity = n
        self.n = 0  # tokens sketched (a multiple of group)

    def reset(self) -> None:
        self.n = 0

    def append(self, k: torch.Tensor) -> None:
        """k [B, H, m, D] on the device, m a multiple of group: the next m middle tokens."""
        m = k.shape[2]
        if not m:
            return
        cpw, g, a = codes_per_word(self.bits), self.group, self.n
        codes, scale, mn = quantize_keys(k, self.bits, g)
        self.codes[:, :, a // cpw:(a + m) // cpw] = codes
        self.scale[:, :, a // g:(a + m) // g] = scale
        self.min[:, :, a // g:(a + m) // g] = mn
        self.n += m

    def logits(self, q: torch.Tensor, n: int) -> torch.Tensor:
        """q [B, Hq, 1, D] -> [B, Hq, n] fp32 scaled logits over the first n sketched positions (n a multiple of
        the group; positions past self.n hold stale data: the caller masks them)."""
        cpw, g = codes_per_word(self.bits), self.group
        s = qk_quant(q, self.codes[:, :, :n // cpw], self.scale[:, :, :n // g], self.min[:, :, :n // g],
                     self.bits, g, sm_scale=softmax_scale(q.shape[-1]))
        return s[:, :, 0]

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.min))


class SketchSelector(TokenSelector):
    def __init__(self, rule: str = "lse"):
        self.rule = rule

    def select(self, layer, q):
        lo, n, k = layer.sink, layer.middle_bucket, layer.topk
        if layer.middle_whole:
            return layer.whole_middle(q)
        logits = layer.sketch.logits(q, n)
        valid = torch.arange(lo, lo + n, device=q.device) < layer.tail_start_dev
        scores = combine_heads(logits.masked_fill(~valid, float("-inf")), layer.spec.n_kv_heads, self.rule)
        idx = topk_tokens(scores, k)  # the logits are scaled already: combine_heads' sm_scale stays 1
        # the tail's extra prompt tokens (layer.extra_dev) replace the lowest-scored of the K: position -1
        # lies outside the middle, so the attention skips it
        order = scores.gather(-1, idx).argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(k, device=q.device).expand_as(order))
        return torch.where(rank < k - layer.extra_dev, idx + lo, -1)

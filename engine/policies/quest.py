"""`quest`: query-aware page selection (Quest, Tang et al. 2024). The whole KV stays on the device, as in
`full`, plus, per page of `settings.page` tokens, the per-channel min and max of the keys (updated as tokens
arrive: the pages a step touches are recomputed from the stored keys).

Decode (one token): each page gets an upper bound of q . k (ops/page_select.py; per KV head the max over its
GQA group); the last, possibly partial, page is always kept and the top-scoring other pages fill the rest of
`settings.budget` in whole pages; attention is exact over the chosen pages' tokens. While the context fits in
the budget, decode attends over everything (equals `full`). Prefill and any multi-token step attend densely.
Quest itself leaves the first two layers dense; here every layer of the method uses pages.
With `settings.free_generated` the budget counts the prompt's tokens only (those of multi-token steps): the
pages are chosen within the prompt and every token decoded since is attended on top.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tailorkv.engine.cache import LayerCache, LayerSpec
from tailorkv.engine.settings import MethodSettings
from tailorkv.ops.attention import attention_with_mask, causal_attention
from tailorkv.ops.page_select import page_scores, select_pages, tokens_selected


class QuestCache(LayerCache):
    name = "quest"
    selects_tokens = True

    def __init__(self, spec: LayerSpec, settings: MethodSettings):
        super().__init__(spec)
        self.page, self.budget = settings.page, settings.budget
        B, H, D, dev, dt = spec.batch, spec.n_kv_heads, spec.head_dim, spec.device, spec.dtype
        self.k = torch.zeros(B, H, spec.max_len, D, dtype=dt, device=dev)
        self.v = torch.zeros_like(self.k)
        n_pages = math.ceil(spec.max_len / self.page)
        self.kmin = torch.zeros(B, H, n_pages, D, dtype=dt, device=dev)
        self.kmax = torch.zeros_like(self.kmin)
        self.selected: torch.Tensor | None = None  # token indices of the last sparse step (tests, debugging)
        self.free_generated = settings.free_generated
        self.prompt_end = 0  # end of the last multi-token step: tokens past it were decoded

    def _paged(self, end: int) -> int:
        """How many tokens from the start the pages are chosen among at a decode step ending at `end`."""
        return min(end, self.prompt_end) if self.free_generated else end

    def plan(self, step):
        end, paged = step.end, self._paged(step.end)
        if step.decode and paged > self.budget:
            n = tokens_selected(paged, self.page, self.budget)
            self.last = {"tokens_attended": n + end - paged, "pages_selected": math.ceil(n / self.page)}
        else:
            self.last = {"tokens_attended": end}
        return None

    def run(self, q, k, v, step):
        """Eager only (the number of pages grows with the length)."""
        start, end = step.start, step.end
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self._update_pages(start, end)
        paged = self._paged(end)
        if not step.decode or paged <= self.budget:
            return causal_attention(q, self.k[:, :, :end], self.v[:, :, :end], start)
        n_pages = math.ceil(paged / self.page)
        scores = page_scores(q[:, :, 0], self.kmin[:, :, :n_pages], self.kmax[:, :, :n_pages])
        idx = select_pages(scores, paged, self.page, self.budget)            # [B, H, n]
        if paged < end:  # the decoded tokens, on top of the prompt's pages
            idx = torch.cat([idx, torch.arange(paged, end, device=idx.device).expand(*idx.shape[:2], -1)], -1)
        gather = idx.unsqueeze(-1).expand(-1, -1, -1, self.spec.head_dim)
        ks = self.k.gather(2, gather)
        vs = self.v.gather(2, gather)
        self.selected = idx
        return attention_with_mask(q, ks, vs)

    def _update_pages(self, start: int, end: int) -> None:
        """Recompute min/max of the pages that hold tokens [start, end) from the stored keys."""
        p0, p1 = start // self.page, math.ceil(end / self.page)
        seg = self.k[:, :, p0 * self.page:end]
        pad = p1 * self.page - end
        shape = (*seg.shape[:2], p1 - p0, self.page, seg.shape[3])
        self.kmin[:, :, p0:p1] = F.pad(seg, (0, 0, 0, pad), value=float("inf")).reshape(shape).amin(3)
        self.kmax[:, :, p0:p1] = F.pad(seg, (0, 0, 0, pad), value=float("-inf")).reshape(shape).amax(3)

    def commit(self, step) -> None:
        if not step.decode:
            self.prompt_end = step.end

    def reset(self) -> None:
        super().reset()
        self.selected = None
        self.prompt_end = 0

    def abort(self, step) -> None:
        pass  # keys written past the length are never read; their pages are recomputed when rewritten

    def truncate(self, length: int) -> None:
        self.prompt_end = min(self.prompt_end, length)
        if length % self.page:  # the new last page is partial: drop the forgotten keys from its bounds
            self._update_pages(length - length % self.page, length)

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.kmin, self.kmax))

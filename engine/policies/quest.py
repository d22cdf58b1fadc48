"""`quest`: query-aware page selection (Quest, Tang et al. 2024). The whole KV stays on the device, as in
`full`, plus, per page of `settings.page` tokens, the per-channel min and max of the keys (updated as tokens
arrive: the pages a step touches are recomputed from the stored keys).

Decode (one token): each page gets an upper bound of q . k (ops/page_select.py; per KV head the max over its
GQA group); the last, possibly partial, page is always kept and the top-scoring other pages fill the rest of
`settings.budget` in whole pages; attention is exact over the chosen pages' tokens. While the context fits in
the budget, decode attends over everything (equals `full`). Prefill and any multi-token step attend densely.
Quest itself leaves the first two layers dense; here every layer of the method uses pages.

A decode step is graph-safe (CUDA graphs on a GPU): plan picks the regime on the host (dense while the context
fits in the budget, else sparse: part of the step key); run reads the length from `step.lengths` only. Sparse,
the shapes are fixed by the bucket: the pages covering it are scored (the last page and those after it out),
a top-k of the most whole pages a step can ever choose, of which the first n_top count, then a fixed number of
token slots (those top pages, then the last page's tokens), of which attend_decode reads the first n.

With `settings.free_generated` the budget counts the prompt's tokens only (those of multi-token steps): the
pages are chosen within the prompt and every token decoded since is attended on top. That mode decodes eagerly
(its attended count grows with every token), as does every multi-token step.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tailorkv.engine.cache import LayerCache, LayerSpec
from tailorkv.engine.settings import MethodSettings
from tailorkv.ops.attention import attend_decode, attention_with_mask, causal_attention
from tailorkv.ops.kv_store import store_kv
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
        self.n_pages = math.ceil(spec.max_len / self.page)
        self.kmin = torch.zeros(B, H, self.n_pages, D, dtype=dt, device=dev)
        self.kmax = torch.zeros_like(self.kmin)
        # the token indices of the last sparse step, [B, H, n] (tests, debugging); graphed, a view of `slots`
        # that plan sets and run fills (the chosen pages in ascending order, then the last page's tokens)
        self.selected: torch.Tensor | None = None
        self.free_generated = settings.free_generated
        self.graph_safe = not self.free_generated
        self.prompt_end = 0  # end of the last multi-token step: tokens past it were decoded
        self.top_max = min((self.budget - 1) // self.page, self.n_pages - 1)  # whole pages a step may choose
        self.slots = torch.zeros(B, H, (self.top_max + 1) * self.page, dtype=torch.long, device=dev)
        self.ar = torch.arange(max(self.slots.shape[-1], self.n_pages), device=dev)
        self.sparse = False  # the regime plan chose for the step at hand

    def _paged(self, end: int) -> int:
        """How many tokens from the start the pages are chosen among at a decode step ending at `end`."""
        return min(end, self.prompt_end) if self.free_generated else end

    def plan(self, step):
        end, paged = step.end, self._paged(step.end)
        self.sparse = step.decode and paged > self.budget
        if self.sparse:
            n = tokens_selected(paged, self.page, self.budget)
            self.last = {"tokens_attended": n + end - paged, "pages_selected": math.ceil(n / self.page)}
            if self.graph_safe:
                self.selected = self.slots[..., :n]
        else:
            self.last = {"tokens_attended": end}
        return ("sparse",) if self.sparse else ("dense",)

    def run(self, q, k, v, step):
        if step.decode and self.graph_safe:
            return self._decode(q, k, v, step)
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

    def _decode(self, q, k, v, step):
        """A decode step, graph-safe: device work only, shapes fixed by the bucket and the regime, idempotent."""
        store_kv(self.k, self.v, step.positions, k, v)
        self._bound_page(step.positions)
        if not self.sparse:
            n = step.bucket  # static for the graph; attend_decode reads only the first position + 1 slots
            return attend_decode(q, self.k[:, :, :n], self.v[:, :, :n], step.lengths)
        page, length = self.page, step.lengths                           # [1]: the tokens held after the step
        last = (length - 1) // page                                      # the last page, always attended ...
        last_count = length - last * page                                # ... with its tokens
        n_top = torch.minimum(last, (self.budget - last_count) // page).clamp_(min=0)  # whole top pages
        n_pages = min(math.ceil(step.bucket / page), self.n_pages)
        top = min(self.top_max, n_pages - 1)  # k of the top-k: n_top <= top at every length of the bucket
        S = (top + 1) * page
        j = self.ar[:S]
        first_last = n_top * page                                        # slot of the last page's first token
        in_last = last * page + torch.minimum(j - first_last, last_count - 1)  # past n: a held token, unread
        if top:
            scores = page_scores(q[:, :, 0], self.kmin[:, :, :n_pages], self.kmax[:, :, :n_pages])
            scores = scores.masked_fill(self.ar[:n_pages] >= last, float("-inf"))
            pages = scores.topk(top, -1).indices                        # [B, H, top], best first
            pages = pages.masked_fill(self.ar[:top] >= n_top, self.n_pages).sort(-1).values  # chosen, ascending
            in_top = pages.gather(-1, (j // page).clamp(max=top - 1).expand(*pages.shape[:2], S)) * page + j % page
            in_last = torch.where(j < first_last, in_top, in_last)
        self.slots[..., :S].copy_(in_last.expand(*self.slots.shape[:2], S))
        gather = self.slots[..., :S, None].expand(-1, -1, -1, self.spec.head_dim)
        ks, vs = self.k.gather(2, gather), self.v.gather(2, gather)
        return attend_decode(q, ks, vs, first_last + last_count)

    def _bound_page(self, position: torch.Tensor) -> None:
        """Recompute the min/max of the page holding `position` ([1] on the device) from its stored keys up to
        the position (the slots after it left out): exact, and the same however often it runs."""
        page = self.page
        first = position - position % page
        offs = self.ar[:page]
        seg = self.k.index_select(2, (first + offs).clamp_(max=self.spec.max_len - 1))  # [B, H, page, D]
        out = (offs > position - first)[:, None]
        idx = first // page
        self.kmin.index_copy_(2, idx, seg.masked_fill(out, float("inf")).amin(2, keepdim=True))
        self.kmax.index_copy_(2, idx, seg.masked_fill(out, float("-inf")).amax(2, keepdim=True))

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
        # a step writes its tokens' slots and the bounds of their pages, recomputed from the stored keys up to the
        # step's tokens: a later step rewrites those slots and recomputes those pages before they are read
        pass

    def truncate(self, length: int) -> None:
        self.prompt_end = min(self.prompt_end, length)
        if length % self.page:  # the new last page is partial: drop the forgotten keys from its bounds
            self._update_pages(length - length % self.page, length)

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.kmin, self.kmax, self.slots))

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
topk_tokens takes the most whole pages a step can ever choose (the lowest-scoring one dropped where this length's
budget has room for one fewer: plan says so), and sparse_decode_attention reads those pages' rows and the last
page's straight from the store (positions past the new token are not read): no gather, no per-step host ints.

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
from tailorkv.ops.attention import attend_decode, attention_with_mask, causal_attention, sparse_decode_attention
from tailorkv.ops.kv_store import store_kv
from tailorkv.ops.page_select import bound_page, page_scores, page_slots, select_pages, tokens_selected
from tailorkv.ops.sparse_select import topk_tokens


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
        self._selected: torch.Tensor | None = None  # eager steps' `selected`
        self.free_generated = settings.free_generated
        self.graph_safe = not self.free_generated
        self.prompt_end = 0  # end of the last multi-token step: tokens past it were decoded
        # a sparse decode step takes the top `top` pages by score (the most whole pages a step may choose; `drop`:
        # this step's budget leaves room for one fewer) and the last page
        self.top = min((self.budget - 1) // self.page, self.n_pages - 1)
        self.slots = torch.zeros(B, H, (self.top + 1) * self.page, dtype=torch.long, device=dev)
        self.sparse, self.drop = False, False  # the regime plan chose for the step at hand
        self._end = 0

    def _paged(self, end: int) -> int:
        """How many tokens from the start the pages are chosen among at a decode step ending at `end`."""
        return min(end, self.prompt_end) if self.free_generated else end

    def plan(self, step):
        end, paged = step.end, self._paged(step.end)
        self.sparse = step.decode and paged > self.budget
        if self.sparse:
            n = tokens_selected(paged, self.page, self.budget)
            self.last = {"tokens_attended": n + end - paged, "pages_selected": math.ceil(n / self.page)}
            self.drop = (n - (end - (end - 1) // self.page * self.page)) // self.page < self.top
            self._end = end
        else:
            self.last = {"tokens_attended": end}
        return ("sparse", self.drop) if self.sparse else ("dense",)

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
        self._selected = idx
        return attention_with_mask(q, ks, vs)

    @property
    def selected(self) -> torch.Tensor | None:
        """The positions the last sparse decode step attended, [B, H, n] ascending: the chosen pages', then the last
        page's (tests, debugging; a graphed step's are read back from its slots)."""
        if not (self.graph_safe and self.sparse):
            return self._selected
        return self.slots.sort(-1).values[..., :self.last["tokens_attended"]]

    def _decode(self, q, k, v, step):
        """A decode step, graph-safe: device work only, shapes fixed by the bucket and the regime, idempotent."""
        store_kv(self.k, self.v, step.positions, k, v)
        bound_page(self.k, self.kmin, self.kmax, step.positions, self.page)
        if not self.sparse:
            n = step.bucket  # static for the graph; attend_decode reads only the first position + 1 slots
            return attend_decode(q, self.k[:, :, :n], self.v[:, :, :n], step.lengths)
        tokens = self._choose(q, step)  # rows of the store, read inside the attention (a position >= the length: not)
        empty = self.k[:, :, :0]
        return sparse_decode_attention(q, empty, self.v[:, :, :0], self.k, self.v, tokens, step.positions,
                                       step.lengths.reshape(()), 0)

    def _choose(self, q, step) -> torch.Tensor:
        """The positions a sparse step attends, into `slots` [B, H, (top + 1) * page]: the top pages' tokens (in
        no order), then the last page's. The last page's slots past the new token, and the tokens of the page that
        a top-k of one page too many dropped, hold positions the attention does not read."""
        page, length = self.page, step.lengths                           # [1]: the tokens held after the step
        scores = pages = self.slots[..., :0]                             # no top pages: the last page only
        if self.top:
            n_pages = min(math.ceil(step.bucket / page), self.n_pages)
            scores = page_scores(q[:, :, 0], self.kmin[:, :, :n_pages], self.kmax[:, :, :n_pages], length, page)
            pages = topk_tokens(scores, self.top)                        # [B, H, top]
        # the budget may have room for one whole page fewer at this length (plan says so): the lowest-scoring goes
        return page_slots(pages, scores, length, page, self.drop, self.n_pages, self.slots)

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
        self._selected, self.sparse = None, False
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

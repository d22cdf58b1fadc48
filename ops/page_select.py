"""Quest page scoring and selection (torch references).

A page is `page` consecutive tokens. For each (batch, KV head, page, channel) the cache keeps the min and max
of the page's (post-RoPE) keys. Since min_d <= k_d <= max_d, every term q_d * k_d <= max(q_d * min_d,
q_d * max_d), so

    bound(q, page) = sum_d max(q_d * min_d, q_d * max_d) >= q . k   for every key k in the page.

With q+ = max(q, 0) and q- = min(q, 0) the bound is q+ . max + q- . min: two small matmuls, no [.., P, D]
temporary.

GQA: the query heads of one KV head share that head's selected pages, so a page's score per KV head is the
MAX of its bounds over the group's query heads (a page is kept if any head of the group may need it; the max
stays an upper bound of every group head's q . k in the page).
"""
from __future__ import annotations

import math

import torch

from tailorkv.ops import page_select_cuda
from tailorkv.ops.dispatch import op, register_kernel


def page_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, D], kmin/kmax [B, Hkv, P, D] -> fp32 [B, Hq, P]: the upper bound of q . k over each page."""
    B, Hq, D = q.shape
    H, P = kmin.shape[1], kmin.shape[2]
    qg = q.float().reshape(B, H, Hq // H, D)
    pos, neg = qg.clamp(min=0), qg.clamp(max=0)
    bound = pos @ kmax.float().transpose(-1, -2) + neg @ kmin.float().transpose(-1, -2)  # [B, H, G, P]
    return bound.reshape(B, Hq, P)


@op("quest_page_scores")
def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, length: torch.Tensor | None = None,
                page: int = 1) -> torch.Tensor:
    """q [B, Hq, D], kmin/kmax [B, Hkv, P, D] -> fp32 [B, Hkv, P]: per KV head, the max over its GQA group of
    the page bounds. With `length` ([1] int64, the tokens held; pages of `page` tokens): the page holding
    position length - 1 and those after it score -inf (out of the top pages; no host read)."""
    B, Hq, _ = q.shape
    H, P = kmin.shape[1], kmin.shape[2]
    scores = page_bounds(q, kmin, kmax).reshape(B, H, Hq // H, P).amax(2)
    if length is None:
        return scores
    return scores.masked_fill(torch.arange(P, device=scores.device) >= (length - 1) // page, float("-inf"))


@op("quest_page_slots")
def page_slots(pages: torch.Tensor, scores: torch.Tensor, length: torch.Tensor, page: int, drop: bool, none: int,
               slots: torch.Tensor) -> torch.Tensor:
    """The positions a sparse decode step attends, written into `slots` [B, H, (top + 1) * page] (long): those
    of `pages` [B, H, top] (page indices, any order) in turn, then those of the last page (holding position
    length - 1; `length` [1] int64). With `drop`, the chosen page of the lowest score in `scores` [B, H, P]
    (the first in `pages` on a tie) becomes page `none` (positions the attention does not read)."""
    if drop and pages.shape[-1]:
        pages = pages.scatter(-1, scores.gather(-1, pages).argmin(-1, keepdim=True), none)
    offs = torch.arange(page, device=slots.device)
    last = ((length - 1) // page * page + offs).expand(*slots.shape[:2], page)
    return torch.cat([(pages[..., None] * page + offs).flatten(2), last], -1, out=slots)


@op("quest_bound_page")
def bound_page(k: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, position: torch.Tensor, page: int) -> None:
    """k [B, H, N, D]: the stored keys; kmin/kmax [B, H, ceil(N / page), D]; position [1] int64 on k's device ->
    the min and max of the page holding `position` recomputed from its keys up to the position (the slots after
    it left out), in place: exact, and the same however often it runs. No host reads."""
    first = position - position % page
    offs = torch.arange(page, device=k.device)
    seg = k.index_select(2, (first + offs).clamp_(max=k.shape[2] - 1))  # [B, H, page, D]
    out = (offs > position - first)[:, None]
    idx = first // page
    kmin.index_copy_(2, idx, seg.masked_fill(out, float("inf")).amin(2, keepdim=True))
    kmax.index_copy_(2, idx, seg.masked_fill(out, float("-inf")).amax(2, keepdim=True))


register_kernel("quest_page_scores", lambda: page_select_cuda.load(page_scores.fallback))
register_kernel("quest_bound_page", lambda: page_select_cuda.load_bound_page(bound_page.fallback))
register_kernel("quest_page_slots", lambda: page_select_cuda.load_page_slots(page_slots.fallback))


def pages_selected(length: int, page: int, budget: int) -> tuple[int, int]:
    """(whole top pages chosen besides the last one, tokens of the last page) for select_pages."""
    last = math.ceil(length / page) - 1
    last_count = length - last * page
    return max(0, min(last, (budget - last_count) // page)), last_count


def tokens_selected(length: int, page: int, budget: int) -> int:
    n_top, last_count = pages_selected(length, page, budget)
    return n_top * page + last_count


def select_pages(scores: torch.Tensor, length: int, page: int, budget: int) -> torch.Tensor:
    """Token indices to attend for each (batch, KV head): the last (possibly partial) page always, plus the
    highest-scoring other pages, as many whole pages as fit so that the total stays <= budget.

    scores [B, H, P] with P = ceil(length / page). Returns long [B, H, n], pages in ascending order,
    n = n_top * page + (length - (P - 1) * page)."""
    B, H, P = scores.shape
    last = P - 1
    n_top, last_count = pages_selected(length, page, budget)
    top = scores[..., :last].topk(n_top, dim=-1).indices.sort(-1).values            # [B, H, n_top]
    offs = torch.arange(page, device=scores.device)
    idx_top = (top.unsqueeze(-1) * page + offs).reshape(B, H, n_top * page)
    idx_last = torch.arange(last * page, length, device=scores.device).expand(B, H, last_count)
    return torch.cat([idx_top, idx_last], -1)

"""Keep a device cache of host rows current for a new selection: sketch-ahead gathers each step's top-K K/V rows
from pinned host memory, and with real weights most of them were chosen the step before too (SmolLM2-135M: over
real text at 4k on the CPU, 71% of a layer's picks; at 8k on the H200, 81%), so only the rows not held already
cross PCIe. With random weights at long context they hardly repeat (Llama-3.1-8B shape at 128k: 1%).

The CUDA kernel (ops/row_cache_cuda.py) reads the new rows zero-copy over PCIe (UVA), with device indices: no
sync, graph-capturable. This reference does the same assignment with torch ops (no sync either) and then gathers
every slot's row again (gather_rows), which is the same result.
"""
from __future__ import annotations

import torch

from tailorkv.ops import row_cache_cuda
from tailorkv.ops.dispatch import op, register_kernel
from tailorkv.ops.host_gather import gather_rows


@op("refresh_rows")
def refresh_rows(host: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, lo: int, n: int,
                 counts: torch.Tensor | None = None) -> None:
    """host [B, H, N, X] (unit stride along X); pos [B, H, K] int64: the new selection, distinct positions in
    [lo, lo + n); slots [B, H, K] int64: the position each cached row holds (-1: none), and rows [B, H, K, X]
    (host's dtype, on pos' device): those rows. Afterwards slots holds exactly pos' positions and rows[s] is host
    row slots[s]. Per (b, h): a slot whose position is chosen again keeps it and its row; the chosen positions not
    held yet, ascending, go to the other slots, ascending. counts (int64 [2], if given) grows by the rows read
    from host and by the rows selected (B * H * K)."""
    B, H, K = pos.shape
    p, s = pos.reshape(B * H, K), slots.reshape(B * H, K)
    ps = p.sort(-1).values
    at = torch.searchsorted(ps, s).clamp_max(K - 1)
    kept = (ps.gather(1, at) == s) & (s >= lo) & (s < lo + n)
    held = torch.zeros_like(ps).scatter_reduce_(1, at, kept.long(), "amax").bool()     # chosen and kept, by rank
    new_first = torch.argsort(held.to(torch.int8), dim=-1, stable=True)        # positions not held, ascending, first
    free_first = torch.argsort(kept.to(torch.int8), dim=-1, stable=True)       # slots not kept, ascending, first
    fetched = (~held).sum(-1, keepdim=True)
    rank = torch.arange(K, device=p.device).expand_as(p)
    value = torch.where(rank < fetched, ps.gather(1, new_first), s.gather(1, free_first))
    s.scatter_(1, free_first, value)
    if s.data_ptr() != slots.data_ptr():
        slots.copy_(s.view_as(slots))
    gather_rows(host, slots, rows.device, out=rows)
    if counts is not None:
        counts[0] += fetched.sum()
        counts[1] += B * H * K


register_kernel("refresh_rows", lambda: row_cache_cuda.load(refresh_rows.fallback))

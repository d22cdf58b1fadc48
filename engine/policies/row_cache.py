"""A sparse layer's device copy of the host rows its last selection chose: each step reads only the chosen rows it
does not hold yet from host memory (ops/row_cache.py's refresh_rows), and the step reads every chosen row here.
sketch-ahead keeps its top-K tokens' K/V rows (width 2 x head_dim); the paper's path its r channels' K^T rows over
the middle (width: the largest middle). One per layer, allocated with the layer (a CUDA graph holds its addresses)."""
from __future__ import annotations

import torch


class RowCache:
    def __init__(self, spec, k: int, width: int | None = None, dtype: torch.dtype | None = None):
        B, H = spec.batch, spec.n_kv_heads
        self.width = 2 * spec.head_dim if width is None else width
        self.rows = torch.empty(B, H, k, self.width, dtype=dtype or spec.dtype, device=spec.device)
        self.slots = torch.empty(B, H, k, dtype=torch.long, device=spec.device)        # each row's position
        self.counts = torch.zeros(2, dtype=torch.long, device=spec.device)  # rows read from host, rows selected
        self.reset()

    def reset(self) -> None:
        """Hold nothing (the host store is about to be rewritten)."""
        self.slots.fill_(-1)
        self.counts.zero_()

    def forget(self) -> None:
        """Hold nothing, counts kept (the rows' range of the host store changed)."""
        self.slots.fill_(-1)

    def view(self, n: int) -> torch.Tensor:
        """The rows as [B, H, k, n] (n <= width) over the first B * H * k * n elements: a row's width is the
        step's; a new width needs forget() first."""
        B, H, k, _ = self.rows.shape
        return self.rows.view(-1)[:B * H * k * n].view(B, H, k, n)

    @staticmethod
    def bytes_for(batch: int, heads: int, k: int, row_bytes: int) -> int:
        return batch * heads * k * (row_bytes + 8) + 16

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.rows, self.slots, self.counts))

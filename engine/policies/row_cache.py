"""A sparse layer's device copy of the host rows its last selection chose (sketch-ahead): each step reads only the
chosen rows it does not hold yet from host memory (ops/row_cache.py's refresh_rows), and the attention reads every
chosen row here. One per layer, allocated with the layer (a CUDA graph holds its addresses)."""
from __future__ import annotations

import torch


class RowCache:
    def __init__(self, spec, topk: int):
        B, H, D = spec.batch, spec.n_kv_heads, spec.head_dim
        self.rows = torch.empty(B, H, topk, 2 * D, dtype=spec.dtype, device=spec.device)   # K then V per row
        self.slots = torch.empty(B, H, topk, dtype=torch.long, device=spec.device)        # each row's position
        self.counts = torch.zeros(2, dtype=torch.long, device=spec.device)  # rows read from host, rows selected
        self.reset()

    def reset(self) -> None:
        """Hold nothing (the host store is about to be rewritten)."""
        self.slots.fill_(-1)
        self.counts.zero_()

    @staticmethod
    def bytes_for(batch: int, heads: int, head_dim: int, topk: int, dtype_bytes: int) -> int:
        return batch * heads * topk * (2 * head_dim * dtype_bytes + 8) + 16

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.rows, self.slots, self.counts))

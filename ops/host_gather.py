"""Gather rows of a host (pinned) tensor into device memory.

The CUDA kernel (ops/host_gather_cuda.py) reads the rows zero-copy over PCIe (UVA) from pinned memory with
device indices. The torch reference below indexes on the host, so it needs the indices there: with device
indices that is one device-to-host copy (a sync).
"""
from __future__ import annotations

import torch

from tailorkv.ops import host_gather_cuda
from tailorkv.ops.dispatch import op, register_kernel


@op("gather_rows")
def gather_rows(host: torch.Tensor, idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """host [B, H, N, X] (a view with unit stride along X is fine); idx [B, H, n] row indices into N
    -> [B, H, n, X] on `device`."""
    B, H, n = idx.shape
    i = idx.to(host.device, torch.int64)
    rows = host.gather(2, i[..., None].expand(B, H, n, host.shape[-1]))
    return rows.to(device)


register_kernel("gather_rows", host_gather_cuda.load)

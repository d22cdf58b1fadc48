"""Writing a step's keys and values into a cache's preallocated slots: one launch for both on the GPU (the
reference: two index_copy_)."""
from __future__ import annotations

import torch

from tailorkv.ops import kv_store_cuda
from tailorkv.ops.dispatch import op, register_kernel


@op("store_kv")
def store_kv(k_dst: torch.Tensor, v_dst: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, tail: torch.Tensor | None = None, sink: int = 0) -> None:
    """k_dst, v_dst [B, H, N, D]; slots [n] int64 on the device; k, v [B, H, n, D] (any strides) ->
    k_dst[:, :, slots[i]] = k[:, :, i] and the same for v, in place. With `tail` (a one-element int64 device
    tensor), slots are positions in a cache holding its first `sink` positions at slots 0.. and the positions from
    tail[0] on at slots sink..: slot = position if position < sink else sink + position - tail[0]."""
    if tail is not None:
        slots = torch.where(slots < sink, slots, sink + slots - tail.reshape(()))
    k_dst.index_copy_(2, slots, k)
    v_dst.index_copy_(2, slots, v)


register_kernel("store_kv", lambda: kv_store_cuda.load(store_kv.fallback))

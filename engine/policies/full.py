"""`full`: every token's K and V on the device, preallocated to max_len (no re-allocation per token)."""
from __future__ import annotations

import torch

from tailorkv.engine.cache import LayerCache, LayerSpec
from tailorkv.ops.attention import causal_attention, decode_attention


class FullCache(LayerCache):
    name = "full"

    def __init__(self, spec: LayerSpec):
        super().__init__(spec)
        shape = (spec.batch, spec.n_kv_heads, spec.max_len, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.graph_len = spec.max_len

    graph_safe = True  # decode with a device-tensor position inside a CUDA graph

    def attend(self, q, k, v, start_pos):
        if isinstance(start_pos, torch.Tensor):
            return self._attend_graphed(q, k, v, start_pos)
        end = self.admit(start_pos, k.shape[2])
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        self.length = end
        return causal_attention(q, self.k[:, :, :end], self.v[:, :, :end], start_pos)

    def _attend_graphed(self, q, k, v, pos):
        """One decode token at device position `pos`, attending over the first `graph_len` slots (the
        capture bucket, >= pos + 1) with the slots after pos masked: static shapes for graph replay."""
        self.k.index_copy_(2, pos.view(1), k)
        self.v.index_copy_(2, pos.view(1), v)
        n = self.graph_len
        valid = torch.arange(n, device=q.device) <= pos
        return decode_attention(q, self.k[:, :, :n], self.v[:, :, :n], valid)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def device_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

"""`full`: every token's K and V on the device, preallocated to max_len (no re-allocation per token)."""
from __future__ import annotations

import torch

from engine.cache import LayerCache, LayerSpec
from ops.attention import causal_attention


class FullCache(LayerCache):
    name = "full"

    def __init__(self, spec: LayerSpec):
        super().__init__(spec)
        shape = (spec.batch, spec.n_kv_heads, spec.max_len, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=spec.device)

    def attend(self, q, k, v, start_pos):
        end = start_pos + k.shape[2]
        if end > self.spec.max_len:
            raise ContextFull(end, self.spec.max_len)
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        self.length = end
        return causal_attention(q, self.k[:, :, :end], self.v[:, :, :end], start_pos)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def device_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class ContextFull(RuntimeError):
    def __init__(self, needed: int, max_len: int):
        super().__init__(f"the context needs {needed} tokens but the cache holds {max_len}; "
                         f"start a new chat (/reset) or raise --ctx")
        self.needed, self.max_len = needed, max_len

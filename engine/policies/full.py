"""`full`: every token's K and V on the device, preallocated to max_len (no re-allocation per token).

A decode step writes its token at its device position and attends over the step's bucket of slots (static
shapes), the slots after the position masked; a multi-token step writes and attends over exactly [0, end)."""
from __future__ import annotations

import torch

from tailorkv.engine.cache import LayerCache, LayerSpec
from tailorkv.ops.attention import attend_decode, causal_attention
from tailorkv.ops.kv_store import store_kv


class FullCache(LayerCache):
    name = "full"
    graph_safe = True

    def __init__(self, spec: LayerSpec, settings=None):
        super().__init__(spec)
        shape = (spec.batch, spec.n_kv_heads, spec.max_len, spec.head_dim)
        self.k = torch.zeros(shape, dtype=spec.dtype, device=spec.device)
        self.v = torch.zeros(shape, dtype=spec.dtype, device=spec.device)

    def plan(self, step):
        self.last = {"tokens_attended": step.end}
        return None

    def run(self, q, k, v, step):
        if step.decode:
            store_kv(self.k, self.v, step.positions, k, v)
            n = step.bucket  # static for the graph; the kernel reads only the first position + 1 slots
            return attend_decode(q, self.k[:, :, :n], self.v[:, :, :n], step.lengths)
        s, e = step.start, step.end
        self.k[:, :, s:e] = k
        self.v[:, :, s:e] = v
        return causal_attention(q, self.k[:, :, :e], self.v[:, :, :e], s, into_q=True)

    def abort(self, step) -> None:
        pass  # what a step wrote lies beyond the length: never read

    def truncate(self, length: int) -> None:
        pass  # slots from `length` on are overwritten before they are read again

    def device_bytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

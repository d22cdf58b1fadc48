"""`offload`: the whole KV in host memory (pinned when the device is CUDA), preallocated to max_len. Each step
copies all held tokens [0:start_pos) back to the device, adds the new tokens there and attends exactly, so the
output equals `full`; the new tokens are then copied to the host. Nothing stays on the device between steps:
the copy is a temporary freed after the layer's attention (the allocator reuses it for the next layer), so
the device holds one layer's K and V at a time. This is the baseline whose cost is PCIe bandwidth:
`stats()` reports the bytes moved in the last step.

Host layout is token-major, [max_len, B, H_kv, D], so the held prefix [0:len) is one contiguous block: each
step is one DMA per tensor straight from pinned memory (a head-major [B, H, max_len, D] prefix is strided,
and torch would stage it through a pageable copy). Attention reads the device copy through a permuted view.
"""
from __future__ import annotations

import torch

from tailorkv.engine.cache import LayerCache, LayerSpec
from tailorkv.engine.settings import MethodSettings
from tailorkv.ops.attention import causal_attention


class OffloadCache(LayerCache):
    name = "offload"

    def __init__(self, spec: LayerSpec, settings: MethodSettings | None = None):
        super().__init__(spec)
        shape = (spec.max_len, spec.batch, spec.n_kv_heads, spec.head_dim)  # token-major
        pin = spec.device.type == "cuda"
        self.k_host = torch.zeros(shape, dtype=spec.dtype, pin_memory=pin)
        self.v_host = torch.zeros(shape, dtype=spec.dtype, pin_memory=pin)

    def plan(self, step):
        per_token = 2 * self.spec.batch * self.spec.n_kv_heads * self.spec.head_dim * self.k_host.element_size()
        self.last = {"tokens_attended": step.end, "h2d_bytes": step.start * per_token,
                     "d2h_bytes": step.n * per_token}
        return None

    def run(self, q, k, v, step):
        """Eager only (shapes follow the length): the held prefix comes back, the new tokens go out."""
        s, e = step.start, step.end
        if s == 0:
            kk, vv = k, v
        else:
            kd = torch.empty(e, *self.k_host.shape[1:], dtype=k.dtype, device=k.device)
            vd = torch.empty_like(kd)
            kd[:s].copy_(self.k_host[:s], non_blocking=True)
            vd[:s].copy_(self.v_host[:s], non_blocking=True)
            kd[s:], vd[s:] = k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)
            kk, vv = kd.permute(1, 2, 0, 3), vd.permute(1, 2, 0, 3)
        out = causal_attention(q, kk, vv, s)
        self.k_host[s:e].copy_(k.permute(2, 0, 1, 3), non_blocking=True)
        self.v_host[s:e].copy_(v.permute(2, 0, 1, 3), non_blocking=True)
        return out

    def abort(self, step) -> None:
        pass  # what a step wrote lies beyond the length: never read

    def truncate(self, length: int) -> None:
        pass

    def host_bytes(self) -> int:
        return self.k_host.numel() * self.k_host.element_size() * 2

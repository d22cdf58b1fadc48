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
        self.last: dict = {}

    def attend(self, q, k, v, start_pos):
        T = k.shape[2]
        end = self.admit(start_pos, T)
        if start_pos == 0:
            kk, vv = k, v
        else:
            kd = torch.empty(end, *self.k_host.shape[1:], dtype=k.dtype, device=k.device)
            vd = torch.empty_like(kd)
            kd[:start_pos].copy_(self.k_host[:start_pos], non_blocking=True)
            vd[:start_pos].copy_(self.v_host[:start_pos], non_blocking=True)
            kd[start_pos:], vd[start_pos:] = k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)
            kk, vv = kd.permute(1, 2, 0, 3), vd.permute(1, 2, 0, 3)
        out = causal_attention(q, kk, vv, start_pos)
        self.k_host[start_pos:end].copy_(k.permute(2, 0, 1, 3), non_blocking=True)
        self.v_host[start_pos:end].copy_(v.permute(2, 0, 1, 3), non_blocking=True)
        self.length = end
        per_token = 2 * k.shape[0] * k.shape[1] * k.shape[3] * k.element_size()  # K and V of one position
        self.last = {"tokens_attended": end, "h2d_bytes": start_pos * per_token, "d2h_bytes": T * per_token}
        return out

    def reset(self) -> None:
        self.length = 0
        self.last = {}

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def host_bytes(self) -> int:
        return self.k_host.numel() * self.k_host.element_size() * 2

    def stats(self) -> dict:
        return dict(self.last)

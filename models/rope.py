"""Rotary position embeddings (rotate-half layout, as in HF checkpoints): plain, linear and Llama-3.1 scaling."""
from __future__ import annotations

import math

import torch

from tailorkv.models.errors import UnsupportedModel
from tailorkv.ops.fused import rope_


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old_ctx / low, inv / factor, torch.where(wavelen < old_ctx / high, inv, mid))
    elif kind not in (None, "default"):
        raise UnsupportedModel(f"rope scaling '{kind}' is not supported (only linear and llama3): use a model "
                               f"without it")
    return inv.float()


class Rope(torch.nn.Module):
    """Rotates q and k in place for their absolute positions (ops.fused.rope_: cos/sin from the positions, in
    fp32, as HF computes them; one kernel on the GPU)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.register_buffer("inv_freq", inv_frequencies(head_dim, theta, scaling), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor):
        """q [B, Hq, T, D], k [B, Hkv, T, D] or None, positions [T] int64 on their device -> (q, k), rotated."""
        return rope_(q, k, positions, self.inv_freq)

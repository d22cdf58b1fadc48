"""Rotary position embeddings (rotate-half layout, as in HF checkpoints): plain, linear and Llama-3.1 scaling."""
from __future__ import annotations

import math

import torch


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
        raise ValueError(f"unsupported rope scaling '{kind}' (supported: linear, llama3)")
    return inv.float()


ROPE_CHUNK = 8192


class Rope(torch.nn.Module):
    """cos/sin tables in fp32, built by `tables(end)` for positions [0, end) before a forward uses them."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.register_buffer("inv_freq", inv_frequencies(head_dim, theta, scaling), persistent=False)
        self._cos = self._sin = None

    def tables(self, end: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Build the tables for positions [0, end) (at least) on `device`."""
        if self._cos is None or self._cos.shape[0] < end or self._cos.device != torch.device(device):
            n = max(end, 256)
            t = torch.arange(n, dtype=torch.float32, device=device)
            freqs = torch.outer(t, self.inv_freq.to(device))
            emb = torch.cat([freqs, freqs], dim=-1)
            self._cos, self._sin = emb.cos(), emb.sin()
        return self._cos, self._sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] at the T positions of the int64 device tensor `positions`. The tables must reach
        the largest position (the runner builds them to the cache's max_len)."""
        t = x.shape[2]
        cos, sin = self._cos.index_select(0, positions), self._sin.index_select(0, positions)
        # in the activation dtype, as HF does; long prompts in chunks to bound the temporaries
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        half = x.shape[-1] // 2
        out = torch.empty_like(x)
        for s in range(0, t, ROPE_CHUNK):
            xs, c, sn = x[:, :, s:s + ROPE_CHUNK], cos[s:s + ROPE_CHUNK], sin[s:s + ROPE_CHUNK]
            torch.mul(xs, c, out=out[:, :, s:s + ROPE_CHUNK])
            out[:, :, s:s + ROPE_CHUNK, :half].addcmul_(xs[..., half:], sn[:, :half], value=-1)
            out[:, :, s:s + ROPE_CHUNK, half:].addcmul_(xs[..., :half], sn[:, half:])
        return out

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
    """cos/sin tables are built lazily up to the longest position seen, in fp32."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.register_buffer("inv_freq", inv_frequencies(head_dim, theta, scaling), persistent=False)
        self._cos = self._sin = None

    def tables(self, end: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] < end or self._cos.device != torch.device(device):
            n = max(end, 2 * (self._cos.shape[0] if self._cos is not None else 0), 256)
            t = torch.arange(n, dtype=torch.float32, device=device)
            freqs = torch.outer(t, self.inv_freq.to(device))
            emb = torch.cat([freqs, freqs], dim=-1)
            self._cos, self._sin = emb.cos(), emb.sin()
        return self._cos, self._sin

    def forward(self, x: torch.Tensor, start_pos) -> torch.Tensor:
        """x [B, H, T, D] at positions start_pos..start_pos+T-1. start_pos is an int, or a 0-dim device
        tensor inside a CUDA graph (the tables must then be built beforehand with tables(max_len))."""
        t = x.shape[2]
        if isinstance(start_pos, torch.Tensor):
            pos = start_pos + torch.arange(t, device=x.device)
            cos, sin = self._cos.index_select(0, pos), self._sin.index_select(0, pos)
        else:
            cos, sin = self.tables(start_pos + t, x.device)
            cos, sin = cos[start_pos:start_pos + t], sin[start_pos:start_pos + t]
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

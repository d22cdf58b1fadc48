"""The one cache interface. The model hands each layer's (q, k, v) to `ModelCache.attend` and gets the
attention output back; it knows nothing about which policy holds the tokens.

Shapes: q [B, Hq, T, D], k and v [B, Hkv, T, D], RoPE already applied, T new tokens at positions
start_pos .. start_pos + T - 1. The output is [B, Hq, T, D]: causal attention of the new queries over every
token the layer holds (the new ones included), as the policy sees them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class LayerSpec:
    layer_idx: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_len: int
    batch: int
    dtype: torch.dtype
    device: torch.device

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads


class ContextFull(RuntimeError):
    def __init__(self, needed: int, max_len: int):
        super().__init__(f"the context needs {needed} tokens but the cache holds {max_len}; "
                         f"start a new chat (/reset) or raise --ctx")
        self.needed, self.max_len = needed, max_len


class LayerCache:
    """One layer's KV cache policy. Subclasses implement `attend`, `reset` and the byte counts."""

    name = "base"
    wants_query_prediction = False  # True: ModelCache feeds predict_query() from the previous layer

    def __init__(self, spec: LayerSpec):
        self.spec = spec
        self.length = 0  # tokens held (prompt + generated), i.e. the next position

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
        raise NotImplementedError

    def admit(self, start_pos: int, n: int) -> int:
        """Checks that n new tokens at start_pos can be taken; going back first cuts the cache to start_pos.
        Returns the end position."""
        if start_pos > self.length:
            raise RuntimeError(f"{self.name} cache holds {self.length} tokens but got new ones at {start_pos}")
        if start_pos < self.length:
            self.truncate(start_pos)
        end = start_pos + n
        if end > self.spec.max_len:
            raise ContextFull(end, self.spec.max_len)
        return end

    def truncate(self, length: int) -> None:
        if length != self.length:
            raise RuntimeError(f"{self.name} cache cannot be truncated")

    def predict_query(self, q_hat: torch.Tensor) -> None:
        """Receives this layer's query predicted one layer early ([B, Hq, 1, D]), before attend()."""

    def reset(self) -> None:
        self.length = 0

    def device_bytes(self) -> int:
        return 0

    def host_bytes(self) -> int:
        return 0

    def stats(self) -> dict:
        """Per-policy counters (e.g. tokens fetched, bytes moved over PCIe in the last step)."""
        return {}


QueryFn = Callable[[int, torch.Tensor, int], torch.Tensor]  # (layer_idx, normed x, start_pos) -> roped q


class ModelCache:
    """All layers' caches plus the look-ahead hook. Built by engine.methods.build_cache."""

    def __init__(self, layers: list[LayerCache], query_fn: QueryFn | None = None, method: str = "full"):
        self.layers = layers
        self.query_fn = query_fn
        self.method = method
        self.on_layer = None  # optional progress callback (layer_idx, n_layers) during prefill

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def max_len(self) -> int:
        return self.layers[0].spec.max_len

    def layer_input(self, i: int, x: torch.Tensor, start_pos: int) -> None:
        """Called by the model with layer i's normalized input, before its attention. During decode it lets
        layer i+1 predict its query from this input (TailorKV's one-layer-early prediction)."""
        if self.on_layer is not None and x.shape[1] > 1:
            self.on_layer(i, len(self.layers))
        nxt = i + 1
        if x.shape[1] == 1 and nxt < len(self.layers) and self.layers[nxt].wants_query_prediction:
            self.layers[nxt].predict_query(self.query_fn(nxt, x, start_pos))

    def attend(self, i: int, q, k, v, start_pos: int):
        return self.layers[i].attend(q, k, v, start_pos)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()

    def truncate(self, length: int) -> None:
        """Forget tokens from `length` on (only supported where a policy can; used after an interrupted turn)."""
        for layer in self.layers:
            layer.truncate(length)

    def device_bytes(self) -> int:
        return sum(layer.device_bytes() for layer in self.layers)

    def host_bytes(self) -> int:
        return sum(layer.host_bytes() for layer in self.layers)

    def stats(self) -> dict:
        out: dict = {}
        for layer in self.layers:
            for key, val in layer.stats().items():
                if isinstance(val, (int, float)):
                    out[key] = out.get(key, 0) + val
        return out

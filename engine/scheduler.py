"""The model cache's scheduler: the one place for streams, events and the two buffer sets that alternate by
layer, so that what layer l reads can be filled while layer l - 1 computes.

Today one stream serves everything (`copy` is the compute stream); the buffers already alternate by layer
parity. A buffer is allocated once, at its first request, and never moves (CUDA graphs hold its address):
ask for the largest size the policy will ever need.
"""
from __future__ import annotations

import math

import torch


class Scheduler:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    @property
    def compute(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    @property
    def copy(self):
        """The stream that moves data between host and device (the compute stream for now)."""
        return self.compute

    def buffer(self, name: str, layer_idx: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Buffer set layer_idx % 2 of `name`: the same memory for every layer of that parity, so one layer's
        data may be filled while the layer before it still reads the other set. The first request allocates
        it (outside any captured step); later requests must fit in it."""
        key = (name, layer_idx % 2)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(math.prod(shape), dtype=dtype, device=self.device)
        if buf.dtype != dtype or buf.numel() < math.prod(shape):
            raise RuntimeError(f"buffer {name}: {tuple(shape)} {dtype} does not fit the one allocated "
                               f"({buf.numel()} x {buf.dtype})")
        return buf[:math.prod(shape)].view(shape)

    def device_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

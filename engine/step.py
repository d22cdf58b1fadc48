"""One forward pass's state, made once by the model cache and read (never written) by the model and every policy.

A decode step (one new token) may be captured in a CUDA graph and replayed for later steps of the same `key`:
inside `LayerCache.run` it therefore reads only `positions` and `lengths` (device tensors the runner refills
before each replay), `bucket`, `key` and what the policy's own `plan` prepared on the device. The host ints
`start` / `end` are right for the step at hand, so `plan`, `commit` and any multi-token step may use them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch

BUCKET_ALIGN = 256


def bucket_for(length: int, max_len: int) -> int:
    """Smallest bucket >= length: multiples of 256 up to 2048, then steps of 1/8 of a power of two (so a
    bucket serves many steps and holds at most ~1/8 more slots than it must)."""
    if length <= 2048:
        b = -(-length // BUCKET_ALIGN) * BUCKET_ALIGN
    else:
        step = 1 << (length.bit_length() - 4)
        b = -(-length // step) * step
    return min(b, max_len)


def fine_bucket(length: int) -> int:
    """Smallest multiple of max(256, 1/64 of the power of two below length) >= length: at most ~3% more than
    it must (used where the excess costs PCIe bytes, not only HBM)."""
    if length <= 0:
        return 0
    step = max(BUCKET_ALIGN, 1 << max(0, length.bit_length() - 7))
    return -(-length // step) * step


@dataclass(frozen=True)
class Step:
    start: int                 # tokens held before the step = position of its first new token
    n: int                     # new tokens
    positions: torch.Tensor    # [n] int64 on the device: start .. start + n - 1
    bucket: int                # decode: attended-length bucket for static shapes; multi-token: end
    key: Hashable = None       # what fixes every static shape of the step (bucket + each policy's plan)
    lengths: torch.Tensor | None = None  # [n] int64 on the device: positions + 1 (tokens held after each)

    @property
    def end(self) -> int:
        return self.start + self.n

    @property
    def decode(self) -> bool:
        return self.n == 1

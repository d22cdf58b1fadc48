"""Method settings: the one place for the defaults of every cache policy (the paper's, where it has them)."""
from __future__ import annotations

from dataclasses import dataclass, field, asdict

METHODS = ("full", "tailorkv", "offload", "streamingllm", "snapkv", "quest")

# The methods each knob changes; under the others it has no effect (the CLI refuses it there).
KNOB_USERS = {
    "bits": ("tailorkv",),
    "budget": ("tailorkv", "streamingllm", "snapkv", "quest"),
    "sink": ("tailorkv", "streamingllm"),
    "recent": ("tailorkv",),
    "channels": ("tailorkv",),
    "quant_layers": ("tailorkv",),
}


@dataclass
class MethodSettings:
    method: str = "full"
    bits: int = 1            # quantized layers: 1 or 2 bits
    group: int = 64          # quantization group (tokens for keys, channels for values)
    residual: int = 128      # full-precision recent tokens in quantized layers
    budget: int = 1024       # tokens attended per sparse layer: sink + top-K + recent
    sink: int = 64
    recent: int = 64
    channels: int = 12       # r: channels per KV head used for approximate scores
    quant_layers: list[int] | None = None  # None: from the model's profile
    page: int = 16           # quest page size
    snap_window: int = 32    # snapkv observation window (last prompt queries)
    snap_pool: int = 7       # snapkv pooling kernel
    extra: dict = field(default_factory=dict)

    @property
    def topk(self) -> int:
        return max(0, self.budget - self.sink - self.recent)

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method '{self.method}'; choose one of {', '.join(METHODS)}")
        if self.bits not in (1, 2):
            raise ValueError(f"--bits must be 1 or 2, got {self.bits}")
        if self.sink < 0 or self.recent < 0:
            raise ValueError(f"--sink and --recent must be >= 0, got {self.sink} and {self.recent}")
        if self.method == "tailorkv" and self.budget < self.sink + self.recent:  # the others check their own
            raise ValueError(f"--budget {self.budget} is smaller than --sink {self.sink} + --recent {self.recent}")
        if self.channels < 1:
            raise ValueError(f"--channels must be at least 1, got {self.channels}")

    def check_model(self, head_dim: int, n_layers: int) -> None:
        """Checks that need the model's shape (tailorkv's knobs)."""
        if self.method != "tailorkv":
            return
        if self.channels > head_dim:
            raise ValueError(f"--channels {self.channels} is more than the model's head dimension ({head_dim}): "
                             f"use at most {head_dim}")
        bad = [i for i in self.quant_layers or [] if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"--quant-layers {bad[0]} is out of range: the model has layers 0..{n_layers - 1}")

    def to_dict(self) -> dict:
        return asdict(self)

"""Next-token choice: greedy, or temperature with top-k and top-p, from a seeded generator."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0            # 0: off
    seed: int | None = None

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError("--temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("--top-p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("--top-k must be >= 0")


class Sampler:
    def __init__(self, params: SamplingParams, device):
        self.p = params
        self.gen = torch.Generator(device=device)
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] (float) -> token ids [B]."""
        if self.p.temperature == 0:
            return logits.argmax(-1)
        logits = logits / self.p.temperature
        if self.p.top_k:
            kth = torch.topk(logits, min(self.p.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.p.top_p < 1:
            sorted_logits, order = logits.sort(-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) > self.p.top_p  # keep the smallest set reaching top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        probs = logits.softmax(-1)
        return torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)

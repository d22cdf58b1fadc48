"""The one runner: every command (chat, bench, eval, profile) drives the model through `prefill` and `decode`.
It decides once whether decode steps replay CUDA graphs (a CUDA device and a cache whose every policy is
graph-safe) and returns the allocator's prefill blocks after long prompts."""
from __future__ import annotations

import torch

from tailorkv.engine.cache import ModelCache

RELEASE_AFTER = 1024  # prompt tokens from which a prefill's cached allocator blocks go back to the driver


def release_prefill_blocks(device, n_tokens: int) -> None:
    """After a long prefill, return the allocator's cached blocks (the prefill's temporaries) to the driver.
    Decode needs far less, and near a memory cap it ran much slower with them kept: Llama-3.1-8B, tailorkv at
    128k under a 24 GiB cap, 162 -> 61 ms/token on the H200 (which allocator path costs the time: not pinned
    down; no allocation retries were counted)."""
    if n_tokens >= RELEASE_AFTER and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


class Runner:
    def __init__(self, model, cache: ModelCache, use_cuda_graph: bool = True):
        self.model, self.cache = model, cache
        self.device = model.output_weight.device
        self.graphs = None
        if use_cuda_graph and self.device.type == "cuda" and cache.graph_safe:
            from tailorkv.engine.cuda_graph import DecodeGraphs
            self.graphs = DecodeGraphs(model, cache)

    @property
    def length(self) -> int:
        return self.cache.length

    def prefill(self, tokens: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """tokens [B, T] after what the cache holds -> logits of the last position [B, V] (or [B, T, V])."""
        logits = self._forward(tokens, all_logits)
        release_prefill_blocks(self.device, tokens.shape[1])
        return logits

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row [B, 1] -> logits [B, V]. With graphs the result is a static buffer that the next
        step overwrites: copy it to keep it."""
        if self.graphs is not None:
            return self.graphs.step(tokens)
        return self._forward(tokens, False)

    def prepare_decode(self) -> None:
        """Ready the next decode step before its token is known (captures its CUDA graph if it has none)."""
        if self.graphs is not None:
            self.graphs.prepare()

    def _forward(self, tokens: torch.Tensor, all_logits: bool) -> torch.Tensor:
        step = self.cache.begin(tokens.shape[1])
        try:
            logits = self.model(tokens, step, self.cache, all_logits=all_logits)
        except BaseException:
            self.cache.abort(step)
            raise
        self.cache.finish(step)
        return logits

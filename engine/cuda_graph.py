"""CUDA-graph decode: one captured graph per length bucket replays a whole decode step (all layers, logits)
with a single launch, removing the per-kernel CPU cost that dominates batch-1 decode in eager PyTorch.

Only for caches whose every layer is `graph_safe` (attends with a device-tensor position over a static
buffer). The bucket is the attended length rounded up, so a graph serves many steps and attention reads at
most ~1/8 more slots than the context holds."""
from __future__ import annotations

import torch

BUCKET_ALIGN = 256


def bucket_for(length: int, max_len: int) -> int:
    """Smallest bucket >= length: multiples of 256 up to 2048, then steps of 1/8 of a power of two."""
    if length <= 2048:
        b = -(-length // BUCKET_ALIGN) * BUCKET_ALIGN
    else:
        step = 1 << (length.bit_length() - 4)  # 1/8 of the power of two below length
        b = -(-length // step) * step
    return min(b, max_len)


class GraphedDecoder:
    def __init__(self, model, cache, batch: int = 1):
        self.model, self.cache = model, cache
        dev = model.output_weight.device
        self.tokens = torch.zeros((batch, 1), dtype=torch.long, device=dev)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        model.rope.tables(cache.max_len, dev)  # built before capture: no allocation inside a graph

    @staticmethod
    def supported(cache) -> bool:
        return torch.cuda.is_available() and all(getattr(l, "graph_safe", False) for l in cache.layers)

    def _set_len(self, n: int) -> None:
        for layer in self.cache.layers:
            layer.graph_len = n

    def _capture(self, n: int):
        self._set_len(n)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, cuBLAS handles)
            for _ in range(2):
                self.model(self.tokens, self.pos, self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(self.tokens, self.pos, self.cache)
        self.pool = graph.pool()
        return graph, logits

    def step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """Decode one token [B, 1] at position pos; returns logits [B, V] (a static buffer: copy to keep)."""
        n = bucket_for(pos + 1, self.cache.max_len)
        self.tokens.copy_(token)
        self.pos.fill_(pos)
        if n not in self.graphs:  # its warm-up runs write slot pos with this token, as the replay does
            self.graphs[n] = self._capture(n)
        self._set_len(n)
        graph, logits = self.graphs[n]
        graph.replay()
        for layer in self.cache.layers:
            layer.length = pos + 1
        return logits

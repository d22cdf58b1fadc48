"""CUDA-graph decode: one captured graph per step key (the attended-length bucket and what each policy's plan
fixed) replays a whole decode step (all layers, logits) with a single launch, removing the per-kernel CPU cost
that dominates batch-1 decode in eager PyTorch. Used by the runner when every layer's policy is graph-safe.

Per step: the token and position go into static device buffers, the cache plans the step (host), the graph of
its key replays (captured on first use, or ahead by `prepare` after a prefill: two eager warm-up runs on a side
stream, then the capture; a decode step's run() is idempotent, so the warm-ups leave the state the replay
leaves), the cache commits it."""
from __future__ import annotations

import torch


class DecodeGraphs:
    def __init__(self, model, cache, batch: int = 1):
        self.model, self.cache = model, cache
        dev = model.output_weight.device
        self.tokens = torch.zeros((batch, 1), dtype=torch.long, device=dev)
        self.positions = torch.zeros(1, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(1, dtype=torch.long, device=dev)
        self.graphs: dict = {}
        self.pool = None

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Decode one token [B, 1]; returns logits [B, V] (a static buffer: copy to keep)."""
        if tokens.shape != self.tokens.shape:
            self.tokens = torch.zeros_like(tokens)
            self.graphs.clear()
        self.tokens.copy_(tokens)
        step = self._begin()
        try:
            graph, logits = self._graph_for(step)
            graph.replay()
        except BaseException:
            self.cache.abort(step)
            raise
        self.cache.finish(step)
        return logits

    def prepare(self) -> None:
        """Capture the graph of the next step's key now, if it has none (after a prefill: the first token's step
        then only replays; a capture costs a few eager steps, 0.4-0.6 s for the first one in a process)."""
        if self.cache.length >= self.cache.max_len:
            return
        step = self._begin()
        try:
            self._graph_for(step)
        finally:
            self.cache.abort(step)  # graphed policies write only their token's own slots before commit

    def _begin(self):
        self.positions.fill_(self.cache.length)
        self.lengths.fill_(self.cache.length + 1)
        return self.cache.begin(1, self.positions, self.lengths)

    def _graph_for(self, step):
        if step.key not in self.graphs:
            self.graphs[step.key] = self._capture(step)
        return self.graphs[step.key]

    def _capture(self, step):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (allocator, cuBLAS handles, kernel loads)
            for _ in range(2):
                self.model(self.tokens, step, self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(self.tokens, step, self.cache)
        self.pool = graph.pool()
        return graph, logits

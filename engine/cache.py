"""The one cache interface. The model hands each layer's (q, k, v) to `ModelCache.attend` and gets the
attention output back; it knows nothing about which policy holds the tokens.

Shapes: q [B, Hq, T, D], k and v [B, Hkv, T, D], RoPE already applied, T = step.n new tokens at positions
step.start .. step.end - 1. The output is [B, Hq, T, D]: causal attention of the new queries over every token
the layer holds (the new ones included), as the policy sees them.

One forward = `begin` (the cache makes the Step and calls every policy's `plan` on the host), the model's
layers (each calls `attend` -> the policy's `run`, device work only), `finish` (every policy's `commit` on the
host, then the length advances). The cache owns the length; policies read the step and never write it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from tailorkv.engine.scheduler import Scheduler
from tailorkv.engine.step import Step, bucket_for


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
    """One layer's KV cache policy.

    - `plan(step)`: host work before the step (regions, buckets, flush decisions, device scalars the step
      reads). Returns what fixes the static shapes of `run` for a decode step (part of the graph key), and
      sets `self.last`, the step's counters (computed here, on the host, so they stay right under replay).
    - `run(q, k, v, step)`: the attention. For a decode step: device work only, static shapes for the plan,
      no host reads or syncs, and idempotent (running it twice for one step gives the same state: graph capture
      runs it as warm-up). A multi-token step runs eagerly and may store as it goes. The model reads q no more
      after run: run may write its output over q (causal_attention's into_q).
    - `commit(step)`: host work after the step (moving tokens between regions, flushes, host writes).
    """

    name = "base"
    wants_query_prediction = False  # True: the cache feeds predict_query() from the previous layer
    prefetch_after_attention = False  # True: ... once the previous layer's attention is queued (plan sets it)
    graph_safe = False              # True: a decode step's run() may be captured in a CUDA graph
    selects_tokens = False          # True: attends to a subset of the held tokens (its tokens_attended says how many)

    def __init__(self, spec: LayerSpec):
        self.spec = spec
        self.scheduler: Scheduler | None = None  # set by ModelCache
        self.last: dict = {}

    def plan(self, step: Step) -> Hashable:
        return None

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step) -> torch.Tensor:
        raise NotImplementedError

    def commit(self, step: Step) -> None:
        pass

    def abort(self, step: Step) -> None:
        """The step was interrupted after plan (maybe inside run): bring the layer back to the state before
        it, or raise RuntimeError when it cannot (the caller then rebuilds the cache from the token ids).
        This default suits a policy whose decode step writes only to its token's own slots (a repeat of the step
        rewrites them) and counts the token at commit; one that appends or evicts during run overrides it."""
        if not step.decode:
            raise RuntimeError(f"{self.name} cache cannot undo an interrupted multi-token step")

    def truncate(self, length: int) -> None:
        """Forget the tokens from position `length` on, or raise RuntimeError when the policy cannot."""
        raise RuntimeError(f"{self.name} cache cannot be truncated")

    def predict_query(self, q_hat: torch.Tensor) -> None:
        """Receives this layer's query predicted one layer early ([B, Hq, 1, D]), before run()."""

    def reset(self) -> None:
        self.last = {}

    def device_bytes(self) -> int:
        return 0

    def host_bytes(self) -> int:
        return 0

    def stats(self) -> dict:
        """The last step's counters (tokens_attended, tokens_fetched, bytes moved over PCIe, ...)."""
        return dict(self.last)

    def totals(self) -> dict:
        """Counters the policy keeps on the device since reset() (name -> int). Reading them waits for the device:
        read after the steps, not inside them."""
        return {}


QueryFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]  # (layer, normed x, positions) -> roped q


class ModelCache:
    """All layers' policies, the length they hold, the scheduler and the look-ahead hook. Built by
    engine.methods.build_cache."""

    def __init__(self, layers: list[LayerCache], query_fn: QueryFn | None = None, method: str = "full",
                 scheduler: Scheduler | None = None, predict_ahead: int = 1):
        self.layers = layers
        self.query_fn = query_fn
        self.method = method
        self.length = 0
        self.intact = True  # False after a step that a policy could not undo (see abort)
        self.scheduler = scheduler or Scheduler(layers[0].spec.device if layers else "cpu")
        for layer in layers:
            layer.scheduler = self.scheduler
        self.on_layer = None  # optional progress callback (layer_idx, n_layers) during multi-token steps
        # layer j's query is predicted from layer j - predict_ahead's input (layer_input says which layers differ);
        # the scheduler then keeps predict_ahead + 1 buffer sets, so that what a prediction fetches for layer j never
        # lands in the set of layer j - predict_ahead - 1, whose reads are queued before the prediction is made
        self.predict_ahead = predict_ahead
        self.scheduler.sets = max(self.scheduler.sets, predict_ahead + 1)
        self._predicted = []  # (source layer, layer, its predicted query) between layer_input and attend

    @property
    def max_len(self) -> int:
        return self.layers[0].spec.max_len

    @property
    def graph_safe(self) -> bool:
        return all(layer.graph_safe for layer in self.layers)

    # --- one forward -----------------------------------------------------------------------------------
    def begin(self, n: int, positions: torch.Tensor | None = None, lengths: torch.Tensor | None = None) -> Step:
        """The step of n new tokens after what the cache holds; every policy plans it. positions (and lengths,
        positions + 1): device buffers the caller already filled (a CUDA graph's static inputs)."""
        start, end = self.length, self.length + n
        self._predicted = []
        if end > self.max_len:
            raise ContextFull(end, self.max_len)
        device = self.layers[0].spec.device
        if positions is None:
            positions = torch.arange(start, end, device=device)
        if lengths is None:
            lengths = positions + 1
        bucket = bucket_for(end, self.max_len) if n == 1 else end
        step = Step(start, n, positions, bucket, lengths=lengths)
        key = (bucket, tuple(layer.plan(step) for layer in self.layers))
        return Step(start, n, positions, bucket, key, lengths)

    def layer_input(self, i: int, x: torch.Tensor, step: Step) -> None:
        """Called by the model with layer i's normalized input, before its attention. During decode layer
        i + predict_ahead predicts its query from this input (TailorKV's one-layer-early prediction: 1). A layer
        whose fetch is small (`prefetch_after_attention`) receives it once layer i's attention is queued (attend), so
        what it fetches shares the PCIe link with the MLP rather than with layer i's own reads of host rows; a larger
        fetch starts at once, to have the whole layer to run in."""
        if self.on_layer is not None and not step.decode:
            self.on_layer(i, len(self.layers))
        if not step.decode:
            return
        # layer 1 from layer 0's input (the embeddings' are a poor prediction further on), layers 2 .. predict_ahead
        # + 1 from layer 1's, the others from predict_ahead layers back
        for nxt in ((1,) if i == 0 else range(2, self.predict_ahead + 2) if i == 1 else (i + self.predict_ahead,)):
            if nxt < len(self.layers) and self.layers[nxt].wants_query_prediction:
                q_hat = self.query_fn(nxt, x, step.positions)
                if self.layers[nxt].prefetch_after_attention:
                    self._predicted.append((i, nxt, q_hat))
                else:
                    self.layers[nxt].predict_query(q_hat)

    def attend(self, i: int, q, k, v, step: Step):
        out = self.layers[i].run(q, k, v, step)
        for src, nxt, q_hat in [p for p in self._predicted if p[0] == i]:
            self.layers[nxt].predict_query(q_hat)
        self._predicted = [p for p in self._predicted if p[0] != i]
        return out

    def finish(self, step: Step) -> None:
        for layer in self.layers:
            layer.commit(step)
        self.length = step.end

    def abort(self, step: Step) -> None:
        """Undo an interrupted step. Where a policy cannot, `intact` turns False: rebuild from the token ids."""
        for layer in self.layers:
            try:
                layer.abort(step)
            except RuntimeError:
                self.intact = False

    # --- whole-cache operations -------------------------------------------------------------------------
    def reset(self) -> None:
        self.length = 0
        self.intact = True
        for layer in self.layers:
            layer.reset()

    def truncate(self, length: int) -> None:
        """Forget tokens from `length` on (only where every policy can; used after an interrupted turn)."""
        if length >= self.length:
            return
        for layer in self.layers:
            layer.truncate(length)
        self.length = length

    def device_bytes(self) -> int:
        return sum(layer.device_bytes() for layer in self.layers) + self.scheduler.device_bytes()

    def host_bytes(self) -> int:
        return sum(layer.host_bytes() for layer in self.layers)

    def stats(self) -> dict:
        """The last step's counters, summed over layers."""
        out: dict = {}
        for layer in self.layers:
            for key, val in layer.stats().items():
                if isinstance(val, (int, float)):
                    out[key] = out.get(key, 0) + val
        return out

    def totals(self) -> dict:
        """The layers' device counters since reset (LayerCache.totals), summed; a key only where a layer keeps it."""
        out: dict = {}
        for layer in self.layers:
            for key, val in layer.totals().items():
                out[key] = out.get(key, 0) + val
        return out

"""Fidelity of a method against the full cache, without task data (`tailorkv eval --fidelity-tokens N`).

Teacher-forced decoding over a long natural text (the essay haystack of haystack.py, cut to the target length):
both caches prefill the first (length - N) tokens, then take the next N tokens one at a time (the text's own
tokens, whatever either model would have said), and after each step the two next-token distributions are
compared:
- top-1 agreement: argmax(method) == argmax(full), in % of the N steps;
- KL(full || method) in nats per step: its mean, 99th percentile and max;
- the negative log-likelihood of the text's next token under each (nll_full, nll_method; exp = perplexity)
  and how often each one's argmax is that token.
Prefill is exact for every method here, so only decode steps count.

Attention-mass recall (tailorkv's sparse-offload layers only): at each decode step and sparse layer, the share
of the exact attention mass (softmax of the layer's query over every token the layer holds: sink, middle in
host memory, tail, the new token) that falls on the tokens the layer actually attended to (sink + the selected
top-K + tail + the new token); mean over query heads, then over layers and steps. It is observed from outside
the policy: each selecting layer's selector is wrapped (engine.policies.selection.ObservedSelector) to see which
middle tokens were picked; a layer that selected nothing in a step (its middle fits the budget, so nothing was
left out) counts 1.0; a cache with no selecting layers reports None.
"""
from __future__ import annotations

import math
import statistics
from typing import Callable

import torch

from tailorkv.engine.errors import InputError
from tailorkv.engine.results import percentile
from tailorkv.engine.evaluation.haystack import Filler, essay_units


def fidelity_ids(tokenizer, length: int) -> list[int]:
    """length + 1 token ids of essay text (BOS first when the tokenizer wants one): the first `length` are
    fed, each of the last N + 1 is the target of the step before it."""
    from tailorkv.models.tokenizer import bos_prefix
    bos = bos_prefix(tokenizer)
    need = length + 1 - len(bos)
    filler = Filler(essay_units(), 0)
    words = max(64, need)
    while True:
        ids = tokenizer.encode("".join(filler.take(words)))
        if len(ids) >= need:
            return bos + ids[:need]
        words = int(words * 1.5) + 1


class RecallProbe:
    """Attention-mass recall of the token-selecting layers of one cache (see the module doc). A context manager:
    on enter it wraps each such layer's selector (engine.policies.selection.ObservedSelector) and restores it
    on exit. Call `end_step()` after every decode step: a layer whose middle was empty (nothing to select, so
    nothing left out) counts 1.0 for that step. Needs eager decoding (a replayed CUDA graph calls no Python)."""

    def __init__(self, cache):
        self.layers = [layer for layer in cache.layers if hasattr(layer, "selector")]
        self.values: list[float] = []      # one per (decode step, selecting layer)
        self.per_layer: dict[int, list[float]] = {layer.spec.layer_idx: [] for layer in self.layers}
        self._seen: set[int] = set()

    def __enter__(self):
        from tailorkv.engine.policies.selection import ObservedSelector
        self._inner = [layer.selector for layer in self.layers]
        for layer in self.layers:
            layer.selector = ObservedSelector(layer.selector, self._observe)
        return self

    def __exit__(self, *exc):
        for layer, inner in zip(self.layers, self._inner):
            layer.selector = inner
        return False

    def end_step(self) -> None:
        for layer in self.layers:
            if id(layer) not in self._seen:
                self.values.append(1.0)
                self.per_layer[layer.spec.layer_idx].append(1.0)
        self._seen.clear()

    def _observe(self, layer, q, picked) -> None:
        """picked [B, Hkv, K]: absolute positions; those outside the middle are not attended."""
        self._seen.add(id(layer))
        keys, _ = layer.held_kv(pending=1)  # every held token and this step's, in position order
        lo, hi = layer.regions()["middle"].start, layer.regions()["middle"].stop
        B, Hq, _, D = q.shape
        H = keys.shape[1]
        G = Hq // H
        logits = (q.float().reshape(B, H, G, D) @ keys.float().transpose(-1, -2)) / math.sqrt(D)  # [B, H, G, N]
        probs = torch.softmax(logits, -1)
        middle = probs[..., lo:hi]
        inside = (picked >= lo) & (picked < hi)
        hits = torch.zeros(B, H, hi - lo, dtype=torch.int32, device=q.device)
        hits.scatter_add_(2, torch.where(inside, picked - lo, 0), inside.int())
        left_out = (middle * (hits == 0)[:, :, None, :]).sum(-1)                      # [B, H, G]
        self.values.append(float((1.0 - left_out).mean()))
        self.per_layer[layer.spec.layer_idx].append(self.values[-1])

    def summary(self) -> dict:
        if not self.layers:
            return {"attn_recall": None, "attn_recall_min": None}
        v = self.values
        return {"attn_recall": statistics.fmean(v) if v else None, "attn_recall_min": min(v) if v else None,
                "attn_recall_per_layer": {i: statistics.fmean(r) for i, r in self.per_layer.items() if r}}


def compare_logits(full: torch.Tensor, other: torch.Tensor, target: int) -> dict:
    """One step: full and other are logits [V] (or [1, V])."""
    lf = torch.log_softmax(full.reshape(-1).double(), -1)
    lo = torch.log_softmax(other.reshape(-1).double(), -1)
    kl = float((lf.exp() * (lf - lo)).sum().clamp_min(0.0))
    af, ao = int(lf.argmax()), int(lo.argmax())
    return {"agree": af == ao, "kl": kl, "nll_full": float(-lf[target]), "nll_method": float(-lo[target]),
            "hit_full": af == target, "hit_method": ao == target}


def run_fidelity(loaded, settings, ids: list[int], n_steps: int, recall: bool = True,
                 on_phase: Callable[[str], None] | None = None) -> dict:
    """Teacher-force ids[:-1] through the full cache and through `settings`' cache side by side; compare the
    last n_steps next-token distributions. Returns the record's measured fields."""
    from tailorkv.engine.generate import Engine
    from tailorkv.engine.methods import build_cache
    from tailorkv.engine.settings import MethodSettings

    say = on_phase or (lambda s: None)
    length = len(ids) - 1
    if not 0 < n_steps < length:
        raise InputError(f"--fidelity-tokens {n_steps} must be between 1 and the length - 1 ({length - 1})")
    prefix = length - n_steps
    max_len = length + 16
    ref = Engine(loaded, build_cache(loaded, MethodSettings(method="full"), max_len))
    cache = build_cache(loaded, settings, max_len)
    probe = RecallProbe(cache) if recall and settings.method == "tailorkv" else None
    eng = Engine(loaded, cache, use_cuda_graph=probe is None)
    steps = []
    with torch.inference_mode():
        say(f"prefill {prefix} tokens (full)")
        ref.forward(ids[:prefix])
        say(f"prefill {prefix} tokens ({settings.method})")
        eng.forward(ids[:prefix])
        say(f"{n_steps} teacher-forced steps")
        if probe is not None:
            probe.__enter__()
        try:
            for j in range(n_steps):
                tok = ids[prefix + j]
                a = ref.forward([tok]).clone()
                b = eng.forward([tok])
                if probe is not None:
                    probe.end_step()
                steps.append(compare_logits(a, b, ids[prefix + j + 1]))
        finally:
            if probe is not None:
                probe.__exit__(None, None, None)
    kls = [s["kl"] for s in steps]
    nf = statistics.fmean(s["nll_full"] for s in steps)
    nm = statistics.fmean(s["nll_method"] for s in steps)
    out = {"prefix_tokens": prefix, "steps": n_steps,
           "top1_agreement": 100.0 * statistics.fmean(s["agree"] for s in steps),
           "kl_mean": statistics.fmean(kls), "kl_p99": percentile(kls, 99), "kl_max": max(kls),
           "nll_full": nf, "nll_method": nm, "ppl_full": math.exp(min(nf, 700)), "ppl_method": math.exp(min(nm, 700)),
           "next_token_acc_full": 100.0 * statistics.fmean(s["hit_full"] for s in steps),
           "next_token_acc_method": 100.0 * statistics.fmean(s["hit_method"] for s in steps)}
    out.update(probe.summary() if probe is not None else {"attn_recall": None})
    return out

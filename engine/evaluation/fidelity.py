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
the policy: the layer's `attend` is wrapped on the instance and the policy module's `topk_tokens` is wrapped
while the step runs, to see which middle tokens were picked. If the policy stops calling `topk_tokens` on a
step where the middle exceeds top-K, recall is reported as None rather than guessed.
"""
from __future__ import annotations

import math
import statistics
from typing import Callable

import torch

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
    """Attention-mass recall of the sparse-offload layers of one cache (see the module doc). A context manager:
    installs the instance wrappers on enter, removes them on exit."""

    def __init__(self, cache):
        self.layers = [layer for layer in cache.layers if layer.name == "sparse"]
        self.values: list[float] = []      # one per (decode step, sparse layer)
        self.unobserved = 0                # decode steps whose selection could not be seen
        self._picked = None

    def __enter__(self):
        import tailorkv.engine.policies.sparse as sp
        self._module = sp
        self._orig_topk = sp.topk_tokens

        def topk_tokens(scores, k):
            idx = self._orig_topk(scores, k)
            self._picked = idx
            return idx

        sp.topk_tokens = topk_tokens
        for layer in self.layers:
            layer.attend = self._wrap(layer, layer.attend)
        return self

    def __exit__(self, *exc):
        self._module.topk_tokens = self._orig_topk
        for layer in self.layers:
            layer.__dict__.pop("attend", None)
        return False

    def _wrap(self, layer, attend):
        def wrapped(q, k, v, start_pos):
            if k.shape[2] != 1 or start_pos != layer.length:
                return attend(q, k, v, start_pos)
            reg = layer.regions()
            n_sink, lo, hi = len(reg["sink"]), reg["middle"].start, reg["middle"].stop
            mid = max(0, hi - lo)
            tl = len(reg["tail"])
            dev = q.device
            if dev.type == "cuda":  # the host store must hold every copy the policy queued before we read it
                torch.cuda.synchronize(dev)
            keys = torch.cat([layer.sink_k[:, :, :n_sink], layer.host_k[:, :, lo:hi].to(dev),
                              layer.tail_k[:, :, :tl], k], 2)  # a copy: the step may rewrite the tail after
            self._picked = None
            out = attend(q, k, v, start_pos)
            picked, self._picked = self._picked, None
            self._score(layer, q, keys, n_sink, mid, picked)
            return out
        return wrapped

    def _score(self, layer, q, keys, n_sink, mid, picked) -> None:
        topk = layer.topk
        if mid == 0 or (0 < mid <= topk):  # nothing left out
            self.values.append(1.0)
            return
        B, Hq, _, D = q.shape
        H = keys.shape[1]
        G = Hq // H
        logits = (q.float().reshape(B, H, G, D) @ keys.float().transpose(-1, -2)) / math.sqrt(D)  # [B, H, G, N]
        probs = torch.softmax(logits, -1)
        middle = probs[..., n_sink:n_sink + mid]
        kept = middle.new_zeros(())
        if topk > 0:
            if picked is None:
                self.unobserved += 1
                return
            idx = picked.to(q.device).long()[:, :, None, :].expand(-1, -1, G, -1)  # relative to the middle
            kept = middle.gather(-1, idx).sum(-1)
        left_out = middle.sum(-1) - kept                                             # [B, H, G]
        self.values.append(float((1.0 - left_out).mean()))

    def summary(self) -> dict:
        if self.unobserved or not self.layers:
            return {"attn_recall": None, "attn_recall_min": None, "attn_recall_unobserved_steps": self.unobserved}
        v = self.values
        return {"attn_recall": statistics.fmean(v) if v else None, "attn_recall_min": min(v) if v else None,
                "attn_recall_unobserved_steps": 0}


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
        raise ValueError(f"--fidelity-tokens {n_steps} must be between 1 and the length - 1 ({length - 1})")
    prefix = length - n_steps
    max_len = length + 16
    ref = Engine(loaded, build_cache(loaded, MethodSettings(method="full"), max_len))
    eng = Engine(loaded, build_cache(loaded, settings, max_len))
    probe = RecallProbe(eng.cache) if recall and settings.method == "tailorkv" else None
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

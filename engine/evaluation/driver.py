"""The work behind `tailorkv eval`: one work item -> its record(s), on one loaded model. Pure functions, no CLI
(engine/evaluation/command.py is the command; plan.py says what the items are, prompts.py what is fed,
summary.py and merge.py what is written).

One work item is either
- a task item (length, method, sample): build a fresh cache for the method (max_len = prompt + max new + 16),
  greedy-decode the sample's prompt, score the answer (scoring.score x 100); or
- a fidelity item (length, method): teacher-forced comparison with the full cache (fidelity.py).

Tokens loaded: per decode step, from the cache's stats() (the step's counters, summed over layers):
  ``loaded_frac``   sparse-offload layers (tailorkv): tokens_fetched / (n_sparse_layers * context), the share of
                    the context brought from host memory (top-K; the paper's "loading 1-3% of tokens");
  ``attended_frac`` tokens each non-full layer attends to / context: tokens_attended (streamingllm, snapkv,
                    quest) or sink + fetched + tail (tailorkv's sparse layers, read from the layer's regions).
  context = tokens held after the step. Both are the mean over the sample's decode steps (prefill excluded);
  None for methods without such counters (full).
"""
from __future__ import annotations

import statistics
import time
import traceback
from typing import Callable

import torch

from tailorkv.engine.evaluation.plan import MARGIN, EvalPlan, length_label
from tailorkv.engine.evaluation.prompts import prompt_ids
from tailorkv.engine.evaluation.scoring import score
from tailorkv.engine.evaluation.tasks import Sample
from tailorkv.engine.settings import MethodSettings


# ------------------------------------------------------------------------------------------------ one sample
def n_sparse_layers(cache) -> int:
    return sum(1 for layer in cache.layers if layer.name == "sparse")


def step_fractions(cache, context: int) -> dict:
    """This decode step's share of the context that the cache loaded / attended to (see the module doc)."""
    st = cache.stats()
    out = {}
    sparse = [layer for layer in cache.layers if layer.name == "sparse"]
    if sparse and "tokens_fetched" in st:
        out["loaded_frac"] = st["tokens_fetched"] / (len(sparse) * context)
        attended = 0
        for layer in sparse:
            reg = layer.regions()
            attended += len(reg["sink"]) + layer.stats().get("tokens_fetched", 0) + len(reg["tail"])
        out["attended_frac"] = attended / (len(sparse) * context)
    elif "tokens_attended" in st:
        n_layers = sum(1 for layer in cache.layers if layer.name != "full")
        out["attended_frac"] = st["tokens_attended"] / (max(n_layers, 1) * context)
    return out


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def run_sample(loaded, settings: MethodSettings, sample: Sample, max_new: int, question: str = "after") -> dict:
    """Greedy-decode one sample with a fresh cache; returns the record's measured fields."""
    from tailorkv.engine.generate import Engine
    from tailorkv.engine.methods import build_cache

    tok = loaded.tokenizer
    ids = prompt_ids(tok, sample, question)
    cache = build_cache(loaded, settings, len(ids) + max_new + MARGIN)
    engine = Engine(loaded, cache)
    fracs: dict[str, list[float]] = {"loaded_frac": [], "attended_frac": []}
    seen = [0]

    def on_token(_tok: int) -> None:
        seen[0] += 1
        if seen[0] > 1:  # the first token comes from the prefill's logits; later ones from a decode step
            for k, v in step_fractions(cache, len(engine.tokens)).items():
                fracs[k].append(v)

    with torch.inference_mode():
        out, st = engine.generate(ids, max_new, on_token)
    pred = tok.decode(out, skip_special_tokens=True)
    return {"prompt_tokens": len(ids), "prediction": pred, "new_tokens": st.new_tokens, "stop": st.stop,
            "score": 100.0 * score(pred, sample.answers, sample.metric),
            "loaded_frac": _mean(fracs["loaded_frac"]), "attended_frac": _mean(fracs["attended_frac"]),
            "prefill_s": st.prefill_s, "decode_s": st.decode_s}


def _failure(e: BaseException) -> dict:
    from tailorkv.engine.bench.driver import is_oom
    status = "oom" if is_oom(e) else "error"
    out = {"status": status, "error": f"{type(e).__name__}: {e}".strip()}
    if status == "error":
        out["traceback"] = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-8:])
    return out


def _run_one(rec: dict, work: Callable[[], dict], device) -> dict:
    """rec updated with work()'s fields, or with the failure; timed. Never raises for a failing method."""
    from tailorkv.engine.bench.driver import free_device
    rec.update(status="ok", error=None)
    t0 = time.perf_counter()
    try:
        rec.update(work())
    except Exception as e:  # one failing method must not stop the run
        if rec["kind"] == "task":
            rec.update(score=None, prediction=None)
        rec.update(_failure(e))
    rec["wall_s"] = time.perf_counter() - t0
    if rec["status"] != "ok":  # the exception's frames held the cache: give its memory back now
        free_device(device)    # (not after every item: gc.collect costs ~0.2 s and the cache is freed anyway)
    return rec


def run_item(loaded, plan: EvalPlan, item: dict, suites: dict[int, list[Sample]], texts: dict | None = None,
             on_phase: Callable[[str], None] | None = None) -> list[dict]:
    """One work item -> its records (plan.runs() order for a task item; one for a fidelity item); each with
    status 'ok', 'oom' or 'error'."""
    device = loaded.model.output_weight.device
    say = on_phase or (lambda s: None)
    n, index = item["length"], plan.record_index()
    if item["kind"] == "fidelity":
        from tailorkv.engine.evaluation.fidelity import fidelity_ids, run_fidelity
        b, m = item["budget"], item["method"]
        rec = {"index": index[(item["index"], b, m)], "item": item["index"], "kind": "fidelity", "length": n,
               "budget": b, "method": m, "tokens": plan.fidelity_tokens}

        def fidelity() -> dict:
            ids = texts.get(n) if texts is not None else None
            if ids is None:
                ids = fidelity_ids(loaded.tokenizer, n)
                if texts is not None:
                    texts[n] = ids
            return run_fidelity(loaded, plan.settings(m, n, b), ids, plan.fidelity_tokens, on_phase=on_phase)
        return [_run_one(rec, fidelity, device)]
    sample = suites[n][item["suite_index"]]
    max_new = plan.max_new(sample.task)
    out = []
    for b, m in plan.runs():
        rec = {"index": index[(item["index"], b, m)], "item": item["index"], "kind": "task", "length": n,
               "budget": b, "method": m, "task": sample.task, "sample": item["sample"],
               "prompt_hash": sample.prompt_hash, "n_tokens": sample.n_tokens, "target_tokens": sample.target_tokens,
               "depth": sample.depth, "answers": list(sample.answers), "metric": sample.metric,
               "max_new_tokens": max_new}
        say(m if b is None else f"{m} @ {b}")
        settings = plan.settings(m, n, b)
        out.append(_run_one(rec, lambda: run_sample(loaded, settings, sample, max_new, plan.question), device))
    return out


COUNTS_GENERATED = ("streamingllm", "quest")  # policies whose own rule spends budget on generated tokens


def check_methods(loaded, plan: EvalPlan) -> list[str]:
    """Build a tiny cache for every (budget, method, length) setting so configuration errors (no layer profile,
    a budget a policy refuses) surface once, as one clear message, before any work. Returns warnings: runs
    whose policy does not say it honors settings.free_generated (a layer attribute `free_generated`), so their
    budget still counts generated tokens whatever the protocol."""
    from tailorkv.engine.methods import build_cache
    lax: dict[str, None] = {}
    for n in plan.lengths:
        for b, m in plan.runs():
            s = plan.settings(m, n, b)
            try:
                cache = build_cache(loaded, s, 64)
            except ValueError as e:
                where = "" if b is None else f" budget {b}"
                raise ValueError(f"{m} at length {length_label(n)}{where} ({s.budget} tokens = sink {s.sink} + "
                                 f"top-K {s.topk} + recent {s.recent}): {e}") from None
            if s.free_generated:
                lax.update({layer.name: None for layer in cache.layers if layer.name in COUNTS_GENERATED
                            and getattr(layer, "free_generated", None) is not True})
    if plan.samples and loaded.tokenizer is None:
        raise ValueError(f"{loaded.name} has no tokenizer here: pass --weights DIR with tokenizer.json")
    return [f"{name} does not implement free_generated yet: its budget still counts the generated tokens "
            f"(protocol {plan.protocol} asks every method to attend them on top)" for name in lax]

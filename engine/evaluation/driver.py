"""The work behind `tailorkv eval`: one work item -> its record(s), on one loaded model. Pure functions, no CLI
(engine/evaluation/command.py is the command; plan.py says what the items are, prompts.py what is fed,
summary.py and merge.py what is written).

One work item is either
- a task item (length, sample): for every run of the plan (full first, then each budget group's methods) build
  a fresh cache (max_len = prompt + max new + 16), greedy-decode the sample's prompt, score the answer
  (scoring.score x 100); and, for every method but full, teacher-force full's greedy answer (its tokens, plus
  the EOS where full stopped) to get the answer's negative log-likelihood under the method:
  ``nll`` = mean over the answer's tokens of -log p (nats/token), ``dnll`` = nll - full's nll on the same
  sample (full's own nll comes from its greedy pass; its dnll is 0), ``agree`` = % of the answer's tokens the
  method ranks first. While a method's greedy path equals full's answer, the greedy pass is the teacher-forced
  one (``tf`` 'shared'); after it leaves it, a second prefill on a fresh cache does it (``tf`` 'separate'); or
- a fidelity item (length, budget, method): teacher-forced comparison with the full cache (fidelity.py).

Tokens loaded: per decode step, from the cache's stats() (the step's counters, summed over layers):
  ``loaded_frac``   sparse-offload layers (tailorkv): tokens_fetched / (n_loading_layers * context), the share of
                    the context brought from host memory (top-K; the paper's "loading 1-3% of tokens");
  ``attended_frac`` tokens each token-selecting layer attends to / context: its tokens_attended counter
                    (streamingllm, snapkv, quest; tailorkv's sparse layers: sink + fetched + tail).
  context = tokens held after the step. Both are the mean over the sample's decode steps (prefill excluded);
  None for methods without such counters (full).
"""
from __future__ import annotations

import statistics
import time
import traceback
from typing import Callable

import torch

from tailorkv.engine.errors import InputError
from tailorkv.engine.evaluation.plan import MARGIN, EvalPlan, length_label
from tailorkv.engine.evaluation.prompts import prompt_ids
from tailorkv.engine.evaluation.scoring import score
from tailorkv.engine.evaluation.summary import mean_or_none
from tailorkv.engine.evaluation.tasks import Sample
from tailorkv.engine.settings import MethodSettings


# ------------------------------------------------------------------------------------------------ one sample
def step_fractions(cache, context: int) -> dict:
    """This decode step's share of the context that the cache loaded / attended to (see the module doc), from
    the counters each policy publishes: `tokens_fetched` (layers that load from host memory) and
    `tokens_attended` (layers whose `selects_tokens` is set)."""
    loading = [layer.stats() for layer in cache.layers if "tokens_fetched" in layer.stats()]
    selecting = [layer.stats() for layer in cache.layers if layer.selects_tokens]
    out = {}
    if loading:
        out["loaded_frac"] = sum(s["tokens_fetched"] for s in loading) / (len(loading) * context)
    if selecting:
        out["attended_frac"] = sum(s["tokens_attended"] for s in selecting) / (len(selecting) * context)
    return out


def _pick(logits: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(log-probabilities fp32 [V], the greedy token) of one position's logits."""
    lp = torch.log_softmax(logits.reshape(-1).float(), -1)
    return lp, int(lp.argmax())


def greedy(engine, ids: list[int], max_new: int, follow: list[int] | None = None, own_nll: bool = False,
           on_step: Callable[[], None] | None = None) -> dict:
    """Prefill ids, then decode() greedily; prefill_s and decode_s timed."""
    t0 = time.perf_counter()
    logits = engine.forward(ids)
    _pick(logits)  # waits for the device
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = decode(engine, logits, max_new, follow, own_nll, on_step)
    return dict(out, prefill_s=prefill_s, decode_s=time.perf_counter() - t0)


def decode(engine, logits: torch.Tensor, max_new: int, follow: list[int] | None = None, own_nll: bool = False,
           on_step: Callable[[], None] | None = None) -> dict:
    """From `logits` (the prefill's), pick the argmax until EOS, max_new tokens or a full context. Returns the
    answer (EOS not included), `picked` (the answer, plus the EOS when it stopped there), the stop reason, and
    NLL terms: of its own picks (own_nll), or of `follow` (a reference answer) at every position where the picks
    so far equal follow's (while the two paths agree, teacher forcing along follow is this very computation).
    on_step() runs after every decode step."""
    eos = engine.eos_ids
    lp, tok = _pick(logits)
    out, picked, nll, agree, stop = [], [], [], [], ""
    while True:
        j = len(picked)
        if own_nll:
            nll.append(-float(lp[tok]))
        elif follow is not None and j < len(follow) and picked == follow[:j]:
            nll.append(-float(lp[follow[j]]))
            agree.append(tok == follow[j])
        picked.append(tok)
        if tok in eos:
            stop = "eos"
            break
        out.append(tok)
        if len(out) >= max_new:
            stop = "length"
            break
        if len(engine.tokens) + 1 > engine.max_len:
            stop = "context full"
            break
        lp, tok = _pick(engine.forward([tok]))
        if on_step is not None:
            on_step()
    return {"answer": out, "picked": picked, "stop": stop, "nll": nll, "agree": agree}


def teacher_force(engine, ids: list[int], answer: list[int]) -> tuple[list[float], list[bool]]:
    """Prefill ids, then force() the answer."""
    return force(engine, engine.forward(ids), answer)


def force(engine, logits: torch.Tensor, answer: list[int]) -> tuple[list[float], list[bool]]:
    """From `logits` (the prefill's), feed answer[:-1]: per answer token its NLL and whether it was the argmax."""
    nll, agree = [], []
    for j, t in enumerate(answer):
        lp, tok = _pick(logits)
        nll.append(-float(lp[t]))
        agree.append(tok == t)
        if j + 1 < len(answer):
            logits = engine.forward([t])
    return nll, agree


def run_sample(loaded, settings: MethodSettings, sample: Sample, max_new: int, question: str = "after",
               reference: list[int] | None = None) -> dict:
    """Greedy-decode one sample with a fresh cache and score it. NLL per answer token: for full (reference
    None and method full), of its own answer (`answer_ids`); with a reference (full's answer_ids), of that
    answer under this method, teacher-forced (a second prefill on a fresh cache only when the greedy path
    left the reference: `tf` 'separate', else 'shared'), with `agree` = % of its tokens that were the argmax."""
    from tailorkv.engine.generate import Engine
    from tailorkv.engine.methods import build_cache

    tok = loaded.tokenizer
    ids = prompt_ids(tok, sample, question)
    max_len = len(ids) + max_new + MARGIN
    cache = build_cache(loaded, settings, max_len)
    engine = Engine(loaded, cache)
    fracs: dict[str, list[float]] = {"loaded_frac": [], "attended_frac": []}

    def on_step() -> None:
        for k, v in step_fractions(cache, len(engine.tokens)).items():
            fracs[k].append(v)

    own = reference is None and settings.method == "full"
    with torch.inference_mode():
        g = greedy(engine, ids, max_new, follow=reference, own_nll=own, on_step=on_step)
    pred = tok.decode(g["answer"], skip_special_tokens=True)
    rec = {"prompt_tokens": len(ids), "prediction": pred, "new_tokens": len(g["answer"]), "stop": g["stop"],
           "score": 100.0 * score(pred, sample.answers, sample.metric),
           "loaded_frac": mean_or_none(fracs["loaded_frac"]), "attended_frac": mean_or_none(fracs["attended_frac"]),
           "prefill_s": g["prefill_s"], "decode_s": g["decode_s"], "nll": None, "nll_tokens": 0}
    nll, agree = g["nll"], g["agree"]
    if own:
        rec["answer_ids"] = g["picked"]
        agree = [True] * len(nll)
    elif reference:
        rec["tf"] = "shared"
        if len(nll) < len(reference):
            del engine, cache  # free this cache before the next
            rec["tf"] = "separate"
            with torch.inference_mode():
                nll, agree = teacher_force(Engine(loaded, build_cache(loaded, settings, max_len)), ids, reference)
    if nll:
        rec.update(nll=statistics.fmean(nll), nll_tokens=len(nll), agree=100.0 * statistics.fmean(agree))
    return rec


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
    out: list[dict] = []
    full: dict = {}
    for b, m in plan.runs():
        rec = {"index": index[(item["index"], b, m)], "item": item["index"], "kind": "task", "length": n,
               "budget": b, "method": m, "task": sample.task, "sample": item["sample"],
               "prompt_hash": sample.prompt_hash, "n_tokens": sample.n_tokens, "target_tokens": sample.target_tokens,
               "depth": sample.depth, "answers": list(sample.answers), "metric": sample.metric,
               "max_new_tokens": max_new}
        say(m if b is None else f"{m} @ {b}")
        settings = plan.settings(m, n, b)
        ref = full.get("answer_ids") if m != "full" else None
        out.append(_run_one(rec, lambda: run_sample(loaded, settings, sample, max_new, plan.question, ref), device))
        if m == "full" and rec["status"] == "ok":
            full = rec
        if ref is not None and rec.get("nll") is not None:
            rec["dnll"] = rec["nll"] - full["nll"]
        elif m == "full" and rec.get("nll") is not None:
            rec["dnll"] = 0.0
    return out


def check_methods(loaded, plan: EvalPlan) -> None:
    """Build a tiny cache for every (budget, method, length) setting so configuration errors (no layer profile,
    a budget a policy refuses) surface once, as one clear message, before any work."""
    from tailorkv.engine.methods import build_cache
    for n in plan.lengths:
        for b, m in plan.runs():
            s = plan.settings(m, n, b)
            try:
                build_cache(loaded, s, 64)
            except InputError as e:
                where = "" if b is None else f" budget {b}"
                raise InputError(f"{m} at length {length_label(n)}{where} ({s.budget} tokens = sink {s.sink} + "
                                 f"top-K {s.topk} + recent {s.recent}): {e}") from None
    if plan.samples:
        from tailorkv.models.loader import require_tokenizer
        require_tokenizer(loaded)

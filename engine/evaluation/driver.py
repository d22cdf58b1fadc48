"""The driver behind `tailorkv eval`: task accuracy of every method against the full cache on one loaded model.

Pure functions, no CLI (engine/evaluation/command.py is the command). One work item is either
- a task item (length, method, sample): build a fresh cache for the method (max_len = prompt + max new + 16),
  greedy-decode the sample's prompt, score the answer (scoring.score x 100); or
- a fidelity item (length, method): teacher-forced comparison with the full cache (fidelity.py).
The flattened list of items (task items: lengths, then methods, then samples; then fidelity items: lengths,
then methods) is what `--shard i/n` splits: shard i runs the items whose index % n == i, so the shards of one
plan partition it exactly and `eval-merge` puts the records back in index order.

Conventions (written down here because they change the numbers):
- Prompt: the user message is ``question.strip() + "\\n\\n" + context + question`` (the question is stated
  before and after the long text), rendered with the model's chat template, then the sample's answer_prefix
  appended to the assistant turn, so the model continues e.g. "The pass key is ...". BOS is prepended only when
  the tokenizer wants one and the template does not write it (as engine.chat.ChatSession does).
- Length: RULER's convention. --lengths L is the whole sequence: chat template + prompt + the task's max new
  tokens fit in L. Each task's text is fitted to L - max_new - overhead, where overhead (template, the question
  stated first, the answer prefix) is measured on a probe sample of that task at that length.
- Budget: every method gets the same knobs (budget, sink, recent, channels, bits, quant layers).
  With --budget-frac F the budget at length L is round(F * L); if sink + recent exceed half of it they are scaled
  down (proportionally, rounded down) to fit in budget // 2, so top-K keeps at least half; SnapKV's observation
  window is capped at budget // 2 the same way. Quest still needs budget >= one page (16 tokens).
- Tokens loaded: per decode step, from the cache's stats() (the step's counters, summed over layers):
  ``loaded_frac``   sparse-offload layers (tailorkv): tokens_fetched / (n_loading_layers * context), the share of
                    the context brought from host memory (top-K; the paper's "loading 1-3% of tokens");
  ``attended_frac`` tokens each token-selecting layer attends to / context: its tokens_attended counter
                    (streamingllm, snapkv, quest; tailorkv's sparse layers: sink + fetched + tail).
  context = tokens held after the step. Both are the mean over the sample's decode steps (prefill excluded);
  None for methods without such counters (full).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from tailorkv.engine import ui
from tailorkv.models.tokenizer import bos_prefix
from tailorkv.engine.evaluation.scoring import score
from tailorkv.engine.evaluation.tasks import TASKS, Sample, make_suite
from tailorkv.engine.settings import METHODS, MethodSettings

SCHEMA = 1
KIND = "tailorkv-eval"
MARGIN = 16  # free cache slots after prompt + max new tokens

# greedy tokens generated per task: enough for the whole answer (digits are one token each in SmolLM2)
MAX_NEW_TOKENS = {
    "passkey": 32,
    "niah_single": 32,
    "niah_single_essay": 32,
    "niah_multikey": 32,
    "niah_multivalue": 64,    # 4 values of 7 digits
    "niah_multiquery": 64,    # 4 keys' values
    "variable_tracking": 48,
    "common_words": 120,
    "frequent_words": 48,
}
DEFAULT_MAX_NEW = 64        # a task not in the table
TIMING_KEYS = ("prefill_s", "decode_s", "wall_s")  # the only record fields that differ between identical runs


# ------------------------------------------------------------------------------------------------ parsing
def parse_length(text: str) -> int:
    """'4096', '4k', '0.5k', '1m' -> tokens (k = 1024). ValueError naming --lengths otherwise."""
    n = ui.parse_length(text, "--lengths")
    if n < 64:
        raise ValueError(f"--lengths: {text} is too short; use at least 64 tokens")
    return n


def parse_lengths(text: str) -> list[int]:
    parts = ui.split_list(text)
    if not parts:
        raise ValueError("--lengths is empty: give at least one length, e.g. 4k")
    out = []
    for p in parts:
        n = parse_length(p)
        if n not in out:
            out.append(n)
    return out


def parse_methods(text: str) -> list[str]:
    names = ui.split_list(text)
    if not names:
        raise ValueError(f"--methods is empty: name at least one of {', '.join(METHODS)}")
    bad = [m for m in names if m not in METHODS]
    if bad:
        raise ValueError(f"unknown method '{bad[0]}' in --methods: choose from {', '.join(METHODS)}")
    return names


def parse_tasks(text: str | None) -> list[str]:
    names = ui.split_list(text) or list(TASKS)
    bad = [t for t in names if t not in TASKS]
    if bad:
        raise ValueError(f"unknown task '{bad[0]}' in --tasks: choose from {', '.join(TASKS)}")
    return names


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'i/n' with 0 <= i < n -> (i, n); None -> None."""
    if text is None:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard '{text}' is not i/n: write e.g. 0/4 (shards 0/4 .. 3/4)") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard {text}: need 0 <= i < n, e.g. 0/4 .. 3/4")
    return i, n


def length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def shard_filename(i: int, n: int) -> str:
    return f"eval.shard-{i}-of-{n}.json"


# ------------------------------------------------------------------------------------------------ settings
def budget_from_frac(frac: float, length: int, sink: int, recent: int) -> tuple[int, int, int]:
    """(budget, sink, recent) at `length` for --budget-frac: budget = round(frac * length) (at least 2);
    sink + recent scaled down (proportionally, rounded down) to fit in budget // 2 when they exceed it."""
    if not 0 < frac <= 1:
        raise ValueError(f"--budget-frac must be in (0, 1], got {frac}")
    budget = max(2, round(frac * length))
    half = budget // 2
    if sink + recent > half:
        total = sink + recent
        sink = sink * half // total
        recent = half - sink
    return budget, sink, recent


def settings_for(base: MethodSettings, method: str, length: int, budget_frac: float | None) -> MethodSettings:
    """The settings of `method` at `length`: the shared knobs of `base`, with --budget-frac applied."""
    s = dataclasses.replace(base, method=method, extra=dict(base.extra))
    if budget_frac:
        s.budget, s.sink, s.recent = budget_from_frac(budget_frac, length, base.sink, base.recent)
        s.snap_window = max(1, min(base.snap_window, s.budget // 2))
    s.validate()
    return s


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class EvalPlan:
    lengths: list[int]
    methods: list[str]
    tasks: list[str]
    samples: int                        # per task and length
    seed: int = 0
    base: MethodSettings = field(default_factory=MethodSettings)
    budget_frac: float | None = None
    max_new_tokens: int | None = None   # overrides MAX_NEW_TOKENS for every task
    fidelity_tokens: int = 0            # 0: no fidelity items

    def validate(self) -> None:
        if not self.lengths:
            raise ValueError("--lengths is empty: give at least one length, e.g. 4k")
        if not self.methods:
            raise ValueError("--methods is empty")
        if self.samples < 0:
            raise ValueError("--samples must be 0 or more")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be at least 1")
        if self.fidelity_tokens < 0:
            raise ValueError("--fidelity-tokens must be 0 (off) or more")
        if self.samples == 0 and not self.fidelity_tokens:
            raise ValueError("nothing to do: --samples 0 and no --fidelity-tokens")
        for n in self.lengths:
            if self.fidelity_tokens and self.fidelity_tokens >= n:
                raise ValueError(f"--fidelity-tokens {self.fidelity_tokens} must be smaller than the length {n}")
        for n in self.lengths:
            for m in self.methods:
                settings_for(self.base, m, n, self.budget_frac)

    def max_new(self, task: str) -> int:
        return self.max_new_tokens or MAX_NEW_TOKENS.get(task, DEFAULT_MAX_NEW)

    def settings(self, method: str, length: int) -> MethodSettings:
        return settings_for(self.base, method, length, self.budget_frac)

    def items(self) -> list[dict]:
        """Every work item in plan order; item["index"] is its position."""
        out: list[dict] = []
        if self.samples:
            for n in self.lengths:
                for m in self.methods:
                    for ti, task in enumerate(self.tasks):
                        for s in range(self.samples):
                            out.append({"kind": "task", "length": n, "method": m, "task": task, "sample": s,
                                        "suite_index": ti * self.samples + s})
        if self.fidelity_tokens:
            for n in self.lengths:
                for m in self.methods:
                    out.append({"kind": "fidelity", "length": n, "method": m})
        for i, it in enumerate(out):
            it["index"] = i
        return out

    def to_dict(self) -> dict:
        return {"lengths": self.lengths, "methods": self.methods, "tasks": self.tasks,
                "samples_per_task": self.samples, "seed": self.seed, "budget_frac": self.budget_frac,
                "max_new_tokens": {t: self.max_new(t) for t in self.tasks},
                "max_new_tokens_override": self.max_new_tokens, "fidelity_tokens": self.fidelity_tokens,
                "base_settings": self.base.to_dict(), "n_items": len(self.items()), "margin": MARGIN,
                "length_convention": "chat template + prompt + max new tokens fit in the length (RULER)",
                "budget_convention": ("same knobs for every method; --budget-frac F: budget = round(F * length), "
                                      "sink + recent scaled to fit budget // 2, snapkv window <= budget // 2")}

    def settings_dict(self) -> dict:
        return {str(n): {m: self.settings(m, n).to_dict() for m in self.methods} for n in self.lengths}


def shard_items(items: list[dict], shard: tuple[int, int] | None) -> list[dict]:
    if shard is None:
        return list(items)
    i, n = shard
    return [it for it in items if it["index"] % n == i]


# ------------------------------------------------------------------------------------------------ prompts
def user_message(sample: Sample) -> str:
    """The question before and after the long text."""
    return sample.question.strip() + "\n\n" + sample.context + sample.question


def render_prompt(tokenizer, sample: Sample) -> str:
    """Chat-templated user message, then the answer prefix at the start of the assistant turn."""
    msg = [{"role": "user", "content": user_message(sample)}]
    if hasattr(tokenizer, "apply_chat_template"):
        text = tokenizer.apply_chat_template(msg, add_generation_prompt=True)
    else:  # a bare test tokenizer
        text = f"user: {msg[0]['content']}\nassistant: "
    return text + sample.answer_prefix


def prompt_ids(tokenizer, sample: Sample) -> list[int]:
    return bos_prefix(tokenizer) + tokenizer.encode(render_prompt(tokenizer, sample))


def build_suites(tokenizer, plan: EvalPlan, lengths: Iterable[int] | None = None) -> dict[int, list[Sample]]:
    """The samples of each length, identical for every method: per task, the text is fitted so that the
    rendered prompt plus the task's max new tokens fit in the length (overhead measured on a probe sample).
    The suite is ordered like make_suite's: tasks in plan order, samples_per_task each."""
    out: dict[int, list[Sample]] = {}
    if not plan.samples:
        return out
    for n in (plan.lengths if lengths is None else lengths):
        suite: list[Sample] = []
        for task in plan.tasks:
            room = n - plan.max_new(task)
            probe = make_suite(tokenizer, room, 1, plan.seed, tasks=[task])[0]
            overhead = len(prompt_ids(tokenizer, probe)) - probe.n_tokens
            target = room - overhead
            if target < 16:
                raise ValueError(f"--lengths {n} leaves no room for {task}: the prompt template and "
                                 f"{plan.max_new(task)} new tokens need more; use a longer length")
            suite += make_suite(tokenizer, target, plan.samples, plan.seed, tasks=[task])
        out[n] = suite
    return out


def suite_hash(suites: dict[int, list[Sample]]) -> str:
    h = hashlib.sha256()
    for n in sorted(suites):
        for s in suites[n]:
            h.update(f"{n}:{s.task}:{s.prompt_hash};".encode())
    return h.hexdigest()[:16]


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


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def run_sample(loaded, settings: MethodSettings, sample: Sample, max_new: int) -> dict:
    """Greedy-decode one sample with a fresh cache; returns the record's measured fields."""
    from tailorkv.engine.generate import Engine
    from tailorkv.engine.methods import build_cache

    tok = loaded.tokenizer
    ids = prompt_ids(tok, sample)
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


def run_item(loaded, plan: EvalPlan, item: dict, suites: dict[int, list[Sample]], texts: dict | None = None,
             on_phase: Callable[[str], None] | None = None) -> dict:
    """One work item -> its record. Never raises for a failing method: status 'ok', 'oom' or 'error'."""
    from tailorkv.engine.bench.driver import free_device
    device = loaded.model.output_weight.device
    n, m = item["length"], item["method"]
    settings = plan.settings(m, n)
    rec: dict = {"index": item["index"], "kind": item["kind"], "length": n, "method": m}
    if item["kind"] == "task":
        sample = suites[n][item["suite_index"]]
        rec.update(task=sample.task, sample=item["sample"], prompt_hash=sample.prompt_hash,
                   n_tokens=sample.n_tokens, target_tokens=sample.target_tokens, depth=sample.depth,
                   answers=list(sample.answers), metric=sample.metric, max_new_tokens=plan.max_new(sample.task))
    else:
        rec.update(tokens=plan.fidelity_tokens)
    rec.update(status="ok", error=None)
    t0 = time.perf_counter()
    try:
        if item["kind"] == "task":
            rec.update(run_sample(loaded, settings, sample, plan.max_new(sample.task)))
        else:
            from tailorkv.engine.evaluation.fidelity import fidelity_ids, run_fidelity
            ids = texts.get(n) if texts is not None else None
            if ids is None:
                ids = fidelity_ids(loaded.tokenizer, n)
                if texts is not None:
                    texts[n] = ids
            rec.update(run_fidelity(loaded, settings, ids, plan.fidelity_tokens, on_phase=on_phase))
    except Exception as e:  # one failing item must not stop the run
        if item["kind"] == "task":
            rec.update(score=None, prediction=None)
        rec.update(_failure(e))
    rec["wall_s"] = time.perf_counter() - t0
    if rec["status"] != "ok":  # the exception's frames held the cache: give its memory back now
        free_device(device)    # (not after every item: gc.collect costs ~0.2 s and the cache is freed anyway)
    return rec


def check_methods(loaded, plan: EvalPlan) -> None:
    """Build a tiny cache for every (method, length) setting so configuration errors (no layer profile, a
    budget a policy refuses) surface once, as one clear message, before any work."""
    from tailorkv.engine.methods import build_cache
    for n in plan.lengths:
        for m in plan.methods:
            s = plan.settings(m, n)
            try:
                build_cache(loaded, s, 64)
            except ValueError as e:
                raise ValueError(f"{m} at length {length_label(n)} (budget {s.budget}, sink {s.sink}, "
                                 f"recent {s.recent}): {e}") from None
    if plan.samples and loaded.tokenizer is None:
        raise ValueError(f"{loaded.name} has no tokenizer here: pass --weights DIR with tokenizer.json")


# ------------------------------------------------------------------------------------------------ results
def results(*, command, args, env, model, plan: EvalPlan, shard, records: list[dict], suites_hash=None,
            layer_policies=None, merged_from=None) -> dict:
    tasks = sorted((r for r in records if r["kind"] == "task"), key=lambda r: r["index"])
    fid = sorted((r for r in records if r["kind"] == "fidelity"), key=lambda r: r["index"])
    expected = {it["index"] for it in shard_items(plan.items(), shard)}
    done = {r["index"] for r in records}
    return {
        "schema": SCHEMA,
        "kind": KIND,
        "command": command,
        "args": args,
        "env": env,
        "model": model,
        "eval": plan.to_dict(),
        "shard": None if shard is None else {"index": shard[0], "count": shard[1]},
        "merged_from": merged_from,
        "suites_hash": suites_hash,
        "settings": plan.settings_dict(),
        "layer_policies": layer_policies,  # per method: each layer's cache policy (tailorkv: quant / sparse)
        "complete": expected <= done,
        "records": tasks,
        "fidelity": fid,
        "summary": summarize(tasks, plan),
    }


def summarize(records: list[dict], plan: EvalPlan) -> dict:
    """Mean scores: per length, method and task (plus 'average' = mean over tasks, as RULER; None until every
    task has a scored sample), overall (mean over lengths), and the mean loaded/attended fractions.
    Failed samples are counted, not scored."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["length"], r["method"]), []).append(r)
    per: dict = {}
    for n in plan.lengths:
        L = per[str(n)] = {}
        for m in plan.methods:
            rs = groups.get((n, m), [])
            ok = [r for r in rs if r["status"] == "ok"]
            by_task: dict = {}
            for r in ok:
                by_task.setdefault(r["task"], []).append(r["score"])
            tasks = {t: _mean(by_task.get(t, [])) for t in plan.tasks}
            scored = [v for v in tasks.values() if v is not None]
            cell = {"tasks": tasks, "average": _mean(scored) if len(scored) == len(plan.tasks) else None,
                    "n": len(ok), "failed": len(rs) - len(ok)}
            for key in ("loaded_frac", "attended_frac"):
                cell[key] = _mean([r[key] for r in ok if r.get(key) is not None])
            L[m] = cell
    overall: dict = {}
    for m in plan.methods:
        cells = [per[str(n)][m] for n in plan.lengths]
        tasks = {}
        for t in plan.tasks:
            vals = [c["tasks"][t] for c in cells]
            tasks[t] = _mean(vals) if all(v is not None for v in vals) else None
        avgs = [c["average"] for c in cells]
        overall[m] = {"tasks": tasks, "average": _mean(avgs) if all(a is not None for a in avgs) else None,
                      "n": sum(c["n"] for c in cells), "failed": sum(c["failed"] for c in cells)}
    return {"per_length": per, "overall": overall}


def strip_timing(records: list[dict]) -> list[dict]:
    """Records without the fields that differ between two identical runs (timings)."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


# ------------------------------------------------------------------------------------------------ merging
def _plan_from(res: dict) -> EvalPlan:
    e = res["eval"]
    names = {f.name for f in dataclasses.fields(MethodSettings)}
    base = MethodSettings(**{k: v for k, v in e["base_settings"].items() if k in names})
    return EvalPlan(lengths=list(e["lengths"]), methods=list(e["methods"]), tasks=list(e["tasks"]),
                    samples=e["samples_per_task"], seed=e["seed"], base=base, budget_frac=e["budget_frac"],
                    max_new_tokens=e["max_new_tokens_override"], fidelity_tokens=e["fidelity_tokens"])


SAME_KEYS = ("schema", "kind", "eval", "settings", "layer_policies", "suites_hash")


def merge_shards(shards: list[tuple[str, dict]]) -> tuple[dict, list[str]]:
    """[(file name, shard results)] -> (merged results, warnings). Raises ValueError when the shards do not
    belong to one plan, overlap, or leave items out."""
    if not shards:
        raise ValueError("no eval.shard-*-of-*.json files to merge")
    name0, first = shards[0]
    count = first["shard"]["count"] if first.get("shard") else None
    if count is None:
        raise ValueError(f"{name0} is not a shard file (no 'shard' entry)")
    warnings: list[str] = []
    for name, res in shards[1:]:
        for key in SAME_KEYS:
            if res.get(key) != first.get(key):
                raise ValueError(f"{name} and {name0} differ in '{key}': they are not shards of one run")
        if (res.get("model") or {}).get("name") != (first.get("model") or {}).get("name"):
            raise ValueError(f"{name} and {name0} ran different models")
        if res["shard"]["count"] != count:
            raise ValueError(f"{name} is one of {res['shard']['count']} shards, {name0} one of {count}")
    got = sorted(res["shard"]["index"] for _, res in shards)
    if len(set(got)) != len(got):
        raise ValueError(f"shard numbers repeat: {got}")
    missing = sorted(set(range(count)) - set(got))
    if missing:
        raise ValueError(f"shards {missing} of {count} are missing: run them (--shard i/{count}) first")
    plan = _plan_from(first)
    records, seen = [], {}
    for name, res in shards:
        for r in res["records"] + res["fidelity"]:
            if r["index"] in seen:
                raise ValueError(f"item {r['index']} appears in {seen[r['index']]} and {name}")
            seen[r["index"]] = name
            records.append(r)
    want = {it["index"] for it in plan.items()}
    left = sorted(want - set(seen))
    if left:
        raise ValueError(f"{len(left)} items have no record (first: index {left[0]}): a shard did not finish; "
                         f"rerun it")
    commits = {res["env"].get("git_commit") for _, res in shards}
    if len(commits) > 1:
        warnings.append(f"the shards ran at different commits: {sorted(map(str, commits))}")
    merged = results(command=first["command"], args=first["args"], env=first["env"], model=first["model"],
                     plan=plan, shard=None, records=records, suites_hash=first.get("suites_hash"),
                     layer_policies=first.get("layer_policies"), merged_from=[{"file": name, "command": res["command"], "date": res["env"].get("date"),
                                   "git_commit": res["env"].get("git_commit")} for name, res in shards])
    return merged, warnings


def resumable_records(prev: dict, fresh: dict, name: str) -> list[dict]:
    """The finished ('ok') records of an earlier results file `prev` of the same run as `fresh` (an empty
    results dict of the run about to start). ValueError when `prev` belongs to another run."""
    fresh = json.loads(json.dumps(fresh, default=str))  # tuples -> lists, as read back from a file
    for key in SAME_KEYS + ("shard",):
        if prev.get(key) != fresh.get(key):
            raise ValueError(f"--resume: {name} holds another run (its '{key}' differs): use the command that "
                             f"wrote it, or another --out")
    if (prev.get("model") or {}).get("name") != (fresh.get("model") or {}).get("name"):
        raise ValueError(f"--resume: {name} ran another model: use another --out")
    return [r for r in prev["records"] + prev["fidelity"] if r["status"] == "ok"]


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)

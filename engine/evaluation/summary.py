"""eval.json's content: the results dict of a run (or of a shard, or of a merge) and its summary.

Summary statistics, per (budget group, length, method), over the samples that ran ok:
- ``average``: the mean over tasks of each task's mean score (RULER); None until every task has a score.
- ``average_se``: its standard error, stratified by task: sqrt(sum_t s_t^2 / n_t) / T (s_t the sample standard
  deviation of task t's scores); None while a task has fewer than 2 samples.
- ``diff`` / ``diff_se``: the same over the paired differences score(method) - score(full) of each sample.
- ``dnll`` / ``dnll_se``: the same over each sample's dNLL (nats per token of full's greedy answer, method minus
  full; driver.py); ``agree``: the mean % of full's answer tokens the method ranked first (teacher-forced).
Across lengths (``overall``): the mean of the per-length values, SE = sqrt(sum of squared SEs) / n_lengths.
Exact methods (full, offload) run once per sample; their cells appear in every budget group.
"""
from __future__ import annotations

import math
import statistics

from tailorkv.engine.evaluation.plan import EXACT_METHODS, EvalPlan, shard_items

SCHEMA = 2
KIND = "tailorkv-eval"
TIMING_KEYS = ("prefill_s", "decode_s", "wall_s")  # the only record fields that differ between identical runs


def mean_or_none(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def stratified(by_task: dict[str, list[float]], tasks: list[str]) -> tuple[float | None, float | None]:
    """(mean over tasks of the task means, its standard error): see the module doc."""
    if not tasks or any(not by_task.get(t) for t in tasks):
        return None, None
    mean = statistics.fmean(statistics.fmean(by_task[t]) for t in tasks)
    if any(len(by_task[t]) < 2 for t in tasks):
        return mean, None
    var = sum(statistics.variance(by_task[t]) / len(by_task[t]) for t in tasks)
    return mean, math.sqrt(var) / len(tasks)


def combine(values: list, ses: list) -> tuple[float | None, float | None]:
    """Mean of per-length values and the SE of that mean (independent lengths)."""
    if not values or any(v is None for v in values):
        return None, None
    se = None if any(s is None for s in ses) else math.sqrt(sum(s * s for s in ses)) / len(ses)
    return statistics.fmean(values), se


def results(*, command, args, env, model, plan: EvalPlan, shard, records: list[dict], suites_hash=None,
            layer_policies=None, merged_from=None, warnings=None) -> dict:
    tasks = sorted((r for r in records if r["kind"] == "task"), key=lambda r: r["index"])
    fid = sorted((r for r in records if r["kind"] == "fidelity"), key=lambda r: r["index"])
    keys = plan.record_keys()
    mine = {it["index"] for it in shard_items(plan.items(), shard)}
    expected = {i for i, key in enumerate(keys) if key[0] in mine}
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
        "layer_policies": layer_policies,  # per budget group and method: each layer's cache policy
        "warnings": warnings or [],      # e.g. a partial merge's missing shards
        "complete": expected <= done,
        "records": tasks,
        "fidelity": fid,
        "summary": summarize(tasks, plan),
    }


def _cell(rs: list[dict], full: dict, plan: EvalPlan) -> dict:
    ok = [r for r in rs if r["status"] == "ok"]
    scores: dict = {}
    diffs: dict = {}
    dnlls: dict = {}
    agree: list = []
    for r in ok:
        scores.setdefault(r["task"], []).append(r["score"])
        ref = full.get((r["length"], r["task"], r["sample"]))
        if ref is not None:
            diffs.setdefault(r["task"], []).append(r["score"] - ref)
        if r.get("dnll") is not None:
            dnlls.setdefault(r["task"], []).append(r["dnll"])
            agree.append(r["agree"])
    avg, avg_se = stratified(scores, plan.tasks)
    diff, diff_se = stratified(diffs, plan.tasks)
    dnll, dnll_se = stratified(dnlls, plan.tasks)
    cell = {"tasks": {t: mean_or_none(scores.get(t, [])) for t in plan.tasks}, "average": avg, "average_se": avg_se,
            "diff": diff, "diff_se": diff_se, "dnll": dnll, "dnll_se": dnll_se, "agree": mean_or_none(agree),
            "n": len(ok), "failed": len(rs) - len(ok)}
    for key in ("loaded_frac", "attended_frac"):
        cell[key] = mean_or_none([r[key] for r in ok if r.get(key) is not None])
    return cell


def summarize(records: list[dict], plan: EvalPlan) -> dict:
    """{"budgets": {label: {"per_length": {length: {method: cell}}, "overall": {method: cell}}}}: see the
    module doc. Failed samples are counted, not scored."""
    groups: dict = {}
    full: dict = {}
    for r in records:
        groups.setdefault((r["budget"], r["length"], r["method"]), []).append(r)
        if r["method"] == "full" and r["status"] == "ok":
            full[(r["length"], r["task"], r["sample"])] = r["score"]
    out: dict = {}
    for b in plan.budgets:
        per: dict = {}
        for n in plan.lengths:
            per[str(n)] = {m: _cell(groups.get((None if m in EXACT_METHODS else b.label, n, m), []), full, plan)
                           for m in plan.methods}
            for m in plan.methods:
                per[str(n)][m]["budget_tokens"] = None if m in EXACT_METHODS else plan.settings(m, n, b.label).budget
        overall: dict = {}
        for m in plan.methods:
            cells = [per[str(n)][m] for n in plan.lengths]
            tasks = {t: combine([c["tasks"][t] for c in cells], [0.0] * len(cells))[0] for t in plan.tasks}
            avg, avg_se = combine([c["average"] for c in cells], [c["average_se"] for c in cells])
            diff, diff_se = combine([c["diff"] for c in cells], [c["diff_se"] for c in cells])
            dnll, dnll_se = combine([c["dnll"] for c in cells], [c["dnll_se"] for c in cells])
            agree = combine([c["agree"] for c in cells], [None] * len(cells))[0]
            overall[m] = {"tasks": tasks, "average": avg, "average_se": avg_se, "diff": diff, "diff_se": diff_se,
                          "dnll": dnll, "dnll_se": dnll_se, "agree": agree,
                          "n": sum(c["n"] for c in cells), "failed": sum(c["failed"] for c in cells)}
        out[b.label] = {"per_length": per, "overall": overall}
    return {"budgets": out}


def strip_timing(records: list[dict]) -> list[dict]:
    """Records without the fields that differ between two identical runs (timings)."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]

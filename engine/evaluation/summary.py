"""eval.json's content: the results dict of a run (or of a shard, or of a merge) and its summary."""
from __future__ import annotations

import statistics

from tailorkv.engine.evaluation.plan import EvalPlan, shard_items

SCHEMA = 2
KIND = "tailorkv-eval"
TIMING_KEYS = ("prefill_s", "decode_s", "wall_s")  # the only record fields that differ between identical runs


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


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

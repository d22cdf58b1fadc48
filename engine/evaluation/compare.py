"""`tailorkv eval-compare A B`: one method's samples in two eval runs (or two methods', --against), paired, B - A.

Two runs that differ in a knob (``--kt-bits 16`` and ``8``, two commits, two selection rules) ran the same prompts
when their lengths, tasks, samples, seed and question placement agree; their task records pair by (length, budget
group, prompt). Per (budget, length) and over lengths, the paired score difference and the difference of the dNLLs
of full's answers carry standard errors stratified by task (summary.py's rules); per task, the plain SE. "same"
counts the samples whose greedy answers are the same text. Fidelity records pair by (length, budget).
"""
from __future__ import annotations

import os

from tailorkv.engine.errors import InputError
from tailorkv.engine.evaluation.merge import read_results
from tailorkv.engine.evaluation.plan import EXACT_METHODS, length_label
from tailorkv.engine.evaluation.summary import combine, stratified

FIDELITY_KEYS = ("top1_agreement", "kl_mean", "attn_recall")


def results_path(path: str) -> str:
    """An eval.json, or a folder holding one."""
    if os.path.isdir(path):
        inside = os.path.join(path, "eval.json")
        if not os.path.isfile(inside):
            raise InputError(f"{path} holds no eval.json: give a `tailorkv eval --out` folder or its eval.json "
                             f"(shards: `tailorkv eval-merge {path}` first)")
        return inside
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file: give an eval.json or the folder that holds it")
    return path


def _ok_methods(res: dict) -> set[str]:
    return {r["method"] for r in res["records"] + res["fidelity"] if r["status"] == "ok"}


def pick_method(a: dict, b: dict, method: str | None, against: str | None = None) -> tuple[str, str]:
    """(A's method, B's method): the ones named (--method, and --against for B), or the one method with a budget
    that both runs ran."""
    in_a, in_b = _ok_methods(a), _ok_methods(b)
    if against is not None and method is None:
        raise InputError(f"--against {against} pairs it with A's --method: name that one too, e.g. --method full")
    if method is not None:
        for name, have, m, flag in (("A", in_a, method, "--method"), ("B", in_b, against or method,
                                                                      "--against" if against else "--method")):
            if m not in have:
                raise InputError(f"{flag} {m}: run {name} has no finished record of it (it has "
                                 f"{', '.join(sorted(have)) or 'none'})")
        return method, against or method
    both = sorted((in_a & in_b) - set(EXACT_METHODS))
    if len(both) != 1:
        raise InputError(f"name the method to compare with --method: both runs ran "
                         f"{', '.join(sorted(in_a & in_b)) or 'no method in common'}")
    return both[0], both[0]


def settings_changed(a: dict, b: dict, method: str, method_b: str) -> list[str]:
    """'knob: A -> B' for each setting that differs between A's method and B's (where both ran a cell)."""
    out = [f"method: {method} -> {method_b}"] if method != method_b else []
    for group, by_length in (a.get("settings") or {}).items():
        for n, by_method in by_length.items():
            sa = by_method.get(method)
            sb = ((b.get("settings") or {}).get(group) or {}).get(n, {}).get(method_b)
            if sa is None or sb is None:
                continue
            for k in sorted(set(sa) | set(sb)):
                line = f"{k}: {sa.get(k)} -> {sb.get(k)}"
                if sa.get(k) != sb.get(k) and line not in out:
                    out.append(line)
    return out


def _diffs(pairs: list[tuple[dict, dict]], field: str) -> dict[str, list[float]]:
    by_task: dict[str, list[float]] = {}
    for ra, rb in pairs:
        if ra.get(field) is not None and rb.get(field) is not None:
            by_task.setdefault(ra["task"], []).append(rb[field] - ra[field])
    return by_task


def _row(pairs: list[tuple[dict, dict]], tasks: list[str]) -> dict:
    score, score_se = stratified(_diffs(pairs, "score"), tasks)
    dnll_by_task = _diffs(pairs, "dnll")
    dnll, dnll_se = stratified(dnll_by_task, tasks) if dnll_by_task else (None, None)
    return {"n": len(pairs), "score_a": stratified({t: [ra["score"] for ra, _ in pairs if ra["task"] == t]
                                                    for t in tasks}, tasks)[0],
            "score_b": stratified({t: [rb["score"] for _, rb in pairs if rb["task"] == t] for t in tasks}, tasks)[0],
            "diff": score, "diff_se": score_se, "dnll_diff": dnll, "dnll_diff_se": dnll_se,
            "same_answer": sum(ra.get("prediction") == rb.get("prediction") for ra, rb in pairs)}


def _keyed(res: dict, method: str, groups: list) -> dict:
    """A method's finished task records by (budget, length, prompt); an exact method's (budget None) under each
    of `groups` when those are budgets, to pair with a budgeted method."""
    out = {}
    for r in res["records"]:
        if r["method"] == method and r["status"] == "ok":
            for g in (groups if r["budget"] is None else [r["budget"]]):
                out[(g, r["length"], r["prompt_hash"])] = r
    return out


def compare(a: dict, b: dict, method: str, method_b: str | None = None) -> dict:
    """B's method_b (default: method) against A's method, sample by sample."""
    method_b = method_b or method
    budgets = [{r["budget"] for r in res["records"] if r["method"] == m} for res, m in ((a, method), (b, method_b))]
    ra, rb = _keyed(a, method, sorted(budgets[1], key=str)), _keyed(b, method_b, sorted(budgets[0], key=str))
    keys = [k for k in ra if k in rb]
    if not keys:
        raise InputError(f"no {method} sample finished in both runs with the same length, budget and prompt: "
                         f"compare runs of the same --lengths, --tasks, --samples, --seed and --question (and "
                         f"budget groups)")
    cells, groups = [], {}
    for group in dict.fromkeys(k[0] for k in keys):
        rows = []
        for n in sorted({k[1] for k in keys if k[0] == group}):
            pairs = [(ra[k], rb[k]) for k in keys if k[:2] == (group, n)]
            tasks = sorted({p[0]["task"] for p in pairs})
            rows.append(dict(_row(pairs, tasks), budget=group, length=n))
        cells += rows
        g = {"n": sum(r["n"] for r in rows), "same_answer": sum(r["same_answer"] for r in rows)}
        for f, se in (("diff", "diff_se"), ("dnll_diff", "dnll_diff_se"), ("score_a", None), ("score_b", None)):
            g[f], spread = combine([r[f] for r in rows], [r[se] if se else None for r in rows])
            if se:
                g[se] = spread
        groups[str(group)] = g
    by_task = {}
    for t in sorted({ra[k]["task"] for k in keys}):
        pairs = [(ra[k], rb[k]) for k in keys if ra[k]["task"] == t]
        by_task[t] = _row(pairs, [t])
    fidelity = []
    ok_b = {(f["length"], f["budget"]): f for f in b["fidelity"] if f["method"] == method_b and f["status"] == "ok"}
    for fa in a["fidelity"]:
        fb = ok_b.get((fa["length"], fa["budget"]))
        if fa["method"] == method and fa["status"] == "ok" and fb is not None:
            fidelity.append({"length": fa["length"], "budget": fa["budget"],
                             **{k: [fa.get(k), fb.get(k)] for k in FIDELITY_KEYS}})
    return {"method": method if method == method_b else f"{method} -> {method_b}",
            "changed": settings_changed(a, b, method, method_b), "paired": len(keys),
            "only_a": len(ra) - len(keys), "only_b": len(rb) - len(keys), "cells": cells, "groups": groups,
            "tasks": by_task, "fidelity": fidelity}


def cell_rows(cmp: dict) -> list[tuple[str, dict]]:
    """(label, figures) per budget group and length, then the group's mean over lengths where it has several."""
    rows = []
    for group, g in cmp["groups"].items():
        name = "" if group == "None" else f"budget {group}, "
        mine = [c for c in cmp["cells"] if str(c["budget"]) == group]
        rows += [(f"{name}{length_label(c['length'])}", c) for c in mine]
        if len(mine) > 1:
            rows.append((f"{name}mean over lengths", g))
    return rows


def _pm(v, se, fmt="+.1f") -> str:
    if v is None:
        return "-"
    return f"{v:{fmt}}" + ("" if se is None else f" ± {se:{fmt[1:]}}")


def tables(cmp: dict):
    from rich.table import Table
    cols = ("n", "A", "B", "B - A", "same answer", "dNLL B - A")

    def table(title: str, first: str, rows: list[tuple[str, dict]]) -> Table:
        t = Table(title=title, title_justify="left")
        t.add_column(first)
        for c in cols:
            t.add_column(c, justify="right")
        for label, r in rows:
            t.add_row(label, str(r["n"]), _pm(r["score_a"], None, ".1f"), _pm(r["score_b"], None, ".1f"),
                      _pm(r["diff"], r["diff_se"]), f"{r['same_answer']}/{r['n']}",
                      _pm(r["dnll_diff"], r["dnll_diff_se"], "+.4f"))
        return t

    out = [table(f"{cmp['method']}: score (mean over tasks), paired B - A", "budget, length", cell_rows(cmp)),
           table("per task, over every length and budget", "task", list(cmp["tasks"].items()))]
    if cmp["fidelity"]:
        t = Table(title="fidelity vs full (teacher-forced essay text), A -> B", title_justify="left")
        for c in ("length", "budget", "top-1 %", "KL mean", "attn recall"):
            t.add_column(c, justify="right")
        for f in cmp["fidelity"]:
            cells = [f"{x:.{d}f} -> {y:.{d}f}" if x is not None and y is not None else "-"
                     for (x, y), d in zip((f[k] for k in FIDELITY_KEYS), (1, 4, 4))]
            t.add_row(length_label(f["length"]), str(f["budget"] or "-"), *cells)
        out.append(t)
    return out


def load_pair(path_a: str, path_b: str) -> tuple[dict, dict]:
    return read_results(results_path(path_a)), read_results(results_path(path_b))


"""One-line descriptions of an eval run that the tables (report.py) and the charts (plots.py) share."""
from __future__ import annotations

from tailorkv.engine.ui import count


def title_line(res: dict) -> str:
    m, e = res.get("model") or {}, res["eval"]
    env = res.get("env") or {}
    where = env.get("gpu") or env.get("device") or "?"
    samples = f"{count(e['samples_per_task'], 'sample')}/task"
    if res.get("complete") is False:  # a partial merge, or a shard's own file
        samples = f"up to {samples} (partial: {count(len(res.get('records', [])), 'record')})"
    return (f"{m.get('name', '?')} on {where}; {samples}, seed {e['seed']}, "
            f"question {e['question']}, protocol {e['protocol']}, {budget_line(e)}")


def budget_line(e: dict) -> str:
    """The budget groups (where a method with a budget ran) and tailorkv's bits and r (where it ran)."""
    from tailorkv.engine.evaluation.budgets import budgeted
    b, methods = e["base_settings"], e.get("methods") or []
    parts = []
    if budgeted(methods):
        parts.append(f"budgets {', '.join(g['label'] for g in e['budgets'])} (split {e['split']})")
    if "tailorkv" in methods:
        parts.append(f"{b['bits']}-bit quant layers, r = {b['channels']} channels")
    return ", ".join(parts) or "no budgets (every method keeps every token)"


def split_text(s: dict) -> str:
    return f"{s['budget']} = {s['sink']} sink + {max(0, s['budget'] - s['sink'] - s['recent'])} top-K + " \
           f"{s['recent']} recent, r {s['channels']}"

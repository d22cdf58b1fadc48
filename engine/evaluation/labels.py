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
    """The budget groups (where a method with a budget ran) and tailorkv's bits and r (where it ran): the split
    named only where a group uses it (192 and 1024 bring the paper's own sink, recent and r)."""
    from tailorkv.engine.evaluation.budgets import PAPER_SPLITS, budgeted
    b, methods, groups = e["base_settings"], e.get("methods") or [], e.get("budgets") or []
    parts = []
    if budgeted(methods):
        labels = ", ".join(g["label"] + (" (the paper's split)" if g.get("kind") == "paper" else "") for g in groups)
        split = any(g.get("kind") in ("frac", "tokens") for g in groups)
        parts.append(f"budgets {labels}" + (f" (split {e['split']})" if split else ""))
    if "tailorkv" in methods:
        rs = sorted({PAPER_SPLITS[g["tokens"]][2] if g.get("kind") == "paper" else b["channels"] for g in groups}
                    or {b["channels"]})
        parts.append(f"{b['bits']}-bit quant layers, r = {' / '.join(map(str, rs))} channels")
    return ", ".join(parts) or "no budgets (every method keeps every token)"


def split_text(s: dict) -> str:
    return f"{s['budget']} = {s['sink']} sink + {max(0, s['budget'] - s['sink'] - s['recent'])} top-K + " \
           f"{s['recent']} recent, r {s['channels']}"

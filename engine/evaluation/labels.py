"""One-line descriptions of an eval run that the tables (report.py) and the charts (plots.py) share."""
from __future__ import annotations


def title_line(res: dict) -> str:
    m, e = res.get("model") or {}, res["eval"]
    env = res.get("env") or {}
    where = env.get("gpu") or env.get("device") or "?"
    samples = f"{e['samples_per_task']} sample{'' if e['samples_per_task'] == 1 else 's'}/task"
    if res.get("complete") is False:  # a partial merge, or a shard's own file
        samples = f"up to {samples} (partial: {len(res.get('records', []))} records)"
    return (f"{m.get('name', '?')} on {where}; {samples}, seed {e['seed']}, "
            f"question {e['question']}, protocol {e['protocol']}, {budget_line(e)}")


def budget_line(e: dict) -> str:
    b = e["base_settings"]
    groups = ", ".join(g["label"] for g in e["budgets"])
    return f"budgets {groups} (split {e['split']}), {b['bits']}-bit quant layers, r = {b['channels']} channels"


def split_text(s: dict) -> str:
    return f"{s['budget']} = {s['sink']} sink + {max(0, s['budget'] - s['sink'] - s['recent'])} top-K + " \
           f"{s['recent']} recent, r {s['channels']}"

"""What `tailorkv eval` shows and writes: rich tables of an eval.json's summary and PNG charts (matplotlib Agg).

- score tables: one per length (rows: tasks + Average, plus the mean share of the context each method loaded
  from host / attended to; columns: methods) and one overall table (rows: lengths + Average);
- fidelity table: per (length, method), top-1 agreement with full, KL(full || method), NLL, attention recall;
- eval_scores.png: grouped bars of score per task per method, one panel per length (plus an 'avg' group);
- eval_fidelity.png (when fidelity ran): top-1 agreement and mean KL per method, grouped by length.
Every file is written atomically (a temporary file renamed over the old one).
"""
from __future__ import annotations

import os

from rich.table import Table

from tailorkv.engine.evaluation.plan import length_label


def _fmt(x, digits: int = 1, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.{digits}f}%" if pct else f"{x:.{digits}f}"


def title_line(res: dict) -> str:
    m, e = res.get("model") or {}, res["eval"]
    env = res.get("env") or {}
    where = env.get("gpu") or env.get("device") or "?"
    return f"{m.get('name', '?')} on {where}; {e['samples_per_task']} samples/task, seed {e['seed']}, {_budget(e)}"


def _budget(e: dict) -> str:
    b = e["base_settings"]
    budget = f"budget {e['budget_frac']:g} x length" if e.get("budget_frac") else f"budget {b['budget']}"
    return f"{budget}, {b['bits']}-bit quant layers, r = {b['channels']} channels"


def score_tables(res: dict) -> list[Table]:
    e, summ = res["eval"], res["summary"]
    methods, tasks = e["methods"], e["tasks"]
    out = []
    if not e["samples_per_task"]:
        return out
    for n in e["lengths"]:
        cells = summ["per_length"][str(n)]
        s = res["settings"][str(n)]
        any_m = next(iter(s.values()))
        topk = max(0, any_m["budget"] - any_m["sink"] - any_m["recent"])
        t = Table(title=f"length {length_label(n)}: score 0-100", title_justify="left", header_style="bold",
                  caption=f"budget {any_m['budget']} = {any_m['sink']} sink + {any_m['recent']} recent + "
                          f"{topk} top-K", caption_justify="left")
        t.add_column("task")
        for m in methods:
            t.add_column(m, justify="right")
        for task in tasks:
            t.add_row(task, *[_fmt(cells[m]["tasks"][task]) for m in methods])
        t.add_section()
        t.add_row("[bold]Average[/]", *[f"[bold]{_fmt(cells[m]['average'])}[/]" for m in methods])
        if any(cells[m]["loaded_frac"] is not None for m in methods):
            t.add_row("[dim]loaded from host[/]", *[_fmt(cells[m]["loaded_frac"], 2, True) for m in methods])
        if any(cells[m]["attended_frac"] is not None for m in methods):
            t.add_row("[dim]attended[/]", *[_fmt(cells[m]["attended_frac"], 2, True) for m in methods])
        failed = [f"{m}: {cells[m]['failed']}" for m in methods if cells[m]["failed"]]
        if failed:
            t.caption += f"\n[red]failed samples (not scored): {', '.join(failed)}[/]"
        out.append(t)
    t = Table(title="average score over tasks", title_justify="left", header_style="bold")
    t.add_column("length")
    for m in methods:
        t.add_column(m, justify="right")
    for n in e["lengths"]:
        cells = summ["per_length"][str(n)]
        t.add_row(length_label(n), *[_fmt(cells[m]["average"]) for m in methods])
    t.add_section()
    t.add_row("[bold]Average[/]", *[f"[bold]{_fmt(summ['overall'][m]['average'])}[/]" for m in methods])
    out.append(t)
    return out


def fidelity_table(res: dict) -> Table | None:
    recs = res.get("fidelity") or []
    if not recs:
        return None
    t = Table(title=f"fidelity vs full: {res['eval']['fidelity_tokens']} teacher-forced tokens of essay text "
                    f"after the prefix", title_justify="left", header_style="bold")
    for name in ("length", "method", "top-1 %", "KL mean", "KL p99", "KL max", "NLL full", "NLL method",
                 "attn recall"):
        t.add_column(name, justify="left" if name in ("length", "method") else "right")
    for r in sorted(recs, key=lambda r: r["index"]):
        if r["status"] != "ok":
            t.add_row(length_label(r["length"]), r["method"], f"[red]{r['status']}[/]", *[""] * 6)
            continue
        t.add_row(length_label(r["length"]), r["method"], _fmt(r["top1_agreement"]), _fmt(r["kl_mean"], 4),
                  _fmt(r["kl_p99"], 4), _fmt(r["kl_max"], 4), _fmt(r["nll_full"], 3), _fmt(r["nll_method"], 3),
                  _fmt(r.get("attn_recall"), 2, True))
    return t


# ------------------------------------------------------------------------------------------------ charts
def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str) -> None:
    from tailorkv.engine.results import write_atomic
    plt = _plt()
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", bbox_inches="tight"))
    plt.close(fig)


def plot_scores(res: dict, path: str) -> None:
    """Grouped bars: per length a panel, per task (and 'avg') a group, per method a bar."""
    plt = _plt()
    e, summ = res["eval"], res["summary"]
    methods, tasks, lengths = e["methods"], e["tasks"], e["lengths"]
    groups = tasks + ["avg"]
    cols = min(len(lengths), 2)
    rows = -(-len(lengths) // cols)
    width = max(6.0, 0.35 * len(groups) * max(len(methods), 2) + 1.5)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, 4.2 * rows), dpi=110, squeeze=False)
    bar = 0.8 / len(methods)
    label_all = len(groups) * len(methods) <= 40
    for k, n in enumerate(lengths):
        ax = axes[k // cols][k % cols]
        cells = summ["per_length"][str(n)]
        for i, m in enumerate(methods):
            vals = [cells[m]["tasks"][t] for t in tasks] + [cells[m]["average"]]
            xs = [g + (i - (len(methods) - 1) / 2) * bar for g in range(len(groups))]
            ax.bar(xs, [v if v is not None else 0 for v in vals], bar, color=f"C{i % 10}", label=m)
            for x, v in zip(xs, vals):  # a zero bar is invisible: say 0; a missing one: n/a
                if v is None or v == 0 or label_all:
                    ax.text(x, (v or 0) + 1, "n/a" if v is None else f"{v:.0f}", ha="center", va="bottom",
                            fontsize=6, rotation=90, color=f"C{i % 10}")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=8)
        ax.axvline(len(tasks) - 0.5, color="grey", lw=0.8, ls=":")
        ax.set_ylim(0, 112)
        ax.set_yticks(range(0, 101, 20))
        ax.set_ylabel("score (0-100)")
        s = next(iter(res["settings"][str(n)].values()))
        ax.set_title(f"length {length_label(n)}, budget {s['budget']}", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        if k == min(cols, len(lengths)) - 1:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for k in range(len(lengths), rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    fig.suptitle(f"task accuracy vs full cache\n{title_line(res)}", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def plot_fidelity(res: dict, path: str) -> None:
    plt = _plt()
    e = res["eval"]
    methods, lengths = e["methods"], e["lengths"]
    recs = {(r["length"], r["method"]): r for r in res["fidelity"] if r["status"] == "ok"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    bar = 0.8 / len(methods)
    for ax, key, label in ((axes[0], "top1_agreement", "top-1 agreement with full (%)"),
                           (axes[1], "kl_mean", "mean KL(full || method), nats")):
        for i, m in enumerate(methods):
            xs = [g + (i - (len(methods) - 1) / 2) * bar for g in range(len(lengths))]
            ax.bar(xs, [recs[(n, m)][key] if (n, m) in recs else 0 for n in lengths], bar,
                   color=f"C{i % 10}", label=m)
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels([length_label(n) for n in lengths])
        ax.set_xlabel("length")
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylim(0, 105)
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    m, env = res.get("model") or {}, res.get("env") or {}
    fig.suptitle(f"fidelity vs full over {e['fidelity_tokens']} teacher-forced tokens of essay text\n"
                 f"{m.get('name', '?')} on {env.get('gpu') or env.get('device') or '?'}, {_budget(e)}", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def write_outputs(res: dict, folder: str) -> list[str]:
    """eval.json plus the charts; returns the paths written."""
    from tailorkv.engine.results import write_json
    paths = [os.path.join(folder, "eval.json")]
    write_json(paths[0], res)
    if res["eval"]["samples_per_task"] and res["records"]:
        paths.append(os.path.join(folder, "eval_scores.png"))
        plot_scores(res, paths[-1])
    if res.get("fidelity"):
        paths.append(os.path.join(folder, "eval_fidelity.png"))
        plot_fidelity(res, paths[-1])
    return paths

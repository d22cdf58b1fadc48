"""What `tailorkv eval` shows and writes: rich tables of an eval.json's summary, and the files (plots.py draws).

- score tables: per budget group and length (rows: tasks, Average and its SE, the paired difference to full,
  dNLL of full's answers, the share of the context each method loaded from host / attended to; columns:
  methods), then per budget group one table over lengths, and with several groups a budget summary;
- fidelity table: per (length, budget, method), top-1 agreement with full, KL(full || method), NLL, attention
  recall.
Every file is written atomically (a temporary file renamed over the old one).
"""
from __future__ import annotations

import os

from rich.table import Table

from tailorkv.engine.evaluation.budgets import budgeted
from tailorkv.engine.evaluation.labels import split_text
from tailorkv.engine.evaluation.plan import length_label


def _fmt(x, digits: int = 1, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.{digits}f}%" if pct else f"{x:.{digits}f}"


def _pm(x, se, digits: int = 1, signed: bool = False) -> str:
    if x is None:
        return "-"
    v = f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"
    return v if se is None else f"{v} ± {se:.{digits}f}"


def _titled(title: str, caption: str | None = None) -> Table:
    """A table at least as wide as its title, which then stays on one line."""
    return Table(title=title, title_justify="left", header_style="bold", min_width=len(title), caption=caption,
                 caption_justify="left")


def score_tables(res: dict) -> list[Table]:
    e, summ = res["eval"], res["summary"]["budgets"]
    methods, tasks = e["methods"], e["tasks"]
    out: list[Table] = []
    if not e["samples_per_task"]:
        return out
    limited = bool(budgeted(methods))
    for g in e["budgets"]:
        label = g["label"]
        for n in e["lengths"]:
            cells = summ[label]["per_length"][str(n)]
            by_method = res["settings"][label][str(n)]
            s = by_method.get("tailorkv") or next(iter(by_method.values()))  # the split is tailorkv's
            t = _titled(f"{f'budget {label}, ' if limited else ''}length {length_label(n)}: score 0-100",
                        caption=(f"budget {split_text(s)}" if "tailorkv" in by_method else
                                 f"budget {s['budget']} tokens per layer" if limited else None))
            t.add_column("task")
            for m in methods:
                t.add_column(m, justify="right")
            for task in tasks:
                t.add_row(task, *[_fmt(cells[m]["tasks"][task]) for m in methods])
            t.add_section()
            t.add_row("[bold]Average[/]", *[f"[bold]{_fmt(cells[m]['average'])}[/]" for m in methods])
            t.add_row("[dim]± SE[/]", *[_fmt(cells[m]["average_se"]) for m in methods])
            t.add_row("vs full (paired)", *[_pm(cells[m]["diff"], cells[m]["diff_se"], signed=True) for m in methods])
            if any(cells[m].get("dnll") is not None for m in methods):
                t.add_row("dNLL nats/token", *[_pm(cells[m].get("dnll"), cells[m].get("dnll_se"), 3, True)
                                                for m in methods])
                t.add_row("[dim]top-1 = full's answer[/]", *[_fmt(cells[m].get("agree")) for m in methods])
            for key, name in (("loaded_frac", "loaded from host"), ("attended_frac", "attended")):
                if any(cells[m][key] is not None for m in methods):
                    t.add_row(f"[dim]{name}[/]", *[_fmt(cells[m][key], 2, True) for m in methods])
            failed = [f"{m}: {cells[m]['failed']}" for m in methods if cells[m]["failed"]]
            if failed:
                t.caption = (f"{t.caption}\n" if t.caption else "") + \
                    f"[red]failed samples (not scored): {', '.join(failed)}[/]"
            out.append(t)
        out.append(_over_lengths(res, label))
    if len(e["budgets"]) > 1:
        out.append(_budget_summary(res))
    return out


def _over_lengths(res: dict, label: str) -> Table:
    e, summ = res["eval"], res["summary"]["budgets"][label]
    methods = e["methods"]
    t = _titled(f"{f'budget {label}: ' if budgeted(methods) else ''}average score over tasks (dNLL)")
    t.add_column("length")
    for m in methods:
        t.add_column(m, justify="right")

    def cell(c):
        d = c.get("dnll")
        return _fmt(c["average"]) + ("" if d is None else f" ({d:+.3f})")
    for n in e["lengths"]:
        t.add_row(length_label(n), *[cell(summ["per_length"][str(n)][m]) for m in methods])
    t.add_section()
    t.add_row("[bold]Average[/]", *[f"[bold]{cell(summ['overall'][m])}[/]" for m in methods])
    t.add_row("vs full (paired)", *[_pm(summ["overall"][m]["diff"], summ["overall"][m]["diff_se"], signed=True)
                                    for m in methods])
    return t


def _budget_summary(res: dict) -> Table:
    e, summ = res["eval"], res["summary"]["budgets"]
    methods = [m for m in e["methods"]]
    t = _titled("every budget: average over lengths and tasks, score (paired diff ± SE) / dNLL ± SE")
    t.add_column("budget")
    for m in methods:
        t.add_column(m, justify="right")
    for g in e["budgets"]:
        row = []
        for m in methods:
            c = summ[g["label"]]["overall"][m]
            text = f"{_fmt(c['average'])} ({_pm(c['diff'], c['diff_se'], signed=True)})"
            if c.get("dnll") is not None:
                text += f" / {_pm(c['dnll'], c.get('dnll_se'), 3, True)}"
            row.append(text)
        t.add_row(g["label"], *row)
    return t


def fidelity_table(res: dict) -> Table | None:
    recs = res.get("fidelity") or []
    if not recs:
        return None
    t = _titled(f"fidelity vs full: {res['eval']['fidelity_tokens']} teacher-forced tokens of essay text after the "
                f"prefix")
    for name in ("length", "budget", "method", "top-1 %", "KL mean", "KL p99", "KL max", "NLL full", "NLL method",
                 "attn recall"):
        t.add_column(name, justify="left" if name in ("length", "budget", "method") else "right")
    for r in sorted(recs, key=lambda r: r["index"]):
        head = (length_label(r["length"]), r["budget"] or "-", r["method"])
        if r["status"] != "ok":
            t.add_row(*head, f"[red]{r['status']}[/]", *[""] * 6)
            continue
        t.add_row(*head, _fmt(r["top1_agreement"]), _fmt(r["kl_mean"], 4), _fmt(r["kl_p99"], 4),
                  _fmt(r["kl_max"], 4), _fmt(r["nll_full"], 3), _fmt(r["nll_method"], 3),
                  _fmt(r.get("attn_recall"), 2, True))
    return t


def slug(label: str) -> str:
    """A budget label as a file-name part: '3%' -> '3pct'."""
    return label.replace("%", "pct").replace(".", "_")


def write_outputs(res: dict, folder: str) -> list[str]:
    """eval.json plus the charts; returns the paths written. The charts of an earlier run in folder that this one
    does not draw (other budget groups, fidelity) go: no chart beside eval.json shows another run."""
    import fnmatch
    from tailorkv.engine.evaluation import plots
    from tailorkv.engine.results import write_json
    paths = [os.path.join(folder, "eval.json")]
    write_json(paths[0], res)
    groups = [g["label"] for g in res["eval"]["budgets"]]
    if res["eval"]["samples_per_task"] and res["records"]:
        for label in groups:
            name = "eval_scores.png" if len(groups) == 1 else f"eval_scores-{slug(label)}.png"
            paths.append(os.path.join(folder, name))
            plots.plot_scores(res, label, paths[-1])
        paths.append(os.path.join(folder, "eval_budgets.png"))
        plots.plot_budgets(res, paths[-1])
    if res.get("fidelity"):
        paths.append(os.path.join(folder, "eval_fidelity.png"))
        plots.plot_fidelity(res, paths[-1])
    written = {os.path.basename(p) for p in paths}
    for name in os.listdir(folder):
        if (fnmatch.fnmatch(name, "eval_scores*.png") or name in ("eval_budgets.png", "eval_fidelity.png")) \
                and name not in written:
            os.unlink(os.path.join(folder, name))
    return paths

"""The charts of `tailorkv eval` (matplotlib, Agg):
- eval_scores.png (one per budget group when there are several): grouped bars of score per task per method,
  one panel per length (plus an 'avg' group);
- eval_budgets.png: the budget curve: score (top) and dNLL of full's answers (bottom) against the budget as a
  share of the length, one line per method with standard-error bars, one column per length plus one for the
  mean over lengths (share budgets only); exact methods (full) as a horizontal line;
- eval_fidelity.png (when fidelity ran): top-1 agreement and mean KL per method, grouped by length and budget;
- eval-compare's --plot: paired differences B - A per task and per (budget, length), with 95% intervals.
"""
from __future__ import annotations

from tailorkv.engine.evaluation.budgets import EXACT_METHODS, budgeted
from tailorkv.engine.evaluation.plan import length_label
from tailorkv.engine.evaluation.labels import budget_line, title_line


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


def plot_scores(res: dict, label: str, path: str) -> None:
    """Grouped bars for one budget group: per length a panel, per task (and 'avg') a group, per method a bar."""
    plt = _plt()
    e, summ = res["eval"], res["summary"]["budgets"][label]
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
        budget = next((cells[m]["budget_tokens"] for m in methods if cells[m]["budget_tokens"] is not None), None)
        ax.set_title(f"length {length_label(n)}" + ("" if budget is None else f", budget {budget} tokens"),
                     fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        if k == min(cols, len(lengths)) - 1:
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for k in range(len(lengths), rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    fig.suptitle(f"task accuracy vs full cache, budget {label}\n{title_line(res)}", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def _curve_points(res: dict, method: str, n: int | None, key: str) -> list[tuple[float, float, float | None]]:
    """(budget % of the length, value, SE) per budget group, sorted by budget; n None: mean over lengths (share
    budgets only)."""
    e, summ = res["eval"], res["summary"]["budgets"]
    pts = []
    for g in e["budgets"]:
        if n is None:
            if g["frac"] is None:
                continue
            c, x = summ[g["label"]]["overall"][method], 100 * g["frac"]
        else:
            c = summ[g["label"]]["per_length"][str(n)][method]
            x = 100 * c["budget_tokens"] / n
        if c.get(key) is not None:
            pts.append((x, c[key], c.get(key + "_se")))
    return sorted(pts)


PCT_TICKS = [0.5, 1, 2, 3, 6, 12, 25, 50, 100]


def plot_budgets(res: dict, path: str) -> None:
    plt = _plt()
    from matplotlib import ticker
    e = res["eval"]
    methods, lengths = e["methods"], e["lengths"]
    sparse = budgeted(methods)
    cols = [(length_label(n), n) for n in lengths]
    if len(lengths) > 1 and any(g["frac"] is not None for g in e["budgets"]):
        cols.append(("mean over lengths", None))
    keys = [("average", "average score (0-100)"), ("dnll", "dNLL of full's answer (nats/token)")]
    fig, axes = plt.subplots(2, len(cols), figsize=(max(4.2 * len(cols), 9.0), 7.0), dpi=110, squeeze=False,
                             sharex="col")
    summ = res["summary"]["budgets"]
    first = e["budgets"][0]["label"]
    for j, (name, n) in enumerate(cols):
        xs_all = [x for m in sparse for key, _ in keys for x, _, _ in _curve_points(res, m, n, key)]
        for r, (key, ylabel) in enumerate(keys):
            ax = axes[r][j]
            if xs_all:  # explicit limits: a single budget would leave a log axis without width
                ax.set_xlim(min(xs_all) / 1.4, max(xs_all) * 1.4)
            for i, m in enumerate(methods):
                color = f"C{i % 10}"
                if m in EXACT_METHODS:
                    c = summ[first]["overall" if n is None else "per_length"]
                    c = c[m] if n is None else c[str(n)][m]
                    if c.get(key) is not None:
                        ax.axhline(c[key], color=color, ls="--", lw=1, label=m)
                    continue
                pts = _curve_points(res, m, n, key)
                if pts:
                    xs, ys, ses = zip(*pts)
                    ax.errorbar(xs, ys, yerr=[s or 0 for s in ses], color=color, marker="o", ms=3, capsize=2,
                                label=m)
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(ticker.FixedLocator(PCT_TICKS))
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}%"))
            ax.xaxis.set_minor_formatter(ticker.NullFormatter())
            ax.grid(True, which="major", alpha=0.3)
            if key == "average":
                ax.set_ylim(-2, 102)
            if r == 0:
                ax.set_title(name, fontsize=10)
            else:
                ax.set_xlabel("budget (tokens attended per layer) / length")
            if j == 0:
                ax.set_ylabel(ylabel)
    handles = {}                        # every method drawn in any panel (the last may lack some, or all)
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        axes[0][-1].legend(handles.values(), handles.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"budget curve: {', '.join(sparse) or 'no budgeted method'} vs full\n{title_line(res)}",
                 fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def plot_fidelity(res: dict, path: str) -> None:
    plt = _plt()
    e = res["eval"]
    methods = e["methods"]
    recs = {(r["length"], r["budget"], r["method"]): r for r in res["fidelity"] if r["status"] == "ok"}
    groups = [(n, g["label"]) for n in e["lengths"] for g in e["budgets"]]
    fig, axes = plt.subplots(1, 2, figsize=(max(11.0, 1.2 * len(groups) * 2), 4.2), dpi=110)
    bar = 0.8 / len(methods)
    for ax, key, label in ((axes[0], "top1_agreement", "top-1 agreement with full (%)"),
                           (axes[1], "kl_mean", "mean KL(full || method), nats")):
        for i, m in enumerate(methods):
            xs = [k + (i - (len(methods) - 1) / 2) * bar for k in range(len(groups))]
            vals = [recs.get((n, None if m in EXACT_METHODS else b, m)) for n, b in groups]
            ax.bar(xs, [v[key] if v else 0 for v in vals], bar, color=f"C{i % 10}", label=m)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{length_label(n)}\n{b}" for n, b in groups], fontsize=8)
        ax.set_xlabel("length / budget")
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylim(0, 105)
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    m, env = res.get("model") or {}, res.get("env") or {}
    fig.suptitle(f"fidelity vs full over {e['fidelity_tokens']} teacher-forced tokens of essay text\n"
                 f"{m.get('name', '?')} on {env.get('gpu') or env.get('device') or '?'}, {budget_line(e)}",
                 fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def plot_compare(cmp: dict, path: str) -> None:
    """eval-compare's picture: per task and per (budget, length), the paired difference B - A of the score (left)
    and of the dNLL of full's answers (right), each with a 95% interval (1.96 SE), a zero line between them."""
    from matplotlib.ticker import MaxNLocator
    from tailorkv.engine.evaluation.compare import cell_rows
    plt = _plt()
    rows = list(cmp["tasks"].items()) + cell_rows(cmp)
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.32 * len(rows) + 1.6), dpi=110, sharey=True)
    ys = list(range(len(rows)))[::-1]
    for ax, (key, se, label) in zip(axes, (("diff", "diff_se", "score, B - A (points)"),
                                           ("dnll_diff", "dnll_diff_se", "dNLL of full's answers, B - A (nats/token)"))):
        pts = [(y, r[key], 1.96 * (r[se] or 0)) for y, (_, r) in zip(ys, rows) if r[key] is not None]
        ax.errorbar([p[1] for p in pts], [p[0] for p in pts], xerr=[p[2] for p in pts], fmt="o", ms=4, capsize=3)
        ax.axvline(0, color="grey", lw=0.8)
        ax.axhline(len(rows) - len(cmp["tasks"]) - 0.5, color="grey", lw=0.5, ls=":")  # tasks above, cells below
        ax.set_xlabel(label)
        ax.xaxis.set_major_locator(MaxNLocator(5))
    axes[0].set_yticks(ys)
    axes[0].set_yticklabels([name for name, _ in rows], fontsize=8)
    fig.suptitle(f"{cmp['method']}: B - A over {cmp['paired']} paired samples, 95% intervals; "
                 f"{'; '.join(cmp['changed']) or 'no setting differs'}", fontsize=9)
    _save(fig, path)

"""PNG plots of a bench.json: decode ms/token vs context and peak memory vs context, one line per method.
OOM cells are marked with an x at the top of the plot; failed cells are left out. A CPU run has no device peak
and no HBM floor: its memory plot shows the KV cache each cell held, and its latency plot no floor line."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tailorkv.engine.results import write_atomic  # noqa: E402

GIB = 1024 ** 3
PLOTS = ("decode_ms.png", "peak_memory.png")  # what plot_all writes in a results folder


def ctx_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _axes(res: dict, title: str, ylabel: str):
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    ctxs = sorted(res["bench"]["ctxs"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(ctxs)
    ax.set_xticklabels([ctx_label(c) for c in ctxs])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel(ylabel)
    m, env = res["model"], res["env"]
    ax.set_title(f"{title}\n{m['name']} {m['dtype']}{' (random weights)' if m['random_weights'] else ''}, "
                 f"batch {res['bench']['batch']}, {env.get('gpu') or env['device']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _lines(ax, res: dict, value) -> list[tuple]:
    """One line per method through its ok cells; returns the OOM cells as (ctx, method, color)."""
    ooms = []
    for i, method in enumerate(res["bench"]["methods"]):
        color = f"C{i % 10}"
        cells = sorted((c for c in res["cells"] if c["method"] == method), key=lambda c: c["ctx"])
        pts = [(c["ctx"], value(c)) for c in cells if c["status"] == "ok" and value(c) is not None]
        xs, ys = zip(*pts) if pts else ((), ())
        ax.plot(xs, ys, "o-", color=color, label=method)
        ooms += [(c["ctx"], method, color) for c in cells if c["status"] == "oom"]
    return ooms


def _finish(ax, ooms: list[tuple]) -> None:
    """y from 0; OOM cells as x marks stacked in a band above the data, one per method at its context."""
    ax.set_ylim(bottom=0)
    if ooms:
        most = max(sum(1 for o in ooms if o[0] == x) for x, _, _ in ooms)
        ax.set_ylim(0, ax.get_ylim()[1] * (1.1 + 0.08 * most))
    band = ax.get_xaxis_transform()  # x in data, y in axes fraction
    placed: dict[int, int] = {}
    for x, method, color in ooms:
        y = 0.97 - 0.06 * placed.get(x, 0)
        placed[x] = placed.get(x, 0) + 1
        ax.plot(x, y, "x", color=color, markersize=8, mew=2, transform=band, clip_on=False)
        ax.annotate(f"{method} OOM", (x, y), xycoords=band, textcoords="offset points", xytext=(-7, -3),
                    ha="right", color=color, fontsize=8)
    ax.legend(fontsize=8)


def _save(fig, path: str) -> None:
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", bbox_inches="tight"))
    plt.close(fig)


def on_gpu(res: dict) -> bool:
    return str(res["env"].get("device", "")).startswith("cuda")


def plot_decode(res: dict, path: str) -> None:
    batch = res["bench"].get("batch", 1)
    fig, ax = _axes(res, "decode latency (median per step; bar to p90)",
                    "ms / token" if batch == 1 else f"ms / step (a token for each of {batch} sequences)")
    ooms = _lines(ax, res, lambda c: c["decode_ms"]["median"])
    for i, method in enumerate(res["bench"]["methods"]):
        ok = [c for c in res["cells"] if c["method"] == method and c["status"] == "ok"]
        if ok:
            ax.errorbar([c["ctx"] for c in ok], [c["decode_ms"]["median"] for c in ok],
                        yerr=[[0] * len(ok), [c["decode_ms"]["p90"] - c["decode_ms"]["median"] for c in ok]],
                        fmt="none", ecolor=f"C{i % 10}", capsize=3, alpha=0.6)
    b, w = res["bench"], res["model"]["weight_read_bytes"]
    floor = w / (b["hbm_gbps"] * 1e9) * 1e3
    measured = b.get("hbm_gbps_source") == "measured"   # bench.json before it had a source: a flag or the default
    if on_gpu(res):
        ax.axhline(floor, color="k", ls="--", lw=1,
                   label=f"weight-read floor {floor:.2f} ms at {b['hbm_gbps']:.0f} GB/s"
                         + (" (measured copy)" if measured else ""))
    if b.get("hbm_gbps_measured") and not measured:
        floor = w / (b["hbm_gbps_measured"] * 1e9) * 1e3
        ax.axhline(floor, color="grey", ls=":", lw=1,
                   label=f"weight-read floor {floor:.2f} ms at {b['hbm_gbps_measured']:.0f} GB/s (measured copy)")
    _finish(ax, ooms)
    _save(fig, path)


def plot_memory(res: dict, path: str) -> None:
    gpu = any(c.get("peak_device_bytes") for c in res["cells"])
    if gpu:
        fig, ax = _axes(res, "peak device memory (weights included)", "GiB")
        ooms = _lines(ax, res, lambda c: c["peak_device_bytes"] / GIB if c.get("peak_device_bytes") else None)
        ax.axhline(res["model"]["model_bytes"] / GIB, color="k", ls="--", lw=1, label="weights")
    else:  # the process RSS only grows over a sweep: what each cell held is its KV cache
        def kv(c):
            return c["kv_device_bytes"] + c["kv_host_bytes"] if c.get("kv_device_bytes") is not None else None
        most = max((kv(c) or 0 for c in res["cells"]), default=0)
        unit, scale = ("GiB", GIB) if most >= GIB else ("MiB", 1024 ** 2)
        fig, ax = _axes(res, "KV cache held per cell (CPU run: KV + offloaded KV, weights not included)", unit)
        ooms = _lines(ax, res, lambda c: kv(c) / scale if kv(c) is not None else None)
    limit = res["bench"].get("gpu_mem_limit_bytes")
    if limit and gpu:
        ax.axhline(limit / GIB, color="r", ls=":", lw=1, label=f"--gpu-mem-limit {limit / GIB:.1f} GiB")
    _finish(ax, ooms)
    _save(fig, path)


def plot_all(res: dict, folder: str) -> list[str]:
    paths = [os.path.join(folder, name) for name in PLOTS]
    plot_decode(res, paths[0])
    plot_memory(res, paths[1])
    return paths

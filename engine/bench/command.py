"""`tailorkv bench`: the click command over engine.bench.driver (the sweep) and engine.bench.plot (the PNGs).
ui.py calls register(main)."""
from __future__ import annotations

import os

import click
from rich.markup import escape


def _gib(n) -> str:
    from tailorkv.engine.ui import fmt_bytes
    return "-" if n is None else fmt_bytes(n)


def _table(title: str):
    from rich.table import Table
    t = Table(title=title, title_justify="left", header_style="bold")
    for name in ("method", "ctx", "prefill s", "ms/tok", "p90", "tok/s", "peak dev", "KV dev", "KV host",
                 "PCIe/tok", "floor ms", "%floor", "HBM GB/s"):
        t.add_column(name, justify="left" if name == "method" else "right")
    return t


def _row(cell: dict) -> list[str]:
    from tailorkv.engine.bench.plot import ctx_label
    head = [cell["method"], ctx_label(cell["ctx"])]
    if cell["status"] == "oom":
        return head + ["", "[bold red]OOM[/]"] + [""] * 9
    if cell["status"] == "error":
        msg = cell["error"] if len(cell["error"]) <= 60 else cell["error"][:57] + "..."
        return head + ["", "[red]error[/]", "", "", f"[red]{escape(msg)}[/]"] + [""] * 6
    d, f = cell["decode_ms"], cell["floor"]
    return head + [f"{cell['prefill_s']:.2f}", f"{d['median']:.2f}", f"{d['p90']:.2f}", f"{cell['tok_s']:.1f}",
                   _gib(cell["peak_device_bytes"]), _gib(cell["kv_device_bytes"]), _gib(cell["kv_host_bytes"]),
                   _gib(cell["pcie_bytes_per_token"]), f"{f['floor_ms']:.2f}", f"{100 * f['fraction']:.0f}%",
                   f"{cell['achieved_gbps']:.0f}"]


def stage_table(cell: dict):
    """The stage breakdown of one cell's profiled decode steps (engine.bench.stages)."""
    from rich.table import Table
    from tailorkv.engine.bench.plot import ctx_label
    st = cell["stages"]
    t = Table(title=f"{cell['method']} @ {ctx_label(cell['ctx'])}: {st['kernels_per_step']:.0f} kernels/step, GPU busy "
                    f"{st['gpu_busy_ms']:.2f} ms of {cell['decode_ms']['median']:.2f} ms/step; other streams overlapped "
                    f"{st['other_streams_overlapped_ms']:.2f} ms ({'CUDA graph' if st['cuda_graph'] else 'eager'})",
              title_justify="left", header_style="bold")
    t.add_column("stage")
    t.add_column("ms/step", justify="right")
    for name, ms in st["stage_ms"].items():
        t.add_row(name, f"{ms:.3f}")
    return t


def register(main: click.Group) -> click.Command:
    from tailorkv.engine import ui
    from tailorkv.engine.settings import METHODS

    @main.command()
    @ui.model_options
    @ui.method_options
    @click.option("--ctx", "ctxs", default="8k,32k", show_default=True, help="context lengths, e.g. 8k,32k,128k")
    @click.option("--methods", default="full,tailorkv", show_default=True,
                  help=f"comma-separated, from: {', '.join(METHODS)}")
    @click.option("--decode-steps", type=int, default=64, show_default=True, help="timed decode steps per cell")
    @click.option("--warmup", type=int, default=8, show_default=True, help="untimed decode steps first")
    @click.option("--batch", type=int, default=1, show_default=True)
    @click.option("--gpu-mem-limit", default=None, help="cap device memory, weights included, e.g. 24GiB")
    @click.option("--hbm-gbps", type=float, default=4300.0, show_default=True, help="HBM bandwidth for the floor")
    @click.option("--pcie-gbps", type=float, default=55.0, show_default=True, help="PCIe bandwidth for the floor")
    @click.option("--out", type=click.Path(file_okay=False), default=None,
                  help="results folder (default bench/results/<date>-<model>/)")
    @click.option("--seed", type=int, default=0, show_default=True, help="seed of the random prompts")
    @click.option("--no-cuda-graph", is_flag=True, help="decode eagerly even where a CUDA graph is possible")
    @click.option("--profile", "profile_steps", type=int, default=0, show_default=True,
                  help="GPU: a stage breakdown (kernels, GPU busy, time per stage and stream) of N decode steps")
    @ui.friendly
    def bench(model, weights, random_weights, device, dtype, ctxs, methods, decode_steps, warmup, batch,
              gpu_mem_limit, hbm_gbps, pcie_gbps, out, seed, no_cuda_graph, profile_steps, **knobs):
        """Latency and memory sweep over methods x context lengths (bench.json + PNG plots)."""
        run_bench(click.get_current_context().params, model, weights, random_weights, device, dtype, ctxs, methods,
                  decode_steps, warmup, batch, gpu_mem_limit, hbm_gbps, pcie_gbps, out, seed, knobs,
                  cuda_graph=not no_cuda_graph, profile_steps=profile_steps)

    # --methods replaces method_options' single --method; its other knobs (--budget, --bits, ...) stay
    bench.params = [p for p in bench.params if p.name != "method"]
    return bench


def run_bench(params, model, weights, random_weights, device, dtype, ctxs, methods, decode_steps, warmup, batch,
              gpu_mem_limit, hbm_gbps, pcie_gbps, out, seed, knobs, cuda_graph=True, profile_steps=0):
    import torch
    from rich.console import Console, Group
    from rich.live import Live
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tailorkv.engine import results as R, ui
    from tailorkv.engine.bench import driver as B
    from tailorkv.engine.bench.plot import plot_all
    from tailorkv.engine.settings import METHODS

    if hbm_gbps <= 0 or pcie_gbps <= 0:
        raise ui.UserError("--hbm-gbps and --pcie-gbps must be positive")
    names = ui.split_list(methods)
    bad = [m for m in names if m not in METHODS]
    if bad:
        raise ui.UserError(f"unknown method '{bad[0]}' in --methods: choose from {', '.join(METHODS)}")
    settings = {m: ui.settings_from(method=m, **knobs) for m in names}
    plan = B.BenchPlan(ctxs=[ui.parse_ctx(c) for c in ui.split_list(ctxs)], methods=names, settings=settings,
                       decode_steps=decode_steps, warmup=warmup, batch=batch, seed=seed,
                       hbm_gbps=hbm_gbps, pcie_gbps=pcie_gbps, cuda_graph=cuda_graph, profile_steps=profile_steps)
    plan.validate()
    dev = ui.pick_device(device)
    limit = None
    if gpu_mem_limit:
        limit = B.parse_bytes(gpu_mem_limit)
        if dev.type == "cuda":
            frac = B.set_memory_limit(limit, dev)
            ui.err.print(f"[dim]device memory capped at {ui.fmt_bytes(limit)} ({100 * frac:.1f}% of the GPU), "
                          f"weights included[/]")
        else:
            ui.err.print("[yellow]--gpu-mem-limit ignored: not running on a GPU[/]")
            limit = None
    hbm_measured = B.measure_hbm_gbps(dev)
    torch.manual_seed(seed)
    loaded = ui.load_with_progress(model, weights, random_weights, dev, ui.pick_dtype(dtype, dev))
    plan.validate(loaded.cfg.max_context)

    out = out or R.numbered_dir(loaded.name if not os.path.exists(model) else model, "bench/results", "bench.json")
    json_path = os.path.join(out, "bench.json")
    env = R.environment(dev)
    command = R.command_line()
    args = {k: v for k, v in params.items()}
    cells: list[dict] = []

    def save():
        R.write_json(json_path, B.results(loaded, plan, cells, env, command, args, hbm_measured, limit))

    con = Console(highlight=False)
    if not con.is_terminal:  # a log file: room for every column
        con = Console(highlight=False, width=max(con.width, 160))
    dev_name = env["gpu"] or str(dev)
    floor_note = f"floor: weights + KV read at {hbm_gbps:.0f} GB/s vs PCIe bytes at {pcie_gbps:.0f} GB/s"
    table = _table(f"{loaded.name} on {dev_name}, batch {batch}, {decode_steps} steps after {warmup} warm-up; "
                   f"{floor_note}")
    bar = Progress(TextColumn("[cyan]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), console=con)
    task = bar.add_task("bench", total=len(plan.ctxs) * len(plan.methods))
    # refreshed by hand between phases: a refresh thread would take the GIL inside the timed decode loop
    with Live(Group(table, bar), console=con, auto_refresh=False) as live:
        def on_phase(method, ctx, what):
            bar.update(task, description=f"{method} @ {ctx}: {what}")
            live.refresh()

        def on_cell(cell):
            cells.append(cell)
            table.add_row(*_row(cell))
            bar.advance(task)
            save()
            live.refresh()

        B.run_sweep(loaded, plan, on_cell=on_cell, on_phase=on_phase)
        bar.update(task, visible=False)
        live.refresh()
    con.print()
    if not cells:
        return
    pngs = plot_all(B.results(loaded, plan, cells, env, command, args, hbm_measured, limit), out)
    for c in cells:
        if c["status"] != "ok":
            ui.err.print(f"[red]{c['method']} @ {c['ctx']}: {c['status'].upper()}[/] {escape(c['error'])}")
    for c in cells:
        if c.get("stages"):
            con.print(stage_table(c))
    ok = sum(c["status"] == "ok" for c in cells)
    con.print(f"{ok}/{len(cells)} cells ok; results in {json_path}, plots {', '.join(pngs)}")

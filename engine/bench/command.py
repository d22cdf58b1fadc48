"""`tailorkv bench`: the click command over engine.bench.driver (the sweep) and engine.bench.plot (the PNGs).
ui.py calls register(main)."""
from __future__ import annotations

import dataclasses
import math
import os

import click
from rich.markup import escape


DEFAULT_CTXS = (8192, 32768)  # those the model supports; its own context when it supports neither
GPU_COLUMNS = ("method", "ctx", "prompt", "prefill s", "ms/tok", "p90", "tok/s", "peak dev", "KV dev", "KV host",
               "PCIe/tok", "floor ms", "%floor", "HBM GB/s")
CPU_COLUMNS = ("method", "ctx", "prompt", "prefill s", "ms/tok", "p90", "tok/s", "KV", "KV offloaded", "GB/s")


def _gib(n) -> str:
    from tailorkv.engine.ui import fmt_bytes
    return "-" if n is None else fmt_bytes(n)


def _gbps(x: float) -> str:
    """Three digits at most, two significant below 10 (a CPU reads weights at a few GB/s)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def columns(on_gpu: bool) -> tuple[str, ...]:
    """On a CPU there is no device peak, no HBM floor and no PCIe: those columns are left out."""
    return GPU_COLUMNS if on_gpu else CPU_COLUMNS


def values(cell: dict, on_gpu: bool) -> dict[str, str]:
    """The plain text of each column of one cell (the table, --output md and csv)."""
    from tailorkv.engine.bench.plot import ctx_label
    row = {"method": cell["method"], "ctx": ctx_label(cell["ctx"]), "prompt": str(cell["prompt_tokens"])}
    if cell["status"] != "ok":
        row["prefill s"] = cell["status"].upper()
        row["ms/tok"] = cell["error"] or ""
        return row
    d = cell["decode_ms"]
    row.update({"prefill s": f"{cell['prefill_s']:.2f}", "ms/tok": f"{d['median']:.2f}", "p90": f"{d['p90']:.2f}",
                "tok/s": f"{cell['tok_s']:.1f}", "GB/s": _gbps(cell["achieved_gbps"]),
                "HBM GB/s": _gbps(cell["achieved_gbps"])})
    if on_gpu:
        f = cell["floor"]
        row.update({"peak dev": _gib(cell["peak_device_bytes"]), "KV dev": _gib(cell["kv_device_bytes"]),
                    "KV host": _gib(cell["kv_host_bytes"]), "PCIe/tok": _gib(cell["pcie_bytes_per_token"]),
                    "floor ms": f"{f['floor_ms']:.2f}", "%floor": f"{100 * f['fraction']:.0f}%"})
    else:
        row.update({"KV": _gib(cell["kv_device_bytes"]), "KV offloaded": _gib(cell["kv_host_bytes"])})
    return row


CSV_COLUMNS = ("method", "ctx", "prompt", "batch", "status", "prefill_s", "ms_per_token", "p90_ms", "tok_s", "gbps",
               "peak_device_bytes", "kv_device_bytes", "kv_host_bytes", "pcie_bytes_per_token", "floor_ms",
               "floor_fraction", "error")
CSV_CPU_COLUMNS = tuple(c for c in CSV_COLUMNS if c not in ("peak_device_bytes", "pcie_bytes_per_token", "floor_ms",
                                                             "floor_fraction"))


def csv_values(cell: dict) -> dict:
    """One cell for --output csv: numbers without units (tokens, seconds, ms, bytes), empty where not measured."""
    row = {"method": cell["method"], "ctx": cell["ctx"], "prompt": cell["prompt_tokens"], "batch": cell.get("batch", 1),
           "status": cell["status"], "error": cell.get("error") or ""}
    if cell["status"] == "ok":
        floor = cell.get("floor") or {}
        row.update(prefill_s=cell["prefill_s"], ms_per_token=cell["decode_ms"]["median"],
                   p90_ms=cell["decode_ms"]["p90"], tok_s=cell["tok_s"], gbps=cell["achieved_gbps"],
                   peak_device_bytes=cell.get("peak_device_bytes"), kv_device_bytes=cell["kv_device_bytes"],
                   kv_host_bytes=cell["kv_host_bytes"], pcie_bytes_per_token=cell.get("pcie_bytes_per_token"),
                   floor_ms=floor.get("floor_ms"), floor_fraction=floor.get("fraction"))
    return {k: "" if v is None else v for k, v in row.items()}


def _table(title: str, on_gpu: bool):
    from rich.table import Table
    t = Table(title=title, title_justify="left", header_style="bold")
    for name in columns(on_gpu):  # a narrow terminal folds a value, never cuts it to "..."
        t.add_column(name, justify="left" if name == "method" else "right", overflow="fold")
    return t


def _row(cell: dict, on_gpu: bool) -> list[str]:
    row = values(cell, on_gpu)
    if cell["status"] == "oom":
        row["prefill s"] = "[bold red]OOM[/]"
        row["ms/tok"] = ""
    elif cell["status"] == "error":
        msg = row["ms/tok"] if len(row["ms/tok"]) <= 60 else row["ms/tok"][:57] + "..."
        row["prefill s"], row["ms/tok"] = "[red]error[/]", f"[red]{escape(msg)}[/]"
    return [row.get(c, "") for c in columns(on_gpu)]


def render(res: dict, fmt: str) -> str:
    """bench.json as json, or its cells as a markdown or CSV table."""
    import csv
    import io
    import json
    if fmt == "json":
        return json.dumps(res, indent=2)
    on_gpu = res["env"].get("device", "cpu").startswith("cuda")
    cols = columns(on_gpu)
    rows = [values(c, on_gpu) for c in res["cells"]]
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS if on_gpu else CSV_CPU_COLUMNS, lineterminator="\n",
                           extrasaction="ignore")
        w.writeheader()
        w.writerows(csv_values(c) for c in res["cells"])
        return buf.getvalue().rstrip("\n")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r.get(c, "").replace("|", "/") for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def cell_line(cell: dict, i: int, n: int) -> str:
    row = values(cell, on_gpu=False)
    head = f"[{i}/{n}] {cell['method']} @ {row['ctx']} ({row['prompt']} prompt tokens): "
    if cell["status"] != "ok":
        return head + f"{row['prefill s']} {row['ms/tok']}"
    per = "ms/token" if cell.get("batch", 1) == 1 else f"ms/step of {cell['batch']} tokens, {row['tok/s']} tok/s"
    return head + f"prefill {row['prefill s']} s, decode {row['ms/tok']} {per} (p90 {row['p90']})"


def whole_context_notes(plan) -> list[str]:
    """Cells where a method's budget covers the whole context: the method then attends to every token."""
    from tailorkv.engine import ui
    from tailorkv.engine.bench.plot import ctx_label
    from tailorkv.engine.settings import KNOB_USERS
    notes = []
    for m in plan.methods:
        budget = plan.settings_for(m).budget
        covered = [c for c in plan.ctxs if m in KNOB_USERS["budget"] and budget >= c]
        if covered:
            notes.append(f"{m}: --budget {budget} covers the whole context at {', '.join(map(ctx_label, covered))}: "
                         f"{ui.every_token_note(m)}")
    return notes


def check_batch_fits(cfg, batch: int, ctx: int, dt, dev, limit: int | None) -> None:
    """Before loading: a batch whose prefill of one layer alone passes the device's memory (or the host's RAM)
    would only fill the sweep with failed cells."""
    import torch
    from tailorkv.engine import ui
    from tailorkv.engine.memory_plan import prefill_activation_bytes
    if batch == 1:
        return
    if dev.type == "cuda":
        have, where = limit or torch.cuda.get_device_properties(dev).total_memory, "the GPU's memory"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
    need = prefill_activation_bytes(cfg, ctx, batch, dt.itemsize)
    if need > have:
        raise ui.UserError(f"--batch {batch} at --ctx {ctx} needs {ui.fmt_bytes(need)} for one layer's prefill alone, "
                           f"more than {where} ({ui.fmt_bytes(have)}): lower --batch or --ctx")


def default_ctxs(max_context: int) -> list[int]:
    return [c for c in DEFAULT_CTXS if c <= max_context] or [max_context]


def stage_table(cell: dict):
    """The stage breakdown of one cell's profiled decode steps (engine.bench.stages)."""
    from rich.table import Table
    from tailorkv.engine.bench.plot import ctx_label
    from tailorkv.engine.scheduler import STREAMS
    st = cell["stages"]
    t = Table(title=f"{cell['method']} @ {ctx_label(cell['ctx'])}: {st['kernels_per_step']:.0f} kernels/step, GPU busy "
                    f"{st['gpu_busy_ms']:.2f} ms of {cell['decode_ms']['median']:.2f} ms/step; kernel time beside other work "
                    f"{st.get('concurrent_ms', 0.0):.2f} ms ({'CUDA graph' if st['cuda_graph'] else 'eager'})",
              title_justify="left", header_style="bold")
    t.add_column("stage")
    t.add_column("ms/step", justify="right")
    split = st.get("stage_stream_ms")  # absent in bench.json files written before it
    side = split and any(v["side"] for v in split.values())
    streams = len(st.get("stream_busy_ms", {}))
    if side and st["cuda_graph"] and streams > STREAMS:
        side = False  # the replay ran the graph's branches on streams of the driver's choosing, not the engine's
        t.caption = (f"the CUDA graph's replay spread its branches over {streams} streams, not the engine's compute / "
                     f"copy / select streams: no per-stream split (the title's 'beside other work' is what overlapped)")
    if side:
        t.add_column("compute stream", justify="right")
        t.add_column("side streams", justify="right")
    for name, ms in st["stage_ms"].items():
        by_stream = (f"{split[name]['compute']:.3f}", f"{split[name]['side']:.3f}") if side else ()
        t.add_row(name, f"{ms:.3f}", *by_stream)
    return t


def prefill_stage_table(cell: dict):
    """The stage breakdown of one cell's profiled prefill, with the TFLOP/s of its matmul stages."""
    from rich.table import Table
    from tailorkv.engine.bench.plot import ctx_label
    st = cell["prefill_stages"]
    t = Table(title=f"{cell['method']} @ {ctx_label(cell['ctx'])}: prefill of {cell['prompt_tokens']} tokens, "
                    f"{st['kernels_per_step']:.0f} kernels, GPU busy {st['gpu_busy_ms'] / 1e3:.2f} s of "
                    f"{st['wall_ms'] / 1e3:.2f} s", title_justify="left", header_style="bold")
    t.add_column("stage")
    t.add_column("s", justify="right")
    t.add_column("TFLOP/s", justify="right")
    for name, ms in st["stage_ms"].items():
        flops = st.get("flops", {}).get(name)
        t.add_row(name, f"{ms / 1e3:.3f}", f"{flops / (ms / 1e3) / 1e12:.0f}" if flops and ms else "")
    return t


def register(main: click.Group) -> click.Command:
    from tailorkv.engine import options, ui
    from tailorkv.engine.settings import METHODS

    @main.command()
    @options.model_options
    @options.method_options
    @click.option("--ctx", "ctxs", default=None,
                  help="context lengths, e.g. 8k,32k,128k  [default: 8k,32k, those the model supports]")
    @click.option("--methods", default="full,tailorkv", show_default=True,
                  help=f"comma-separated, from: {', '.join(METHODS)}")
    @click.option("--decode-steps", type=int, default=64, show_default=True, help="timed decode steps per cell")
    @click.option("--warmup", type=int, default=8, show_default=True, help="untimed decode steps first")
    @click.option("--batch", type=int, default=1, show_default=True)
    @click.option("--gpu-mem-limit", default=None, help="cap device memory, weights included, e.g. 24GiB")
    @click.option("--hbm-gbps", type=float, default=None,
                  help="HBM bandwidth for the floor  [default: measured, a device copy (read + write)]")
    @click.option("--pcie-gbps", type=float, default=None,
                  help="PCIe bandwidth for the floor  [default: measured, a pinned host-to-device copy]")
    @click.option("--out", default=None,
                  help="results folder (default bench/results/<date>-<model>/)")
    @click.option("--overwrite", is_flag=True, help="replace the results an earlier run left in --out")
    @click.option("--output", "-o", "fmt", type=click.Choice(["json", "md", "csv"]), default=None,
                  help="also print the results to stdout in this format (the live table goes to stderr)")
    @click.option("--seed", type=click.IntRange(0, 2 ** 63 - 1), default=0, show_default=True,
                  help="seed of the random prompts")
    @click.option("--no-cuda-graph", is_flag=True, help="decode eagerly even where a CUDA graph is possible")
    @click.option("--profile", "profile_steps", type=click.IntRange(min=0), default=0, show_default=True,
                  help="GPU: a stage breakdown (kernels, GPU busy, time per stage and stream) of N decode steps")
    @click.option("--profile-prefill", is_flag=True,
                  help="GPU: a stage breakdown of each cell's prefill, with the TFLOP/s of attention and GEMMs")
    @ui.friendly
    def bench(model, weights, random_weights, device, dtype, threads, ctxs, methods, decode_steps, warmup, batch,
              gpu_mem_limit, hbm_gbps, pcie_gbps, out, overwrite, fmt, seed, no_cuda_graph, profile_steps,
              profile_prefill, **knobs):
        """Latency and memory sweep over methods x context lengths (bench.json + PNG plots)."""
        ui.set_threads(threads)
        run_bench(click.get_current_context().params, model, weights, random_weights, device, dtype, ctxs, methods,
                  decode_steps, warmup, batch, gpu_mem_limit, hbm_gbps, pcie_gbps, out, seed, knobs,
                  cuda_graph=not no_cuda_graph, fmt=fmt, profile_steps=profile_steps,
                  profile_prefill=profile_prefill, overwrite=overwrite)

    # --methods replaces method_options' single --method; its other knobs (--budget, --bits, ...) stay
    bench.params = [p for p in bench.params if p.name != "method"]
    return bench


def run_bench(params, model, weights, random_weights, device, dtype, ctxs, methods, decode_steps, warmup, batch,
              gpu_mem_limit, hbm_gbps, pcie_gbps, out, seed, knobs, cuda_graph=True, fmt=None, profile_steps=0,
              profile_prefill=False, overwrite=False):
    from tailorkv.engine import options, results as R, ui
    from tailorkv.engine.bench import driver as B
    from tailorkv.engine.bench.plot import PLOTS
    from tailorkv.engine.settings import METHODS

    for flag, gbps, example in (("--hbm-gbps", hbm_gbps, 4300), ("--pcie-gbps", pcie_gbps, 55)):
        if gbps is not None and not (gbps > 0 and math.isfinite(gbps)):
            raise ui.UserError(f"{flag} must be a bandwidth above 0 GB/s, got {gbps}: e.g. {flag} {example}")
    names = ui.known_names(methods, METHODS, "method", "--methods")
    options.check_knob_use(click.get_current_context(), names)
    settings = {m: options.settings_from(method=m, **knobs) for m in names}
    ctx_list = None
    if ctxs is not None:  # 1k and 1024 are one context
        ctx_list = list(dict.fromkeys(ui.parse_ctx(c) for c in ui.split_list(ctxs)))
        if not ctx_list:
            raise ui.UserError(f"--ctx {ctxs!r} names no context length: e.g. --ctx 8k,32k")
    dev = ui.pick_device(device)
    limit = ui.parse_bytes(gpu_mem_limit) if gpu_mem_limit else None
    cfg, family = options.peek(model, weights, random_weights)
    dt = ui.pick_dtype(dtype, dev, cfg)
    settings = {m: options.model_defaults(s, family) for m, s in settings.items()}
    # the profile's layers filled in: bench.json records them
    settings = dict(zip(settings, options.check_for_model(settings.values(), cfg, click.get_current_context(),
                                                          family)))
    ctx_list = ctx_list or default_ctxs(cfg.max_context)
    if limit and dev.type == "cuda" and "tailorkv" in settings:  # the sketch's bits at the sweep's largest context
        settings["tailorkv"] = options.plan_memory(settings["tailorkv"], cfg, family, max(ctx_list), limit,
                                                   dt, click.get_current_context(), batch)
    plan = B.BenchPlan(ctxs=ctx_list, methods=names, settings=settings,
                       decode_steps=decode_steps, warmup=warmup, batch=batch, seed=seed,
                       cuda_graph=cuda_graph, profile_steps=profile_steps,
                       profile_prefill=profile_prefill)
    plan.validate(cfg.max_context)
    check_batch_fits(cfg, batch, max(ctx_list), dt, dev, limit)
    given_out = out is not None
    if given_out:
        R.check_free([os.path.join(R.check_out(out), f) for f in ("bench.json", *PLOTS)])
        R.refuse_existing(os.path.join(out, "bench.json"), overwrite)
    with R.results_dir(out, model, family, "bench/results", "bench.json") as out:
        _sweep(params, plan, model, weights, random_weights, dev, dt, gpu_mem_limit, hbm_gbps, pcie_gbps, out,
                 given_out, seed, fmt, profile_steps, profile_prefill)


def _sweep(params, plan, model, weights, random_weights, dev, dt, gpu_mem_limit, hbm_gbps, pcie_gbps, out,
             given_out, seed, fmt, profile_steps, profile_prefill):
    """The sweep, its live table and its files in out, after every check passed."""
    import torch
    from rich.console import Console, Group
    from rich.live import Live
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from tailorkv.engine import options, results as R, ui
    from tailorkv.engine.bench import driver as B
    from tailorkv.engine.bench.plot import plot_all

    limit = ui.cap_gpu_memory(gpu_mem_limit, dev)
    if dev.type != "cuda" and (profile_steps or profile_prefill):
        given = [f for f, on in (("--profile", profile_steps), ("--profile-prefill", profile_prefill)) if on]
        need = "their stage breakdowns need" if len(given) == 2 else "its stage breakdown needs"
        ui.err.print(f"[yellow]{' and '.join(given)} ignored: {need} a GPU[/]")
    bandwidths = B.floor_bandwidths(hbm_gbps, pcie_gbps, B.measure_hbm_gbps(dev), B.measure_pcie_gbps(dev))
    if "tailorkv" in plan.methods:
        bandwidths["zero_copy_gbps_measured"] = B.measure_zero_copy_gbps(dev)
        slow = B.zero_copy_note(bandwidths["zero_copy_gbps_measured"], bandwidths["pcie_gbps_measured"])
        if slow:
            ui.err.print(f"[yellow]{escape(slow)}[/]")
    plan = dataclasses.replace(plan, hbm_gbps=bandwidths["hbm_gbps"], pcie_gbps=bandwidths["pcie_gbps"])
    torch.manual_seed(seed)
    loaded = ui.load_with_progress(model, weights, random_weights, dev, dt)

    json_path = os.path.join(out, "bench.json")
    env = R.environment(dev)
    command = R.command_line()
    args = options.numbers_typed(params)
    cells: list[dict] = []

    def save():
        R.write_json(json_path, B.results(loaded, plan, cells, env, command, args, bandwidths, limit))

    con = Console(highlight=False, stderr=fmt is not None)  # with --output, stdout holds only that
    if not con.is_terminal:  # a log file: room for every column
        con = Console(highlight=False, stderr=fmt is not None, width=max(con.width, 160))
    on_gpu = dev.type == "cuda"
    dev_name = env["gpu"] or str(dev)
    note = (f"; floor: weights + KV read at {plan.hbm_gbps:.0f} GB/s ({bandwidths['hbm_gbps_source']}) vs PCIe bytes "
            f"at {plan.pcie_gbps:.0f} GB/s ({bandwidths['pcie_gbps_source']})" if on_gpu
            else "; prompt = tokens prefilled (ctx less warm-up, timed steps and a margin)")
    if plan.batch > 1:
        note += f"; ms/tok = one step, a token for each of the {plan.batch} sequences; tok/s counts all of them"
    table = _table(f"{loaded.name} on {dev_name}, batch {plan.batch}, {plan.decode_steps} steps after {plan.warmup} "
                   f"warm-up{note}", on_gpu)
    for n in whole_context_notes(plan):
        ui.err.print(f"[yellow]{escape(n)}[/]")
    bar = Progress(TextColumn("[cyan]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), console=con)
    total = len(plan.ctxs) * len(plan.methods)
    task = bar.add_task("bench", total=total)
    interrupted = False
    # refreshed by hand between phases: a refresh thread would take the GIL inside the timed decode loop
    with ui.interrupt_once():  # a second Ctrl-C cannot cut the saving short
        with Live(Group(table, bar), console=con, auto_refresh=False) as live:
            def on_phase(method, ctx, what):
                bar.update(task, description=f"{method} @ {ctx}: {what}")
                live.refresh()

            def on_cell(cell):
                cells.append(cell)
                table.add_row(*_row(cell, on_gpu))
                bar.advance(task)
                save()
                live.refresh()
                if not con.is_terminal:  # a log shows the live table only at the end: a line per cell meanwhile
                    ui.err.print(cell_line(cell, len(cells), total), markup=False)

            try:
                B.run_sweep(loaded, plan, on_cell=on_cell, on_phase=on_phase)
            except KeyboardInterrupt:
                interrupted = True
            bar.update(task, visible=False)
            if not cells:  # no row to show: not a table of headers alone
                live.update(Group(), refresh=True)
            live.refresh()
        con.print()
        if interrupted:
            if cells:  # the plots of the cells saved, not an earlier run's beside them; -o gets them too
                res = B.results(loaded, plan, cells, env, command, args, bandwidths, limit)
                plot_all(res, out)
                if fmt is not None:
                    click.echo(render(res, fmt))
            kept = (f"the {ui.count(len(cells), 'finished cell')} of {total} {'is' if len(cells) == 1 else 'are'} in "
                    f"{json_path} (\"complete\": false)" if cells
                    else "no cell had finished, nothing was written")
            again = " with --overwrite" if cells and given_out else ""
            raise ui.Interrupted(f"{kept}; run the command again{again} to measure every cell")
    if not cells:
        return
    res = B.results(loaded, plan, cells, env, command, args, bandwidths, limit)
    pngs = plot_all(res, out)
    for c in cells:
        if c["status"] != "ok":
            ui.err.print(f"[red]{c['method']} @ {c['ctx']}: {c['status'].upper()}[/] {escape(c['error'])}")
        elif c.get("decode_reference_calls"):  # a kernel that did not take its arguments: a slower decode
            calls = ", ".join(f"{op} x{n}" for op, n in sorted(c["decode_reference_calls"].items()))
            ui.err.print(f"[yellow]{c['method']} @ {c['ctx']}: in decode, kernels handed these calls to their torch "
                         f"reference (arguments they do not take): {calls}[/]")
    for c in cells:
        if c.get("prefill_stages"):
            con.print(prefill_stage_table(c))
        if c.get("stages"):
            con.print(stage_table(c))
    ok = sum(c["status"] == "ok" for c in cells)
    con.print(f"{ok}/{len(cells)} cells ok; results in {json_path}, plots {', '.join(pngs)}")
    if fmt is not None:
        click.echo(render(res, fmt))
    if not ok:  # a script must not take a sweep of failures for a measurement
        kinds = sorted({c["status"].upper() for c in cells})
        fix = "lower --ctx or --batch" if kinds == ["OOM"] else "see each cause above"
        raise ui.UserError(f"every cell failed ({ui.count(len(cells), 'cell')}: {', '.join(kinds)}; details in "
                           f"{json_path}): {fix}")

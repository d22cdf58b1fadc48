"""`tailorkv eval` and `tailorkv eval-merge`: the click commands over engine.evaluation.driver (the work),
fidelity (teacher-forced comparison with full) and report (tables, PNGs). ui.py calls register(main).

    tailorkv eval --model smollm2-135m --methods full,tailorkv,streamingllm,snapkv,quest \\
        --lengths 2k,4k,8k --samples 10 --budget-frac 0.03 --out eval/results/smollm2
    # the same work split over 4 processes, then merged:
    for i in 0 1 2 3; do tailorkv eval ... --out DIR --shard $i/4 & done; wait; tailorkv eval-merge DIR
"""
from __future__ import annotations

import glob
import os
import time

import click
from rich.markup import escape

DEFAULT_METHODS = "full,tailorkv,streamingllm,snapkv,quest"
SAVE_EVERY_S = 30.0  # partial eval.json rewrites during a run


def default_out_dir(model_name: str, root: str = "eval/results") -> str:
    """eval/results/<date>-<model>/, with -2, -3, ... when that folder already holds an eval.json."""
    from tailorkv.engine.results import numbered_dir
    return numbered_dir(model_name, root, marker="eval.json")


def _console():
    from rich.console import Console
    con = Console(highlight=False)
    if not con.is_terminal:  # a log file: room for every column
        con = Console(highlight=False, width=max(con.width, 160))
    return con


def show(res: dict, con=None) -> None:
    from tailorkv.engine.evaluation.report import fidelity_table, score_tables, title_line
    con = con or _console()
    con.print(f"[bold]{escape(title_line(res))}[/]")
    for t in score_tables(res):
        con.print(t)
    ft = fidelity_table(res)
    if ft is not None:
        con.print(ft)


def same_command(ctx: click.Context, **changes) -> str:
    """The command line the user typed (its options as given), with `changes` set: {"out": "DIR", "resume": True}."""
    import shlex
    from click.core import ParameterSource
    args = ["tailorkv", ctx.info_name or "eval"]
    for p in ctx.command.params:
        if not isinstance(p, click.Option):
            continue
        given = ctx.get_parameter_source(p.name) == ParameterSource.COMMANDLINE
        if p.name not in changes and not given:
            continue
        value = changes.get(p.name, ctx.params.get(p.name))
        flag = max(p.opts, key=len)
        if p.is_flag:
            args += [flag] if value else []
        elif p.multiple:
            for v in value:
                args += [flag, str(v)]
        elif value is not None:
            args += [flag, str(value)]
    return shlex.join(args)


def register(main: click.Group) -> list[click.Command]:
    from tailorkv.engine import options, ui
    from tailorkv.engine.evaluation.tasks import TASKS
    from tailorkv.engine.settings import METHODS

    @main.command("eval")
    @options.model_options
    @options.method_options
    @click.option("--methods", default=DEFAULT_METHODS, show_default=True,
                  help=f"comma-separated, from: {', '.join(METHODS)}")
    @click.option("--lengths", default="4k", show_default=True,
                  help="whole sequence lengths (template + prompt + answer), e.g. 2k,4k,8k")
    @click.option("--samples", type=int, default=5, show_default=True, help="samples per task and length (0: none)")
    @click.option("--tasks", default=None, help=f"comma-separated (default all): {', '.join(TASKS)}")
    @click.option("--seed", type=int, default=0, show_default=True, help="seed of the generated samples")
    @click.option("--budget-frac", type=float, default=None,
                  help="budget = round(F x length) per length (e.g. 0.03); sink + recent shrink to fit half")
    @click.option("--max-new-tokens", type=int, default=None, help="greedy tokens per answer (default: per task)")
    @click.option("--fidelity-tokens", type=int, default=0, show_default=True,
                  help="also compare each method with full over N teacher-forced tokens of essay text (0: off)")
    @click.option("--out", type=click.Path(file_okay=False), default=None,
                  help="results folder (default eval/results/<date>-<model>/)")
    @click.option("--shard", default=None, help="i/n: run only items with index % n == i (then eval-merge)")
    @click.option("--resume", is_flag=True, help="keep the finished items of an interrupted run in --out and do "
                                                  "the rest (same command otherwise)")
    @ui.friendly
    def eval_cmd(model, weights, random_weights, device, dtype, threads, methods, lengths, samples, tasks, seed,
                 budget_frac, max_new_tokens, fidelity_tokens, out, shard, resume, **knobs):
        """Long-context accuracy of every method against the full cache (eval.json + tables + PNG)."""
        ui.set_threads(threads)
        run_eval(click.get_current_context().params, model, weights, random_weights, device, dtype, methods,
                 lengths, samples, tasks, seed, budget_frac, max_new_tokens, fidelity_tokens, out, shard, knobs,
                 resume)

    # --methods replaces method_options' single --method; its other knobs (--budget, --bits, ...) stay
    eval_cmd.params = [p for p in eval_cmd.params if p.name != "method"]

    @main.command("eval-merge")
    @click.argument("folder", type=click.Path(file_okay=False))
    @click.option("--out", type=click.Path(file_okay=False), default=None, help="where to write (default FOLDER)")
    @ui.friendly
    def eval_merge(folder, out):
        """Merge the eval.shard-*-of-*.json files of FOLDER into eval.json + tables + PNG."""
        run_merge(folder, out)

    return [eval_cmd, eval_merge]


def run_eval(params, model, weights, random_weights, device, dtype, methods, lengths, samples, tasks, seed,
             budget_frac, max_new_tokens, fidelity_tokens, out, shard, knobs, resume=False):
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from tailorkv.engine import options, results as R, ui
    from tailorkv.engine.bench.driver import model_info
    from tailorkv.engine.evaluation import driver as D
    from tailorkv.engine.evaluation.report import write_outputs
    from tailorkv.engine.methods import layer_policies

    click_ctx = click.get_current_context()
    names = D.parse_methods(methods)
    options.check_knob_use(click_ctx, names)
    plan = D.EvalPlan(lengths=D.parse_lengths(lengths), methods=names, tasks=D.parse_tasks(tasks),
                      samples=samples, seed=seed, base=options.settings_from(method="full", **knobs),
                      budget_frac=budget_frac, max_new_tokens=max_new_tokens, fidelity_tokens=fidelity_tokens)
    plan.validate()
    shard_t = D.parse_shard(shard)
    if shard_t is not None and not out:
        raise ui.UserError("--shard needs --out DIR: every shard of a run writes into the same folder")
    if resume and not out:
        raise ui.UserError("--resume needs --out DIR: the folder of the run to finish")
    dev = ui.pick_device(device)
    cfg = options.peek(model, weights, random_weights)
    too_long = [n for n in plan.lengths if n > cfg.max_context]
    if too_long:
        raise ui.UserError(f"--lengths {too_long[0]} is beyond what {model} supports "
                            f"({cfg.max_context} tokens): lower --lengths")
    options.check_for_model([plan.settings(m, n) for m in plan.methods for n in plan.lengths], cfg, click_ctx)
    torch.manual_seed(seed)
    loaded = ui.load_with_progress(model, weights, random_weights, dev, ui.pick_dtype(dtype, dev))
    D.check_methods(loaded, plan)

    items = D.shard_items(plan.items(), shard_t)
    out = out or default_out_dir(loaded.name if not os.path.exists(model) else model)
    name = "eval.json" if shard_t is None else D.shard_filename(*shard_t)
    json_path = os.path.join(out, name)
    con = _console()
    with con.status("generating the samples"):  # every length, even in a shard: the hash checks the merge
        suites = D.build_suites(loaded.tokenizer, plan)
    policies = {m: layer_policies(plan.settings(m, plan.lengths[0]), loaded.cfg.n_layers, loaded.family)
                for m in plan.methods}
    common = dict(command=R.command_line(), args=dict(params), env=R.environment(dev), model=model_info(loaded),
                  plan=plan, shard=shard_t, suites_hash=D.suite_hash(suites), layer_policies=policies)
    records: list[dict] = []
    if resume and os.path.exists(json_path):
        try:
            prev = D.read_json(json_path)
        except ValueError as e:
            raise ui.UserError(f"{json_path} is not valid JSON ({e}): rerun without --resume") from None
        records = D.resumable_records(prev, D.results(records=[], **common), json_path)
        done = {r["index"] for r in records}
        items = [it for it in items if it["index"] not in done]
        con.print(f"resuming {json_path}: {len(done)} items done, {len(items)} to go")
    last_save = [0.0]

    def save(force: bool = False):  # partial results survive an interrupt; at most every SAVE_EVERY_S seconds
        if force or time.monotonic() - last_save[0] >= SAVE_EVERY_S:
            R.write_json(json_path, D.results(records=records, **common))
            last_save[0] = time.monotonic()

    texts: dict = {}
    bar = Progress(TextColumn("[cyan]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TimeRemainingColumn(), console=ui.err, transient=True)
    try:
        run_items(items, loaded, plan, suites, texts, records, bar, save, lines=not ui.err.is_terminal)
    except KeyboardInterrupt:
        save(force=True)
        again = same_command(click_ctx, out=out, resume=True)
        raise ui.UserError(f"interrupted: {len(records)} items saved in {json_path}; to finish, run: {again}") \
            from None
    res = D.results(records=records, **common)
    if shard_t is None:
        paths = write_outputs(res, out)
    else:
        R.write_json(json_path, res)
        paths = [json_path]
    show(res, con)
    for r in records:
        if r["status"] != "ok":
            ui.err.print(f"[red]{D.length_label(r['length'])} {r['method']} {r.get('task', 'fidelity')}: "
                          f"{r['status'].upper()}[/] {escape(r['error'] or '')}")
    ok = sum(r["status"] == "ok" for r in records)
    con.print(f"{ok}/{len(records)} items ok; results in {', '.join(paths)}"
              + (f" (shard {shard_t[0]} of {shard_t[1]}: merge with `tailorkv eval-merge {out}`)" if shard_t else ""))


def item_line(i: int, n: int, what: str, rec: dict) -> str:
    """One line per finished item, for logs (where the progress bar does not show)."""
    if rec["status"] != "ok":
        result = rec["status"].upper()
    elif rec.get("score") is not None:
        result = f"score {rec['score']:.0f}"
    else:
        result = "done"
    return f"[{i}/{n}] {what}: {result} ({rec['wall_s']:.1f} s)"


def run_items(items, loaded, plan, suites, texts, records, bar, save, lines: bool = False) -> None:
    """Runs the items in order under the progress bar (or, with lines, printing a line per item on stderr),
    appending each record and saving as it goes."""
    from tailorkv.engine import ui
    from tailorkv.engine.evaluation import driver as D
    with bar:
        task = bar.add_task("eval", total=len(items))
        for i, it in enumerate(items, 1):
            what = (f"{D.length_label(it['length'])} {it['method']} "
                    + (f"{it['task']} #{it['sample']}" if it["kind"] == "task" else "fidelity"))
            bar.update(task, description=what)
            rec = D.run_item(loaded, plan, it, suites, texts,
                             on_phase=lambda s, w=what: bar.update(task, description=f"{w}: {s}"))
            records.append(rec)
            save(force=rec["status"] != "ok")
            bar.advance(task)
            if lines:
                ui.err.print(item_line(i, len(items), what, rec), markup=False)


def run_merge(folder: str, out: str | None) -> None:
    from tailorkv.engine import ui
    from tailorkv.engine.evaluation import driver as D
    from tailorkv.engine.evaluation.report import write_outputs

    if not os.path.isdir(folder):
        raise ui.UserError(f"{folder}: no such folder")
    files = sorted(glob.glob(os.path.join(folder, "eval.shard-*-of-*.json")))
    if not files:
        raise ui.UserError(f"{folder} holds no eval.shard-*-of-*.json files: run `tailorkv eval --shard i/n "
                            f"--out {folder}` first")
    shards = []
    for f in files:
        try:
            shards.append((os.path.basename(f), D.read_json(f)))
        except ValueError as e:
            raise ui.UserError(f"{f} is not valid JSON ({e}): rerun that shard") from None
    res, warnings = D.merge_shards(shards)
    for w in warnings:
        ui.err.print(f"[yellow]{escape(w)}[/]")
    paths = write_outputs(res, out or folder)
    con = _console()
    show(res, con)
    con.print(f"merged {len(files)} shards ({len(res['records']) + len(res['fidelity'])} items); "
              f"results in {', '.join(paths)}")

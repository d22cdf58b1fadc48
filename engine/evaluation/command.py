"""`tailorkv eval`, `tailorkv eval-merge` and `tailorkv eval-compare`: the click commands over engine.evaluation.driver (the work),
fidelity (teacher-forced comparison with full) and report (tables, PNGs). ui.py calls register(main).

    tailorkv eval --model smollm2-135m --methods full,tailorkv,streamingllm,snapkv,quest \\
        --lengths 2k,4k,8k --samples 20 --budgets 1%,3%,6%,12%,25%,1024 --out eval/results/smollm2
    # the same work split over 4 processes, then merged:
    for i in 0 1 2 3; do tailorkv eval ... --out DIR --shard $i/4 & done; wait; tailorkv eval-merge DIR
"""
from __future__ import annotations

import glob
import os
import shlex
import time

import click
from rich.markup import escape

from tailorkv.engine.errors import InputError

DEFAULT_METHODS = "full,tailorkv,streamingllm,snapkv,quest"
SAVE_EVERY_S = 30.0  # partial eval.json rewrites during a run


def _console():
    from rich.console import Console
    con = Console(highlight=False)
    if not con.is_terminal:  # a log file: room for every column
        con = Console(highlight=False, width=max(con.width, 160))
    return con


def show(res: dict, con=None) -> None:
    from tailorkv.engine.evaluation.labels import title_line
    from tailorkv.engine.evaluation.report import fidelity_table, score_tables
    con = con or _console()
    con.print(f"[bold]{escape(title_line(res))}[/]")
    for w in res.get("warnings") or []:
        con.print(f"[yellow]warning: {escape(w)}[/]")
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
    @click.option("--seed", type=click.IntRange(0, 2 ** 63 - 1), default=0, show_default=True,
                  help="seed of the generated samples")
    @click.option("--budgets", default=None,
                  help="budget groups: shares of the length and/or tokens (1024 or 1k), e.g. 1%,3%,6%,12%,25%,1024 (192 and 1024 "
                       "bring the paper's sink/top-K/recent split and r; default: one group of --budget, 1024 unless "
                       "given)")
    @click.option("--budget-frac", type=float, default=None,
                  help="one budget group, round(F x length) per length (e.g. 0.03): --budgets with one share")
    @click.option("--split", type=click.Choice(["shrink", "paper"]), default="shrink", show_default=True,
                  help="sink and recent inside a share or token budget: --sink/--recent shrunk to fit half "
                       "(shrink), or budget/16 each (paper)")
    @click.option("--protocol", type=click.Choice(["plain", "paper", "legacy"]), default="plain", show_default=True,
                  help="what budgets count: plain (the same prompt tokens for every method, generated tokens on "
                       "top), paper (plain + the paper's dense layers for baselines: 0; quest 0-1), legacy "
                       "(this engine's first eval)")
    @click.option("--max-new-tokens", type=int, default=None, help="greedy tokens per answer (default: per task)")
    @click.option("--question", type=click.Choice(["after", "both"]), default="after", show_default=True,
                  help="where the question goes: after the long text (RULER) or before and after it")
    @click.option("--fidelity-tokens", type=int, default=0, show_default=True,
                  help="also compare each method with full over N teacher-forced tokens of essay text (0: off)")
    @click.option("--out", default=None,
                  help="results folder (default eval/results/<date>-<model>/)")
    @click.option("--shard", default=None, help="i/n: run only items with index % n == i (then eval-merge)")
    @click.option("--resume", is_flag=True, help="keep the finished items of an interrupted run in --out and do "
                                                  "the rest (same command otherwise)")
    @click.option("--overwrite", is_flag=True, help="replace the results an earlier run left in --out")
    @ui.friendly
    def eval_cmd(**kw):
        """Long-context accuracy of every method against the full cache (eval.json + PNG plots; prints the tables)."""
        ui.set_threads(kw.pop("threads"))
        knobs = {k: kw.pop(k) for k in list(kw) if k not in EVAL_OPTIONS}
        run_eval(click.get_current_context().params, knobs, **kw)

    # --methods replaces method_options' single --method; its other knobs (--budget, --bits, ...) stay
    eval_cmd.params = [p for p in eval_cmd.params if p.name != "method"]

    @main.command("eval-merge")
    @click.argument("folder")
    @click.option("--out", default=None, help="where to write (default FOLDER)")
    @click.option("--partial", is_flag=True, help="merge what the shards finished even if items are left (the "
                  "result says complete: false; each table cell counts its samples)")
    @click.option("--overwrite", is_flag=True, help="replace an eval.json there that no merge wrote")
    @ui.friendly
    def eval_merge(folder, out, partial, overwrite):
        """Merge the eval.shard-*-of-*.json files of FOLDER into eval.json + PNG plots (and print the tables)."""
        run_merge(folder, out, partial, overwrite)

    @main.command("eval-compare")
    @click.argument("a")
    @click.argument("b")
    @click.option("--method", default=None, help="the method to pair (default: the one with a budget both ran)")
    @click.option("--against", default=None, help="B's method, to pair two methods (A's is --method; A and B "
                  "may be the same run)")
    @click.option("--json", "json_out", default=None, help="also write the comparison to this JSON file")
    @click.option("--plot", default=None, help="also draw the paired differences with 95% intervals (PNG)")
    @click.option("--overwrite", is_flag=True, help="replace the files --json and --plot name")
    @ui.friendly
    def eval_compare(a, b, method, against, json_out, plot, overwrite):
        """One method's samples in two eval runs (eval.json or its folder) paired: B - A per length and task."""
        run_compare(a, b, method, against, json_out, plot, overwrite)

    return [eval_cmd, eval_merge, eval_compare]


def make_plan(knobs: dict, methods, lengths, samples, tasks, seed, budgets, budget_frac, split, protocol,
              max_new_tokens, question, fidelity_tokens):
    """The EvalPlan of the command's options (an InputError naming the option when one is wrong)."""
    from tailorkv.engine import options
    from tailorkv.engine.evaluation import budgets as B, plan as P
    if budgets is not None and budget_frac is not None:
        raise InputError("--budgets and --budget-frac both given: use one (--budgets 3% is --budget-frac 0.03)")
    groups = B.parse_budgets(budgets) if budgets is not None else None
    if budget_frac is not None:
        if not 0 < budget_frac <= 1:
            raise InputError(f"--budget-frac must be in (0, 1], got {budget_frac}")
        groups = [B.Budget(f"{budget_frac * 100:g}%", frac=budget_frac)]
    plan = P.EvalPlan(lengths=P.parse_lengths(lengths), methods=P.parse_methods(methods), tasks=P.parse_tasks(tasks),
                      samples=samples, seed=seed, base=options.settings_from(method="full", **knobs), budgets=groups,
                      split=split, protocol=protocol, max_new_tokens=max_new_tokens,
                      fidelity_tokens=fidelity_tokens, question=question)
    plan.validate()
    return plan


EVAL_OPTIONS = ("model", "weights", "random_weights", "device", "dtype", "methods", "lengths", "samples", "tasks",
                "seed", "budgets", "budget_frac", "split", "protocol", "max_new_tokens", "question",
                "fidelity_tokens", "out", "shard", "resume", "overwrite")


def check_budget_knobs(ctx: click.Context, plan) -> None:
    """A budget knob that every budget group sets for itself is an error, as check_knob_use's are: --budget under
    --budgets or --budget-frac; --sink and --recent under --split paper or the paper's 192/1024 groups alone;
    --channels under those alone."""
    from tailorkv.engine.options import given_knobs
    kinds = {b.kind for b in plan.budgets}
    paper_only = kinds == {"paper"}
    paper = "the paper's budget groups (192, 1024) bring their own sink, recent and r; drop {flag} or add another " \
            "budget to --budgets"
    why = {"budget": None if "knobs" in kinds else "the budget groups of --budgets or --budget-frac set every "
                                                     "method's budget; drop --budget or put it in --budgets",
           "channels": paper if paper_only else None}
    if "knobs" not in kinds:
        why["sink"] = why["recent"] = paper if paper_only else (
            "--split paper gives sink and recent budget/16 each; drop {flag} or use --split shrink"
            if plan.split == "paper" else None)
    for k in given_knobs(ctx):
        if why.get(k):
            flag = "--" + k
            raise InputError(f"{flag} has no effect here: {why[k].format(flag=flag)}")
    from tailorkv.engine.evaluation.budgets import budgeted
    from tailorkv.engine.settings import KNOB_USERS
    for k in given_knobs(ctx, ("budgets", "budget_frac", "split")):
        flag = "--" + k.replace("_", "-")
        if not budgeted(plan.methods):
            they = "it keeps" if len(plan.methods) == 1 else "they keep"
            raise InputError(f"{flag} has no effect under {', '.join(plan.methods)}: {they} every token; add a "
                             f"method with a budget ({', '.join(KNOB_USERS['budget'])}) or drop {flag}")
        if k == "split" and not kinds & {"frac", "tokens"}:
            raise InputError("--split has no effect here: it places sink and recent inside the shares or token counts "
                             "of --budgets or --budget-frac (192 and 1024 bring the paper's own); drop --split or "
                             "give --budgets")


def shrunk_notes(plan, given: list[str]) -> list[str]:
    """--sink or --recent given, and scaled down inside budgets too small for them (--split shrink)."""
    from tailorkv.engine.evaluation.plan import length_label
    from tailorkv.engine.settings import KNOB_USERS
    notes = []
    for knob in ("sink", "recent"):
        if knob not in given:
            continue
        want = getattr(plan.base, knob)
        cut = {}
        for b, m in plan.runs():
            if b is None or m not in KNOB_USERS[knob] or plan.budget(b).kind == "paper":  # those bring their own
                continue
            for n in plan.lengths:
                got = getattr(plan.settings(m, n, b), knob)
                if got != want:
                    cut.setdefault(got, []).append(f"{m} @ {b} at {length_label(n)}")
        if cut:
            where = "; ".join(f"{knob} {got} for {', '.join(w[:3])}{' ...' if len(w) > 3 else ''}"
                              for got, w in sorted(cut.items()))
            notes.append(f"--{knob} {want} does not fit in every budget (--split shrink keeps sink + recent within "
                         f"half of it): {where}. --split paper gives budget/16 each")
    return notes


def whole_context_notes(plan) -> list[str]:
    """Runs whose budget covers the whole prompt: the method then attends to every token."""
    from tailorkv.engine import ui
    from tailorkv.engine.evaluation.plan import length_label
    from tailorkv.engine.settings import KNOB_USERS
    notes = []
    for b, m in plan.runs():
        covered = [n for n in plan.lengths if m in KNOB_USERS["budget"] and plan.settings(m, n, b).budget >= n]
        if covered:
            notes.append(f"{m} @ budget {b}: {plan.settings(m, covered[0], b).budget} tokens cover the whole context "
                         f"at {', '.join(map(length_label, covered))}: {ui.every_token_note(m)}")
    return notes


def run_eval(params: dict, knobs: dict, *, model, weights, random_weights, device, dtype, out, shard, resume,
             overwrite=False, **options):
    """`options`: make_plan's keyword arguments; `knobs`: method_options' (the settings every method shares)."""
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from tailorkv.engine import options as options_mod, results as R, ui
    from tailorkv.engine.bench.driver import model_info
    from tailorkv.engine.evaluation import driver as D, merge as M, plan as P, prompts, summary as S
    from tailorkv.engine.evaluation.report import write_outputs
    from tailorkv.engine.methods import layer_policies

    click_ctx = click.get_current_context()
    plan = make_plan(knobs, **options)
    options_mod.check_knob_use(click_ctx, plan.methods)
    check_budget_knobs(click_ctx, plan)
    shard_t = P.parse_shard(shard)
    if shard_t is not None and not out:
        raise ui.UserError("--shard needs --out DIR: every shard of a run writes into the same folder")
    if resume and not out:
        raise ui.UserError("--resume needs --out DIR: the folder of the run to finish")
    if resume and overwrite:
        raise ui.UserError("--resume keeps the earlier run's items, --overwrite replaces them: use one of them")
    name = "eval.json" if shard_t is None else P.shard_filename(*shard_t)
    prev = None  # the results file --resume finishes
    if out is not None:
        done_path = os.path.join(R.check_out(out), name)
        if not resume:
            R.refuse_existing(done_path, overwrite, also=" (--resume finishes an interrupted run)")
        elif os.path.exists(done_path):
            try:
                prev = M.read_results(done_path)
            except InputError as e:
                raise ui.UserError(f"{e}: start over with --overwrite instead of --resume") from None
    dev = ui.pick_device(device)
    cfg, family = options_mod.peek(model, weights, random_weights)
    plan.base = options_mod.model_defaults(plan.base, family)  # every method's settings derive from it
    too_long = [n for n in plan.lengths if n > cfg.max_context]
    if too_long:
        raise ui.UserError(f"--lengths {too_long[0]} is beyond what {model} supports "
                            f"({cfg.max_context} tokens): lower --lengths")
    options_mod.check_for_model([plan.settings(m, n, b.label) for m in plan.methods for n in plan.lengths
                                 for b in plan.budgets], cfg, click_ctx, family)
    if prev is not None:  # another run's file: refused before the weights load
        M.check_same_run(prev, S.results(command="", args={}, env={}, model={}, plan=plan, shard=shard_t,
                                         records=[]), done_path)
    for note in whole_context_notes(plan) + shrunk_notes(plan, options_mod.given_knobs(click_ctx)):
        ui.err.print(f"[yellow]{escape(note)}[/]")
    tok = options_mod.peek_tokenizer(model, weights, random_weights)
    if tok is not None:  # the shortest length's samples, before the weights load: one too short fails here
        prompts.build_suites(tok, plan, lengths=[min(plan.lengths)])
    with R.results_dir(out, model, family, "eval/results", name) as out:  # shards share a folder, not a file
        torch.manual_seed(plan.seed)
        loaded = ui.load_with_progress(model, weights, random_weights, dev, ui.pick_dtype(dtype, dev, cfg))
        D.check_methods(loaded, plan)

        items = P.shard_items(plan.items(), shard_t)
        json_path = os.path.join(out, name)
        con = _console()
        with con.status("generating the samples"):  # every length, even in a shard: the hash checks the merge
            suites = prompts.build_suites(loaded.tokenizer, plan)
        policies = {b.label: {m: layer_policies(plan.settings(m, plan.lengths[0], b.label), loaded.cfg.n_layers,
                                                loaded.family) for m in plan.methods} for b in plan.budgets}
        common = dict(command=R.command_line(), args=dict(params), env=R.environment(dev), model=model_info(loaded),
                      plan=plan, shard=shard_t, suites_hash=prompts.suite_hash(suites, plan.question),
                      layer_policies=policies)
        records: list[dict] = []
        if prev is not None:
            records = M.resumable_records(prev, S.results(records=[], **common), json_path, plan)
            done = {r["item"] for r in records}
            items = [it for it in items if it["index"] not in done]
            con.print(f"resuming {json_path}: {ui.count(len(done), 'item')} done, {len(items)} to go")
        last_save = [0.0]

        def save(force: bool = False):  # partial results survive an interrupt; at most every SAVE_EVERY_S seconds
            if force or time.monotonic() - last_save[0] >= SAVE_EVERY_S:
                R.write_json(json_path, S.results(records=records, **common))
                last_save[0] = time.monotonic()

        texts: dict = {}
        bar = Progress(TextColumn("[cyan]{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), TimeRemainingColumn(), console=ui.err, transient=True)
        with ui.interrupt_once():  # a second Ctrl-C cannot cut the saving short
            try:
                run_items(items, loaded, plan, suites, texts, records, bar, save, lines=not ui.err.is_terminal)
            except KeyboardInterrupt:
                if not records:
                    raise ui.Interrupted("no item had finished, nothing was written") from None
                if shard_t is None:  # the charts of what finished, not an earlier run's beside them
                    write_outputs(S.results(records=records, **common), out)
                else:
                    save(force=True)
                n_items = len({r["item"] for r in records})
                again = same_command(click_ctx, out=out, resume=True, overwrite=False)
                raise ui.Interrupted(f"{ui.count(n_items, 'item')} saved in {json_path}; to finish, run: "
                                     f"{again}") from None
        res = S.results(records=records, **common)
        if shard_t is None:
            paths = write_outputs(res, out)
        else:
            R.write_json(json_path, res)
            paths = [json_path]
        show(res, con)
        for r in records:
            if r["status"] != "ok":
                at = "" if r["budget"] is None else f" @ {r['budget']}"
                ui.err.print(f"[red]{P.length_label(r['length'])} {r['method']}{at} {r.get('task', 'fidelity')}: "
                              f"{r['status'].upper()}[/] {escape(r['error'] or '')}")
        ok = sum(r["status"] == "ok" for r in records)
        con.print(f"{ok}/{len(records)} records ok; results in {', '.join(paths)}"
                  + (f" (shard {shard_t[0]} of {shard_t[1]}: merge with `tailorkv eval-merge {shlex.quote(out)}`)" if shard_t else ""))


def item_line(i: int, n: int, what: str, recs: list[dict]) -> str:
    """One line per finished item, for logs (where the progress bar does not show)."""
    parts = []
    for r in recs:
        name = r["method"] + ("" if r.get("budget") is None else f" @ {r['budget']}")
        if r["status"] != "ok":
            parts.append(f"{name} {r['status'].upper()}")
        elif r.get("score") is not None:
            parts.append(f"{name} score {r['score']:.0f}")
    wall = sum(r.get("wall_s") or 0.0 for r in recs)
    return f"[{i}/{n}] {what}: {', '.join(parts) or 'done'} ({wall:.1f} s)"


def run_items(items, loaded, plan, suites, texts, records, bar, save, lines: bool = False) -> None:
    """Runs the items in order under the progress bar (or, with lines, printing a line per item on stderr),
    appending their records and saving as it goes."""
    from tailorkv.engine import ui
    from tailorkv.engine.evaluation import driver as D
    from tailorkv.engine.evaluation.plan import length_label
    with bar:
        task = bar.add_task("eval", total=len(items))
        for i, it in enumerate(items, 1):
            what = length_label(it["length"]) + " " + (f"{it['task']} #{it['sample']}" if it["kind"] == "task" else
                                                       f"fidelity {it['method']}"
                                                       + ("" if it["budget"] is None else f" @ {it['budget']}"))
            bar.update(task, description=what)
            recs = D.run_item(loaded, plan, it, suites, texts,
                              on_phase=lambda s, w=what: bar.update(task, description=f"{w}: {s}"))
            records.extend(recs)
            save(force=any(r["status"] != "ok" for r in recs))
            bar.advance(task)
            if lines:
                ui.err.print(item_line(i, len(items), what, recs), markup=False)


def run_merge(folder: str, out: str | None, partial: bool = False, overwrite: bool = False) -> None:
    from tailorkv.engine import ui
    from tailorkv.engine.evaluation import merge as M
    from tailorkv.engine.evaluation.report import write_outputs
    from tailorkv.engine.results import check_out

    if not os.path.isdir(folder):
        raise ui.UserError(f"{folder} is a file: give the folder the shards wrote to" if os.path.exists(folder)
                           else f"{folder}: no such folder: give the --out folder that `tailorkv eval --shard i/n` "
                                f"wrote to")
    dest = check_out(out if out is not None else folder)
    target = os.path.join(dest, "eval.json")
    if os.path.exists(target) and not overwrite:  # an earlier merge is replaced; a whole run's results are not
        try:
            merged_before = bool(M.read_results(target).get("merged_from"))
        except InputError:
            merged_before = False
        if not merged_before:
            raise ui.UserError(f"{target} holds results that no merge wrote: pass --overwrite to replace them, "
                               f"or merge into another --out")
    files = sorted(f for f in glob.glob(os.path.join(folder, "eval.shard-*-of-*.json")) if os.path.isfile(f))
    if not files:
        raise ui.UserError(f"{folder} holds no eval.shard-*-of-*.json files: run `tailorkv eval --shard i/n "
                            f"--out {folder}` first")
    shards = []
    for f in files:
        try:
            res = M.read_results(f)
            if not isinstance(res.get("shard"), dict):
                raise InputError(f"{f} is not a shard file (no \"shard\" entry)")
        except InputError as e:
            raise ui.UserError(f"{e}: rerun that shard (tailorkv eval --shard i/n --out {folder} --overwrite)") \
                from None
        shards.append((os.path.basename(f), res))
    res, warnings = M.merge_shards(shards, partial)
    for w in warnings:
        if w not in res["warnings"]:  # those show() prints with the tables
            ui.err.print(f"[yellow]{escape(w)}[/]")
    paths = write_outputs(res, dest)
    con = _console()
    show(res, con)
    recs = res["records"] + res["fidelity"]
    con.print(f"merged {ui.count(len(files), 'shard')} ({ui.count(len({r['item'] for r in recs}), 'item')}, "
              f"{ui.count(len(recs), 'record')}); "
              f"results in {', '.join(paths)}")


def run_compare(path_a: str, path_b: str, method: str | None, against: str | None, json_out: str | None,
                plot: str | None, overwrite: bool) -> None:
    from tailorkv.engine import results as R
    from tailorkv.engine.evaluation import compare as C
    from tailorkv.engine.evaluation.labels import title_line

    for flag, path in (("--json", json_out), ("--plot", plot)):
        if path is not None:
            R.check_out(path, kind="file", flag=flag)
            if os.path.exists(path) and not overwrite:
                raise InputError(f"{flag} {path} already exists: pass --overwrite to replace it, or name another file")
    a, b = C.load_pair(path_a, path_b)
    cmp = C.compare(a, b, *C.pick_method(a, b, method, against))
    con = _console()
    for name, path, res in (("A", path_a, a), ("B", path_b, b)):
        commit = ((res.get("env") or {}).get("git_commit") or "?")[:9]
        con.print(f"[bold]{name}[/]: {escape(path)} ({escape(title_line(res))}; commit {commit})")
        if res.get("complete") is False:
            con.print(f"[yellow]warning: {name} is a partial run: only the samples both finished are paired[/]")
    con.print(f"{cmp['method']}: {cmp['paired']} samples paired ({cmp['only_a']} only in A, {cmp['only_b']} only in "
              f"B); settings that differ: {escape('; '.join(cmp['changed']) or 'none')}")
    for t in C.tables(cmp):
        con.print(t)
    if json_out is not None:
        R.write_json(json_out, cmp)
    if plot is not None:
        from tailorkv.engine.evaluation.plots import plot_compare
        plot_compare(cmp, plot)
    written = [p for p in (json_out, plot) if p is not None]
    if written:
        con.print(f"written to {', '.join(written)}")

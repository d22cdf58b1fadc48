"""`tailorkv profile`: calibrate which layers are quantization-friendly and write the model's profile
(JSON + PNG chart). cli.py calls `register(main)` to add the command."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from datetime import datetime, timezone

import click

from tailorkv.engine.errors import InputError
from tailorkv.engine.profiling.calibration import DEFAULT_N_Q, DEFAULT_TAU, DEFAULT_TOP

DEFAULT_LENGTH = 4096
MIN_LENGTH = 64  # fewer calibration tokens are refused: a row's top 5% is 1-3 keys (eval's --lengths floor too)
SHORT_WARNING = 1024  # below this many calibration tokens P gets noisy
PROFILE_CAP = 16 * 1024 * 1024  # an existing --out larger than this is no profile of ours
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
METHOD_NOTE = ("last n_q queries, per head softmax(q K^T / sqrt(D)) with the causal mask over all prompt keys "
               "(fp32); keep k = max(1, ceil(top * T)) keys per row, T = prompt tokens; "
               "P = 1 - mean over heads and rows of the kept mass; quant_layers = layers with P > tau")


def register(main) -> None:
    from tailorkv.engine import options, ui

    @main.command("profile")
    @options.model_options
    @click.option("--data", default=None,
                  help="calibration text file (UTF-8; - reads stdin)  [default: the built-in text]")
    @click.option("--tau", type=float, default=DEFAULT_TAU, show_default=True,
                  help="P above tau = quantization-friendly layer (0.001 <= tau < 1)")
    @click.option("--length", type=ui.Tokens(), default=None,
                  help=f"calibration tokens, e.g. 4096 or 4k (at least {MIN_LENGTH})  "
                       f"[default: {DEFAULT_LENGTH}, capped by the model's context]")
    @click.option("--n-q", "n_q", type=int, default=DEFAULT_N_Q, show_default=True,
                  help="last queries of the prompt used (at most the calibration tokens)")
    @click.option("--top", type=float, default=DEFAULT_TOP, show_default=True,
                  help="fraction of the keys kept per query row (0 < top < 1)")
    @click.option("--out", default=None,
                  help="profile JSON, the PNG goes next to it  [default: a named model's configs/profiles/<model>.json, "
                       "which its runs load; a model given by path: ./<name>.profile.json, for --layer-profile]")
    @click.option("--overwrite", is_flag=True, help="replace the files already at that path (the JSON and its PNG)")
    @ui.friendly
    def profile(model, weights, random_weights, device, dtype, threads, data, tau, length, n_q, top, out, overwrite):
        """Calibrate the layer types (TailorKV offline identification) and write the model's profile."""
        ui.set_threads(threads)
        run_profile(model, weights, random_weights, device, dtype, data, tau, length, n_q, top, out, overwrite)


def read_data(data: str | None) -> tuple[str, bytes, str]:
    """(text, raw bytes, source label) of the calibration data: the built-in text, a file, or stdin ("-")."""
    if data is None:
        from tailorkv.engine.profiling.text import SOURCE, TEXT
        return TEXT, TEXT.encode("utf-8"), SOURCE
    from tailorkv.engine.ui import read_text_bytes
    text, raw = read_text_bytes(data, "--data")
    if not text.strip():
        what = "the calibration text on stdin (--data -)" if data == "-" else f"the calibration file --data {data}"
        raise InputError(f"{what} is empty{'' if not raw else ' (only blank space)'}: give a few thousand tokens of "
                         f"text (or leave --data out for the built-in text)")
    return text, raw, "stdin" if data == "-" else data


def default_out(model: str, family: dict, random: bool) -> str:
    """A named model's profile in configs/ (its "profile" entry, else profiles/<name>.json), which its tailorkv
    runs load; a random-weights profile is meaningless, so it goes to profiles/<name>-random.json, which no run
    loads, never over a real one. A model given by path has no place there: ./<name>.profile.json, which runs
    take with --layer-profile."""
    from tailorkv.models.loader import CONFIG_DIR
    rel = family.get("profile")
    if rel and not random:
        return os.path.join(CONFIG_DIR, rel)
    suffix = "-random" if random else ""
    if family.get("name"):
        return os.path.join(CONFIG_DIR, "profiles", f"{family['name']}{suffix}.json")
    stem = os.path.splitext(os.path.basename(os.path.normpath(model)))[0]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in stem) or "model"
    return f"{name}{suffix}.profile.json"


def png_path(json_path: str) -> str:
    return os.path.splitext(json_path)[0] + ".png"


def is_profile(path: str) -> bool:
    """Whether the file at path is a profile this command wrote (JSON with P per layer and the layer types)."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > PROFILE_CAP:
            return False
        with open(path, "rb") as f:
            prof = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(prof, dict) and isinstance(prof.get("P"), list) and isinstance(prof.get("layer_types"), list)


def check_out_name(out: str) -> None:
    """--out names the JSON profile: a name that does not end in .json is refused, with the .json name to use."""
    if out.lower().endswith(".json"):
        return
    folder, base = os.path.split(out)
    stem = os.path.splitext(base)[0] or base or "profile"
    example = f"e.g. {os.path.join(folder, stem + '.json')}"
    use = f"use a name ending in .json, {example}"
    if out.lower().endswith(".png"):
        raise InputError(f"--out {out} names a chart, but --out names the JSON profile (its PNG chart goes next to "
                         f"it): {use}")
    if os.path.exists(out) and not is_profile(out):
        raise InputError(f"--out {out} exists and is not a profile this command wrote (a profile is JSON, named "
                         f"*.json): choose another --out ending in .json, {example}")
    raise InputError(f"--out {out} does not end in .json, and the profile is JSON (its PNG chart goes next to it): "
                     f"{use}")


def refuse_existing_files(out_path: str, overwrite: bool) -> None:
    """The profile and its chart replace files already there only with --overwrite; the message says what the
    file there is (an earlier profile, something else, the chart beside the JSON)."""
    from tailorkv.engine.results import refuse_existing
    if overwrite:
        return
    if os.path.exists(out_path):
        if is_profile(out_path):
            refuse_existing(out_path, overwrite)
        raise InputError(f"{out_path} exists and is not a profile this command wrote: pass --overwrite to replace "
                         f"it, or choose another --out")
    img = png_path(out_path)
    if os.path.exists(img):
        raise InputError(f"{img} already exists, and this run writes the chart of {out_path} there: pass "
                         f"--overwrite to replace it, or choose another --out")


def reproduce_command(model, weights, random_weights, device: str, dtype: str, data, tau, length, n_q, top,
                      out) -> str:
    """The command line that reproduces the profile, every setting explicit."""
    args = ["tailorkv", "profile", "--model", model]
    if weights:
        args += ["--weights", weights]
    if random_weights:
        args.append("--random-weights")
    args += ["--device", device, "--dtype", dtype]
    if data:
        args += ["--data", data]
    args += ["--tau", f"{tau:g}", "--length", str(length), "--n-q", str(n_q), "--top", f"{top:g}"]
    if out:
        args += ["--out", out]
    return shlex.join(args)


def run_profile(model, weights, random_weights, device, dtype, data, tau, length, n_q, top, out,
                overwrite: bool = False) -> dict:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table
    import torch

    from tailorkv.engine.methods import model_bits
    from tailorkv.engine.profiling.calibration import profile_model, validate
    from tailorkv.engine.profiling.plot import plot_profile

    from tailorkv import __version__
    from tailorkv.engine import options, ui
    from tailorkv.engine.results import check_free, check_out, git_commit, write_files_atomically

    err = ui.err
    validate(n_q, top, tau)
    if length is not None and length < MIN_LENGTH:
        raise InputError(f"--length {length} is too short: calibration needs at least {MIN_LENGTH} tokens (P is "
                         f"steady from a few thousand): use e.g. --length {DEFAULT_LENGTH // 1024}k")
    if out is not None:
        check_out(out, kind="file")
        check_out_name(out)
    text, raw, source = read_data(data)

    dev = ui.pick_device(device)
    cfg, family = options.peek(model, weights, random_weights)
    dt = ui.pick_dtype(dtype, dev, cfg)
    limit_ctx = cfg.max_context
    bits, bits_source = model_bits(family)  # checked before calibrating; shown with the result
    if length is not None and length > limit_ctx:
        raise InputError(f"--length {length} is beyond what {model} supports ({limit_ctx} tokens): "
                         f"lower --length")
    want = length if length is not None else min(DEFAULT_LENGTH, limit_ctx)
    if want < MIN_LENGTH:
        raise InputError(f"{model} supports {limit_ctx} tokens, fewer than the {MIN_LENGTH} calibration needs: "
                         f"profile a model with a longer context")
    out_path = out or default_out(model, family, random_weights)
    check_free([out_path, png_path(out_path)])
    refuse_existing_files(out_path, overwrite)
    loaded = ui.load_with_progress(model, weights, random_weights, dev, dt)
    from tailorkv.models.loader import require_tokenizer
    tok = require_tokenizer(loaded)
    bos = [tok.bos_id] if getattr(tok, "add_bos", False) and tok.bos_id is not None else []
    all_ids = bos + tok.encode(text)
    ids = all_ids[:want]
    if len(ids) < MIN_LENGTH:
        raise InputError(f"the calibration text gives only {ui.count(len(ids), 'token')}, fewer "
                         f"than the {MIN_LENGTH} calibration needs: give --data more text (a few thousand tokens)")
    if len(all_ids) < want:
        err.print(f"[yellow]the calibration text has {len(all_ids)} tokens, fewer than --length {want}: "
                  f"using all of them[/]")
    if len(ids) < SHORT_WARNING:
        err.print(f"[yellow]{len(ids)} calibration tokens: P from a short prompt is noisy "
                  f"(use a few thousand tokens)[/]")
    if n_q > len(ids):
        err.print(f"[yellow]--n-q {n_q} is more than the {len(ids)} calibration tokens: using all {len(ids)} "
                  f"of their queries[/]")
    from tailorkv.engine.profiling.calibration import top_k_count
    keep = top_k_count(len(ids), top)
    if keep >= len(ids):
        raise InputError(f"--top {top:g} of {len(ids)} calibration tokens keeps every key ({keep}), so P would be 0 "
                         f"in every layer: lower --top, e.g. --top {DEFAULT_TOP:g}")
    if top * len(ids) < 1:
        err.print(f"[yellow]--top {top:g} of {len(ids)} calibration tokens is less than one key: keeping 1 key "
                  f"per query row[/]")

    t0 = time.perf_counter()
    with Progress(TextColumn("[cyan]calibrating {task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} layers"), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task(f"{len(ids)} tokens", total=loaded.cfg.n_layers)
        res = profile_model(loaded, ids, n_q=n_q, top=top, tau=tau,
                            progress=lambda i, n: bar.update(task, completed=i, total=n))
    secs = time.perf_counter() - t0

    if loaded.random:
        err.print("[yellow]random weights: this profile says nothing about the real model; runs do not load it[/]")
    dtype_name = DTYPE_NAMES.get(str(dt), str(dt))
    dev_name = str(dev) if dev.index is not None else dev.type
    src = loaded.source
    if ":" in src:
        kind, _, path = src.partition(":")
        src = f"{kind}:{os.path.basename(os.path.normpath(path))}"
    prof = {
        "model": loaded.name,
        "weights": src,
        "n_layers": loaded.cfg.n_layers,
        "P": [round(x, 6) for x in res["P"]],
        "prediction_cos": [None if c is None else round(c, 6) for c in res["prediction_cos"]],
        "tau": tau,
        "n_q": n_q,
        "rows": res["rows"],
        "top": top,
        "top_k": res["top_k"],
        "quant_layers": res["quant_layers"],
        "layer_types": res["layer_types"],
        "calibration": {
            "source": source,
            "sha256": hashlib.sha256(raw).hexdigest(),
            "tokens": len(ids),
            "text_tokens": len(all_ids),
            "bos": bool(bos),
        },
        "method": METHOD_NOTE,
        "device": dev_name,
        "dtype": dtype_name,
        "command": reproduce_command(model, weights, random_weights, dev_name, dtype_name, data, tau, want,
                                     n_q, top, out),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tailorkv_version": __version__,
        "torch_version": torch.__version__,
        "git_head": git_commit(),  # the commit the working tree was based on
        "seconds": round(secs, 2),
    }
    img_path = png_path(out_path)

    def write_json(tmp):
        with open(tmp, "w") as f:
            json.dump(prof, f, indent=2)
            f.write("\n")

    write_files_atomically([(img_path, lambda tmp: plot_profile(prof, tmp)), (out_path, write_json)])

    con = Console(highlight=False, soft_wrap=True)  # the printed command stays one line, to paste
    con.print(f"[bold]{loaded.name}[/]: P per layer from {len(ids)} calibration tokens, last {res['rows']} "
              f"queries, top {res['top_k']} keys per row; tau = {tau:g}")
    table = Table()
    table.add_column("layer", justify="right")
    table.add_column("P", justify="right")
    table.add_column("type")
    table.add_column("q-hat cos", justify="right")
    for i, (p, kind, c) in enumerate(zip(res["P"], res["layer_types"], res["prediction_cos"])):
        label = "[bold yellow]quantization-friendly[/]" if kind == "quant" else "sparsity-friendly"
        table.add_row(str(i), f"{p:.4f}", label, "-" if c is None else f"{c:.3f}")
    con.print(table)
    q = res["quant_layers"]
    con.print(f"quantization-friendly layers: {', '.join(map(str, q)) if q else 'none'} "
              f"({len(q)} of {loaded.cfg.n_layers}); calibration took {secs:.1f} s")
    if q:
        con.print(f"tailorkv keeps their KV at {bits} bit{'s' if bits != 1 else ''} unless --bits is given ({bits_source})")
    con.print(f"wrote {out_path}")
    con.print(f"wrote {img_path}")
    if family and out_path == default_out(model, family, False):
        con.print(f"tailorkv runs of {loaded.name} load it (--layer-profile FILE picks another)")
    elif not loaded.random:
        weights_args = f" --weights {shlex.quote(weights)}" if weights else ""
        con.print(f"use it: tailorkv run --model {shlex.quote(model)}{weights_args} --method tailorkv "
                  f"--layer-profile {shlex.quote(out_path)}")
    return prof

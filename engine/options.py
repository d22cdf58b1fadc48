"""The options the commands share (model, method knobs) and their checks, all made before a model loads:
a knob that no chosen method uses is refused (KNOB_USERS in engine/settings.py says which method uses which)."""
from __future__ import annotations

import os

import click

from tailorkv.engine.errors import InputError
from tailorkv.engine.ui import Tokens, UserError


def model_options(fn):
    opts = [
        click.option("--model", "-m", default="smollm2-135m", show_default=True,
                     help="config name (see configs/), Hugging Face folder or hub id (org/name, from the HF cache "
                          "or downloaded), or .gguf file"),
        click.option("--weights", type=click.Path(), default=None,
                     help="HF folder, hub id or .gguf for a config name (checked against that config)"),
        click.option("--random-weights", is_flag=True, help="same-shaped random model (speed/memory work)"),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N"),
        click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto", show_default=True,
                     help="auto: bf16 on GPUs and CPUs with AMX, else fp32 (bf16 where fp32 weights would not fit)"),
        click.option("--threads", "-t", type=int, default=None, help="CPU threads (default: torch's choice)"),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _users(knob: str) -> str:
    from tailorkv.engine.settings import KNOB_USERS
    return ", ".join(KNOB_USERS[knob])


def method_options(fn):
    from tailorkv.engine.settings import (CHANNEL_RULES, DEFAULT_BITS, KT_BITS, METHODS, PREDICT_WEIGHTS,
                                          SELECT_MODES, SELECT_RULES, SKETCH_BITS, MethodSettings)
    d = MethodSettings()
    opts = [
        click.option("--method", type=click.Choice(METHODS), default="full", show_default=True, help="KV-cache method"),
        click.option("--bits", type=click.Choice(["1", "2"]), default=None,
                     help=f"bits of quantized layers (default: the model's config, configs/NAME.json \"bits\", "
                          f"else {DEFAULT_BITS}; {_users('bits')})"),
        click.option("--budget", type=Tokens(), default=d.budget, show_default=True,
                     help=f"tokens per sparse layer ({_users('budget')})"),
        click.option("--sink", type=Tokens(), default=d.sink, show_default=True, help=f"first tokens kept ({_users('sink')})"),
        click.option("--recent", type=Tokens(), default=d.recent, show_default=True,
                     help=f"last tokens kept ({_users('recent')})"),
        click.option("--channels", type=int, default=d.channels, show_default=True,
                     help=f"r channels per KV head, at most the head dimension ({_users('channels')})"),
        click.option("--quant-layers", default=None,
                     help=f"e.g. 0,1 (default: the layer profile's; {_users('quant_layers')})"),
        click.option("--layer-profile", default=None,
                     help="the layer profile, a JSON written by `tailorkv profile` (default: the model's shipped "
                          f"one, configs/profiles/NAME.json, where it has one) ({_users('layer_profile')})"),
        click.option("--select", type=click.Choice(SELECT_MODES), default=d.select, show_default=True,
                     help="sparse layers' scores: the paper's r channels of K^T from host memory (channels), "
                          "a 1/2/4-bit key sketch kept on the device (sketch), or the sketch scored one layer "
                          "early from the predicted query with the rows fetched meanwhile (sketch-ahead) "
                          f"({_users('select')})"),
        click.option("--sketch-bits", type=click.Choice([str(b) for b in SKETCH_BITS]), default=str(d.sketch_bits),
                     show_default=True,
                     help=f"bits of the key sketch ({_users('sketch_bits')})"),
        click.option("--kt-bits", type=click.Choice([str(b) for b in KT_BITS]), default=str(d.kt_bits),
                     show_default=True,
                     help="bits of the K^T copy in host memory whose rows --select channels reads each step: the "
                          "keys' own (16) or e4m3 with a power-of-two scale per channel (8: half the PCIe bytes) "
                          f"({_users('kt_bits')})"),
        click.option("--kt-cache/--no-kt-cache", default=d.kt_cache, show_default=True,
                     help="keep each sparse layer's K^T rows of its r channels on the device between steps and read "
                          "from host memory only the channels newly chosen (fewer PCIe bytes; + r / head dim of the "
                          f"keys on the device: 0.78 GB at 128k on an 8B) ({_users('kt_cache')})"),
        click.option("--predict-ahead", type=int, default=d.predict_ahead, show_default=True,
                     help="a sparse layer's query predicted from the input of the layer this many before it (1: the "
                          "paper's one layer early; more gives its selection and fetch more layers to run under) "
                          f"({_users('predict_ahead')})"),
        click.option("--predict-weights", type=click.Choice(PREDICT_WEIGHTS), default=d.predict_weights,
                     show_default=True,
                     help="the W_q that the one-layer-early query prediction reads: the model's (bf16) or e4m3 "
                          f"copies with a scale per row (fp8: half the bytes, +0.5 GiB on an 8B) "
                          f"({_users('predict_weights')})"),
        click.option("--select-rule", type=click.Choice(SELECT_RULES), default=d.select_rule, show_default=True,
                     help="top-K tokens of a KV head from its query heads' scores: summed logits (paper), "
                          f"logsumexp of logits (lse), summed probabilities (psum) ({_users('select_rule')})"),
        click.option("--channel-rule", type=click.Choice(CHANNEL_RULES), default=d.channel_rule, show_default=True,
                     help="r channels per KV head by |group mean of q| (paper), the max over the group's heads "
                          f"(max) or their L2 norm (l2), times max|K| ({_users('channel_rule')})"),
        click.option("--own-query-below", type=float, default=d.own_query_below, show_default=True,
                     help="sparse layers whose profiled q-hat cosine (`tailorkv profile`) is below this select "
                          f"from their own query, without the prefetch; 0 = never ({_users('own_query_below')})"),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


NUMBER_CHOICES = ("bits", "sketch_bits", "kt_bits")  # click.Choice options of numbers: click gives their strings


def numbers_typed(params: dict) -> dict:
    """Click's parameters with NUMBER_CHOICES as numbers (a results file's record of the command's arguments)."""
    return {k: int(v) if k in NUMBER_CHOICES and v is not None else v for k, v in params.items()}


KNOBS = ("bits", "budget", "sink", "recent", "channels", "quant_layers", "layer_profile", "select", "sketch_bits",
         "kt_bits", "kt_cache", "predict_ahead", "predict_weights", "select_rule", "channel_rule", "own_query_below")


def given_knobs(ctx: click.Context, names=KNOBS) -> list[str]:
    """The method knobs (or other options of `names`) the user set (on the command line or through the environment)."""
    from click.core import ParameterSource
    given = []
    for k in names:
        src = ctx.get_parameter_source(k)
        if src in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            given.append(k)
    return given


def check_knob_use(ctx: click.Context, methods: list[str]) -> None:
    """A knob given while no chosen method (or --select mode) uses it is an error (it would be ignored without a
    word)."""
    from tailorkv.engine.settings import KNOB_USERS, SELECT_KNOBS, MethodSettings
    select = ctx.params.get("select") or MethodSettings.select
    for k in given_knobs(ctx):
        flag = "--" + k.replace("_", "-")
        if not set(KNOB_USERS[k]) & set(methods):
            chosen = ", ".join(methods)
            which = "that method" if len(KNOB_USERS[k]) == 1 else "one of those methods"
            raise UserError(f"{flag} has no effect under {chosen}: it applies to {_users(k)}; drop {flag} "
                            f"or choose {which}")
        if select not in SELECT_KNOBS.get(k, (select,)):
            modes = " or ".join(SELECT_KNOBS[k])
            raise UserError(f"{flag} has no effect with --select {select}: it applies to --select {modes}; drop "
                            f"{flag} or choose that selection")


def settings_from(method, bits, budget, sink, recent, channels, quant_layers, select="channels", sketch_bits=2,
                  select_rule=None, channel_rule=None, own_query_below=None, predict_ahead=1, predict_weights="bf16",
                  layer_profile=None, kt_bits=16, kt_cache=False):
    from tailorkv.engine.settings import MethodSettings
    ql = None
    if quant_layers is not None:
        try:
            ql = [int(x) for x in quant_layers.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--quant-layers '{quant_layers}' is not a list of layer numbers like 0,1") from None
    rules = {k: v for k, v in (("select_rule", select_rule), ("channel_rule", channel_rule),
                               ("own_query_below", own_query_below)) if v is not None}
    s = MethodSettings(method=method, bits=None if bits is None else int(bits), budget=budget, sink=sink,
                       recent=recent, channels=channels, quant_layers=ql, select=select,
                       layer_profile=os.path.abspath(layer_profile) if layer_profile else None,  # as --resume compares
                       sketch_bits=int(sketch_bits), kt_bits=int(kt_bits), kt_cache=kt_cache, predict_ahead=predict_ahead,
                       predict_weights=predict_weights, **rules)
    try:
        s.validate()
    except InputError as e:
        raise UserError(str(e)) from None
    return s


def check_for_model(settings_list, cfg, ctx: click.Context, family: dict) -> list:
    """Knobs against the model's shape, and tailorkv's layer profile (given, shipped, or none: an error); returns
    the settings with the profile's layers filled in (methods.with_profile). Only a --channels the user gave is
    checked: the default (the paper's 12) is cut to a smaller head dimension by the policy."""
    import shlex
    from dataclasses import replace
    from tailorkv.engine.methods import layer_profile, with_profile
    given = given_knobs(ctx)
    model = shlex.quote(ctx.params.get("model") or "MODEL")
    checked = []
    for s in settings_list:
        try:
            if s.method == "tailorkv" and "own_query_below" in given and s.own_query_below > 0 \
                    and not any(c is not None for c in (layer_profile(s, family) or {}).get("prediction_cos") or []):
                raise InputError(f"--own-query-below reads the layers' profiled q-hat cosines, and this model's layer "
                                 f"profile has none: write one with `tailorkv profile --model {model} --out prof.json`"
                                 f" and pass --layer-profile prof.json")
            s = with_profile(s, family, cfg.n_layers, model)
            (s if "channels" in given else replace(s, channels=1)).check_model(cfg.head_dim, cfg.n_layers)
            checked.append(s)
        except InputError as e:
            raise UserError(str(e)) from None
    for path in {s.layer_profile for s in checked if s.method == "tailorkv" and s.layer_profile}:  # one warning
        warn_other_model(path, ctx.params.get("model"), family, model)
    return checked


def warn_other_model(path: str, model_arg: str | None, family: dict, model: str) -> None:
    """A --layer-profile written for another model (its "model" field, same layer count) is used with a warning:
    a fine-tune may share its base's layer types, another model need not."""
    from tailorkv.engine.methods import read_profile
    from tailorkv.engine.ui import err
    prof = read_profile(path)
    written, weights = prof.get("model"), str(prof.get("weights", "")).partition(":")[2]
    base = os.path.basename(os.path.normpath(model_arg or ""))
    run = {model_arg, base, os.path.splitext(base)[0], family.get("name")}
    if isinstance(written, str) and not run & {written, weights}:
        err.print(f"[yellow]warning: --layer-profile {path} was written for {written}, this run "
                  f"uses {model_arg}: its layer types may not fit (`tailorkv profile --model {model}` writes this "
                  f"model's)[/]")


def plan_memory(settings, cfg, family: dict, ctx_len: int, limit: int | None, dtype, ctx: click.Context,
                batch: int = 1):
    """tailorkv with --select sketch under --gpu-mem-limit: the sketch's bits from the memory plan (engine/
    memory_plan.py), or the user's --sketch-bits checked against it; the plan's line goes to stderr."""
    import torch
    from tailorkv.engine import ui
    from tailorkv.engine.memory_plan import plan_settings
    chosen = "sketch_bits" in given_knobs(ctx)
    size = torch.empty((), dtype=dtype).element_size()
    try:
        settings, plan = plan_settings(settings, cfg, family, ctx_len, limit, size, chosen, batch)
    except InputError as e:
        raise UserError(str(e)) from None
    if plan is not None:
        ui.err.print(plan.message, style="dim" if plan.fits else "yellow", markup=False, highlight=False)
    return settings


def peek(model: str, weights, random_weights: bool):
    """(the model's hyper-parameters, its configs/NAME.json entry or {}) before loading it (LoadError -> one
    line)."""
    from tailorkv.models.errors import LoadError
    from tailorkv.models.loader import peek_config
    try:
        return peek_config(model, weights, random_weights)
    except LoadError as e:
        raise UserError(str(e)) from None


def peek_tokenizer(model: str, weights, random_weights: bool):
    """The model's tokenizer (None where it has none) before its weights load (LoadError -> one line)."""
    from tailorkv.models.errors import LoadError
    from tailorkv.models.loader import load_tokenizer
    try:
        return load_tokenizer(model, weights, random_weights)
    except LoadError as e:
        raise UserError(str(e)) from None


def model_defaults(settings, family: dict):
    """settings with the knobs the user left out taken from the model's config (its "bits"); a bad value there
    -> one line naming the file and the field."""
    from tailorkv.engine.methods import with_model_defaults
    try:
        return with_model_defaults(settings, family)
    except InputError as e:
        raise UserError(str(e)) from None

"""What the commands share: one-line user errors, the common options, argument parsing, loading with a
progress bar, byte formatting. Used by cli.py and the tool commands (engine/bench, evaluation, profiling)."""
from __future__ import annotations

import functools

import click
from rich.console import Console

err = Console(stderr=True, highlight=False)


class UserError(click.ClickException):
    """One line naming the cause and the fix; exit status 1, no traceback."""

    def show(self, file=None):
        from rich.markup import escape
        err.print(f"[bold red]error:[/] {escape(self.message)}", highlight=False, soft_wrap=True)


def friendly(fn):
    """Turn the errors a user can cause into one clear line."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        import torch
        from tailorkv.models.errors import LoadError
        from tailorkv.engine.generate import ContextTooLong
        try:
            return fn(*a, **kw)
        except (LoadError, ContextTooLong, ValueError) as e:
            raise UserError(str(e)) from None
        except torch.cuda.OutOfMemoryError:
            raise UserError("the GPU ran out of memory: lower --ctx, use --method tailorkv, "
                            "or a smaller --dtype") from None
        except FileNotFoundError as e:
            raise UserError(f"{e.filename}: no such file") from None
    return wrapper


def parse_length(text: str, flag: str = "--ctx") -> int:
    """'8192', '8k', '0.5k', '1m' -> tokens (k = 1024); a ValueError naming `flag` otherwise."""
    t = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale) if scale > 1 else int(t)
    except ValueError:
        raise ValueError(f"{flag} '{text}' is not a length: write e.g. 8192, 8k or 128k") from None


def parse_ctx(text: str) -> int:
    return parse_length(text, "--ctx")


def split_list(text: str | None) -> list[str]:
    """'a, b,,a' -> ['a', 'b'] (order kept, duplicates dropped)."""
    out: list[str] = []
    for part in (text or "").split(","):
        part = part.strip()
        if part and part not in out:
            out.append(part)
    return out


def pick_device(device: str):
    import torch
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("CUDA was requested but no GPU is visible: use --device cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise UserError(f"--device '{device}' is not a device: use auto, cpu or cuda[:N]") from None


def pick_dtype(dtype: str, device):
    import torch
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
            "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}[dtype]


def load_with_progress(model: str, weights, random_weights: bool, device, dtype, quiet: bool = False):
    from rich.progress import Progress, BarColumn, TextColumn, TimeElapsedColumn
    from tailorkv.models.loader import load_model
    with Progress(TextColumn("[cyan]loading {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=True, disable=quiet) as bar:
        task = bar.add_task(model, total=None)
        loaded = load_model(model, weights, random_weights, device, dtype,
                            progress=lambda i, n: bar.update(task, completed=i, total=n))
    if loaded.random:
        err.print("[yellow]random weights: the model's text is meaningless (use them for speed and memory work)[/]")
    return loaded


def check_ctx(ctx: int | None, loaded) -> int:
    limit = loaded.cfg.max_context
    ctx = ctx or min(limit, 8192)
    if ctx > limit:
        raise UserError(f"--ctx {ctx} is beyond what {loaded.name} supports ({limit} tokens): lower --ctx")
    if ctx < 16:
        raise UserError(f"--ctx {ctx} is too small: use at least 16")
    return ctx


def model_options(fn):
    opts = [
        click.option("--model", "-m", default="smollm2-135m", show_default=True,
                     help="config name (see configs/), Hugging Face folder or .gguf file"),
        click.option("--weights", type=click.Path(), default=None, help="HF folder or .gguf for a config name"),
        click.option("--random-weights", is_flag=True, help="same-shaped random model (speed/memory work)"),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N"),
        click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto", show_default=True),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def method_options(fn):
    from tailorkv.engine.settings import CHANNEL_RULES, METHODS, SELECT_RULES, MethodSettings
    d = MethodSettings()
    opts = [
        click.option("--method", type=click.Choice(METHODS), default="full", show_default=True, help="KV-cache method"),
        click.option("--bits", type=click.Choice(["1", "2"]), default=str(d.bits), show_default=True,
                     help="bits of quantized layers"),
        click.option("--budget", type=int, default=d.budget, show_default=True, help="tokens per sparse layer"),
        click.option("--sink", type=int, default=d.sink, show_default=True),
        click.option("--recent", type=int, default=d.recent, show_default=True),
        click.option("--channels", type=int, default=d.channels, show_default=True, help="r channels per KV head"),
        click.option("--quant-layers", default=None, help="e.g. 0,1 (default: the model's profile)"),
        click.option("--select-rule", type=click.Choice(SELECT_RULES), default=d.select_rule, show_default=True,
                     help="top-K tokens of a KV head from its query heads' scores: summed logits (paper), "
                          "logsumexp of logits (lse), summed probabilities (psum)"),
        click.option("--channel-rule", type=click.Choice(CHANNEL_RULES), default=d.channel_rule,
                     show_default=True, help="r channels per KV head by |group mean of q| (paper), the max over "
                                             "the group's heads (max) or their L2 norm (l2), times max|K|"),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def settings_from(method, bits, budget, sink, recent, channels, quant_layers, select_rule=None,
                  channel_rule=None):
    from tailorkv.engine.settings import MethodSettings
    ql = None
    if quant_layers is not None:
        try:
            ql = [int(x) for x in quant_layers.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--quant-layers '{quant_layers}' is not a list of layer numbers like 0,1") from None
    s = MethodSettings(method=method, bits=int(bits), budget=budget, sink=sink, recent=recent,
                       channels=channels, quant_layers=ql,
                       **{k: v for k, v in (("select_rule", select_rule), ("channel_rule", channel_rule)) if v})
    s.validate()
    return s


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024

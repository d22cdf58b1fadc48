"""The `tailorkv` command: run (chat), bench, profile, eval."""
from __future__ import annotations

import functools
import sys

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
        from models.errors import LoadError
        from engine.generate import ContextTooLong
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


def parse_ctx(text: str) -> int:
    t = text.strip().lower()
    try:
        if t.endswith("k"):
            return int(float(t[:-1]) * 1024)
        if t.endswith("m"):
            return int(float(t[:-1]) * 1024 * 1024)
        return int(t)
    except ValueError:
        raise UserError(f"--ctx '{text}' is not a length: write e.g. 8192, 8k or 128k") from None


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
    from models.loader import load_model
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
    from engine.settings import METHODS, MethodSettings
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
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def settings_from(method, bits, budget, sink, recent, channels, quant_layers):
    from engine.settings import MethodSettings
    ql = None
    if quant_layers is not None:
        try:
            ql = [int(x) for x in quant_layers.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--quant-layers '{quant_layers}' is not a list of layer numbers like 0,1") from None
    s = MethodSettings(method=method, bits=int(bits), budget=budget, sink=sink, recent=recent,
                       channels=channels, quant_layers=ql)
    s.validate()
    return s


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """tailorkv: long-context inference for Llama-family models with the TailorKV cache."""


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def turn_line(stats, engine) -> str:
    c = engine.cache
    return (f"prefill {stats.prompt_tokens} tok at {stats.prefill_tps:.0f} tok/s | "
            f"decode {stats.new_tokens} tok at {stats.decode_tps:.1f} tok/s | "
            f"KV device {fmt_bytes(c.device_bytes())}, host {fmt_bytes(c.host_bytes())} | "
            f"context {len(engine.tokens)}/{engine.max_len}")


@main.command()
@model_options
@method_options
@click.option("--ctx", default=None, help="context length: 8192, 8k, 128k (default: min(model, 8k))")
@click.option("--prompt", "-p", default=None, help="one-shot: print only the answer to this prompt")
@click.option("--system", default=None, help="system message")
@click.option("--max-new-tokens", "-n", type=int, default=512, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--no-chat-template", is_flag=True, help="feed raw text, no chat template")
@friendly
def run(model, weights, random_weights, device, dtype, method, bits, budget, sink, recent, channels,
        quant_layers, ctx, prompt, system, max_new_tokens, temperature, top_p, top_k, seed, stop, no_chat_template):
    """Chat with a model (or answer one --prompt)."""
    from engine.chat import ChatSession
    from engine.generate import Engine
    from engine.methods import build_cache
    from engine.sampling import SamplingParams

    sampling = SamplingParams(temperature, top_p, top_k, seed)
    sampling.validate()
    settings = settings_from(method, bits, budget, sink, recent, channels, quant_layers)
    dev = pick_device(device)
    ctx_len = parse_ctx(ctx) if ctx else None
    loaded = load_with_progress(model, weights, random_weights, dev, pick_dtype(dtype, dev), quiet=prompt is not None)
    if loaded.tokenizer is None:
        raise UserError(f"{loaded.name} has no tokenizer here: pass --weights DIR with tokenizer.json")
    cache = build_cache(loaded, settings, check_ctx(ctx_len, loaded))
    chat = ChatSession(Engine(loaded, cache, sampling), system=system, use_template=not no_chat_template)
    if prompt is not None:
        def out(s):
            sys.stdout.write(s)
            sys.stdout.flush()
        chat.send(prompt, max_new_tokens, tuple(stop), on_text=out)
        sys.stdout.write("\n")
        return
    repl(chat, max_new_tokens, tuple(stop))


def repl(chat, max_new_tokens: int, stop: tuple[str, ...]) -> None:
    con = Console(highlight=False)
    eng = chat.engine
    con.print(f"[bold]tailorkv[/] {eng.loaded.name} ({eng.cache.method}) on {eng.device}, "
              f"context {eng.max_len}. /reset, /stats, /exit; Ctrl-C stops an answer, Ctrl-D exits.")
    last = None
    while True:
        try:
            text = con.input("[bold green]>>> [/]")
        except EOFError:
            con.print()
            return
        except KeyboardInterrupt:
            con.print()
            continue
        cmd = text.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit", "/bye"):
            return
        if cmd == "/reset":
            chat.reset()
            con.print("[dim]conversation cleared[/]")
            continue
        if cmd == "/stats":
            con.print(f"[dim]{turn_line(last, eng) if last else 'no turn yet'}; "
                      f"{len(chat.messages)} messages; policy counters {eng.cache.stats()}[/]")
            continue
        if cmd.startswith("/"):
            con.print("[yellow]unknown command; use /reset, /stats or /exit[/]")
            continue
        try:
            _, last = chat.send(text, max_new_tokens, stop, on_text=lambda s: con.out(s, end="", highlight=False))
            con.print()
            con.print(f"[dim]{turn_line(last, eng)}[/]")
        except KeyboardInterrupt:
            con.print("\n[dim](stopped; the history is kept)[/]")
        except Exception as e:  # a turn that fails must not lose the chat
            import torch
            from rich.markup import escape
            from engine.generate import ContextTooLong
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
                eng.recover()
                e = "the GPU ran out of memory in this turn: /reset, or restart with a lower --ctx or --method tailorkv"
            elif not isinstance(e, (ContextTooLong, ValueError)):
                raise
            con.print(f"[bold red]error:[/] {escape(str(e))}")


def _register_commands() -> None:
    from engine.profile_cli import register as register_profile
    from engine.bench_cli import register as register_bench
    from engine.eval_cli import register as register_eval
    register_profile(main)
    register_bench(main)
    register_eval(main)


_register_commands()

if __name__ == "__main__":
    main()

"""The `tailorkv` command: run (chat), bench, profile, eval."""
from __future__ import annotations

import sys

import click
from rich.console import Console

from tailorkv.engine.ui import (UserError, check_ctx, fmt_bytes, friendly, load_with_progress, method_options,
                                model_options, parse_ctx, pick_device, pick_dtype, settings_from)

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """tailorkv: long-context inference for Llama-family models with the TailorKV cache."""


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
        quant_layers, select_rule, channel_rule, ctx, prompt, system, max_new_tokens, temperature, top_p, top_k,
        seed, stop, no_chat_template):
    """Chat with a model (or answer one --prompt)."""
    from tailorkv.engine.chat import ChatSession
    from tailorkv.engine.generate import Engine
    from tailorkv.engine.methods import build_cache
    from tailorkv.engine.sampling import SamplingParams

    sampling = SamplingParams(temperature, top_p, top_k, seed)
    sampling.validate()
    settings = settings_from(method, bits, budget, sink, recent, channels, quant_layers, select_rule, channel_rule)
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
            from tailorkv.engine.generate import ContextTooLong
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
                eng.recover()
                e = "the GPU ran out of memory in this turn: /reset, or restart with a lower --ctx or --method tailorkv"
            elif not isinstance(e, (ContextTooLong, ValueError)):
                raise
            con.print(f"[bold red]error:[/] {escape(str(e))}")


def _register_commands() -> None:
    from tailorkv.engine.profiling.command import register as register_profile
    from tailorkv.engine.bench.command import register as register_bench
    from tailorkv.engine.evaluation.command import register as register_eval
    register_profile(main)
    register_bench(main)
    register_eval(main)


_register_commands()

if __name__ == "__main__":
    main()

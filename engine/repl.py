"""The interactive chat of `tailorkv run`: reads lines, streams answers, prints a stats line per turn, and keeps
the conversation through every error a turn can meet (Ctrl-C, context full, out of memory, bad input)."""
from __future__ import annotations

import functools
import sys

from rich.console import Console
from rich.markup import escape

from tailorkv.engine.ui import err, fmt_bytes

HELP = ("/reset clears the chat, /stats shows the last turn's figures, /exit (or /quit) quits, /help shows this; "
        "Ctrl-C stops an answer, Ctrl-D exits")
EXITS = ("/exit", "/quit", "/bye")
COMMANDS = ("/reset", "/stats", "/help", *EXITS)
ON_DEVICE_ALL = ("full", "quest")  # methods that keep every token's K and V on the device
EMPTY_WHY = {"eos": "the model ended its turn at once", "stop string": "the answer began with a --stop string"}


def kv_line(engine) -> str:
    """What the KV cache holds against what it reserved: a preallocated cache is mostly empty early on."""
    c, used, cap = engine.cache, len(engine.tokens), engine.max_len
    dev, host = c.device_bytes(), c.host_bytes()
    text = f"KV {used}/{cap} tokens"
    if not used and getattr(engine, "rewind_emptied", False):
        text += (f" (emptied: the stop string ended inside tokens that the {c.method} cache cannot drop; the next "
                 f"turn prefills the conversation again)")
    text += f"; device {fmt_bytes(dev)} reserved"
    if c.method in ON_DEVICE_ALL and cap:
        text += f", {fmt_bytes(dev * used / cap)} held"
    if host:
        text += f"; host {fmt_bytes(host)}"
    return text


def turn_line(stats, engine) -> str:
    return (f"prefill {stats.prompt_tokens} tok at {stats.prefill_tps:.0f} tok/s | "
            f"decode {stats.new_tokens} tok at {stats.decode_tps:.1f} tok/s | {kv_line(engine)}")


def context_full_note(stats, engine, fix: str) -> str | None:
    """What to say when an answer stopped because the context filled up (else None)."""
    if stats.stop != "context full":
        return None
    n = stats.new_tokens
    return (f"the answer stopped after {n} token{'' if n == 1 else 's'}: the context (--ctx {engine.max_len} tokens) is "
            f"full: {fix}")


def counters_text(stats: dict) -> str:
    parts = []
    for k, v in sorted(stats.items()):
        shown = fmt_bytes(v) if k.startswith("bytes_") or k.endswith("_bytes") else f"{v:g}"
        parts.append(f"{k.replace('_', ' ')} {shown}")
    return ", ".join(parts) if parts else "none"


def stats_text(chat, last) -> str:
    eng = chat.engine
    lines = [f"last turn: {turn_line(last, eng)}" if last else
             f"no finished turn since the start or /reset; {kv_line(eng)}",
             f"{len(chat.messages)} messages; sampling {eng.sampling.describe()}",
             f"{eng.cache.method} counters (last step, summed over the {len(eng.cache.layers)} layers): "
             f"{counters_text(eng.cache.stats())}"]
    return "\n".join(lines)


def read_line(con: Console) -> str:
    if not _readline():
        return con.input("[bold green]>>> [/]")
    return input("\001\033[1;32m\002>>> \001\033[0m\002")  # \001 \002: what readline does not count as shown


@functools.cache
def _readline() -> bool:
    """Whether the chat reads a terminal through readline: line editing and history, and a pasted line of any
    length (the terminal's own line editing cuts one at 4095 bytes, silently)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return False
    try:
        import readline
    except ImportError:
        return False
    readline.parse_and_bind("set enable-bracketed-paste off")  # pasted lines keep arriving one by one, as typed
    return True


def repl(chat, max_new_tokens: int, stop: tuple[str, ...], sampling_note: str = "", method_note: str = "") -> None:
    con = Console(highlight=False, soft_wrap=True)  # long lines wrap in the terminal, not at 80 columns in logs
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    eng = chat.engine
    con.print(f"[bold]tailorkv[/] {escape(eng.loaded.name)} ({eng.cache.method}{escape(method_note)}) on "
              f"{eng.device}, context {eng.max_len}; sampling {escape(sampling_note)}.\n[dim]{HELP}[/]")
    last = None
    while True:
        try:
            text = read_line(con)  # undecodable bytes arrive as lone surrogates
        except EOFError:
            con.print()
            return
        except KeyboardInterrupt:
            con.print()
            continue
        cmd = text.strip()
        if not cmd:
            continue
        try:
            cmd.encode("utf-8")
        except UnicodeEncodeError:
            err.print("[bold red]error:[/] that line holds bytes that are not UTF-8 text: type it again "
                      "(the chat is kept)")
            continue
        if cmd.startswith("/"):
            cmd = cmd.lower()  # /STATS is /stats
        if cmd in EXITS:
            return
        if cmd == "/help":
            con.print(f"[dim]{HELP}[/]")
            continue
        if cmd == "/reset":
            chat.reset()
            last = None
            con.print("[dim]conversation cleared[/]")
            continue
        if cmd == "/stats":
            con.print(f"[dim]{escape(stats_text(chat, last))}[/]")
            continue
        if cmd.startswith("/"):
            word = cmd.split()[0]
            what = "takes no arguments" if word in COMMANDS else "is not a command"
            con.print(f"[yellow]{escape(word)} {what}: {HELP}[/]")
            continue
        last = turn(con, chat, text, max_new_tokens, stop) or last


def _write(con: Console, text: str) -> None:
    """A piece of the answer, straight to the terminal: rich's buffer, cut by a Ctrl-C, would print it again."""
    con.file.write(text)
    con.file.flush()


def turn(con: Console, chat, text: str, max_new_tokens: int, stop: tuple[str, ...]):
    """One answer; returns its stats, or None when it failed (the history is kept either way)."""
    import torch
    from tailorkv.engine.errors import InputError
    eng = chat.engine  # on every error below, chat.send has already kept the history and repaired the cache
    try:
        answer, stats = chat.send(text, max_new_tokens, stop, on_text=lambda s: _write(con, s))
        con.print()
        if not answer.strip():
            con.print(f"[dim](an empty answer: {EMPTY_WHY.get(stats.stop, 'nothing came before it ended')})[/]")
        con.print(f"[dim]{turn_line(stats, eng)}[/]")
        note = context_full_note(stats, eng, "/reset the chat, or restart with a larger --ctx")
        if note:
            err.print(f"warning: {note}", style="yellow", markup=False)
        return stats
    except KeyboardInterrupt:
        con.print("\n[dim](stopped; the history is kept)[/]")
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        err.print("[bold red]error:[/] the GPU ran out of memory in this turn: /reset, or restart with a lower "
                  "--ctx or --method tailorkv")
    except InputError as e:
        err.print(f"[bold red]error:[/] {escape(str(e))}")
    except Exception:  # a bug, not the user's doing: its traceback, and the chat goes on with its history
        err.print_exception()
        err.print("[bold red]error:[/] this turn failed inside tailorkv (the traceback above is a bug to report); "
                  "the conversation is kept: ask again, or /reset")
    return None

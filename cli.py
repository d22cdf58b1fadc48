"""The `tailorkv` command: run (chat or one-shot), bench, profile, eval. Every argument is checked before the
model loads; errors a user can cause end in one line (engine/ui.py)."""
from __future__ import annotations

import errno
import sys

import click

from tailorkv import __version__
from tailorkv.engine.options import (check_for_model, check_knob_use, method_options, model_defaults, model_options,
                                     peek, plan_memory, settings_from)
from tailorkv.engine.ui import (FULL_DISK, OneLineErrors, UserError, cap_gpu_memory, check_ctx, err, friendly,
                                full_disk_error, load_with_progress, parse_ctx, pick_device, pick_dtype, read_text_file,
                                set_threads, utf8_text)

SAMPLING_HELP = ("Sampling defaults: each value the model's generation_config.json names (for smollm2-135m, "
                 "its model card's temperature 0.2 and top-p 0.9, kept in configs/), else llama.cpp's: temperature "
                 "0.8, top-k 40, top-p 0.95, min-p 0.05, and repeat-penalty 1.1 over the answer's last 64 tokens. "
                 "One-shot -p/-f is greedy (temperature 0) unless --temp is given, so scripts get the same answer.\n\n"
                 "Method knobs (--bits to --own-query-below) change only the methods named in parentheses: giving "
                 "one to a method that ignores it is an error.")


@click.group(name="tailorkv", cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="tailorkv", message="%(prog)s %(version)s")
def main():
    """tailorkv: long-context inference for Llama-family models with the TailorKV cache."""


@main.command(epilog=SAMPLING_HELP)
@model_options
@method_options
@click.option("--ctx", "-c", default=None, help="context length: 8192, 8k, 128k (default: min(model, 8k))")
@click.option("--prompt", "-p", default=None, help="one-shot: print only the answer to this prompt (greedy)")
@click.option("--file", "-f", "prompt_file", default=None, help="one-shot: the prompt from a UTF-8 file (- = stdin)")
@click.option("--system", default=None, help="system message")
@click.option("--max-new-tokens", "-n", type=int, default=512, show_default=True, help="tokens per answer, at most")
@click.option("--temperature", "--temp", type=float, default=None, help="0 = greedy  [default: see below]")
@click.option("--top-k", type=int, default=None, help="0 = off")
@click.option("--top-p", type=float, default=None, help="1 = off")
@click.option("--min-p", type=float, default=None, help="0 = off; drop tokens below min-p x the top probability")
@click.option("--repeat-penalty", type=float, default=None, help="1 = off; llama.cpp's rule, on the answer's recent tokens")
@click.option("--repeat-last-n", type=int, default=None, help="answer tokens the penalty looks back on (0 = off, -1 = the whole answer)")
@click.option("--seed", "-s", type=int, default=None, help="sampling seed (default: random)")
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--no-chat-template", is_flag=True, help="feed raw text, no chat template")
@click.option("--gpu-mem-limit", default=None, help="cap device memory, weights included, e.g. 24GiB (as on a 24 GB card)")
@friendly
def run(model, weights, random_weights, device, dtype, threads, method, bits, budget, sink, recent, channels,
        quant_layers, layer_profile, select, sketch_bits, select_rule, channel_rule, own_query_below, ctx, prompt,
        prompt_file, system, max_new_tokens, temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed, stop,
        no_chat_template, gpu_mem_limit, predict_ahead, predict_weights, kt_bits, kt_cache):
    """Chat with a model, or answer one --prompt / --file and exit."""
    from tailorkv.engine import sampling as S

    prompt = one_shot_prompt(prompt, prompt_file)
    if system is not None:
        utf8_text(system, "--system")
        if no_chat_template:
            raise UserError("--system needs the chat template, which --no-chat-template turns off: drop one of "
                            "them (raw text can carry the instructions in the prompt itself)")
    for s in stop:
        utf8_text(s, "--stop")
        if not s:
            raise UserError("--stop is empty: give the text that ends an answer, e.g. --stop '###'")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}: e.g. -n 256")
    flags = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
                 repeat_last_n=repeat_last_n, seed=seed)
    S.resolve(flags)  # checks the values given, before anything loads
    check_knob_use(click.get_current_context(), [method])
    settings = settings_from(method, bits, budget, sink, recent, channels, quant_layers, select, sketch_bits,
                             select_rule, channel_rule, own_query_below, predict_ahead, predict_weights, layer_profile,
                             kt_bits, kt_cache)
    ctx_len = parse_ctx(ctx) if ctx is not None else None
    dev = pick_device(device)
    limit = cap_gpu_memory(gpu_mem_limit, dev)
    set_threads(threads)
    cfg, family = peek(model, weights, random_weights)
    ctx_len = check_ctx(ctx_len, cfg, model)
    settings = model_defaults(settings, family)
    settings, = check_for_model([settings], cfg, click.get_current_context(), family)
    dt = pick_dtype(dtype, dev, cfg)
    settings = plan_memory(settings, cfg, family, ctx_len, limit, dt, click.get_current_context())
    whole_context_note(settings, ctx_len)

    loaded = load_with_progress(model, weights, random_weights, dev, dt)
    from tailorkv.models.loader import require_tokenizer
    require_tokenizer(loaded)
    from tailorkv.engine.chat import ChatSession
    from tailorkv.engine.generate import Engine
    from tailorkv.engine.methods import build_cache
    sampling, source = S.resolve(flags, loaded.generation, greedy=prompt is not None and temperature is None,
                                 model_source=loaded.generation_source)
    cache = build_cache(loaded, settings, ctx_len)
    chat = ChatSession(Engine(loaded, cache, sampling), system=system, use_template=not no_chat_template)
    if prompt is not None:
        _, stats = chat.send(prompt, max_new_tokens, tuple(stop), on_text=write_answer)
        write_answer("\n")
        from tailorkv.engine.repl import context_full_note
        note = context_full_note(stats, chat.engine, f"raise --ctx (the model supports {cfg.max_context})")
        if note:
            err.print(f"warning: {note}", style="yellow", markup=False)
        return
    from tailorkv.engine.repl import repl
    try:
        repl(chat, max_new_tokens, tuple(stop), sampling_note=f"{sampling.describe()} ({source})",
             method_note=method_note(settings, bits, family))
    except OSError as e:
        if e.errno not in FULL_DISK:  # not a full disk: not ours to explain
            raise
        unwritable(e, "the chat")


def whole_context_note(settings, ctx_len: int) -> None:
    """As bench and eval say: a budget as large as the context makes the method attend to every token."""
    from tailorkv.engine.settings import KNOB_USERS
    from tailorkv.engine.ui import every_token_note
    if settings.method in KNOB_USERS["budget"] and settings.budget >= ctx_len:
        err.print(f"note: --budget {settings.budget} covers the whole context (--ctx {ctx_len}): "
                  f"{every_token_note(settings.method)}", style="dim", markup=False)


def method_note(settings, bits: str | None, family: dict) -> str:
    """What the banner adds to the method's name: tailorkv's bits and where they come from."""
    if settings.method != "tailorkv":
        return ""
    from tailorkv.engine.methods import model_bits
    return f", {settings.bits}-bit quantized layers from {'--bits' if bits is not None else model_bits(family)[1]}"


def write_answer(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as e:
        unwritable(e, "the answer")


def unwritable(e: OSError, what: str) -> None:
    """stdout refused a write: one line (a full disk, /dev/full), or click's quiet end where the reader stopped."""
    if e.errno == errno.EPIPE or e.errno is None:  # the reader stopped (| head): click ends quietly
        raise e
    raise full_disk_error(e, what) from None


def one_shot_prompt(prompt: str | None, prompt_file: str | None) -> str | None:
    if prompt is not None and prompt_file is not None:
        raise UserError("--prompt and --file both give the prompt: use one of them")
    if prompt_file is not None:
        prompt = read_text_file(prompt_file, "--file")
        what = f"--file {prompt_file}"
    else:
        what = "--prompt"
    if prompt is None:
        return None
    utf8_text(prompt, what)
    if not prompt.strip():
        raise UserError(f"{what} is empty: give the text to answer (or leave it out to chat)")
    return prompt


def _register_commands() -> None:
    from tailorkv.engine.profiling.command import register as register_profile
    from tailorkv.engine.bench.command import register as register_bench
    from tailorkv.engine.evaluation.command import register as register_eval
    register_profile(main)
    register_bench(main)
    register_eval(main)


_register_commands()

if __name__ == "__main__":
    main(prog_name="tailorkv")

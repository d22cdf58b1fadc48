"""What the commands share: one-line user errors (ours and click's), argument parsing, device and dtype
choice, loading with a progress bar and a load line, byte formatting. The common options live in
engine/options.py. Used by cli.py and the tool commands (engine/bench, evaluation, profiling)."""
from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import sys
import time

import click
from rich.console import Console

from tailorkv.engine.errors import InputError

err = Console(stderr=True, highlight=False, soft_wrap=True)  # one line per message, even in logs
MIN_CTX = 16


class UserError(click.ClickException):
    """One line naming the cause and the fix; exit status 1, no traceback."""

    def show(self, file=None):
        from rich.markup import escape
        err.print(f"[bold red]error:[/] {escape(self.message)}", highlight=False, soft_wrap=True)


class Interrupted(UserError):
    """Ctrl-C during long work: one line saying what was kept and how to finish; exit status 130 (SIGINT's)."""
    exit_code = 130

    def __init__(self, message: str):
        super().__init__(f"interrupted: {message}")


@contextlib.contextmanager
def interrupt_once():
    """Long work whose Ctrl-C saves what finished: the first Ctrl-C raises KeyboardInterrupt, and later ones are
    ignored until the process ends, so that a second press cannot cut the saving short (nor end the process in
    a traceback of its shutdown). Without an interrupt the handler before is put back."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit = []

    def first(signum, frame):
        hit.append(signum)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        if not hit and before is not None:  # None: a handler set outside Python, which cannot be put back
            signal.signal(signal.SIGINT, before)


NO_ARGS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2


class OneLineErrors(click.Group):
    """A group whose usage errors (bad option value, unknown option, missing argument) print one line,
    `error: <cause> (see: tailorkv CMD --help)`, instead of click's usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except NO_ARGS_HELP as e:  # a bare `tailorkv` shows the help
            e.show()
            sys.exit(e.exit_code)
        except click.UsageError as e:
            cmd = e.ctx.command_path if e.ctx is not None else "tailorkv"
            UserError(f"{e.format_message()} (see: {cmd} --help)").show()
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:  # Ctrl-C outside a chat turn (click turns KeyboardInterrupt into Abort)
            err.print("interrupted")
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)


FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write refused for want of space (or /dev/full)
HOST_OOM = ("this machine ran out of memory (RAM): use --dtype bf16 (half of fp32's bytes), a lower --ctx or a "
            "smaller model, or close what else uses memory")


def friendly(fn):
    """Turn the errors a user can cause into one clear line."""
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        import torch
        from tailorkv.models.errors import LoadError
        try:
            return fn(*a, **kw)
        except (LoadError, InputError) as e:
            raise UserError(str(e)) from None
        except torch.cuda.OutOfMemoryError:
            raise UserError("the GPU ran out of memory: lower --ctx, use --method tailorkv, "
                            "or a smaller --dtype") from None
        except MemoryError:
            raise UserError(HOST_OOM) from None
        except RuntimeError as e:  # torch's CPU allocator reports a failed allocation as a RuntimeError
            if "can't allocate memory" in str(e) or "DefaultCPUAllocator" in str(e):
                raise UserError(HOST_OOM) from None
            raise
        except FileNotFoundError as e:
            raise UserError(f"{e.filename}: no such file: check the path") from None
        except OSError as e:
            if e.errno not in FULL_DISK:
                raise
            raise full_disk_error(e, "the output") from None
    return wrapper


def full_disk_error(e: OSError, what: str) -> UserError:
    """One line for a write refused for want of space (FULL_DISK): `what` could not be written to the file the
    error names, else stdout; the fix for a file-size limit is the limit."""
    where = e.filename if e.filename is not None else "stdout"
    fix = "a file-size limit (ulimit -f) stops it: raise the limit" if e.errno == errno.EFBIG else "free space there"
    return UserError(f"{what} cannot be written to {where} ({e.strerror}): {fix}, or send it elsewhere")


def parse_length(text: str, flag: str = "--ctx", examples: str = "8192, 8k or 128k") -> int:
    """'8192', '8k', '0.5k', '1m' -> tokens (k = 1024); an InputError naming `flag` and `examples` otherwise."""
    t = text.strip().lower()
    scale = {"k": 1024, "m": 1024 * 1024}.get(t[-1:], 1)
    try:
        n = float(t[:-1]) * scale if scale > 1 else int(t)
    except ValueError:
        n = -1
    if not 0 <= n < 2 ** 62:  # also inf, nan
        raise InputError(f"{flag} '{text}' is not a length: write e.g. {examples}")
    return int(n)


class Tokens(click.ParamType):
    """A count of tokens as --ctx takes it (1024, 1k, 0.5k); a plain integer passes as is (a negative one is left
    to the setting's own check, which names the fix)."""
    name = "tokens"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return int(value)
        except ValueError:
            pass
        flag = param.opts[0] if param is not None else "a token count"
        try:
            return parse_length(value, flag, "1024 or 1k")
        except InputError as e:
            raise UserError(str(e)) from None


def parse_ctx(text: str, flag: str = "--ctx") -> int:
    n = parse_length(text, flag)
    if n < MIN_CTX:
        raise UserError(f"{flag} {text} is too small: use at least {MIN_CTX} tokens, e.g. 8k")
    return n


def check_ctx(ctx: int | None, cfg, name: str) -> int:
    """--ctx against the model (from its config, before loading): the default is min(model, 8k)."""
    limit = cfg.max_context
    ctx = ctx if ctx is not None else min(limit, 8192)
    if ctx > limit:
        raise UserError(f"--ctx {ctx} is beyond what {name} supports ({limit} tokens): lower --ctx")
    return ctx


def split_list(text: str | None) -> list[str]:
    """'a, b,,a' -> ['a', 'b'] (order kept, duplicates dropped)."""
    out: list[str] = []
    for part in (text or "").split(","):
        part = part.strip()
        if part and part not in out:
            out.append(part)
    return out


def known_names(text: str | None, choices, what: str, flag: str) -> list[str]:
    """split_list(text), refusing the first name not in choices: InputError("unknown {what} 'x' in {flag}: ...")."""
    names = split_list(text)
    bad = [n for n in names if n not in choices]
    if bad:
        raise InputError(f"unknown {what} '{bad[0]}' in {flag}: choose from {', '.join(choices)}")
    return names


def utf8_text(text: str, what: str) -> str:
    """Command-line and stdin text reach Python with undecodable bytes as lone surrogates: refuse them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{what} holds bytes that are not UTF-8 text: convert it (e.g. iconv -t utf-8)") from None
    return text


def read_text_file(path: str, what: str) -> str:
    return read_text_bytes(path, what)[0]


STREAM_CAP = 256 * 1024 * 1024  # what a device or a pipe may give (/dev/zero never ends)


def read_text_bytes(path: str, what: str) -> tuple[str, bytes]:
    """(text, raw bytes) of a UTF-8 file named by the flag `what`: a regular file, a device or a pipe (/dev/null,
    <(cat a b)); "-" reads stdin."""
    if path == "-":
        data = sys.stdin.buffer.read()
    elif os.path.isdir(path):
        raise UserError(f"{what} {path} is a folder: give a text file")
    elif not os.path.exists(path):
        raise UserError(f"{what} {path}: no such file: check the path ({what} - reads stdin)")
    else:
        try:
            with open(path, "rb") as f:
                data = f.read(STREAM_CAP + 1)
        except OSError as e:
            raise UserError(f"{what} {path} cannot be read ({e.strerror or e}): give a text file") from None
        if len(data) > STREAM_CAP:
            raise UserError(f"{what} {path} is over {STREAM_CAP >> 20} MiB: give a shorter text file")
    try:
        return data.decode("utf-8-sig"), data  # a byte order mark (Windows editors write one) is not text
    except UnicodeDecodeError:
        raise UserError(f"{what} {path} is not UTF-8 text: convert it (e.g. iconv -t utf-8)") from None


def pick_device(device: str):
    import torch
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device '{device}' is not a device: use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("CUDA was requested but no GPU is visible: use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"--device '{device}': tailorkv runs on a CPU or an NVIDIA GPU: use auto, cpu or cuda[:N]")
    if dev.type == "cuda" and dev.index is not None and dev.index >= (n := torch.cuda.device_count()):
        raise UserError(f"--device {device}: this machine has {n} GPU{'s' if n > 1 else ''}: use cuda:0"
                        + (f" .. cuda:{n - 1}" if n > 1 else ""))
    return dev


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def cpu_has_amx() -> bool:
    """Whether this CPU multiplies bf16 in AMX tiles, where bf16 matmuls outrun fp32. AVX512-BF16 alone does not:
    on the CI machine (Xeon, AVX512-BF16, no AMX) a bf16 GEMM ran at 148 GFLOP/s against fp32's 219, and an AVX2
    CPU emulates bf16 (4x slower prefill)."""
    return " amx_bf16" in _cpu_flags()


def memory_available() -> int | None:
    """Bytes the OS can give this process now (Linux MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pick_dtype(dtype: str, device, cfg=None):
    """auto: bf16 on GPUs with bf16 (fp16 on older ones); on a CPU fp32 (faster there and exact), bf16 with AMX or
    where the model's fp32 weights (cfg) would take more than half the memory available (bf16 fits)."""
    import torch
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        free = memory_available()
        too_big = cfg is not None and free is not None and 4 * cfg.params > free // 2
        return torch.bfloat16 if cpu_has_amx() or too_big else torch.float32
    return {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
            "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}[dtype]


def set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch
        if threads < 1:
            raise UserError(f"--threads must be at least 1, got {threads}: e.g. -t {os.cpu_count() or 1}")
        cores = os.cpu_count() or 1
        if threads > 4 * cores:
            raise UserError(f"--threads {threads} is more than 4x this machine's {cores} cores: use at most {cores}")
        torch.set_num_threads(threads)


def dtype_name(dtype) -> str:
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(str(dtype), str(dtype))


def load_line(loaded, seconds: float) -> str:
    """'smollm2-135m: 134.5M parameters, Q4_1 GGUF -> fp32 weights (538 MB), trained context 8192; cpu, 12.3 s'"""
    params = sum(p.numel() for p in loaded.model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    w = loaded.model.output_weight
    kind = "GGUF" if loaded.source.startswith("gguf:") else "safetensors"
    became = dtype_name(w.dtype)
    if loaded.random:
        stored = "random"
    elif loaded.stored and loaded.stored != became:
        stored = f"{loaded.stored} {kind} ->"
    else:
        stored = kind
    return (f"{loaded.name}: {params / 1e6:.1f}M parameters, {stored} {became} weights ({fmt_bytes(nbytes)}), "
            f"trained context {loaded.cfg.max_context}; {w.device}, loaded in {seconds:.1f} s")


def load_with_progress(model: str, weights, random_weights: bool, device, dtype, quiet: bool = False):
    """Loads with a progress bar on a terminal's stderr, then prints the load line on stderr (not when quiet)."""
    from rich.progress import Progress, BarColumn, TextColumn, TimeElapsedColumn
    from tailorkv.models.loader import load_model
    t0 = time.perf_counter()
    if not err.is_terminal and not quiet:
        err.print(f"loading {model} ...", soft_wrap=True, markup=False)
    with Progress(TextColumn("[cyan]loading {task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                  TimeElapsedColumn(), console=err, transient=True, disable=quiet or not err.is_terminal) as bar:
        task = bar.add_task(model, total=None, count="")  # no "0/None" before the loader knows its tensors
        loaded = load_model(model, weights, random_weights, device, dtype,
                            progress=lambda i, n: bar.update(task, completed=i, total=n, count=f"{i}/{n}"))
    if not quiet:
        err.print(f"[dim]{load_line(loaded, time.perf_counter() - t0)}[/]", soft_wrap=True)
    if loaded.random:
        err.print("[yellow]random weights: the model's text is meaningless (use them for speed and memory work)[/]")
    if str(device).startswith("cuda"):
        prepare_kernels(loaded.cfg, dtype, device, quiet)
    return loaded


def prepare_kernels(cfg, dtype, device, quiet: bool = False) -> None:
    """The CUDA kernels loaded before the first turn or cell: ours (CuPy compiles them on a machine's first run,
    then reads its disk cache) and the prefill attention's (cuDNN builds some at their first use on a machine)."""
    from tailorkv.ops import dispatch
    from tailorkv.ops.attention import warm_up_prefill
    t0 = time.perf_counter()
    with err.status("loading CUDA kernels (the first run on a machine compiles them)", spinner="dots") \
            if err.is_terminal and not quiet else contextlib.nullcontext():
        n = dispatch.preload(threads=min(8, os.cpu_count() or 1))
        warm_up_prefill(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, dtype, device)
    took = time.perf_counter() - t0
    if n and took > 1.0 and not quiet:
        err.print(f"[dim]loading CUDA kernels: {n} ready in {took:.1f} s (compiled once per machine, then read "
                  f"from CuPy's cache)[/]")


def count(n: int, word: str, many: str | None = None) -> str:
    """'1 item', '2 items' (many: the plural where it is not word + 's')."""
    return f"{n} {word if n == 1 else many or word + 's'}"


def every_token_note(method: str) -> str:
    """What a method attends to when its budget covers the whole context (bench's and eval's notes)."""
    if method == "tailorkv":
        return "its sparse layers attend to every token there (its 1/2-bit layers stay quantized)"
    return "it attends to every token there, like full"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def parse_bytes(text: str, flag: str = "--gpu-mem-limit") -> int:
    """'24GiB', '24GB', '24G', '512MiB', '1e9' -> bytes (G/M/K without 'B' mean binary units)."""
    import re
    bad = InputError(f"{flag} '{text}' is not a size: write e.g. 24GiB, 24GB or 512MiB")
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text or "")
    try:
        num = float(m.group(1)) if m else math.nan
    except ValueError:
        num = math.nan
    unit, suffix = (m.group(2).upper(), m.group(3) or "") if m else ("", "")
    base = 1000 if suffix.lower() == "b" and unit else 1024
    size = num * base ** " KMGT".index(unit or " ")
    if not (math.isfinite(size) and size >= 1):
        raise bad
    return int(size)


def set_memory_limit(limit_bytes: int, device) -> float:
    """Cap what this process may allocate on the device (weights included); returns the fraction used."""
    import torch
    idx = device.index if device.index is not None else torch.cuda.current_device()  # 'cuda' has no index
    total = torch.cuda.get_device_properties(idx).total_memory
    frac = float(min(1.0, limit_bytes / total))
    torch.cuda.set_per_process_memory_fraction(frac, idx)
    return frac


def cap_gpu_memory(text: str | None, device) -> int | None:
    """--gpu-mem-limit: cap what this process may allocate on the GPU (weights included); the cap in bytes,
    or None (no cap, or not on a GPU: then a line says it is ignored)."""
    if not text:
        return None
    limit = parse_bytes(text)
    if device.type != "cuda":
        err.print("[yellow]--gpu-mem-limit ignored: not running on a GPU[/]")
        return None
    frac = set_memory_limit(limit, device)
    err.print(f"[dim]device memory capped at {fmt_bytes(limit)} ({100 * frac:.1f}% of the GPU), weights included[/]")
    return limit

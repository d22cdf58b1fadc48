"""Results files that every tool writes (bench.json, eval.json, profiles): atomic writes, numbered folders,
the environment block (command, commit, GPU, driver, date) and the small statistics the reports share."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from typing import Callable

import torch

from tailorkv.engine.errors import InputError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_files_atomically(files: list[tuple[str, Callable[[str], None]]]) -> None:
    """Write every (path, writer(tmp_path)) to a temp file beside its target, then rename them all into place:
    readers never see half a file and a failure leaves no partial file behind."""
    check_free([path for path, _ in files])
    temps: list[tuple[str, str]] = []
    try:
        for path, writer in files:
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
            os.close(fd)
            temps.append((tmp, path))
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600 files; give the usual permissions
            try:
                writer(tmp)
            except OSError as e:  # a write's own error names no file (a full disk): name the one it was for
                raise e if e.filename is not None else OSError(e.errno, e.strerror, path) from None
        for tmp, path in temps:
            os.replace(tmp, path)
    finally:
        for tmp, _ in temps:
            if os.path.exists(tmp):
                os.unlink(tmp)


def write_atomic(path: str, writer: Callable[[str], None]) -> None:
    write_files_atomically([(path, writer)])


def json_writer(obj: dict) -> Callable[[str], None]:
    def w(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, allow_nan=False, default=str)
            f.write("\n")
    return w


def write_json(path: str, obj: dict) -> None:
    write_atomic(path, json_writer(obj))


def check_out(path: str, kind: str = "folder", flag: str = "--out") -> str:
    """An output path checked before any work (an InputError naming the cause and the fix): not empty, a folder
    (kind "folder") or a file name (kind "file") as asked, and creatable: its nearest existing parent a folder this
    process can write in."""
    if not path.strip():
        raise InputError(f"{flag} is empty: give a {kind} name")
    if kind == "folder" and os.path.isfile(path):
        raise InputError(f"{flag} {path} is a file: give a folder")
    if kind == "file" and (os.path.isdir(path) or path.endswith(("/", os.sep))):
        raise InputError(f"{flag} {path} is a folder: give a file name inside it, like "
                         f"{os.path.join(path, 'results.json')}")
    parent = os.path.abspath(path if kind == "folder" else os.path.dirname(os.path.abspath(path)))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise InputError(f"{flag} {path}: {parent} is a file, not a folder: choose another path")
    try:  # a file made and removed: what permissions, read-only mounts and /proc allow
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".tailorkv-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot write in {parent} ({e.strerror or e}): choose another path") \
            from None
    return path


def check_free(paths: list[str], flag: str = "--out") -> None:
    """Files a run will write, checked before it starts: a folder in the way of one -> InputError."""
    for path in paths:
        if os.path.isdir(path):
            raise InputError(f"{path} is a folder, and this run writes a file there: move the folder away or choose "
                             f"another {flag}")


def refuse_existing(path: str, overwrite: bool, also: str = "") -> None:
    """An earlier run's results are replaced only when the user says so (--overwrite)."""
    if os.path.exists(path) and not overwrite:
        raise InputError(f"{path} already holds an earlier run's results: pass --overwrite to replace them"
                         f"{also}, or choose another --out")


def numbered_dir(model_name: str, root: str, marker: str) -> str:
    """<root>/<date>-<model>/, with -2, -3, ... when that folder already holds a results file (marker), is held by
    a running command (its lock file locked) or is not a folder."""
    name = os.path.normpath(model_name)
    if name.split(os.sep)[-1] in (".", ".."):  # the folder the user stands in (or above): its own name
        name = os.path.abspath(name)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(name)).strip("-.") or "model"
    base = os.path.join(root, f"{datetime.date.today().isoformat()}-{stem}")
    out, n = base, 1
    while (os.path.exists(os.path.join(out, marker)) or _held(_lock(out, marker))
           or (os.path.exists(out) and not os.path.isdir(out))):
        n += 1
        out = f"{base}-{n}"
    return out


def results_dir(out: str | None, model: str, family: dict, root: str, marker: str):
    """A command's results folder, as a context: --out as given (checked by the caller), else claimed_dir's
    numbered folder under root, named after the model path as given, else its config's name (or the hub id)."""
    if out is not None:
        return held_dir(out, marker)
    return claimed_dir(model if os.path.exists(model) else family.get("name") or model, root, marker)


def _lock(folder: str, marker: str) -> str:
    return os.path.join(folder, f".{marker}.lock")


def _held(lock: str) -> bool:
    """Whether a running command holds the lock file (one left by a killed command is not held)."""
    import fcntl
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _hold_lock(lock: str) -> int | None:
    """An exclusive flock on the lock file (made if missing): its descriptor, or None while another process
    holds it. The kernel lets go when a process ends, so a file left by a killed command is taken over."""
    import fcntl
    while True:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:  # its holder removed it as it ended: lock the file there now
            same = False
        if same:
            return fd
        os.close(fd)


def _let_go(out: str, marker: str, fd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(_lock(out, marker))
    os.close(fd)


@contextlib.contextmanager
def _holding(out: str, marker: str, fd: int, made: bool):
    """Yields the held folder; then lets the lock go, and the folder too if this command made it and wrote nothing
    there."""
    try:
        yield out
    finally:
        _let_go(out, marker, fd)
        if made:
            with contextlib.suppress(OSError):  # only an empty folder goes
                os.rmdir(out)


@contextlib.contextmanager
def held_dir(out: str, marker: str):
    """--out as given (checked by the caller), made now, before any work, and held for this command by a lock
    file: a second command writing the same results file there is refused instead of overwriting the first's.
    The lock goes when the command ends, and so does the folder if the command made it and wrote nothing there."""
    made = not os.path.exists(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot make the results folder {out} ({e.strerror or e}): choose another --out") from None
    lock = _lock(out, marker)
    fd = _hold_lock(lock)
    if fd is None:
        raise InputError(f"another tailorkv command is writing {marker} in {out} (it holds {lock}): wait for it to "
                         f"end, or choose another --out")
    with _holding(out, marker, fd, made):
        yield out


@contextlib.contextmanager
def claimed_dir(model_name: str, root: str, marker: str):
    """numbered_dir's folder, made now and held for this command as held_dir holds --out: a command started beside
    it takes the next number. A folder that cannot be made -> InputError, before any work."""
    while True:
        out = numbered_dir(model_name, root, marker)
        made = not os.path.exists(out)
        try:
            os.makedirs(out, exist_ok=True)
            fd = _hold_lock(_lock(out, marker))
        except OSError as e:
            raise InputError(f"cannot make the results folder {out} ({e.strerror or e}): run from a folder where "
                             f"you can write, or pass --out DIR") from None
        if fd is not None and not os.path.exists(os.path.join(out, marker)):
            break
        if fd is not None:  # a command beside it finished there a moment ago: the next number
            _let_go(out, marker, fd)
    with _holding(out, marker, fd, made):
        yield out


def command_line() -> str:
    return shlex.join(["tailorkv", *sys.argv[1:]]) if sys.argv else "tailorkv"


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str | None:
    """TAILORKV_COMMIT names the commit of a copy of the tree whose .git is missing or stale (a lent GPU
    machine); else the checkout's HEAD."""
    return os.environ.get("TAILORKV_COMMIT") or _run(["git", "rev-parse", "HEAD"])


def git_dirty() -> bool | None:
    """Whether tracked files differ from the commit. Under TAILORKV_COMMIT the copy's .git is not that commit's,
    so only TAILORKV_DIRTY (0 or 1, from the checkout that sent the copy) can say; without it, None (unknown)."""
    if os.environ.get("TAILORKV_COMMIT"):
        flag = os.environ.get("TAILORKV_DIRTY", "")
        return {"0": False, "1": True}.get(flag)
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return None if status is None else bool(status)


def environment(device: torch.device) -> dict:
    from tailorkv import __version__
    cuda = device.type == "cuda"
    env = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git_commit": git_commit() or "unknown",
        "git_dirty": git_dirty(),
        "tailorkv": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "gpu_total_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
        "driver": None,
    }
    if cuda:
        smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        env["driver"] = smi.splitlines()[0].strip() if smi else None
    return env


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    i = (len(xs) - 1) * p / 100
    lo = int(i)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)

"""The one dispatch rule for every op: tensors the GPU can read (on the GPU, or in host memory it maps: pinned or
ops/host_memory.py's stores, which kernels read zero-copy), at least one on the GPU, and a loadable kernel -> the
kernel; else the torch reference. Kernels register themselves by op name; a kernel that fails to build is
remembered as absent. A loaded kernel may still hand arguments it does not support (a dtype, a shape) to the
op's `fallback`: the reference, counted in FALLBACKS by op name, which `tailorkv bench` reports per cell."""
from __future__ import annotations

import collections
import os
import warnings
from typing import Callable

from tailorkv.ops.host_memory import gpu_readable

FALLBACKS: collections.Counter = collections.Counter()  # op name -> calls a loaded kernel gave to its reference

_KERNELS: dict[str, Callable] = {}
_LOADERS: dict[str, Callable[[], Callable]] = {}
_FAILED: set[str] = set()


def register_kernel(name: str, loader: Callable[[], Callable]) -> None:
    """`loader()` returns the kernel function (compiling it on first use) or raises."""
    _LOADERS[name] = loader


def kernels_enabled(name: str | None = None) -> bool:
    """TAILORKV_KERNELS=0 turns every kernel off; TAILORKV_KERNELS_OFF=a,b the named ones (for A/B runs)."""
    if os.environ.get("TAILORKV_KERNELS", "1") == "0":
        return False
    return name is None or name not in os.environ.get("TAILORKV_KERNELS_OFF", "").split(",")


def kernel_for(name: str, *tensors) -> Callable | None:
    if not any(t.is_cuda for t in tensors):  # first: a CPU call reads no environment variables
        return None
    if not kernels_enabled(name) or name in _FAILED or name not in _LOADERS:
        return None
    if not all(gpu_readable(t) for t in tensors):
        return None
    if name not in _KERNELS and not _load(name):
        return None
    return _KERNELS[name]


def _load(name: str) -> bool:
    try:
        _KERNELS[name] = _LOADERS[name]()
        return True
    except Exception as e:  # no CuPy, no compiler: the reference serves
        _FAILED.add(name)
        warnings.warn(f"{name}: the CUDA kernel did not load ({type(e).__name__}: {e}); using the torch "
                      f"reference, which is slower (pip install cupy-cuda12x or cupy-cuda13x, matching "
                      f"your CUDA)", RuntimeWarning, stacklevel=4)
        return False


def preload(threads: int = 8) -> int:
    """Load every enabled kernel of ops/ now, `threads` at a time, rather than at its first call: on a machine
    whose CuPy cache lacks them, compiling them takes seconds that would otherwise land inside the first turn or
    bench cell. Returns how many loaded; one that fails is remembered as absent, as at a first call. Without
    CuPy nothing loads here (each op then says so at its first call)."""
    import importlib
    import pkgutil
    from concurrent.futures import ThreadPoolExecutor
    try:
        import cupy  # noqa: F401 - imported once here, not by the threads at the same time
    except ImportError:
        return 0
    package = importlib.import_module("tailorkv.ops")
    for info in pkgutil.iter_modules(package.__path__):   # the modules that register kernels
        if not info.name.endswith("_cuda"):
            importlib.import_module(f"tailorkv.ops.{info.name}")
    names = [n for n in _LOADERS if kernels_enabled(n) and n not in _KERNELS and n not in _FAILED]
    with ThreadPoolExecutor(max(1, threads)) as pool:
        return sum(pool.map(_load, names))


def op(name: str):
    """Decorator for a torch reference: calls the registered kernel instead when the rule says so.
    The rule looks at the positional tensor arguments. The kernel's loader is handed `.fallback`."""
    def wrap(ref: Callable) -> Callable:
        def run(*args, **kwargs):
            kern = kernel_for(name, *[a for a in args if hasattr(a, "is_cuda")])
            return (kern or ref)(*args, **kwargs)
        run.reference = ref

        def fallback(*args, **kwargs):
            FALLBACKS[name] += 1
            return ref(*args, **kwargs)
        fallback.uncounted = ref  # for arguments a kernel leaves to the reference by design (several rows: cuBLAS)
        run.fallback = fallback
        run.__name__ = ref.__name__
        run.__doc__ = ref.__doc__
        return run
    return wrap

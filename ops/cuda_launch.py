"""What every CuPy kernel of ops/ shares: compiling a source, launching on torch's current stream (so that a
launch inside torch.cuda.graph is captured), raw pointers and the alignment checks of vector loads.
CuPy is imported only when a kernel loads, so the package imports without it."""
from __future__ import annotations

import os
import re
import sys
import threading
import time

import numpy as np
import torch

_STREAMS: dict[tuple[int, int], object] = {}
_MODULES: dict[tuple[str, int], list] = {}  # (source, device) -> [its lock, its module]
_MODULES_LOCK = threading.Lock()


class _StreamHandle:
    """A raw cudaStream_t behind the CUDA stream protocol, which cupy.cuda.Stream.from_external reads."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _cupy_stream(handle: int, device_index: int):
    import cupy
    key = (handle, device_index)
    if key not in _STREAMS:
        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14 (ExternalStream is deprecated there)
            _STREAMS[key] = cupy.cuda.Stream.from_external(_StreamHandle(handle))
        else:
            _STREAMS[key] = cupy.cuda.ExternalStream(handle, device_index)
    return _STREAMS[key]


def compile_module(source: str):
    """A CuPy module of `source`, compiled (CuPy picks the arch) or read from CuPy's disk cache, once per
    device: dispatch.preload's threads may ask for one source at once (fused's four ops share theirs). With
    TAILORKV_LOG_COMPILES=1 its kernels, defines and load time go to stderr."""
    import cupy
    key = (source, cupy.cuda.Device().id)
    with _MODULES_LOCK:
        entry = _MODULES.setdefault(key, [threading.Lock(), None])
    with entry[0]:
        if entry[1] is None:
            t0 = time.perf_counter()
            mod = cupy.RawModule(code=source)
            if hasattr(mod, "compile"):   # else compiled at its first function's load
                mod.compile()
            if os.environ.get("TAILORKV_LOG_COMPILES") == "1":
                names = re.findall(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)', source)
                defines = " ".join(re.findall(r"^#define (\w+ \S+)$", source.split("extern", 1)[0], re.M)[:12])
                sys.stderr.write(f"compile_module: {','.join(names)} [{defines}] {time.perf_counter() - t0:.2f} s\n")
            entry[1] = mod
        return entry[1]


def launch(kernel, grid, block, args, device: torch.device, shared_mem: int = 0) -> None:
    """Launch `kernel` on torch's current stream of `device` (no sync, no allocation: graph-capturable)."""
    import cupy
    with cupy.cuda.Device(device.index):
        stream = _cupy_stream(torch.cuda.current_stream(device).cuda_stream, device.index)
        kernel(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem, stream=stream)


def units_per_block(units: int, warps: int, device: torch.device, blocks_per_sm: float = 4) -> int:
    """Work units (a multiple of `warps`) per block so that the grid is about one wave of `blocks_per_sm`
    blocks per multiprocessor (below 1: on that share of them): all blocks resident at once, no tail wave."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks = max(1, round(sms * blocks_per_sm))
    return warps * max(1, -(-units // (warps * blocks)))


def cu_source(name: str, defines: dict, types: dict | None = None, head: str = "") -> str:
    """The CUDA C of ops/<name> after `head`, a #define per item of `defines` and a typedef per item of `types`
    (name -> C type)."""
    with open(os.path.join(os.path.dirname(__file__), name)) as f:
        body = f.read()
    return (head + "".join(f"#define {k} {v}\n" for k, v in defines.items())
            + "".join(f"typedef {t} {n};\n" for n, t in (types or {}).items()) + body)


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def ptr_or_null(t: torch.Tensor | None) -> np.uint64:
    """An optional tensor argument: its address, or a null pointer for None."""
    return ptr(t) if t is not None else np.uint64(0)


def aligned(t: torch.Tensor, nbytes: int, dims=None) -> bool:
    """The base address and the byte strides of `dims` (default: all but the last; a dimension of size 1 has no
    stride that matters) are multiples of nbytes."""
    dims = range(t.dim() - 1) if dims is None else dims
    elt = t.element_size()
    return t.data_ptr() % nbytes == 0 and all(t.shape[d] == 1 or (t.stride(d) * elt) % nbytes == 0 for d in dims)


def rows_contiguous(t: torch.Tensor, ndim_inner: int = 1) -> bool:
    """The last `ndim_inner` dimensions are laid out contiguously (any strides above them)."""
    expect = 1
    for d in range(t.dim() - 1, t.dim() - 1 - ndim_inner, -1):
        if t.shape[d] != 1 and t.stride(d) != expect:
            return False
        expect *= t.shape[d]
    return True

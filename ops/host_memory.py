"""Host memory that the GPU reads in place (zero-copy, over PCIe), for the stores whose rows a step picks at random.

On a CUDA device a store can be managed memory kept in host memory (preferred location the host, mapped for the
device, never migrated): the GPU maps it with large pages, so that reading thousands of rows scattered over
gigabytes costs few address translations. Pinned memory (cudaHostAlloc) is mapped with small pages: on the H200
with 31 layers' K/V stores (15.5 GiB), the gather of 896 x 8 rows of 512 B per layer beside the dense GEMVs took
4.84 ms for 31 layers from pinned memory and 3.07 ms from managed memory, which reads as fast as a 0.5 GiB pinned
store does (bench/host_pages.py, bench/results/2026-12-01-h200-sixteenth-session). The DMA copies into a managed
store are slower, though (a 128k prefill of Llama-3.1-8B: 12.3-15.0 s instead of 11.3-11.8; ops/host_copy.py writes
them with the SMs instead), so only the stores read row by row under the dense GEMVs (sketch-ahead's) ask for it
(`managed=True`). Without CUDA, where the driver refuses managed memory, or where the managed stores would
come to more than the device has free (under --gpu-mem-limit: free under the cap), a store is ordinary (pinned on
a CUDA device) torch memory: managed memory beyond the card's free memory can hang the GPU.

The tensors are CPU tensors to torch, which does not call managed memory pinned (is_pinned is False, or True,
depending on how torch asks); `gpu_readable` is the one test of whether a kernel may read a tensor."""
from __future__ import annotations

import bisect
import ctypes

import torch

MANAGED = True  # False: every store pinned (for A/B runs)
_ATTACH_GLOBAL, _PREFER, _ACCESSED_BY, _HOST, _DEVICE = 1, 3, 5, 2, 1  # CUDA driver API enums (cuda.h)
_ranges: list[tuple[int, int]] = []  # (start, end) addresses of the managed stores not yet freed, sorted


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Managed:
    """One managed allocation, freed when the last tensor over it dies (its buffer holds it)."""

    def __init__(self, addr: int, nbytes: int, cu):
        self.addr, self.nbytes, self.cu = addr, nbytes, cu
        bisect.insort(_ranges, (addr, addr + nbytes))

    def __del__(self):
        try:
            _ranges.remove((self.addr, self.addr + self.nbytes))
            self.cu.cuMemFree_v2(ctypes.c_ulonglong(self.addr))
        except Exception:  # interpreter shutdown
            pass


def _managed_buffer(nbytes: int, device: int):
    """A ctypes buffer over new managed memory whose pages live on the host, mapped for `device`."""
    cu = ctypes.CDLL("libcuda.so.1")
    addr = ctypes.c_ulonglong()
    _check(cu.cuMemAllocManaged(ctypes.byref(addr), ctypes.c_size_t(nbytes), ctypes.c_uint(_ATTACH_GLOBAL)),
           "cuMemAllocManaged")
    buffer = (ctypes.c_char * nbytes).from_address(addr.value)
    buffer.owner = _Managed(addr.value, nbytes, cu)  # torch.frombuffer keeps the buffer, the buffer this
    torch.frombuffer(buffer, dtype=torch.uint8).zero_()  # first touch on the host: its pages live there
    for advice, where in ((_PREFER, _Location(_HOST, 0)), (_ACCESSED_BY, _Location(_DEVICE, device))):
        _check(cu.cuMemAdvise_v2(ctypes.c_ulonglong(addr.value), ctypes.c_size_t(nbytes), ctypes.c_int(advice),
                                 where), "cuMemAdvise")
    return buffer


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (CUresult {rc})")


def host_empty(shape, dtype: torch.dtype, device: torch.device, managed: bool = False) -> torch.Tensor:
    """A host tensor that kernels on `device` read in place: pinned, or managed (and zeroed) if `managed`."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype)
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    index = torch.cuda.current_device() if device.index is None else device.index
    if managed and MANAGED and nbytes > 0 and managed_bytes() + nbytes <= device_free_bytes(index):
        torch.cuda.synchronize(index)  # the driver calls below need the device's context, which torch makes lazily
        try:
            buffer = _managed_buffer(nbytes, index)
        except (OSError, RuntimeError):
            pass  # no driver library or no managed memory: pinned
        else:
            return torch.frombuffer(buffer, dtype=dtype).view(shape)
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def device_free_bytes(index: int) -> int:
    """What the device has free, and under this process's cap (torch's memory fraction) what the cap leaves."""
    free, total = torch.cuda.mem_get_info(index)
    fraction = torch.cuda.get_per_process_memory_fraction(index)
    if fraction < 1.0:
        free = min(free, int(fraction * total) - torch.cuda.memory_reserved(index))
    return free


def managed_bytes() -> int:
    """Host bytes in managed stores now (freed with their last tensor)."""
    return sum(end - start for start, end in _ranges)


def is_managed(t: torch.Tensor) -> bool:
    """In a managed store of host_empty."""
    if not _ranges or t.numel() == 0 or t.is_cuda:
        return False
    p = t.data_ptr()
    i = bisect.bisect_right(_ranges, (p, float("inf"))) - 1
    return i >= 0 and _ranges[i][0] <= p < _ranges[i][1]


def gpu_readable(t: torch.Tensor) -> bool:
    """On the GPU, in pinned memory or in a managed store of host_empty."""
    return t.is_cuda or t.is_pinned() or is_managed(t)

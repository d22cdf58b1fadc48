"""Copies between pinned host memory and the device where one side is a strided view: a block of rows
(dims before the row collapse into one row index with a single pitch) whose last dims are contiguous, e.g. the
middle [lo, hi) of a host store [B, H, N, D] or columns [lo, hi) of K^T [B, H, D, N].

Where the leading dims do not collapse (a head's rows of an interleaved K/V store: [B, H, m, D] views of
[B, H, N, 2, D]), the copy is one 2D copy per index of the first dim (recursively).

The torch reference is `dst.copy_(src)` (for a strided host side torch stages the data and copies it row by
row on the CPU: ~1.5 GB/s measured on the H200 machine). The CUDA path is one cudaMemcpy2DAsync on torch's
current stream: the DMA engines move the rows at PCIe speed, the host is not held, and the copy overlaps work
on other streams. Into a managed store (ops/host_memory.py) the DMA copies are slow (a 128k prefill of Llama-3.1-8B
took 12.3-15.5 s instead of 11.3-11.8 with pinned stores), so there a kernel writes the rows over PCIe with the
SMs' 16-byte stores (through the store's GPU mapping, as the gathers read it) on BLOCKS blocks: 11.5-11.7 s."""
from __future__ import annotations

import torch

from tailorkv.ops import cuda_launch
from tailorkv.ops.dispatch import op, register_kernel
from tailorkv.ops.host_memory import is_managed

# 64 blocks: a 128k prefill of Llama-3.1-8B with sketch-ahead's managed store took 11.52-11.70 s on the H200 (128
# blocks: 11.56, 16: 14.48; the DMA: 12.37-13.14; the full cache 11.45), decode unchanged (5.95-5.96 ms/token;
# bench/results/2026-12-01-h200-seventeenth-session). SM_WRITES False: the DMA into managed stores too (A/B runs).
SM_WRITES, BLOCKS, THREADS = True, 64, 256

_SOURCE = r"""
extern "C" __global__ void copy_rows16(const uint4* src, uint4* dst, const long long rows, const long long words,
                                       const long long src_pitch, const long long dst_pitch) {
    const long long items = rows * words;   // 16-byte words; pitches in words
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < items; i += step) {
        const long long r = i / words, w = i - r * words;
        dst[r * dst_pitch + w] = src[r * src_pitch + w];
    }
}
"""


def _contiguous_tail(t: torch.Tensor) -> int:
    """How many trailing dims of t are laid out contiguously."""
    k, expect = 0, 1
    for d in range(t.dim() - 1, -1, -1):
        if t.shape[d] != 1 and t.stride(d) != expect:
            break
        expect *= t.shape[d]
        k += 1
    return k


def _pitch(t: torch.Tensor, k: int) -> int | None:
    """The pitch (elements) of t seen as rows of its last k dims, when its leading dims collapse into one row
    index with a single pitch; else None."""
    width = 1
    for d in range(t.dim() - k, t.dim()):
        width *= t.shape[d]
    lead = [d for d in range(t.dim() - k) if t.shape[d] != 1]
    if not lead:
        return width
    pitch, rows = t.stride(lead[-1]), 1
    for d in reversed(lead):
        if t.stride(d) != pitch * rows:
            return None
        rows *= t.shape[d]
    return pitch


def rows_plan(dst: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(rows, width, dst pitch, src pitch) in elements for one 2D copy of src into dst (same shape), or None."""
    if dst.shape != src.shape or dst.dim() == 0:
        return None
    k = min(_contiguous_tail(dst), _contiguous_tail(src))
    if k == 0:
        return None
    dp, sp = _pitch(dst, k), _pitch(src, k)
    if dp is None or sp is None:
        return None
    width = 1
    for d in range(dst.dim() - k, dst.dim()):
        width *= dst.shape[d]
    return dst.numel() // max(width, 1) if width else 0, width, dp, sp


@op("host_copy")
def host_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src) for same-shaped, same-dtype tensors, one on the device and one in pinned host memory."""
    return dst.copy_(src)


def _load():
    import cupy
    import numpy as np

    copy_rows16 = cuda_launch.compile_module(_SOURCE).get_function("copy_rows16")

    def sm_writes(dst, src, rows, width, dpitch, spitch) -> bool:
        """Rows of src (device) into a managed dst by the SMs, where every row and pitch is whole 16-byte words."""
        elt = dst.element_size()
        if not (SM_WRITES and src.is_cuda and is_managed(dst)):
            return False
        if any((x * elt) % 16 for x in (width, dpitch, spitch)) or dst.data_ptr() % 16 or src.data_ptr() % 16:
            return False
        words = [np.int64(x * elt // 16) for x in (width, spitch, dpitch)]
        cuda_launch.launch(copy_rows16, (BLOCKS,), (THREADS,),
                           (cuda_launch.ptr(src), cuda_launch.ptr(dst), np.int64(rows), *words), src.device)
        return True

    def host_copy_2d(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        plan = rows_plan(dst, src) if dst.dtype == src.dtype and dst.is_cuda != src.is_cuda else None
        if plan is None:
            if dst.dtype == src.dtype and dst.is_cuda != src.is_cuda and dst.shape == src.shape and dst.dim() > 1:
                for i in range(dst.shape[0]):  # the leading dims do not collapse: one 2D copy per index of the first
                    host_copy_2d(dst[i], src[i])
                return dst
            return host_copy.fallback(dst, src)
        rows, width, dpitch, spitch = plan
        if rows * width == 0 or sm_writes(dst, src, rows, width, dpitch, spitch):
            return dst
        elt = dst.element_size()
        dev = src.device if src.is_cuda else dst.device
        cupy.cuda.runtime.memcpy2DAsync(dst.data_ptr(), dpitch * elt, src.data_ptr(), spitch * elt, width * elt,
                                        rows, cupy.cuda.runtime.memcpyDefault,  # the pointers say where (UVA)
                                        torch.cuda.current_stream(dev).cuda_stream)
        return dst

    return host_copy_2d


register_kernel("host_copy", _load)

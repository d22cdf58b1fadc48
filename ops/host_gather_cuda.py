"""CUDA kernel for gather_rows: reads the chosen rows of a pinned host tensor straight over PCIe (zero-copy,
through the pointer UVA gives every pinned allocation), so the indices never leave the device and the step
needs no sync. The copy width is the widest word (16, 8, 4, 2 or 1 bytes) that divides the row length, the
strides and the base address. Short rows (sketch-ahead's 512-byte K/V rows): a few blocks (MAX_BLOCKS) loop
over all (row, word) items, each thread keeping UNROLL reads in flight, so PCIe's latency is covered without an SM
slot per row and the SMs stay with the compute stream. Long rows (the paper's K^T rows): by default one block per
row, one read per thread at a time (more reads in flight took PCIe from the attention's reads of host rows: 19.3 ->
22.7 ms/token at 128k on the H200); with `blocks`, the loop kernel on that many blocks of LONG_THREADS, for a step
bound by its compute stream rather than by PCIe."""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import compile_module, launch, ptr

# 16 blocks: at 128k, sketch-ahead (4-bit sketch) on the H200 from managed host stores (ops/host_memory.py), 6.116
# ms/token (20: 6.128, 24: 6.122-6.129, 12: 6.213; 32k and 8k the same within 0.3%: bench/results/2026-12-01-h200-
# sixteenth-session). From pinned stores 12 had measured best (6.45; 16: 6.86, 24: 7.31, 32: 7.73), the extra
# reads in flight slowing the GEMVs beside them (twelfth and sixteenth sessions).
MAX_BLOCKS, THREADS, UNROLL = 16, 256, 4
LONG_THREADS = 1024  # long rows on `blocks` blocks: the short rows' loop, UNROLL reads in flight per thread
LOOP_ITEMS = 2**30  # the loop kernel's int indices, with room for its base after the last pass (+ grid stride)

_SOURCE = r"""
extern "C" __global__ void gather_rows_w{W}(const unsigned long long src_addr, const unsigned long long idx_addr,
                                          const unsigned long long dst_addr, const int H, const int n,
                                          const long long sb, const long long sh, const long long sn,
                                          const int words, const int items) {{
    typedef {T} word;
    const word* src = (const word*)src_addr;
    const long long* idx = (const long long*)idx_addr;
    word* dst = (word*)dst_addr;
    for (int base = blockIdx.x * blockDim.x * {U} + threadIdx.x; base < items; base += gridDim.x * blockDim.x * {U}) {{
        word v[{U}];
        #pragma unroll
        for (int u = 0; u < {U}; ++u) {{   // item = row * words + word; row over B * H * n
            const int it = base + u * blockDim.x;
            if (it < items) {{
                const int row = it / words, b = row / (H * n), h = (row / n) % H;
                v[u] = src[b * sb + h * sh + idx[row] * sn + it % words];
            }}
        }}
        #pragma unroll
        for (int u = 0; u < {U}; ++u)
            if (base + u * blockDim.x < items) dst[base + u * blockDim.x] = v[u];
    }}
}}
"""
_ROW_SOURCE = r"""
extern "C" __global__ void gather_long_rows_w{W}(const unsigned long long src_addr,
                                               const unsigned long long idx_addr, const unsigned long long dst_addr,
                                               const int H, const int n, const long long sb, const long long sh,
                                               const long long sn, const int words) {{
    typedef {T} word;
    const int row = blockIdx.x;                      // one block per gathered row, over B * H * n
    const int b = row / (H * n), h = (row / n) % H;
    const long long i = ((const long long*)idx_addr)[row];
    const word* src = (const word*)src_addr + b * sb + h * sh + i * sn;
    word* dst = (word*)dst_addr + (long long)row * words;
    for (int w = threadIdx.x; w < words; w += blockDim.x) dst[w] = src[w];
}}
"""
WORDS = {16: "uint4", 8: "unsigned long long", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}


def widest_word(host: torch.Tensor) -> int:
    """The widest word of WORDS (bytes) that divides host's [B, H, N, X] row length, strides and start: the copy
    width of the kernels that read its rows."""
    elt = host.element_size()
    steps = [host.stride(0) * elt, host.stride(1) * elt, host.stride(2) * elt, host.shape[-1] * elt, host.data_ptr()]
    return next(w for w in WORDS if all(s % w == 0 for s in steps))


def one_pass_blocks(items: int, unroll: int | None = None) -> int:
    """Blocks of THREADS in which the short rows' loop covers `items` words in one pass, each thread keeping
    `unroll` (default UNROLL, read at the call: bench/ab_patch.py may set it) reads in flight."""
    return -(-items // (THREADS * (unroll or UNROLL)))


def load(reference):
    """reference: the torch gather_rows, for the arguments the kernel does not take."""
    import cupy

    mod = compile_module("\n".join(src.format(W=w, T=t, U=UNROLL) for w, t in WORDS.items()
                                   for src in (_SOURCE, _ROW_SOURCE)))
    kernels = {w: mod.get_function(f"gather_rows_w{w}") for w in WORDS}
    row_kernels = {w: mod.get_function(f"gather_long_rows_w{w}") for w in WORDS}
    if not cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["unifiedAddressing"]:
        raise RuntimeError("no unified addressing: pinned host pointers are not device pointers")

    def gather_rows(host: torch.Tensor, idx: torch.Tensor, device: torch.device,
                    out: torch.Tensor | None = None, blocks: int = 0) -> torch.Tensor:
        """The kernel needs host rows of unit stride and a contiguous `out` on idx's device, of host's dtype
        and shape [B, H, n, X]; anything else goes to the torch reference (which syncs on device indices)."""
        B, H, n = idx.shape
        X, elt = host.shape[-1], host.element_size()
        if host.stride(-1) != 1 or (out is not None and (
                out.shape != (B, H, n, X) or out.dtype != host.dtype or not out.is_contiguous()
                or out.device != idx.device)):
            return reference(host, idx, device, out)
        if out is None:
            out = torch.empty(B, H, n, X, dtype=host.dtype, device=idx.device)
        if out.numel() == 0:
            return out
        src = host.data_ptr()  # pinned memory under UVA: the host address is the device address
        w = widest_word(host)
        idx64 = idx if idx.dtype == torch.int64 and idx.is_contiguous() else idx.to(torch.int64).contiguous()
        words = X * elt // w
        strides = (np.int64(host.stride(0) * elt // w), np.int64(host.stride(1) * elt // w),
                   np.int64(host.stride(2) * elt // w))
        items = B * H * n * words
        long_rows = words >= THREADS * UNROLL
        if long_rows and not (blocks and items < LOOP_ITEMS):  # the K^T rows' 256 KiB: a block per row
            launch(row_kernels[w], (B * H * n,), (THREADS,),
                   (np.uint64(src), ptr(idx64), ptr(out), np.int32(H), np.int32(n), *strides, np.int32(words)),
                   idx.device)
            return out
        if items >= LOOP_ITEMS:
            return reference(host, idx, device, out)
        grid, threads = ((min(blocks, B * H * n), LONG_THREADS) if long_rows
                         else (min(MAX_BLOCKS, one_pass_blocks(items)), THREADS))
        launch(kernels[w], (grid,), (threads,),
               (np.uint64(src), ptr(idx64), ptr(out), np.int32(H), np.int32(n), *strides, np.int32(words),
                np.int32(items)), idx.device)
        return out

    return gather_rows

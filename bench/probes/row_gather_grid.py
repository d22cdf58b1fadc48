"""ops/host_gather_cuda.py's gathers by grid, alone on an idle GPU, each variant checked against torch indexing:
  - short rows (sketch-ahead's 512-byte K|V rows, and the 256-byte rows the issue first quoted), the loop kernel
    by reads in flight per thread (UNROLL) and blocks (MAX_BLOCKS): what the 16-block cap (chosen end to end) costs
    its own rate;
  - long rows (the paper's K^T rows, 12 x 8 of 256 KiB), one block per row (blocks 0) against the loop kernel
    on `blocks` blocks of LONG_THREADS.
    PYTHONPATH=src python3 bench/probes/row_gather_grid.py
"""
import sys

import numpy as np
import torch

sys.path.insert(0, "bench")
from kernels import gpu_time  # noqa: E402  (a CUDA graph of 8 calls replayed, the median)
from tailorkv.ops import host_gather_cuda as hg  # noqa: E402
from tailorkv.ops.cuda_launch import compile_module, launch, ptr  # noqa: E402
from tailorkv.ops.host_gather import gather_rows  # noqa: E402

dev = torch.device("cuda")
H, N, n = 8, 131072, 896
mods = {u: compile_module(hg._SOURCE.format(W=16, T="uint4", U=u)) for u in (4, 8, 16)}


def run(u, blocks, host, idx, out):
    words = host.shape[-1] * host.element_size() // 16
    items = H * n * words
    grid = min(blocks, hg.one_pass_blocks(items, u))
    launch(mods[u].get_function("gather_rows_w16"), (grid,), (hg.THREADS,),
           (np.uint64(host.data_ptr()), ptr(idx), ptr(out), np.int32(H), np.int32(n),
            np.int64(host.stride(0) * 2 // 16), np.int64(host.stride(1) * 2 // 16), np.int64(host.stride(2) * 2 // 16),
            np.int32(words), np.int32(items)), dev)


rows = []
for X in (128, 256):  # bf16 elements: 256- and 512-byte rows
    host = torch.randn(1, H, N, X, dtype=torch.bfloat16).pin_memory()
    idx = torch.stack([torch.randperm(N)[:n] for _ in range(H)]).view(1, H, n).to(dev)
    want = host[0].to(dev)[torch.arange(H, device=dev)[:, None], idx[0]]
    nbytes = H * n * X * 2
    for u in (4, 8, 16):
        for blocks in (16, 32, 64, 132, 10**6):
            out = torch.full((1, H, n, X), float("nan"), dtype=torch.bfloat16, device=dev)
            run(u, blocks, host, idx, out)
            torch.cuda.synchronize()
            ok = torch.equal(out[0], want)
            ms, _ = gpu_time([lambda: run(u, blocks, host, idx, out)], reps=30)
            rows.append((X * 2, u, blocks, ok, ms, nbytes / ms / 1e6))
print(f"{'row B':>6} {'unroll':>6} {'blocks':>8} {'exact':>6} {'ms':>8} {'GB/s':>7}")
for r in rows:
    print(f"{r[0]:>6} {r[1]:>6} {str(r[2]) if r[2] < 10**6 else 'all':>8} {str(r[3]):>6} {r[4]:>8.4f} {r[5]:>7.1f}")

kt = torch.randn(1, H, 128, N, dtype=torch.bfloat16).pin_memory()
chans = torch.stack([torch.randperm(128)[:12] for _ in range(H)]).view(1, H, 12).to(dev)
want = kt[0].to(dev)[torch.arange(H, device=dev)[:, None], chans[0]]
nbytes = H * 12 * N * 2
print(f"\nK^T rows 12 x {H} of {N * 2 // 1024} KiB")
print(f"{'blocks':>8} {'threads':>8} {'exact':>6} {'ms':>8} {'GB/s':>7}")
for blocks, threads in ((0, 256), (8, 1024), (16, 1024), (32, 1024), (16, 512), (32, 512), (64, 256)):
    hg.LONG_THREADS = threads
    out = torch.full((1, H, 12, N), float("nan"), dtype=torch.bfloat16, device=dev)
    gather_rows(kt, chans, dev, out=out, blocks=blocks)
    torch.cuda.synchronize()
    ok = torch.equal(out[0], want)
    ms, _ = gpu_time([lambda: gather_rows(kt, chans, dev, out=out, blocks=blocks)], reps=10)
    print(f"{blocks or 'per row':>8} {threads:>8} {str(ok):>6} {ms:>8.4f} {nbytes / ms / 1e6:>7.1f}")

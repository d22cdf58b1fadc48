"""How fast this host lets the SMs read the paper's K^T rows (zero-copy over PCIe) against the DMA engine's pinned
copy: the one machine-dependent cost of tailorkv's default step at 128k (bench --profile's 'pcie gather').
A layer's fetch: 8 KV heads x 12 channels, each a row of N bf16 (256 KiB at 128k), picked from a pinned
[1, 8, 128, N] store; the stores of 31 layers are cycled as a decode step does. Variants: the kernel's threads per
block (host_gather_cuda.THREADS, one block per row).
    PYTHONPATH=src python3 bench/probes/kt_row_reads.py [N] [LAYERS]
"""
import sys

import torch

from host_read_paths import timed  # this folder's: the same wall-clock timing
from tailorkv.ops import host_gather_cuda
from tailorkv.ops.host_gather import gather_rows

N = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
L = int(sys.argv[2]) if len(sys.argv) > 2 else 31
dev = torch.device("cuda")
stores = [torch.empty(1, 8, 128, N, dtype=torch.bfloat16, pin_memory=True) for _ in range(L)]
stores[-1].normal_()  # the one checked against torch
out = torch.empty(1, 8, 12, N, dtype=torch.bfloat16, device=dev)
row_bytes = out.numel() * 2


g = torch.Generator(device=dev).manual_seed(0)
idx = [torch.randperm(128, generator=g, device=dev)[:96].view(1, 8, 12).sort(-1).values for _ in range(L)]


def all_layers():
    for s, i in zip(stores, idx):
        gather_rows(s, i, dev, out=out)


ref = stores[-1].gather(2, idx[-1].cpu()[..., None].expand(1, 8, 12, N))
rows = []
for threads in (256, 512, 1024):
    host_gather_cuda.THREADS = threads
    t = timed(all_layers)
    assert torch.equal(out.cpu(), ref), "gather_rows picked other rows than torch.gather"
    rows.append((f"SM gather, {threads} threads/row", t * 1e3, L * row_bytes / t / 1e9))
host_gather_cuda.THREADS = 256
flat = torch.empty(L * row_bytes, dtype=torch.uint8, pin_memory=True)
dst = torch.empty_like(flat, device=dev)
t = timed(lambda: dst.copy_(flat, non_blocking=True))
rows.append(("DMA copy of the same bytes (pinned, contiguous)", t * 1e3, L * row_bytes / t / 1e9))
print(f"{torch.cuda.get_device_name(0)}; {L} layers x 96 rows of {N * 2 // 1024} KiB "
      f"({L * row_bytes / 2**20:.0f} MiB per step)")
print(f"{'variant':<50} {'ms/step':>8} {'GB/s':>7}")
for name, ms, gbs in rows:
    print(f"{name:<50} {ms:8.2f} {gbs:7.1f}")

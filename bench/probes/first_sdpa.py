"""Is a machine's first prefill slow because cuDNN's attention kernels are built at their first use? Times the
prefill attention (ops.attention.causal_attention, Llama-3.1-8B heads, bf16) twice at a short and a long length, in
a fresh process, and prints the driver's JIT cache size around it.
    python3 bench/probes/first_sdpa.py"""
import os
import subprocess
import time

import torch

from tailorkv.ops.attention import causal_attention


def cache_size() -> str:
    path = os.path.expanduser("~/.nv/ComputeCache")
    return subprocess.run(["du", "-sh", path], capture_output=True, text=True).stdout.strip() or "none"


print("ComputeCache before:", cache_size())
torch.zeros(1, device="cuda")
for T, into_q in ((2048, False), (2048, False), (40000, True), (40000, True), (4096, True), (40000, True)):
    q = torch.randn(1, 32, T, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, T, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    causal_attention(q, k, v, 0, into_q=into_q)
    torch.cuda.synchronize()
    print(f"T {T} into_q {into_q}: {time.perf_counter() - t0:.3f} s")
print("ComputeCache after:", cache_size())

"""ops/host_gather_cuda.py's short-row gather, the loop kernel against its pipelined form (each thread issues its
next UNROLL reads before it stores the last ones), alone on an idle GPU, by reads in flight per thread (UNROLL),
blocks, row length and host memory (pinned, or managed as sketch-ahead's stores are); each run checked against
torch indexing. What matters for acceptance 3 of issue 14: the 256-byte top-K rows on the engine's 16 blocks.
    PYTHONPATH=src python3 bench/probes/row_gather_pipeline.py [--json OUT.json]
"""
import json
import sys

import numpy as np
import torch

sys.path.insert(0, "bench")
from kernels import gpu_time  # noqa: E402  (a CUDA graph of 8 calls replayed, the median)
from tailorkv.ops import host_gather_cuda as hg  # noqa: E402
from tailorkv.ops.cuda_launch import compile_module, launch, ptr  # noqa: E402
from tailorkv.ops.host_memory import host_empty  # noqa: E402

dev = torch.device("cuda")
H, N, n = 8, 131072, 896
UNROLLS = (2, 4, 8)
mods = {u: compile_module(hg._SOURCE.format(W=16, T="uint4", U=u) + hg._PIPELINED_SOURCE.format(W=16, T="uint4", U=u))
        for u in UNROLLS}


def run(kernel, u, blocks, host, idx, out):
    words = host.shape[-1] * host.element_size() // 16
    items = H * n * words
    grid = min(blocks, -(-items // (hg.THREADS * u)))
    launch(mods[u].get_function(kernel), (grid,), (hg.THREADS,),
           (np.uint64(host.data_ptr()), ptr(idx), ptr(out), np.int32(H), np.int32(n),
            np.int64(host.stride(0) * 2 // 16), np.int64(host.stride(1) * 2 // 16), np.int64(host.stride(2) * 2 // 16),
            np.int32(words), np.int32(items)), dev)


rows = []
for memory in ("pinned", "managed"):
    for X in (128, 256):  # bf16 elements: 256- and 512-byte rows
        host = host_empty((1, H, N, X), torch.bfloat16, dev, managed=memory == "managed")
        host.copy_(torch.randn(1, H, N, X, dtype=torch.bfloat16))
        idxs = [torch.stack([torch.randperm(N)[:n] for _ in range(H)]).view(1, H, n).to(dev) for _ in range(4)]
        wants = [host[0][torch.arange(H)[:, None], i[0].cpu()].to(dev) for i in idxs]
        nbytes = H * n * X * 2
        for kernel in ("gather_rows_w16", "gather_rows_pipelined_w16"):
            for u in UNROLLS:
                for blocks in (16, 32, 10**6):
                    out = torch.full((1, H, n, X), float("nan"), dtype=torch.bfloat16, device=dev)
                    exact = True
                    for i, want in zip(idxs, wants):
                        out.fill_(float("nan"))
                        run(kernel, u, blocks, host, i, out)
                        torch.cuda.synchronize()
                        exact &= torch.equal(out[0], want)
                    ms, _ = gpu_time([lambda i=i: run(kernel, u, blocks, host, i, out) for i in idxs], reps=30)
                    rows.append(dict(memory=memory, row_bytes=X * 2, kernel="pipelined" if "pipelined" in kernel
                                     else "loop", unroll=u, blocks=blocks if blocks < 10**6 else "all", exact=exact,
                                     ms=ms, gbps=nbytes / ms / 1e6))
print(f"{'memory':>8} {'row B':>6} {'kernel':>10} {'unroll':>6} {'blocks':>6} {'exact':>6} {'ms':>8} {'GB/s':>7}")
for r in rows:
    print(f"{r['memory']:>8} {r['row_bytes']:>6} {r['kernel']:>10} {r['unroll']:>6} {r['blocks']:>6} "
          f"{str(r['exact']):>6} {r['ms']:>8.4f} {r['gbps']:>7.1f}")
if "--json" in sys.argv:
    with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)

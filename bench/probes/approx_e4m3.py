"""approx_scores (the paper's approximate scores over r K^T rows) with bf16 rows against e4m3 rows (--kt-bits 8), the
kernel alone at Llama-3.1-8B's shape: 32 query heads over 8 KV heads, r = 12 rows of N tokens, rule lse; the e4m3
rows loaded 16, 8 or 4 bytes at a time per thread (sparse_select_cuda.LOAD_BYTES).
    PYTHONPATH=src python3 bench/probes/approx_e4m3.py [N ...]
"""
import sys

import torch

from tailorkv.ops import dispatch, sparse_select_cuda
from tailorkv.ops.sparse_select import approx_scores

Ns = [int(a) for a in sys.argv[1:]] or [32768, 131072]
g = torch.Generator(device="cuda").manual_seed(0)
print(f"{torch.cuda.get_device_name(0)}; approx_scores, 32 q heads / 8 KV heads, r 12, lse; us per call (HBM GB/s)")
for N in Ns:
    q = torch.randn(1, 32, 1, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    ch = torch.stack([torch.randperm(128, device="cuda", generator=g)[:12] for _ in range(8)]).view(1, 8, 12)
    rows16 = torch.randn(1, 8, 12, N, device="cuda", generator=g, dtype=torch.bfloat16)
    out = torch.empty(1, 8, N, device="cuda")
    end = torch.tensor([N], device="cuda")
    row = []
    e4 = rows16.to(torch.float8_e4m3fn)
    for rows, load in ((rows16, 16), (e4, 16), (e4, 8), (e4, 4)):
        sparse_select_cuda.LOAD_BYTES[rows.element_size()] = load
        kernel = dispatch.kernel_for("approx_scores", q, rows, ch)
        ref = approx_scores.reference(q, rows, ch, None, "lse", 0.088, end, 0)
        kernel(q, rows, ch, out, "lse", 0.088, end, 0)
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-4, err
        graph = torch.cuda.CUDAGraph()  # 200 calls in a graph: the GPU's time, not the host's launches
        with torch.cuda.graph(graph):
            for _ in range(200):
                kernel(q, rows, ch, out, "lse", 0.088, end, 0)
        graph.replay()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        us = s.elapsed_time(e) / 200 * 1e3
        row.append(f"{str(rows.dtype)[6:]}/{load}B {us:6.1f} us ({(rows.numel() * rows.element_size() + out.numel() * 4) / us / 1e3:6.0f})")
    print(f"N {N:>7}: " + "   ".join(row))

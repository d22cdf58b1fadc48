"""The top-K kernel's time by stretches per row (1 = one stage), against torch.topk's picks, for the rule in
ops/topk_cuda.py's stretches():
    PYTHONPATH=src python3 bench/probes/topk_stretches.py
"""
import sys

import torch

sys.path.insert(0, "bench")
import kernels as K  # noqa: E402
from tailorkv.ops import sparse_select, topk_cuda  # noqa: E402

ROWS = 8
SHAPES = [(1024, 63), (2048, 63), (4096, 63), (8192, 63), (16384, 63), (8192, 255), (32768, 1024), (131072, 1024)]
FORCED = (1, 2, 4, 8, 16)
kernel = topk_cuda.load(sparse_select.topk_tokens.fallback)
rule = topk_cuda.stretches
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(f"{torch.cuda.get_device_name(0)}, {ROWS} rows; us per call by stretches (s); * = the rule's choice")
print(f"{'N':>7} {'k':>5} " + " ".join(f"{'s=' + str(s):>8}" for s in FORCED) + "   rule")
for n, k in SHAPES:
    sets = [K.randn(1, ROWS, n) for _ in range(K.n_sets(ROWS * n * 4))]
    chosen = rule(ROWS, n, k, sms)
    cells = []
    for s in FORCED:
        topk_cuda.stretches = lambda rows, n_, k_, sms_, s=s: s
        got = kernel(sets[0], k)
        want = torch.topk(sets[0], k, dim=-1).indices.sort(dim=-1).values
        if not torch.equal(got, want):
            raise SystemExit(f"N {n} k {k} s {s}: the picks differ from torch.topk's")
        ms, _ = K.gpu_time([lambda x=x: kernel(x, k) for x in sets])
        cells.append(f"{ms * 1e3:7.1f}{'*' if s == chosen else ' '}")
    topk_cuda.stretches = rule
    print(f"{n:>7} {k:>5} " + " ".join(cells) + f"   {chosen}")

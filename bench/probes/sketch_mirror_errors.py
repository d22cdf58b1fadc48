"""How far the sketch_scores kernel lies from its float64 mirror (tests/test_kernels_quant.sketch_mirror), over many
random inputs of each of the test's cases: the norm-relative error the test bounds (median, 99th percentile,
largest, how many >= 1e-5). From the repo root: PYTHONPATH=src python3 bench/probes/sketch_mirror_errors.py
[seeds] > out.json"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from helpers import random_keys, rel_err  # noqa: E402
from test_kernels_quant import SKETCH_CASES, sketch_mirror  # noqa: E402

from tailorkv.ops import dispatch, sparse_select  # noqa: E402,F401 - sparse_select registers the kernel

seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 200
rows = []
for bits, B, hq, hkv, T, D, dtype, rule in SKETCH_CASES:
    errs = []
    for seed in range(seeds):
        g = torch.Generator().manual_seed(seed * 1000 + T + hq + bits + 11)
        kc, ks, km = random_keys(g, B, hkv, T + 256, D, bits, "cuda", sketch=True)
        q = (torch.randn(B, hq, 1, D, generator=g) * 3).to("cuda", dtype)
        kernel = dispatch.kernel_for("sketch_scores", q, kc, ks, km)
        offset, sm = 5, 1 / math.sqrt(D)
        for end in (offset + T - 37, offset + T):
            args = (q, kc[:, :, :T], ks[:, :, :-(-T // 64)], km[:, :, :-(-T // 64)], bits, 64,
                    torch.tensor(end, device="cuda"), offset, rule, sm)
            got = kernel(*args)
            want = sketch_mirror(*args[:4], bits, end, offset, rule, sm)
            fin = torch.isfinite(want)
            errs.append(rel_err(got[fin], want[fin]))
    errs.sort()
    row = dict(bits=bits, B=B, hq=hq, hkv=hkv, T=T, D=D, dtype=str(dtype), rule=rule, runs=len(errs),
               median=errs[len(errs) // 2], p99=errs[int(0.99 * len(errs))], max=errs[-1],
               over_1e5=sum(e >= 1e-5 for e in errs))
    rows.append(row)
    print(json.dumps(row), file=sys.stderr, flush=True)
print(json.dumps(dict(seeds=seeds, rows=rows), indent=1))

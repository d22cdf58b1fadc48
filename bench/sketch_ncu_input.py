"""The sketch kernel at 128k (8 KV heads, 2 bits, 32 query heads), launched 4 times: an input for Nsight Compute
(bench/results/2026-12-01-h200-twelfth-session).
    PYTHONPATH=src ncu --kernel-name sketch_scores_kernel --launch-skip 2 --launch-count 1 python3 bench/sketch_ncu_input.py"""
import math, torch
from tailorkv.ops.quant import quantize_sketch
from tailorkv.ops.sparse_select import sketch_scores
n=131072
g = torch.Generator(device="cuda").manual_seed(0)
keys = torch.randn(1, 8, n, 128, device="cuda", generator=g)
kc, ks, km = quantize_sketch(keys, 2, 64)
q = torch.randn(1, 32, 1, 128, device="cuda", generator=g).bfloat16()
end = torch.tensor(n, device="cuda")
for _ in range(4):
    sketch_scores(q, kc, ks, km, 2, 64, end, 0, "lse", 1 / math.sqrt(128))
torch.cuda.synchronize()

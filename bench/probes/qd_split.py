"""quant_decode_attention's two kernels timed apart (torch.profiler, 20 calls over 4 input sets at 128k, Llama-3.1-8B
shape, 1 and 2 bits): the partial kernel and the reduce. Device only: PYTHONPATH=src python3 bench/probes/qd_split.py"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "bench")
from kernels import DEV, decode_state  # noqa: E402

from tailorkv.ops import dispatch  # noqa: E402

T = 131072
for bits in (1, 2):
    sets = [decode_state(bits, 1, 32, 8, T, 128) for _ in range(4)]
    sc = (torch.tensor(T - 128, device=DEV), torch.tensor([T - 1], device=DEV))
    k = dispatch.kernel_for("quant_decode_attention", sets[0][0], *sets[0][1])
    for s in sets:
        k(s[0], *s[1], *s[2], s[3], *sc, bits, 64, 64, 0.088)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            for s in sets:
                k(s[0], *s[1], *s[2], s[3], *sc, bits, 64, 64, 0.088)
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if "quant_attn" in e.key:
            print(f"{bits}-bit {e.key:22s} n={e.count} avg {e.device_time_total / e.count:.2f} us")

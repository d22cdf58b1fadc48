"""quant_decode_attention's two kernels timed apart (torch.profiler, 20 calls over 4 input sets at 128k, Llama-3.1-8B
shape, 1 and 2 bits): the partial kernel and the reduce. Device only: PYTHONPATH=src python3 bench/probes/qd_split.py"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "bench")
from kernels import qattn_128k  # noqa: E402

from tailorkv.ops import dispatch  # noqa: E402

for bits in (1, 2):
    _, sets, call = qattn_128k(bits, 4)
    k = dispatch.kernel_for("quant_decode_attention", sets[0][0], *sets[0][1])
    for s in sets:
        call(k, s)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            for s in sets:
                call(k, s)
        torch.cuda.synchronize()
    for e in prof.key_averages():
        if "quant_attn" in e.key:
            print(f"{bits}-bit {e.key:22s} n={e.count} avg {e.device_time_total / e.count:.2f} us")

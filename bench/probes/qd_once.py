"""Run quant_decode_attention once at 128k (Llama-3.1-8B shape) for a profiler: python3 bench/probes/qd_once.py [bits]."""
import sys

import torch

sys.path.insert(0, "bench")
from kernels import qattn_128k  # noqa: E402

from tailorkv.ops import dispatch  # noqa: E402

bits = int(sys.argv[1]) if len(sys.argv) > 1 else 1
_, (s,), call = qattn_128k(bits, 1)
k = dispatch.kernel_for("quant_decode_attention", s[0], *s[1])
for _ in range(3):
    call(k, s)
torch.cuda.synchronize()

"""Run quant_decode_attention once at 128k (Llama-3.1-8B shape) for a profiler: python3 bench/probes/qd_once.py [bits]."""
import sys

import torch

sys.path.insert(0, "bench")
from kernels import DEV, decode_state  # noqa: E402

from tailorkv.ops import dispatch  # noqa: E402

bits = int(sys.argv[1]) if len(sys.argv) > 1 else 1
T = 131072
s = decode_state(bits, 1, 32, 8, T, 128)
sc = (torch.tensor(T - 128, device=DEV), torch.tensor([T - 1], device=DEV))
k = dispatch.kernel_for("quant_decode_attention", s[0], *s[1])
for _ in range(3):
    k(s[0], *s[1], *s[2], s[3], *sc, bits, 64, 64, 0.088)
torch.cuda.synchronize()

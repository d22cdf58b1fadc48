"""A tailorkv cache cut back by one token (a chat's stop string over two tokens) on the GPU, graphed decode: the
logits of the steps after the cut against a cache that never held the cut token, at prompts around a key flush
(252: the cut falls just after one, which cannot be undone: the cache is emptied). The budget covers the context,
so the sparse layers attend exactly and any difference is the 1/2-bit layers' (their max|K| keeps a cut token).
    PYTHONPATH=src python3 bench/probes/quant_truncate_gpu.py [MODEL]     (random weights; default smollm2-135m)
"""
import sys

import torch

from tailorkv.engine.generate import Engine
from tailorkv.engine.methods import build_cache
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model

model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
loaded = load_model(model, random_weights=True, device="cuda", dtype=torch.bfloat16)
g = torch.Generator().manual_seed(0)
worst = 0.0
print(f"{torch.cuda.get_device_name(0)}, {model} random bf16, tailorkv budget 1024, graphed decode")
for prompt in (200, 250, 252, 300):
    ids = torch.randint(100, 10000, (prompt + 12,), generator=g).tolist()
    cut, ref = (Engine(loaded, build_cache(loaded, MethodSettings("tailorkv", budget=1024, sink=16, recent=32),
                                           max_len=1024)) for _ in range(2))
    cut.forward(ids[:prompt])
    for t in ids[prompt:prompt + 4]:
        cut.forward([t])
    cut.rewind(prompt + 3)                          # the fourth token goes
    kept = not cut.rewind_emptied
    ref.forward(ids[:prompt])
    for t in ids[prompt:prompt + 3]:
        ref.forward([t])
    err = 0.0
    for t in ids[prompt + 4:prompt + 12]:          # other tokens from the cut on
        a = cut.forward([t]) if kept else None
        b = ref.forward([t])
        if a is not None:
            assert torch.isfinite(a).all()
            err = max(err, ((a.float() - b.float()).abs().max() / b.float().abs().max()).item())
    worst = max(worst, err)
    diff = f"{err:.2e}" if kept else "n/a (emptied: the next turn prefills again)"
    print(f"prompt {prompt}: cut kept={kept}, max rel diff of 8 steps' logits vs never held: {diff}")
print("ok" if worst < 1e-2 else f"MISMATCH {worst:.2e}")

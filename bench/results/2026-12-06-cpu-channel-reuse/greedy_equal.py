"""SmolLM2-135M (fp32, CPU), a 4,000-token essay prompt, 200 greedy tokens (past a flush) with the paper path's K^T row
cache off and on (ChannelSelector.REUSE_ROWS): the tokens, the largest logit difference, the rows read of those chosen.
    PYTHONPATH=src python3 bench/results/2026-12-06-cpu-channel-reuse/greedy_equal.py"""
import torch
from tailorkv.engine.evaluation.fidelity import fidelity_ids
from tailorkv.engine.generate import Engine
from tailorkv.engine.methods import build_cache
from tailorkv.engine.policies.selection import ChannelSelector
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model

loaded = load_model("smollm2-135m", None, False, torch.device("cpu"), torch.float32)
ids = fidelity_ids(loaded.tokenizer, 4000)
out = {}
for reuse in (False, True):
    ChannelSelector.REUSE_ROWS = reuse
    s = MethodSettings(method="tailorkv", bits=2, budget=1024, sink=64, recent=64, channels=12, free_generated=True)
    cache = build_cache(loaded, s, 4000 + 300)
    eng = Engine(loaded, cache, use_cuda_graph=False)
    toks, logits = [], []
    with torch.inference_mode():
        x = eng.forward(ids[:4000])
        for _ in range(200):   # greedy, past a flush (128 steps)
            t = int(x.reshape(-1).argmax())
            toks.append(t)
            logits.append(x.reshape(-1).clone())
            x = eng.forward([t])
    out[reuse] = (toks, torch.stack(logits), cache.totals())
same = sum(a == b for a, b in zip(out[False][0], out[True][0]))
d = (out[False][1] - out[True][1]).abs().max().item()
print(f"greedy tokens equal: {same}/200; max |logit difference| {d:.3g}; row cache totals {out[True][2].get('kt_rows_read')} read of {out[True][2].get('kt_rows_chosen')} chosen")

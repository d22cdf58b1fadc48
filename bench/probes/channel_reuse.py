"""How much of a sparse layer's K^T fetch repeats from one decode step to the next (the paper's path: r channels
per KV head, their K^T rows over the middle read from host memory every step). A channel chosen again could be
kept on the device from the step before (its row over the middle changes by the token that entered it), so the
repeat share bounds what such a cache would save of the PCIe bytes. Also: the share of picks that fall in the
C channels of largest max|K| at the end of prefill (a static device copy of C channels per head).
SmolLM2-135M on the CPU, the eval's 1024 split (sink 64 + top-K 896 + recent 64, r = 12), essay text, teacher
forced:   PYTHONPATH=src python3 bench/probes/channel_reuse.py [--length 4096] [--steps 64] [--random-weights]
"""
import argparse
import json
import statistics

import torch

from tailorkv.engine.evaluation.fidelity import fidelity_ids
from tailorkv.engine.generate import Engine
from tailorkv.engine.methods import build_cache
from tailorkv.engine.policies import selection
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model

ap = argparse.ArgumentParser()
ap.add_argument("--length", type=int, default=4096)
ap.add_argument("--steps", type=int, default=64)
ap.add_argument("--random-weights", action="store_true")
ap.add_argument("--json", default=None)
a = ap.parse_args()

loaded = load_model("smollm2-135m", None, a.random_weights, torch.device("cpu"), torch.float32)
ids = fidelity_ids(loaded.tokenizer, a.length + a.steps)
s = MethodSettings(method="tailorkv", bits=2, budget=1024, sink=64, recent=64, channels=12, free_generated=True)
s.validate()
cache = build_cache(loaded, s, a.length + a.steps + 16)
picks: dict[int, list[torch.Tensor]] = {}   # id(layer) -> [B, Hkv, r] per step
kmax0: dict[int, torch.Tensor] = {}
order: list[int] = []
inner = selection.ChannelSelector.channels


def recording(self, layer, q_sel):
    ch = inner(self, layer, q_sel)
    key = id(layer)
    if key not in picks:
        picks[key], kmax0[key] = [], layer.kmax_before().clone()
        order.append(key)
    picks[key].append(ch.clone())
    return ch


selection.ChannelSelector.channels = recording
eng = Engine(loaded, cache, use_cuda_graph=False)
with torch.inference_mode():
    eng.forward(ids[:a.length])
    picks.clear(), kmax0.clear(), order.clear()   # prefill's own selections (if any) are not decode steps
    for j in range(a.steps):
        eng.forward([ids[a.length + j]])

r = s.channels
rows = []
for n, key in enumerate(order):
    steps = picks[key]
    D = kmax0[key].shape[-1]
    repeat = statistics.fmean(
        len(set(p[0, h].tolist()) & set(q[0, h].tolist())) / r
        for p, q in zip(steps, steps[1:]) for h in range(p.shape[1]))
    static = {}
    for mult in (1, 2, 4):
        c = min(D, mult * r)
        top = kmax0[key][0].topk(c, dim=-1).indices
        static[c] = statistics.fmean(
            len(set(p[0, h].tolist()) & set(top[h].tolist())) / r for p in steps for h in range(p.shape[1]))
    rows.append({"layer": n, "steps": len(steps), "repeat": repeat, "static": static})
weights = "random" if a.random_weights else "trained"
print(f"SmolLM2-135M ({weights} weights), {a.length} tokens then {a.steps} steps, r = {r} of "
      f"{loaded.cfg.head_dim} channels, per sparse layer with a channel selection:")
print(f"{'layer':>5} {'repeat':>7} " + " ".join(f"{'top-' + str(c) + ' kmax':>12}" for c in rows[0]["static"]))
for row in rows:
    print(f"{row['layer']:5d} {row['repeat']:7.1%} " + " ".join(f"{v:12.1%}" for v in row["static"].values()))
print(f"{'mean':>5} {statistics.fmean(x['repeat'] for x in rows):7.1%} " + " ".join(
    f"{statistics.fmean(x['static'][c] for x in rows):12.1%}" for c in rows[0]["static"]))
if a.json:
    with open(a.json, "w") as f:
        json.dump({"weights": weights, "length": a.length, "steps": a.steps, "r": r, "layers": rows}, f, indent=1)

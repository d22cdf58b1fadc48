"""Teacher-forced fidelity of tailorkv variants against the full cache (same as `tailorkv eval --samples 0
--fidelity-tokens N`, engine/evaluation/fidelity.py), but the full cache's logits are computed once per
(dtype, length, tokens) and cached on disk, so each variant runs only its own cache.

usage: PYTHONPATH=src python3 eval/results/2026-11-30-cpu-fidelity-1024-8k/fidelity_variants.py --dtype fp32 \
         --name NAME --out DIR [--set key=json ...]
  keys: any MethodSettings field (bits, budget, sink, recent, channels, quant_layers, dense_layers,
  select_rule, channel_rule, own_query_below, ...) applied on top of the eval's settings for
  `--budgets 1024 --bits 2` (sink 64 + top-K 896 + recent 64, r = 12, free_generated=True).
  --method offload|tailorkv (default tailorkv).
"""
import argparse
import json
import os
import statistics
import time

import torch

from tailorkv.engine.evaluation.fidelity import RecallProbe, compare_logits, fidelity_ids
from tailorkv.engine.generate import Engine
from tailorkv.engine.methods import build_cache, layer_policies
from tailorkv.engine.results import percentile
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model

ap = argparse.ArgumentParser()
ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
ap.add_argument("--name", required=True)
ap.add_argument("--method", default="tailorkv")
ap.add_argument("--length", type=int, default=8192)
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--set", action="append", default=[])
ap.add_argument("--out", required=True, help="folder for NAME.json, NAME_logits.pt and the cached reference")
a = ap.parse_args()

OUT = a.out
os.makedirs(OUT, exist_ok=True)
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
t0 = time.perf_counter()
loaded = load_model("smollm2-135m", None, False, torch.device("cpu"), dtype)
ids = fidelity_ids(loaded.tokenizer, a.length)
length = len(ids) - 1
n = a.tokens
prefix = length - n
max_len = length + 16

ref_path = f"{OUT}/ref_{a.dtype}_{a.length}_{n}.pt"
if os.path.exists(ref_path):
    ref = torch.load(ref_path)
    assert ref["ids"] == ids
    ref_logits = ref["logits"]
    ref_s = 0.0
else:
    t1 = time.perf_counter()
    eng = Engine(loaded, build_cache(loaded, MethodSettings(method="full"), max_len))
    rows = []
    with torch.inference_mode():
        eng.forward(ids[:prefix])
        for j in range(n):
            rows.append(eng.forward([ids[prefix + j]]).reshape(-1).clone())
    ref_logits = torch.stack(rows)
    torch.save({"ids": ids, "logits": ref_logits}, ref_path)
    ref_s = time.perf_counter() - t1
    del eng

# the eval's settings for --budgets 1024 --bits 2, protocol plain (budgets.settings_for)
s = MethodSettings(method=a.method, bits=2, budget=1024, sink=64, recent=64, channels=12, free_generated=True)
for kv in a.set:
    k, v = kv.split("=", 1)
    assert hasattr(s, k), k
    setattr(s, k, json.loads(v))
s.validate()
s.check_model(loaded.cfg.head_dim, loaded.cfg.n_layers)

t1 = time.perf_counter()
cache = build_cache(loaded, s, max_len)
policies = layer_policies(s, loaded.cfg.n_layers, loaded.family)
probe = RecallProbe(cache) if s.method == "tailorkv" else None
eng = Engine(loaded, cache, use_cuda_graph=False)
steps, fetched, attended, logits = [], [], [], []
with torch.inference_mode():
    eng.forward(ids[:prefix])
    if probe is not None:
        probe.__enter__()
    for j in range(n):
        b = eng.forward([ids[prefix + j]])
        if probe is not None:
            probe.end_step()
        st = cache.stats()
        fetched.append(st.get("bytes_fetched", 0))
        attended.append(st.get("tokens_attended", 0))
        steps.append(compare_logits(ref_logits[j], b, ids[prefix + j + 1]))
        logits.append(b.reshape(-1).float().clone())
    if probe is not None:
        probe.__exit__(None, None, None)
var_s = time.perf_counter() - t1
kls = [x["kl"] for x in steps]
nf = statistics.fmean(x["nll_full"] for x in steps)
nm = statistics.fmean(x["nll_method"] for x in steps)
out = {"name": a.name, "dtype": a.dtype, "length": a.length, "prefix_tokens": prefix, "steps": n,
       "settings": s.to_dict(), "overrides": a.set, "layer_policies": policies,
       "own_query_layers": [i for i, l in enumerate(cache.layers)
                            if getattr(l, "selects_tokens", False) and not l.wants_query_prediction],
       "top1_agreement": 100.0 * statistics.fmean(x["agree"] for x in steps),
       "disagree_steps": [j for j, x in enumerate(steps) if not x["agree"]],
       "kl_mean": statistics.fmean(kls), "kl_p99": percentile(kls, 99), "kl_max": max(kls),
       "nll_full": nf, "nll_method": nm,
       "attn_recall": probe.summary()["attn_recall"] if probe else None,
       "attn_recall_min": probe.summary()["attn_recall_min"] if probe else None,
       "attn_recall_per_layer": probe.summary()["attn_recall_per_layer"] if probe else None,
       "pcie_bytes_per_step_mean": statistics.fmean(fetched), "tokens_attended_per_step_mean": statistics.fmean(attended),
       "device_kv_bytes": cache.device_bytes(), "host_kv_bytes": cache.host_bytes(),
       "element_bytes": torch.tensor([], dtype=dtype).element_size(),
       "ref_s": ref_s, "variant_s": var_s, "wall_s": time.perf_counter() - t0}
torch.save(torch.stack(logits), f"{OUT}/{a.name}_logits.pt")
with open(f"{OUT}/{a.name}.json", "w") as f:
    json.dump(out, f, indent=1)
print(json.dumps({k: out[k] for k in ("name", "top1_agreement", "disagree_steps", "kl_mean", "kl_p99", "attn_recall",
                                      "pcie_bytes_per_step_mean", "device_kv_bytes", "own_query_layers",
                                      "ref_s", "variant_s", "wall_s")}))

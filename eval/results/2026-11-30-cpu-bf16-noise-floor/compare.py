"""Pairs of teacher-forced logits saved by ../2026-11-30-cpu-fidelity-1024-8k/fidelity_variants.py, compared with
engine/evaluation/fidelity.py's compare_logits (top-1 agreement, KL(reference || other) per step, NLL of the text):

  (a) full bf16     vs full fp32      how far bf16 rounding alone moves the full cache
  (b) tailorkv bf16 vs full bf16      what a bf16 eval measures (both caches in bf16)
  (c) tailorkv bf16 vs full fp32      tailorkv in bf16 against the exact reference
  (d) tailorkv fp32 vs full fp32      the earlier study's base row, recomputed (a check of the setup)

usage: PYTHONPATH=src python3 eval/results/2026-11-30-cpu-bf16-noise-floor/compare.py DIR OUT.json \
         [--commit SHA --date YYYY-MM-DD]
  DIR holds ref_{fp32,bf16}_8192_128.pt and tailorkv_{bf16,fp32}_logits.pt (and the runs' tailorkv_*.json, whose
  settings and timings are copied); --commit / --date: the code the logits came from, recorded as given.
"""
import argparse
import json
import statistics

import torch

from tailorkv.engine.evaluation.fidelity import compare_logits
from tailorkv.engine.results import percentile

ap = argparse.ArgumentParser()
ap.add_argument("src")
ap.add_argument("out")
ap.add_argument("--commit", default=None)
ap.add_argument("--date", default=None)
a = ap.parse_args()
src, out_path = a.src, a.out
ref = {d: torch.load(f"{src}/ref_{d}_8192_128.pt") for d in ("fp32", "bf16")}
assert ref["fp32"]["ids"] == ref["bf16"]["ids"]
ids = ref["fp32"]["ids"]
logits = {"full fp32": ref["fp32"]["logits"].float(), "full bf16": ref["bf16"]["logits"].float(),
          "tailorkv bf16": torch.load(f"{src}/tailorkv_bf16_logits.pt").float(),
          "tailorkv fp32": torch.load(f"{src}/tailorkv_fp32_logits.pt").float()}
n = logits["full fp32"].shape[0]
prefix = len(ids) - 1 - n
assert all(x.shape[0] == n for x in logits.values())

# the fp32 full cache's margin between its top two logits at each step: disagreements sit at near-ties
top2 = logits["full fp32"].topk(2, -1).values
margin = (top2[:, 0] - top2[:, 1]).tolist()


def pair(other: str, reference: str) -> dict:
    steps = [compare_logits(logits[reference][j], logits[other][j], ids[prefix + j + 1]) for j in range(n)]
    kls = [s["kl"] for s in steps]
    dis = [j for j, s in enumerate(steps) if not s["agree"]]
    return {"other": other, "reference": reference, "steps": n,
            "top1_agreement": 100.0 * statistics.fmean(s["agree"] for s in steps),
            "disagree_steps": dis, "fp32_full_top2_margin_at_disagreements": [round(margin[j], 4) for j in dis],
            "kl_mean": statistics.fmean(kls), "kl_p99": percentile(kls, 99), "kl_max": max(kls),
            "nll_reference": statistics.fmean(s["nll_full"] for s in steps),
            "nll_other": statistics.fmean(s["nll_method"] for s in steps)}


runs = {}
for d in ("bf16", "fp32"):
    with open(f"{src}/tailorkv_{d}.json") as f:
        r = json.load(f)
    runs[d] = {k: r[k] for k in ("settings", "layer_policies", "own_query_layers", "attn_recall",
                                 "pcie_bytes_per_step_mean", "device_kv_bytes", "ref_s", "variant_s", "wall_s")}
res = {"commit": a.commit, "date": a.date, "runs": runs, "prefix_tokens": prefix, "steps": n, "fp32_full_top2_margin_median": statistics.median(margin),
       "pairs": {"a": pair("full bf16", "full fp32"), "b": pair("tailorkv bf16", "full bf16"),
                 "c": pair("tailorkv bf16", "full fp32"), "d": pair("tailorkv fp32", "full fp32")}}
with open(out_path, "w") as f:
    json.dump(res, f, indent=1)
for k, p in res["pairs"].items():
    print(f"({k}) {p['other']} vs {p['reference']}: top-1 {p['top1_agreement']:.1f}% "
          f"({len(p['disagree_steps'])} differ: {p['disagree_steps']}), KL mean {p['kl_mean']:.4f} "
          f"p99 {p['kl_p99']:.4f} max {p['kl_max']:.4f}")

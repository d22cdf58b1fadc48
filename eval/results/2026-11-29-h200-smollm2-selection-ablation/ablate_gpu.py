"""Ablation of tailorkv selection variants on SmolLM2 (one variant per process; JSON lines to argv[5])."""
import sys, time, json, os, torch
sys.path.insert(0, os.path.dirname(__file__))
from variants import apply_variant
from models.loader import load_model
from engine.evaluation import driver as D
from engine.evaluation.fidelity import fidelity_ids, run_fidelity
from engine.settings import MethodSettings

variant, tasks, samples, lengths, outp = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")], sys.argv[5]
dev = "cuda" if torch.cuda.is_available() else "cpu"
lm = load_model("smollm2-135m", device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
kw = apply_variant(variant)
method = "full" if variant == "full" else "tailorkv"
base = MethodSettings(method=method, bits=2, **kw)
plan = D.EvalPlan(lengths=lengths, methods=[method], tasks=tasks, samples=samples, base=base, budget_frac=0.03)
suites = D.build_suites(lm.tokenizer, plan)
f = open(outp, "a")
t0 = time.time()
if method == "tailorkv":
    for n in lengths:
        r = run_fidelity(lm, plan.settings(method, n), fidelity_ids(lm.tokenizer, n), 128)
        f.write(json.dumps({"variant": variant, "kind": "fid", "length": n, **{k: r[k] for k in ("top1_agreement", "kl_mean", "kl_p99", "attn_recall")}}) + "\n"); f.flush()
for it in plan.items():
    r = D.run_item(lm, plan, it, suites)
    f.write(json.dumps({"variant": variant, "kind": "task", **{k: r.get(k) for k in ("index", "length", "task", "sample", "score", "loaded_frac", "attended_frac", "prefill_s", "decode_s", "new_tokens", "status", "error")}}) + "\n"); f.flush()
print(variant, "done", time.time() - t0, flush=True)

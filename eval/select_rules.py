"""Which rule should TailorKV's sparse layers use to pick their top-K tokens? A CPU measurement on SmolLM2 that
uses only the selection ops of ops/sparse_select.py (no engine policy involved).

Per sample (RULER's question placement, `tailorkv eval`'s prompts): one exact prefill, shared by every variant
(layer 0 is tailorkv's 2-bit quantized layer, as the shipped profile says; layers 1-29 keep every token in a
full cache). Then full's greedy answer, and per variant, with the variant's selection applied in every sparse
layer at every decode step (sink + the top-K middle tokens it picks + the last `recent` prompt tokens + the
generated ones; channels from the query predicted one layer early, scores from the current one, as the engine):
- its greedy answer's score (RULER string match), and
- the teacher-forced NLL of full's answer: dNLL = variant - full, nats per answer token (the eval's metric),
- attention recall: the share of the exact attention mass (every query head, over every held token) that falls
  on the tokens the variant kept, mean over the teacher-forced steps, sparse layers and heads.
Standard errors over samples. Run from the repository root:

    PYTHONPATH=src python eval/select_rules.py --task niah_multikey --samples 16 --out DIR
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from tailorkv.engine.cache import LayerSpec, ModelCache
from tailorkv.engine.evaluation import driver as D, prompts
from tailorkv.engine.evaluation.budgets import split_budget
from tailorkv.engine.evaluation.plan import EvalPlan
from tailorkv.engine.evaluation.scoring import score
from tailorkv.engine.generate import Engine
from tailorkv.engine.methods import with_profile
from tailorkv.engine.policies.full import FullCache
from tailorkv.engine.policies.quant import QuantCache
from tailorkv.engine.results import environment
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model
from tailorkv.ops.attention import attention_with_mask, softmax_scale
from tailorkv.ops.sparse_select import channel_scores, combine_heads, head_scores, topk_channels, topk_tokens


@dataclass(frozen=True)
class Variant:
    name: str
    channel_rule: str = "paper"  # or "per-head": r channels for each query head (up to G x the K^T rows)
    combine: str = "sum"
    r: int = 12
    split: str = "shrink"        # sink / recent inside the budget (budgets.split_budget)
    tokens_from: str = "query"   # or "predicted": the token scores from the query predicted one layer early too
    #                              (what fetching the chosen rows a layer ahead would select)
    own_layers: tuple[int, ...] = ()  # layers whose channels come from their own query (no prediction)


VARIANTS = [
    Variant("paper (engine today)"),
    Variant("lse", combine="lse"),
    Variant("psum", combine="psum"),
    Variant("max channels + lse", "max", "lse"),
    Variant("max channels + psum", "max", "psum"),
    Variant("l2 channels + lse", "l2", "lse"),
    Variant("per-head channels + lse", "per-head", "lse"),
    Variant("exact (r 64) + sum", r=64),
    Variant("exact (r 64) + lse", combine="lse", r=64),
    Variant("exact (r 64) + psum", combine="psum", r=64),
    Variant("paper, split budget/16", split="paper"),
    Variant("lse, split budget/16", combine="lse", split="paper"),
    Variant("lse, layer 1 from its own query", combine="lse", own_layers=(1,)),
    Variant("lse, tokens from the predicted query", combine="lse", tokens_from="predicted"),
    Variant("exact (r 64) + lse, from the predicted query", combine="lse", r=64, tokens_from="predicted"),
]


class SelectCache(FullCache):
    """A full cache that, while `variant` is set, attends each decode query only to what the variant keeps.
    start() (after the shared prefill) fixes the middle [sink, prompt - recent) and its K^T rows."""
    wants_query_prediction = True

    def __init__(self, spec: LayerSpec):
        super().__init__(spec)
        self.variant: Variant | None = None
        self.q_hat = None
        self.recall: list[float] | None = None  # None: not measured

    def start(self, variant: Variant | None, prompt_len: int, budget: int) -> None:
        self.truncate(prompt_len)
        self.variant, self.recall = variant, None
        if variant is None:
            return
        self.sink, self.recent = split_budget(budget, 64, 64, variant.split)
        self.topk = budget - self.sink - self.recent
        self.lo, self.hi = self.sink, prompt_len - self.recent
        g = self.spec.n_heads // self.spec.n_kv_heads
        kt = self.k[:, :, self.lo:self.hi].transpose(2, 3)                    # [B, H, D, N]
        self.kt = (kt.repeat_interleave(g, 1) if variant.channel_rule == "per-head" else kt).contiguous()
        self.kmax = self.k[:, :, :prompt_len].abs().amax(2).float()

    def predict_query(self, q_hat):
        self.q_hat = q_hat

    def run(self, q, k, v, step):
        q_hat, self.q_hat = self.q_hat, None
        if self.variant is None or not step.decode:
            return super().run(q, k, v, step)
        start_pos, end = step.start, step.end
        self.k[:, :, start_pos:end], self.v[:, :, start_pos:end] = k, v
        torch.maximum(self.kmax, k[:, :, 0].abs().float(), out=self.kmax)
        return self._select(q, q if q_hat is None else q_hat, end)

    def _select(self, q, q_hat, end):
        var = self.variant
        if self.spec.layer_idx in var.own_layers:
            q_hat = q
        B, Hq, _, D = q.shape
        H, N = self.spec.n_kv_heads, self.hi - self.lo
        g = Hq // H
        if var.channel_rule == "per-head":  # each query head its own r channels: score it against its KV head
            chans = topk_channels(channel_scores(q_hat, self.kmax.repeat_interleave(g, 1), "paper"), var.r)
        else:
            chans = topk_channels(channel_scores(q_hat, self.kmax, var.channel_rule), var.r)
        rows = self.kt.gather(2, chans[..., None].expand(-1, -1, -1, N))      # [B, H or Hq, r, N]
        q_tok = q_hat if var.tokens_from == "predicted" else q
        scores = combine_heads(head_scores(q_tok, rows, chans), H, var.combine, softmax_scale(D))
        idx = topk_tokens(scores, self.topk) + self.lo
        edge = torch.cat([torch.arange(self.lo), torch.arange(self.hi, end)]).expand(B, H, -1)
        keep = torch.cat([edge, idx], 2)
        ks = self.k[:, :, :end].gather(2, keep[..., None].expand(-1, -1, -1, D))
        vs = self.v[:, :, :end].gather(2, keep[..., None].expand(-1, -1, -1, D))
        if self.recall is not None:
            logits = q.float().reshape(B, H, g, D) @ self.k[:, :, :end].float().transpose(2, 3)
            probs = torch.softmax(logits * softmax_scale(D), -1)               # [B, H, G, end]
            self.recall.append(float(probs.gather(3, keep[:, :, None, :].expand(-1, -1, g, -1)).sum(-1).mean()))
        return attention_with_mask(q, ks, vs)


def build(loaded, max_len: int) -> ModelCache:
    cfg = loaded.cfg
    quant = set(with_profile(MethodSettings("tailorkv"), loaded.family, cfg.n_layers).quant_layers)
    layers = []
    for i in range(cfg.n_layers):
        spec = LayerSpec(i, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, max_len, 1, torch.float32,
                         torch.device("cpu"))
        layers.append(QuantCache(spec, MethodSettings("tailorkv", bits=2)) if i in quant else SelectCache(spec))
    return ModelCache(layers, query_fn=loaded.model.project_query, method="tailorkv")


def _se(xs: list[float]) -> float | None:
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None


def run(args) -> dict:
    torch.manual_seed(0)
    loaded = load_model("smollm2-135m", device="cpu", dtype=torch.float32)
    tok = loaded.tokenizer
    plan = EvalPlan(lengths=[args.length], methods=["full"], tasks=[args.task], samples=args.samples,
                    seed=args.seed, question="after")
    suite = prompts.build_suites(tok, plan)[args.length]
    budget = round(args.budget_frac * args.length)
    max_new = plan.max_new(args.task)
    variants = [v for v in VARIANTS if not args.variants or v.name in args.variants.split(";")]
    per: dict = {v.name: {"score": [], "dnll": [], "agree": [], "recall": []} for v in variants}
    full_scores = []
    for si, sample in enumerate(suite):
        t0 = time.time()
        ids = prompts.prompt_ids(tok, sample, "after")
        cache = build(loaded, len(ids) + max_new + 16)
        sel = [layer for layer in cache.layers if isinstance(layer, SelectCache)]
        engine = Engine(loaded, cache)
        with torch.inference_mode():
            logits = engine.forward(ids).clone()
            state = [copy.deepcopy(layer) for layer in cache.layers if not isinstance(layer, SelectCache)]

            def restore(var: Variant | None, recall: bool = False):
                engine.tokens = list(ids)
                cache.length = len(ids)  # the model cache owns the length: back to the shared prefill
                j = 0
                for i, layer in enumerate(cache.layers):
                    if isinstance(layer, SelectCache):
                        layer.start(var, len(ids), budget)
                        layer.recall = [] if recall else None
                    else:
                        cache.layers[i] = copy.deepcopy(state[j])
                        j += 1
            restore(None)
            ref = D.decode(engine, logits, max_new, own_nll=True)
            full_pred = tok.decode(ref["answer"], skip_special_tokens=True)
            full_scores.append(100 * score(full_pred, sample.answers, sample.metric))
            nll_full = statistics.fmean(ref["nll"])
            for var in variants:
                restore(var, recall=True)
                g = D.decode(engine, logits, max_new, follow=ref["picked"])
                pred = tok.decode(g["answer"], skip_special_tokens=True)
                nll, agree = g["nll"], g["agree"]
                if len(nll) < len(ref["picked"]):  # it left full's answer: teacher-force it from the prefill
                    restore(var, recall=True)
                    nll, agree = D.force(engine, logits, ref["picked"])
                rec = per[var.name]
                rec["score"].append(100 * score(pred, sample.answers, sample.metric))
                rec["dnll"].append(statistics.fmean(nll) - nll_full)
                rec["agree"].append(100 * statistics.fmean(agree))
                rec["recall"].append(statistics.fmean(x for layer in sel for x in layer.recall))
        print(f"sample {si}: full {full_scores[-1]:.0f} ({full_pred.strip()[:40]!r}), "
              f"{time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = []
    for var in variants:
        rec = per[var.name]
        rows.append({"variant": asdict(var), **{k: statistics.fmean(x) for k, x in rec.items()},
                     **{k + "_se": _se(x) for k, x in rec.items()}, "per_sample": rec})
    return {"task": args.task, "length": args.length, "samples": args.samples, "seed": args.seed,
            "budget": budget, "splits": {s: split_budget(budget, 64, 64, s) for s in ("shrink", "paper")},
            "full_score": statistics.fmean(full_scores), "full_scores": full_scores, "rows": rows}


def table(res: dict) -> str:
    lines = [f"| variant | score (full {res['full_score']:.1f}) | dNLL ± SE | top-1 on full's answer % | "
             f"attention recall % |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        se = "" if r["dnll_se"] is None else f" ± {r['dnll_se']:.3f}"
        lines.append(f"| {r['variant']['name']} | {r['score']:.1f} | {r['dnll']:+.3f}{se} | {r['agree']:.1f} | "
                     f"{100 * r['recall']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="niah_multikey")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--budget-frac", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (more than the free cores is slow)")
    ap.add_argument("--out", default=None, help="folder for select_rules-<task>.json")
    ap.add_argument("--variants", default=None, help="';'-separated variant names (default: all)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = run(args)
    res["env"] = environment(torch.device("cpu"))
    res["command"] = "python eval/select_rules.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(table(res))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"select_rules-{args.task}.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()

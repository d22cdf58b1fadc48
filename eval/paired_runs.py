"""Two eval.json files of one plan that differ in a knob (e.g. --kt-bits 16 and 8): one method's task records paired
by (length, budget, prompt), B - A per sample, with standard errors, overall and per task; and the fidelity records
of that method side by side.

    PYTHONPATH=src python3 eval/paired_runs.py A/eval.json B/eval.json [--method tailorkv] [--out paired.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from tailorkv.engine.evaluation.merge import read_results


def _mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n) if n > 1 else float("nan"))


def paired(a: dict, b: dict, method: str) -> dict:
    def keyed(res):
        return {(r["length"], r["budget"], r["prompt_hash"]): r for r in res["records"]
                if r["method"] == method and r["status"] == "ok"}
    ra, rb = keyed(a), keyed(b)
    both = sorted(set(ra) & set(rb), key=str)
    if not both:
        sys.exit(f"no {method} sample ran in both files: are they runs of one plan?")
    rows = {}
    for task in sorted({ra[k]["task"] for k in both}) + [None]:
        keys = [k for k in both if task is None or ra[k]["task"] == task]
        score = _mean_se([rb[k]["score"] - ra[k]["score"] for k in keys])
        dn = [rb[k]["dnll"] - ra[k]["dnll"] for k in keys if ra[k].get("dnll") is not None
              and rb[k].get("dnll") is not None]
        rows[task or "all"] = {"n": len(keys), "score_a": sum(ra[k]["score"] for k in keys) / len(keys),
                               "score_b": sum(rb[k]["score"] for k in keys) / len(keys),
                               "score_diff": score[0], "score_diff_se": score[1],
                               "same_prediction": sum(ra[k]["prediction"] == rb[k]["prediction"] for k in keys),
                               "dnll_diff": _mean_se(dn)[0] if dn else None,
                               "dnll_diff_se": _mean_se(dn)[1] if len(dn) > 1 else None}
    fid = [(fa, fb) for fa in a.get("fidelity") or [] for fb in b.get("fidelity") or []
           if fa["method"] == fb["method"] == method and fa["length"] == fb["length"] and fa["budget"] == fb["budget"]]
    return {"method": method, "unpaired": len(set(ra) ^ set(rb)), "tasks": rows,
            "fidelity": [{k: (fa.get(k), fb.get(k)) for k in ("length", "budget", "top1_agreement", "kl_mean",
                                                             "attn_recall")} for fa, fb in fid]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--method", default="tailorkv")
    ap.add_argument("--out")
    args = ap.parse_args()
    out = paired(read_results(args.a), read_results(args.b), args.method)
    print(f"{args.method}: B - A over {out['tasks']['all']['n']} paired samples ({out['unpaired']} unpaired)")
    print(f"{'task':<20}{'n':>4}{'A':>8}{'B':>8}{'B - A':>16}{'same text':>11}{'dNLL B - A':>22}")
    for task, r in out["tasks"].items():
        dn = "-" if r["dnll_diff"] is None else f"{r['dnll_diff']:+.4f} ± {r['dnll_diff_se'] or 0:.4f}"
        print(f"{task:<20}{r['n']:>4}{r['score_a']:>8.1f}{r['score_b']:>8.1f}"
              f"{r['score_diff']:>+9.1f} ± {r['score_diff_se']:<4.1f}{r['same_prediction']:>11}{dn:>22}")
    for f in out["fidelity"]:
        print("fidelity", {k: v for k, v in f.items()})
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()

"""Where the top-K carry (ops/topk_carry.py) stands: (1) the kernels alone at 128k, 8 rows, K 1024: the sketch
scores with and without listing, the top-K searching whole and selecting among 2K .. 16K listed tokens; (2) how
the rank-K score moves from step to step in a real decode (recorded per layer, row and step, with the ranks 2K ..
16K and the predicted query's norm), to size the margin and the cap offline.
    PYTHONPATH=src python3 bench/topk_carry_probe.py --random-weights --ctx 131072 --out DIR"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kernels import gpu_time  # noqa: E402

from tailorkv.engine.results import environment, write_json  # noqa: E402
from tailorkv.ops.quant import quantize_sketch
from tailorkv.ops.sparse_select import sketch_scores, topk_tokens  # noqa: E402
from tailorkv.ops.topk_carry import TopKCarry  # noqa: E402

RANKS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16)


def timed(fn) -> float:
    """us per call of fn, replayed from a CUDA graph (bench/kernels.py's gpu_time: launch costs out of it)."""
    return gpu_time([fn])[0] * 1e3


def kernels_alone(n=131072, k=1024) -> tuple[dict, dict]:
    """(us per call of each kernel or pair, {listed: [rows searched whole, rows selected]} of the pairs)"""
    g = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(1, 8, n, 128, device="cuda", generator=g) * torch.exp(torch.randn(128, device="cuda", generator=g))
    kc, ks, km = quantize_sketch(keys, 2, 64)
    q = torch.randn(1, 32, 1, 128, device="cuda", generator=g).bfloat16()
    end = torch.tensor(n, device="cuda")
    args = (q, kc, ks, km, 2, 64, end, 0, "lse", 1 / math.sqrt(128))
    scores = sketch_scores(*args)
    out = torch.empty(1, 8, k, dtype=torch.long, device="cuda")
    searches = {}
    rows = {"sketch scores": timed(lambda: sketch_scores(*args)),
            "top-K whole": timed(lambda: topk_tokens(scores, k, 0, out))}
    for mult in (2, 4, 8, 16):
        carry = TopKCarry(8, k, torch.device("cuda"), cap_per_k=max(4, 2 * mult))
        qnorm = q.float().reshape(8, -1).norm(dim=-1)
        kth = scores.reshape(8, -1).topk(mult * k, -1).values[:, -1] / qnorm

        def pair():
            carry.threshold.copy_(kth)
            carry.margin.fill_(1.0)
            topk_tokens(sketch_scores(*args, carry=carry), k, 0, out, carry=carry)
        rows[f"sketch scores listing + top-K among {mult}K"] = timed(pair)
        searches[f"{mult}K"] = carry.searches.tolist()
    rows["sketch scores + top-K whole"] = timed(lambda: topk_tokens(sketch_scores(*args), k, 0, out))
    rows["(copy + fill, as in the listing pairs)"] = timed(lambda: (carry.threshold.copy_(kth), carry.margin.fill_(1.0)))
    return rows, searches


def decode_ranks(a):
    from tailorkv.engine.methods import build_cache
    from tailorkv.engine.policies.sketch import SketchSelector
    from tailorkv.engine.runner import Runner
    from tailorkv.engine.settings import MethodSettings
    from tailorkv.models.loader import load_model
    loaded = load_model(a.model, random_weights=a.random_weights, device="cuda", dtype=torch.bfloat16)
    cache = build_cache(loaded, MethodSettings("tailorkv", select="sketch-ahead"), a.ctx)
    runner = Runner(loaded.model, cache, use_cuda_graph=False)
    records = []
    pick = SketchSelector._pick

    def recording(self, layer, q, out=None):
        lo, n = layer.sink, layer.middle_bucket
        carry, layer.sketch.carry = layer.sketch.carry, None   # listing twice would list every token twice
        s = layer.sketch.scores(q, n, layer.tail_start_dev, lo, self.rule).reshape(-1, n)
        layer.sketch.carry = carry
        k = layer.topk
        top = s.topk(min(n, int(16 * k)), -1).values
        at = torch.tensor([min(top.shape[-1], int(r * k)) - 1 for r in RANKS], device=s.device)
        G = q.shape[1] // layer.spec.n_kv_heads
        qn = q.float().reshape(q.shape[0], layer.spec.n_kv_heads, G, -1).norm(dim=(2, 3)).reshape(-1)
        records.append((layer.spec.layer_idx, top[:, at], qn))
        return pick(self, layer, q, out)
    SketchSelector._pick = recording
    prompt = torch.randint(0, loaded.cfg.vocab_size, (1, a.ctx - 64), device="cuda")
    tok = runner.prefill(prompt).argmax(-1, keepdim=True)
    for _ in range(a.steps):
        tok = runner.decode(tok).argmax(-1, keepdim=True)
    SketchSelector._pick = pick
    return [{"layer": li, "ranks": r.tolist(), "qnorm": qn.tolist()} for li, r, qn in records]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    alone, searches = kernels_alone()
    for name, us in alone.items():
        print(f"{name:45s} {us:8.1f} us")
    print("rows searched whole, of those selected, per listed size:", searches)
    steps = decode_ranks(a) if a.steps else []
    write_json(os.path.join(a.out, "topk_carry_probe.json"),
               {"environment": environment(torch.device("cuda")), "alone_us": alone, "searches": searches,
                "rank_multiples": RANKS, "steps": steps})
    print(f"{len(steps)} selections recorded")


if __name__ == "__main__":
    main()

"""How often the top-K carry (ops/topk_carry.py) falls back to the whole search across replays whose query
drifts, modelled on the CPU: the sketch scores by their torch reference, then the top-K kernel's margin rule
(ops/topk_cuda.py, the block that sets the next threshold) re-stated in Python. The inputs are those of
tests/test_kernels_topk_carry.py's graph test (32k tokens, 8 KV heads, K 1024, 2-bit sketch, q <- a q + b noise
before each replay), seed by seed, so a seed that failed there replays here without a GPU (the first step's
margin uses the stretches' floors, as on a GPU of --sms SMs).

    PYTHONPATH=src python3 bench/probes/topk_carry_margin.py --drift 0.9,0.3 --seeds 1000-1149
"""
import argparse
import collections
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers import random_keys  # noqa: E402
from tailorkv.ops.sparse_select import sketch_scores  # noqa: E402
from tailorkv.ops.topk_carry import TopKCarry  # noqa: E402
from tailorkv.ops.topk_cuda import stretches  # noqa: E402


def next_margin(m: float, listed: int, k: int, cap: int, top: float, low_floor: float | None) -> float:
    """The kernel's rule: the first margin a quarter of the way down to the lowest stretch's floor, then widened
    when too few were listed, narrowed when too many (all in units of the query norm)."""
    if not m > 0:
        m = 0.25 * (top - low_floor) if low_floor is not None else 0.05 * abs(top)
    elif listed < k:
        m *= 2
    elif listed > cap:
        m *= 0.5
    elif 4 * listed < 5 * k:
        m *= 1.5
    elif listed > 3 * k:
        m *= 0.75
    return max(m, 1e-6 * abs(top))


def whole_searches(seed: int, a: float, b: float, replays: int, sms: int) -> int:
    g = torch.Generator().manual_seed(seed)
    hq, hkv, T, D, k = 32, 8, 32768, 128, 1024
    kc, ks, km = random_keys(g, 1, hkv, T, D, 2, "cpu", sketch=True)
    q = torch.randn(1, hq, 1, D, generator=g).to(torch.bfloat16)
    cap = TopKCarry(hkv, k, torch.device("cpu")).cap
    s_count = stretches(hkv, T, k, sms)
    threshold, margin, whole = [float("-inf")] * hkv, [0.0] * hkv, 0
    for _ in range(replays):
        q.copy_(q.float() * a + b * torch.randn(q.shape, generator=g))
        scores = sketch_scores.reference(q, kc, ks, km, 2, 64, torch.tensor(T), 0, "lse", 1 / math.sqrt(D))
        scores = scores.reshape(hkv, T).float()
        qnorm = q.float().reshape(hkv, -1).norm(dim=-1)
        for r in range(hkv):
            listed = int((scores[r] >= threshold[r] * qnorm[r]).sum())
            whole += not k <= listed <= cap
            top = float(scores[r].topk(k).values[-1] / qnorm[r])
            low = (min(float(st.topk(k).values[-1]) for st in scores[r].split(-(-T // s_count))) / float(qnorm[r])
                   if s_count > 1 else None)
            margin[r] = next_margin(margin[r], listed, k, cap, top, low)
            threshold[r] = top - margin[r]
    return whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drift", default="0.9,0.3", help="a,b: q <- a q + b noise before each replay")
    ap.add_argument("--seeds", default="0-19", help="first-last")
    ap.add_argument("--replays", type=int, default=6)
    ap.add_argument("--sms", type=int, default=132)
    args = ap.parse_args()
    a, b = (float(x) for x in args.drift.split(","))
    first, last = (int(x) for x in args.seeds.split("-"))
    counts = collections.Counter()
    for seed in range(first, last + 1):
        n = whole_searches(seed, a, b, args.replays, args.sms)
        counts[n] += 1
        print(f"seed {seed}: {n} of {args.replays * 8} rows searched whole", flush=True)
    print("rows searched whole: seeds", dict(sorted(counts.items())))


if __name__ == "__main__":
    main()

"""One layer's causal prefill attention (Hq 32, Hkv 8, D 128, bf16) as one cuDNN call against the blocked form that
writes its output over q (ops.attention's into_q: per block of queries, the keys before it unmasked and its own
keys causally, merged by logsumexp): time and relative error for several block sizes, and the first call's time
(cuDNN builds an execution plan for every new shape: run one form per process to see a cold start).
    PYTHONPATH=src python3 bench/prefill_over_q.py --tokens 131072 --blocks 8192,16384,32768 --out DIR
    PYTHONPATH=src python3 bench/prefill_over_q.py --tokens 131072 --blocks 16384 --skip-one --out DIR/cold-16384"""
from __future__ import annotations

import argparse
import os
import time

import torch

from sdpa_backends import time_ms  # bench/, the script's folder, leads sys.path
from tailorkv.engine.results import environment, write_json
from tailorkv.ops import attention


def first_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--blocks", default="8192,16384,32768")
    ap.add_argument("--skip-one", action="store_true", help="leave out the one-call form (a cold start of the blocks)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    T = args.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, T, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)  # engine layout
    k, v = (torch.randn(1, 8, T, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    flops = 4 * 32 * 128 * T * (T + 1) / 2
    rows = []
    ref = None
    if not args.skip_one:
        first = first_ms(lambda: attention.causal_attention(q, k, v, 0))
        ref = attention.causal_attention(q, k, v, 0).float()
        ms = time_ms(lambda: attention.causal_attention(q, k, v, 0), 3)
        rows.append({"tokens": T, "form": "one cuDNN call", "first_ms": first, "ms": ms, "tflops": flops / ms / 1e9})
        print(rows[-1])
    for blk in (int(b) for b in args.blocks.split(",")):
        attention.INTO_Q_BLOCK = blk
        qc = q.clone()
        first = first_ms(lambda qc=qc: attention.causal_attention(qc, k, v, 0, into_q=True))
        qc.copy_(q)
        got = attention.causal_attention(qc, k, v, 0, into_q=True).float()
        err = ((got - ref).norm() / ref.norm()).item() if ref is not None else None
        del got
        ms = time_ms(lambda qc=qc: attention.causal_attention(qc, k, v, 0, into_q=True), 3)  # over its own output: same work
        rows.append({"tokens": T, "form": f"over q, blocks of {blk}", "first_ms": first, "ms": ms, "tflops": flops / ms / 1e9,
                     "rel_err": err, "nan": bool(qc.isnan().any())})
        print(rows[-1])
        del qc
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, "prefill_over_q.json"), {"env": environment(torch.device("cuda")), "rows": rows})


if __name__ == "__main__":
    main()

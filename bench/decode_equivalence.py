"""The pipelined, graphed decode against the synchronous eager reference: the same greedy tokens?
For each (model, method): one cache decodes through the engine's path (CUDA graphs, the copy stream's
prefetch), another eagerly on one stream; both prefill the same prompt and decode N greedy steps.
    PYTHONPATH=src python3 bench/decode_equivalence.py --model smollm2-135m --ctx 4096 --steps 256 --out DIR
    PYTHONPATH=src python3 bench/decode_equivalence.py --model llama-3.1-8b --random-weights --ctx 32768 ..."""
from __future__ import annotations

import argparse
import os

import torch

from tailorkv.engine.methods import build_cache
from tailorkv.engine.results import environment, write_json
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model


def greedy(loaded, settings, prompt, steps, max_len, pipelined: bool) -> list[int]:
    cache = build_cache(loaded, settings, max_len, overlap=pipelined)
    runner = Runner(loaded.model, cache, use_cuda_graph=pipelined)
    tok = runner.prefill(prompt).argmax(-1, keepdim=True)
    out = [tok]
    for _ in range(steps):
        tok = runner.decode(tok).argmax(-1, keepdim=True)
        out.append(tok)
    return torch.cat(out, 1)[0].tolist()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--methods", default="full,tailorkv")
    ap.add_argument("--bits", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    loaded = load_model(args.model, random_weights=args.random_weights, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    n_prompt = args.ctx - args.steps - 16
    prompt = torch.randint(0, min(loaded.cfg.vocab_size, 32000), (1, n_prompt), generator=g).cuda()
    rows = []
    for method in args.methods.split(","):
        s = MethodSettings(method=method, bits=args.bits)
        ref = greedy(loaded, s, prompt, args.steps, args.ctx, pipelined=False)
        got = greedy(loaded, s, prompt, args.steps, args.ctx, pipelined=True)
        first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        rows.append({"model": loaded.name, "method": method, "ctx": args.ctx, "steps": args.steps,
                     "equal": ref == got, "first_difference": first, "tokens": len(ref)})
        print(f"{loaded.name} {method} ctx {args.ctx}: {args.steps} greedy steps "
              + ("identical" if ref == got else f"DIFFER from step {first}"))
    os.makedirs(args.out, exist_ok=True)
    write_json(os.path.join(args.out, f"equivalence-{loaded.name}-{args.ctx}.json"),
               {"env": environment(torch.device("cuda")), "rows": rows})


if __name__ == "__main__":
    main()

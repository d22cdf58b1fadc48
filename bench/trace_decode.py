"""A chrome trace of a few decode steps (every kernel and copy with its stream), for finding what a stage
breakdown cannot show: which work overlaps and where a stream waits.
    PYTHONPATH=src python3 bench/trace_decode.py --model llama-3.1-8b --random-weights --ctx 32768 [--select sketch-ahead] --out DIR"""
from __future__ import annotations

import argparse
import os

import torch

from tailorkv.engine.bench.stages import profile_steps
from tailorkv.engine.methods import build_cache
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--method", default="tailorkv")
    ap.add_argument("--select-rule", default="lse")
    ap.add_argument("--select", default="channels", help="channels, sketch or sketch-ahead")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    loaded = load_model(a.model, random_weights=a.random_weights, device="cuda", dtype=torch.bfloat16)
    runner = Runner(loaded.model, build_cache(loaded, MethodSettings(a.method, select_rule=a.select_rule, select=a.select), a.ctx))
    prompt = torch.randint(0, 32000, (1, a.ctx - 64), device="cuda")
    tok = [runner.prefill(prompt).argmax(-1, keepdim=True)]
    for _ in range(6):
        tok[0] = runner.decode(tok[0]).argmax(-1, keepdim=True)

    def step():
        tok[0] = runner.decode(tok[0]).argmax(-1, keepdim=True)
    os.makedirs(a.out, exist_ok=True)
    print(profile_steps(step, a.steps, os.path.join(a.out, "trace.json")))


if __name__ == "__main__":
    main()

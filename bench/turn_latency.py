"""A chat's second turn after a long first one, and where GPU memory peaks: prefill a long prompt, decode a few
tokens, then time short multi-token turns (what `tailorkv run` does when a message arrives), with a stage
breakdown of one of them; the allocator's peak is read per phase and per layer of the long prefill.
    PYTHONPATH=src python3 bench/turn_latency.py --ctx 131072 --prompt 118028 --turn 23 --out DIR"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from tailorkv.engine.bench.stages import profile_steps
from tailorkv.engine.methods import build_cache
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model

GIB = 2**30


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--prompt", type=int, default=118028)
    ap.add_argument("--turn", type=int, default=23)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--method", default="tailorkv")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda")
    loaded = load_model(a.model, random_weights=True, device="cuda", dtype=torch.bfloat16)
    cache = build_cache(loaded, MethodSettings(a.method), a.ctx)
    runner = Runner(loaded.model, cache)
    res = {"model": a.model, "method": a.method, "ctx": a.ctx, "prompt": a.prompt, "turn": a.turn,
           "gpu": torch.cuda.get_device_name(dev), "commit": os.environ.get("TAILORKV_COMMIT", "unknown"),
           "after_load_gib": torch.cuda.memory_allocated(dev) / GIB}
    per_layer = []

    def on_layer(i, n):  # at layer i's start: the peak since layer i - 1's start is layer i - 1's
        per_layer.append((i - 1, torch.cuda.memory_allocated(dev) / GIB, torch.cuda.max_memory_allocated(dev) / GIB))
        torch.cuda.reset_peak_memory_stats(dev)
    cache.on_layer = on_layer
    torch.cuda.reset_peak_memory_stats(dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, loaded.cfg.vocab_size, (1, a.prompt), generator=g).to(dev)
    t0 = time.perf_counter()
    tok = runner.prefill(prompt).argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    res["prefill_s"] = time.perf_counter() - t0
    res["prefill_peak_gib"] = max(p for _, _, p in per_layer + [(0, 0, torch.cuda.max_memory_allocated(dev) / GIB)])
    worst = max(per_layer, key=lambda x: x[2]) if per_layer else None
    res["prefill_worst_layer"] = {"layer": worst[0], "allocated_at_next_start_gib": worst[1], "peak_gib": worst[2]} \
        if worst else None
    cache.on_layer = None
    torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(8):
        tok = runner.decode(tok).argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    res["decode_peak_gib"] = torch.cuda.max_memory_allocated(dev) / GIB
    times = []
    for _ in range(a.turns):
        msg = torch.randint(0, loaded.cfg.vocab_size, (1, a.turn), generator=g).to(dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tok = runner.prefill(msg).argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tok = runner.decode(tok).argmax(-1, keepdim=True)
    res["turn_prefill_s"] = times
    msg = torch.randint(0, loaded.cfg.vocab_size, (1, a.turn), generator=g).to(dev)
    res["turn_profile"] = profile_steps(lambda: runner.prefill(msg), 1)
    res["turn_peak_gib"] = torch.cuda.max_memory_allocated(dev) / GIB
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "turn_latency.json"), "w") as f:
        json.dump(res, f, indent=1)
    short = {k: v for k, v in res.items() if k != "turn_profile"}
    print(json.dumps(short, indent=1))
    print({k: round(v, 3) for k, v in res["turn_profile"]["stage_ms"].items()},
          "wall", round(res["turn_profile"]["wall_ms"], 1), "busy", round(res["turn_profile"]["gpu_busy_ms"], 1))


if __name__ == "__main__":
    main()

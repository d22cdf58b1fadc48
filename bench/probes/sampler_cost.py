"""What choosing a token costs a decode step: each iteration queues a GPU spin of about one decode step (the
graph's replay) and then picks the token as Engine.generate does (the sampler, int() on the host). The time
over the spin alone is what the pick adds to a token.
    PYTHONPATH=src python3 bench/probes/sampler_cost.py [--vocab 128256] [--ms 19]"""
from __future__ import annotations

import argparse
import time

import torch

from tailorkv.engine.sampling import Sampler, SamplingParams, resolve


def per_iteration_ms(pick, logits, hist, cycles: int, n: int) -> float:
    for _ in range(5):
        pick(logits, hist)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        torch.cuda._sleep(cycles)
        int(pick(logits, hist)[0])
    return 1e3 * (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--ms", type=float, default=19.0)
    ap.add_argument("--n", type=int, default=100)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    logits = (3 * torch.randn(1, a.vocab, device=dev, generator=g)).float()
    hist = torch.randint(0, a.vocab, (32,)).tolist()
    # calibrate the spin: cycles per ms
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(10**8)
    torch.cuda.synchronize()
    cycles = int(10**8 * a.ms / (1e3 * (time.perf_counter() - t0)))
    base = per_iteration_ms(lambda x, h: x[:, :1].long()[0], logits, hist, cycles, a.n)
    rows = [("spin + int() only", base)]
    for name, params in (("greedy", SamplingParams()), ("llama.cpp defaults", resolve({"seed": 1})[0]),
                         ("defaults, no penalty", resolve({"seed": 1, "repeat_penalty": 1.0})[0])):
        s = Sampler(params, dev)
        rows.append((name, per_iteration_ms(s, logits, hist, cycles, a.n)))
    s = Sampler(resolve({"seed": 1})[0], dev)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            int(s(logits, hist)[0])
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    print(f"{'pick':24s} ms per iteration   added to a token")
    for name, ms in rows:
        print(f"{name:24s} {ms:8.3f}            {ms - base:+.3f}")


if __name__ == "__main__":
    main()

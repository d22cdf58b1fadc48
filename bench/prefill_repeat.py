"""The same long prefill several times in one process (the first builds cuDNN's plans), with the attention of a
long prompt blocked over q (the default) or as one cuDNN call (`--block 0`): prefill seconds and peak memory.
    PYTHONPATH=src python3 bench/prefill_repeat.py --ctx 131072 --select sketch-ahead --repeat 3 [--block 0]"""
from __future__ import annotations

import argparse
import time

import torch

from tailorkv.engine.methods import build_cache
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model
from tailorkv.ops import attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--select", default="channels")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--block", type=int, default=None, help="INTO_Q_BLOCK; 0: one cuDNN call")
    a = ap.parse_args()
    if a.block is not None:
        attention.INTO_Q_BLOCK = a.block or 1 << 40
    loaded = load_model("llama-3.1-8b", random_weights=True, device="cuda", dtype=torch.bfloat16)
    settings = MethodSettings("tailorkv", select=a.select)
    prompt = torch.randint(0, loaded.cfg.vocab_size, (1, a.ctx - 64), device="cuda")
    for i in range(a.repeat):
        cache = build_cache(loaded, settings, a.ctx, 1)
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            Runner(loaded.model, cache, use_cuda_graph=False).prefill(prompt)
        torch.cuda.synchronize()
        print(f"block {attention.INTO_Q_BLOCK} {a.select} prefill {i}: {time.perf_counter() - t0:.2f} s, "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
        del cache


if __name__ == "__main__":
    main()

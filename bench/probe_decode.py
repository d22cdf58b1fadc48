"""Device probe: eager decode ms/token and prefill time of a random-weight model with the full cache.
python bench/probe_decode.py --model llama-3.1-8b --ctx 8192"""
import argparse
import statistics
import sys
import time
import os

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch

from tailorkv.engine.methods import build_cache
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="llama-3.1-8b")
ap.add_argument("--ctx", type=int, default=8192)
ap.add_argument("--steps", type=int, default=64)
ap.add_argument("--method", default="full")
a = ap.parse_args()
t0 = time.perf_counter()
lm = load_model(a.model, random_weights=True, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
print(f"load {time.perf_counter()-t0:.1f}s weights {sum(p.numel()*p.element_size() for p in lm.model.parameters())/2**30:.2f} GiB")
cache = build_cache(lm, MethodSettings(a.method, quant_layers=[0]), max_len=a.ctx + a.steps + 16)
ids = torch.randint(0, lm.cfg.vocab_size, (1, a.ctx), device="cuda")
for rep in range(2):
    cache.reset()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    logits = lm.model(ids, 0, cache)
    torch.cuda.synchronize(); pre = time.perf_counter() - t0
    print(f"prefill {a.ctx} tokens: {pre*1000:.0f} ms ({a.ctx/pre:.0f} tok/s)")
tok = logits.argmax(-1, keepdim=True)
times = []
for s in range(a.steps):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    logits = lm.model(tok, a.ctx + s, cache)
    tok = logits.argmax(-1, keepdim=True)
    torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
times = times[8:]
print(f"decode at {a.ctx}: median {statistics.median(times)*1000:.2f} ms/token, min {min(times)*1000:.2f}")
print(f"peak memory {torch.cuda.max_memory_allocated()/2**30:.2f} GiB")
from tailorkv.engine.cuda_graph import GraphedDecoder
g = GraphedDecoder(lm.model, cache)
pos = a.ctx
cache.truncate(pos)
eager = lm.model(tok, pos, cache).float()
cache.truncate(pos)
graphed = g.step(tok, pos).float()
err = ((eager - graphed).norm() / eager.norm()).item()
print(f"graph vs eager logits rel err {err:.2e}")
times = []
for s in range(a.steps):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    logits = g.step(tok, pos + s)
    tok = logits.argmax(-1, keepdim=True)
    torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
times = times[4:]
print(f"graphed decode at {a.ctx}: median {statistics.median(times)*1000:.2f} ms/token, min {min(times)*1000:.2f}; graphs {len(g.graphs)}")
print(f"peak memory {torch.cuda.max_memory_allocated()/2**30:.2f} GiB")

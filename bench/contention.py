"""What slows the dense GEMVs beside the copy stream's work in `--select sketch-ahead`: 31 layers of Llama-3.1-8B
projections (the engine's GEMV, distinct weights per layer, one CUDA graph) timed alone and while a second graph
runs on a stream of the engine's copy-stream priority (or `--priority`) with, per layer, (a) the gather of 1,024 x 8 K/V rows of 512 B from pinned host
memory, (b) sketch scores (2 bits, 128k tokens) + top-896, (c) both.
    PYTHONPATH=src python3 bench/contention.py --out DIR"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from tailorkv.engine.results import environment, write_json
from tailorkv.ops.host_gather import gather_rows
from tailorkv.ops.linear import linear
from tailorkv.ops.quant import quantize_sketch
from tailorkv.ops.sparse_select import sketch_scores, topk_tokens

LAYERS, N, K, HKV, D = 31, 131072, 1024, 8, 128


def graph_of(fn, stream):
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        fn()  # warm-up (kernels load, allocator pools)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    torch.cuda.synchronize()
    return g


def replay_timed(graph, stream):
    """Queue a replay of `graph` on `stream` between two timing events (no sync) -> (start, end)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        graph.replay()
        end.record(stream)
    return start, end


def dense_gemvs(dev):
    """A function that runs the 31 layers' projections of the 8B shape (distinct random weights per layer)."""
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    weights = [[torch.randn(*s, device=dev, dtype=torch.bfloat16) * 0.02 for s in shapes] for _ in range(LAYERS)]
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    h = torch.randn(1, 14336, device=dev, dtype=torch.bfloat16)

    def layer(i):
        w = weights[i]
        linear(x, w[0]), linear(x, w[1]), linear(x, w[2]), linear(h, w[3])

    def dense():
        for i in range(LAYERS):
            layer(i)
    dense.layer = layer  # one layer's projections
    return dense


def gather_inputs(dev: torch.device, k: int, bits: int):
    """One sparse layer's pinned K/V store [1, HKV, N, 2D], k random row indices, a device buffer for the k
    gathered rows, a `bits` sketch of random keys and a query of 32 heads."""
    host = torch.randn(1, HKV, N, 2 * D, dtype=torch.bfloat16).pin_memory()
    idx = torch.randint(0, N, (1, HKV, k), device=dev)
    rows = torch.empty(1, HKV, k, 2 * D, device=dev, dtype=torch.bfloat16)
    sketch = quantize_sketch(torch.randn(1, HKV, N, D, device=dev), bits, 64)
    q = torch.randn(1, 32, 1, D, device=dev, dtype=torch.bfloat16)
    return host, idx, rows, sketch, q


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--priority", type=int, default=-5, help="the side stream's (the engine's copy stream: -5)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    dense = dense_gemvs(dev)

    host, idx, rows, sketch, q = gather_inputs(dev, K, 2)
    end = torch.tensor(N, device=dev)

    def gather():
        for _ in range(LAYERS):
            gather_rows(host, idx, dev, out=rows)

    def select():
        for _ in range(LAYERS):
            topk_tokens(sketch_scores(q, *sketch, 2, 64, end, 0, "lse", 0.088), 896)

    def both():
        for _ in range(LAYERS):
            topk_tokens(sketch_scores(q, *sketch, 2, 64, end, 0, "lse", 0.088), 896)
            gather_rows(host, idx, dev, out=rows)

    main_stream = torch.cuda.Stream(dev)
    side = torch.cuda.Stream(dev, priority=a.priority)
    g_dense = graph_of(dense, main_stream)
    sides = {name: graph_of(fn, side) for name, fn in (("gather", gather), ("sketch+topk", select), ("both", both))}

    rows_out = []
    for name in [None, *sides]:
        dense_ms, side_ms = [], []
        for _ in range(a.reps):
            torch.cuda.synchronize()
            side_events = replay_timed(sides[name], side) if name is not None else None  # queued first
            dense_events = replay_timed(g_dense, main_stream)
            torch.cuda.synchronize()
            dense_ms.append(dense_events[0].elapsed_time(dense_events[1]))
            if side_events is not None:
                side_ms.append(side_events[0].elapsed_time(side_events[1]))
        row = {"priority": a.priority, "beside": name or "nothing", "dense_ms": statistics.median(dense_ms),
               "side_ms": statistics.median(side_ms) if side_ms else None}
        rows_out.append(row)
        print(row, flush=True)
    for name, g in sides.items():  # each side alone
        ts = []
        for _ in range(a.reps):
            start, end = replay_timed(g, side)
            torch.cuda.synchronize()
            ts.append(start.elapsed_time(end))
        rows_out.append({"alone": name, "ms": statistics.median(ts)})
        print(rows_out[-1], flush=True)
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, f"contention-priority{a.priority}.json"), {"env": environment(dev), "rows": rows_out})


if __name__ == "__main__":
    main()

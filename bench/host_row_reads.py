"""How fast a sparse layer's decode attention reads its selected K and V rows from pinned host memory, by host
store size and layout (GPU only). The question: why 8 KV heads x 1024 rows of K and V (4 MiB) take ~2x longer
per layer at 128k than at 32k in `tailorkv bench` (the same bytes).

For each context N and layout it times `sparse_decode_attention` (the kernel reads the rows zero-copy inside the
attention) and `gather_rows` of K then V (one block per row) over L layers' stores, cycling through the layers as
a decode step does, with fresh random positions (1024 per KV head, sorted) each step:
  separate:    host_k, host_v [1, 8, N, 128] (the engine's layout)
  interleaved: one [1, 8, N, 2, 128] store, K and V of a token in one 512-byte run (host_k, host_v its views)
Prints GB/s of row bytes per layer and a table last; --out writes JSON.

    PYTHONPATH=src python3 bench/host_row_reads.py --ctx 32768,131072 --layers 8
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tailorkv.ops.attention import sparse_decode_attention
from tailorkv.ops.host_gather import gather_rows


def stores(n_layers, N, layout, H=8, D=128):
    out = []
    for _ in range(n_layers):
        if layout == "separate":
            k = torch.empty(1, H, N, D, dtype=torch.bfloat16, pin_memory=True)
            v = torch.empty(1, H, N, D, dtype=torch.bfloat16, pin_memory=True)
        else:
            kv = torch.empty(1, H, N, 2, D, dtype=torch.bfloat16, pin_memory=True)
            k, v = kv[:, :, :, 0], kv[:, :, :, 1]
        k.normal_()
        v.normal_()
        out.append((k, v))
    return out


def time_layers(fn, n_layers, steps, warmup=3):
    for s in range(warmup):
        for layer in range(n_layers):
            fn(layer, s)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for s in range(steps):
        for layer in range(n_layers):
            fn(layer, warmup + s)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / (steps * n_layers) * 1e3  # us per layer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="32768,131072")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--topk", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, H, D, sink = torch.device("cuda"), 8, 128, 64
    q = torch.randn(1, 32, 1, D, device=dev, dtype=torch.bfloat16)
    dk = torch.randn(1, H, sink + 256, D, device=dev, dtype=torch.bfloat16)
    dv = torch.randn_like(dk)
    rows_bytes = 2 * H * args.topk * D * 2
    results = []
    for N in [int(x) for x in args.ctx.split(",")]:
        p = torch.tensor([N - 1], device=dev)
        ts = torch.tensor(N - 64, device=dev)
        g = torch.Generator(device=dev).manual_seed(N)
        pos = [torch.rand(1, H, N - 2 * sink, generator=g, device=dev).topk(args.topk, -1).indices.sort(-1).values
               + sink for _ in range(8)]
        for layout in ("separate", "interleaved"):
            t0 = time.time()
            st = stores(args.layers, N, layout)
            alloc_s = time.time() - t0
            kbuf = torch.empty(1, H, args.topk, D, device=dev, dtype=torch.bfloat16)
            vbuf = torch.empty_like(kbuf)

            def attend(layer, s):
                k, v = st[layer]
                sparse_decode_attention(q, dk, dv, k, v, pos[s % 8], p, ts, sink)

            def gather(layer, s):
                k, v = st[layer]
                gather_rows(k, pos[s % 8], dev, out=kbuf)
                gather_rows(v, pos[s % 8], dev, out=vbuf)

            for name, fn in (("attention", attend), ("gather", gather)):
                us = time_layers(fn, args.layers, args.steps)
                r = {"ctx": N, "layout": layout, "op": name, "layers": args.layers, "us_per_layer": round(us, 1),
                     "GB_s": round(rows_bytes / us / 1e3, 1), "alloc_s": round(alloc_s, 1)}
                print(r, flush=True)
                results.append(r)
            st = None  # free the pinned stores before the next layout
            torch.cuda.empty_cache()
    print(f"\n{'ctx':>7} {'layout':>12} {'op':>10} {'us/layer':>9} {'GB/s':>6}")
    for r in results:
        print(f"{r['ctx']:>7} {r['layout']:>12} {r['op']:>10} {r['us_per_layer']:>9} {r['GB_s']:>6}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows_bytes_per_layer": rows_bytes, "results": results,
                       "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()

"""Read a chrome trace of decode steps (bench/trace_decode.py) and print what a stage table cannot show: the
kernels of a few layers in time order with their streams, each stream's busy time, and where the busiest
stream sat idle (the gap summed by the kernel that ended it: a wait on the other stream shows up there).
    PYTHONPATH=src python3 bench/trace_timeline.py DIR/trace.json [--layers 10,11] [--marker rope_]"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

from tailorkv.engine.bench.stages import gpu_events


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--layers", default="10,11", help="layer indices to print, counted by --marker kernels")
    ap.add_argument("--marker", default="rope_", help="a kernel launched once per layer")
    ap.add_argument("--n-layers", type=int, default=32)
    ap.add_argument("--per-layer", type=int, default=2, help="marker kernels per layer (rope: the layer's own "
                    "query and keys, and the next layer's predicted query)")
    ap.add_argument("--gap-us", type=float, default=2.0)
    a = ap.parse_args()
    with open(a.trace) as f:
        ev = gpu_events(json.load(f))
    busy = defaultdict(float)
    for e in ev:
        busy[e["stream"]] += e["dur"]
    compute = max(busy, key=busy.get)
    print("streams (kernel time, us):", {s: round(b) for s, b in busy.items()}, "busiest:", compute)
    gaps, end = defaultdict(lambda: [0.0, 0]), None
    for e in (e for e in ev if e["stream"] == compute):
        if end is not None and e["ts"] - end > a.gap_us:
            g = gaps[e["name"][:70]]
            g[0] += e["ts"] - end
            g[1] += 1
        end = max(end or 0.0, e["ts"] + e["dur"])
    print(f"idle gaps > {a.gap_us} us on stream {compute}, by the kernel that ended them (us, count):")
    for name, (t, n) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"  {t:9.1f} {n:5d}  {name}")
    # a CUDA graph spreads a step over streams of its own: the marker is looked for on every stream
    marks = [i for i, e in enumerate(ev) if a.marker in e["name"]]
    want = [int(x) for x in a.layers.split(",")]
    last = marks[-a.n_layers * a.per_layer:][::a.per_layer]  # the last step's layers
    if max(want) >= len(last):
        raise SystemExit(f"only {len(last)} layers found by the marker {a.marker!r} (--marker, --per-layer)")
    lo_i = last[min(want)]
    hi_i = last[max(want) + 1] if last and max(want) + 1 < len(last) else len(ev)
    t0 = ev[lo_i]["ts"]
    print(f"timeline of layers {a.layers} of the last step (t=0 at its {a.marker} kernel), stream {compute} unmarked, others '*':")
    for e in ev[lo_i:hi_i]:
        tag = " " if e["stream"] == compute else "*"
        print(f"{tag}{e['ts'] - t0:9.1f} {e['dur']:8.1f}  s{e['stream']:<4d} {e['name'][:90]}")


if __name__ == "__main__":
    main()

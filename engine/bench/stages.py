"""The stage breakdown of decode steps (`tailorkv bench --profile`): torch.profiler records a few steps, and the
kernels and copies of its trace are summed per stage and per stream.

Per step: kernels launched, GPU busy time (the union of every kernel's and copy's interval, all streams), the
wall time, the time each stage's kernels take (their intervals may overlap across streams), and how much of
the copy stream's busy time ran while the compute stream was busy too (what the prefetch overlapped), and the
kernel time that ran beside other work (the sum of every interval less their union): a CUDA graph spreads its
branches over streams of its own, so "the compute stream" is not one stream there and only this last figure
says how much ran concurrently.
Stages are read off kernel names, so a renamed kernel lands in `other`: the table says so."""
from __future__ import annotations

import json
import re

# first match wins; patterns are matched against lower-cased kernel names
STAGES = (
    ("pcie gather", r"gather_rows|gather_long_rows|refresh_rows"),
    ("sketch scores", r"sketch_scores"),
    ("1/2-bit attention", r"qk_quant|av_quant|quant_attn"),
    ("selection", r"approx_scores|topk|radix|sort|bitonic|channel|page_scores|page_slots|bound_page"),
    ("attention", r"attend_|flash|fmha|attention|cudnn|softmax"),
    ("dense (gemm/gemv)", r"gemm|gemv|cutlass|xmma|nvjet|sm90|sm80|splitk|cublas"),
    ("fused norm/rope/silu", r"rms_norm|rope|silu_mul"),
)
COPIES = {"memcpy htod": "pcie copy h2d", "memcpy dtoh": "pcie copy d2h", "memcpy dtod": "device copy",
          "memset": "memset"}


def stage_of(name: str) -> str:
    low = name.lower()
    for stage, pattern in STAGES:
        if re.search(pattern, low):
            return stage
    return "other (elementwise, index, cat, ...)"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the union of a intersected with the union of b."""
    return _union(a) + _union(b) - _union(a + b)


def gpu_events(trace: dict) -> list[dict]:
    """The trace's kernels, copies and memsets in time order: {cat, name, ts, dur, stream} (times in us)."""
    out = []
    for e in trace.get("traceEvents", []):
        cat = str(e.get("cat", "")).lower()
        if cat in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            out.append({"cat": cat, "name": str(e.get("name", "")), "ts": float(e["ts"]), "dur": float(e["dur"]),
                        "stream": int((e.get("args") or {}).get("stream", 0))})
    return sorted(out, key=lambda e: e["ts"])


def summarize(trace: dict, steps: int, wall_ms: float) -> dict:
    """trace: a chrome trace (torch.profiler's export) covering `steps` decode steps of wall_ms each."""
    stages: dict[str, float] = {}
    streams: dict[int, list[tuple[float, float]]] = {}
    stage_streams: dict[str, dict[int, float]] = {}
    kernels = 0
    for e in gpu_events(trace):
        name = e["name"]
        if e["cat"] == "kernel":
            kernels += 1
            stage = stage_of(name)
        else:
            stage = next((v for k, v in COPIES.items() if k in name.lower()), "copy")
        stages[stage] = stages.get(stage, 0.0) + e["dur"] / 1e3
        by = stage_streams.setdefault(stage, {})
        by[e["stream"]] = by.get(e["stream"], 0.0) + e["dur"] / 1e3
        streams.setdefault(e["stream"], []).append((e["ts"], e["ts"] + e["dur"]))
    by_busy = sorted(streams, key=lambda s: -_union(streams[s]))
    # the compute stream runs most of the kernels (a side stream may be the busier one: a step bound by PCIe)
    compute = max(streams, key=lambda s: len(streams[s])) if streams else None
    others = [iv for s in streams if s != compute for iv in streams[s]]
    n = max(steps, 1)
    # each stage's time on the compute stream and on the others (copy, select: what can overlap it)
    split = {k: {"compute": v.get(compute, 0.0) / n, "side": sum(t for s, t in v.items() if s != compute) / n}
             for k, v in stage_streams.items()}
    busy = _union([iv for ivs in streams.values() for iv in ivs]) / 1e3
    order = sorted(stages, key=lambda k: -stages[k])
    return {"steps": steps, "kernels_per_step": kernels / n, "gpu_busy_ms": busy / n, "wall_ms": wall_ms,
            "busy_fraction": busy / n / wall_ms if wall_ms else None,
            "stage_ms": {k: stages[k] / n for k in order},
            "stage_stream_ms": {k: split[k] for k in order},
            "stream_busy_ms": {str(s): _union(streams[s]) / 1e3 / n for s in by_busy},
            "other_streams_overlapped_ms": (_overlap(streams[compute], others) / 1e3 / n) if others else 0.0,
            "concurrent_ms": (sum(b - a for ivs in streams.values() for a, b in ivs) / 1e3 / n) - busy / n}


def profile_steps(step, steps: int, trace_path: str | None = None) -> dict:
    """Run step() `steps` times under torch.profiler (CUDA) and summarize; keeps the trace at trace_path."""
    import os
    import tempfile
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    path = trace_path or tempfile.mkstemp(suffix=".json")[1]
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    if trace_path is None:
        os.unlink(path)
    return summarize(trace, steps, wall_ms)

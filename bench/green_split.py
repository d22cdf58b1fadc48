"""Does giving the row gather SMs of its own (CUDA green contexts) keep its PCIe row rate beside the dense GEMVs?
31 layers of Llama-3.1-8B projections on a compute stream, beside, per layer, the gather of 896 x 8 K/V rows of 512 B
from pinned host memory (alone, or after the 4-bit sketch scores + top-896 on a select stream, as sketch-ahead runs
them). Streams either share all SMs (the engine today) or the gather's stream gets n SMs of a green context and
the compute and select streams the other SMs (a second green context). A probe kernel records which SMs each
stream's blocks ran on, eagerly and from a CUDA graph replayed there.
    PYTHONPATH=src python3 bench/green_split.py --out DIR [--side-sms 8,16,32]"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import struct

import torch

from contention import dense_gemvs
from tailorkv.engine.results import environment, write_json
from tailorkv.ops import host_gather_cuda
from tailorkv.ops.cuda_launch import compile_module, launch, ptr
from tailorkv.ops.host_gather import gather_rows
from tailorkv.ops.quant import quantize_sketch
from tailorkv.ops.sparse_select import sketch_scores, topk_tokens
from tailorkv.ops.topk_carry import TopKCarry

LAYERS, N, K, HKV, D, BITS = 31, 131072, 896, 8, 128, 4
RESOURCE_BYTES, SM_TYPE, NON_BLOCKING = 144, 1, 1  # sizeof(CUdevResource), CU_DEV_RESOURCE_TYPE_SM (CUDA 13 cuda.h)


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def green_streams(side_sms: int, device: int = 0):
    """Split the SMs into `side_sms` and the rest; a green context on each. -> (rest streams (compute, select),
    side stream, SM counts (rest, side))."""
    cu = ctypes.CDLL("libcuda.so.1")
    torch.cuda.synchronize()  # the primary context exists
    dev = ctypes.c_int()
    _check(cu.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    full, side, rest = (ctypes.create_string_buffer(RESOURCE_BYTES) for _ in range(3))
    _check(cu.cuDeviceGetDevResource(dev, full, SM_TYPE), "cuDeviceGetDevResource")
    groups = ctypes.c_uint(1)
    _check(cu.cuDevSmResourceSplitByCount(side, ctypes.byref(groups), full, rest, ctypes.c_uint(0),
                                          ctypes.c_uint(side_sms)), "cuDevSmResourceSplitByCount")
    counts = tuple(struct.unpack_from("I", r.raw, 96)[0] for r in (rest, side))

    def streams(res, priorities):
        desc, ctx = ctypes.c_void_p(), ctypes.c_void_p()
        _check(cu.cuDevResourceGenerateDesc(ctypes.byref(desc), res, ctypes.c_uint(1)), "cuDevResourceGenerateDesc")
        _check(cu.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, ctypes.c_uint(0)), "cuGreenCtxCreate")
        out = []
        for p in priorities:
            s = ctypes.c_void_p()
            _check(cu.cuGreenCtxStreamCreate(ctypes.byref(s), ctx, ctypes.c_uint(NON_BLOCKING), ctypes.c_int(p)),
                   "cuGreenCtxStreamCreate")
            out.append(torch.cuda.ExternalStream(s.value, device=torch.device("cuda", device)))
        return out
    compute, select = streams(rest, (0, -5))
    (gather,) = streams(side, (-5,))
    return (compute, select), gather, counts


_PROBE = r"""
extern "C" __global__ void which_sm(int* out) {
    unsigned int s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    if (threadIdx.x == 0) out[blockIdx.x] = s;
    for (int i = 0; i < 20000; ++i) __nanosleep(100);   // stay resident so that the blocks spread
}
"""


def sms_used(kernel, stream, graph: bool, blocks: int = 264) -> list[int]:
    out = torch.full((blocks,), -1, dtype=torch.int32, device="cuda")
    with torch.cuda.stream(stream):
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                launch(kernel, (blocks,), (32,), (ptr(out),), out.device)
            g.replay()
        else:
            launch(kernel, (blocks,), (32,), (ptr(out),), out.device)
    torch.cuda.synchronize()
    return sorted(set(out.tolist()))


def sms_used_or_error(kernel, stream, graph: bool):
    try:
        return sms_used(kernel, stream, graph)
    except RuntimeError as e:
        return [f"error: {e}"]


def timed(streams_work, reps):
    """streams_work: [(stream, fn)] run interleaved layer by layer (fn(layer) queues that layer's work); a sleep
    first on every stream, so that the host queues ahead. -> median ms per stream."""
    out = [[] for _ in streams_work]
    for _ in range(reps):
        torch.cuda.synchronize()
        ev = []
        for s, _ in streams_work:
            with torch.cuda.stream(s):
                torch.cuda._sleep(2_000_000)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(s)
                ev.append((a, b))
        for layer in range(LAYERS):
            for s, fn in streams_work:
                with torch.cuda.stream(s):
                    fn(layer)
        for (s, _), (a, b) in zip(streams_work, ev):
            b.record(s)
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(ev):
            out[i].append(a.elapsed_time(b))
    return [round(statistics.median(x), 4) for x in out]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--side-sms", default="8,16,32")
    ap.add_argument("--gather-blocks", default="12,24")
    a = ap.parse_args()
    dev = torch.device("cuda")
    dense = dense_gemvs(dev)
    host = torch.randn(1, HKV, N, 2 * D, dtype=torch.bfloat16).pin_memory()
    idx = torch.randint(0, N, (1, HKV, K), device=dev)
    rows = torch.empty(1, HKV, K, 2 * D, device=dev, dtype=torch.bfloat16)
    sketch = quantize_sketch(torch.randn(1, HKV, N, D, device=dev), BITS, 64)
    q = torch.randn(1, 32, 1, D, device=dev, dtype=torch.bfloat16)
    end = torch.tensor(N, device=dev)
    pos = torch.empty(1, HKV, K, dtype=torch.long, device=dev)
    carry = TopKCarry(HKV, K, dev)
    layer_dense = dense.layer

    def gather(_):
        gather_rows(host, idx, dev, out=rows)

    def select_then(select_stream, gather_stream, events):
        def sel(layer):
            topk_tokens(sketch_scores(q, *sketch, BITS, 64, end, 0, "lse", 0.088, carry=carry), K, 0, pos, carry=carry)
            events[layer].record(select_stream)

        def gat(layer):
            gather_stream.wait_event(events[layer])
            gather_rows(host, pos, dev, out=rows)
        return sel, gat

    probe = compile_module(_PROBE).get_function("which_sm")
    results = {"env": environment(dev), "rows": [], "probe": {}}

    def record(row):
        results["rows"].append(row)
        print(row, flush=True)

    configs = [("shared", None)] + [(f"green{n}", int(n)) for n in a.side_sms.split(",")]
    for name, n in configs:
        if n is None:
            compute, select, side, counts = (torch.cuda.Stream(dev), torch.cuda.Stream(dev, priority=-5),
                                             torch.cuda.Stream(dev, priority=-5), None)
        else:
            (compute, select), side, counts = green_streams(n)
            results["probe"][name] = {
                "sm_counts (rest, side)": counts,
                **{f"{who} {how}": sms_used_or_error(probe, s, how == "graph")
                   for who, s in (("compute", compute), ("side", side)) for how in ("eager", "graph")}}
            p = results["probe"][name]
            print(name, "SM counts", counts, {k: len(v) for k, v in p.items() if k != "sm_counts (rest, side)"},
                  "overlap eager", len(set(p["compute eager"]) & set(p["side eager"])),
                  "overlap graph", len(set(p["compute graph"]) & set(p["side graph"])), flush=True)
        for blocks in [int(b) for b in a.gather_blocks.split(",")]:
            host_gather_cuda.MAX_BLOCKS = blocks
            events = [torch.cuda.Event() for _ in range(LAYERS)]
            sel, gat = select_then(select, side, events)
            base = {"config": name, "sm_counts": counts, "gather_blocks": blocks}
            (d,) = timed([(compute, layer_dense)], a.reps)
            (g,) = timed([(side, gather)], a.reps)
            record({**base, "dense_alone_ms": d, "gather_alone_ms": g})
            d, g = timed([(compute, layer_dense), (side, gather)], a.reps)
            record({**base, "beside": "gather", "dense_ms": d, "gather_ms": g})
            d, s, g = timed([(compute, layer_dense), (select, sel), (side, gat)], a.reps)
            record({**base, "beside": "sketch+topk -> gather", "dense_ms": d, "select_ms": s, "gather_ms": g})
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, "green-split.json"), results)
    print(f"{'config':10} {'blocks':>6} {'beside':24} {'dense':>8} {'select':>8} {'gather':>8}")
    for r in results["rows"]:
        if "beside" in r:
            print(f"{r['config']:10} {r['gather_blocks']:6} {r['beside']:24} {r['dense_ms']:8.3f} "
                  f"{r.get('select_ms', float('nan')):8.3f} {r['gather_ms']:8.3f}")
        else:
            print(f"{r['config']:10} {r['gather_blocks']:6} {'(alone)':24} {r['dense_alone_ms']:8.3f} "
                  f"{'':8} {r['gather_alone_ms']:8.3f}")


if __name__ == "__main__":
    main()

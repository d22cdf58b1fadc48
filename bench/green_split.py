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

from contention import dense_gemvs, gather_inputs, graph_of, replay_timed
from tailorkv.engine.results import environment, write_json
from tailorkv.ops import host_gather_cuda
from tailorkv.ops.cuda_launch import compile_module, launch, ptr
from tailorkv.ops.host_gather import gather_rows
from tailorkv.ops.sparse_select import sketch_scores, topk_tokens
from tailorkv.ops.topk_carry import TopKCarry

LAYERS, N, K, HKV, D, BITS = 31, 131072, 896, 8, 128, 4
# sizeof(CUdevResource), CU_DEV_RESOURCE_TYPE_SM, CU_STREAM_NON_BLOCKING, CU_GREEN_CTX_DEFAULT_STREAM (CUDA 13 cuda.h)
RESOURCE_BYTES, SM_TYPE, NON_BLOCKING, DEFAULT_STREAM = 144, 1, 1, 1


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
        _check(cu.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, ctypes.c_uint(DEFAULT_STREAM)), "cuGreenCtxCreate")
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


def sms_used_forked(kernel, compute, side, blocks: int = 264) -> dict:
    """One graph captured on `compute` that forks to `side`: the SMs of each branch's probe."""
    outs = [torch.full((blocks,), -1, dtype=torch.int32, device="cuda") for _ in range(2)]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=compute):
        fork, join = torch.cuda.Event(), torch.cuda.Event()
        fork.record(compute)
        side.wait_event(fork)
        for s, out in zip((compute, side), outs):
            with torch.cuda.stream(s):
                launch(kernel, (blocks,), (32,), (ptr(out),), out.device)
        join.record(side)
        compute.wait_event(join)
    with torch.cuda.stream(compute):
        g.replay()
    torch.cuda.synchronize()
    return {f"forked graph {who}": sorted(set(o.tolist())) for who, o in zip(("compute", "side"), outs)}


def sms_used_or_error(kernel, stream, graph: bool):
    try:
        return sms_used(kernel, stream, graph)
    except RuntimeError as e:
        return [f"error: {e}"]


def step_graph(compute, select, side, dense_layer, sel, gat, chained: bool):
    """One CUDA graph of LAYERS layers, forked from `compute`: the dense layer on compute (if dense_layer), per layer
    the selection on select then the gather on side (if sel / gat). chained: as sketch-ahead runs, layer i + 1's
    selection starts with dense layer i, and dense layer i + 1 waits for layer i + 1's rows."""
    def queue():
        fork = torch.cuda.Event()
        fork.record(compute)
        select.wait_event(fork)
        side.wait_event(fork)
        rows_ready = None
        for layer in range(LAYERS):
            started = torch.cuda.Event()
            with torch.cuda.stream(compute):
                if chained and rows_ready is not None:
                    compute.wait_event(rows_ready)
                started.record(compute)
                if dense_layer:
                    dense_layer(layer)
            if sel:
                picked = torch.cuda.Event()
                with torch.cuda.stream(select):
                    if chained:
                        select.wait_event(started)
                    sel(layer)
                    picked.record(select)
                with torch.cuda.stream(side):
                    side.wait_event(picked)
                    gat(layer)
            elif gat:
                with torch.cuda.stream(side):
                    gat(layer)
            if gat:
                rows_ready = torch.cuda.Event()
                rows_ready.record(side)
        for s in (select, side):
            done = torch.cuda.Event()
            done.record(s)
            compute.wait_event(done)
    return graph_of(queue, compute)


def replay_ms(g, stream, reps):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = replay_timed(g, stream)
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return round(statistics.median(ts), 4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--side-sms", default="8,16,32")
    ap.add_argument("--gather-blocks", default="12,24")
    a = ap.parse_args()
    dev = torch.device("cuda")
    dense = dense_gemvs(dev)
    host, idx, rows, sketch, q = gather_inputs(dev, K, BITS)
    end = torch.tensor(N, device=dev)
    pos = torch.empty(1, HKV, K, dtype=torch.long, device=dev)
    carry = TopKCarry(HKV, K, dev)
    layer_dense = dense.layer

    def gather(_):
        gather_rows(host, idx, dev, out=rows)

    def sel(_):
        topk_tokens(sketch_scores(q, *sketch, BITS, 64, end, 0, "lse", 0.088, carry=carry), K, 0, pos, carry=carry)

    def gat(_):
        gather_rows(host, pos, dev, out=rows)

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
            try:
                results["probe"][name].update(sms_used_forked(probe, compute, side))
            except RuntimeError as e:
                results["probe"][name]["forked graph"] = [f"error: {e}"]
            p = results["probe"][name]
            print(name, "SM counts", counts, {k: len(v) for k, v in p.items() if k != "sm_counts (rest, side)"},
                  "overlap eager", len(set(p["compute eager"]) & set(p["side eager"])),
                  "overlap graph", len(set(p["compute graph"]) & set(p["side graph"])),
                  "overlap forked", len(set(p.get("forked graph compute", [])) & set(p.get("forked graph side", []))),
                  flush=True)
        for blocks in [int(b) for b in a.gather_blocks.split(",")]:
            host_gather_cuda.MAX_BLOCKS = blocks
            row = {"config": name, "sm_counts": counts, "gather_blocks": blocks}
            for label, parts, chained in (("dense", (layer_dense, None, None), False),
                                          ("gather", (None, None, gather), False),
                                          ("select+gather", (None, sel, gat), False),
                                          ("dense | gather", (layer_dense, None, gather), False),
                                          ("dense | select+gather", (layer_dense, sel, gat), False),
                                          ("chained", (layer_dense, sel, gat), True)):
                try:
                    row[label] = replay_ms(step_graph(compute, select, side, *parts, chained), compute, a.reps)
                except RuntimeError as e:
                    row[label] = f"error: {e}"
            record(row)
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, "green-split.json"), results)
    labels = ["dense", "gather", "select+gather", "dense | gather", "dense | select+gather", "chained"]
    print(f"{'config':9} {'blocks':>6} " + " ".join(f"{x:>21}" for x in labels))
    for r in results["rows"]:
        print(f"{r['config']:9} {r['gather_blocks']:6} " + " ".join(f"{str(r[x]):>21}" for x in labels))

if __name__ == "__main__":
    main()

"""Does the K/V row gather of `--select sketch-ahead` slow down in the decode step because of where its rows lie?
In the step each of 31 layers reads 1,024 x 8 rows of 512 B from its own 512 MiB pinned store (16 GiB in all),
at new positions every step; bench/contention.py read the same rows of one store 31 times. This times one CUDA
graph of 31 gathers (the engine's gather_rows kernel) alone and beside 31 layers of the 8B GEMVs, for:
    same-rows:   one store, the same rows every layer (contention.py's setup)
    one-store:   one store, new sorted rows per layer
    31-stores:   a store per layer (the step's layout), new sorted rows per layer
    31-unsorted: as 31-stores, rows in random order
    31-thp:      as 31-stores, the stores on transparent 2 MiB pages (mmap + madvise + cudaHostRegister)
    31-vmm:      as 31-stores, each store host memory from the driver's virtual memory API (cuMemCreate with a
                 host location, mapped at its allocation granularity: the GPU's page tables hold 2 MiB pages)
    PYTHONPATH=src python3 bench/gather_pages.py --out DIR"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from contention import D, HKV, K, LAYERS, N, dense_gemvs, graph_of, replay_timed  # noqa: E402

from tailorkv.engine.results import environment, write_json  # noqa: E402
from tailorkv.ops import host_gather_cuda  # noqa: E402
from tailorkv.ops.host_gather import gather_rows  # noqa: E402

STORE_BYTES = HKV * N * 2 * D * 2


def anon_huge_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


def thp_store():
    """A [1, HKV, N, 2D] bf16 tensor on memory mmapped with MADV_HUGEPAGE, registered (pinned, mapped) for UVA."""
    import cupy

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    huge = 2 << 20
    raw = libc.mmap(None, STORE_BYTES + huge, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    if raw in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    addr = (raw + huge - 1) // huge * huge
    if libc.madvise(addr, STORE_BYTES, 14) != 0:  # MADV_HUGEPAGE
        raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
    ctypes.memset(addr, 0, STORE_BYTES)
    cupy.cuda.runtime.hostRegister(addr, STORE_BYTES, 3)  # portable | mapped
    buf = (ctypes.c_byte * STORE_BYTES).from_address(addr)
    return torch.frombuffer(buf, dtype=torch.bfloat16).view(1, HKV, N, 2 * D)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("location", _Location),
                ("win32", ctypes.c_void_p), ("flags", ctypes.c_ubyte * 8)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def vmm_store(dev):
    """A [1, HKV, N, 2D] bf16 tensor over pinned host memory made with cuMemCreate (location: host) and mapped
    for the device at the allocation granularity. The CPU gets access too where the driver allows it."""
    cu = ctypes.CDLL("libcuda.so.1")

    def check(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUresult {rc}")
    prop = _AllocProp(type=1, handle_types=0, location=_Location(type=2, id=0))   # pinned, CU_MEM_LOCATION_TYPE_HOST
    gran = ctypes.c_size_t()
    check(cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 1), "cuMemGetAllocationGranularity")
    size = -(-STORE_BYTES // gran.value) * gran.value
    handle, va = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    check(cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)),
          "cuMemCreate")
    check(cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(gran.value),
                                 ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
    check(cu.cuMemMap(va, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)), "cuMemMap")
    check(cu.cuMemSetAccess(va, ctypes.c_size_t(size), ctypes.byref(_AccessDesc(_Location(1, dev.index or 0), 3)),
                            ctypes.c_size_t(1)), "cuMemSetAccess (device)")
    cpu = cu.cuMemSetAccess(va, ctypes.c_size_t(size), ctypes.byref(_AccessDesc(_Location(2, 0), 3)), ctypes.c_size_t(1))
    buf = (ctypes.c_byte * STORE_BYTES).from_address(va.value)
    return torch.frombuffer(buf, dtype=torch.bfloat16).view(1, HKV, N, 2 * D), gran.value, cpu == 0


def sorted_rows(dev):
    return torch.randint(0, N, (1, HKV, K), device=dev).sort(-1).values


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cases", default="same-rows,one-store,31-stores,31-unsorted,31-thp,31-vmm")
    ap.add_argument("--variants", default="", help="blocks x loads in flight per thread of the short-row kernel, "
                    "e.g. 16x4,16x8,32x4 (each case is timed with each; default: the module's)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    dense = dense_gemvs(dev)
    main_stream, side = torch.cuda.Stream(dev), torch.cuda.Stream(dev, priority=-5)
    g_dense = graph_of(dense, main_stream)
    rows = torch.empty(1, HKV, K, 2 * D, device=dev, dtype=torch.bfloat16)
    one = torch.randn(1, HKV, N, 2 * D, dtype=torch.bfloat16).pin_memory()
    results = []
    variants = [tuple(map(int, v.split("x"))) for v in a.variants.split(",") if v] or [
        (host_gather_cuda.MAX_BLOCKS, host_gather_cuda.UNROLL)]
    for case, (blocks, unroll) in ((c, v) for c in a.cases.split(",") for v in variants):
        host_gather_cuda.MAX_BLOCKS, host_gather_cuda.UNROLL = blocks, unroll
        gather = host_gather_cuda.load(gather_rows.reference)
        huge_before = anon_huge_kib()
        cpu_ok, gran = True, None
        if case == "31-thp":
            stores = [thp_store() for _ in range(LAYERS)]
        elif case == "31-vmm":
            made = [vmm_store(dev) for _ in range(LAYERS)]
            stores, gran, cpu_ok = [m[0] for m in made], made[0][1], all(m[2] for m in made)
        elif case.startswith("31-"):
            stores = [torch.empty(1, HKV, N, 2 * D, dtype=torch.bfloat16).pin_memory() for _ in range(LAYERS)]
        else:
            stores = [one] * LAYERS
        huge_mib = (anon_huge_kib() - huge_before) // 1024
        if case == "same-rows":
            idx = [sorted_rows(dev)] * LAYERS
        elif case == "31-unsorted":
            idx = [torch.randint(0, N, (1, HKV, K), device=dev) for _ in range(LAYERS)]
        else:
            idx = [sorted_rows(dev) for _ in range(LAYERS)]
        if cpu_ok:
            want = stores[3][0, 2, idx[3][0, 2, 7]].to(dev)
            gather(stores[3], idx[3], dev, out=rows)
            torch.cuda.synchronize()
            assert torch.equal(rows[0, 2, 7], want), case

        def gathers():
            for s, i in zip(stores, idx):
                gather(s, i, dev, out=rows)
        g_side = graph_of(gathers, side)
        row = {"case": case, "granularity": gran, "cpu_access": cpu_ok, "blocks": blocks, "unroll": unroll, "anon_huge_mib": huge_mib}
        for beside in (False, True):
            side_ms, dense_ms = [], []
            for _ in range(a.reps):
                torch.cuda.synchronize()
                ev = replay_timed(g_side, side)
                dv = replay_timed(g_dense, main_stream) if beside else None
                torch.cuda.synchronize()
                side_ms.append(ev[0].elapsed_time(ev[1]))
                if dv:
                    dense_ms.append(dv[0].elapsed_time(dv[1]))
            ms = statistics.median(side_ms)
            key = "beside_gemvs" if beside else "alone"
            row[f"{key}_ms"] = round(ms, 3)
            row[f"{key}_gbps"] = round(LAYERS * HKV * K * 2 * D * 2 / ms / 1e6, 1)
            if beside:
                row["gemvs_ms"] = round(statistics.median(dense_ms), 3)
        results.append(row)
        print(row, flush=True)
        g_side = stores = None  # the next case pins its own stores
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, "gather_pages.json"), {"environment": environment(dev), "results": results})
    print(f"{'case':14s} {'variant':>8s} {'THP MiB':>8s} {'alone ms':>9s} {'GB/s':>6s} {'beside ms':>10s} {'GB/s':>6s} {'GEMVs ms':>9s}")
    for r in results:
        print(f"{r['case']:14s} {str(r['blocks']) + 'x' + str(r['unroll']):>8s} {r['anon_huge_mib']:8d} {r['alone_ms']:9.3f} {r['alone_gbps']:6.1f} "
              f"{r['beside_gemvs_ms']:10.3f} {r['beside_gemvs_gbps']:6.1f} {r['gemvs_ms']:9.3f}")


if __name__ == "__main__":
    main()

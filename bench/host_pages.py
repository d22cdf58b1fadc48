"""Is the row gather bound by address translation? The same gathers of 896 x 8 K/V rows of 512 B per layer (31
layers), beside the dense GEMVs or alone, from host stores that differ only in size and page backing:
  small:  one 0.5 GiB pinned layer store read by every layer with the same rows (few distinct pages),
  small-distinct: that store, other rows per layer,
  pinned-same: the 31 layers' pinned stores below, each layer the same row numbers in its own store,
  pinned: 31 layers' stores, 15.5 GiB from torch's pin_memory (cudaHostAlloc), other rows per layer (as the engine),
  thp:    the same 15.5 GiB in anonymous memory on transparent huge pages (madvise), registered with cudaHostRegister,
  4k:     as thp but madvise(NOHUGEPAGE), registered likewise,
  vmm:    the same 15.5 GiB from the CUDA virtual memory API (cuMemCreate in host memory, mapped at its recommended
          granularity, the CPU given access too),
  managed: the same 15.5 GiB as managed memory kept on the host (preferred location host, accessed by the GPU).
"split" runs the dense and the gather graphs on two streams and times each.
    PYTHONPATH=src python3 bench/host_pages.py --out DIR"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import os

import torch

from contention import dense_gemvs, replay_timed
from green_split import BITS, D, HKV, K, LAYERS, N, replay_ms, step_graph
from tailorkv.engine.results import environment, write_json
from tailorkv.ops import host_gather_cuda
from tailorkv.ops.host_gather import gather_rows
from tailorkv.ops.quant import quantize_sketch
from tailorkv.ops.sparse_select import sketch_scores, topk_tokens
from tailorkv.ops.topk_carry import TopKCarry

HUGE = 2 << 20
LAYER_SHAPE = (1, HKV, N, 2 * D)


def anon_store(layers: int, huge: bool, keep: list):
    """A [layers, 1, HKV, N, 2D] bf16 tensor in anonymous memory, 2 MiB aligned, on huge pages or not, registered."""
    nbytes = layers * HKV * N * 2 * D * 2
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(m, dtype=torch.uint8)
    off = (-base.data_ptr()) % HUGE
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE, off, nbytes)
    t = base[off:off + nbytes].view(torch.bfloat16).view(layers, *LAYER_SHAPE)
    t.fill_(1.0)
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 3)  # portable | mapped
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister: {rc}")
    keep.append(m)
    return t


class _Prop(ctypes.Structure):   # CUmemAllocationProp (CUDA 13 cuda.h)
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("loc_type", ctypes.c_int),
                ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("compression", ctypes.c_ubyte),
                ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


def vmm_store(layers: int, info: dict):
    """The store in host memory from cuMemCreate (location HOST), mapped for the GPU and the CPU."""
    cu = ctypes.CDLL("libcuda.so.1")
    nbytes = layers * HKV * N * 2 * D * 2
    prop = _Prop(type=1, handle_types=0, loc_type=2, loc_id=0)  # pinned, no handle, CU_MEM_LOCATION_TYPE_HOST
    gran = ctypes.c_size_t()
    for what, rc in (("granularity", cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 1)),):
        if rc:
            raise RuntimeError(f"{what}: {rc}")
    size = -(-nbytes // gran.value) * gran.value
    handle, addr = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    if rc := cu.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0)):
        raise RuntimeError(f"cuMemCreate: {rc}")
    if rc := cu.cuMemAddressReserve(ctypes.byref(addr), ctypes.c_size_t(size), ctypes.c_size_t(gran.value),
                                    ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)):
        raise RuntimeError(f"cuMemAddressReserve: {rc}")
    if rc := cu.cuMemMap(addr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)):
        raise RuntimeError(f"cuMemMap: {rc}")
    access = (_Access * 2)(_Access(1, torch.cuda.current_device(), 3), _Access(3, 0, 3))  # device, host: read-write
    if rc := cu.cuMemSetAccess(addr, ctypes.c_size_t(size), access, ctypes.c_size_t(2)):
        raise RuntimeError(f"cuMemSetAccess: {rc}")
    info.update(granularity=gran.value, size=size)
    buf = (ctypes.c_char * nbytes).from_address(addr.value)
    t = torch.frombuffer(buf, dtype=torch.bfloat16).view(layers, *LAYER_SHAPE)
    t.fill_(1.0)
    return t


class _Loc(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def managed_store(layers: int):
    """The store in managed memory, preferred location the host, mapped for the GPU (accessed-by): UVM's own
    host pages, zero-copy reads."""
    cu = ctypes.CDLL("libcuda.so.1")
    nbytes = layers * HKV * N * 2 * D * 2
    addr = ctypes.c_ulonglong()
    if rc := cu.cuMemAllocManaged(ctypes.byref(addr), ctypes.c_size_t(nbytes), ctypes.c_uint(1)):
        raise RuntimeError(f"cuMemAllocManaged: {rc}")
    t = torch.frombuffer((ctypes.c_char * nbytes).from_address(addr.value), dtype=torch.bfloat16)
    t = t.view(layers, *LAYER_SHAPE)
    t.fill_(1.0)  # first touch on the CPU
    for advice, loc in ((3, _Loc(2, 0)), (5, _Loc(1, torch.cuda.current_device()))):
        if rc := cu.cuMemAdvise_v2(addr, ctypes.c_size_t(nbytes), ctypes.c_int(advice), loc):
            raise RuntimeError(f"cuMemAdvise {advice}: {rc}")
    return t


def split_ms(g_dense, g_side, compute, side, reps):
    """Both graphs at once on their streams -> (dense ms, side ms), medians."""
    d, s = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        side_ev, dense_ev = replay_timed(g_side, side), replay_timed(g_dense, compute)
        torch.cuda.synchronize()
        s.append(side_ev[0].elapsed_time(side_ev[1]))
        d.append(dense_ev[0].elapsed_time(dense_ev[1]))
    return round(statistics.median(d), 4), round(statistics.median(s), 4)


def anon_huge_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gather-blocks", default="12,24")
    ap.add_argument("--stores", default="small,pinned,vmm,thp")
    a = ap.parse_args()
    dev = torch.device("cuda")
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp_mode = f.read().strip()
    print("THP:", thp_mode, flush=True)
    dense = dense_gemvs(dev)
    sketch = quantize_sketch(torch.randn(1, HKV, N, D, device=dev), BITS, 64)
    q = torch.randn(1, 32, 1, D, device=dev, dtype=torch.bfloat16)
    end = torch.tensor(N, device=dev)
    carry = TopKCarry(HKV, K, dev)
    pos = torch.empty(1, HKV, K, dtype=torch.long, device=dev)
    rows = torch.empty(1, HKV, K, 2 * D, device=dev, dtype=torch.bfloat16)
    idx = [torch.randint(0, N, (1, HKV, K), device=dev) for _ in range(LAYERS)]
    compute, select, side = (torch.cuda.Stream(dev), torch.cuda.Stream(dev, priority=-5),
                             torch.cuda.Stream(dev, priority=-5))
    kernel_gather = host_gather_cuda.load(gather_rows.reference)  # the kernel itself: the dispatch rule wants
    # pinned or device tensors, and torch does not call managed memory pinned
    results, keep = {"env": environment(dev), "thp": thp_mode, "rows": []}, []
    for name in a.stores.split(","):
        before = anon_huge_kib()
        if name in ("small", "small-distinct"):
            one = torch.ones(LAYER_SHAPE, dtype=torch.bfloat16).pin_memory()
            store = [one] * LAYERS
            layer_idx = [idx[0]] * LAYERS if name == "small" else idx
        else:
            if name == "managed":
                big = managed_store(LAYERS)
            elif name == "vmm":
                info = {}
                big = vmm_store(LAYERS, info)
                print("vmm", info, flush=True)
            elif name.startswith("pinned"):
                big = torch.empty((LAYERS, *LAYER_SHAPE), dtype=torch.bfloat16, pin_memory=True)
                big.fill_(1.0)
            else:
                big = anon_store(LAYERS, name == "thp", keep)
            store, layer_idx = list(big), ([idx[0]] * LAYERS if name.endswith("-same") else idx)
        huge_gib = (anon_huge_kib() - before) / 2**20

        def gather(layer):
            kernel_gather(store[layer], layer_idx[layer], dev, out=rows)

        def sel(layer):
            topk_tokens(sketch_scores(q, *sketch, BITS, 64, end, 0, "lse", 0.088, carry=carry), K, 0, pos,
                        carry=carry)
            pos.copy_(layer_idx[layer])  # the gather reads this layer's rows (the sketch's picks are one tensor)

        def gat(layer):
            kernel_gather(store[layer], pos, dev, out=rows)

        for blocks in [int(b) for b in a.gather_blocks.split(",")]:
            host_gather_cuda.MAX_BLOCKS = blocks
            row = {"store": name, "anon_huge_gib": round(huge_gib, 2), "gather_blocks": blocks}
            for label, parts, chained in (("dense", (dense.layer, None, None), False),
                                          ("gather", (None, None, gather), False),
                                          ("dense | gather", (dense.layer, None, gather), False),
                                          ("chained", (dense.layer, sel, gat), True)):
                row[label] = replay_ms(step_graph(compute, select, side, *parts, chained), compute, a.reps)
            g_dense = step_graph(compute, select, side, dense.layer, None, None, False)
            g_side = step_graph(side, select, side, None, None, gather, False)
            row["split dense"], row["split gather"] = split_ms(g_dense, g_side, compute, side, a.reps)
            results["rows"].append(row)
            print(row, flush=True)
    os.makedirs(a.out, exist_ok=True)
    write_json(os.path.join(a.out, "host-pages.json"), results)
    labels = ["dense", "gather", "dense | gather", "chained", "split dense", "split gather"]
    print(f"{'store':7} {'hugeGiB':>7} {'blocks':>6} " + " ".join(f"{x:>15}" for x in labels))
    for r in results["rows"]:
        print(f"{r['store']:7} {r['anon_huge_gib']:7} {r['gather_blocks']:6} "
              + " ".join(f"{r[x]:15.3f}" for x in labels))


if __name__ == "__main__":
    main()

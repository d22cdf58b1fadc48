"""Run `tailorkv bench` with one engine knob patched, for A/B runs in one process per variant:
    PYTHONPATH=src python3 bench/ab_patch.py VARIANT bench ARGS...
Variants: none; carry-off (KeySketch.CARRY False: the top-K searches every row whole); reuse-on
(SketchSelector.REUSE_ROWS True: each layer's row cache, only the newly chosen rows read from host); no-sketch
(the sketch scores replaced by a fixed random tensor: an ablation for timing only, its picks are meaningless);
no-gather (the selected rows are not gathered: timing only); gather-blocks-N, gather-threads-N, gather-unroll-N
(the short-row gather's blocks, threads per block, reads in flight per thread); kt-gather-blocks-N (the K^T rows'
gather on N blocks of the loop kernel at either --kt-bits, ChannelSelector.KT_GATHER_BLOCKS; 0: one block per row);
gather-longthreads-N (that loop kernel's threads per block); refresh-threads-N,
refresh-unroll-N (the row cache kernel's block size and reads in flight per thread); sketch-grid-N (the sketch
kernel's grid ahead of its layer sized for N blocks per SM at any --predict-ahead, SketchSelector.AHEAD_BLOCKS_PER_SM;
0: the full wave); predict-after-qkv (the next layer's prediction queued
after the qkv projection); sketch-after-qkv (only its sketch, top-K and gather queued after it);
select-priority-0 (the select stream at normal priority); host-pinned (the sparse layers' host stores pinned,
not ops/host_memory.py's managed memory); hostcopy-dma (rows written into managed stores by the DMA, not the SMs);
hostcopy-blocks-N (the SMs' copy kernel's blocks); topk-short-N (rows of up to N keys take the top-K in one stage;
0: the split rule alone); embed-device (an untied embedding table kept on the
device, not in pinned host memory); several joined by "+". (Queries predicted N layers ahead: --predict-ahead N.)"""
from __future__ import annotations

import importlib
import sys

import torch

# variant prefix -> (the kernel's module in ops/, its constants by variant name), read when the kernel loads
KERNEL_KNOBS = {"gather": ("host_gather_cuda", {"blocks": "MAX_BLOCKS", "threads": "THREADS", "unroll": "UNROLL",
                                          "longthreads": "LONG_THREADS"}),
                "refresh": ("row_cache_cuda", {"threads": "THREADS", "unroll": "UNROLL"}),
                "hostcopy": ("host_copy", {"blocks": "BLOCKS"}),
                "topk": ("topk_cuda", {"short": "ONE_STAGE_MAX_N"})}


def patch(variants: str) -> None:
    for variant in variants.split("+"):
        patch_one(variant)


def patch_one(variant: str) -> None:
    from tailorkv.engine.policies import sketch
    if variant == "carry-off":
        sketch.KeySketch.CARRY = False
    elif variant == "no-sketch":
        held = {}

        def fixed(self, q, n, end, offset, rule):
            if n not in held:
                held[n] = torch.randn(q.shape[0], self.codes.shape[1], n, device=q.device)
            return held[n]
        sketch.KeySketch.scores = fixed
    elif variant == "predict-after-qkv":  # the next layer's prediction, and so all its selection work
        from tailorkv.engine.cache import ModelCache
        after_qkv(ModelCache, "layer_input")
    elif variant == "sketch-after-qkv":  # the prediction where it was, its sketch, top-K and gather after
        from tailorkv.engine.policies.sparse import SparseOffloadCache
        after_qkv(SparseOffloadCache, "predict_query")
    elif variant == "select-priority-0":
        from tailorkv.engine import scheduler
        init = scheduler.Scheduler.__init__

        def normal_select(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if self._select is not None:
                self._select = torch.cuda.Stream(self.device, priority=0)
        scheduler.Scheduler.__init__ = normal_select
    elif variant == "embed-device":
        from tailorkv.models import loader
        loader.HOST_EMBEDDINGS = False
    elif variant == "host-pinned":  # the host stores in pinned memory, not managed memory kept on the host
        from tailorkv.ops import host_memory
        host_memory.MANAGED = False
    elif variant == "hostcopy-dma":  # device rows into managed stores by the DMA engines, not the SMs' stores
        from tailorkv.ops import host_copy
        host_copy.SM_WRITES = False
    elif variant == "reuse-on":
        sketch.SketchSelector.REUSE_ROWS = True
    elif variant == "no-gather":
        sketch.SketchSelector._gather = lambda self, layer, pos: None
    elif variant.startswith("kt-gather-blocks-"):
        from tailorkv.engine.policies.selection import ChannelSelector
        blocks = int(variant.rsplit("-", 1)[1])
        ChannelSelector.KT_GATHER_BLOCKS = dict.fromkeys((1, 2, 4), blocks)
    elif variant.split("-")[0] in KERNEL_KNOBS:  # e.g. gather-blocks-12: a kernel module's constant
        kernel, knob, value = variant.split("-")
        module, names = KERNEL_KNOBS[kernel]
        setattr(importlib.import_module(f"tailorkv.ops.{module}"), names[knob], int(value))
    elif variant.startswith("sketch-grid-"):  # read when the layers are built
        blocks = float(variant.rsplit("-", 1)[1]) or None
        sketch.SketchSelector.AHEAD_BLOCKS_PER_SM = {1: blocks, 2: blocks}
    elif variant != "none":
        raise SystemExit(f"unknown variant {variant!r}")


def after_qkv(owner, name: str) -> None:
    """owner.name's calls held back until the layer's qkv projection has been queued, then made in order."""
    from tailorkv.models import llama
    held, original, project_qkv = [], getattr(owner, name), llama.Attention.project_qkv

    def deferred(*args):
        held.append(args)

    def qkv_then_held(self, x):
        out = project_qkv(self, x)
        for args in held:
            original(*args)
        held.clear()
        return out
    setattr(owner, name, deferred)
    llama.Attention.project_qkv = qkv_then_held


if __name__ == "__main__":
    patch(sys.argv[1])
    sys.argv = ["tailorkv"] + sys.argv[2:]
    from tailorkv.cli import main
    main()

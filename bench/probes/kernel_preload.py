"""Time ops.dispatch.preload on an empty CuPy cache (set CUPY_CACHE_DIR to a new folder before running):
    CUPY_CACHE_DIR=$(mktemp -d) python3 bench/probes/kernel_preload.py THREADS"""
import os
import sys
import time

import torch

from tailorkv.ops import dispatch

torch.zeros(1, device="cuda")
t0 = time.perf_counter()
n = dispatch.preload(threads=int(sys.argv[1]))
took = time.perf_counter() - t0
cached = len(os.listdir(os.environ["CUPY_CACHE_DIR"]))
print(f"threads {sys.argv[1]}: {n} kernels loaded in {took:.2f} s, {cached} modules in the cache, failed "
      f"{sorted(dispatch._FAILED)}")

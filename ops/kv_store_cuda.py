"""CUDA kernel for ops/kv_store.py: one launch writes the keys and values of a step (a few tokens) into their
slots; elements are copied as raw 2- or 4-byte words, so any dtype of that size works. Many tokens (a prompt)
go to the reference, whose copies are already bandwidth-bound."""
from __future__ import annotations

import numpy as np
import torch

from tailorkv.ops.cuda_launch import compile_module, launch, ptr, ptr_or_null

MAX_TOKENS = 64
_SOURCE = r"""
struct Strides { long long b, h, t; };   // of (batch, head, token); the last dim is contiguous
#define S3(x) const long long x##b, const long long x##h, const long long x##t
#define ST(x) Strides{x##b, x##h, x##t}

template <typename T>
__device__ __forceinline__ void store_kv(T* kd, T* vd, const T* k, const T* v, const long long* slots,
                                         const long long* tail, const long long sink,
                                         const Strides skd, const Strides svd, const Strides sk, const Strides sv,
                                         const int H, const int n, const int D, const long long total) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < 2 * total;
         i += (long long)gridDim.x * blockDim.x) {
        const bool is_v = i >= total;
        const long long e = is_v ? i - total : i;
        const int d = (int)(e % D);
        long long r = e / D;
        const int t = (int)(r % n); r /= n;
        const int h = (int)(r % H);
        const long long b = r / H;
        const Strides so = is_v ? svd : skd, si = is_v ? sv : sk;
        long long slot = slots[t];
        if (tail != nullptr && slot >= sink) slot += sink - *tail;   // a position past the sink: its tail slot
        (is_v ? vd : kd)[b * so.b + h * so.h + slot * so.t + d] = (is_v ? v : k)[b * si.b + h * si.h + t * si.t + d];
    }
}

#define STORE_KV(NAME, T) \
extern "C" __global__ void NAME(T* kd, T* vd, const T* k, const T* v, const long long* slots, \
                                const long long* tail, const long long sink, S3(skd), S3(svd), S3(sk), S3(sv), \
                                const int H, const int n, const int D, const long long total) { \
    store_kv(kd, vd, k, v, slots, tail, sink, ST(skd), ST(svd), ST(sk), ST(sv), H, n, D, total); }
STORE_KV(store_kv_16, unsigned short)
STORE_KV(store_kv_32, unsigned)
"""


def load(reference):
    mod = compile_module(_SOURCE)
    kernels = {2: mod.get_function("store_kv_16"), 4: mod.get_function("store_kv_32")}

    def store_kv(k_dst, v_dst, slots, k, v, tail=None, sink=0):
        B, H, n, D = k.shape
        ts = (k_dst, v_dst, k, v)
        ok = (k_dst.dim() == 4 and v_dst.shape == k_dst.shape and v.shape == k.shape and k_dst.shape[:2] == (B, H)
              and k_dst.shape[3] == D and 0 < n <= MAX_TOKENS and slots.shape == (n,) and slots.dtype == torch.long
              and all(t.is_cuda and t.device == k.device and t.dtype == k.dtype for t in ts)
              and slots.is_cuda and slots.device == k.device and k.element_size() in kernels
              and all(t.stride(3) == 1 for t in ts)
              and (tail is None or (tail.numel() == 1 and tail.dtype == torch.long and tail.device == k.device)))
        if not ok or B * H == 0:
            return reference(k_dst, v_dst, slots, k, v, tail, sink)
        strides = [np.int64(s) for t in ts for s in t.stride()[:3]]
        total = B * H * n * D
        launch(kernels[k.element_size()], (min(-(-2 * total // 256), 1024),), (256,),
               (ptr(k_dst), ptr(v_dst), ptr(k), ptr(v), ptr(slots), ptr_or_null(tail),
                np.int64(sink), *strides, np.int32(H), np.int32(n), np.int32(D), np.int64(total)), k.device)

    return store_kv

"""attend_decode (decode attention over a preallocated buffer with a device-side length): the torch reference
against a plain formula, and the flash-decoding kernel against the reference.

Inputs are random with a fresh seed per run (printed; set TAILORKV_SEED to replay one)."""
from __future__ import annotations

import math
import os
import random

import pytest
import torch

from tailorkv.ops import dispatch
from tailorkv.ops.attention import attend_decode

SEED = int(os.environ.get("TAILORKV_SEED", random.randrange(2**31)))
print(f"test_kernels_attention seed: TAILORKV_SEED={SEED}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any() and not torch.isnan(b).any(), "NaN in the result"
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def plain(q, k, v, lengths, sm_scale):
    """One batch row at a time over exactly its first `length` keys, GQA by repeating the KV heads."""
    B, Hq, _, D = q.shape
    G = Hq // k.shape[1]
    out = torch.zeros(B, Hq, 1, D, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        kb = k[b, :, :n].double().repeat_interleave(G, 0)
        vb = v[b, :, :n].double().repeat_interleave(G, 0)
        p = torch.softmax(q[b].double() @ kb.transpose(-1, -2) * sm_scale, -1)
        out[b] = p @ vb
    return out


def buffers(g, B, Hq, Hkv, N, D, lengths, dtype, device="cpu"):
    """q, and K/V buffers of N slots whose slots past each row's length hold NaN (they must never be read)."""
    q = torch.randn(B, Hq, 1, D, generator=g).to(device, dtype)
    k = (torch.randn(B, Hkv, N, D, generator=g) * 2).to(device, dtype)
    v = torch.randn(B, Hkv, N, D, generator=g).to(device, dtype)
    for b, n in enumerate(lengths):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    return q, k, v


@pytest.mark.parametrize("B,Hq,Hkv,N,D,lengths", [
    (1, 8, 2, 50, 16, [37]), (3, 9, 3, 40, 8, [40, 0, 13]), (2, 4, 4, 30, 8, [30, 30]), (2, 6, 1, 20, 4, [25, 1]),
])
def test_attend_decode_reference_equals_plain_formula(B, Hq, Hkv, N, D, lengths):
    g = torch.Generator().manual_seed(SEED + N + Hq)
    q, k, v = buffers(g, B, Hq, Hkv, N, D, [min(n, N) for n in lengths], torch.float32)
    length = torch.tensor(lengths) if len(set(lengths)) > 1 else torch.tensor(lengths[0])
    got = attend_decode(q, k, v, length, sm_scale=0.3)
    assert got.shape == q.shape and got.dtype == q.dtype
    want = plain(q, k, v, [min(n, N) for n in lengths], 0.3)
    assert torch.equal(got[torch.tensor(lengths) == 0], torch.zeros_like(got[torch.tensor(lengths) == 0]))
    assert rel_err(got, want) < 1e-5
    default = attend_decode(q, k, v, length)
    assert rel_err(default, plain(q, k, v, [min(n, N) for n in lengths], 1 / math.sqrt(D))) < 1e-5


CASES = [  # (B, Hq, Hkv, N, D, lengths, dtype)
    (1, 32, 8, 131072, 128, [131072], torch.bfloat16), (1, 32, 8, 131072, 128, [9000], torch.bfloat16),
    (2, 32, 8, 5000, 128, [4999, 1], torch.float16), (1, 9, 3, 1000, 64, [777], torch.bfloat16),
    (3, 4, 4, 300, 64, [0, 300, 65], torch.float16), (1, 16, 1, 2048, 128, [2048], torch.bfloat16),
    (2, 24, 8, 700, 128, [700, 700], torch.bfloat16), (1, 8, 8, 64, 128, [64], torch.float16),
]


@pytest.mark.cuda
@pytest.mark.parametrize("B,Hq,Hkv,N,D,lengths,dtype", CASES)
def test_attend_decode_kernel_equals_reference(B, Hq, Hkv, N, D, lengths, dtype):
    g = torch.Generator().manual_seed(SEED + N + Hq + len(lengths))
    q, k, v = buffers(g, B, Hq, Hkv, N, D, lengths, dtype, "cuda")
    length = (torch.tensor(lengths) if len(set(lengths)) > 1 else torch.tensor(lengths[0])).cuda()
    kernel = dispatch.kernel_for("attend_decode", q, k, v, length)
    assert kernel is not None, "the attend_decode kernel did not load (CuPy missing?)"
    torch.full((B * Hq * D,), float("nan"), dtype=dtype, device="cuda")  # poison the block the output reuses
    got = kernel(q, k, v, length)
    assert got.shape == q.shape and got.dtype == dtype
    want = attend_decode.reference(q, k, v, length)
    assert rel_err(got, want) < (1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert rel_err(got, plain(q, k, v, lengths, 1 / math.sqrt(D)).to(dtype)) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.cuda
def test_attend_decode_kernel_follows_the_device_length_in_a_graph():
    g = torch.Generator().manual_seed(SEED + 5)
    N = 4096
    q, k, v = buffers(g, 1, 32, 8, N, 128, [N], torch.bfloat16, "cuda")
    length = torch.tensor(100, device="cuda")
    attend_decode(q, k, v, length)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend_decode(q, k, v, length)
    for n in (100, 1, 2500, N):
        length.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        want = attend_decode.reference(q, k, v, length)
        assert rel_err(out, want) < 1e-2, n

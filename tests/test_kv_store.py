"""store_kv: a step's keys and values written into their cache slots in one op; the kernel equals the reference
bit for bit (it only copies), on views of a fused qkv buffer, leaving every other slot untouched."""
from __future__ import annotations

import pytest
import torch

from tailorkv.ops import dispatch
from tailorkv.ops.kv_store import store_kv
from helpers import SEED


def case(B, H, N, n, D, dtype, device, g):
    """Caches filled with sentinels, k and v as head views of one [B, n, (Hq + 2H) * D] projection."""
    k_dst = torch.full((B, H, N, D), -7.0, dtype=dtype, device=device)
    v_dst = torch.full((B, H, N, D), 5.0, dtype=dtype, device=device)
    qkv = torch.randn(B, n, (2 * H + 2 * H) * D, generator=g).to(dtype).to(device)
    k = qkv[..., 2 * H * D:3 * H * D].view(B, n, H, D).transpose(1, 2)
    v = qkv[..., 3 * H * D:].view(B, n, H, D).transpose(1, 2)
    slots = torch.randperm(N, generator=g)[:n].to(device)
    return k_dst, v_dst, slots, k, v


def test_reference_writes_the_slots_only():
    g = torch.Generator().manual_seed(SEED)
    k_dst, v_dst, slots, k, v = case(2, 3, 40, 5, 16, torch.float32, "cpu", g)
    store_kv(k_dst, v_dst, slots, k, v)
    assert torch.equal(k_dst[:, :, slots], k) and torch.equal(v_dst[:, :, slots], v)
    rest = torch.ones(40, dtype=torch.bool)
    rest[slots] = False
    assert bool((k_dst[:, :, rest] == -7.0).all()) and bool((v_dst[:, :, rest] == 5.0).all())


@pytest.mark.cuda
@pytest.mark.parametrize("B, H, N, n, D, dtype", [
    (1, 8, 4096, 1, 128, torch.bfloat16), (2, 3, 300, 4, 64, torch.float16), (1, 2, 100, 64, 64, torch.float32),
    (1, 4, 500, 100, 128, torch.bfloat16),   # more tokens than the kernel takes: the reference
])
def test_kernel_equals_reference(B, H, N, n, D, dtype):
    g = torch.Generator().manual_seed(SEED + n)
    got = case(B, H, N, n, D, dtype, "cuda", g)
    want = [t.clone() for t in got]
    assert dispatch.kernel_for("store_kv", *got) is not None
    store_kv(*got)
    store_kv.reference(*want)
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.cuda
def test_kernel_in_a_graph_follows_the_slot_tensor():
    g = torch.Generator().manual_seed(SEED + 1)
    k_dst, v_dst, slots, k, v = case(1, 8, 256, 1, 128, torch.bfloat16, "cuda", g)
    store_kv(k_dst, v_dst, slots, k, v)  # load the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv(k_dst, v_dst, slots, k, v)
    for s in (3, 200, 255):
        slots.fill_(s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(k_dst[:, :, s], k[:, :, 0]) and torch.equal(v_dst[:, :, s], v[:, :, 0])


def test_reference_maps_positions_to_sink_and_tail_slots():
    """With a tail start, position p < sink goes to slot p and p >= sink to slot sink + p - tail."""
    g = torch.Generator().manual_seed(SEED + 2)
    k_dst, v_dst, _, k, v = case(1, 2, 32, 3, 8, torch.float32, "cpu", g)
    pos, tail = torch.tensor([2, 150, 151]), torch.tensor(140)
    store_kv(k_dst, v_dst, pos, k, v, tail, 8)
    for i, slot in enumerate([2, 18, 19]):
        assert torch.equal(k_dst[:, :, slot], k[:, :, i]) and torch.equal(v_dst[:, :, slot], v[:, :, i])
    assert int((k_dst[0, 0, :, 0] != -7.0).sum()) == 3


@pytest.mark.cuda
def test_kernel_maps_positions_like_the_reference():
    g = torch.Generator().manual_seed(SEED + 3)
    got = list(case(1, 8, 200, 2, 128, torch.bfloat16, "cuda", g))
    got[2] = torch.tensor([5, 1000], device="cuda")
    tail = torch.tensor(900, device="cuda")
    want = [t.clone() for t in got]
    store_kv(*got, tail, 64)
    store_kv.reference(*want, tail, 64)
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][:, :, 164], got[3][:, :, 1])

"""refresh_rows (ops/row_cache.py): a device cache of host rows kept current for each new selection. The torch
reference on the CPU; the CUDA kernel against it (same slots, same rows), marked cuda."""
import collections
import zlib

import pytest
import torch

from tailorkv.ops import dispatch
from tailorkv.ops.row_cache import refresh_rows

cuda = pytest.mark.cuda


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def selections(gen, rows, n, k, steps, keep):
    """Random selections of k distinct positions in [0, n) per row, each keeping about `keep` of the last."""
    cur = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(rows)])
    out = [cur.clone()]
    for _ in range(steps - 1):
        nxt = []
        for r in range(rows):
            stay = cur[r][torch.randperm(k, generator=gen)[:int(keep * k)]]
            pool = torch.ones(n, dtype=torch.bool)
            pool[stay] = False
            fresh = torch.nonzero(pool).flatten()
            fresh = fresh[torch.randperm(len(fresh), generator=gen)[:k - len(stay)]]
            nxt.append(torch.cat([stay, fresh])[torch.randperm(k, generator=gen)])
        cur = torch.stack(nxt)
        out.append(cur.clone())
    return out


def check_state(host, pos, slots, rows, before):
    """slots holds exactly pos' positions, rows their host rows, and a slot whose position stayed chosen kept it."""
    pos, slots, rows, before = pos.cpu(), slots.cpu(), rows.cpu(), before.cpu()
    assert torch.equal(slots.sort(-1).values, pos.sort(-1).values)
    assert torch.equal(rows, host.cpu().gather(2, slots[..., None].expand(-1, -1, -1, host.shape[-1])))
    for r in range(pos.shape[0] * pos.shape[1]):
        stayed = torch.isin(before.flatten(0, 1)[r], pos.flatten(0, 1)[r])
        assert torch.equal(slots.flatten(0, 1)[r][stayed], before.flatten(0, 1)[r][stayed])


def test_the_reference_keeps_rows_chosen_again_and_fetches_the_rest(gen):
    B, H, N, X, K, lo = 1, 1, 300, 8, 40, 10
    host = torch.randn(B, H, N, X, generator=gen)
    slots = torch.full((B, H, K), -1, dtype=torch.long)
    rows = torch.zeros(B, H, K, X)
    counts = torch.zeros(2, dtype=torch.long)
    fetched = 0
    for pos in selections(gen, B * H, N - lo - 50, K, 12, 0.7):
        pos = pos.reshape(B, H, K) + lo
        before = slots.clone()
        refresh_rows.reference(host, pos, slots, rows, lo, N - lo - 50, counts)
        check_state(host, pos, slots, rows, before)
        fetched += K - int(torch.isin(before, pos).sum())
        # the new positions, ascending, went to the freed slots, ascending
        freed = ~torch.isin(before, pos)
        assert torch.equal(slots[freed], pos[~torch.isin(pos, before)].sort().values)
    assert counts.tolist() == [fetched, 12 * K]


def test_the_reference_fills_empty_slots_and_those_of_positions_not_chosen(gen):
    """-1 and positions outside [lo, lo + n) or not chosen free their slots; the rest stay where they are."""
    host = torch.randn(1, 2, 100, 4, generator=gen)
    pos = torch.tensor([[[7, 5, 6], [9, 8, 10]]])
    slots = torch.tensor([[[5, -1, 99], [10, 3, 8]]])
    rows = torch.zeros(1, 2, 3, 4)
    refresh_rows.reference(host, pos, slots, rows, 5, 7)
    assert slots.tolist() == [[[5, 6, 7], [10, 9, 8]]]
    check_state(host, pos, slots, rows, slots)


def _on_gpu(gen, B, H, N, X, K, lo, n, steps, keep, dtype=torch.bfloat16):
    from tailorkv.ops.dispatch import kernel_for
    host = torch.randn(B, H, N, X, generator=gen).to(dtype).pin_memory()
    assert kernel_for("refresh_rows", host, torch.zeros(1, device="cuda")) is not None, "the kernel did not load"
    state = {}
    for name in ("kernel", "reference"):
        state[name] = (torch.full((B, H, K), -1, dtype=torch.long, device="cuda"),
                       torch.zeros(B, H, K, X, dtype=dtype, device="cuda"),
                       torch.zeros(2, dtype=torch.long, device="cuda"))
    for pos in selections(gen, B * H, n, K, steps, keep):
        pos = (pos.reshape(B, H, K) + lo).cuda()
        before = state["kernel"][0].clone()
        refresh_rows(host, pos, *state["kernel"][:2], lo, n, state["kernel"][2])
        refresh_rows.reference(host, pos, *state["reference"][:2], lo, n, state["reference"][2])
        torch.cuda.synchronize()
        for a, b in zip(state["kernel"], state["reference"]):
            assert torch.equal(a, b)
        check_state(host, pos, *state["kernel"][:2], before)
    return state


@cuda
@pytest.mark.parametrize("B,H,K,n,keep", [(1, 8, 1024, 131072, 0.8), (2, 3, 100, 5000, 0.5), (1, 2, 1500, 1500, 0.9),
                                          (1, 1, 64, 600_000, 0.0), (1, 4, 1024, 4096, 1.0)])
def test_the_kernel_equals_the_reference(gen, B, H, K, n, keep):
    """Same slots, rows and counts as the reference step after step: 8 heads x 1024 of 128k; batch 2 with a
    K that is no multiple of the block; every position of the range chosen; a bitmap past 48 KiB of shared
    memory; nothing kept; everything kept."""
    lo = 7
    state = _on_gpu(gen, B, H, lo + n + 3, 256, K, lo, n, 4, keep)
    assert state["kernel"][2][1] == 4 * B * H * K


@cuda
def test_the_kernel_replays_from_a_cuda_graph(gen):
    B, H, N, X, K, lo, n = 1, 8, 20000, 256, 512, 4, 19000
    host = torch.randn(B, H, N, X, generator=gen).bfloat16().pin_memory()
    slots = torch.full((B, H, K), -1, dtype=torch.long, device="cuda")
    rows = torch.zeros(B, H, K, X, dtype=torch.bfloat16, device="cuda")
    pos = torch.empty(B, H, K, dtype=torch.long, device="cuda")
    sel = selections(gen, B * H, n, K, 5, 0.75)
    pos.copy_(sel[0].reshape(B, H, K) + lo)
    refresh_rows(host, pos, slots, rows, lo, n)   # loads the kernel outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        refresh_rows(host, pos, slots, rows, lo, n)
    for s in sel[1:]:
        pos.copy_(s.reshape(B, H, K) + lo)
        before = slots.clone()
        g.replay()
        torch.cuda.synchronize()
        check_state(host, pos, slots, rows, before)


def test_the_kernels_copy_with_the_widest_word_that_divides_the_rows_strides_and_start():
    """host_gather_cuda.widest_word, the copy width of the gather and refresh kernels (CPU allocations are 64-byte
    aligned): a 3,000-byte stride and a 2,984-byte row from byte 16 allow 8 bytes; a start at byte 3 only 1."""
    from tailorkv.ops.host_gather_cuda import widest_word
    store8 = torch.empty(1, 8, 128, 3000, dtype=torch.uint8)
    store16 = torch.empty(1, 8, 128, 4096, dtype=torch.bfloat16)
    assert widest_word(store8[..., 16:3000]) == 8 and widest_word(store8[..., 3:2998]) == 1
    assert widest_word(store16[..., 64:2112]) == 16 and widest_word(store16[..., 1:2049]) == 2


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("N,lo,n", [(40000, 64, 32768), (3000, 16, 2984), (3001, 3, 2995)])
def test_the_kernel_keeps_k_transposed_channel_rows(gen, dtype, N, lo, n, monkeypatch):
    """The paper path's K^T row cache (--kt-cache): rows are 12 of 128 channels per KV head over a
    bucket of the middle (a slice of each row), positions are channels (lo 0, n 128); 16- and 8-bit stores whose
    row length, stride and start allow 16-byte words down to single bytes; the kernel takes each (no reference)."""
    monkeypatch.setattr(dispatch, "FALLBACKS", collections.Counter())
    B, H, D, r = 1, 8, 128, 12
    raw = lambda t: t.view(torch.int16 if t.element_size() == 2 else torch.uint8)  # noqa: E731  (e4m3: no equal)
    store = torch.randn(B, H, D, N, generator=gen).to(dtype).pin_memory()
    host = store[:, :, :, lo:lo + n]
    state = {name: [torch.full((B, H, r), -1, dtype=torch.long, device="cuda"),
                    torch.zeros(B, H, r, n, device="cuda").to(dtype), torch.zeros(2, dtype=torch.long, device="cuda")]
             for name in ("kernel", "reference")}
    for pos in selections(gen, B * H, D, r, 6, 0.75):
        pos = pos.reshape(B, H, r).cuda()
        refresh_rows(host, pos, *state["kernel"][:2], 0, D, state["kernel"][2])
        refresh_rows.reference(host, pos, *state["reference"][:2], 0, D, state["reference"][2])
        torch.cuda.synchronize()
        (slots, rows, counts), (slots_ref, rows_ref, counts_ref) = state["kernel"], state["reference"]
        assert torch.equal(slots, slots_ref) and torch.equal(counts, counts_ref)
        assert torch.equal(raw(rows), raw(rows_ref))
        want = raw(host).gather(2, slots.cpu()[..., None].expand(-1, -1, -1, n))
        assert torch.equal(raw(rows).cpu(), want)
    assert 0 < state["kernel"][2][0] < state["kernel"][2][1] == 6 * B * H * r
    assert dispatch.FALLBACKS["refresh_rows"] == 0

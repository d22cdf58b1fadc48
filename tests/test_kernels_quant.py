"""The fused 1/2-bit decode kernels (qk_quant, av_quant) against their torch references and a plain formula.

Inputs are random with a fresh seed per run (shown beside a failure; set TAILORKV_SEED to replay one)."""
from __future__ import annotations

import math

import pytest
import torch

from tailorkv.ops import dispatch
from tailorkv.ops.quant import dequantize_sketch, quantize_values, unpack
from helpers import SEED, random_keys, rel_err
from tailorkv.ops.quant_attention import av_quant, qk_quant, quant_decode_attention


def poison_allocator(nbytes: int) -> None:
    """Fill a block of the caching allocator with NaN and free it: the kernel's next output of that size reuses
    it, so an element the kernel forgets to write stays NaN."""
    torch.full((max(1, nbytes // 4),), float("nan"), device="cuda")


def plain_keys(codes, scale, mn, bits, group=64):
    """Dequantized keys [B, H, T, D] fp32 for any T that is a multiple of 32 / bits (a partial last group)."""
    c = unpack(codes, bits, dim=2).float()
    T = c.shape[2]
    return c * scale.float().repeat_interleave(group, 2)[:, :, :T] + mn.float().repeat_interleave(group, 2)[:, :, :T]


def plain_values(codes, scale, mn, bits, group):
    c = unpack(codes, bits, dim=3).float()
    return c * scale.float().repeat_interleave(group, 3) + mn.float().repeat_interleave(group, 3)


QK_CASES = [  # (bits, B, Hq, Hkv, T, D, q dtype)
    (1, 1, 32, 8, 4096, 128, torch.bfloat16), (2, 1, 32, 8, 4096, 128, torch.bfloat16),
    (1, 2, 9, 3, 320, 64, torch.float16), (2, 2, 9, 3, 320, 64, torch.float32),
    (1, 1, 4, 4, 96, 128, torch.float32), (2, 1, 8, 2, 48, 128, torch.float16),
    (1, 1, 28, 1, 64, 64, torch.bfloat16), (1, 2, 32, 8, 0, 128, torch.bfloat16),
    (4, 1, 32, 8, 4096, 128, torch.bfloat16), (4, 2, 9, 3, 320, 64, torch.float32),
    (4, 1, 8, 2, 48, 128, torch.float16), (4, 1, 28, 1, 136, 64, torch.bfloat16),
]


@pytest.mark.cuda
@pytest.mark.parametrize("bits,B,hq,hkv,T,D,dtype", QK_CASES)
def test_qk_quant_kernel_equals_reference(bits, B, hq, hkv, T, D, dtype):
    g = torch.Generator().manual_seed(SEED + T + hq + bits)
    kc, ks, km = random_keys(g, B, hkv, T, D, bits, "cuda")
    q = (torch.randn(B, hq, 1, D, generator=g) * 3).to("cuda", dtype)
    kernel = dispatch.kernel_for("qk_quant", q, kc, ks, km)
    assert kernel is not None, "the qk_quant kernel did not load (CuPy missing?)"
    sm = 1 / math.sqrt(D)
    poison_allocator(B * hq * T * 4)
    got = kernel(q, kc, ks, km, bits, 64, sm)
    assert got.shape == (B, hq, 1, T) and got.dtype == torch.float32
    if T == 0:
        return
    K = plain_keys(kc, ks, km, bits).repeat_interleave(hq // hkv, 1)
    want = (q.float() * sm) @ K.transpose(-1, -2)
    assert rel_err(got, want) < 1e-5
    if T % 64 == 0:
        assert rel_err(got, qk_quant.reference(q, kc, ks, km, bits, 64, sm)) < 1e-5


@pytest.mark.cuda
def test_qk_quant_kernel_reads_views_of_a_larger_buffer():
    g = torch.Generator().manual_seed(SEED + 7)
    kc, ks, km = random_keys(g, 1, 8, 1024, 128, 1, "cuda")
    q = torch.randn(1, 32, 1, 128, generator=g).to("cuda", torch.bfloat16)
    got = qk_quant(q, kc[:, :, :20], ks[:, :, :10], km[:, :, :10], 1, 64, 0.1)  # the policy's sliced views
    want = qk_quant.reference(q, kc[:, :, :20], ks[:, :, :10], km[:, :, :10], 1, 64, 0.1)
    assert rel_err(got, want) < 1e-5


SKETCH_CASES = [  # (bits, B, Hq, Hkv, T, D, q dtype, rule)
    (2, 1, 32, 8, 4096, 128, torch.bfloat16, "lse"), (1, 1, 32, 8, 4096, 128, torch.bfloat16, "sum"),
    (4, 1, 32, 8, 2048, 128, torch.bfloat16, "lse"), (2, 2, 9, 3, 333, 64, torch.float32, "lse"),
    (1, 1, 7, 1, 200, 64, torch.bfloat16, "lse"), (4, 2, 9, 3, 256, 64, torch.float16, "sum"),
    (2, 1, 8, 1, 130, 128, torch.float16, "lse"), (4, 1, 4, 4, 70, 128, torch.bfloat16, "sum"),
]


def sketch_mirror(q, kc, ks, km, bits, end, offset, rule, sm):
    """The kernel's arithmetic in float64: w = fp16(q 2^e) * fp16(scale 2^p) rounded to fp16 (e per KV head from
    max |q|, p per group from its largest scale), the codes and mins exact."""
    B, Hq, _, D = q.shape
    Hkv, N = kc.shape[1], kc.shape[2]
    qf = q.float().reshape(B, Hkv, Hq // Hkv, D)
    amax = qf.abs().amax((2, 3), keepdim=True)
    e = torch.where(amax > 0, 14 - torch.floor(torch.log2(amax)), torch.zeros_like(amax))
    q16 = (qf * torch.exp2(e)).half().double()
    ms = ks.float().amax(-1, keepdim=True)
    p = torch.where(ms > 0, (-1 - torch.floor(torch.log2(ms))).clamp(max=15), torch.zeros_like(ms))
    s16 = (ks.float() * torch.exp2(p)).half().float()
    w = (q16.float()[:, :, :, None] * s16[:, :, None]).half().double()                # [B, Hkv, G, groups, D]
    w = w / torch.exp2(e[..., None] + p[:, :, None]).double()
    grp = torch.arange(N, device=q.device) // 64
    codes = dequantize_sketch(kc, torch.ones_like(ks), torch.zeros_like(km), bits, 64).double()
    main = (w[:, :, :, grp] * codes[:, :, None]).sum(-1)
    bias = (q16 / torch.exp2(e).double()) @ km.double().transpose(-1, -2)              # [B, Hkv, G, groups]
    logits = sm * (main + bias[..., grp])
    n = torch.arange(N, device=q.device) + offset
    logits = logits.masked_fill(n >= end, float("-inf"))
    return torch.logsumexp(logits, 2) if rule == "lse" else logits.sum(2)


def sketch_rounding_bound(q, kc, ks, km, bits, end, offset, rule, sm):
    """How far the kernel's scores may lie from the exact ones by its roundings alone, per KV head and token: each
    weight q * scale rounded to fp16 (2^-11 relative), and an fp32 q first to fp16 (2^-11 more, on the min term
    too); per head sm * sum_d |q s c| (+ |q min|), summed over the group's heads for rule sum, their largest for
    lse (1-Lipschitz in the largest change), with 1% slack for the fp32 accumulation."""
    B, Hq, _, D = q.shape
    Hkv, N = kc.shape[1], kc.shape[2]
    qa = q.double().abs().reshape(B, Hkv, Hq // Hkv, D)
    grp = torch.arange(N, device=q.device) // 64
    codes = dequantize_sketch(kc, torch.ones_like(ks), torch.zeros_like(km), bits, 64).double()   # [B, Hkv, N, D]
    sc = ks.double()[:, :, grp] * codes                                                          # |scale * code|
    per_head = qa @ sc.transpose(-1, -2)                                                         # [B, Hkv, G, N]
    if q.dtype == torch.float32:
        per_head = 2 * per_head + qa @ km.double().abs()[:, :, grp].transpose(-1, -2)
    err = 1.01 * 2.0 ** -11 * sm * per_head
    return err.sum(2) if rule == "sum" else err.amax(2)


@pytest.mark.cuda
@pytest.mark.parametrize("bits,B,hq,hkv,T,D,dtype,rule", SKETCH_CASES)
def test_sketch_scores_kernel_equals_reference(bits, B, hq, hkv, T, D, dtype, rule):
    """The kernel (the group's heads combined, masked from `end` on) on views of a larger sketch as the policy
    passes them: within fp32 rounding of the same arithmetic in float64 (its one rounding, the per-channel
    weight q * scale in fp16), and every score within that rounding's bound of the exact torch reference (a
    norm-relative 1e-3 failed on 0.2-2% of random inputs of the small cases, where the few scores cancel).
    The fp32 part: the MMA's A carries each code on an fp16 offset of up to 2^6 that the seed takes off, so the
    accumulators hold sums up to ~65x the score's terms; over 600 random inputs per case on the H200 the
    norm-relative distance to the mirror reached 1.75e-5 (1 bit, rule sum; bench/probes/sketch_mirror_errors.py,
    bench/results/2026-12-01-h200-nineteenth-session)."""
    from tailorkv.ops.sparse_select import sketch_scores
    g = torch.Generator().manual_seed(SEED + T + hq + bits + 11)
    kc, ks, km = random_keys(g, B, hkv, T + 256, D, bits, "cuda", sketch=True)
    q = (torch.randn(B, hq, 1, D, generator=g) * 3).to("cuda", dtype)
    kernel = dispatch.kernel_for("sketch_scores", q, kc, ks, km)
    assert kernel is not None, "the sketch_scores kernel did not load (CuPy missing?)"
    offset, sm = 5, 1 / math.sqrt(D)
    for end in (offset + T - 37, offset + T, offset + 3, 0):
        e = torch.tensor(end, device="cuda")
        args = (q, kc[:, :, :T], ks[:, :, :-(-T // 64)], km[:, :, :-(-T // 64)], bits, 64, e, offset, rule, sm)
        poison_allocator(B * hkv * T * 4)
        got = kernel(*args)
        want = sketch_scores.reference(*args)
        assert got.shape == want.shape == (B, hkv, T)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), f"mask differs at end {end}"
        fin = torch.isfinite(want)
        if fin.any():
            bound = sketch_rounding_bound(*args[:4], bits, end, offset, rule, sm)
            assert ((got.double() - want.double()).abs() <= bound)[fin].all(), "beyond the fp16 weights' rounding"
            assert rel_err(got[fin], sketch_mirror(*args[:4], bits, end, offset, rule, sm)[fin]) < 4e-5
        for grid in (1, 0.5):  # sketch-ahead's narrower grids: each group scored the same way, the same scores
            assert torch.equal(kernel(*args, None, grid), got)


AV_CASES = [  # (bits, B, Hq, Hkv, T, D, probs dtype)
    (1, 1, 32, 8, 4096, 128, torch.float32), (2, 1, 32, 8, 4096, 128, torch.float32),
    (1, 2, 9, 3, 201, 64, torch.float32), (2, 2, 9, 3, 17, 64, torch.bfloat16),
    (1, 1, 16, 2, 1000, 128, torch.float32), (2, 1, 16, 1, 333, 64, torch.float32),
    (1, 1, 4, 4, 1, 128, torch.float32), (1, 2, 32, 8, 0, 128, torch.float32),
]


@pytest.mark.cuda
@pytest.mark.parametrize("bits,B,hq,hkv,T,D,dtype", AV_CASES)
def test_av_quant_kernel_equals_reference(bits, B, hq, hkv, T, D, dtype):
    g = torch.Generator().manual_seed(SEED + T + hq + bits + 1)
    group = min(64, D)
    v = torch.randn(B, hkv, T, D, generator=g) * torch.exp(torch.randn(D, generator=g) * 0.5)
    vc, vs, vm = (t.cuda() for t in quantize_values(v, bits, group))
    probs = torch.softmax(torch.randn(B, hq, 1, T, generator=g) * 4, -1).to("cuda", dtype)
    kernel = dispatch.kernel_for("av_quant", probs, vc, vs, vm)
    assert kernel is not None, "the av_quant kernel did not load (CuPy missing?)"
    poison_allocator(B * hq * D * 4)
    got = kernel(probs, vc, vs, vm, bits, group)
    assert got.shape == (B, hq, 1, D) and got.dtype == torch.float32
    if T == 0:
        assert torch.equal(got, torch.zeros_like(got))
        return
    V = plain_values(vc, vs, vm, bits, group).repeat_interleave(hq // hkv, 1)
    assert rel_err(got, probs.float() @ V) < 1e-5
    assert rel_err(got, av_quant.reference(probs, vc, vs, vm, bits, group)) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("bits,D,hq,hkv", [(1, 64, 9, 3), (2, 128, 32, 8), (1, 128, 8, 8)])
def test_av_quant_kernel_reads_views_of_an_odd_sized_buffer(bits, D, hq, hkv):
    """The policy's buffers hold max_len - 128 value tokens, often odd: heads are then only 2-, 4- or 8-byte
    aligned, and the kernel stages them in smaller units."""
    g = torch.Generator().manual_seed(SEED + 13 + D)
    group = min(64, D)
    vc, vs, vm = (t.cuda() for t in quantize_values(torch.randn(1, hkv, 1001, D, generator=g), bits, group))
    n = 555
    views = vc[:, :, :n], vs[:, :, :n], vm[:, :, :n]
    probs = torch.softmax(torch.randn(1, hq, 1, n, generator=g) * 3, -1).cuda()
    assert dispatch.kernel_for("av_quant", probs, *views) is not None
    got = av_quant(probs, *views, bits, group)
    assert rel_err(got, av_quant.reference(probs, *views, bits, group)) < 1e-5


@pytest.mark.cuda
def test_av_quant_kernel_is_deterministic_and_captured_in_a_graph():
    g = torch.Generator().manual_seed(SEED + 11)
    vc, vs, vm = (t.cuda() for t in quantize_values(torch.randn(1, 8, 5000, 128, generator=g), 1, 64))
    probs = torch.softmax(torch.randn(1, 32, 1, 5000, generator=g), -1).cuda()
    first = av_quant(probs, vc, vs, vm, 1, 64)
    assert torch.equal(first, av_quant(probs, vc, vs, vm, 1, 64))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = av_quant(probs, vc, vs, vm, 1, 64)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, first)


def decode_inputs(g, bits, B, hq, hkv, T, D, R, qdtype, vdtype, device):
    """A quantized layer's decode state: T key positions (whole groups), values quantized for T + R rows, a ring
    of R + 1 exact rows."""
    kc, ks, km = random_keys(g, B, hkv, T, D, bits, "cpu")
    vg = min(64, D)
    vc, vs, vm = quantize_values(torch.randn(B, hkv, T + R, D, generator=g) * 2, bits, vg)
    ring = torch.randn(B, hkv, R + 1, D, generator=g).to(vdtype)
    q = (torch.randn(B, hq, 1, D, generator=g) * 3).to(qdtype)
    return [t.to(device) for t in (q, kc, ks, km, vc, vs, vm, ring)]


def plain_decode(q, kc, ks, km, vc, vs, vm, ring, nk, p, bits, sm):
    """The formula: softmax over positions [0, nk) of q . dequantized K; a position's value is dequantized
    before p - R, the ring's slot position % (R + 1) from there on."""
    B, hq, _, D = q.shape
    hkv, R1 = kc.shape[1], ring.shape[2]
    keys = plain_keys(kc, ks, km, bits)[:, :, :nk].double()
    vals = plain_values(vc, vs, vm, bits, min(64, D))[:, :, :nk].double()
    vq = max(0, p - (R1 - 1))
    for t in range(vq, nk):
        vals[:, :, t] = ring[:, :, t % R1].double()
    qg = q.double().reshape(B, hkv, hq // hkv, D)
    s = qg @ keys.transpose(-1, -2) * sm
    lse = torch.logsumexp(s, -1) if nk else torch.full(s.shape[:-1], float("-inf"), dtype=torch.float64)
    o = torch.softmax(s, -1) @ vals if nk else torch.zeros(B, hkv, hq // hkv, D, dtype=torch.float64)
    return o.reshape(B, hq, 1, D), lse.reshape(B, hq, 1)


DECODE_CASES = [  # (bits, B, Hq, Hkv, T, D, R, nk, p)
    (1, 1, 32, 8, 1024, 128, 128, 1024, 1100), (2, 1, 8, 2, 512, 64, 64, 320, 350),
    (1, 2, 9, 3, 256, 64, 64, 0, 40), (2, 1, 4, 4, 384, 128, 128, 256, 300), (1, 1, 4, 1, 128, 128, 128, 64, 100),
]


@pytest.mark.parametrize("bits, B, hq, hkv, T, D, R, nk, p", DECODE_CASES)
def test_quant_decode_reference_equals_formula(bits, B, hq, hkv, T, D, R, nk, p):
    g = torch.Generator().manual_seed(SEED + 20)
    args = decode_inputs(g, bits, B, hq, hkv, T, D, R, torch.float32, torch.float32, "cpu")
    sm = 1 / math.sqrt(D)
    o, lse = quant_decode_attention.reference(*args, torch.tensor(nk), torch.tensor([p]), bits, 64, min(64, D), sm)
    o_ref, lse_ref = plain_decode(*args, nk, p, bits, sm)
    assert rel_err(o, o_ref) < 1e-5 if nk else torch.equal(o, torch.zeros_like(o))
    assert torch.allclose(lse.double(), lse_ref, atol=1e-5) if nk else bool((lse == float("-inf")).all())


KERNEL_DECODE_CASES = [  # (bits, B, Hq, Hkv, T, D, R, nk, p, q dtype, ring dtype)
    (1, 1, 32, 8, 8192, 128, 128, 8064, 8150, torch.bfloat16, torch.bfloat16),
    (2, 1, 32, 8, 8192, 128, 128, 5000, 5100, torch.bfloat16, torch.bfloat16),   # nk inside a chunk and a group
    (1, 2, 9, 3, 1280, 64, 128, 1024, 1100, torch.float16, torch.float16),
    (2, 1, 64, 8, 2048, 128, 128, 1920, 2000, torch.float32, torch.float32),      # G = 8, fp32 q
    (1, 1, 32, 32, 1024, 128, 128, 896, 1000, torch.bfloat16, torch.bfloat16),    # G = 1
    (1, 1, 40, 4, 1024, 64, 128, 1024, 1150, torch.bfloat16, torch.bfloat16),     # G = 10 (two row tiles)
    (2, 1, 64, 4, 640, 64, 64, 576, 600, torch.float16, torch.bfloat16),          # G = 16, ring crosses chunks
    (1, 1, 32, 8, 512, 128, 128, 0, 60, torch.bfloat16, torch.bfloat16),          # nothing quantized yet
    (1, 1, 32, 8, 131072, 128, 128, 130944, 131050, torch.bfloat16, torch.bfloat16),
]


@pytest.mark.cuda
@pytest.mark.parametrize("bits, B, hq, hkv, T, D, R, nk, p, qdtype, vdtype", KERNEL_DECODE_CASES)
def test_quant_decode_kernel_equals_reference(bits, B, hq, hkv, T, D, R, nk, p, qdtype, vdtype):
    g = torch.Generator().manual_seed(SEED + 21)
    args = decode_inputs(g, bits, B, hq, hkv, T, D, R, qdtype, vdtype, "cuda")
    nk_t, p_t = torch.tensor(nk, device="cuda"), torch.tensor([p], device="cuda")
    sm = 1 / math.sqrt(D)
    kern = dispatch.kernel_for("quant_decode_attention", *args)
    assert kern is not None
    poison_allocator(B * hq * D * 4)
    o, lse = kern(*args, nk_t, p_t, bits, 64, min(64, D), sm)
    o_ref, lse_ref = quant_decode_attention.reference(*args, nk_t, p_t, bits, 64, min(64, D), sm)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    if nk:
        assert rel_err(o, o_ref) < 1e-4
        assert (lse - lse_ref).abs().max().item() < 1e-4
    else:
        assert torch.equal(o, torch.zeros_like(o)) and bool((lse == float("-inf")).all())


@pytest.mark.cuda
def test_quant_decode_kernel_reads_device_scalars_in_a_graph():
    """Captured once, replayed with other nk and p (as a decode graph is): each replay equals the reference."""
    g = torch.Generator().manual_seed(SEED + 22)
    args = decode_inputs(g, 1, 1, 32, 8, 4096, 128, 128, torch.bfloat16, torch.bfloat16, "cuda")
    nk_t, p_t = torch.tensor(3840, device="cuda"), torch.tensor([3900], device="cuda")
    run = lambda: quant_decode_attention(*args, nk_t, p_t, 1, 64, 64, 0.088)  # noqa: E731
    first = run()
    assert all(torch.equal(a, b) for a, b in zip(first, run()))    # deterministic
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for nk, p in [(3840, 3900), (3968, 4000), (4096, 4200), (128, 200)]:
        nk_t.fill_(nk)
        p_t.fill_(p)
        graph.replay()
        torch.cuda.synchronize()
        ref = quant_decode_attention.reference(*args, nk_t, p_t, 1, 64, 64, 0.088)
        assert rel_err(captured[0], ref[0]) < 1e-4 and (captured[1] - ref[1]).abs().max().item() < 1e-4

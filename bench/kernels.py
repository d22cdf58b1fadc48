"""Device check and timing of every CUDA kernel of ops/ against its torch reference and the stock alternative.
From the repo root:  PYTHONPATH=src python3 bench/kernels.py --out DIR [--only gather,qk,av,attend,approx,sketch,topk,pages]
(`quant` stands for qk,av,qattn). For each kernel: max relative error against the reference on fresh random inputs at
2-3 shapes (PASS/FAIL), then the time of one call (CUDA events around replays of a CUDA graph that holds several
calls, inputs rotating over sets that together exceed the 60 MB L2; median of 50), the bytes it must move, the
rate against the ceiling, and the baseline's time. The ceilings are this GPU's, measured at the start: HBM a device
copy, read + write (4.2-4.3 TB/s on the H200, 3.0 on the H100), PCIe a pinned host-to-device copy (55 GB/s), for
the pinned-host gathers; --hbm-gbps / --pcie-gbps set them. A kernel that fails to build or is wrong is reported
and the others go on. Writes DIR/kernels.json."""
from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import time
import traceback
from unittest import mock

import torch
import torch.nn.functional as F

from tailorkv.engine.bench.driver import floor_bandwidths, measure_hbm_gbps, measure_pcie_gbps
from tailorkv.engine.results import environment, write_json
from tailorkv.ops import dispatch, host_gather_cuda
from tailorkv.ops.attention import attend_decode
from tailorkv.ops.host_gather import gather_rows
from tailorkv.ops.host_memory import host_empty
from tailorkv.ops.quant import quantize_keys, quantize_sketch, quantize_values
from tailorkv.ops.quant_attention import av_quant, qk_quant
from tailorkv.ops.sparse_select import approx_scores, sketch_scores

HBM, PCIE, L2_BYTES = 4300.0, 55.0, 60e6
# quant_decode_attention's checks against its reference: (B, Hq, Hkv, T, D, keys attended, position)
QATTN_SHAPES = ((1, 32, 8, 8192, 128, 8064, 8150), (2, 9, 3, 1280, 64, 1024, 1100))
DEV = torch.device("cuda")


def randn(*shape, dtype=torch.float32, scale=1.0):
    """Fresh random inputs (torch's CUDA generator, seeded from the clock in main)."""
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def n_sets(set_bytes: float) -> int:
    return max(1, min(6, math.ceil(2.5 * L2_BYTES / max(set_bytes, 1))))


def gpu_time(calls, reps: int = 50, eager: bool = False) -> tuple[float, str]:
    """ms per call: a CUDA graph of >= 8 calls (rotating over `calls`) replayed `reps` times, median; where a
    call cannot be captured, back-to-back eager calls (which include the host's launch time)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    per = len(calls) * max(1, math.ceil(8 / len(calls)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    run, mode = None, "graph"
    if not eager:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(per):
                    calls[i % len(calls)]()
            run = graph.replay
        except Exception:  # noqa: BLE001 - not capturable: time it eagerly
            torch.cuda.synchronize()
    if run is None:
        mode = "eager"

        def run():
            for i in range(per):
                calls[i % len(calls)]()
    run()
    for s, e in zip(starts, ends):
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / per, mode


def result(name, checks, kernel_ms, mode, nbytes, ceiling, base_name, base_ms, extra=None):
    r = dict(kernel=name, checks=checks, passed=all(c["pass"] for c in checks), time_ms=kernel_ms, timing=mode,
             bytes=nbytes, GBps=nbytes / kernel_ms / 1e6, ceiling_GBps=ceiling,
             fraction_of_ceiling=nbytes / kernel_ms / 1e6 / ceiling, baseline=base_name, baseline_ms=base_ms,
             speedup=base_ms / kernel_ms if base_ms else None)
    r.update(extra or {})
    return r


def check(label, got, want, bound):
    err = max_rel(got, want)
    ok = err <= bound
    print(f"  check {label}: max rel. error {err:.2e} (bound {bound:.0e}) {'PASS' if ok else 'FAIL'}")
    return dict(shape=label, max_rel_err=err if math.isfinite(err) else None, bound=bound, **{"pass": ok})


def kernel(name, *tensors):
    k = dispatch.kernel_for(name, *tensors)
    if k is None:
        raise RuntimeError(f"the {name} kernel did not load")
    return k


# --- benches ------------------------------------------------------------------------------------------------
def bench_gather():
    out = []
    # the layouts the engine gathers: the default path's K^T rows from a pinned store, sketch-ahead's top-K K|V rows
    # (512 B) from a managed one (ops/host_memory.py); the default path reads its top-K rows inside the attention
    for label, (H, N, X, n, kt) in {"K^T rows 12x8 of 256 KiB": (8, 128, 131072, 12, True),
                                     "top-K K|V rows 896x8 of 512 B, managed": (8, 131072, 256, 896, False)}.items():
        host = host_empty((1, H, N, X), torch.bfloat16, DEV, managed=not kt).copy_(torch.randn(1, H, N, X))
        k = kernel("gather_rows", host, torch.zeros(1, device=DEV))
        idxs = [torch.randint(0, N, (1, H, n), device=DEV) for _ in range(4)]
        checks = [check(label, k(host, idxs[0], DEV).float(), gather_rows.reference(host, idxs[0].cpu(), DEV).float(), 0)]
        buf = torch.empty(1, H, n, X, dtype=torch.bfloat16, device=DEV)
        checks.append(check(label + " (out=)", k(host, idxs[1], DEV, out=buf).float(),
                            gather_rows.reference(host, idxs[1].cpu(), DEV).float(), 0))
        ms, mode = gpu_time([lambda i=i, k=k, host=host, buf=buf: k(host, i, DEV, out=buf) for i in idxs])
        cpu_idx = [i.cpu() for i in idxs]
        base_ms, _ = gpu_time([lambda i=i, host=host: gather_rows.reference(host, i, DEV) for i in cpu_idx], reps=5,
                              eager=True)
        out.append(result(f"gather_rows [{label}]", checks, ms, mode, H * n * X * 2, PCIE,
                          "torch index on host + copy", base_ms))
        if not kt:  # the engine's grid (MAX_BLOCKS) keeps the SMs for the compute stream; one pass at once:
            words = H * n * X * host.element_size() // host_gather_cuda.widest_word(host)
            blocks = host_gather_cuda.one_pass_blocks(words)
            with mock.patch.object(host_gather_cuda, "MAX_BLOCKS", blocks):
                checks = [check(f"{label}, {blocks} blocks", k(host, idxs[2], DEV, out=buf).float(),
                                gather_rows.reference(host, idxs[2].cpu(), DEV).float(), 0)]
                ms, mode = gpu_time([lambda i=i, k=k, host=host, buf=buf: k(host, i, DEV, out=buf) for i in idxs])
            out.append(result(f"gather_rows [{label}, {blocks} blocks]", checks, ms, mode, H * n * X * 2, PCIE,
                              "torch index on host + copy", base_ms))
    return out


def quant_inputs(bits, B, Hq, Hkv, T, D, qdtype):
    """Keys are quantized in whole groups of 64 tokens (the first T // 64 * 64), values per token (all T)."""
    kc, ks, km = quantize_keys(randn(B, Hkv, T // 64 * 64, D) * torch.exp(randn(D)), bits, 64)
    vc, vs, vm = quantize_values(randn(B, Hkv, T, D), bits, min(64, D))
    q = randn(B, Hq, 1, D, dtype=qdtype)
    probs = torch.softmax(randn(B, Hq, 1, T, scale=3.0), -1)
    return q, (kc, ks, km), probs, (vc, vs, vm)


def bench_qk():
    out = []
    for bits in (1, 2):
        checks = []
        for shape in ((bits, 1, 32, 8, 4096, 128, torch.bfloat16), (bits, 2, 9, 3, 320, 64, torch.float32)):
            q, keys, _, _ = quant_inputs(*shape)
            k = kernel("qk_quant", q, *keys)
            checks.append(check(f"{shape[:6]} q {shape[6]}", k(q, *keys, bits, 64, 0.088),
                                qk_quant.reference(q, *keys, bits, 64, 0.088), 1e-4))
        B, Hq, Hkv, T, D = 1, 32, 8, 131072, 128
        packed = Hkv * T * D * (bits / 8 + 4 / 64)           # codes + fp16 scale and min per 64 tokens
        sets = [quant_inputs(bits, B, Hq, Hkv, T, D, torch.bfloat16)[:2] for _ in range(n_sets(packed))]
        k = kernel("qk_quant", sets[0][0], *sets[0][1])
        ms, mode = gpu_time([lambda s=s, k=k, bits=bits: k(s[0], *s[1], bits, 64, 0.088) for s in sets])
        base_ms, _ = gpu_time([lambda s=s, bits=bits: qk_quant.reference(s[0], *s[1], bits, 64, 0.088) for s in sets[:2]],
                              reps=10)
        total = packed + Hq * T * 4
        out.append(result(f"qk_quant {bits}-bit T=128k Hq=32 Hkv=8 D=128", checks, ms, mode, total, HBM,
                          "torch reference", base_ms, dict(packed_bytes=packed, packed_GBps=packed / ms / 1e6)))
    return out


def bench_sketch():
    """sketch_scores (lse) over a key sketch against the qk_quant kernel over the same keys packed along time
    (the kernel the sketch used before it had its own: plain logits, no combining)."""
    out = []
    B, Hq, Hkv, T, D = 1, 32, 8, 131072, 128
    for bits in (1, 2, 4):
        checks = []
        for (b, hq, hkv, t, d, dt) in ((1, 32, 8, 4096, 128, torch.bfloat16), (2, 9, 3, 333, 64, torch.float32)):
            k = randn(b, hkv, -(-t // 64) * 64, d) * torch.exp(randn(d))
            keys = [x[:, :, :t] if i == 0 else x for i, x in enumerate(quantize_sketch(k, bits, 64))]
            q = randn(b, hq, 1, d, dtype=dt)
            end = torch.tensor(t - 5, device=DEV)
            kern = kernel("sketch_scores", q, *keys)
            got, want = kern(q, *keys, bits, 64, end, 0, "lse", 0.088), sketch_scores.reference(
                q, *keys, bits, 64, end, 0, "lse", 0.088)
            checks.append(check(f"({b}, {hq}, {hkv}, {t}, {d}) q {dt}", got[..., :t - 5], want[..., :t - 5], 1e-3))
        packed = Hkv * T * D * (bits / 8 + 4 / 64)
        sets = []
        for _ in range(n_sets(packed)):
            k = randn(B, Hkv, T, D) * torch.exp(randn(D))
            sets.append((randn(B, Hq, 1, D, dtype=torch.bfloat16), quantize_sketch(k, bits, 64),
                         quantize_keys(k, bits, 64)))
        end = torch.tensor(T, device=DEV)
        kern = kernel("sketch_scores", sets[0][0], *sets[0][1])
        ms, mode = gpu_time([lambda s=s, bits=bits: kern(s[0], *s[1], bits, 64, end, 0, "lse", 0.088) for s in sets])
        qk = kernel("qk_quant", sets[0][0], *sets[0][2])
        base_ms, _ = gpu_time([lambda s=s, bits=bits: qk(s[0], *s[2], bits, 64, 0.088) for s in sets])
        out.append(result(f"sketch_scores {bits}-bit lse T=128k Hq=32 Hkv=8 D=128", checks, ms, mode,
                          packed + Hkv * T * 4, HBM, "qk_quant kernel (time-packed, no combining)", base_ms,
                          dict(packed_bytes=packed, packed_GBps=packed / ms / 1e6)))
    return out


def bench_av():
    out = []
    for bits in (1, 2):
        checks = []
        for shape in ((bits, 1, 32, 8, 4096, 128, torch.bfloat16), (bits, 2, 9, 3, 201, 64, torch.bfloat16)):
            _, _, probs, vals = quant_inputs(*shape)
            k = kernel("av_quant", probs, *vals)
            group = min(64, shape[5])
            checks.append(check(f"{shape[:6]}", k(probs, *vals, bits, group), av_quant.reference(probs, *vals, bits, group), 1e-4))
        B, Hq, Hkv, T, D = 1, 32, 8, 131072, 128
        packed = Hkv * T * D * (bits / 8 + 4 / 64)           # codes + fp16 scale and min per 64 channels
        sets = [quant_inputs(bits, B, Hq, Hkv, T, D, torch.bfloat16)[2:] for _ in range(n_sets(packed))]
        k = kernel("av_quant", sets[0][0], *sets[0][1])
        ms, mode = gpu_time([lambda s=s, k=k, bits=bits: k(s[0], *s[1], bits, 64) for s in sets])
        base_ms, _ = gpu_time([lambda s=s, bits=bits: av_quant.reference(s[0], *s[1], bits, 64) for s in sets[:2]],
                              reps=10)
        total = packed + Hq * T * 4
        out.append(result(f"av_quant {bits}-bit T=128k Hq=32 Hkv=8 D=128", checks, ms, mode, total, HBM,
                          "torch reference", base_ms, dict(packed_bytes=packed, packed_GBps=packed / ms / 1e6)))
    return out


def decode_state(bits, B, Hq, Hkv, T, D, R=128):
    """A quantized layer's decode inputs at T key positions: q, packed K, packed V (T + R rows), the ring."""
    q, keys, _, vals = quant_inputs(bits, B, Hq, Hkv, T + R, D, torch.bfloat16)
    keys = tuple(k[:, :, :T // (32 // bits)] if i == 0 else k[:, :, :T // 64] for i, k in enumerate(keys))
    return q, keys, vals, randn(B, Hkv, R + 1, D, dtype=torch.bfloat16)


def qattn_128k(bits, n_inputs=None):
    """quant_decode_attention's timed case, 128k keys of the Llama-3.1-8B shape: its packed bytes (K and V: codes +
    fp16 scale and min per 64), the input sets (enough to spill L2 unless n_inputs) and a call on one set."""
    B, Hq, Hkv, T, D = 1, 32, 8, 131072, 128
    packed = 2 * Hkv * T * D * (bits / 8 + 4 / 64)
    sets = [decode_state(bits, B, Hq, Hkv, T, D) for _ in range(n_inputs or n_sets(packed))]
    sc = (torch.tensor(T - 128, device=DEV), torch.tensor([T - 1], device=DEV))

    def call(fn, s):
        return fn(s[0], *s[1], *s[2], s[3], *sc, bits, 64, 64, 0.088)
    return packed, sets, call


def bench_qattn():
    """The whole 1/2-bit decode attention (quant_decode_attention) against the composition it replaces."""
    from tailorkv.ops.quant_attention import quant_decode_attention as qda
    out = []
    for bits in (1, 2):
        checks = []
        for (B, Hq, Hkv, T, D, nk, p) in QATTN_SHAPES:
            q, keys, vals, ring = decode_state(bits, B, Hq, Hkv, T, D)
            sc = (torch.tensor(nk, device=DEV), torch.tensor([p], device=DEV))
            k = kernel("quant_decode_attention", q, *keys, *vals, ring, *sc)
            got = k(q, *keys, *vals, ring, *sc, bits, 64, min(64, D), 0.088)
            want = qda.reference(q, *keys, *vals, ring, *sc, bits, 64, min(64, D), 0.088)
            checks.append(check(f"B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} nk={nk} o", got[0], want[0], 1e-4))
            checks.append(check(f"B={B} Hq={Hq} Hkv={Hkv} T={T} D={D} nk={nk} lse", got[1], want[1], 1e-5))
        packed, sets, call = qattn_128k(bits)
        k = kernel("quant_decode_attention", sets[0][0], *sets[0][1], *sets[0][2], sets[0][3])
        ms, mode = gpu_time([lambda s=s, k=k, call=call: call(k, s) for s in sets])
        base_ms, _ = gpu_time([lambda s=s, call=call: call(qda.reference, s) for s in sets[:2]], reps=20)
        out.append(result(f"quant_decode_attention {bits}-bit T=128k Hq=32 Hkv=8 D=128", checks, ms, mode, packed,
                          HBM, "qk_quant + softmax + av_quant", base_ms,
                          dict(packed_bytes=packed, packed_GBps=packed / ms / 1e6)))
    return out


# attend_decode variants timed side by side (the first is the module's CONFIG): one run picks the best
ATTEND_VARIANTS = {
    "w2 k32 b4": {},
    "w4 k32 b2": dict(warps=4, blocks_per_sm=2),
    "w4 k16 b3": dict(warps=4, keys_per_step=16, blocks_per_sm=3, min_blocks=3),
    "w8 k32 b1": dict(warps=8, blocks_per_sm=1),
    "w4 k32 b4 (2 waves)": dict(warps=4, blocks_per_sm=4),
    "w4 k32 b2 L2::256B": dict(warps=4, blocks_per_sm=2, load="L2::256B"),
    "w4 k16 b3 L2::256B": dict(warps=4, keys_per_step=16, blocks_per_sm=3, min_blocks=3, load="L2::256B"),
}


def bench_attend():
    from tailorkv.ops import attention_cuda
    checks = []
    for (B, Hq, Hkv, N, D, lens, dt) in ((1, 32, 8, 8192, 128, [8192], torch.bfloat16),
                                          (1, 32, 8, 8192, 128, [1000], torch.bfloat16),
                                          (1, 32, 8, 131072, 128, [131072], torch.bfloat16),
                                          (1, 32, 8, 131072, 128, [9000], torch.bfloat16),
                                          (2, 9, 3, 3000, 64, [2999, 17], torch.float16),
                                          (1, 32, 4, 4096, 128, [4000], torch.bfloat16),
                                          (1, 16, 1, 2048, 128, [2047], torch.bfloat16),
                                          (1, 8, 8, 1000, 64, [1], torch.float16)):
        q, k_, v_ = randn(B, Hq, 1, D, dtype=dt), randn(B, Hkv, N, D, dtype=dt), randn(B, Hkv, N, D, dtype=dt)
        length = torch.tensor(lens, device=DEV)
        k = kernel("attend_decode", q, k_, v_, length)
        checks.append(check(f"B={B} Hq={Hq} Hkv={Hkv} N={N} D={D} len={lens} {dt}", k(q, k_, v_, length),
                            attend_decode.reference(q, k_, v_, length), 2e-2))
        del q, k_, v_
    out = []
    B, Hq, Hkv, N, D = 1, 32, 8, 131072, 128
    q, kb, vb = randn(B, Hq, 1, D, dtype=torch.bfloat16), randn(B, Hkv, N, D, dtype=torch.bfloat16), randn(B, Hkv, N, D, dtype=torch.bfloat16)

    def windows(L):
        nbytes = 2 * B * Hkv * L * D * 2
        return nbytes, [i * L for i in range(min(n_sets(nbytes), N // L))]     # disjoint windows of the buffer

    base = {}
    for L in (1024, 8192, 9000, 32768, N):
        nbytes, offs = windows(L)
        base[L], _ = gpu_time([lambda o=o, e=L: F.scaled_dot_product_attention(q, kb[:, :, o:o + e], vb[:, :, o:o + e],
                                                                             enable_gqa=True) for o in offs])
    k = kernel("attend_decode", q, kb, vb, torch.tensor(N, device=DEV))
    for L in (1024, 9000, 32768):                       # the module's default, in a 128k buffer (a bucket)
        length = torch.tensor(L, device=DEV)
        nbytes, offs = windows(L)
        ms, mode = gpu_time([lambda o=o, n=length: k(q, kb[:, :, o:], vb[:, :, o:], n) for o in offs])
        out.append(result(f"attend_decode bf16 N=128k length={L} Hq=32 Hkv=8 D=128", checks, ms, mode,
                          nbytes, HBM, "SDPA enable_gqa over exactly length keys", base[L]))
    wants = {}
    print(f"  {'variant':22} {'length':>7} {'buffer':>7} {'check':>14} {'ms':>8} {'GB/s':>6} {'SDPA ms':>8}")
    for name, cfg in ATTEND_VARIANTS.items():
        try:
            kv = attention_cuda.load(attend_decode.reference, cfg)
        except Exception as e:  # noqa: BLE001 - a variant that does not build is reported, the others go on
            print(f"  {name:22} did not build: {type(e).__name__}: {e}")
            continue
        for L, buf in ((8192, 8192), (N, N)):
            length = torch.tensor(L, device=DEV)
            nbytes, offs = windows(L)
            if L not in wants:
                wants[L] = attend_decode.reference(q, kb[:, :, :buf], vb[:, :, :buf], length)
            err = max_rel(kv(q, kb[:, :, :buf], vb[:, :, :buf], length), wants[L])
            c = dict(shape=f"{name} length={L}", max_rel_err=err if math.isfinite(err) else None, bound=2e-2,
                     **{"pass": err <= 2e-2})
            ms, mode = gpu_time([lambda o=o, n=length, kv=kv, e=buf: kv(q, kb[:, :, o:o + e], vb[:, :, o:o + e], n)
                                 for o in offs])
            print(f"  {name:22} {L:7d} {buf:7d} {err:9.1e} {'PASS' if c['pass'] else 'FAIL'} {ms:8.4f} "
                  f"{nbytes / ms / 1e6:6.0f} {base[L]:8.4f}", flush=True)
            out.append(result(f"attend_decode [{name}] length={L} of {buf}", [c], ms, mode, nbytes, HBM,
                              "SDPA enable_gqa over exactly length keys", base[L], dict(config=kv.config)))
    return out


def bench_approx():
    checks = []
    for (B, Hq, Hkv, D, r, N, dt) in ((1, 32, 8, 128, 12, 131072, torch.bfloat16), (2, 9, 3, 64, 8, 1001, torch.float16)):
        q = randn(B, Hq, 1, D, dtype=dt)
        rows = randn(B, Hkv, r, N + 3, dtype=dt)[..., 1:N + 1]
        ch = torch.stack([torch.randperm(D, device=DEV)[:r] for _ in range(B * Hkv)]).reshape(B, Hkv, r)
        k = kernel("approx_scores", q, rows, ch)
        checks.append(check(f"B={B} Hkv={Hkv} r={r} N={N} {dt} (unaligned view)", k(q, rows, ch),
                            approx_scores.reference(q, rows, ch), 1e-4))
    B, Hq, Hkv, D, r, N = 1, 32, 8, 128, 12, 131072
    nbytes = B * Hkv * r * N * 2 + B * Hkv * N * 4
    sets = []
    for _ in range(n_sets(nbytes)):
        sets.append((randn(B, Hq, 1, D, dtype=torch.bfloat16), randn(B, Hkv, r, N, dtype=torch.bfloat16),
                     torch.stack([torch.randperm(D, device=DEV)[:r] for _ in range(Hkv)])[None],
                     torch.empty(B, Hkv, N, device=DEV)))
    k = kernel("approx_scores", *sets[0][:3])
    ms, mode = gpu_time([lambda s=s: k(*s[:3], out=s[3]) for s in sets])
    base_ms, _ = gpu_time([lambda s=s: approx_scores.reference(*s[:3]) for s in sets])
    return [result(f"approx_scores bf16 r={r} N=128k Hkv=8", checks, ms, mode, nbytes, HBM, "torch reference", base_ms)]


def bench_topk():
    """topk_tokens (exact, index order) over sketch scores of random keys (the decode step's input: 8 KV heads x
    128k tokens, k = 896) against torch.topk; its two stages timed apart with the profiler (stage 1: the k best of
    each stretch of a row, stage 2: the k best of those candidates)."""
    from tailorkv.ops.sparse_select import topk_tokens
    checks = []
    for (rows, n, k) in ((8, 131072, 896), (3, 5000, 100), (2, 700, 700)):
        for kind in ("sketch", "ties"):
            if kind == "sketch":
                keys = quantize_sketch(randn(1, rows, -(-n // 64) * 64, 128) * torch.exp(randn(128)), 2, 64)
                x = sketch_scores(randn(1, 4 * rows, 1, 128, dtype=torch.bfloat16), *keys, 2, 64,
                                  torch.tensor(n, device=DEV), 0, "lse", 0.088)[..., :n].contiguous()
            else:
                x = torch.randint(0, 50, (1, rows, n), device=DEV).float()
            kern = kernel("topk_tokens", x)
            got = kern(x, k).sort(-1).values
            want = topk_tokens.reference(x, k) if kind == "sketch" else \
                torch.sort(-x, dim=-1, stable=True).indices[..., :k]                    # ties: the lowest indices
            checks.append(check(f"{kind} rows={rows} N={n} k={k}", got.float(), want.sort(-1).values.float(), 0))
    rows, n, k = 8, 131072, 896
    sets = []
    for _ in range(n_sets(rows * n * 4)):
        keys = quantize_sketch(randn(1, rows, n, 128) * torch.exp(randn(128)), 2, 64)
        sets.append(sketch_scores(randn(1, 32, 1, 128, dtype=torch.bfloat16), *keys, 2, 64,
                                  torch.tensor(n, device=DEV), 0, "lse", 0.088).contiguous())
    kern = kernel("topk_tokens", sets[0])
    ms, mode = gpu_time([lambda s=s: kern(s, k) for s in sets])
    base_ms, _ = gpu_time([lambda s=s: s.topk(k, dim=-1) for s in sets])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            for s in sets:
                kern(s, k)
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if e.name == "topk_rows"]
    stages = {f"stage{i + 1}_us": statistics.median(times[i::2]) for i in range(2)} if len(times) % 2 == 0 else {}
    print(f"  stages (us, profiler, eager): {stages}")
    return [result(f"topk_tokens k={k} of {rows} x 128k sketch scores", checks, ms, mode, rows * n * 4, HBM,
                   "torch.topk", base_ms, stages)]


def bench_linear():
    """One row times each Llama-3.1-8B weight (the decode step's GEMVs) against F.linear (cuBLAS)."""
    from tailorkv.ops.linear import linear
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
              "lm_head": (128256, 4096)}
    out, step_ms, step_base = [], 0.0, 0.0
    checks = []
    for (N, K, dt) in ((1000, 576, torch.bfloat16), (4099, 1544, torch.float16), (6144, 4096, torch.bfloat16)):
        x, w = randn(1, 1, K, dtype=dt), randn(N, K, dtype=dt, scale=0.02)
        checks.append(check(f"N={N} K={K} {dt}", kernel("linear", x, w)(x, w), x.float() @ w.float().t(), 8e-3))
    for name, (N, K) in shapes.items():
        nbytes = N * K * 2
        sets = [(randn(1, 1, K, dtype=torch.bfloat16), randn(N, K, dtype=torch.bfloat16, scale=0.02))
                for _ in range(n_sets(nbytes))]
        k = kernel("linear", *sets[0])
        ms, mode = gpu_time([lambda s=s: k(*s) for s in sets])
        base_ms, _ = gpu_time([lambda s=s: linear.reference(*s) for s in sets])
        times = 1 if name == "lm_head" else 32
        step_ms, step_base = step_ms + times * ms, step_base + times * base_ms
        out.append(result(f"linear bf16 {name} N={N} K={K}", checks, ms, mode, nbytes, HBM, "F.linear (cuBLAS)",
                          base_ms))
    print(f"  a Llama-3.1-8B step's projections (32 layers + lm head): {step_ms:.3f} ms, cuBLAS {step_base:.3f} ms")
    return out


def bench_pages():
    """Quest's decode selection at 128k (Llama-3.1-8B: 8 KV heads x 4 query heads, D 128, pages of 16: 8,192 pages):
    quest_page_scores (reads every page's bf16 min and max once) against its torch reference, and quest_page_slots
    (the top pages' positions and the last page's) against its reference."""
    from tailorkv.ops.page_select import page_scores, page_slots
    checks = []
    for (Hq, H, P, D) in ((32, 8, 8192, 128), (9, 3, 515, 64)):
        q = randn(1, Hq, D, dtype=torch.bfloat16)
        a, b = randn(1, H, P, D, dtype=torch.bfloat16), randn(1, H, P, D, dtype=torch.bfloat16)
        kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
        length = torch.tensor([P * 16 - 5], device=DEV)
        want = page_scores.reference(q, kmin, kmax, length, 16)
        got = kernel("quest_page_scores", q, kmin, kmax)(q, kmin, kmax, length, 16)
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        fin = torch.isfinite(want)
        checks.append(check(f"scores Hq={Hq} H={H} P={P} D={D}", got[fin], want[fin], 1e-5))
        top = 63
        pages = torch.stack([torch.randperm(P - 1, device=DEV)[:top] for _ in range(H)])[None]
        slots = torch.empty(1, H, (top + 1) * 16, dtype=torch.long, device=DEV)
        scores = want
        want = page_slots.reference(pages, scores, length, 16, True, 10 ** 6, slots.clone())
        got = kernel("quest_page_slots", pages)(pages, scores, length, 16, True, 10 ** 6, slots)
        checks.append(check(f"slots H={H} P={P}", got.float(), want.float(), 0))
    Hq, H, P, D = 32, 8, 8192, 128
    nbytes = 2 * H * P * D * 2
    sets = []
    for _ in range(n_sets(nbytes)):
        a, b = randn(1, H, P, D, dtype=torch.bfloat16), randn(1, H, P, D, dtype=torch.bfloat16)
        sets.append((randn(1, Hq, D, dtype=torch.bfloat16), torch.minimum(a, b), torch.maximum(a, b)))
    length = torch.tensor([P * 16 - 5], device=DEV)
    kern = kernel("quest_page_scores", *sets[0])
    ms, mode = gpu_time([lambda s=s: kern(*s, length, 16) for s in sets])
    base_ms, _ = gpu_time([lambda s=s: page_scores.reference(*s, length, 16) for s in sets])
    pages = torch.stack([torch.randperm(P - 1, device=DEV)[:63] for _ in range(H)])[None]
    scores = kern(*sets[0], length, 16)
    slots = torch.empty(1, H, 64 * 16, dtype=torch.long, device=DEV)
    skern = kernel("quest_page_slots", pages)
    slots_ms, _ = gpu_time([lambda: skern(pages, scores, length, 16, True, 10 ** 6, slots)])
    slots_base, _ = gpu_time([lambda: page_slots.reference(pages, scores, length, 16, True, 10 ** 6, slots)])
    print(f"  quest_page_slots: {slots_ms * 1e3:.1f} us, its reference {slots_base * 1e3:.1f} us")
    return [result(f"quest_page_scores of {H} x {P} pages (D {D}, bf16 min + max)", checks, ms, mode, nbytes, HBM,
                   "torch reference", base_ms, dict(slots_us=slots_ms * 1e3, slots_reference_us=slots_base * 1e3))]


BENCHES = {"linear": bench_linear, "gather": bench_gather, "qk": bench_qk, "av": bench_av, "qattn": bench_qattn, "attend": bench_attend,
           "approx": bench_approx, "sketch": bench_sketch, "topk": bench_topk, "pages": bench_pages}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for kernels.json")
    ap.add_argument("--only", default="", help="comma-separated: " + ",".join(BENCHES) + " (quant = qk,av,qattn)")
    ap.add_argument("--hbm-gbps", type=float, default=None, help="the HBM ceiling [default: a device copy, measured]")
    ap.add_argument("--pcie-gbps", type=float, default=None, help="the PCIe ceiling [default: a pinned copy, measured]")
    a = ap.parse_args()
    global HBM, PCIE
    names = [n for part in a.only.split(",") if part for n in (("qk", "av", "qattn") if part == "quant" else (part,))] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        sys.exit(f"unknown bench {unknown}; choose from {list(BENCHES)}")
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")
    seed = int(time.time())
    torch.manual_seed(seed)
    ceilings = floor_bandwidths(a.hbm_gbps, a.pcie_gbps, measure_hbm_gbps(DEV), measure_pcie_gbps(DEV))
    HBM, PCIE = ceilings["hbm_gbps"], ceilings["pcie_gbps"]
    print(f"seed {seed}; ceilings: HBM {HBM:.0f} GB/s ({ceilings['hbm_gbps_source']}), "
          f"PCIe {PCIE:.1f} GB/s ({ceilings['pcie_gbps_source']})")
    t0 = time.perf_counter()
    rows, errors = [], {}
    for name in names:
        print(f"== {name}", flush=True)
        try:
            rows += BENCHES[name]()
        except Exception as e:  # noqa: BLE001 - one broken kernel must not stop the others
            lines = traceback.format_exc().strip().splitlines()
            errors[name] = f"{type(e).__name__}: {e}"
            print("  ERROR " + "\n  ".join(lines[-6:]), flush=True)
        torch.cuda.empty_cache()
    env = environment(DEV)
    env["command"] = shlex.join(["python3", "bench/kernels.py", *sys.argv[1:]])
    write_json(f"{a.out}/kernels.json", dict(environment=env, seed=seed, ceilings=ceilings, results=rows, errors=errors,
                                             seconds=time.perf_counter() - t0))
    print(f"\n{'kernel':58} {'check':5} {'ms':>8} {'GB/s':>8} {'of ceil':>7} {'baseline ms':>11} {'speedup':>7}")
    for r in rows:
        print(f"{r['kernel'][:58]:58} {'PASS' if r['passed'] else 'FAIL':5} {r['time_ms']:8.4f} {r['GBps']:8.0f} "
              f"{r['fraction_of_ceiling']:7.0%} {r['baseline_ms']:11.4f} {r['speedup']:7.1f}x"
              + (f"  packed {r['packed_GBps']:.0f} GB/s" if "packed_GBps" in r else ""))
    for name, err in errors.items():
        print(f"{name:58} ERROR {err[:100]}")
    print(f"({time.perf_counter() - t0:.0f} s; {a.out}/kernels.json)")


if __name__ == "__main__":
    main()

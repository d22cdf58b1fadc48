"""Latency and memory sweeps over (method, context) on one loaded model: the driver behind `tailorkv bench`.

Pure functions, no CLI. One cell = build a fresh cache for (method, ctx), prefill random token ids, decode
greedily (warm-up steps first, then timed steps), read the cache's byte counts and counters, free it all.

Per decode step the physical floor is the bytes the step must move over the bandwidth that moves them:
    hbm_ms  = (weight bytes read + KV bytes read on the device) / HBM bandwidth
    pcie_ms = PCIe bytes of the step / PCIe bandwidth
    floor_ms = max(hbm_ms, pcie_ms)   (the two can overlap; nothing can beat the slower one)
KV bytes read on the device: the policy's stats() key "kv_read_bytes" when it reports one; else its
"tokens_attended" (summed over layers by ModelCache.stats) x one token's K and V in one layer; else
cache.device_bytes() (an upper bound: everything the cache holds on the device). PCIe bytes: the sum of every
stats() key that starts with "bytes_" or names a direction ("h2d", "d2h"). stats() reports the last step
(engine.cache.LayerCache.stats), so it is read after each timed step and each key's median is kept.
"""
from __future__ import annotations

import gc
import os
import statistics
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from tailorkv.engine.errors import InputError
from tailorkv.engine.results import percentile
from tailorkv.engine.methods import build_cache
from tailorkv.engine.generate import sync
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.ops import dispatch

HBM_GBPS = 4300.0   # H200 device-to-device copy, read + write (DESIGN.md, "Measured on the lent H200 machine")
PCIE_GBPS = 55.0    # H200 host, pinned host-to-device copy (same place)
MARGIN = 16         # free cache slots left after prefill + warm-up + timed steps


@dataclass
class BenchPlan:
    ctxs: list[int]
    methods: list[str]
    settings: dict[str, MethodSettings] = field(default_factory=dict)  # per method; default MethodSettings
    decode_steps: int = 64
    warmup: int = 8
    batch: int = 1
    seed: int = 0
    hbm_gbps: float = HBM_GBPS
    pcie_gbps: float = PCIE_GBPS
    margin: int = MARGIN
    cuda_graph: bool = True  # decode through the engine's CUDA graph where the cache allows it
    profile_steps: int = 0   # > 0 (GPU): a stage breakdown of that many decode steps (engine.bench.stages)
    profile_prefill: bool = False  # GPU: a stage breakdown of the prefill, with TFLOP/s of its matmuls

    def settings_for(self, method: str) -> MethodSettings:
        return self.settings.get(method) or MethodSettings(method=method)

    def prompt_len(self, ctx: int) -> int:
        return ctx - self.warmup - self.decode_steps - self.margin

    def validate(self, max_context: int | None = None) -> None:
        if not self.methods:
            raise InputError("--methods is empty: name at least one method, e.g. full")
        if not self.ctxs:
            raise InputError("--ctx is empty: give at least one context length, e.g. 8k")
        for flag, n, least in (("--decode-steps", self.decode_steps, 1), ("--batch", self.batch, 1),
                               ("--warmup", self.warmup, 0)):
            if n < least:
                raise InputError(f"{flag} must be at least {least}, got {n}: e.g. {flag} {max(least, 1)}")
        for ctx in self.ctxs:
            if self.prompt_len(ctx) < 1:
                raise InputError(f"--ctx {ctx} leaves no room for a prompt after {self.warmup} warm-up and "
                                 f"{self.decode_steps} decode steps: raise --ctx or lower --decode-steps")
            if max_context is not None and ctx > max_context:
                raise InputError(f"--ctx {ctx} is beyond what the model supports ({max_context} tokens): lower --ctx")


# --- sizes and environment ---------------------------------------------------------------------------------

def model_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of all parameters, bytes one decode step reads): an untied embedding table is read one row
    per token, not whole, so it is left out of the second figure."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    read = total
    emb = model.model.embed_tokens.weight
    if emb is not model.output_weight:
        read -= emb.numel() * emb.element_size()
    return total, read


def process_rss() -> int | None:
    try:
        import psutil
        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def measure_pcie_gbps(device: torch.device, nbytes: int = 256 << 20, iters: int = 5) -> float | None:
    """Pinned host-to-device copy bandwidth (the DMA engine's); None off GPU."""
    if device.type != "cuda":
        return None
    return _copy_gbps(device, lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), nbytes, iters, 1,
                      warmup=1)


def measure_zero_copy_gbps(device: torch.device, rows: int = 12, n: int = 65536, iters: int = 5) -> float | None:
    """How fast the SMs read long rows picked from pinned host memory, zero-copy over PCIe: tailorkv's K^T gather
    (ops/host_gather.py's kernel, 8 heads x `rows` rows of n bf16 per call, other rows each call so that none is read
    twice). None off GPU, without the kernel, or where the buffers do not fit. Some hosts hold it well below the
    DMA engine's copy: 34 against 55 GB/s on some H100 hosts, 45-47 against 55 on the H200
    (bench/results/2026-12-07-h100-h200-fifty-second-session)."""
    from tailorkv.ops.host_gather import gather_rows
    if device.type != "cuda":
        return None

    def make_step():
        store = torch.empty(1, 8, 128, n, dtype=torch.bfloat16, pin_memory=True)
        out = torch.empty(1, 8, rows, n, dtype=torch.bfloat16, device=device)
        order = torch.stack([torch.randperm(128, device=device) for _ in range(8)])[None]  # [1, 8, 128]
        picks = [order[..., k * rows:(k + 1) * rows].sort(-1).values for k in range(128 // rows)]
        if dispatch.kernel_for("gather_rows", store, picks[0]) is None:
            return None
        return lambda i: gather_rows(store, picks[i], device, out=out)

    return _timed_gbps(device, make_step, rows * 8 * n * 2, min(iters, 128 // rows - 1), warmup=1)


def zero_copy_note(zero_copy_gbps: float | None, dma_gbps: float | None, threshold: float = 0.7) -> str | None:
    """A line for the bench's user where this host's SMs read host memory much slower than its DMA engine copies
    it: tailorkv's sparse layers fetch their K^T rows the first way, so its long-context decode waits longer on
    PCIe than the floor (which divides by the DMA copy) says. None where they match or either is unknown."""
    if not zero_copy_gbps or not dma_gbps or zero_copy_gbps >= threshold * dma_gbps:
        return None
    return (f"this host's SMs read pinned host memory at {zero_copy_gbps:.0f} GB/s, {zero_copy_gbps / dma_gbps:.0%} "
            f"of its DMA copy ({dma_gbps:.0f} GB/s): tailorkv's sparse layers read their K^T rows that way, so at "
            f"long contexts its decode can take up to {dma_gbps / zero_copy_gbps:.1f}x the floor's PCIe term "
            f"(--kt-bits 8 halves those bytes)")


def floor_bandwidths(hbm_flag: float | None, pcie_flag: float | None, hbm_measured: float | None,
                     pcie_measured: float | None) -> dict:
    """The bandwidths the floor divides by: the flag where given, else this machine's measured copy, else the H200's
    figures (HBM_GBPS, PCIE_GBPS); with each, where it came from and what was measured."""
    out = {}
    for name, flag, measured, default in (("hbm_gbps", hbm_flag, hbm_measured, HBM_GBPS),
                                          ("pcie_gbps", pcie_flag, pcie_measured, PCIE_GBPS)):
        value, source = ((flag, "flag") if flag is not None else (measured, "measured") if measured
                         else (default, "H200 default"))
        out.update({name: value, f"{name}_source": source, f"{name}_measured": measured})
    return out


def measure_hbm_gbps(device: torch.device, nbytes: int = 512 << 20, iters: int = 20) -> float | None:
    """Device-to-device copy bandwidth, counting read + write (as DESIGN.md's 4.3 TB/s); None off GPU."""
    if device.type != "cuda":
        return None
    return _copy_gbps(device, lambda: torch.empty(nbytes, dtype=torch.uint8, device=device), nbytes, iters, 2,
                      warmup=3)


def _copy_gbps(device: torch.device, source, nbytes: int, iters: int, passes: int, warmup: int) -> float | None:
    """GB/s of copying source() (nbytes) into device memory, `passes` x nbytes counted per copy."""
    def make_step():
        src, dst = source(), torch.empty(nbytes, dtype=torch.uint8, device=device)
        return lambda i: dst.copy_(src, non_blocking=True)

    return _timed_gbps(device, make_step, passes * nbytes, iters, warmup)


def _timed_gbps(device: torch.device, make_step, nbytes: int, iters: int, warmup: int) -> float | None:
    """GB/s of nbytes per call of step = make_step(): step(0 .. warmup - 1), then step(warmup .. warmup + iters - 1)
    timed by CUDA events. None when make_step returns None or its buffers do not fit (a tight --gpu-mem-limit,
    pinned memory); the buffers are freed after."""
    try:
        step = make_step()
        if step is None:
            return None
        for i in range(warmup):
            step(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for i in range(warmup, warmup + iters):
            step(i)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end) / iters
        del step
        torch.cuda.empty_cache()
        return nbytes / (ms / 1e3) / 1e9
    except RuntimeError:
        torch.cuda.empty_cache()
        return None


# --- one cell ----------------------------------------------------------------------------------------------

def is_oom(e: BaseException) -> bool:
    if isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def free_device(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def is_pcie_key(key: str) -> bool:
    return key.startswith("bytes_") or "h2d" in key or "d2h" in key


def pcie_bytes(stats: dict) -> float:
    return float(sum(v for k, v in stats.items() if is_pcie_key(k)))


def _median_stats(steps: list[dict]) -> dict:
    keys = sorted({k for s in steps for k in s})
    return {k: float(statistics.median(s.get(k, 0) for s in steps)) for k in keys}


Phase = Callable[[str], None]


def bench_prompt(loaded, plan: BenchPlan, ctx: int) -> torch.Tensor:
    """The random prompt ids [batch, prompt_len(ctx)] of a cell (seeded by plan.seed and ctx)."""
    gen = torch.Generator().manual_seed(plan.seed + ctx)
    return torch.randint(0, loaded.cfg.vocab_size, (plan.batch, plan.prompt_len(ctx)), generator=gen)


def _measure(loaded, settings: MethodSettings, ctx: int, plan: BenchPlan, on_phase: Phase | None) -> dict:
    model = loaded.model
    device = model.output_weight.device
    cuda = device.type == "cuda"
    say = on_phase or (lambda s: None)
    out: dict = {}
    if cuda:
        out["device_baseline_bytes"] = torch.cuda.memory_allocated(device)
    say("building cache")
    cache = build_cache(loaded, settings, ctx, plan.batch)
    out["kv_device_bytes"] = cache.device_bytes()

    n_prompt = plan.prompt_len(ctx)
    prompt = bench_prompt(loaded, plan, ctx).to(device)
    say(f"prefill {n_prompt} tokens")
    sync(device)
    t0 = time.perf_counter()
    runner = Runner(model, cache, use_cuda_graph=plan.cuda_graph)
    if plan.profile_prefill and cuda:
        from tailorkv.engine.bench.stages import profile_steps
        held = []
        out["prefill_stages"] = profile_steps(lambda r=runner, p=prompt: held.append(r.prefill(p)), 1)
        out["prefill_stages"]["flops"] = prefill_flops(loaded.cfg, n_prompt, plan.batch)
        logits = held[0]
        out["prefill_s"] = out["prefill_stages"]["wall_ms"] / 1e3  # the profiler's wall: not its trace's export
    else:
        logits = runner.prefill(prompt)
        sync(device)
        out["prefill_s"] = time.perf_counter() - t0
    out["prefill_tok_s"] = plan.batch * n_prompt / out["prefill_s"]
    out["prefill_stats"] = {k: float(v) for k, v in cache.stats().items()}
    if cuda:
        out["peak_device_prefill_bytes"] = torch.cuda.max_memory_allocated(device)
        out["peak_reserved_prefill_bytes"] = torch.cuda.max_memory_reserved(device)  # what the allocator held
        torch.cuda.reset_peak_memory_stats(device)
    del prompt

    tok = logits.argmax(-1, keepdim=True)  # [B, 1], stays on the device
    decoded = [tok]
    out["cuda_graph"] = runner.graphs is not None
    say("decode")
    handed_back = dispatch.FALLBACKS.copy()
    for _ in range(plan.warmup):
        tok = runner.decode(tok).argmax(-1, keepdim=True)
        decoded.append(tok)
    sync(device)
    n = plan.decode_steps
    totals_before = cache.totals()
    step_stats, times_ms = [], []
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)] if cuda else []
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)] if cuda else []
    wall0 = time.perf_counter()
    for i in range(n):
        if cuda:
            starts[i].record()
        else:
            t0 = time.perf_counter()
        tok = runner.decode(tok).argmax(-1, keepdim=True)
        decoded.append(tok)
        if cuda:
            ends[i].record()
        else:
            times_ms.append((time.perf_counter() - t0) * 1e3)
        step_stats.append(cache.stats())
    sync(device)
    wall_ms = (time.perf_counter() - wall0) * 1e3 / n
    # op -> calls its loaded kernel handed to the torch reference in warm-up and timed steps (graph captures
    # included; a replay runs no Python): arguments the kernel does not take
    out["decode_reference_calls"] = dict(dispatch.FALLBACKS - handed_back)
    if plan.profile_steps and cuda:
        from tailorkv.engine.bench.stages import profile_steps
        say("profile")
        last = [tok]

        def one_step(r=runner):
            last[0] = r.decode(last[0]).argmax(-1, keepdim=True)
        out["stages"] = profile_steps(one_step, plan.profile_steps)
        out["stages"]["cuda_graph"] = runner.graphs is not None
    if cuda:
        times_ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        out["peak_device_decode_bytes"] = torch.cuda.max_memory_allocated(device)
        out["peak_device_bytes"] = max(out["peak_device_prefill_bytes"], out["peak_device_decode_bytes"])
        out["peak_reserved_bytes"] = max(out["peak_reserved_prefill_bytes"], torch.cuda.max_memory_reserved(device))
    else:
        out.update(peak_device_bytes=None, peak_device_prefill_bytes=None, peak_device_decode_bytes=None,
                   peak_reserved_bytes=None, peak_reserved_prefill_bytes=None, device_baseline_bytes=None)
    out["decode_ms"] = {"median": statistics.median(times_ms), "p90": percentile(times_ms, 90),
                        "mean": statistics.fmean(times_ms), "min": min(times_ms), "max": max(times_ms),
                        "wall_mean": wall_ms, "steps": n}
    out["kv_device_bytes"] = cache.device_bytes()
    out["kv_host_bytes"] = cache.host_bytes()
    out["host_rss_bytes"] = process_rss()
    out["stats"] = _median_stats(step_stats)
    totals = cache.totals()
    out["row_cache"] = None
    # the plan counts every chosen row; a row cache reads only the new ones: all the fetched bytes of sketch-ahead's
    # K/V rows, the K^T part of the paper path's
    for counters, cached in ((("rows_read", "rows_chosen"), None), (("kt_rows_read", "kt_rows_chosen"), "kt_bytes")):
        if counters[0] in totals:
            read, chosen = (totals[k] - totals_before[k] for k in counters)
            share = read / max(1, chosen)
            out["row_cache"] = {"rows_read": read, "rows_chosen": chosen, "read_share": share}
            stats = out["stats"]
            stats["bytes_fetched"] -= stats["bytes_fetched" if cached is None else cached] * (1 - share)
    out["tokens_held"] = cache.length
    out["greedy_tokens"] = torch.cat(decoded, 1)[0].tolist()  # row 0's greedy tokens, prefill's first
    out["topk_searches"] = {"searched_whole": totals["topk_searched_whole"], "selected": totals["topk_selected"]} \
        if "topk_selected" in totals else None  # since the cache's reset
    del runner, cache, logits, tok
    return out


def prefill_flops(cfg, n: int, batch: int = 1) -> dict:
    """Matmul flops of prefilling n tokens from an empty cache (exact causal attention, logits of the last token):
    dense = 2 x tokens x the projection weights; attention = q.K^T and P.V over the causal triangle."""
    hd, layers = cfg.head_dim, cfg.n_layers
    dense = 2.0 * batch * (n * layers * cfg.layer_matmul_params + cfg.dim * cfg.vocab_size)
    attention = 2.0 * 2.0 * batch * layers * cfg.n_heads * hd * n * (n + 1) / 2
    return {"dense (gemm/gemv)": dense, "attention": attention}


def floor_of(cell: dict, weight_read_bytes: int, kv_token_bytes: int, plan: BenchPlan) -> dict:
    """kv_token_bytes: K and V of one token in one layer, all batch rows."""
    stats = cell["stats"]
    if "kv_read_bytes" in stats:
        kv_read, source = float(stats["kv_read_bytes"]), "kv_read_bytes"
    elif "tokens_attended" in stats:
        kv_read, source = float(stats["tokens_attended"]) * kv_token_bytes, "tokens_attended"
    else:
        kv_read, source = float(cell["kv_device_bytes"]), "device_bytes"
    pcie = pcie_bytes(stats)
    hbm_ms = (weight_read_bytes + kv_read) / (plan.hbm_gbps * 1e9) * 1e3
    pcie_ms = pcie / (plan.pcie_gbps * 1e9) * 1e3
    floor_ms = max(hbm_ms, pcie_ms)
    return {"weight_bytes": weight_read_bytes, "kv_read_bytes": kv_read, "kv_read_source": source, "pcie_bytes": pcie,
            "hbm_gbps": plan.hbm_gbps, "pcie_gbps": plan.pcie_gbps,
            "hbm_ms": hbm_ms, "pcie_ms": pcie_ms, "floor_ms": floor_ms,
            "fraction": floor_ms / cell["decode_ms"]["median"]}


def run_cell(loaded, method: str, ctx: int, plan: BenchPlan, on_phase: Phase | None = None) -> dict:
    """One (method, ctx) measurement. Never raises for a failing method: status 'ok', 'oom' or 'error'."""
    device = loaded.model.output_weight.device
    cell: dict = {"method": method, "ctx": ctx, "batch": plan.batch, "prompt_tokens": plan.prompt_len(ctx),
                  "status": "ok", "error": None}
    free_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with torch.inference_mode():
            cell.update(_measure(loaded, plan.settings_for(method), ctx, plan, on_phase))
    except Exception as e:  # one failing cell must not stop the sweep
        cell["status"] = "oom" if is_oom(e) else "error"
        cell["error"] = f"{type(e).__name__}: {e}".strip()
        if cell["status"] == "error":
            cell["traceback"] = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-8:])
    # the exception (and the frames holding the cache) is gone here: now the memory can be returned
    free_device(device)
    if cell["status"] == "ok":
        total, read = model_bytes(loaded.model)
        ms = cell["decode_ms"]["median"]
        cell["tok_s"] = plan.batch * 1e3 / ms
        cell["pcie_bytes_per_step"] = pcie_bytes(cell["stats"])
        cell["pcie_bytes_per_token"] = cell["pcie_bytes_per_step"] / plan.batch
        cell["model_gbps"] = total * (1e3 / ms) / 1e9  # gpt-fast's figure: model bytes x steps/s
        cfg = loaded.cfg
        elt = loaded.model.output_weight.element_size()
        cell["floor"] = f = floor_of(cell, read, 2 * cfg.n_kv_heads * cfg.head_dim * elt * plan.batch, plan)
        # what the step achieves on the bytes it must read: weights + KV from HBM, and the PCIe bytes
        cell["achieved_gbps"] = (f["weight_bytes"] + f["kv_read_bytes"]) / (ms / 1e3) / 1e9
        cell["achieved_pcie_gbps"] = f["pcie_bytes"] / (ms / 1e3) / 1e9
    return cell


WARM_CTX = 4096  # context of the untimed warm-up cells


def warm_up(loaded, plan: BenchPlan, on_phase: Callable[[str, int, str], None] | None = None,
            force: bool = False) -> list[dict]:
    """On a GPU (or with force): one short untimed cell per method before the sweep, so the first timed cell
    does not pay for compiling the CUDA kernels, creating the cuBLAS/cuDNN handles and the first graph capture
    (measured on the H200: tailorkv's 8k prefill took 2.66 s as a process's first cell, 0.55 s after one)."""
    if loaded.model.output_weight.device.type != "cuda" and not force:
        return []
    small = replace(plan, ctxs=[], decode_steps=2, warmup=2, profile_steps=0, profile_prefill=False)
    ctx = min([WARM_CTX, *plan.ctxs])
    out = []
    for method in plan.methods:
        phase = (lambda s, m=method: on_phase(m, ctx, f"warm-up: {s}")) if on_phase else None
        out.append(run_cell(loaded, method, ctx, small, phase))
    return out


def run_sweep(loaded, plan: BenchPlan, on_cell: Callable[[dict], None] | None = None,
              on_phase: Callable[[str, int, str], None] | None = None) -> list[dict]:
    """Every (ctx, method) cell, contexts outer so each context's methods sit together, after warm_up."""
    warm_up(loaded, plan, on_phase)
    cells = []
    for ctx in plan.ctxs:
        for method in plan.methods:
            phase = (lambda s, m=method, c=ctx: on_phase(m, c, s)) if on_phase else None
            cell = run_cell(loaded, method, ctx, plan, phase)
            cells.append(cell)
            if on_cell:
                on_cell(cell)
    return cells


# --- the results file --------------------------------------------------------------------------------------

def model_info(loaded) -> dict:
    total, read = model_bytes(loaded.model)
    cfg = loaded.cfg
    dtype = loaded.model.output_weight.dtype
    return {"name": loaded.name, "source": loaded.source, "random_weights": loaded.random,
            "dtype": str(dtype).replace("torch.", ""), "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "dim": cfg.dim, "vocab_size": cfg.vocab_size,
            "max_context": cfg.max_context, "params": sum(p.numel() for p in loaded.model.parameters()),
            "model_bytes": total, "weight_read_bytes": read,
            "kv_bytes_per_token": cfg.kv_bytes_per_token(torch.empty(0, dtype=dtype).element_size())}


def results(loaded, plan: BenchPlan, cells: list[dict], env: dict, command: str, args: dict,
            bandwidths: dict, gpu_mem_limit: int | None) -> dict:
    """bandwidths: floor_bandwidths' dict (the plan holds the values it picked)."""
    return {
        "schema": 1,
        "command": command,
        "args": args,
        "env": env,
        "model": model_info(loaded),
        "bench": {"ctxs": plan.ctxs, "methods": plan.methods, "decode_steps": plan.decode_steps,
                  "warmup": plan.warmup, "batch": plan.batch, "seed": plan.seed, "margin": plan.margin,
                  **bandwidths, "hbm_gbps": plan.hbm_gbps, "pcie_gbps": plan.pcie_gbps,
                  "gpu_mem_limit_bytes": gpu_mem_limit},
        "method_settings": {m: plan.settings_for(m).to_dict() for m in plan.methods},
        "complete": len(cells) == len(plan.ctxs) * len(plan.methods),  # false: interrupted, these cells saved
        "cells": cells,
    }

"""What a run needs of the device's memory, and the key sketch's precision that fits a --gpu-mem-limit.

The estimate is the prefill's peak (the largest moment of a run: measured on the H200 for Llama-3.1-8B at 128k,
tailorkv with sketch-ahead, 18.39 GiB at 2 bits and 19.36 at 4; this model says 18.3 and 19.3): the weights (an
untied embedding table stays in pinned host memory, models/loader.py), the prompt's activations (the
residual stream, one [T, dim] buffer that the layer's input, q, the attention output and the layer's output
share, K and V, one chunk's temporaries), and what the caches keep on the device: layer 0's packed codes, the
sparse layers' sink and tail slots, the scheduler's buffers (the selection's) and, with `--select sketch` or
`sketch-ahead`, the sketch.

The top-K budget costs little device memory (the chosen rows are read from pinned host memory in place, or, with
sketch-ahead, gathered into two buffers of top-K rows, or kept per layer in a row cache: 4 MiB a layer for
Llama-3.1-8B at K 1024), so the
planner chooses only the sketch's bits: the most of 2 and 1 that fit (4 when asked for).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tailorkv.engine.settings import DEFAULT_BITS, MethodSettings

PLANNED_SKETCH_BITS = (2, 1)  # 4 bits only when asked for: twice the memory and scored bytes of 2, and slower
#                               (128k on the H200: 6.55 against 6.42 ms/token, fourteenth session)
GIB = 2 ** 30
# Kept free beyond the estimate for the caching allocator's rounding and fragmentation: on the H200 a run whose
# estimate was 19.6 GiB (Llama-3.1-8B shape, 128k, --select sketch-ahead at 1 bit) ran out of memory under a
# 20.0 GiB cap (bench/results/2026-11-30-h200-eighth-session; the prefill then still held ~1 GiB of K/V chunks
# reserved for the copy stream beyond its allocated peak, bench/results/2026-11-30-h200-ninth-session). A 2-bit
# plan estimated at 19.3 GiB has since run under that cap, with a 19.25 GiB peak (the table then on the device).
HEADROOM = GIB // 2


def weight_bytes(cfg, dtype_bytes: int) -> int:
    """The projections, the output projection (the embedding table when tied) and the norms (two per layer, one at
    the end). An untied embedding table stays in pinned host memory (models/loader.py)."""
    from tailorkv.models.loader import embeddings_on_host
    on_host = cfg.vocab_size * cfg.dim if embeddings_on_host(cfg, "cuda") else 0
    return dtype_bytes * (cfg.params - on_host)


def prefill_activation_bytes(cfg, tokens: int, batch: int, dtype_bytes: int, kt_bits: int = 16) -> int:
    """A prompt's largest moment in a layer (models/llama.py): the residual stream, the layer's input (which its q,
    then the attention output, then the layer's output overwrite, where q is as wide as the input and the prompt
    longer than one chunk; else the stacked q/k/v output and the attention output beside it), K and V, and one
    chunk's temporaries: the MLP's, and the two staging slots of the sparse layers' copies to the host (with an
    8-bit K^T, its e4m3 slots too)."""
    from tailorkv.engine.policies.sparse import STORE_CHUNK
    from tailorkv.models.llama import MLP_CHUNK
    hd, q_width = cfg.head_dim, cfg.n_heads * cfg.head_dim
    kv_width = 2 * cfg.n_kv_heads * hd
    if tokens > MLP_CHUNK and q_width == cfg.dim:
        per_token = 2 * cfg.dim + kv_width
    else:
        per_token = cfg.dim + q_width + kv_width + q_width
    mlp = min(tokens, MLP_CHUNK) * 3 * cfg.hidden_dim
    staging = 2 * min(tokens, STORE_CHUNK) * (kv_width + cfg.n_kv_heads * hd)   # K and V, and K^T on the paper's path
    e4m3 = 2 * min(tokens, STORE_CHUNK) * cfg.n_kv_heads * hd if kt_bits == 8 else 0
    return dtype_bytes * batch * (tokens * per_token + mlp + staging) + batch * e4m3 + 4 * batch * cfg.vocab_size


def sketch_bytes(cfg, ctx: int, sink: int, bits: int, group: int, batch: int) -> int:
    """One sparse layer's KeySketch (its middle: the context less the sink)."""
    from tailorkv.engine.policies.sketch import KeySketch
    return KeySketch.bytes_for(batch, cfg.n_kv_heads, cfg.head_dim, ctx - sink, bits, group)


def quant_layer_bytes(cfg, settings: MethodSettings, ctx: int, batch: int, dtype_bytes: int) -> int:
    """A 1/2-bit layer's buffers, as the policy allocates them (QuantCache.buffers)."""
    import torch
    from tailorkv.engine.policies.quant import QuantCache
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    return QuantCache.bytes_for(batch, cfg.n_kv_heads, cfg.head_dim, ctx, settings.bits or DEFAULT_BITS,
                                settings.group, settings.residual, dtype)


def sparse_layer_bytes(cfg, settings: MethodSettings, ctx: int, batch: int, dtype_bytes: int) -> int:
    """A sparse layer's sink and tail slots and max|K|, and its share of the scheduler's buffers (predict_ahead + 1
    sets, by layer, each for the largest step: the paper's K^T rows of r channels and fp32 scores over the
    middle; sketch-ahead's top-K positions and gathered K/V rows, or with its row caches the positions only; the
    synchronous sketch has none) and the layer's row cache if on (sketch-ahead's, or the paper path's K^T rows)."""
    from tailorkv.engine.policies.row_cache import RowCache
    from tailorkv.engine.policies.sketch import SketchSelector
    from tailorkv.engine.policies.sparse import FLUSH
    hd, kv = cfg.head_dim, cfg.n_kv_heads
    slots = 2 * (settings.sink + settings.recent + FLUSH) * hd * dtype_bytes + 8 * hd
    rows = 0
    if settings.select == "sketch-ahead":
        buffers = settings.topk * 8
        if SketchSelector.REUSE_ROWS:  # each layer's own
            rows = RowCache.bytes_for(batch, kv, settings.topk, 2 * hd * dtype_bytes)
        else:
            buffers += settings.topk * 2 * hd * dtype_bytes  # the gathered rows, two sets
    elif settings.sketched:
        buffers = 0
    else:
        r = min(settings.channels, hd)
        kt = dtype_bytes if settings.kt_bits == 16 else 1
        middle = max(0, ctx - settings.sink)
        if settings.kt_cache:  # each layer's own K^T rows; the sets keep the scores and channels
            rows = RowCache.bytes_for(batch, kv, r, ctx * kt)
            buffers = middle * 4 + 8 * r
        else:
            buffers = middle * (r * kt + 4) + 8 * r  # + the r channel indices
    return batch * kv * slots + rows + (settings.predict_ahead + 1) * batch * kv * buffers // max(1, cfg.n_layers)


@dataclass
class Estimate:
    weights: int
    activations: int
    sketch: int
    other: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.sketch + self.other

    def describe(self) -> str:
        return (f"{self.total / GIB:.1f} GiB (weights {self.weights / GIB:.1f}, prefill activations "
                f"{self.activations / GIB:.1f}, sketch {self.sketch / GIB:.2f}, caches {self.other / GIB:.2f})")


def estimate(cfg, settings: MethodSettings, layer_names: list[str], ctx: int, batch: int = 1,
             dtype_bytes: int = 2) -> Estimate:
    """The prefill's device peak of a tailorkv run at context ctx (the other methods are not modelled)."""
    sparse = layer_names.count("sparse")
    sketch = sparse * sketch_bytes(cfg, ctx, settings.sink, settings.sketch_bits, settings.group, batch) \
        if settings.sketched else 0
    other = (layer_names.count("quant") * quant_layer_bytes(cfg, settings, ctx, batch, dtype_bytes)
             + layer_names.count("full") * 2 * batch * cfg.n_kv_heads * ctx * cfg.head_dim * dtype_bytes
             + sparse * sparse_layer_bytes(cfg, settings, ctx, batch, dtype_bytes))
    q_rows = cfg.n_heads * cfg.head_dim  # --predict-weights fp8: a byte per W_q weight and a scale per row
    copies = cfg.n_layers * q_rows * (cfg.dim + 4) if settings.predict_weights == "fp8" else 0
    kt_bits = 16 if settings.sketched else settings.kt_bits
    return Estimate(weight_bytes(cfg, dtype_bytes) + copies,
                    prefill_activation_bytes(cfg, ctx, batch, dtype_bytes, kt_bits), sketch, other)


@dataclass
class SketchPlan:
    bits: int
    estimate: Estimate
    fits: bool
    message: str


def plan_sketch_bits(cfg, settings: MethodSettings, layer_names: list[str], ctx: int, limit: int,
                     batch: int = 1, dtype_bytes: int = 2, chosen: bool = False) -> SketchPlan:
    """The sketch's bits under a device memory limit: settings.sketch_bits when chosen by the user (checked),
    else the most of PLANNED_SKETCH_BITS whose estimate fits with HEADROOM to spare (the fewest when none does)."""
    def at(bits):
        return estimate(cfg, replace(settings, sketch_bits=bits), layer_names, ctx, batch, dtype_bytes)
    cap = f"{limit / GIB:.1f} GiB"
    if chosen:
        est = at(settings.sketch_bits)
        fits = est.total + HEADROOM <= limit
        verdict = "fits" if fits else "does not fit: expect running out of memory (fewer --sketch-bits, or --select channels)"
        return SketchPlan(settings.sketch_bits, est, fits,
                          f"memory plan: --sketch-bits {settings.sketch_bits} needs ~{est.describe()}, {verdict} in {cap}")
    for bits in PLANNED_SKETCH_BITS:
        est = at(bits)
        if est.total + HEADROOM <= limit:
            return SketchPlan(bits, est, True, f"memory plan: --sketch-bits {bits} chosen for {cap}: ~{est.describe()}")
    bits = PLANNED_SKETCH_BITS[-1]
    est = at(bits)
    return SketchPlan(bits, est, False, f"memory plan: even --sketch-bits {bits} needs ~{est.describe()}, more "
                                        f"than {cap}: expect running out of memory (--select channels needs "
                                        f"{(est.total - est.sketch) / GIB:.1f} GiB)")


def plan_settings(settings: MethodSettings, cfg, family: dict, ctx: int, limit: int | None, dtype_bytes: int,
                  chosen: bool, batch: int = 1) -> tuple[MethodSettings, SketchPlan | None]:
    """For `run` and `bench`: tailorkv with --select sketch under a --gpu-mem-limit gets the plan's bits (unless
    the user chose them: then they are checked); -> (settings, the plan, whose message says what was chosen) or
    (settings, None) when there is nothing to plan."""
    if settings.method != "tailorkv" or not settings.sketched or not limit:
        return settings, None
    from tailorkv.engine.methods import layer_policies
    names = layer_policies(settings, cfg.n_layers, family)
    plan = plan_sketch_bits(cfg, settings, names, ctx, limit, batch, dtype_bytes, chosen)
    return replace(settings, sketch_bits=plan.bits), plan

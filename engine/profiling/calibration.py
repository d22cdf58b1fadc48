"""Offline layer identification (TailorKV method point 1): how widely does each layer attend?

For each layer we take the last n_q queries of a calibration prompt, compute softmax(q K^T / sqrt(D)) per query
head over every key with the causal mask (row i, at position T - n_q + i, sees keys 0 .. T - n_q + i), keep the
top k keys of each row and measure the attention mass they hold:

    P = 1 - mean over (heads, rows) of the kept mass          (the paper's n_q - sum, normalized by n_q)

A layer whose few top keys hold nearly all the mass (P small) is sparsity-friendly; a layer that spreads its
attention (P > tau, 0.2 in the paper) is quantization-friendly, i.e. it gets the dense, low-bit cache.

Choices, written down:
- k = max(1, ceil(top * T)), T the total key count of the prompt (the paper's "5% of the keys"), the same k for
  every row. The last rows see T - n_q + 1 .. T keys, so for T >> n_q the difference to "5% of the keys the
  row can see" is below 1%. Masked keys have probability 0, so a k larger than a row's visible keys only keeps
  the whole row (mass 1).
- The causal mask is applied (the reference code omits it, which lets the last queries "see" the few keys
  after them and changes P).
- Scores and softmax in float32 whatever the model dtype; GQA is handled per KV head (each query head h reads
  KV head h // group), one KV head at a time, so memory is [group * n_q, T] floats, never [T, T].
- If the prompt is shorter than n_q, all of its queries are used.

Prediction quality (for TailorKV's one-layer-early query): for the same last n_q rows, layer l's query predicted
from layer l - 1's normalized input (layer l's W_q and RoPE applied to it) against layer l's true query: the
cosine per (query head, row), averaged. Layer 0 has no layer before it (None).
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from tailorkv.engine.errors import InputError
from tailorkv.engine.cache import LayerCache, LayerSpec, ModelCache
from tailorkv.engine.runner import Runner
from tailorkv.ops.attention import causal_attention, group_probs

DEFAULT_N_Q = 32
DEFAULT_TOP = 0.05
DEFAULT_TAU = 0.2


def top_k_count(n_keys: int, top: float) -> int:
    """Keys kept per query row: ceil(top * n_keys), at least 1 (rounded first so 0.05 * 4000 gives 200)."""
    return max(1, math.ceil(round(top * n_keys, 9)))


def layer_p(q: torch.Tensor, k: torch.Tensor, n_q: int = DEFAULT_N_Q, top: float = DEFAULT_TOP,
            q_offset: int | None = None) -> float:
    """P of one layer as a float; see layer_p_tensor."""
    return float(layer_p_tensor(q, k, n_q, top, q_offset))


def layer_p_tensor(q: torch.Tensor, k: torch.Tensor, n_q: int = DEFAULT_N_Q, top: float = DEFAULT_TOP,
                   q_offset: int | None = None) -> torch.Tensor:
    """P of one layer, a 0-dim float64 tensor on q's device (no host sync inside the layer loop).
    q [B, Hq, Tq, D] (roped) at positions q_offset.., k [B, Hkv, Tk, D] at positions 0..Tk-1; q_offset
    defaults to Tk - Tq (the queries are the last ones of the prompt). Uses the last min(n_q, Tq) queries and
    all Tk keys, causally masked; averages over batch, heads and rows."""
    b, hq, tq, _ = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if q_offset is None:
        q_offset = tk - tq
    rows = min(n_q, tq)
    kk = top_k_count(tk, top)
    q_last = q[:, :, tq - rows:]
    kept = torch.zeros((), dtype=torch.float64, device=q.device)
    for h in range(hkv):
        probs = group_probs(q_last, k, h, q_offset + tq - rows)  # [B, G, rows, Tk]
        kept = kept + torch.topk(probs, kk, dim=-1, sorted=False).values.sum(dtype=torch.float64)
        del probs
    return (1.0 - kept / (b * hq * rows)).clamp(0.0, 1.0)  # float rounding can step a hair outside [0, 1]


class CalibrationCache(LayerCache):
    """Prefill-only layer policy for calibration: plain causal attention over the prompt (the same output as
    the full cache) while it measures this layer's P. It keeps no KV after the call, so calibrating a long
    prompt holds one layer's K and V at a time; decoding after it is not supported."""

    name = "calibration"

    def __init__(self, spec: LayerSpec, n_q: int = DEFAULT_N_Q, top: float = DEFAULT_TOP):
        super().__init__(spec)
        self.n_q, self.top = n_q, top
        self.p_tensor: torch.Tensor | None = None
        self.n_keys = 0
        self.q_hat: torch.Tensor | None = None  # the last rows' query predicted from the layer before
        self.cos_tensor: torch.Tensor | None = None

    @property
    def p(self) -> float | None:
        return None if self.p_tensor is None else float(self.p_tensor)

    def run(self, q, k, v, step):
        if step.start != 0:
            raise RuntimeError("calibration takes the whole prompt in one prefill call")
        self.p_tensor = layer_p_tensor(q, k, self.n_q, self.top, q_offset=0)
        self.n_keys = k.shape[2]
        if self.q_hat is not None:
            rows = self.q_hat.shape[2]
            self.cos_tensor = torch.cosine_similarity(self.q_hat.float(), q[:, :, -rows:].float(), dim=-1).mean()
            self.q_hat = None
        return causal_attention(q, k, v, 0)

    @property
    def prediction_cos(self) -> float | None:
        return None if self.cos_tensor is None else float(self.cos_tensor)

    def reset(self) -> None:
        super().reset()
        self.p_tensor = self.cos_tensor = self.q_hat = None


class CalibrationModelCache(ModelCache):
    """Hands each layer the prediction of its last n_q rows' query from the layer before's input."""

    def layer_input(self, i, x, step):
        super().layer_input(i, x, step)
        nxt = i + 1
        if self.query_fn is not None and nxt < len(self.layers):
            rows = min(self.layers[nxt].n_q, x.shape[1])
            self.layers[nxt].q_hat = self.query_fn(nxt, x[:, -rows:], step.positions[-rows:])


def calibration_cache(cfg, n_q: int, top: float, batch: int, device, dtype, max_len: int,
                      query_fn=None) -> ModelCache:
    """query_fn: the model's project_query, to measure the one-layer-early prediction (else not measured)."""
    layers = [CalibrationCache(LayerSpec(i, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, max_len, batch, dtype,
                                         torch.device(device)), n_q, top)
              for i in range(cfg.n_layers)]
    return CalibrationModelCache(layers, query_fn=query_fn, method="calibration")


def quant_layers_of(p: list[float], tau: float) -> list[int]:
    """Quantization-friendly layers: P > tau."""
    return [i for i, x in enumerate(p) if x > tau]


TAU_FLOOR = 1e-3  # fp32 sums of a row's kept mass leave P ~1e-7 on a layer that keeps all of it


def validate(n_q: int, top: float, tau: float) -> None:
    """The settings' ranges, each refusal one line naming the range and an example."""
    allowed = f"give a tau in [{TAU_FLOOR:g}, 1), e.g. --tau {DEFAULT_TAU:g}"
    if not TAU_FLOOR <= tau < 1.0:
        if tau >= 1.0:
            why = "P is at most 1, so no layer would be quantization-friendly"
        elif tau <= 0.0:
            why = "P is at least 0, so every layer would be quantization-friendly"
        elif tau > 0.0:
            why = (f"a P below {TAU_FLOOR:g} is within the rounding of the attention sums (a layer whose top keys hold "
                   f"all of its attention would pass it)")
        else:
            why = "it is not a number"
        raise InputError(f"--tau {tau:g} is outside [{TAU_FLOOR:g}, 1): {why}: {allowed}")
    example = f"e.g. --top {DEFAULT_TOP:g} (the top {DEFAULT_TOP:.0%} of the keys)"
    if top >= 1.0:
        raise InputError(f"--top {top:g} keeps every key, so P would be 0 in every layer (--top is the fraction of "
                         f"the keys kept per query row, in (0, 1)): give a fraction below 1, {example}")
    if not top > 0.0:
        why = "is not a number" if math.isnan(top) else "keeps no key"
        raise InputError(f"--top {top:g} {why} (--top is the fraction of the keys kept per query row, in (0, 1)): "
                         f"give a fraction above 0, {example}")
    if n_q < 1:
        raise InputError(f"--n-q {n_q} gives no query rows: use at least 1, e.g. --n-q {DEFAULT_N_Q}")


def profile_model(loaded, text_ids, n_q: int = DEFAULT_N_Q, top: float = DEFAULT_TOP, tau: float = DEFAULT_TAU,
                  progress: Callable[[int, int], None] | None = None) -> dict:
    """Run one calibration prefill of text_ids (list of ids, or a [T] / [B, T] tensor) through loaded.model and
    return {"P": [...], "prediction_cos": [...], "quant_layers": [...], "layer_types": [...], "tau", "n_q", "top",
    "top_k", "tokens"}.
    progress(done, n_layers) is called as layers complete."""
    validate(n_q, top, tau)
    model, cfg = loaded.model, loaded.cfg
    device = model.output_weight.device
    ids = torch.as_tensor(text_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.numel() == 0 or ids.shape[1] < 1:
        raise InputError("the calibration text is empty: give --data a file with text in it")
    n_tok = ids.shape[1]
    if n_tok > cfg.max_context:
        raise InputError(f"the calibration prompt has {n_tok} tokens but {loaded.name} supports "
                         f"{cfg.max_context}: lower --length")
    cache = calibration_cache(cfg, n_q, top, ids.shape[0], device, model.output_weight.dtype, n_tok,
                              query_fn=model.project_query)
    n_layers = cfg.n_layers
    if progress is not None:
        cache.on_layer = lambda i, n: progress(i, n)
    Runner(model, cache, use_cuda_graph=False).prefill(ids.to(device))
    if progress is not None:
        progress(n_layers, n_layers)
    p = [float(layer.p) for layer in cache.layers]
    quant = quant_layers_of(p, tau)
    return {
        "P": p,
        "prediction_cos": [layer.prediction_cos for layer in cache.layers],
        "quant_layers": quant,
        "layer_types": ["quant" if i in set(quant) else "sparse" for i in range(n_layers)],
        "tau": tau,
        "n_q": n_q,
        "rows": min(n_q, n_tok),
        "top": top,
        "top_k": top_k_count(n_tok, top),
        "tokens": n_tok,
    }

"""The memory planner's estimate against the H200 measurement, and its choice of the sketch's bits."""
from dataclasses import replace

import pytest

from tailorkv.engine.memory_plan import GIB, estimate, plan_settings, plan_sketch_bits, sketch_bytes
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.config import ModelConfig

LLAMA8B = ModelConfig(name="llama", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden_dim=14336,
                      vocab_size=128256, max_context=131072)
NAMES = ["quant"] + ["sparse"] * 31
TKV = MethodSettings(method="tailorkv", bits=1)


def test_estimate_matches_the_measured_peak_at_128k():
    # bench/results/2026-12-01-h200-fourteenth-session: tailorkv --select sketch-ahead at 131036 prompt tokens, the
    # embedding table in pinned host memory: peak with prefill 18.39 GiB (2 bits) and 19.36 GiB (4 bits). The
    # paper's channels: 18.21 GiB with the table on the device (ninth session), less the table's 0.98 GiB.
    e = estimate(LLAMA8B, replace(TKV, select="sketch-ahead", sketch_bits=2), NAMES, 131036)
    assert abs(e.total / GIB - 18.39) < 0.2 and abs(e.sketch / GIB - 1.21) < 0.01
    assert abs(estimate(LLAMA8B, replace(TKV, select="sketch-ahead", sketch_bits=4), NAMES, 131036).total / GIB
               - 19.36) < 0.2
    assert abs(estimate(LLAMA8B, TKV, NAMES, 131036).total / GIB - (18.21 - 0.98)) < 0.2
    assert abs(e.weights / 1e9 - 15.01) < 0.01          # 8.03e9 parameters less the 0.53e9 of the host table, bf16
    assert estimate(LLAMA8B, TKV, NAMES, 131036).sketch == 0
    # sixteenth session: --predict-weights fp8 (e4m3 copies of every layer's W_q) peaked at 19.86 GiB, 4 bits
    fp8 = estimate(LLAMA8B, replace(TKV, select="sketch-ahead", sketch_bits=4, predict_weights="fp8"), NAMES, 131036)
    assert abs(fp8.total / GIB - 19.86) < 0.2 and abs((fp8.weights - e.weights) / GIB - 0.5) < 0.01


@pytest.mark.parametrize("bits", [1, 2])
def test_quant_layer_bytes_are_the_quant_cache_buffers(bits):
    import torch
    from tailorkv.engine.cache import LayerSpec
    from tailorkv.engine.memory_plan import quant_layer_bytes
    from tailorkv.engine.policies.quant import QuantCache
    cfg = ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=100)
    s = MethodSettings(method="tailorkv", bits=bits)
    spec = LayerSpec(0, 4, 2, cfg.head_dim, 1000, 2, torch.bfloat16, torch.device("cpu"))
    built = QuantCache(spec, s).device_bytes()
    assert quant_layer_bytes(cfg, s, 1000, 2, 2) == built
    assert built > 2 * 2 * (s.residual + s.residual + 1) * cfg.head_dim * 2  # more than its exact rows alone


def test_sketch_bytes_are_the_key_sketch_buffers():
    import torch
    from tailorkv.engine.cache import LayerSpec
    from tailorkv.engine.policies.sketch import KeySketch
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=100)
    for bits in (1, 2, 4):
        spec = LayerSpec(1, 4, 2, cfg.head_dim, 1000, 2, torch.float32, torch.device("cpu"))
        assert sketch_bytes(cfg, 1000, 8, bits, 64, 2) == KeySketch(spec, bits, 64, 1000 - 8).device_bytes()


def test_plan_takes_the_most_bits_that_fit():
    sk = replace(TKV, select="sketch")
    assert plan_sketch_bits(LLAMA8B, sk, NAMES, 131072, 24 * GIB).bits == 2
    assert plan_sketch_bits(LLAMA8B, sk, NAMES, 131072, int(18.9 * GIB)).bits == 2   # 2 bits: 18.3 GiB estimated
    p = plan_sketch_bits(LLAMA8B, sk, NAMES, 131072, int(18.5 * GIB))
    assert p.bits == 1 and p.fits and "--sketch-bits 1 chosen" in p.message      # 1 bit: 17.8
    p = plan_sketch_bits(LLAMA8B, sk, NAMES, 131072, int(18.2 * GIB))
    assert p.bits == 1 and not p.fits and "expect running out of memory" in p.message
    assert "--select channels needs 17.1 GiB" in p.message
    p = plan_sketch_bits(LLAMA8B, replace(sk, sketch_bits=4), NAMES, 131072, 20 * GIB, chosen=True)
    assert p.bits == 4 and p.fits and "fits in 20.0 GiB" in p.message             # 4 bits: 19.3
    p = plan_sketch_bits(LLAMA8B, replace(sk, sketch_bits=4), NAMES, 131072, int(19.5 * GIB), chosen=True)
    assert p.bits == 4 and not p.fits and "does not fit" in p.message


def test_only_tailorkv_with_a_sketch_and_a_limit_is_planned():
    family = {"quant_layers": [0]}
    for s, limit in ((TKV, 24 * GIB), (replace(TKV, select="sketch"), None), (MethodSettings(method="full"), GIB)):
        assert plan_settings(s, LLAMA8B, family, 131072, limit, 2, chosen=False) == (s, None)
    s, plan = plan_settings(replace(TKV, select="sketch", sketch_bits=4), LLAMA8B, family, 131072, int(18.5 * GIB), 2,
                            False)
    assert s.sketch_bits == 1 and plan.message.startswith("memory plan: --sketch-bits 1")


@pytest.mark.parametrize("reuse", [False, True])
def test_the_selection_buffers_counted_are_the_ones_each_selector_asks_for(reuse, monkeypatch):
    """The sparse layers' scheduler buffers in the estimate are those each selector asks the scheduler for at the
    largest step (two sets shared by all layers): the paper's K^T rows and scores over the middle, none for the
    synchronous sketch, top-K positions and gathered rows for sketch-ahead, only the positions with its row cache),
    and the row caches (each layer's own: sketch-ahead's K/V rows, the paper path's K^T rows, --kt-cache) when on."""
    from tailorkv.engine.policies.sketch import SketchSelector
    monkeypatch.setattr(SketchSelector, "REUSE_ROWS", reuse)
    import math
    import torch
    from tailorkv.engine.cache import LayerSpec
    from tailorkv.engine.memory_plan import sparse_layer_bytes
    from tailorkv.engine.policies.sparse import SparseOffloadCache
    cfg = ModelConfig(name="small", dim=256, n_layers=4, n_heads=8, n_kv_heads=2, hidden_dim=512, vocab_size=100,
                      max_context=2048)
    ctx, base = 1000, MethodSettings(method="tailorkv", budget=96, sink=8, recent=24, channels=4, kt_cache=reuse)
    spec = LayerSpec(1, 8, 2, cfg.head_dim, ctx, 1, torch.bfloat16, torch.device("cpu"))
    none = sparse_layer_bytes(cfg, replace(base, select="sketch"), ctx, 1, 2)
    for select in ("channels", "sketch", "sketch-ahead"):
        s = replace(base, select=select)
        layer = SparseOffloadCache(spec, s)
        asked = sum(math.prod(most) * torch.empty(0, dtype=dt).element_size()
                    for _, most, dt in layer.selector.buffers(layer).values())
        own = layer.selector.device_bytes()
        assert (select in ("sketch-ahead", "channels") and reuse) == (own > 0)
        assert sparse_layer_bytes(cfg, s, ctx, 1, 2) - none == 2 * asked // cfg.n_layers + own, select

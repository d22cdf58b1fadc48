"""The sparse-offload policy (TailorKV's sparsity-friendly layers) and its selection ops (CPU, fp32).

Inputs are random with a fresh seed per run (shown beside a failure; set TAILORKV_SEED to replay one)."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

import tailorkv.engine.policies.sparse as sparse
from tailorkv.engine.cache import LayerSpec, ModelCache
from tailorkv.engine.policies.full import FullCache
from tailorkv.engine.policies.sketch import SketchSelector
from tailorkv.engine.policies.sparse import SparseOffloadCache
from tailorkv.engine.policies.selection import ChannelSelector, ObservedSelector
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.engine.step import fine_bucket
from tailorkv.ops.attention import attention_with_mask
from tailorkv.ops.host_gather import gather_rows
from tailorkv.ops.sparse_select import approx_scores, channel_scores, topk_channels, topk_tokens
from helpers import SEED, One, rel_err

GQA = [(9, 3), (8, 2), (4, 4)]


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(SEED + zlib.crc32(request.node.name.encode()))


@pytest.fixture
def small_flush(monkeypatch):
    monkeypatch.setattr(sparse, "FLUSH", 5)  # flush every few steps instead of every 128


def spec_of(hq, hkv, D=16, B=1, max_len=256):
    return LayerSpec(1, hq, hkv, D, max_len, B, torch.float32, torch.device("cpu"))


def settings(**kw):
    return MethodSettings(method="tailorkv", **{"sink": 4, "recent": 8, "budget": 1024, "channels": 4, **kw})


def qkv(g, B, hq, hkv, T, D):
    q = torch.randn(B, hq, T, D, generator=g)
    k = torch.randn(B, hkv, T, D, generator=g) * torch.exp(torch.randn(D, generator=g))  # outlier channels
    v = torch.randn(B, hkv, T, D, generator=g)
    return q, k, v


def check_regions(cache: SparseOffloadCache, K, V, kmax_exact=True):
    """Every held token in exactly one region, each region's storage holding the right values."""
    r = cache.regions()
    pos = list(r["sink"]) + list(r["middle"]) + list(r["tail"])
    assert pos == list(range(cache.length))
    assert len(r["tail"]) <= cache.recent + sparse.FLUSH
    s, m, t = r["sink"], r["middle"], r["tail"]
    assert torch.equal(cache.dev_k[:, :, :len(s)], K[:, :, s.start:s.stop])
    assert torch.equal(cache.dev_v[:, :, :len(s)], V[:, :, s.start:s.stop])
    assert torch.equal(cache.host_k[:, :, m.start:m.stop], K[:, :, m.start:m.stop])
    assert torch.equal(cache.host_v[:, :, m.start:m.stop], V[:, :, m.start:m.stop])
    assert torch.equal(cache.kt.host[:, :, :, m.start:m.stop], K[:, :, m.start:m.stop].transpose(2, 3))
    S = cache.sink
    assert torch.equal(cache.dev_k[:, :, S:S + len(t)], K[:, :, t.start:t.stop])
    assert torch.equal(cache.dev_v[:, :, S:S + len(t)], V[:, :, t.start:t.stop])
    held_k, held_v = cache.held_kv()
    assert torch.equal(held_k, K[:, :, :cache.length]) and torch.equal(held_v, V[:, :, :cache.length])
    if kmax_exact:  # after a truncation max|K| may over-estimate (it keeps the dropped tokens)
        assert torch.equal(cache.kmax_before(), K.abs().amax(2))


# --- (a) a budget covering the context reproduces `full`, across tail flushes ------------------------------
@pytest.mark.parametrize("hq,hkv", GQA)
def test_big_budget_equals_full(gen, small_flush, hq, hkv):
    B, D, P = 2, 16, 40
    spec = spec_of(hq, hkv, D, B)
    sp, full = One(SparseOffloadCache(spec, settings(budget=spec.max_len))), One(FullCache(spec))
    q, k, v = qkv(gen, B, hq, hkv, P, D)
    assert rel_err(sp.attend(q, k, v, 0), full.attend(q, k, v, 0)) < 1e-5
    flushed = 0
    for step in range(20):
        q, k, v = qkv(gen, B, hq, hkv, 1, D)
        if step % 2:
            sp.predict_query(torch.randn(B, hq, 1, D, generator=gen))
        mid_before = len(sp.regions()["middle"])
        out = sp.attend(q, k, v, P + step)
        flushed += len(sp.regions()["middle"]) > mid_before
        assert sp.stats()["middle_tokens"] == mid_before and sp.stats()["tokens_fetched"] == mid_before
        assert rel_err(out, full.attend(q, k, v, P + step)) < 1e-5
    assert flushed >= 2 and sp.length == full.length == P + 20


def test_a_budget_far_past_the_context_reads_only_the_middles_bucket(gen, small_flush):
    """Each step's whole middle is read over its bucket, not over the budget: a budget of 100,000 tokens costs
    a 40-token context what a budget of 256 does."""
    B, hq, hkv, D, P = 1, 4, 2, 16, 40
    spec = spec_of(hq, hkv, D, B)
    sp, full = One(SparseOffloadCache(spec, settings(budget=100_000))), One(FullCache(spec))
    widths = []
    sp.policy.selector = ObservedSelector(sp.policy.selector, lambda layer, q1, pos: widths.append(pos.shape[-1]))
    q, k, v = qkv(gen, B, hq, hkv, P, D)
    sp.attend(q, k, v, 0), full.attend(q, k, v, 0)
    row = B * hkv * D * 4
    for step in range(12):
        q, k, v = qkv(gen, B, hq, hkv, 1, D)
        mid = len(sp.regions()["middle"])
        assert rel_err(sp.attend(q, k, v, P + step), full.attend(q, k, v, P + step)) < 1e-5
        assert widths[-1] == fine_bucket(mid) == 256 and sp.stats()["bytes_fetched"] == 2 * 256 * row
    assert len(widths) == 12


# --- (b) with all channels, the chosen top-K is the exact top-K ---------------------------------------------
@pytest.mark.parametrize("hq,hkv", GQA)
def test_all_channels_gives_exact_topk(gen, hq, hkv):
    B, D, N, K = 2, 16, 300, 24
    q, k, _ = qkv(gen, B, hq, hkv, N, D)
    q = q[:, :, :1]
    chans = topk_channels(channel_scores(q, k.abs().amax(2)), D)
    rows = gather_rows(k.transpose(2, 3).contiguous(), chans, torch.device("cpu"))
    got = topk_tokens(approx_scores(q, rows, chans), K)
    exact = (q.reshape(B, hkv, hq // hkv, D) @ k.transpose(2, 3)).sum(2)  # [B, Hkv, N]
    want = exact.topk(K, dim=-1).indices
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)


@pytest.mark.parametrize("hq,hkv", GQA)
def test_decode_attends_sink_topk_tail(gen, small_flush, hq, hkv):
    """Through the cache, with r = D and the paper's rule (summed logits of the group): output = attention over
    sink + exact top-K middle + tail + new token."""
    B, D, P = 1, 16, 80
    st = settings(budget=4 + 8 + 10, channels=D, select_rule="paper")
    sp = One(SparseOffloadCache(spec_of(hq, hkv, D, B), st))
    q, K, V = qkv(gen, B, hq, hkv, P, D)
    sp.attend(q, K, V, 0)
    for step in range(8):
        q, k, v = qkv(gen, B, hq, hkv, 1, D)
        r = sp.regions()
        mid = torch.tensor(list(r["middle"]))
        exact = (q.reshape(B, hkv, hq // hkv, D) @ K[:, :, mid].transpose(2, 3)).sum(2)
        idx = mid[exact.topk(st.topk, dim=-1).indices]  # [B, Hkv, topk]
        pick = lambda X: X.gather(2, idx[..., None].expand(-1, -1, -1, D))  # noqa: E731
        keys = torch.cat([K[:, :, r["sink"].start:r["sink"].stop], pick(K), K[:, :, r["tail"].start:], k], 2)
        vals = torch.cat([V[:, :, r["sink"].start:r["sink"].stop], pick(V), V[:, :, r["tail"].start:], v], 2)
        out = sp.attend(q, k, v, P + step)
        assert rel_err(out, attention_with_mask(q, keys, vals)) < 1e-5
        s = sp.stats()
        assert s["tokens_fetched"] == st.topk and s["middle_tokens"] == len(mid)
        n = min(fine_bucket(len(mid)), sp.spec.max_len - st.sink)  # K^T rows over the bucket of the middle
        assert s["bytes_fetched"] == B * hkv * 4 * (D * n + 2 * st.topk * D)
        K, V = torch.cat([K, k], 2), torch.cat([V, v], 2)
    check_regions(sp, K, V)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])
def test_8bit_kt_store_picks_as_16_bits_do_where_e4m3_holds_the_keys(gen, small_flush, hq, hkv):
    """Keys of integers up to 8 times a power of two per channel: scaled by a power of two they are exact in
    e4m3, so the 8-bit K^T store's scores, picks and outputs equal the 16-bit store's; it holds a byte per key."""
    B, D, P = 1, 16, 150
    exps = 2.0 ** torch.randint(-4, 5, (D,), generator=gen)
    keys = lambda T: torch.randint(-8, 9, (B, hkv, T, D), generator=gen).float() * exps  # noqa: E731
    spec = spec_of(hq, hkv, D, B)
    st = dict(budget=4 + 8 + 20, channels=6)
    by_bits = {b: One(SparseOffloadCache(spec, settings(**st, kt_bits=b))) for b in (16, 8)}
    picks = {b: [] for b in by_bits}
    for b, c in by_bits.items():
        c.policy.selector = ObservedSelector(c.policy.selector, lambda layer, q1, pos, b=b: picks[b].append(pos))
    q, _, v = qkv(gen, B, hq, hkv, P, D)
    k = keys(P)
    outs = {b: c.attend(q, k, v, 0) for b, c in by_bits.items()}
    for step in range(12):
        q, _, v = qkv(gen, B, hq, hkv, 1, D)
        k = keys(1)
        outs = {b: c.attend(q, k, v, P + step) for b, c in by_bits.items()}
        assert torch.equal(picks[8][-1], picks[16][-1])
        assert rel_err(outs[8], outs[16]) < 1e-6
    assert by_bits[8].policy.kt.host.dtype == torch.float8_e4m3fn
    assert by_bits[16].policy.kt.nbytes() == 4 * by_bits[8].policy.kt.nbytes()       # fp32 keys here
    assert by_bits[8].stats()["bytes_fetched"] < by_bits[16].stats()["bytes_fetched"]


def test_8bit_kt_store_saturates_keys_past_its_scale_and_reset_sets_it_again(gen, small_flush):
    """A key far past the first write's max|K| is stored as +-448 (e4m3's largest; no NaN) and the step stays finite;
    after a reset the next prompt sets the scales from its own keys."""
    B, hq, hkv, D, P = 1, 4, 2, 16, 60
    sp = One(SparseOffloadCache(spec_of(hq, hkv, D, B), settings(budget=4 + 8 + 16, kt_bits=8)))
    q, k, v = qkv(gen, B, hq, hkv, P, D)
    sp.attend(q, k, v, 0)
    kt = sp.policy.kt
    scale = kt.scale.clone()
    assert torch.all(torch.log2(scale) == torch.log2(scale).round())          # powers of two
    mid = sp.regions()["middle"]
    stored = kt.host[:, :, :, mid.start:mid.stop].float()
    assert stored.abs().amax() <= 32 and stored.abs().amax() > 16              # max|K| maps to (16, 32]
    big = k[:, :, :P - 8] * 1000.0                                             # 1000x: past 448 / 32
    sp.policy.reset()
    sp.attend(q, torch.cat([k[:, :, :P - 8] * 1e-3, k[:, :, P - 8:]], 2), v, 0)
    sp.policy.reset()
    sp.attend(q, torch.cat([big, k[:, :, P - 8:]], 2), v, 0)                  # scales set again: not saturated
    stored = kt.host[:, :, :, mid.start:mid.stop].float()
    assert stored.abs().amax() <= 32 and not torch.equal(kt.scale, scale)
    sp.policy.reset()
    sp.attend(q, k, v, 0)
    assert torch.equal(kt.scale, scale)
    q1, k1, v1 = qkv(gen, B, hq, hkv, 1, D)
    for step in range(30):                                                     # flushes of huge keys
        out = sp.attend(q1, k1 * 1e6, v1, P + step)
        assert torch.isfinite(out).all()
    held = kt.host[:, :, :, sp.regions()["middle"]].float()
    assert not held.isnan().any() and held.abs().amax() == 448


def test_8bit_kt_store_keeps_fp16_scales_finite(gen):
    """A channel of keys all zero (max|K| 0) or tiny, in fp16: the scales stay finite and no stored key is NaN."""
    spec = LayerSpec(1, 4, 2, 16, 256, 1, torch.float16, torch.device("cpu"))
    sp = One(SparseOffloadCache(spec, settings(budget=4 + 8 + 16, kt_bits=8)))
    q, k, v = (t.half() for t in qkv(gen, 1, 4, 2, 60, 16))
    k[..., 0] = 0
    k[..., 1] *= 1e-6
    sp.attend(q, k, v, 0)
    kt = sp.policy.kt
    assert torch.isfinite(kt.scale).all() and torch.isfinite(kt.q_scale).all() and (kt.q_scale > 0).all()
    mid = sp.regions()["middle"]
    assert not kt.host[:, :, :, mid.start:mid.stop].float().isnan().any()


def test_kt_rows_gather_grid_follows_the_stores_width(gen, monkeypatch):
    """The K^T gather's grid is KT_GATHER_BLOCKS by bytes per K^T element: e4m3 rows on a few blocks (the 8-bit
    step waits on its compute stream), wider rows one block per row (0)."""
    import tailorkv.engine.policies.selection as selection
    seen, real = [], selection.gather_rows
    monkeypatch.setattr(selection, "gather_rows", lambda *a, **kw: seen.append(kw.get("blocks")) or real(*a, **kw))
    assert ChannelSelector.KT_GATHER_BLOCKS[1] > 0
    for bits, want in ((8, ChannelSelector.KT_GATHER_BLOCKS[1]), (16, 0)):
        seen.clear()
        sp = One(SparseOffloadCache(spec_of(4, 2, 16, 1), settings(budget=4 + 8 + 16, kt_bits=bits)))
        sp.attend(*qkv(gen, 1, 4, 2, 60, 16), 0)
        for step in range(3):
            sp.attend(*qkv(gen, 1, 4, 2, 1, 16), 60 + step)
        assert seen and set(seen) == {want}


# --- (c) channel selection --------------------------------------------------------------------------------
def test_channel_selection_hand_made():
    # one KV head, a group of two query heads: the mean over the group cancels channel 3 (largest max|K|)
    q = torch.tensor([[1.0, -3.0, 0.5, 2.0, 0.0, 0.1, 0.0, 0.0],
                      [1.0, 1.0, 0.5, -2.0, 0.0, 0.1, 0.0, 0.0]]).reshape(1, 2, 1, 8)
    kmax = torch.tensor([2.0, 5.0, 30.0, 100.0, 1.0, 1.0, 1.0, 1.0]).reshape(1, 1, 8)
    s = channel_scores(q, kmax)  # |[1, -1, .5, 0, 0, .1, 0, 0]| * kmax = [2, 5, 15, 0, 0, .1, 0, 0]
    assert torch.allclose(s, torch.tensor([2.0, 5.0, 15.0, 0, 0, 0.1, 0, 0]).reshape(1, 1, 8))
    assert topk_channels(s, 3).tolist() == [[[2, 1, 0]]]


def test_approx_scores_hand_made():
    q = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 0.0, -1.0, 1.0]]).reshape(1, 2, 1, 4)  # group sum [2, 2, 2, 5]
    kt = torch.arange(12.0).reshape(1, 1, 4, 3)  # K^T rows: channel c, token t = 3c + t
    chans = torch.tensor([[[3, 0]]])
    got = approx_scores(q, gather_rows(kt, chans, torch.device("cpu")), chans)
    assert torch.allclose(got, torch.tensor([[[45.0, 52.0, 59.0]]]))
    assert sorted(topk_tokens(got, 5).flatten().tolist()) == [0, 1, 2]


# --- (d) max|K| follows every token -----------------------------------------------------------------------
def test_kmax_updated_by_generated_tokens(gen, small_flush):
    B, hq, hkv, D, P = 1, 4, 2, 16, 30
    sp = One(SparseOffloadCache(spec_of(hq, hkv, D, B), settings()))
    q, K, _ = qkv(gen, B, hq, hkv, P, D)
    sp.attend(q, K, K, 0)
    assert torch.equal(sp.kmax_before(), K.abs().amax(2))
    q, k, _ = qkv(gen, B, hq, hkv, 1, D)
    k[0, 1, 0, 5] = -1000.0
    sp.attend(q, k, k, P)
    assert sp.kmax_before()[0, 1, 5] == 1000.0
    assert torch.equal(sp.kmax_before(), torch.cat([K, k], 2).abs().amax(2))


# --- (e) regions after prompts of any length, decodes, flushes, second turns, truncation --------------------
@pytest.mark.parametrize("prompt", [2, 6, 12, 17, 60])
def test_regions_bookkeeping(gen, small_flush, prompt):
    B, hq, hkv, D = 2, 4, 2, 8
    spec = spec_of(hq, hkv, D, B)
    sp, full = One(SparseOffloadCache(spec, settings(budget=spec.max_len))), One(FullCache(spec))
    K = V = torch.zeros(B, hkv, 0, D)
    for T in [prompt] + [1] * 13 + [3] + [1] * 9 + [20] + [1] * 4:
        q, k, v = qkv(gen, B, hq, hkv, T, D)
        L = sp.length
        assert rel_err(sp.attend(q, k, v, L), full.attend(q, k, v, L)) < 1e-5
        K, V = torch.cat([K, k], 2), torch.cat([V, v], 2)
        check_regions(sp, K, V)
        if T > 1 and sp.length > sp.sink:
            assert len(sp.regions()["tail"]) == min(sp.recent, sp.length - sp.sink)
    t = sp.regions()["tail"]
    sp.truncate(t.start + 1)  # cutting the tail is fine
    check_regions(sp, K[:, :, :t.start + 1], V[:, :, :t.start + 1], kmax_exact=False)
    if len(sp.regions()["middle"]):
        with pytest.raises(RuntimeError):
            sp.truncate(t.start - 1)
    sp.truncate(0)
    assert sp.length == 0 and sp.regions()["middle"] == range(sp.sink, sp.sink)


def test_byte_counts():
    spec = spec_of(8, 2, 16, 1, max_len=256)
    sp = One(SparseOffloadCache(spec, settings()))
    assert sp.host_bytes() == 3 * 2 * 256 * 16 * 4
    assert sp.device_bytes() == (2 * 4 + 2 * (8 + sparse.FLUSH)) * 2 * 16 * 4 + 2 * 2 * 16 * 4  # + two max|K|


# --- (f) the predicted query picks the channels -------------------------------------------------------------
def test_predicted_query_selects_channels(gen):
    B, hq, hkv, D, P = 1, 4, 2, 16, 64
    sp = One(SparseOffloadCache(spec_of(hq, hkv, D, B), settings(budget=4 + 8 + 6, channels=1)))
    _, K, V = qkv(gen, B, hq, hkv, P, D)
    sp.attend(torch.randn(B, hq, P, D, generator=gen), K, V, 0)
    chosen = []

    class Recording(ChannelSelector):
        def channels(self, layer, q_sel):
            chosen.append(super().channels(layer, q_sel))
            return chosen[-1]
    sp.selector = Recording("sum", "paper")
    q = torch.zeros(B, hq, 1, D)
    q[..., 5] = 1.0   # the current query points at channel 5 ...
    q_hat = torch.zeros(B, hq, 1, D)
    q_hat[..., 0] = 1.0  # ... the predicted one at channel 0
    k, v = torch.randn(B, hkv, 1, D, generator=gen), torch.randn(B, hkv, 1, D, generator=gen)
    sp.attend(q, k, v, P, q_hat=q_hat)
    sp.attend(q, k, v, P + 1)  # no prediction for this step: the current query selects
    assert chosen[0].flatten().tolist() == [0] * hkv
    assert chosen[1].flatten().tolist() == [5] * hkv
    assert sp.q_hat is None


# --- (g) the prediction for layer l uses layer l's weights on layer l-1's normalized input -----------------
def tiny_model(n_layers=3):
    from tailorkv.models.config import ModelConfig
    from tailorkv.models.loader import _random_model
    cfg = ModelConfig(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=64,
                      head_dim=32, rope_theta=10000.0)
    return cfg, _random_model(cfg, torch.device("cpu"), torch.float32, seed=SEED % 1000)


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_prediction_uses_next_layers_weights(gen, ahead):
    """Layer l's query is predicted with its own q weights from the input of layer l - predict_ahead (layer 1 from
    layer 0's, layers 2 .. predict_ahead + 1 from layer 1's), and the scheduler keeps predict_ahead + 1 buffer
    sets."""
    from tailorkv.engine.methods import build_cache
    from tailorkv.models.loader import LoadedModel
    cfg, model = tiny_model(n_layers=5)
    st = MethodSettings(method="tailorkv", quant_layers=[0], sink=2, recent=4, budget=10, channels=4,
                        predict_ahead=ahead)
    cache = build_cache(LoadedModel(model, None, cfg, "tiny", "random"), st, max_len=64)
    assert cache.scheduler.sets == ahead + 1
    runner = Runner(model, cache, use_cuda_graph=False)
    recorded, inputs = {}, {}
    for i, layer in enumerate(cache.layers):
        if layer.wants_query_prediction:
            orig = layer.predict_query
            layer.predict_query = lambda qh, i=i, orig=orig: (recorded.__setitem__(i, qh.clone()), orig(qh))
    for i, block in enumerate(model.model.layers):
        block.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0].clone()))
    P = 20
    runner.prefill(torch.randint(0, 64, (1, P), generator=gen))
    assert recorded == {}  # no prediction during prefill
    runner.decode(torch.randint(0, 64, (1, 1), generator=gen))
    assert set(recorded) == {i for i in range(1, 5) if cache.layers[i].wants_query_prediction} and recorded
    layers = model.model.layers

    def by_hand(proj_layer, l):
        src = l - ahead if l - ahead >= 1 else min(l - 1, 1)
        x = layers[src].input_layernorm(inputs[src])
        w_q = layers[proj_layer].self_attn.qkv_proj.weight[:4 * 32]  # q_proj's rows of the stacked weight
        q = (x @ w_q.T).view(1, 1, 4, 32).transpose(1, 2)
        return model.rope(q.clone(), None, torch.tensor([P]))[0]
    for l, q_hat in recorded.items():
        assert rel_err(q_hat, by_hand(l, l)) < 1e-6
        assert rel_err(q_hat, by_hand(l - 1, l)) > 0.1
        if l - ahead != (src := l - ahead if l - ahead >= 1 else min(l - 1, 1)) and src > 0:   # not layer 0's
            x0 = layers[0].input_layernorm(inputs[0]) @ layers[l].self_attn.qkv_proj.weight[:4 * 32].T
            assert rel_err(q_hat, model.rope(x0.view(1, 1, 4, 32).transpose(1, 2), None, torch.tensor([P]))[0]) > 0.1


def test_all_sparse_big_budget_model_equals_full(gen):
    cfg, model = tiny_model(n_layers=2)
    spec = lambda i: LayerSpec(i, 4, 2, 32, 64, 1, torch.float32, torch.device("cpu"))  # noqa: E731
    st = MethodSettings(method="tailorkv", sink=2, recent=4, budget=64, channels=4)
    sp = Runner(model, ModelCache([SparseOffloadCache(spec(i), st) for i in range(2)], model.project_query, "tailorkv"))
    full = Runner(model, ModelCache([FullCache(spec(i)) for i in range(2)], model.project_query, "full"))
    toks = torch.randint(0, 64, (1, 30), generator=gen)
    assert rel_err(sp.prefill(toks[:, :20]), full.prefill(toks[:, :20])) < 1e-5
    for p in range(20, 30):
        assert rel_err(sp.decode(toks[:, p:p + 1]), full.decode(toks[:, p:p + 1])) < 1e-5


# --- (h) a multi-token attend after prefill (a second chat turn) is exact ----------------------------------
@pytest.mark.parametrize("hq,hkv", GQA)
def test_multi_token_after_prefill_equals_full(gen, small_flush, monkeypatch, hq, hkv):
    monkeypatch.setattr(sparse, "STORE_CHUNK", 7)  # the prompt's store and max|K| in parts
    B, D, P = 1, 16, 50
    spec = spec_of(hq, hkv, D, B)
    sp, full = One(SparseOffloadCache(spec, settings(budget=4 + 8 + 6))), One(FullCache(spec))  # small top-K
    q, k, v = qkv(gen, B, hq, hkv, P, D)
    sp.attend(q, k, v, 0), full.attend(q, k, v, 0)
    for p in range(P, P + 7):  # sparse decode steps (not compared: top-K of a random middle)
        q, k, v = qkv(gen, B, hq, hkv, 1, D)
        sp.attend(q, k, v, p), full.attend(q, k, v, p)
    assert len(sp.regions()["middle"]) > 0 and len(sp.regions()["tail"]) > sp.recent
    q, k, v = qkv(gen, B, hq, hkv, 9, D)
    mid = len(sp.regions()["middle"])
    assert rel_err(sp.attend(q, k, v, P + 7), full.attend(q, k, v, P + 7)) < 1e-5
    assert len(sp.regions()["tail"]) == sp.recent
    assert sp.stats()["tokens_fetched"] == sp.stats()["middle_tokens"] == mid


# --- (i) --select sketch: a low-bit key sketch of the middle on the device ---------------------------------
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_sketch_big_budget_equals_full(gen, bits):
    """A budget covering the context: the middle is taken whole and sketched whole (partial groups too) across
    prefill, a second turn and flushes, and every step equals full."""
    B, hq, hkv, D = 1, 4, 2, 32
    spec = spec_of(hq, hkv, D, B, max_len=600)
    st = settings(budget=600, sink=8, recent=16, select="sketch", sketch_bits=bits)
    sp, full = One(SparseOffloadCache(spec, st)), One(FullCache(spec))
    pos = 0
    for T in [150] + [1] * 140 + [37] + [1] * 5:
        q, k, v = qkv(gen, B, hq, hkv, T, D)
        assert rel_err(sp.attend(q, k, v, pos), full.attend(q, k, v, pos)) < 1e-5
        pos += T
        mid = len(sp.regions()["middle"])
        assert sp.sketch.n == mid and len(sp.regions()["tail"]) < sp.cap


@pytest.mark.parametrize("reuse", [False, True])
def test_sketch_ahead_selects_from_the_prediction_and_attends_the_gathered_rows(gen, small_flush, reuse, monkeypatch):
    """--select sketch-ahead: given the layer's own query as its prediction, every step equals --select sketch
    up to the order of the summed rows (they come through the layer's row cache, in its slot order, instead of the
    host store in place), across flushes; given
    another query, the positions are the sketch's top-K for that query; with no prediction, the layer's own."""
    monkeypatch.setattr(SketchSelector, "REUSE_ROWS", reuse)
    B, hq, hkv, D = 1, 6, 2, 32
    spec = spec_of(hq, hkv, D, B, max_len=600)
    kw = dict(budget=8 + 40 + 16, sink=8, recent=16, sketch_bits=2)
    ahead, sync = (One(SparseOffloadCache(spec, settings(**kw, select=m))) for m in ("sketch-ahead", "sketch"))
    assert ahead.policy.selector.fetches_ahead and not sync.policy.selector.fetches_ahead
    q, K, V = qkv(gen, B, hq, hkv, 300, D)
    assert rel_err(ahead.attend(q, K, V, 0), sync.attend(q, K, V, 0)) < 1e-6
    seen = []
    ahead.policy.selector = ObservedSelector(ahead.policy.selector, lambda layer, q1, pos: seen.append(pos.clone()))
    for p in range(300, 330):
        q1, k1, v1 = qkv(gen, B, hq, hkv, 1, D)
        got = ahead.attend(q1, k1, v1, p, q_hat=q1 if p % 3 else None)
        assert rel_err(got, sync.attend(q1, k1, v1, p)) < 1e-6
    assert len(seen) == 30 and ahead.policy.selector.rows(ahead.policy) is not None
    assert (ahead.policy.selector.inner.row_cache is not None) == reuse
    totals = ahead.policy.totals()  # the bench's row-cache counters: rows read from host <= rows chosen
    assert sync.policy.totals() == {} and ("rows_read" in totals) == reuse
    if reuse:
        assert 0 < totals["rows_read"] <= totals["rows_chosen"] == 30 * B * hkv * 40
    other = qkv(gen, B, hq, hkv, 1, D)[0]
    q1, k1, v1 = qkv(gen, B, hq, hkv, 1, D)
    ahead.attend(q1, k1, v1, 330, q_hat=other)
    lay = ahead.policy
    want = topk_tokens(lay.sketch.scores(other, lay.middle_bucket, lay.tail_start_dev, 8, "lse"), 40) + 8
    assert torch.equal(seen[-1].sort(-1).values, want.sort(-1).values)
    D2 = lay.host_kv.shape[-1]
    rows_k, rows_v = lay.selector.rows(lay)
    assert torch.equal(rows_k, lay.host_k.gather(2, seen[-1][..., None].expand(-1, -1, -1, D2)))
    assert torch.equal(rows_v, lay.host_v.gather(2, seen[-1][..., None].expand(-1, -1, -1, D2)))


@pytest.mark.parametrize("kt_bits", [16, 8])
def test_the_channel_row_cache_reads_only_new_channels_and_changes_no_step(gen, small_flush, kt_bits):
    """The paper's path with a K^T row cache (--kt-cache): across steps that keep some channels,
    flushes (the middle grows: every row is read again) and a second turn, every step equals the path without it up
    to the order of the summed channels; the rows held are the host K^T rows of the channels held; the counters
    say fewer rows were read from host than were chosen."""
    B, hq, hkv, D = 1, 6, 2, 32
    spec = spec_of(hq, hkv, D, B, max_len=600)
    st = dict(budget=8 + 40 + 16, sink=8, recent=16, channels=6, kt_bits=kt_bits)
    plain = One(SparseOffloadCache(spec, settings(**st)))
    held = One(SparseOffloadCache(spec, settings(**st, kt_cache=True)))
    assert plain.policy.selector.row_cache is None and held.policy.selector.row_cache is not None
    q, K, V = qkv(gen, B, hq, hkv, 300, D)
    assert rel_err(held.attend(q, K, V, 0), plain.attend(q, K, V, 0)) < 1e-6
    pos, drift, checked = 300, torch.randn(B, hq, 1, D, generator=gen), 0
    for T in [1] * 20 + [9] + [1] * 12:
        q1, k1, v1 = qkv(gen, B, hq, hkv, T, D)
        q_hat = drift + 0.3 * torch.randn(B, hq, 1, D, generator=gen) if T == 1 else None  # channels mostly kept
        assert rel_err(held.attend(q1, k1, v1, pos, q_hat=q_hat), plain.attend(q1, k1, v1, pos, q_hat=q_hat)) < 1e-5
        pos += T
        lay, lo = held.policy, held.policy.sink
        chans, rows = lay.selector.held_rows(lay)
        if T > 1 or (chans < 0).any():   # a flush after the step: the rows are read again next step
            continue
        n = lay.tail_start - lo   # the bucket's positions past the middle are not written (masked)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[rows.element_size()]  # e4m3: no CPU gather, equal
        want = lay.kt.host[:, :, :, lo:lo + n].view(bits).gather(2, chans[..., None].expand(-1, -1, -1, n))
        assert torch.equal(rows[..., :n].view(bits), want)
        checked += 1
    totals = held.policy.totals()
    assert checked > 10 and plain.policy.totals() == {}
    assert 0 < totals["kt_rows_read"] < totals["kt_rows_chosen"] == 32 * B * hkv * 6


@pytest.mark.parametrize("ahead", [1, 2, 4])
def test_sketch_ahead_narrows_the_sketch_grid_by_how_far_ahead_the_query_is_predicted(gen, ahead, monkeypatch):
    """The sketch kernel ahead of its layer runs on AHEAD_BLOCKS_PER_SM[1] blocks per SM one layer ahead,
    AHEAD_BLOCKS_PER_SM[2] two or more (room for the compute stream); a layer that selects from its own query inside
    the step keeps the full wave."""
    from tailorkv.engine.policies.sketch import KeySketch
    grids = []
    scores = KeySketch.scores
    monkeypatch.setattr(KeySketch, "scores", lambda self, *a: grids.append(a[-1]) or scores(self, *a))
    spec = spec_of(6, 2, 32, 1, max_len=600)
    lay = One(SparseOffloadCache(spec, settings(budget=64, sink=8, recent=16, select="sketch-ahead",
                                                predict_ahead=ahead)))
    q, K, V = qkv(gen, 1, 6, 2, 300, 32)
    lay.attend(q, K, V, 0)
    q1, k1, v1 = qkv(gen, 1, 6, 2, 1, 32)
    lay.attend(q1, k1, v1, 300, q_hat=q1)   # predicted: ahead of the layer
    lay.attend(q1, k1, v1, 301)             # no prediction: inside the step
    assert grids == [SketchSelector.AHEAD_BLOCKS_PER_SM[min(ahead, 2)], None]   # None: the full wave
    assert SketchSelector.AHEAD_BLOCKS_PER_SM[1] != SketchSelector.AHEAD_BLOCKS_PER_SM[2]


@pytest.mark.parametrize("bits", [2, 4])
def test_sketch_takes_a_partial_last_group(gen, bits):
    """A prompt whose middle is not whole 64-token groups: the tail keeps exactly `recent` tokens (as on the
    paper's path), the partial group is quantized over its own tokens, and again whole once decode steps fill it;
    the selection is the top-K of logsumexp over the group of q . dequant(sketch), built here from the true keys
    with the ops' quantizer."""
    from tailorkv.ops.quant import dequantize_keys, quantize_keys
    B, hq, hkv, D, P = 1, 6, 2, 32, 8 + 256 + 20 + 16
    spec = spec_of(hq, hkv, D, B, max_len=600)
    kw = dict(budget=8 + 40 + 16, sink=8, recent=16)
    sp, ch = One(SparseOffloadCache(spec, settings(**kw, select="sketch", sketch_bits=bits))), \
        One(SparseOffloadCache(spec, settings(**kw)))
    q, K, V = qkv(gen, B, hq, hkv, P, D)
    sp.attend(q, K, V, 0), ch.attend(q, K, V, 0)
    assert sp.regions() == ch.regions() and len(sp.regions()["middle"]) == 276 == sp.sketch.n
    assert sp.sketch.pending.shape[2] == 20
    seen = []

    class Spy(type(sp.selector)):
        def select(self, layer, q1):
            seen.append(super().select(layer, q1))
            return seen[-1]
    sp.selector = Spy()

    def want(keys, q1, k):
        x = torch.cat([keys, keys[:, :, -1:].expand(-1, -1, -keys.shape[2] % 64, -1)], 2)
        deq = dequantize_keys(*quantize_keys(x, bits, 64), bits, 64)[:, :, :keys.shape[2]]
        logits = (q1.reshape(B, hkv, hq // hkv, D) @ deq.transpose(-1, -2)) / math.sqrt(D)
        return torch.logsumexp(logits, 2).topk(k, -1).indices + 8

    q1, k1, v1 = qkv(gen, B, hq, hkv, 1, D)
    sp.attend(q1, k1, v1, P), ch.attend(q1, k1, v1, P)
    assert torch.equal(seen[0].sort(-1).values, want(K[:, :, 8:284], q1, 40).sort(-1).values)
    assert sp.stats()["tokens_attended"] == ch.stats()["tokens_attended"]
    keys = [K[:, :, 8:P], k1]
    for p in range(P + 1, P + 130):  # the tail reaches recent + FLUSH: its oldest tokens fill the partial group
        q1, k1, v1 = qkv(gen, B, hq, hkv, 1, D)
        sp.attend(q1, k1, v1, p)
        keys.append(k1)
    mid = sp.regions()["middle"]
    assert mid.stop > 8 + 320 and sp.sketch.n == len(mid) and sp.sketch.pending.shape[2] == len(mid) % 64
    allk = torch.cat(keys, 2)[:, :, :len(mid)]
    q1, k1, v1 = qkv(gen, B, hq, hkv, 1, D)
    sp.attend(q1, k1, v1, P + 130)
    assert torch.equal(seen[-1].sort(-1).values, want(allk, q1, 40).sort(-1).values)


def test_fp8_prediction_reads_e4m3_copies_of_the_next_layers_weights():
    """predict_weights="fp8": the same prediction from fp8_rows copies of W_q (close to, not equal to, bf16's)."""
    from tailorkv.engine.methods import build_cache
    from tailorkv.models.loader import LoadedModel
    from tailorkv.ops.linear import fp8_rows
    cfg, model = tiny_model(n_layers=3)
    loaded = LoadedModel(model, None, cfg, "tiny", "random")
    x, pos = torch.randn(1, 1, 64), torch.tensor([7])
    plain = build_cache(loaded, MethodSettings(method="tailorkv", quant_layers=[0], budget=10, sink=2, recent=4,
                                               channels=4), max_len=64).query_fn
    fp8 = build_cache(loaded, MethodSettings(method="tailorkv", quant_layers=[0], budget=10, sink=2, recent=4,
                                             channels=4, predict_weights="fp8"), max_len=64).query_fn
    codes, scale = fp8_rows(model.model.layers[2].self_attn.qkv_proj.weight[:4 * 32])
    by_hand = ((x @ codes.float().T) * scale).view(1, 1, 4, 32).transpose(1, 2)
    assert rel_err(fp8(2, x, pos), model.rope(by_hand, None, pos)[0]) < 1e-6
    assert 1e-4 < rel_err(fp8(2, x, pos), plain(2, x, pos)) < 0.1
    with pytest.raises(ValueError, match="--predict-weights"):
        MethodSettings(method="tailorkv", predict_weights="int4").validate()

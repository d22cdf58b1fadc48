"""The baseline cache policies (offload, streamingllm, snapkv, quest) and Quest's page ops (CPU, fp32).

Inputs are random with a fresh seed per run (shown beside a failure; set TAILORKV_SEED to replay one)."""
from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from tailorkv.engine.cache import LayerSpec
from tailorkv.engine.cache import ContextFull
from tailorkv.engine.policies.full import FullCache
from tailorkv.engine.policies.offload import OffloadCache
from tailorkv.engine.policies.quest import QuestCache
from tailorkv.engine.policies.snapkv import SnapKVCache, snap_scores
from tailorkv.engine.policies.streaming import StreamingCache
from tailorkv.engine.settings import MethodSettings
from tailorkv.ops.attention import attention_with_mask, causal_attention
from tailorkv.ops.page_select import page_bounds, page_scores, select_pages
from helpers import SEED, One, rel_err


D = 16
GQA = [(9, 3), (8, 2), (4, 4)]
POLICIES = {"offload": OffloadCache, "streamingllm": StreamingCache, "snapkv": SnapKVCache, "quest": QuestCache}


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(SEED + zlib.crc32(request.node.name.encode()))


def make_spec(hq, hkv, max_len=128, batch=2):
    return LayerSpec(0, hq, hkv, D, max_len, batch, torch.float32, torch.device("cpu"))


def settings(**kw):
    base = dict(budget=128, sink=4, recent=4, page=16, snap_window=8, snap_pool=5)
    base.update(kw)
    return MethodSettings(**base)


def make_qkv(g, batch, hq, hkv, n):
    return (torch.randn(batch, hq, n, D, generator=g), torch.randn(batch, hkv, n, D, generator=g),
            torch.randn(batch, hkv, n, D, generator=g))


def feed(caches, Q, K, V, chunks):
    """Feed the same chunks [(start, end)] to every cache; yields the list of outputs per chunk."""
    for s, e in chunks:
        yield [c.attend(Q[:, :, s:e], K[:, :, s:e], V[:, :, s:e], s) for c in caches]


def decode_steps(start, n):
    return [(p, p + 1) for p in range(start, start + n)]


# --- every policy equals full when its budget covers the context ---------------------------------------
@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("name", list(POLICIES))
def test_equals_full_when_budget_covers(gen, name, hq, hkv):
    spec = make_spec(hq, hkv)
    cache, full = One(POLICIES[name](spec, settings(budget=spec.max_len))), One(FullCache(spec))
    Q, K, V = make_qkv(gen, spec.batch, hq, hkv, spec.max_len)
    # prefill, 20 decode steps, a second turn (multi-token attend after existing tokens), 10 more steps
    chunks = [(0, 50)] + decode_steps(50, 20) + [(70, 95)] + decode_steps(95, 10)
    for i, (out, ref) in enumerate(feed([cache, full], Q, K, V, chunks)):
        assert out.shape == ref.shape
        assert rel_err(out, ref) < 1e-5, f"chunk {chunks[i]}"
    assert cache.length == 105
    # reset, then a fresh conversation with new inputs
    cache.reset(), full.reset()
    Q, K, V = make_qkv(gen, spec.batch, hq, hkv, spec.max_len)
    for out, ref in feed([cache, full], Q, K, V, [(0, 33)] + decode_steps(33, 5) + [(38, 128)]):
        assert rel_err(out, ref) < 1e-5
    with pytest.raises(ContextFull):
        cache.attend(Q[:, :, :1], K[:, :, :1], V[:, :, :1], 128)


@pytest.mark.parametrize("name", list(POLICIES))
def test_truncate_then_continue_equals_full_when_covered(gen, name):
    spec = make_spec(8, 2)
    cache, full = One(POLICIES[name](spec, settings(budget=spec.max_len))), One(FullCache(spec))
    Q, K, V = make_qkv(gen, spec.batch, 8, 2, spec.max_len)
    list(feed([cache, full], Q, K, V, [(0, 40)] + decode_steps(40, 6)))
    cache.truncate(43), full.truncate(43)
    assert cache.length == 43
    Q2, K2, V2 = make_qkv(gen, spec.batch, 8, 2, spec.max_len)  # different tokens after the cut
    for out, ref in feed([cache, full], Q2, K2, V2, decode_steps(43, 4) + [(47, 60)]):
        assert rel_err(out, ref) < 1e-5


def test_bad_settings_are_rejected():
    """Budgets a policy cannot work with are refused by the settings, before any cache is built."""
    with pytest.raises(ValueError, match="must exceed --sink 4 under streamingllm"):
        settings(method="streamingllm", budget=4, sink=4).validate()
    with pytest.raises(ValueError, match="must exceed snapkv's observation window"):
        settings(method="snapkv", budget=8, snap_window=8).validate()
    with pytest.raises(ValueError, match="at least one quest page"):
        settings(method="quest", budget=8, page=16).validate()
    settings(method="quest", budget=16, page=16).validate()


# --- offload -----------------------------------------------------------------------------------------------
def test_offload_equals_full_and_reports_copies(gen):
    spec = make_spec(9, 3)
    cache, full = One(OffloadCache(spec, settings(budget=16))), One(FullCache(spec))  # the budget does not apply
    Q, K, V = make_qkv(gen, spec.batch, 9, 3, spec.max_len)
    per_token = 2 * spec.batch * 3 * D * 4
    chunks = [(0, 60)] + decode_steps(60, 30) + [(90, 100)] + decode_steps(100, 3)
    for (s, e), (out, ref) in zip(chunks, feed([cache, full], Q, K, V, chunks)):
        assert rel_err(out, ref) < 1e-5
        st = cache.stats()
        assert st["h2d_bytes"] == s * per_token and st["d2h_bytes"] == (e - s) * per_token
        assert st["tokens_attended"] == e
    assert cache.device_bytes() == 0
    assert cache.host_bytes() == spec.max_len * per_token
    assert torch.equal(cache.k_host[:103].permute(1, 2, 0, 3), K[:, :, :103])


# --- streamingllm --------------------------------------------------------------------------------------------
class StreamRef:
    """The policy's semantics as plain lists: sinks, then a window of the last `cap` positions."""

    def __init__(self, sink, cap):
        self.sink, self.cap, self.sinks, self.recent = sink, cap, [], []

    def add(self, p):
        if len(self.sinks) < self.sink:
            self.sinks.append(p)
        else:
            self.recent = (self.recent + [p])[-self.cap:]

    def held(self):
        return self.sinks + self.recent

    def truncate(self, n):
        self.sinks = [p for p in self.sinks if p < n]
        self.recent = [p for p in self.recent if p < n]


def stream_expected(ref, Q, K, V, s, e):
    held = ref.held()
    if e - s == 1:
        ref.add(s)
        idx = torch.tensor(ref.held())
        return attention_with_mask(Q[:, :, s:e], K[:, :, idx], V[:, :, idx])
    idx = torch.tensor(held + list(range(s, e)), dtype=torch.long)
    out = causal_attention(Q[:, :, s:e], K[:, :, idx], V[:, :, idx], len(held))
    for p in range(s, e):
        ref.add(p)
    return out


@pytest.mark.parametrize("hq,hkv", GQA)
def test_streaming_keeps_sinks_and_window(gen, hq, hkv):
    sink, budget = 4, 24
    spec = make_spec(hq, hkv, max_len=160)
    cache = One(StreamingCache(spec, settings(budget=budget, sink=sink)))
    ref = StreamRef(sink, budget - sink)
    Q, K, V = make_qkv(gen, spec.batch, hq, hkv, spec.max_len)
    chunks = [(0, 50)] + decode_steps(50, 45) + [(95, 112)] + decode_steps(112, 10)
    for (s, e), (out,) in zip(chunks, feed([cache], Q, K, V, chunks)):
        before = len(ref.held())
        assert rel_err(out, stream_expected(ref, Q, K, V, s, e)) < 1e-5, (s, e)
        assert sorted(cache.positions().tolist()) == ref.held()
        assert cache.held == budget
        assert cache.stats()["tokens_attended"] == (budget if e - s == 1 else before + e - s)
    assert ref.held() == list(range(sink)) + list(range(122 - (budget - sink), 122))
    held = cache.positions()
    assert torch.equal(cache.k[:, :, :budget], K[:, :, held])
    # truncate within the window works; going back past an evicted token cannot
    cache.truncate(119), ref.truncate(119)
    assert sorted(cache.positions().tolist()) == ref.held()
    for (s, e), (out,) in zip(decode_steps(119, 8), feed([cache], Q, K, V, decode_steps(119, 8))):
        assert rel_err(out, stream_expected(ref, Q, K, V, s, e)) < 1e-5
    with pytest.raises(RuntimeError):
        cache.truncate(50)
    assert cache.device_bytes() == 2 * spec.batch * hkv * budget * D * 4


@pytest.mark.parametrize("sink", [4, 40])
def test_streaming_holds_no_more_slots_than_the_context(gen, sink):
    """A context shorter than the budget (even than the sinks) never evicts: its own length in slots, and every
    token attended as by full, up to the last position."""
    spec = make_spec(8, 2, max_len=32)
    full, stream = One(FullCache(spec)), One(StreamingCache(spec, settings(budget=64, sink=sink)))
    assert stream.device_bytes() == full.device_bytes() == 2 * spec.batch * 2 * 32 * D * 4
    Q, K, V = make_qkv(gen, spec.batch, 8, 2, 32)
    chunks = [(0, 20)] + decode_steps(20, 12)
    for (s, e), (f, o) in zip(chunks, feed([full, stream], Q, K, V, chunks)):
        assert rel_err(o, f) < 1e-6, (s, e)
        assert stream.stats()["tokens_attended"] == e
    with pytest.raises(ContextFull):
        stream.attend(Q[:, :, :1], K[:, :, :1], V[:, :, :1], 32)


def test_streaming_ignores_a_strong_key_in_the_middle(gen):
    spec = make_spec(8, 2, max_len=100)
    Q, K, V = make_qkv(gen, spec.batch, 8, 2, 61)
    K2, V2 = K.clone(), V.clone()
    q = Q[:, :, 60:61]
    K2[:, :, 30] = 5 * q[:, ::4, 0]        # matches query heads 0 and 4 (one per KV head) strongly
    V2[:, :, 30] = 10.0
    outs = {}
    for name, (k, v) in {"plain": (K, V), "planted": (K2, V2)}.items():
        full, stream = One(FullCache(spec)), One(StreamingCache(spec, settings(budget=24, sink=4)))
        for o in feed([full, stream], Q, k, v, [(0, 60), (60, 61)]):
            outs[name] = o
    assert rel_err(outs["planted"][0], outs["plain"][0]) > 0.1   # full sees the answer-bearing key
    assert rel_err(outs["planted"][1], outs["plain"][1]) < 1e-6  # streaming evicted it


# --- snapkv --------------------------------------------------------------------------------------------------
def snap_scores_naive(q_win, k, pool):
    B, Hq, w, _ = q_win.shape
    H, L = k.shape[1], k.shape[2]
    G, n = Hq // H, L - w
    out = torch.zeros(B, H, n, dtype=torch.float64)
    for b in range(B):
        for hq in range(Hq):
            for i in range(w):
                p = n + i  # the query's position: keys 0..p visible
                logits = (q_win[b, hq, i].double() @ k[b, hq // G, :p + 1].double().T) / math.sqrt(D)
                out[b, hq // G] += torch.softmax(logits, -1)[:n]
    lo = [j - pool // 2 for j in range(n)]  # window [j - pool//2, j - pool//2 + pool) clipped to the tokens
    return torch.stack([out[..., max(0, a):a + pool].amax(-1) for a in lo], -1)


@pytest.mark.parametrize("hq,hkv", GQA)
@pytest.mark.parametrize("pool", [1, 4, 5])
def test_snap_scores_match_naive(gen, hq, hkv, pool):
    q = torch.randn(2, hq, 6, D, generator=gen)
    k = torch.randn(2, hkv, 30, D, generator=gen)
    assert rel_err(snap_scores(q, k, pool), snap_scores_naive(q, k, pool)) < 1e-5


def planted_prompt(g, hq, hkv, P, w, strong, weak):
    """Window queries share a direction u per query head; key `strong` is +3u, key `weak` is -3u."""
    Q, K, V = make_qkv(g, 2, hq, hkv, P + 10)
    u = torch.randn(2, hkv, D, generator=g)
    Q[:, :, P - w:P] = 0.3 * Q[:, :, P - w:P] + u.repeat_interleave(hq // hkv, 1)[:, :, None]
    K[:, :, strong], K[:, :, weak] = 3 * u, -3 * u
    return Q, K, V


@pytest.mark.parametrize("hq,hkv", GQA)
def test_snapkv_keeps_attended_token_and_drops_ignored_one(gen, hq, hkv):
    P, budget, w = 64, 24, 8
    Q, K, V = planted_prompt(gen, hq, hkv, P, w, strong=20, weak=40)
    spec = make_spec(hq, hkv, max_len=80)
    cache = One(SnapKVCache(spec, settings(budget=budget, snap_window=w, snap_pool=1)))
    full = One(FullCache(spec))
    out, ref = next(feed([cache, full], Q, K, V, [(0, P)]))
    assert rel_err(out, ref) < 1e-5  # prefill is exact
    _, _, pos = cache.held()
    assert pos.shape == (2, hkv, budget)
    for b in range(2):
        for h in range(hkv):
            kept = set(pos[b, h].tolist())
            assert 20 in kept and 40 not in kept
            assert set(range(P - w, P)) <= kept
    # decode appends every generated token and attends exactly over the kept ones
    for s, e in decode_steps(P, 5):
        out = cache.attend(Q[:, :, s:e], K[:, :, s:e], V[:, :, s:e], s)
        kh, vh, ph = cache.held()
        assert ph.shape[2] == budget + e - P and (ph[..., -1] == s).all()
        gather = ph.unsqueeze(-1).expand(-1, -1, -1, D)
        ref = attention_with_mask(Q[:, :, s:e], K.gather(2, gather), V.gather(2, gather))
        assert rel_err(out, ref) < 1e-5
        assert torch.equal(kh, K.gather(2, gather))
    assert cache.k.shape[2] == budget + spec.max_len - P  # allocated once, at the prefill


def test_snapkv_pooling_keeps_neighbours(gen):
    P, budget, w = 64, 24, 8
    Q, K, V = planted_prompt(gen, 8, 2, P, w, strong=20, weak=40)
    cache = One(SnapKVCache(make_spec(8, 2, max_len=80), settings(budget=budget, snap_window=w, snap_pool=5)))
    cache.attend(Q[:, :, :P], K[:, :, :P], V[:, :, :P], 0)
    for row in cache.held()[2].reshape(-1, budget):
        assert set(range(18, 23)) <= set(row.tolist())


def test_snapkv_second_turn_compresses_again(gen):
    spec = make_spec(9, 3, max_len=128)
    budget, w = 32, 8
    cache = One(SnapKVCache(spec, settings(budget=budget, snap_window=w)))
    Q, K, V = make_qkv(gen, spec.batch, 9, 3, spec.max_len)
    list(feed([cache], Q, K, V, [(0, 20)] + decode_steps(20, 5)))
    assert cache.n == 25 and cache.base == 0                   # within the budget: all kept
    out = cache.attend(Q[:, :, 25:60], K[:, :, 25:60], V[:, :, 25:60], 25)
    ref = causal_attention(Q[:, :, 25:60], K[:, :, :60], V[:, :, :60], 25)
    assert rel_err(out, ref) < 1e-5                            # held was everything: exact
    pos = cache.held()[2]
    assert cache.n == budget and cache.base == 60
    assert (pos[..., -w:] == torch.arange(52, 60)).all()      # the new turn's window is kept
    list(feed([cache], Q, K, V, decode_steps(60, 3)))
    cache.truncate(61)
    assert cache.n == budget + 1
    with pytest.raises(RuntimeError):
        cache.truncate(59)
    out = cache.attend(Q[:, :, 61:62], K[:, :, 61:62], V[:, :, 61:62], 61)
    assert cache.held()[2][0, 0, -1] == 61 and cache.n == budget + 2


# --- quest ---------------------------------------------------------------------------------------------------
def true_page_max(q, k, length, page):
    """max over each page's tokens of q . k per query head: [B, Hq, P]."""
    B, Hq, _ = q.shape
    H = k.shape[1]
    scores = torch.einsum("bhgd,bhtd->bhgt", q.reshape(B, H, Hq // H, D), k[:, :, :length]).reshape(B, Hq, length)
    P = math.ceil(length / page)
    scores = F.pad(scores, (0, P * page - length), value=float("-inf"))
    return scores.reshape(B, Hq, P, page).amax(-1)


@pytest.mark.parametrize("hq,hkv", GQA)
def test_quest_page_bounds_are_upper_bounds(gen, hq, hkv):
    page = 16
    spec = make_spec(hq, hkv, max_len=128)
    cache = One(QuestCache(spec, settings(budget=48, page=page)))
    Q, K, V = make_qkv(gen, spec.batch, hq, hkv, spec.max_len)
    K = K * torch.exp(torch.randn(D, generator=gen))  # outlier channels
    chunks = [(0, 37)] + decode_steps(37, 20) + [(57, 90)]
    for s, e in chunks:
        cache.attend(Q[:, :, s:e], K[:, :, s:e], V[:, :, s:e], s)
        if e == 50:
            cache.truncate(45)  # mid-page cut: the page's bounds must forget the dropped keys
            cache.attend(Q[:, :, 45:50], K[:, :, 45:50], V[:, :, 45:50], 45)
        L = cache.length
        P = math.ceil(L / page)
        padded = F.pad(K[:, :, :L], (0, 0, 0, P * page - L), value=float("nan")).reshape(*K.shape[:2], P, page, D)
        assert torch.equal(cache.kmin[:, :, :P], padded.nan_to_num(float("inf")).amin(3))
        assert torch.equal(cache.kmax[:, :, :P], padded.nan_to_num(float("-inf")).amax(3))
        for _ in range(3):
            q = torch.randn(spec.batch, hq, D, generator=gen) * 3
            bound = page_bounds(q, cache.kmin[:, :, :P], cache.kmax[:, :, :P])
            true = true_page_max(q, K, L, page)
            assert torch.isfinite(bound).all()
            assert (bound >= true - 1e-4 * true.abs().clamp_min(1)).all()
            per_kv = page_scores(q, cache.kmin[:, :, :P], cache.kmax[:, :, :P])
            grp = true.reshape(spec.batch, hkv, hq // hkv, P).amax(2)
            assert (per_kv >= grp - 1e-4 * grp.abs().clamp_min(1)).all()


def test_select_pages_budget_and_last_page():
    scores = torch.tensor([[[5.0, 1.0, 9.0, 3.0, 7.0, 0.0]]])  # 6 pages, length 84: last page holds 4
    idx = select_pages(scores, 84, 16, 40)                        # 36 left: two whole pages
    assert idx.tolist()[0][0] == list(range(32, 48)) + list(range(64, 80)) + list(range(80, 84))
    assert select_pages(scores, 84, 16, 84).tolist()[0][0] == list(range(84))
    assert select_pages(scores, 84, 16, 19).tolist()[0][0] == list(range(80, 84))


@pytest.mark.parametrize("hq,hkv", GQA)
def test_quest_picks_the_page_with_a_planted_key(gen, hq, hkv):
    page, budget, L = 16, 48, 160
    spec = make_spec(hq, hkv, max_len=192)
    cache, full = One(QuestCache(spec, settings(budget=budget, page=page))), One(FullCache(spec))
    Q, K, V = make_qkv(gen, spec.batch, hq, hkv, L + 1)
    G = hq // hkv
    planted = {h: 33 + 16 * h for h in range(hkv)}  # a different page per KV head
    for h, p in planted.items():
        K[:, h, p] = 10 * Q[:, h * G, L]  # the group's first head (5x lost 1 seed in 60)
    outs = list(feed([cache, full], Q, K, V, [(0, L), (L, L + 1)]))
    idx = cache.selected
    assert idx.shape[2] <= budget and cache.stats()["tokens_attended"] == idx.shape[2]
    assert (idx[..., -1] == L).all()  # the last (partial) page
    for h, p in planted.items():
        assert (idx[:, h] == p).any(-1).all()
    gather = idx.unsqueeze(-1).expand(-1, -1, -1, D)
    ref = attention_with_mask(Q[:, :, L:L + 1], K.gather(2, gather), V.gather(2, gather))
    assert rel_err(outs[-1][0], ref) < 1e-5
    assert rel_err(outs[0][0], outs[0][1]) < 1e-5  # prefill stays dense
    assert cache.device_bytes() > full.device_bytes()


# quest's decode steps are graph-safe: run reads only the device step (positions, lengths), the bucket and what plan
# set, is idempotent, and a step aborted after run leaves nothing behind
def quest_expected(q, K, V, L, page, budget):
    """Quest's rule computed from scratch at a decode step holding L tokens: (output [B, Hq, 1, D], the attended
    token indices [B, H, n], ascending): the page bounds from the keys, the last page and the top whole pages."""
    B, H = K.shape[:2]
    P = math.ceil(L / page)
    padded = F.pad(K[:, :, :L], (0, 0, 0, P * page - L), value=float("nan")).reshape(B, H, P, page, D)
    scores = page_scores(q[:, :, 0], padded.nan_to_num(float("inf")).amin(3),
                         padded.nan_to_num(float("-inf")).amax(3))
    if L <= budget:
        idx = torch.arange(L).expand(B, H, L)
    else:
        last_count = L - (P - 1) * page
        n_top = max(0, min(P - 1, (budget - last_count) // page))
        top = scores[..., :P - 1].topk(n_top, -1).indices.sort(-1).values
        idx = torch.cat([(top[..., None] * page + torch.arange(page)).reshape(B, H, -1),
                         torch.arange((P - 1) * page, L).expand(B, H, last_count)], -1)
    g = idx.unsqueeze(-1).expand(-1, -1, -1, D)
    return attention_with_mask(q, K.gather(2, g), V.gather(2, g)), idx


def quest_model_cache(spec, **kw):
    from tailorkv.engine.cache import ModelCache
    return ModelCache([QuestCache(spec, settings(**kw))])


def quest_step(mc, Q, K, V, s, e, runs=1, run_as=None):
    """One step of tokens [s, e) with its run repeated `runs` times; run_as(step): the Step run sees."""
    step = mc.begin(e - s)
    for _ in range(runs):
        out = mc.attend(0, Q[:, :, s:e], K[:, :, s:e], V[:, :, s:e], step if run_as is None else run_as(step))
    mc.finish(step)
    return out


@pytest.mark.parametrize("hq,hkv", GQA)
def test_quest_graph_safe_decode_equals_the_rule(gen, hq, hkv):
    """A prompt longer than the budget, decode steps across a bucket boundary, a second turn, more decode steps:
    each equals the rule computed from the keys (same tokens, exact attention over them)."""
    page, budget = 16, 64
    spec = make_spec(hq, hkv, max_len=300)
    mc = quest_model_cache(spec, budget=budget, page=page)
    policy = mc.layers[0]
    assert policy.graph_safe and not QuestCache(spec, settings(free_generated=True)).graph_safe
    Q, K, V = make_qkv(gen, spec.batch, hq, hkv, spec.max_len)
    quest_step(mc, Q, K, V, 0, 180)
    steps = decode_steps(180, 50) + [(230, 240)] + decode_steps(240, 30)
    for s, e in steps:
        out = quest_step(mc, Q, K, V, s, e)
        if e - s > 1:
            continue
        want, idx = quest_expected(Q[:, :, s:e], K, V, e, page, budget)
        assert rel_err(out, want) < 1e-5, (s, e)
        assert torch.equal(policy.selected, idx) and policy.stats()["tokens_attended"] == idx.shape[-1]


@pytest.mark.parametrize("hq,hkv", GQA)
def test_quest_decode_step_is_idempotent_and_reads_only_the_device_step(gen, hq, hkv):
    """Running a step's run three times (a graph capture's two warm-ups and the capture) changes nothing; nor does
    running it with the host ints (start) of the first step of its key, as a replayed graph does. The steps cross
    page boundaries, the budget (dense -> sparse) and a bucket boundary (256 -> 300)."""
    from dataclasses import replace
    spec = make_spec(hq, hkv, max_len=300)
    Q, K, V = make_qkv(gen, spec.batch, hq, hkv, spec.max_len)
    outs = []
    for runs, replay in ((1, False), (3, False), (1, True)):
        mc = quest_model_cache(spec, budget=64, page=16)
        quest_step(mc, Q, K, V, 0, 40)
        first = {}
        run_as = (lambda st: replace(first.setdefault(st.key, st), positions=st.positions,
                                     lengths=st.lengths)) if replay else None
        outs.append([quest_step(mc, Q, K, V, s, e, runs, run_as) for s, e in decode_steps(40, 260)])
        assert len(first) in (0, 3)  # (256, dense), (256, sparse), (300, sparse)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def test_quest_aborted_decode_step_leaves_nothing(gen):
    """A decode step planned and run with an outlier key, then aborted, and the real token at its position (or a
    second turn from it): the outputs and page bounds equal those of a cache that never saw the aborted steps."""
    hq, hkv, page, budget = 8, 2, 16, 48
    spec = make_spec(hq, hkv, max_len=160)
    Q, K, V = make_qkv(gen, spec.batch, hq, hkv, spec.max_len)
    Qx, Kx, Vx = make_qkv(gen, spec.batch, hq, hkv, spec.max_len)
    Kx = Kx * 50  # would widen its page's bounds and win the selection if it stayed
    clean, aborted = (quest_model_cache(spec, budget=budget, page=page) for _ in range(2))
    for mc in (clean, aborted):
        quest_step(mc, Q, K, V, 0, 20)
    aborts = {20, 31, 32, 47, 48, 49, 63, 64, 80, 100}  # a page's last and first tokens, the budget, a second turn
    steps = decode_steps(20, 80) + [(100, 110)] + decode_steps(110, 30)

    def check(s, e):
        a, b = quest_step(aborted, Q, K, V, s, e), quest_step(clean, Q, K, V, s, e)
        assert torch.equal(a, b), (s, e)
        P = math.ceil(e / page)  # the bounds too, the last page's included (read once it is no longer the last)
        for name in ("kmin", "kmax"):
            assert torch.equal(getattr(aborted.layers[0], name)[:, :, :P], getattr(clean.layers[0], name)[:, :, :P])
    for s, e in steps:
        if s in aborts:
            step = aborted.begin(1)
            aborted.attend(0, Qx[:, :, s:s + 1], Kx[:, :, s:s + 1], Vx[:, :, s:s + 1], step)
            aborted.abort(step)
            assert aborted.length == s
        check(s, e)
    # a step aborted at 140, then both cut back to 130: the outlier left in slot 140 lies ahead of the steps that
    # refill its page (128 ..) and must not count in its bounds (decoded in order, the page's slots are all
    # rewritten before its bounds are read, so only the bounds themselves show it)
    step = aborted.begin(1)
    aborted.attend(0, Qx[:, :, 140:141], Kx[:, :, 140:141], Vx[:, :, 140:141], step)
    aborted.abort(step)
    aborted.truncate(130), clean.truncate(130)
    for s, e in decode_steps(130, 20):
        check(s, e)


# --- free_generated (eval's plain and paper protocols): decoded tokens are attended on top of the budget -----
def test_streaming_free_generated_keeps_every_decoded_token(gen):
    sink, budget, hq, hkv = 4, 24, 8, 2
    spec = make_spec(hq, hkv, max_len=160)
    cache = One(StreamingCache(spec, settings(budget=budget, sink=sink, free_generated=True)))
    ref = StreamRef(sink, budget - sink)
    Q, K, V = make_qkv(gen, spec.batch, hq, hkv, spec.max_len)
    out = cache.attend(Q[:, :, :50], K[:, :, :50], V[:, :, :50], 0)
    assert rel_err(out, stream_expected(ref, Q, K, V, 0, 50)) < 1e-5
    window = ref.held()  # the prompt's sinks and last recent tokens, fixed while decoding
    for p in range(50, 80):
        out = cache.attend(Q[:, :, p:p + 1], K[:, :, p:p + 1], V[:, :, p:p + 1], p)
        idx = torch.tensor(window + list(range(50, p + 1)))
        assert rel_err(out, attention_with_mask(Q[:, :, p:p + 1], K[:, :, idx], V[:, :, idx])) < 1e-5
        assert cache.stats()["tokens_attended"] == budget + p - 49
    assert sorted(cache.positions().tolist()) == window
    cache.truncate(70)  # drops decoded tokens only
    out = cache.attend(Q[:, :, 70:71], K[:, :, 70:71], V[:, :, 70:71], 70)
    idx = torch.tensor(window + list(range(50, 71)))
    assert rel_err(out, attention_with_mask(Q[:, :, 70:71], K[:, :, idx], V[:, :, idx])) < 1e-5
    # a next multi-token step: the decoded tokens join the window first, then slide as prompt tokens
    for p in range(50, 71):
        ref.add(p)
    out = cache.attend(Q[:, :, 71:80], K[:, :, 71:80], V[:, :, 71:80], 71)
    assert rel_err(out, stream_expected(ref, Q, K, V, 71, 80)) < 1e-5
    assert sorted(cache.positions().tolist()) == ref.held()


def test_quest_free_generated_selects_pages_in_the_prompt_and_keeps_decoded_tokens(gen):
    hq, hkv, page, budget = 8, 2, 16, 48
    spec = make_spec(hq, hkv, max_len=160)
    free = One(QuestCache(spec, settings(budget=budget, page=page, free_generated=True)))
    plain = One(QuestCache(spec, settings(budget=budget, page=page)))
    Q, K, V = make_qkv(gen, spec.batch, hq, hkv, spec.max_len)
    P = 100
    free.attend(Q[:, :, :P], K[:, :, :P], V[:, :, :P], 0), plain.attend(Q[:, :, :P], K[:, :, :P], V[:, :, :P], 0)
    for p in range(P, P + 30):
        out = free.attend(Q[:, :, p:p + 1], K[:, :, p:p + 1], V[:, :, p:p + 1], p)
        plain.attend(Q[:, :, p:p + 1], K[:, :, p:p + 1], V[:, :, p:p + 1], p)
        sel = free.policy.selected
        prompt_part, decoded = sel[..., :-(p + 1 - P)], sel[..., -(p + 1 - P):]
        assert (prompt_part < P).all() and prompt_part.shape[-1] <= budget
        assert torch.equal(decoded, torch.arange(P, p + 1).expand_as(decoded))
        # the same prompt pages as quest's own rule over the prompt alone
        scores = page_scores(Q[:, :, p], free.policy.kmin[:, :, :math.ceil(P / page)],
                             free.policy.kmax[:, :, :math.ceil(P / page)])
        assert torch.equal(prompt_part, select_pages(scores, P, page, budget))
        g = sel.unsqueeze(-1).expand(-1, -1, -1, D)
        want = attention_with_mask(Q[:, :, p:p + 1], K.gather(2, g), V.gather(2, g))
        assert rel_err(out, want) < 1e-5
        assert free.stats()["tokens_attended"] == sel.shape[-1]
    assert plain.policy.selected.shape[-1] <= budget  # quest's own rule spends the budget on decoded tokens too

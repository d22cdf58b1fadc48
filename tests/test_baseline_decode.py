"""The baselines' decode steps on the path CUDA graphs capture: streamingllm and snapkv store their token and
attend over a bucket of slots with a device-side length, so a step run again changes nothing, an aborted step
leaves no trace, and on a GPU the captured graphs equal eager decoding bit for bit (free_generated stays eager)."""
import pytest
import torch

from tailorkv.engine.methods import build_cache
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model
from helpers import write_tiny_folder
from test_decode_paths import _decode_both, _decode_repeating

# budgets far below the prompt: streamingllm's ring wraps, snapkv compresses the prompt then appends
SETTINGS = {"streamingllm": MethodSettings("streamingllm", budget=96, sink=8),
            "snapkv": MethodSettings("snapkv", budget=96, snap_window=8),
            "quest": MethodSettings("quest", budget=100, page=16)}  # 100: some lengths leave room for a page fewer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_baselines")
    write_tiny_folder(folder, seed=9, hidden=128, n_heads=4, n_kv=2, head_dim=64, max_pos=2048)  # 64: the kernels
    return str(folder)


@pytest.mark.parametrize("method", list(SETTINGS))
def test_a_decode_step_run_again_changes_nothing(tiny, method):
    """A graph's capture runs a step three times (two warm-ups, then the capture); before, streamingllm slid its
    window and snapkv appended on every run."""
    lm = load_model(tiny, dtype=torch.float32)
    ids = torch.randint(3, 300, (1, 420), generator=torch.Generator().manual_seed(4))
    once = _decode_repeating(lm, SETTINGS[method], ids, 300, 500, 1)
    thrice = _decode_repeating(lm, SETTINGS[method], ids, 300, 500, 3)
    assert all(torch.equal(a, b) for a, b in zip(once, thrice))


@pytest.mark.parametrize("method", list(SETTINGS))
def test_an_aborted_decode_step_leaves_no_trace(tiny, method):
    """Steps interrupted after their run (another token at each position first, then aborted) give the same
    logits as a cache that never saw them, while the ring wraps and evicts; so does going back a few tokens after
    one (the token it evicted, the oldest held, is read again)."""
    lm = load_model(tiny, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 300, (1, 331), generator=g)
    other = torch.randint(3, 300, (1, 331), generator=g)
    logits = []
    for interrupt in (False, True):
        cache = build_cache(lm, SETTINGS[method], 400)
        runner = Runner(lm.model, cache, use_cuda_graph=False)
        runner.prefill(ids[:, :200])
        out = []
        for p in range(200, 330):
            if interrupt:
                step = cache.begin(1, torch.tensor([p]))
                lm.model(other[:, p:p + 1], step, cache)
                cache.abort(step)
                assert cache.intact and cache.length == p
            out.append(runner.decode(ids[:, p:p + 1]).clone())
        if interrupt:
            step = cache.begin(1, torch.tensor([330]))
            for _ in range(3):  # as a graph's capture runs it
                lm.model(other[:, 330:331], step, cache)
            cache.abort(step)
        cache.truncate(320)
        out += [runner.decode(ids[:, p:p + 1]).clone() for p in range(320, 330)]
        logits.append(out)
    assert all(torch.equal(a, b) for a, b in zip(*logits))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", list(SETTINGS))
def test_cuda_graph_decode_equals_eager(tiny, method, dtype):
    """bf16 runs the kernels (quest: page scores, top-k, the page slots, the attention over rows of the store; fp32
    takes their references), none of which hands a call to its reference."""
    from tailorkv.ops import dispatch
    lm = load_model(tiny, device="cuda", dtype=dtype)
    ids = torch.randint(3, 300, (1, 700), device="cuda")
    before = dict(dispatch.FALLBACKS)
    eager, graphed, n_graphs = _decode_both(lm, SETTINGS[method], ids, 400, 800)
    for a, b in zip(eager, graphed):  # the same kernels on the same inputs: bit-equal
        assert torch.equal(b, a)
    assert 1 <= n_graphs <= 8
    if dtype == torch.bfloat16:
        ops = ("store_kv", "attend_decode", "quest_page_scores", "quest_page_slots", "topk_tokens",
               "sparse_decode_attention")
        assert {o: dispatch.FALLBACKS[o] for o in ops} == {o: before.get(o, 0) for o in ops}


@pytest.mark.cuda
def test_free_generated_streaming_decodes_eagerly(tiny):
    lm = load_model(tiny, device="cuda", dtype=torch.float32)
    cache = build_cache(lm, MethodSettings("streamingllm", budget=96, sink=8, free_generated=True), 400)
    assert not cache.graph_safe and Runner(lm.model, cache).graphs is None


@pytest.mark.parametrize("how", ["no run (prepare with its graph captured)", "interrupt in layer 1"])
def test_streaming_abort_without_the_run_keeps_the_oldest_token(tiny, how):
    """streamingllm's abort restores the evicted slot only in layers whose run took the copy (Ctrl-C in an earlier
    layer; DecodeGraphs.prepare when the step's graph exists: begin + abort, no run). Found by a QA pass."""
    lm = load_model(tiny, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 300, (1, 300), generator=g)
    other = torch.randint(3, 300, (1, 1), generator=g)
    logits = []
    for interrupt in (False, True):
        cache = build_cache(lm, SETTINGS["streamingllm"], 400)
        runner = Runner(lm.model, cache, use_cuda_graph=False)
        runner.prefill(ids[:, :200])          # the ring is full: every decode step evicts
        for p in range(200, 230):
            runner.decode(ids[:, p:p + 1])    # `saved` now holds the last step's evicted token
        if interrupt:
            step = cache.begin(1)
            if how.startswith("interrupt"):
                attend = cache.attend
                def stop(i, *a):
                    if i == 1:
                        raise KeyboardInterrupt
                    return attend(i, *a)
                cache.attend = stop
                with pytest.raises(KeyboardInterrupt):
                    lm.model(other, step, cache)
                cache.attend = attend
            cache.abort(step)
            assert cache.intact and cache.length == 230
        logits.append(runner.prefill(ids[:, 230:250]).clone())  # the next chat turn reads the oldest token
    assert torch.equal(logits[0], logits[1]), (logits[0] - logits[1]).abs().max()


def test_streaming_evicting_steps_have_their_own_key(tiny):
    """A graph captured at a step that evicts nothing has no _keep_evicted in it; replayed for an evicting step it
    saves nothing for abort."""
    lm = load_model(tiny, dtype=torch.float32)
    cache = build_cache(lm, SETTINGS["streamingllm"], 400)
    runner = Runner(lm.model, cache, use_cuda_graph=False)
    runner.prefill(torch.randint(3, 300, (1, 50)))
    k1 = cache.begin(1).key
    cache.abort(cache.begin(1))
    runner.prefill(torch.randint(3, 300, (1, 100)))  # the ring is full now
    step = cache.begin(1)
    assert cache.layers[0]._evicts and step.key != k1
    cache.abort(step)

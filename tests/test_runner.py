"""One runner under every command: a bench cell and a chat turn (Engine.generate, the loop `tailorkv run` uses)
produce the same greedy tokens for the same prompt and method; the cache owns the length; an interrupted step
leaves the cache as it was (or marks it for a rebuild)."""
import pytest
import torch

from tailorkv.engine.bench import driver as B
from tailorkv.engine.generate import Engine
from tailorkv.engine.methods import build_cache
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model
from helpers import write_tiny_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_runner")
    write_tiny_folder(folder, seed=11, hidden=128, n_heads=4, n_kv=2, head_dim=32)
    return load_model(str(folder))


SETTINGS = {"full": MethodSettings("full"),
            "tailorkv": MethodSettings("tailorkv", quant_layers=[0], budget=48, sink=4, recent=12, channels=4)}


@pytest.mark.parametrize("method", list(SETTINGS))
def test_bench_cell_and_chat_turn_agree(tiny, method):
    plan = B.BenchPlan(ctxs=[400], methods=[method], settings={method: SETTINGS[method]}, decode_steps=12, warmup=3)
    cell = B.run_cell(tiny, method, 400, plan)
    assert cell["status"] == "ok", cell.get("error")
    prompt = B.bench_prompt(tiny, plan, 400)[0].tolist()
    engine = Engine(tiny, build_cache(tiny, SETTINGS[method], 400))
    engine.eos_ids = set()  # the bench never stops at EOS
    n = plan.warmup + plan.decode_steps + 1
    out, _ = engine.generate(prompt, max_new_tokens=n)
    assert out == cell["greedy_tokens"] and len(out) == n
    assert engine.cache.length == len(engine.tokens) == len(prompt) + n  # the last token is fed at the stop


def test_interrupted_decode_step_leaves_the_cache_intact(tiny):
    engine = Engine(tiny, build_cache(tiny, SETTINGS["tailorkv"], 300))
    ids = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    engine.forward(ids[:150])
    want = engine.forward([ids[150]]).clone()
    engine.reset()
    engine.forward(ids[:150])
    layer = engine.cache.layers[2]
    inner = layer.selector

    class Boom(type(inner)):
        def select(self, *a):
            raise KeyboardInterrupt
    layer.selector = Boom(inner.rule, inner.channel_rule)
    with pytest.raises(KeyboardInterrupt):
        engine.forward([ids[150]])
    layer.selector = inner
    assert engine.cache.length == 150 and engine.cache.intact
    engine.recover()
    assert torch.allclose(engine.forward([ids[150]]), want, atol=1e-6, rtol=0)


EVERY = {**SETTINGS, "offload": MethodSettings("offload"),
         "streamingllm": MethodSettings("streamingllm", budget=48, sink=4),
         "streamingllm-free": MethodSettings("streamingllm", budget=48, sink=4, free_generated=True),
         "snapkv": MethodSettings("snapkv", budget=48, snap_window=8, snap_pool=5),
         "quest": MethodSettings("quest", budget=48, page=16)}


@pytest.mark.parametrize("method", list(EVERY))
@pytest.mark.parametrize("cut_at", [0, 2])
def test_ctrl_c_inside_a_decode_step_is_undone(tiny, method, cut_at):
    """Ctrl-C after `cut_at` layers ran their step (and stored the token): recover, and the next steps give the
    logits of a cache never interrupted."""
    ids = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = Engine(tiny, build_cache(tiny, EVERY[method], 300))
    engine.forward(ids[:150])
    for t in ids[150:153]:
        engine.forward([t])
    want = [engine.forward([t]).clone() for t in ids[153:156]]
    engine = Engine(tiny, build_cache(tiny, EVERY[method], 300))
    engine.forward(ids[:150])
    for t in ids[150:153]:
        engine.forward([t])
    layer = engine.cache.layers[cut_at]
    real = layer.run

    def run_then_ctrl_c(*a):
        real(*a)
        raise KeyboardInterrupt
    layer.run = run_then_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        engine.forward([ids[153]])
    del layer.run
    engine.recover()
    assert engine.cache.length == len(engine.tokens) == 153
    got = [engine.forward([t]) for t in ids[153:156]]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-5, rtol=0), (g - w).abs().max()


@pytest.mark.parametrize("method", list(SETTINGS))
def test_long_prompt_path_writes_over_its_inputs_and_agrees(tiny, method, monkeypatch):
    """A prompt longer than MLP_CHUNK and INTO_Q_BLOCK: q written over the layer input, the attention over q,
    each MLP chunk's output over the attention output it read; the same logits as the one-shot path."""
    from tailorkv.models import llama
    from tailorkv.ops import attention
    ids = torch.randint(0, tiny.cfg.vocab_size, (1, 150), generator=torch.Generator().manual_seed(3))

    def prefill_logits():
        cache = build_cache(tiny, SETTINGS[method], 200)
        return Runner(tiny.model, cache).prefill(ids, all_logits=True)
    want = prefill_logits()
    monkeypatch.setattr(llama, "MLP_CHUNK", 32)
    monkeypatch.setattr(attention, "INTO_Q_BLOCK", 40)
    made = []
    real_empty_like = torch.empty_like
    monkeypatch.setattr(llama.torch, "empty_like", lambda t, *a, **kw: made.append(t.shape) or real_empty_like(t, *a, **kw))
    got = prefill_logits()
    assert (1, 150, tiny.cfg.dim) not in made      # no [T, dim] output buffer beside the attention output
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()

"""The decode paths: a decode step (static shapes over a bucket, the path CUDA graphs capture) equals a prefill
of the same tokens; running a step again changes nothing; on a GPU the captured graphs equal eager decoding bit
for bit, for the full cache, tailorkv and quest."""
import pytest
import torch

from tailorkv.engine.methods import build_cache
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model
from helpers import rel_err, write_tiny_folder, write_tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_graph")
    write_tiny_hf(folder, seed=5)
    return str(folder)


def test_decode_steps_equal_one_prefill(tiny):
    lm = load_model(tiny)
    ids = torch.randint(3, 300, (1, 130), generator=torch.Generator().manual_seed(2))
    whole = Runner(lm.model, build_cache(lm, MethodSettings("full"), max_len=300)).prefill(ids, all_logits=True)
    runner = Runner(lm.model, build_cache(lm, MethodSettings("full"), max_len=300))
    runner.prefill(ids[:, :120])
    for pos in range(120, 130):
        assert rel_err(runner.decode(ids[:, pos:pos + 1]), whole[:, pos]) < 1e-5
    assert runner.length == 130


def test_bucket_bounds():
    from tailorkv.engine.step import bucket_for, fine_bucket
    for n in [1, 255, 256, 257, 2048, 2049, 5000, 8193, 100_000, 131072]:
        b = bucket_for(n, 131072)
        assert n <= b <= 131072
        assert b - n <= max(256, n // 8)
        f = fine_bucket(n)
        assert n <= f and f - n <= max(256, n // 32)


def _decode_both(lm, settings, ids, n_prompt, max_len):
    """Logits of every decode step, eager and through CUDA graphs (the first captured right after the prefill),
    from two identical caches."""
    out = []
    for graphs in (False, True):
        runner = Runner(lm.model, build_cache(lm, settings, max_len), use_cuda_graph=graphs)
        assert (runner.graphs is not None) == graphs
        runner.prefill(ids[:, :n_prompt])
        runner.prepare_decode()  # what Engine.generate does: the first step's graph captured before its token
        assert runner.length == n_prompt and (not graphs or len(runner.graphs.graphs) == 1)
        out.append([runner.decode(ids[:, p:p + 1]).clone() for p in range(n_prompt, ids.shape[1])])
        if graphs:
            out.append(len(runner.graphs.graphs))
    return out


@pytest.mark.cuda
def test_cuda_graph_decode_equals_eager(tiny):
    lm = load_model(tiny, device="cuda", dtype=torch.float32)
    ids = torch.randint(3, 300, (1, 2100), device="cuda")
    eager, graphed, n_graphs = _decode_both(lm, MethodSettings("full"), ids, 2040, 3000)
    for a, b in zip(eager, graphed):  # crosses the 2048 bucket boundary; the same kernels: bit-equal
        assert torch.equal(b, a)
    assert n_graphs == 2


@pytest.mark.cuda
@pytest.mark.parametrize("bits,select,ahead,kt_bits", [(1, "channels", 1, 16), (2, "channels", 1, 16),
                                                       (1, "channels", 1, 8), (1, "sketch", 1, 16),
                                                       (1, "sketch-ahead", 1, 16), (1, "sketch-ahead", 3, 16)])
def test_cuda_graph_tailorkv_equals_eager(tmp_path, bits, select, ahead, kt_bits):
    """Quant layer 0 and sparse layers: flushes of the key residual and of the sparse tail happen between
    replays (commit), and the middle grows past a bucket: the graphs still equal eager steps. The sketch's
    prompt of 790 tokens leaves a middle of 758: 11 whole groups and a partial one, filled by later flushes."""
    write_tiny_folder(tmp_path, seed=6, hidden=128, n_heads=4, n_kv=2, head_dim=32, max_pos=2048)
    lm = load_model(str(tmp_path), device="cuda", dtype=torch.float32)
    s = MethodSettings("tailorkv", quant_layers=[0], bits=bits, budget=96, sink=8, recent=24, channels=8,
                       select=select, predict_ahead=ahead, kt_bits=kt_bits)
    ids = torch.randint(3, 300, (1, 1100), device="cuda")
    eager, graphed, n_graphs = _decode_both(lm, s, ids, 790 if select.startswith("sketch") else 800, 1200)
    for a, b in zip(eager, graphed):  # the same kernels on the same inputs: bit-equal
        assert torch.equal(b, a)
    assert 1 <= n_graphs <= 8


@pytest.mark.cuda
@pytest.mark.parametrize("n_prompt,budget,keys", [(230, 96, 2), (200, 240, 3)])
def test_cuda_graph_quest_equals_eager(tiny, n_prompt, budget, keys):
    """quest's decode steps replay graphs: one per (bucket, dense or sparse); 100 steps past a prompt longer than
    the budget, or from dense into sparse, cross the 256 bucket. With free_generated quest decodes eagerly."""
    lm = load_model(tiny, device="cuda", dtype=torch.float32)
    ids = torch.randint(3, 300, (1, n_prompt + 100), device="cuda")
    s = MethodSettings("quest", budget=budget, page=16)
    eager, graphed, n_graphs = _decode_both(lm, s, ids, n_prompt, 512)
    for a, b in zip(eager, graphed):  # the same kernels on the same inputs: bit-equal
        assert torch.equal(b, a)
    assert n_graphs == keys
    free = build_cache(lm, MethodSettings("quest", budget=budget, page=16, free_generated=True), 512)
    assert not free.graph_safe and Runner(lm.model, free).graphs is None


def test_long_prefills_release_cached_blocks_on_cuda_only(monkeypatch):
    from tailorkv.engine.runner import RELEASE_AFTER, release_prefill_blocks
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    release_prefill_blocks("cpu", RELEASE_AFTER * 4)
    release_prefill_blocks(torch.device("cuda"), RELEASE_AFTER - 1)  # a chat turn's short prefill: keep them
    assert calls == []
    release_prefill_blocks(torch.device("cuda"), RELEASE_AFTER)
    assert calls == [1]


def _decode_repeating(lm, settings, ids, n_prompt, max_len, repeats):
    """Logits of every decode step when each step's forward runs `repeats` times between begin and finish (a
    CUDA graph's capture runs it three times: two warm-ups, then the replay)."""
    cache = build_cache(lm, settings, max_len)
    Runner(lm.model, cache, use_cuda_graph=False).prefill(ids[:, :n_prompt])
    out = []
    for p in range(n_prompt, ids.shape[1]):
        step = cache.begin(1, torch.tensor([p]))
        for _ in range(repeats):
            logits = lm.model(ids[:, p:p + 1], step, cache)
        cache.finish(step)
        out.append(logits)
    return out


@pytest.mark.parametrize("select", ["channels", "sketch", "sketch-ahead"])
def test_decode_step_is_idempotent(tmp_path, select):
    """Running a step again changes nothing it reads: max|K| (the channel scores' statistic) is read before the
    step's own key joins it (the step at position p reads entry p % 2 and writes the other), flushes happen in
    commit. Before, a graph captured mid-generation selected other channels than eager decoding did."""
    write_tiny_folder(tmp_path, seed=6, hidden=128, n_heads=4, n_kv=2, head_dim=32, max_pos=2048)
    lm = load_model(str(tmp_path), dtype=torch.float32)
    s = MethodSettings("tailorkv", quant_layers=[0], budget=96, sink=8, recent=24, channels=4, select=select)
    ids = torch.randint(3, 300, (1, 560), generator=torch.Generator().manual_seed(3))
    once = _decode_repeating(lm, s, ids, 400, 600, 1)
    thrice = _decode_repeating(lm, s, ids, 400, 600, 3)
    assert all(torch.equal(a, b) for a, b in zip(once, thrice))


def test_quest_decode_step_is_idempotent(tmp_path):
    """quest's decode step run three times equals it run once, from dense into sparse and across the 256 bucket."""
    write_tiny_folder(tmp_path, seed=6, hidden=128, n_heads=4, n_kv=2, head_dim=32, max_pos=2048)
    lm = load_model(str(tmp_path), dtype=torch.float32)
    s = MethodSettings("quest", budget=96, page=16)
    ids = torch.randint(3, 300, (1, 300), generator=torch.Generator().manual_seed(3))
    once = _decode_repeating(lm, s, ids, 60, 320, 1)
    thrice = _decode_repeating(lm, s, ids, 60, 320, 3)
    assert all(torch.equal(a, b) for a, b in zip(once, thrice))


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("method", ["full", "tailorkv", "tailorkv-kt8", "streamingllm", "snapkv", "quest"])
def test_llama_shaped_decode_hands_no_call_to_a_reference(tmp_path, method, batch):
    """bf16, head_dim 128, 4 query heads per KV head (Llama-3.1-8B's head shape): every op of a bench cell's
    decode that has a kernel runs it (dispatch.FALLBACKS counts the calls a kernel hands to its reference; the
    GEMV leaves several rows to cuBLAS by design, uncounted)."""
    from tailorkv.engine.bench import driver as B
    write_tiny_folder(tmp_path, seed=7, hidden=512, n_heads=4, n_kv=1, head_dim=128, max_pos=4096)
    lm = load_model(str(tmp_path), device="cuda", dtype=torch.bfloat16)
    s = {"full": MethodSettings("full"),
         "tailorkv": MethodSettings("tailorkv", quant_layers=[0], budget=256, sink=16, recent=64),
         "tailorkv-kt8": MethodSettings("tailorkv", quant_layers=[0], budget=256, sink=16, recent=64, kt_bits=8),
         "streamingllm": MethodSettings("streamingllm", budget=256, sink=16),
         "snapkv": MethodSettings("snapkv", budget=256), "quest": MethodSettings("quest", budget=256)}[method]
    method = s.method
    plan = B.BenchPlan(ctxs=[3000], methods=[method], settings={method: s}, decode_steps=8, warmup=2, batch=batch)
    cell = B.run_cell(lm, method, 3000, plan)
    assert cell["status"] == "ok", cell.get("error")
    assert cell["cuda_graph"] and cell["decode_reference_calls"] == {}


@pytest.mark.cuda
def test_a_bench_cell_reports_the_sketch_layers_top_k_searches(tmp_path):
    """--select sketch on a GPU: each step's top-K leaves a carry for the next; the cell counts the selections
    that searched the whole row (the cache's totals), at most all of them, and none without a sketch."""
    from tailorkv.engine.bench import driver as B
    write_tiny_folder(tmp_path, seed=8, hidden=512, n_heads=4, n_kv=1, head_dim=128, max_pos=4096)
    lm = load_model(str(tmp_path), device="cuda", dtype=torch.bfloat16)
    for select in ("sketch", "channels"):
        s = MethodSettings("tailorkv", quant_layers=[0], budget=256, sink=16, recent=64, select=select)
        plan = B.BenchPlan(ctxs=[3000], methods=["tailorkv"], settings={"tailorkv": s}, decode_steps=8, warmup=2)
        cell = B.run_cell(lm, "tailorkv", 3000, plan)
        assert cell["status"] == "ok", cell.get("error")
        got = cell["topk_searches"]
        if select == "channels":
            assert got is None
        else:
            assert got["selected"] >= 10 and 1 <= got["searched_whole"] <= got["selected"], got

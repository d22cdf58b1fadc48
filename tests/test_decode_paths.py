"""The static-shape decode path (device-tensor position over a padded buffer, used by CUDA graphs) equals the
eager path; on a GPU the captured graph equals eager decoding."""
import pytest
import torch

from tailorkv.engine.methods import build_cache
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model
from helpers import rel_err, write_tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_graph")
    write_tiny_hf(folder, seed=5)
    return str(folder)


def test_tensor_position_path_equals_eager(tiny):
    lm = load_model(tiny)
    cache = build_cache(lm, MethodSettings("full"), max_len=300)
    ids = torch.randint(3, 300, (1, 130), generator=torch.Generator().manual_seed(2))
    lm.model(ids[:, :120], 0, cache)
    lm.model.rope.tables(300, "cpu")
    for pos in range(120, 130):
        eager = lm.model(ids[:, pos:pos + 1], pos, cache)
        cache.truncate(pos)
        for layer in cache.layers:
            layer.graph_len = 256
        static = lm.model(ids[:, pos:pos + 1], torch.tensor(pos), cache)
        for layer in cache.layers:
            layer.length = pos + 1
        assert rel_err(static, eager) < 1e-5


def test_bucket_bounds():
    from tailorkv.engine.cuda_graph import bucket_for
    for n in [1, 255, 256, 257, 2048, 2049, 5000, 8193, 100_000, 131072]:
        b = bucket_for(n, 131072)
        assert n <= b <= 131072
        assert b - n <= max(256, n // 8)


@pytest.mark.cuda
def test_cuda_graph_decode_equals_eager(tiny):
    from tailorkv.engine.cuda_graph import GraphedDecoder
    lm = load_model(tiny, device="cuda", dtype=torch.float32)
    cache = build_cache(lm, MethodSettings("full"), max_len=3000)
    ids = torch.randint(3, 300, (1, 2100), device="cuda")
    lm.model(ids[:, :2040], 0, cache)
    g = GraphedDecoder(lm.model, cache)
    for pos in range(2040, 2100):  # crosses the 2048 bucket boundary
        eager = lm.model(ids[:, pos:pos + 1], pos, cache).clone()
        cache.truncate(pos)
        graphed = g.step(ids[:, pos:pos + 1], pos)
        assert rel_err(graphed, eager) < 1e-4
    assert len(g.graphs) == 2


def test_long_prefills_release_cached_blocks_on_cuda_only(monkeypatch):
    from tailorkv.engine.generate import RELEASE_AFTER, release_prefill_blocks
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    release_prefill_blocks("cpu", RELEASE_AFTER * 4)
    release_prefill_blocks(torch.device("cuda"), RELEASE_AFTER - 1)  # a chat turn's short prefill: keep them
    assert calls == []
    release_prefill_blocks(torch.device("cuda"), RELEASE_AFTER)
    assert calls == [1]

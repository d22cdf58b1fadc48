"""Logits of our Llama equal HF transformers' LlamaForCausalLM on a tiny random checkpoint (GQA, llama3 RoPE
scaling, untied embeddings): over a 512-token prefill and 32 cached decode steps, fp32, CPU."""
import pytest
import torch

from tailorkv.engine.methods import build_cache
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model
from helpers import prefill_then_decode, rel_err, write_tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_hf")
    hf = write_tiny_hf(folder)
    return folder, hf


def test_logits_match_transformers(tiny):
    folder, hf = tiny
    loaded = load_model(str(folder))
    assert loaded.cfg.rope_scaling["rope_type"] == "llama3" and not loaded.cfg.tie_embeddings
    ids = torch.randint(3, 300, (1, 512 + 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    got = prefill_then_decode(loaded, ids, 512)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < 1e-4
    assert rel_err(got[-32:], ref[-32:]) < 1e-4  # the cached decode steps on their own


def test_tied_embeddings(tmp_path):
    hf = write_tiny_hf(tmp_path, tie=True, rope_scaling=None, seed=3)
    loaded = load_model(str(tmp_path))
    assert loaded.cfg.tie_embeddings and loaded.model.lm_head is None
    ids = torch.randint(3, 300, (1, 40))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    cache = build_cache(loaded, MethodSettings("full"), max_len=64)
    assert rel_err(Runner(loaded.model, cache).prefill(ids, all_logits=True)[0], ref) < 1e-4

"""An untied embedding table lives in pinned host memory on a GPU (models/loader.py) and is read row by row over
PCIe (Llama.embed): the same logits as a table on the device, vocab x dim less device memory; a tied table (the
output projection too) and any CPU run keep it where the model is."""
import pytest
import torch

from tailorkv.engine.methods import build_cache
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.models import loader
from tailorkv.models.loader import embeddings_on_host, load_model
from helpers import write_tiny_hf


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    folder = tmp_path_factory.mktemp("untied")
    write_tiny_hf(folder, seed=3, tie=False)
    return str(folder)


def test_only_an_untied_table_on_a_gpu_goes_to_the_host(untied):
    lm = load_model(untied)
    assert not lm.cfg.tie_embeddings and lm.model.model.embed_tokens.weight.device.type == "cpu"
    assert not embeddings_on_host(lm.cfg, "cpu")
    if not torch.cuda.is_available():  # planning for a GPU from here: the table would go to the host
        assert embeddings_on_host(lm.cfg, "cuda")
    tied = load_model("smollm2-135m", random_weights=True)
    assert tied.cfg.tie_embeddings and not embeddings_on_host(tied.cfg, "cuda")


def test_the_memory_plan_leaves_the_host_table_out():
    from tailorkv.engine.memory_plan import weight_bytes
    from tailorkv.models.config import ModelConfig
    untied = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=1000)
    tied = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, vocab_size=1000,
                       tie_embeddings=True)
    assert weight_bytes(untied, 2) == weight_bytes(tied, 2)   # the output projection only, either way


def _logits(lm, ids):
    runner = Runner(lm.model, build_cache(lm, MethodSettings("full"), max_len=512), use_cuda_graph=True)
    first = runner.prefill(ids[:, :200]).clone()
    return [first] + [runner.decode(ids[:, p:p + 1]).clone() for p in range(200, ids.shape[1])]


@pytest.mark.cuda
def test_a_host_table_gives_the_device_tables_logits(untied, monkeypatch):
    ids = torch.randint(3, 300, (1, 216), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    on_host = load_model(untied, device="cuda", dtype=torch.bfloat16)
    w = on_host.model.model.embed_tokens.weight
    assert w.device.type == "cpu" and w.is_pinned()
    monkeypatch.setattr(loader, "HOST_EMBEDDINGS", False)
    on_device = load_model(untied, device="cuda", dtype=torch.bfloat16)
    assert on_device.model.model.embed_tokens.weight.is_cuda
    assert torch.equal(on_host.model.embed(ids), on_device.model.embed(ids))
    for a, b in zip(_logits(on_host, ids), _logits(on_device, ids)):   # prefill, then graphed decode steps
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_without_the_row_gather_kernel_the_table_stays_on_the_device(untied, monkeypatch):
    """The gather's torch reference syncs (no CUDA graph could hold it): with the kernel off, the table stays put
    and the graphed decode runs as before."""
    monkeypatch.setenv("TAILORKV_KERNELS_OFF", "gather_rows")
    lm = load_model(untied, device="cuda", dtype=torch.bfloat16)
    assert lm.model.model.embed_tokens.weight.is_cuda
    ids = torch.randint(3, 300, (1, 216), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    assert len(_logits(lm, ids)) == 17

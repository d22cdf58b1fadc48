"""SmolLM2 loaded from the GGUF gives the logits of HF transformers' LlamaForCausalLM loaded from the same file
(fp32, CPU): over a 512-token prompt plus 32 cached decode steps, and at long positions."""
import os

import pytest
import torch

from tailorkv.engine.methods import build_cache
from tailorkv.engine.runner import Runner
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import smollm2_gguf_path
from tailorkv.models.loader import load_model
from helpers import prefill_then_decode, rel_err


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModelForCausalLM
    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    return load_model("smollm2-135m"), hf


def test_prompt_and_cached_decode_match_transformers(pair):
    ours, hf = pair
    ids = torch.randint(0, 49152, (1, 512 + 32), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    got = prefill_then_decode(ours, ids, 512)
    assert rel_err(got, ref) < 1e-4
    assert rel_err(got[512:], ref[512:]) < 1e-4


def test_long_positions_match_transformers(pair):
    ours, hf = pair
    ids = torch.randint(0, 49152, (1, 4096), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = hf(ids).logits[0, -64:]
    cache = build_cache(ours, MethodSettings("full"), max_len=4096)
    got = Runner(ours.model, cache).prefill(ids, all_logits=True)[0, -64:]
    assert rel_err(got, ref) < 1e-4

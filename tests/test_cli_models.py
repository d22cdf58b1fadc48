"""What users bring from HF transformers and llama.cpp: a hub id as --model (from a Hugging Face cache built
here, no network), generation_config.json honoured, -f FILE, the load line."""
import json
import os

import pytest
import torch
from click.testing import CliRunner

from tailorkv.cli import main
from tailorkv.engine.ui import dtype_name, pick_dtype
from helpers import TAG_TEMPLATE, assert_one_line_error, write_tiny_folder

TEMPLATE = TAG_TEMPLATE
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding one model, `tiny-org/tiny-llama`, laid out as huggingface_hub lays it."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-llama"
    write_tiny_folder(str(repo / "snapshots" / COMMIT), chat_template=TEMPLATE)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / COMMIT


def call(*args, **kw):
    return CliRunner().invoke(main, list(args), **kw)


def test_hub_id_from_the_cache(hub_cache):
    res = call("run", "-m", "tiny-org/tiny-llama", "-p", "hi", "-n", "3", "--device", "cpu")
    assert res.exit_code == 0, res.output
    load_line = next(line for line in res.output.splitlines() if "parameters" in line)
    assert load_line.startswith("tiny-org/tiny-llama: ") and "safetensors" in load_line
    auto = dtype_name(pick_dtype("auto", torch.device("cpu")))  # bf16 on CPUs with AMX, else fp32
    assert f"{auto} weights" in load_line and "trained context 1024" in load_line


def test_hub_id_not_in_the_cache_offline(hub_cache):
    assert_one_line_error(call("run", "-m", "tiny-org/other-model", "-p", "hi"),
                          "tiny-org/other-model", "HF_HUB_OFFLINE", "hf download")


def test_generation_config_sets_the_chat_defaults(hub_cache):
    (hub_cache / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.3, "top_k": 7}))
    res = call("run", "-m", str(hub_cache), "-n", "2", "--device", "cpu", "--seed", "1", input="/stats\n/exit\n")
    assert res.exit_code == 0, res.output
    assert "temp 0.3, top-k 7, top-p 0.95, min-p 0.05" in res.output
    assert "temperature, top_k from the model's generation config" in res.output
    res = call("run", "-m", str(hub_cache), "-n", "2", "--device", "cpu", "--top-k", "3", input="/exit\n")
    assert "temp 0.3, top-k 3" in res.output  # a flag beats the file


def test_prompt_from_a_file(hub_cache, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("Summarize: the cat sat on the mat.\n", encoding="utf-8")
    res = call("run", "-m", str(hub_cache), "-f", str(f), "-n", "3", "--device", "cpu", "-t", "1")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip()  # the answer, and nothing else, on stdout
    assert "parameters" not in res.stdout and "loading" not in res.stdout


def test_load_line_of_the_default_model():
    from helpers import smollm2_gguf_or_skip
    smollm2_gguf_or_skip()
    from tailorkv.engine.ui import load_line
    from tailorkv.models.loader import load_model
    line = load_line(load_model("smollm2-135m"), 1.0)
    assert line.startswith("smollm2-135m: 134.5M parameters, Q4_1 GGUF -> fp32 weights")
    assert "trained context 8192" in line


def test_a_model_path_that_is_neither_folder_nor_hub_id(tmp_path):
    assert_one_line_error(call("run", "-m", str(tmp_path / "a" / "b"), "-p", "hi"), "does not exist")
    assert not os.path.exists(tmp_path / "a")


@pytest.mark.parametrize("change, needles", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["rope scaling 'yarn' is not supported", "linear and llama3"]),
    ({"num_key_value_heads": 3}, ["n_heads=4, not a multiple of n_kv_heads=3", "restore it"]),
    ({"hidden_size": "64"}, ["'hidden_size' is '64', not a positive whole number", "restore the file"]),
    ({"num_key_value_heads": 0}, ["'num_key_value_heads' is 0, not a positive whole number"]),
    ({"hidden_size": None}, ["lacks the field 'hidden_size'", "not a complete Llama config.json"]),
    ({"hidden_act": "gelu"}, ["hidden_act 'gelu' is not supported", "uses SiLU"]),
])
def test_a_config_tailorkv_cannot_run_is_one_line(tmp_path, change, needles):
    """A Hugging Face folder whose config.json asks for what the model code does not do: the model's error
    (UnsupportedModel / LoadError), not a traceback."""
    write_tiny_folder(str(tmp_path), n_heads=4, n_kv=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    assert_one_line_error(call("run", "-m", str(tmp_path), "-p", "hi", "-n", "2", "--device", "cpu"), *needles)


def test_auto_dtype_on_a_cpu_is_fp32_unless_amx_or_too_big(monkeypatch):
    import torch
    from tailorkv.engine import ui
    from tailorkv.models.loader import peek_config
    cpu = torch.device("cpu")
    small, big = (peek_config(name, random_weights=True)[0] for name in ("smollm2-135m", "llama-3.1-8b"))
    assert 30e9 < 4 * big.params < 33e9 and 4 * small.params < 1e9   # 8.03B and 135M weights
    monkeypatch.setattr(ui, "memory_available", lambda: 24 << 30)
    monkeypatch.setattr(ui, "cpu_has_amx", lambda: True)
    assert ui.pick_dtype("auto", cpu, small) == torch.bfloat16
    monkeypatch.setattr(ui, "cpu_has_amx", lambda: False)  # AVX512-BF16 alone or AVX2: fp32 is faster
    assert ui.pick_dtype("auto", cpu, small) == torch.float32 and ui.pick_dtype("auto", cpu) == torch.float32
    assert ui.pick_dtype("auto", cpu, big) == torch.bfloat16  # 32 GB of fp32 weights in 24 GiB: bf16 fits
    monkeypatch.setattr(ui, "memory_available", lambda: None)  # unknown (not Linux): fp32
    assert ui.pick_dtype("auto", cpu, big) == torch.float32
    assert ui.pick_dtype("bf16", cpu) == torch.bfloat16


def test_load_line_says_what_the_weights_became(hub_cache):
    res = call("run", "-m", str(hub_cache), "-p", "hi", "-n", "2", "--device", "cpu", "--dtype", "bf16")
    assert res.exit_code == 0, res.output
    assert "fp32 safetensors -> bf16 weights" in res.output


def test_a_chat_template_that_refuses_the_conversation_is_one_line_and_keeps_the_chat(tmp_path):
    """A template's own raise_exception (here: no system role, as some models' templates say) names what it
    refuses and the fix, in one-shot and in the chat; the chat goes on with its history."""
    refuses = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    write_tiny_folder(str(tmp_path), chat_template=refuses + TEMPLATE)
    args = ["run", "-m", str(tmp_path), "-n", "2", "--device", "cpu", "--system", "be brief"]
    assert_one_line_error(call(*args, "-p", "hi"), "chat template refuses this conversation",
                          "System role not supported", "restart without --system, or with --no-chat-template")
    res = call(*args, input="hello\n/stats\n")
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert "System role not supported" in res.stderr and "1 messages" in res.stdout  # the system message only
    res = call("run", "-m", str(tmp_path), "-n", "2", "--device", "cpu", "-p", "hi")
    assert res.exit_code == 0, res.output


def _broken(tmp_path, name: str, text: str):
    write_tiny_folder(str(tmp_path), n_heads=4, n_kv=2)
    (tmp_path / name).write_text(text)
    return call("run", "-m", str(tmp_path), "-p", "hi", "-n", "2", "--device", "cpu")


@pytest.mark.parametrize("text", ["{oops", '{"metadata": {}}', "[]", '{"weight_map": {"a": 3}}'])
def test_a_broken_safetensors_index_is_one_line(tmp_path, text):
    assert_one_line_error(_broken(tmp_path, "model.safetensors.index.json", text),
                          "model.safetensors.index.json is not a safetensors index", "download it again")


def test_a_config_that_is_not_an_object_is_one_line(tmp_path):
    assert_one_line_error(_broken(tmp_path, "config.json", "[1, 2]"), "config.json is not a model config",
                          "restore the file")


def test_a_tokenizer_beyond_the_vocabulary_is_refused_before_the_weights_load(tmp_path):
    write_tiny_folder(str(tmp_path), n_heads=4, n_kv=2)  # a 256-token byte-level tokenizer
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 200}))
    res = call("run", "-m", str(tmp_path), "-p", "zzz ~~~", "-n", "2", "--device", "cpu")
    assert_one_line_error(res, "tokenizer.json gives token ids up to 2", "the model's vocabulary has 200 rows",
                          "use the tokenizer that came with these weights")
    assert " parameters, " not in res.output


def test_a_folder_without_a_tokenizer_names_where_it_goes(tmp_path):
    write_tiny_folder(str(tmp_path), n_heads=4, n_kv=2)
    os.unlink(tmp_path / "tokenizer.json")
    assert_one_line_error(call("run", "-m", str(tmp_path), "-p", "hi", "-n", "2", "--device", "cpu"),
                          "has no tokenizer: put the model's tokenizer.json", str(tmp_path))

"""`tailorkv run` as a user calls it: a one-shot answer from the default model, and every error a user can
cause ending in one clear line (cause and fix), a non-zero exit and no traceback."""
import json

import pytest
import torch
from click.testing import CliRunner

from tailorkv.cli import main
from helpers import write_tiny_hf


def call(*args):
    return CliRunner().invoke(main, list(args))


def assert_clean_error(res, *needles):
    assert res.exit_code != 0
    text = res.output
    assert "Traceback" not in text and res.exc_info[0] is SystemExit, text
    lines = [l for l in text.strip().splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), text
    for n in needles:
        assert n in text, text


def test_capital_of_france():
    res = call("run", "--prompt", "What is the capital of France?", "--max-new-tokens", "24", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "Paris" in res.stdout


def test_unknown_model_name():
    assert_clean_error(call("run", "-m", "llama-9000", "-p", "hi"), "unknown model 'llama-9000'", "smollm2-135m")


def test_missing_path(tmp_path):
    assert_clean_error(call("run", "-m", str(tmp_path / "nope"), "-p", "hi"), "does not exist")


def test_folder_without_config(tmp_path):
    assert_clean_error(call("run", "-m", str(tmp_path), "-p", "hi"), "no config.json")


def test_config_name_without_weights():
    assert_clean_error(call("run", "-m", "llama-3.1-8b", "-p", "hi"), "--weights", "--random-weights")


def test_truncated_safetensors(tmp_path):
    write_tiny_hf(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    assert_clean_error(call("run", "-m", str(tmp_path), "-p", "hi"), "truncated", "download it again")


def test_mismatched_weights(tmp_path):
    write_tiny_hf(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(call("run", "-m", str(tmp_path), "-p", "hi"), "does not match")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert_clean_error(call("run", "-m", str(tmp_path), "-p", "hi"), "gpt2", "Llama")


def test_prompt_longer_than_ctx():
    assert_clean_error(call("run", "-p", "word " * 200, "--ctx", "64", "--device", "cpu"), "--ctx is 64")


def test_ctx_beyond_model():
    assert_clean_error(call("run", "-p", "hi", "--ctx", "128k", "--device", "cpu"), "8192", "lower --ctx")


def test_bad_ctx_text():
    assert_clean_error(call("run", "-p", "hi", "--ctx", "lots"), "8k")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_but_absent():
    assert_clean_error(call("run", "-p", "hi", "--device", "cuda"), "no GPU", "--device cpu")


def test_parse_ctx():
    from tailorkv.cli import parse_ctx
    assert parse_ctx("8192") == 8192 and parse_ctx("8k") == 8192 and parse_ctx("128K") == 131072


def test_interactive_chat_commands():
    res = CliRunner().invoke(main, ["run", "--device", "cpu", "-n", "16"],
                             input="What is the capital of France?\n/stats\n/foo\n/reset\n/stats\n")
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "Paris" in out
    assert "context" in out and "KV device" in out            # per-turn stats line
    assert "unknown command" in out
    assert "conversation cleared" in out
    assert out.count("2 messages") == 1 and "0 messages" in out  # /stats before and after /reset

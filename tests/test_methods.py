"""Which policy each layer gets: the tailorkv layer types come from --quant-layers, else the model's profile
(its configs entry, else configs/profiles/<name>.json as `tailorkv profile` writes it), else the paper's value."""
import json

import pytest

from tailorkv.engine import methods
from tailorkv.engine.settings import MethodSettings


def test_profile_file_by_model_name(tmp_path, monkeypatch):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "my-model.json").write_text(json.dumps({"quant_layers": [0, 2]}))
    monkeypatch.setattr(methods, "CONFIG_DIR", str(tmp_path))
    fam = {"name": "my-model", "profile": None, "quant_layers": [0, 1]}
    assert methods.layer_policies(MethodSettings("tailorkv"), 4, fam) == ["quant", "sparse", "quant", "sparse"]


def test_paper_value_without_profile(tmp_path, monkeypatch):
    monkeypatch.setattr(methods, "CONFIG_DIR", str(tmp_path))
    fam = {"name": "yi-6b-200k", "profile": None, "quant_layers": [0, 1]}
    assert methods.layer_policies(MethodSettings("tailorkv"), 3, fam) == ["quant", "quant", "sparse"]


def test_flag_overrides_and_range_check():
    fam = {"name": "smollm2-135m", "profile": "profiles/smollm2-135m.json"}
    assert methods.layer_policies(MethodSettings("tailorkv", quant_layers=[1]), 3, fam) == ["sparse", "quant", "sparse"]
    with pytest.raises(ValueError, match=r"--quant-layers 5 is out of range: the model has layers 0..2"):
        methods.layer_policies(MethodSettings("tailorkv", quant_layers=[5]), 3, fam)
    assert methods.layer_policies(MethodSettings("quest"), 2, fam) == ["quest", "quest"]


def test_dense_layers_use_the_full_policy():
    fam = {"name": "smollm2-135m", "profile": "profiles/smollm2-135m.json"}
    assert methods.layer_policies(MethodSettings("quest", dense_layers=[0, 1]), 3, fam) == ["full", "full", "quest"]
    s = MethodSettings("tailorkv", quant_layers=[0], dense_layers=[2])
    assert methods.layer_policies(s, 3, fam) == ["quant", "sparse", "full"]
    assert methods.layer_policies(MethodSettings("snapkv", dense_layers=[]), 2, fam) == ["snapkv", "snapkv"]
    with pytest.raises(ValueError, match=r"dense layer 3 is out of range: the model has layers 0..2"):
        methods.layer_policies(MethodSettings("snapkv", dense_layers=[0, 3]), 3, fam)
    with pytest.raises(ValueError, match="layer numbers >= 0"):
        MethodSettings("snapkv", dense_layers=[-1]).validate()


def test_selection_rules_are_settings_and_options():
    from click.testing import CliRunner
    from tailorkv.cli import main
    from tailorkv.engine.options import settings_from
    d = MethodSettings()
    assert (d.select_rule, d.channel_rule) == ("lse", "paper") and d.combine_rule == "lse"
    assert MethodSettings(select_rule="paper").combine_rule == "sum"
    s = settings_from("tailorkv", "2", 61, 15, 15, 12, None, select_rule="psum", channel_rule="max")
    assert (s.select_rule, s.channel_rule, s.combine_rule) == ("psum", "max", "psum")
    assert settings_from("tailorkv", "2", 61, 15, 15, 12, None).select_rule == d.select_rule
    with pytest.raises(ValueError, match="--select-rule sum: use paper, lse, psum"):
        MethodSettings(select_rule="sum").validate()
    with pytest.raises(ValueError, match="--channel-rule mean: use paper, max, l2"):
        MethodSettings(channel_rule="mean").validate()
    for cmd in ("run", "bench", "eval"):
        out = CliRunner().invoke(main, [cmd, "--help"]).output
        assert "--select-rule [paper|lse|psum]" in out and "--channel-rule [paper|max|l2]" in out, cmd
    r = CliRunner().invoke(main, ["run", "--select-rule", "sum", "-p", "hi"])
    assert r.exit_code == 2 and "'sum' is not one of 'paper', 'lse', 'psum'" in r.output
    for cmd in ("run", "bench", "eval"):
        assert "--select [channels|sketch|sketch-ahead]" in CliRunner().invoke(main, [cmd, "--help"]).output, cmd
    r = CliRunner().invoke(main, ["run", "--select", "ahead", "-p", "hi"])
    assert r.exit_code == 2 and "'ahead' is not one of 'channels', 'sketch', 'sketch-ahead'" in r.output
    with pytest.raises(ValueError, match="--select ahead: use channels, sketch, sketch-ahead"):
        MethodSettings(select="ahead").validate()
    assert MethodSettings(select="sketch-ahead").sketched and not MethodSettings().sketched


def test_layers_with_a_poor_prediction_select_from_their_own_query(tmp_path, monkeypatch):
    """The profile's q-hat cosines pick the sparse layers that skip the one-layer-early prefetch."""
    assert methods.own_query_layers_of([None, -0.003, 0.885, 0.4, 0.97], 0.5) == [1, 3]
    assert methods.own_query_layers_of([None, -0.003, 0.885], 0.0) == []
    assert methods.own_query_layers_of(None, 0.5) == []
    from helpers import write_tiny_hf
    from tailorkv.models.loader import load_model
    write_tiny_hf(tmp_path / "m", n_layers=3)
    loaded = load_model(str(tmp_path / "m"))
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "tiny.json").write_text(json.dumps({"quant_layers": [],
                                                                  "prediction_cos": [None, 0.1, 0.9]}))
    monkeypatch.setattr(methods, "CONFIG_DIR", str(tmp_path))
    loaded.family = {**loaded.family, "name": "tiny", "profile": "profiles/tiny.json"}
    cache = methods.build_cache(loaded, MethodSettings("tailorkv", budget=32, sink=4, recent=4), 64)
    assert [type(c).__name__ for c in cache.layers] == ["SparseOffloadCache"] * 3  # head_dim 8: no 1-bit layer
    assert [c.wants_query_prediction for c in cache.layers[1:]] == [False, True]
    cache = methods.build_cache(loaded, MethodSettings("tailorkv", budget=32, sink=4, recent=4, own_query_below=0), 64)
    assert [c.wants_query_prediction for c in cache.layers[1:]] == [True, True]
    with pytest.raises(ValueError, match="own-query-below"):
        MethodSettings("tailorkv", own_query_below=1.5).validate()


def test_a_given_layer_profile_decides_the_layers(tmp_path):
    """--layer-profile: its quant_layers, and its q-hat cosines pick the own-query layers; the family's shipped
    profile is not read; --quant-layers still wins."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"n_layers": 4, "quant_layers": [1], "prediction_cos": [None, 0.9, 0.2, 0.8]}))
    fam = {"name": "smollm2-135m", "profile": "profiles/smollm2-135m.json"}
    s = methods.with_profile(MethodSettings("tailorkv", layer_profile=str(path)), fam, 4)
    assert s.quant_layers == [1] and s.own_query_layers == [2]
    assert methods.layer_policies(MethodSettings("tailorkv", layer_profile=str(path)), 4, fam) == \
        ["sparse", "quant", "sparse", "sparse"]
    s = methods.with_profile(MethodSettings("tailorkv", layer_profile=str(path), quant_layers=[0]), fam, 4)
    assert s.quant_layers == [0] and s.own_query_layers == [2]
    assert methods.with_profile(MethodSettings("quest", layer_profile=str(path)), fam, 4).quant_layers is None


def test_no_profile_at_all_names_both_fixes():
    with pytest.raises(ValueError, match="ships none.*--layer-profile prof.json, or pass --quant-layers"):
        methods.with_profile(MethodSettings("tailorkv"), {}, 4)


@pytest.mark.parametrize("head_dim, kw, needles", [
    (96, dict(bits=1), ["multiple of 32 and of 64, and this model's is 96", "--quant-layers ''"]),  # values' groups
    (80, dict(bits=2), ["multiple of 16 and of 64, and this model's is 80"]),
    (48, dict(bits=1), ["multiple of 32 and of 48, and this model's is 48", "use --bits 2 or"]),
    (24, dict(bits=1, quant_layers=[], select="sketch", sketch_bits=2), ["packs 16 channels per word",
                                                                         "--select channels or --sketch-bits 4"]),
])
def test_head_dimensions_the_packed_layers_cannot_hold_are_refused(head_dim, kw, needles):
    """The shapes QuantCache and the key sketch cannot build are refused by check_model, before any weight loads,
    with the fixes that work; the shapes they can build pass."""
    s = MethodSettings("tailorkv", **{"quant_layers": [0], **kw})
    with pytest.raises(ValueError) as e:
        s.check_model(head_dim, 4)
    assert all(n in str(e.value) for n in needles), str(e.value)
    for ok_dim, ok_kw in ((128, dict(bits=1)), (64, dict(bits=2)), (64, dict(select="sketch-ahead", sketch_bits=1)),
                          (24, dict(quant_layers=[], select="sketch", sketch_bits=4))):
        MethodSettings("tailorkv", **{"quant_layers": [0], **ok_kw}).check_model(ok_dim, 4)

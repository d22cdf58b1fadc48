"""`tailorkv eval-compare`: one method's samples of two runs paired, on a tiny random Llama's eval run (CPU) and a
copy of it with known changes; the one-line errors."""
import copy
import json
import os

import pytest

from tailorkv.engine.evaluation import compare as C
from helpers import TAG_TEMPLATE, assert_one_line_error, check_png, invoke_eval as invoke, \
    load_json_strict as load, write_tiny_folder


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    model = write_tiny_folder(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"), hidden=128, n_heads=4,
                              head_dim=32, vocab=256, max_pos=2048, chat_template=TAG_TEMPLATE)
    out = str(tmp_path_factory.mktemp("a"))
    r = invoke("eval", "--model", model, "--device", "cpu", "--dtype", "fp32", "--lengths", "640,768",
               "--samples", "2", "--tasks", "passkey,variable_tracking", "--max-new-tokens", "4", "--sink", "8",
               "--recent", "16", "--channels", "4", "--quant-layers", "0", "--fidelity-tokens", "4",
               "--methods", "full,tailorkv,streamingllm", "--budgets", "64", "--out", out)
    assert r.exit_code == 0, r.output
    return os.path.join(out, "eval.json")


def _changed(a: dict) -> dict:
    """A copy of run A as if run with kt_bits 8, where one tailorkv sample scored 30 more, answered otherwise and
    had a dNLL 0.5 higher."""
    b = copy.deepcopy(a)
    for by_length in b["settings"].values():
        for by_method in by_length.values():
            by_method["tailorkv"]["kt_bits"] = 8
    r = next(r for r in b["records"] if r["method"] == "tailorkv" and r["length"] == 640 and r["task"] == "passkey")
    r.update(score=r["score"] + 30, prediction=r["prediction"] + " else", dnll=r["dnll"] + 0.5)
    return b


def test_pairs_by_sample_with_stratified_errors(run_a):
    a = load(run_a)
    cmp = C.compare(a, _changed(a), *C.pick_method(a, _changed(a), "tailorkv"))
    assert cmp["paired"] == 8 and cmp["only_a"] == cmp["only_b"] == 0   # 2 lengths x 2 tasks x 2 samples
    assert cmp["changed"] == ["kt_bits: 16 -> 8"]
    c640, c768 = cmp["cells"]
    assert (c640["length"], c768["length"]) == (640, 768)
    # one passkey sample of two moved by 30: passkey's mean diff 15, variable_tracking's 0, over two tasks 7.5
    assert c640["diff"] == pytest.approx(7.5) and c640["dnll_diff"] == pytest.approx(0.125)
    assert c640["diff_se"] == pytest.approx(7.5)  # sqrt(var([0, 30]) / 2) / 2 tasks
    assert c640["same_answer"] == 3 and c768["same_answer"] == 4
    assert c768["diff"] == 0 and c768["diff_se"] == 0
    g = cmp["groups"]["64"]
    assert g["diff"] == pytest.approx(3.75) and g["diff_se"] == pytest.approx(3.75)  # mean of two lengths
    assert cmp["tasks"]["passkey"]["diff"] == pytest.approx(30 / 4) and cmp["tasks"]["passkey"]["n"] == 4
    assert [f["top1_agreement"][0] == f["top1_agreement"][1] for f in cmp["fidelity"]] == [True, True]
    same = C.compare(a, a, "tailorkv")
    assert same["changed"] == [] and same["groups"]["64"]["diff"] == 0 and same["tasks"]["passkey"]["same_answer"] == 4


def test_two_methods_of_one_run_pair_as_eval_pairs_them_with_full(run_a):
    """--against: full (A) against tailorkv (B) in the same run gives eval's own paired difference and dNLL."""
    a = load(run_a)
    cmp = C.compare(a, a, *C.pick_method(a, a, "full", "tailorkv"))
    own = a["summary"]["budgets"]["64"]["overall"]["tailorkv"]
    assert cmp["method"] == "full -> tailorkv" and cmp["changed"][0] == "method: full -> tailorkv"
    assert cmp["paired"] == 8
    assert cmp["groups"]["64"]["diff"] == pytest.approx(own["diff"])
    assert cmp["groups"]["64"]["diff_se"] == pytest.approx(own["diff_se"])
    assert cmp["groups"]["64"]["dnll_diff"] == pytest.approx(own["dnll"])
    with pytest.raises(ValueError, match="--against streamingllm pairs it with A's --method"):
        C.pick_method(a, a, None, "streamingllm")
    with pytest.raises(ValueError, match="--against quest: run B has no finished record"):
        C.pick_method(a, a, "full", "quest")


def test_command_prints_and_writes_json(run_a, tmp_path):
    b_path = str(tmp_path / "b" / "eval.json")
    os.makedirs(os.path.dirname(b_path))
    with open(b_path, "w") as f:
        json.dump(_changed(load(run_a)), f)
    out, png = str(tmp_path / "cmp.json"), str(tmp_path / "cmp.png")
    r = invoke("eval-compare", run_a, os.path.dirname(b_path), "--method", "tailorkv", "--json", out, "--plot", png)
    assert r.exit_code == 0, r.output
    check_png(png)
    assert "8 samples paired (0 only in A, 0 only in B); settings that differ: kt_bits: 16 -> 8" in r.output
    assert "+3.8 ± 3.8" in r.output and "3/4" in r.output                            # the budget's mean over lengths
    assert load(out)["groups"]["64"]["diff"] == pytest.approx(3.75)
    before = open(out).read()
    assert_one_line_error(invoke("eval-compare", run_a, b_path, "--method", "tailorkv", "--json", out),
                          "already exists", "--overwrite")
    assert_one_line_error(invoke("eval-compare", run_a, b_path, "--plot", png), "--plot", "already exists")
    assert open(out).read() == before
    assert invoke("eval-compare", run_a, b_path, "--method", "tailorkv", "--json", out, "--overwrite").exit_code == 0
    partial = dict(load(b_path), complete=False)
    partial["records"] = [r for r in partial["records"] if r["length"] == 640]
    with open(b_path, "w") as f:
        json.dump(partial, f)
    r = invoke("eval-compare", run_a, b_path, "--method", "tailorkv")
    assert r.exit_code == 0 and "B is a partial run" in r.output and "4 samples paired (4 only in A" in r.output


def test_errors_name_cause_and_fix(run_a, tmp_path):
    assert_one_line_error(invoke("eval-compare", run_a, str(tmp_path / "nope.json")), "no such file")
    assert_one_line_error(invoke("eval-compare", run_a, str(tmp_path)), "holds no eval.json", "eval-merge")
    assert_one_line_error(invoke("eval-compare", run_a, run_a), "--method", "full, streamingllm, tailorkv")
    assert_one_line_error(invoke("eval-compare", run_a, run_a, "--method", "quest"), "has no finished record",
                          "full, streamingllm, tailorkv")
    other = load(run_a)
    for r in other["records"]:
        r["prompt_hash"] = "0" * 16
    path = str(tmp_path / "other.json")
    with open(path, "w") as f:
        json.dump(other, f)
    assert_one_line_error(invoke("eval-compare", run_a, path, "--method", "tailorkv"),
                          "no tailorkv sample finished in both", "--seed")
    with open(path, "w") as f:
        f.write("{not json")
    assert_one_line_error(invoke("eval-compare", run_a, path), "not an eval results file")

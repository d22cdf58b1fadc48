"""`tailorkv eval` on CPU with a tiny random Llama and a byte-level tokenizer: the JSON schema and records, the
prompt format, --budget-frac, shards that partition the work and merge into the single run, the PNGs, fidelity
(full vs full is exact), one-line errors."""
import math
import json
import os
import shlex

import click
import pytest
import torch
from click.testing import CliRunner

from tailorkv.engine.evaluation import driver as D
from tailorkv.engine.evaluation.fidelity import RecallProbe, compare_logits, fidelity_ids, run_fidelity
from tailorkv.engine.evaluation.tasks import make_suite
from tailorkv.engine.evaluation.command import register
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model
from helpers import assert_one_line_error, check_png, load_json_strict as load, write_tiny_folder

VOCAB = 256
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
LENGTHS = "512,640"
TASKS = "passkey,variable_tracking"
METHODS = ["full", "tailorkv", "streamingllm"]
COMMON = ["--device", "cpu", "--dtype", "fp32", "--lengths", LENGTHS, "--samples", "1", "--tasks", TASKS,
          "--max-new-tokens", "4", "--budget", "64", "--sink", "8", "--recent", "16", "--channels", "4",
          "--quant-layers", "0", "--fidelity-tokens", "4", "--methods", ",".join(METHODS)]



def invoke(*args):
    @click.group()
    def group():
        pass
    register(group)
    return CliRunner().invoke(group, list(args))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_folder(str(tmp_path_factory.mktemp("tiny") / "tiny-llama"), hidden=128, n_heads=4,
                             head_dim=32, vocab=VOCAB, max_pos=2048, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir)


@pytest.fixture(scope="module")
def single(tiny_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("single"))
    r = invoke("eval", "--model", tiny_dir, *COMMON, "--out", out)
    assert r.exit_code == 0, r.output
    return out, r.output


# ------------------------------------------------------------------------------------------------ pure parts
def test_budget_frac():
    assert D.budget_from_frac(0.03, 4096, 64, 64) == (123, 30, 31)  # 64+64 > 61: scaled into budget // 2
    assert D.budget_from_frac(0.25, 4096, 64, 64) == (1024, 64, 64)  # fits: unchanged
    assert D.budget_from_frac(0.03, 8192, 8, 56) == (246, 8, 56)
    b, s, r = D.budget_from_frac(0.01, 2048, 64, 64)
    assert b == 20 and s + r <= b // 2
    base = MethodSettings(sink=64, recent=64, budget=999)
    s = D.settings_for(base, "snapkv", 4096, 0.03)
    assert (s.method, s.budget, s.sink, s.recent, s.snap_window) == ("snapkv", 123, 30, 31, 32)
    assert D.settings_for(base, "snapkv", 2048, 0.03).snap_window == 30  # capped at budget // 2 = 30
    assert D.settings_for(base, "tailorkv", 4096, None).budget == 999  # no fraction: the knobs as given
    assert base.method == "full" and base.budget == 999  # not mutated
    with pytest.raises(ValueError):
        D.budget_from_frac(0, 4096, 64, 64)


def test_parsers():
    assert D.parse_lengths("2k, 4k,4096,0.5k") == [2048, 4096, 512]
    assert D.parse_methods("full,tailorkv,full") == ["full", "tailorkv"]
    assert D.parse_shard("2/5") == (2, 5) and D.parse_shard(None) is None
    for bad in ("abc", "4k,x", ""):
        with pytest.raises(ValueError, match="--lengths"):
            D.parse_lengths(bad)
    for bad in ("5/5", "x", "-1/2", "1/0"):
        with pytest.raises(ValueError, match="--shard"):
            D.parse_shard(bad)
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        D.parse_methods("full,magic")
    with pytest.raises(ValueError, match="unknown task"):
        D.parse_tasks("passkey,nope")


@pytest.mark.parametrize("n", [1, 2, 3, 5, 14])
def test_shards_partition_the_plan(n):
    plan = D.EvalPlan(lengths=[512, 640], methods=METHODS, tasks=["passkey", "variable_tracking"], samples=3,
                      fidelity_tokens=4)
    items = plan.items()
    assert len(items) == 2 * 3 * 2 * 3 + 2 * 3 and [it["index"] for it in items] == list(range(len(items)))
    parts = [{it["index"] for it in D.shard_items(items, (i, n))} for i in range(n)]
    assert sum(len(p) for p in parts) == len(items)           # disjoint ...
    assert set().union(*parts) == set(range(len(items)))      # ... and covering
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1


def test_prompt_format(tiny):
    tok = tiny.tokenizer
    s = make_suite(tok, 400, 1, 0, tasks=["passkey"])[0]
    text = D.render_prompt(tok, s)
    q = s.question.strip()
    assert text.startswith("<user>" + q + "\n\n" + s.context)   # the question before the context ...
    assert (s.context + s.question + "</user>") in text         # ... and after it
    assert text.index(q) < text.index(s.context) < text.rindex(q)
    assert text.endswith("<assistant>" + s.answer_prefix)       # the model continues the answer prefix
    assert D.prompt_ids(tok, s) == tok.encode(text)             # no BOS for this tokenizer


def test_suites_fit_the_length(tiny):
    plan = D.EvalPlan(lengths=[512, 640], methods=["full"], tasks=["passkey", "variable_tracking"], samples=2,
                      max_new_tokens=4)
    suites = D.build_suites(tiny.tokenizer, plan)
    for n, suite in suites.items():
        assert [s.task for s in suite] == ["passkey"] * 2 + ["variable_tracking"] * 2
        for s in suite:
            total = len(D.prompt_ids(tiny.tokenizer, s)) + plan.max_new(s.task)
            assert abs(total - n) <= 0.03 * n, (n, s.task, total)   # RULER: template + prompt + answer ~ n
    assert D.suite_hash(suites) == D.suite_hash(D.build_suites(tiny.tokenizer, plan))  # deterministic


# ------------------------------------------------------------------------------------------------ fidelity
def test_fidelity_full_vs_full_is_exact(tiny):
    ids = fidelity_ids(tiny.tokenizer, 300)
    assert len(ids) == 301
    r = run_fidelity(tiny, MethodSettings(method="full"), ids, 6)
    assert r["top1_agreement"] == 100.0 and r["kl_mean"] == 0.0 and r["kl_p99"] == 0.0 and r["kl_max"] == 0.0
    assert r["nll_full"] == r["nll_method"] and r["prefix_tokens"] == 294 and r["attn_recall"] is None


def test_fidelity_sparse_budget_and_recall(tiny):
    ids = fidelity_ids(tiny.tokenizer, 300)
    # every layer sparse with a budget covering the context: exact attention, recall 1
    wide = MethodSettings(method="tailorkv", quant_layers=[], budget=400, sink=8, recent=16, channels=4)
    r = run_fidelity(tiny, wide, ids, 5)
    assert r["top1_agreement"] == 100.0 and r["kl_max"] < 1e-6 and r["attn_recall"] == pytest.approx(1.0)
    # a small budget: recall is a real fraction, KL finite and non-negative
    small = MethodSettings(method="tailorkv", quant_layers=[0], budget=40, sink=4, recent=8, channels=2)
    r = run_fidelity(tiny, small, ids, 5)
    assert 0.0 < r["attn_recall"] < 1.0 and 0.0 <= r["attn_recall_min"] <= r["attn_recall"]
    assert r["attn_recall_unobserved_steps"] == 0
    assert math.isfinite(r["kl_mean"]) and r["kl_mean"] >= 0 and 0 <= r["top1_agreement"] <= 100
    import tailorkv.engine.policies.sparse as sp
    from tailorkv.ops.sparse_select import topk_tokens
    assert sp.topk_tokens is topk_tokens  # the probe put the policy back as it was


def test_recall_probe_against_brute_force(tiny):
    """Recall of one decode step recomputed independently from the layer's stored K and the picked rows."""
    from tailorkv.engine.generate import Engine
    from tailorkv.engine.methods import build_cache
    s = MethodSettings(method="tailorkv", quant_layers=[0], budget=40, sink=4, recent=8, channels=2)
    eng = Engine(tiny, build_cache(tiny, s, 400))
    ids = fidelity_ids(tiny.tokenizer, 200)
    eng.forward(ids[:199])
    layer = eng.cache.layers[2]
    seen = {}
    orig = layer.attend

    def spy(q, k, v, start_pos):
        seen.update(q=q.clone(), k=k.clone(), lo=layer.sink, hi=layer.tail_start, tl=layer.length - layer.tail_start)
        return orig(q, k, v, start_pos)

    layer.attend = spy
    with RecallProbe(eng.cache) as probe:
        picked = []
        import tailorkv.engine.policies.sparse as sp
        inner = sp.topk_tokens
        sp.topk_tokens = lambda sc, k: picked.append(inner(sc, k)) or picked[-1]
        try:
            eng.forward([ids[199]])
        finally:
            sp.topk_tokens = inner
    # brute force on layer 2 (the probe's value for it is its second entry: layers 1 and 2 are sparse)
    q, lo, hi = seen["q"][0, :, 0].double(), seen["lo"], seen["hi"]
    keys = torch.cat([layer.sink_k[0, :, :lo], layer.host_k[0, :, lo:hi], layer.tail_k[0, :, :seen["tl"]],
                      seen["k"][0]], 1).double()
    g = q.shape[0] // keys.shape[0]
    sel = picked[-1][0]  # [Hkv, topk], relative to the middle
    vals = []
    for h in range(q.shape[0]):
        p = torch.softmax(keys[h // g] @ q[h] / math.sqrt(q.shape[1]), 0)
        mid = p[lo:hi]
        vals.append(1 - (mid.sum() - mid[sel[h // g]].sum()))
    assert probe.values[1] == pytest.approx(float(torch.stack(vals).mean()), abs=1e-5)


def test_compare_logits():
    a = torch.tensor([1.0, 2.0, 3.0])
    r = compare_logits(a, a, 2)
    assert r["agree"] and r["kl"] == 0.0 and r["hit_full"] and r["hit_method"]
    b = torch.tensor([3.0, 2.0, 1.0])
    r = compare_logits(a, b, 0)
    assert not r["agree"] and r["kl"] > 0 and r["hit_method"] and not r["hit_full"]


# ------------------------------------------------------------------------------------------------ the command
def test_eval_json_schema_and_records(single):
    out, output = single
    res = load(os.path.join(out, "eval.json"))
    assert res["schema"] == 1 and res["kind"] == "tailorkv-eval" and res["command"].startswith("tailorkv")
    assert {"date", "git_commit", "torch", "gpu", "device"} <= set(res["env"]) and res["env"]["git_commit"]
    assert res["model"]["n_layers"] == 3
    e = res["eval"]
    assert e["lengths"] == [512, 640] and e["methods"] == METHODS and e["tasks"] == TASKS.split(",")
    assert e["samples_per_task"] == 1 and e["max_new_tokens"] == {"passkey": 4, "variable_tracking": 4}
    assert e["n_items"] == 2 * 3 * 2 + 2 * 3 and res["shard"] is None and res["complete"] is True
    assert set(res["settings"]) == {"512", "640"}
    for n in ("512", "640"):
        assert set(res["settings"][n]) == set(METHODS)
        for m, s in res["settings"][n].items():
            assert s["method"] == m and (s["budget"], s["sink"], s["recent"], s["channels"]) == (64, 8, 16, 4)
    assert res["layer_policies"] == {"full": ["full"] * 3, "tailorkv": ["quant", "sparse", "sparse"],
                                     "streamingllm": ["streamingllm"] * 3}
    recs = res["records"]
    assert len(recs) == 12 and [r["index"] for r in recs] == list(range(12))
    keys = {"index", "kind", "length", "method", "task", "sample", "prompt_hash", "n_tokens", "prompt_tokens",
            "answers", "prediction", "score", "new_tokens", "stop", "loaded_frac", "attended_frac", "status",
            "max_new_tokens", "prefill_s", "decode_s"}
    hashes = {}
    for r in recs:
        assert keys <= set(r), keys - set(r)
        assert r["status"] == "ok" and r["kind"] == "task" and isinstance(r["prediction"], str)
        assert 0 <= r["score"] <= 100 and r["answers"] and 1 <= r["new_tokens"] <= 4
        assert r["prompt_tokens"] + 4 <= r["length"] * 1.03
        hashes.setdefault((r["length"], r["task"], r["sample"]), set()).add(r["prompt_hash"])
        if r["method"] == "full":
            assert r["loaded_frac"] is None and r["attended_frac"] is None
        elif r["method"] == "tailorkv":  # top-K = 64 - 8 - 16 = 40 of ~500 tokens per sparse layer
            assert 0 < r["loaded_frac"] < 0.12 and r["loaded_frac"] < r["attended_frac"] < 0.2
        else:
            assert r["loaded_frac"] is None and 0 < r["attended_frac"] <= 64 / 400
    assert len(hashes) == 2 * 2 and all(len(h) == 1 for h in hashes.values())  # same samples for all methods
    fid = res["fidelity"]
    assert [(f["length"], f["method"]) for f in fid] == [(n, m) for n in (512, 640) for m in METHODS]
    for f in fid:
        assert f["status"] == "ok" and f["steps"] == 4 and 0 <= f["top1_agreement"] <= 100 and f["kl_mean"] >= 0
        if f["method"] == "full":
            assert f["top1_agreement"] == 100.0 and f["kl_mean"] == 0.0
        if f["method"] == "tailorkv":
            assert 0 < f["attn_recall"] <= 1
    summ = res["summary"]
    for n in ("512", "640"):
        for m in METHODS:
            cell = summ["per_length"][n][m]
            assert cell["n"] == 2 and cell["failed"] == 0
            scores = [r["score"] for r in recs if str(r["length"]) == n and r["method"] == m]
            assert cell["tasks"] == dict(zip(TASKS.split(","), scores))
            assert cell["average"] == pytest.approx(sum(scores) / 2)
    assert set(summ["overall"]) == set(METHODS)
    check_png(os.path.join(out, "eval_scores.png"))
    check_png(os.path.join(out, "eval_fidelity.png"))
    assert "Average" in output and "fidelity vs full" in output and "items ok" in output


def test_shards_merge_into_the_single_run(tiny_dir, single, tmp_path):
    out = str(tmp_path / "sharded")
    for i in range(3):
        r = invoke("eval", "--model", tiny_dir, *COMMON, "--out", out, "--shard", f"{i}/3")
        assert r.exit_code == 0, r.output
        part = load(os.path.join(out, f"eval.shard-{i}-of-3.json"))
        assert part["shard"] == {"index": i, "count": 3} and part["complete"] is True
        assert all(x["index"] % 3 == i for x in part["records"] + part["fidelity"])
    r = invoke("eval-merge", out)
    assert r.exit_code == 0, r.output
    merged, ref = load(os.path.join(out, "eval.json")), load(os.path.join(single[0], "eval.json"))
    assert D.strip_timing(merged["records"]) == D.strip_timing(ref["records"])
    assert D.strip_timing(merged["fidelity"]) == D.strip_timing(ref["fidelity"])
    for key in ("summary", "settings", "eval", "suites_hash", "complete"):
        assert merged[key] == ref[key], key
    assert len(merged["merged_from"]) == 3 and merged["shard"] is None
    check_png(os.path.join(out, "eval_scores.png"))
    # a missing shard is a one-line error
    os.remove(os.path.join(out, "eval.shard-1-of-3.json"))
    r = invoke("eval-merge", out)
    assert r.exit_code == 1 and "shards [1] of 3 are missing" in r.output and "Traceback" not in r.output


def test_resume_finishes_an_interrupted_shard(tiny_dir, tmp_path):
    out = str(tmp_path / "resumed")
    args = ["eval", "--model", tiny_dir, *COMMON, "--out", out, "--shard", "0/2"]
    assert invoke(*args).exit_code == 0
    path = os.path.join(out, "eval.shard-0-of-2.json")
    whole = load(path)
    cut = dict(whole, records=whole["records"][:2], fidelity=[], complete=False)  # as an interrupt leaves it
    cut["records"][1] = dict(cut["records"][1], status="error", score=None)       # a failed item is redone
    with open(path, "w") as f:
        json.dump(cut, f)
    r = invoke(*args, "--resume")
    assert r.exit_code == 0, r.output
    assert "1 items done" in r.output
    res = load(path)
    assert res["complete"] is True
    assert D.strip_timing(res["records"]) == D.strip_timing(whole["records"])
    assert D.strip_timing(res["fidelity"]) == D.strip_timing(whole["fidelity"])
    assert res["records"][0]["wall_s"] == whole["records"][0]["wall_s"]  # kept, not run again
    # another run's file is refused in one line, and left as it was
    r = invoke(*args, "--resume", "--seed", "5")
    assert r.exit_code == 1 and "holds another run" in r.output and "'eval' differs" in r.output
    assert load(path) == res


def test_ctrl_c_saves_the_finished_items(tiny_dir, tmp_path, monkeypatch):
    out = str(tmp_path / "interrupted")
    args = ["eval", "--model", tiny_dir, *COMMON, "--out", out]
    real, calls = D.run_item, []

    def run_item(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(D, "run_item", run_item)
    r = invoke(*args)
    assert r.exit_code == 1 and "interrupted: 2 items saved" in r.output
    saved = load(os.path.join(out, "eval.json"))
    assert saved["complete"] is False and [x["index"] for x in saved["records"]] == [0, 1]
    monkeypatch.setattr(D, "run_item", real)
    again = shlex.split(r.output.split("to finish, run: ")[1].strip())  # the command it prints works as it is
    assert again[:2] == ["tailorkv", "eval"] and "--resume" in again and again[again.index("--out") + 1] == out
    r = invoke(*again[1:])
    assert r.exit_code == 0, r.output
    assert "2 items done" in r.output
    assert load(os.path.join(out, "eval.json"))["complete"] is True


def test_fidelity_only_with_budget_frac(tiny_dir, tmp_path):
    out = str(tmp_path / "fid")
    r = invoke("eval", "--model", tiny_dir, "--device", "cpu", "--lengths", "256,320", "--samples", "0",
               "--methods", "snapkv,quest", "--budget-frac", "0.2", "--fidelity-tokens", "3", "--out", out)
    assert r.exit_code == 0, r.output
    res = load(os.path.join(out, "eval.json"))
    assert res["records"] == [] and len(res["fidelity"]) == 4 and res["complete"] is True
    s = res["settings"]
    assert (s["256"]["snapkv"]["budget"], s["256"]["snapkv"]["sink"], s["256"]["snapkv"]["recent"]) == (51, 12, 13)
    assert s["256"]["snapkv"]["snap_window"] == 25 and s["320"]["quest"]["budget"] == 64
    assert res["eval"]["budget_frac"] == 0.2
    check_png(os.path.join(out, "eval_fidelity.png"))
    assert not os.path.exists(os.path.join(out, "eval_scores.png"))
    assert "fidelity vs full" in r.output


@pytest.mark.parametrize("args, message", [
    (["--methods", "full,magic"], "unknown method 'magic'"),
    (["--lengths", "4k,abc"], "--lengths 'abc' is not a length"),
    (["--lengths", "8k"], "beyond what"),
    (["--shard", "3/2", "--out", "x"], "--shard 3/2"),
    (["--shard", "0/2"], "--shard needs --out"),
    (["--resume"], "--resume needs --out"),
    (["--tasks", "nope"], "unknown task 'nope'"),
    (["--methods", "tailorkv", "--quant-layers", "7"], "out of range"),
    (["--methods", "snapkv", "--budget", "30"], "observation window"),
    (["--methods", "full,streamingllm", "--channels", "4"], "--channels has no effect under full, streamingllm"),
])
def test_errors_are_one_line(tiny_dir, args, message, tmp_path):
    base = ["eval", "--model", tiny_dir, "--device", "cpu", "--lengths", "512", "--samples", "1",
            "--tasks", "passkey", "--methods", "full"]
    assert_one_line_error(invoke(*base, *args), message)


def test_a_log_gets_one_line_per_item(single):
    """Where stderr is not a terminal (a log file) the progress bar does not show: each item prints a line."""
    _, output = single
    lines = [line for line in output.splitlines() if line.startswith("[")]
    assert lines and lines[0].startswith("[1/") and ("score" in lines[0] or "done" in lines[0])

"""`tailorkv eval` on CPU with a tiny random Llama and a byte-level tokenizer: the JSON schema and records, the
prompt format, --budget-frac, shards that partition the work and merge into the single run, the PNGs, fidelity
(full vs full is exact), one-line errors."""
import dataclasses
import json
import math
import os
import shlex

import pytest
import torch

from tailorkv.engine.evaluation import driver as D, plan as P, prompts, summary as S
from tailorkv.engine.evaluation.fidelity import RecallProbe, compare_logits, fidelity_ids, run_fidelity
from tailorkv.engine.evaluation.tasks import make_suite
from tailorkv.engine.policies.selection import ChannelSelector
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model
from helpers import (TAG_TEMPLATE, assert_one_line_error, check_png, invoke_eval, load_json_strict as load,
                     write_tiny_folder)

VOCAB = 256
TEMPLATE = TAG_TEMPLATE
LENGTHS = "512,640"
TASKS = "passkey,variable_tracking"
METHODS = ["full", "tailorkv", "streamingllm"]
COMMON = ["--device", "cpu", "--dtype", "fp32", "--lengths", LENGTHS, "--samples", "1", "--tasks", TASKS,
          "--max-new-tokens", "4", "--sink", "8", "--recent", "16", "--channels", "4",
          "--quant-layers", "0", "--fidelity-tokens", "4", "--methods", ",".join(METHODS), "--budgets", "64,12%"]
GROUPS = ["64", "12%"]
RUNS = [(None, "full")] + [(b, m) for b in GROUPS for m in METHODS[1:]]  # each sample's runs, in order


invoke = invoke_eval


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
def test_parsers():
    assert P.parse_lengths("2k, 4k,4096,0.5k") == [2048, 4096, 512]
    assert P.parse_methods("full,tailorkv,full") == ["full", "tailorkv"]
    assert P.parse_shard("2/5") == (2, 5) and P.parse_shard(None) is None
    for bad in ("abc", "4k,x", ""):
        with pytest.raises(ValueError, match="--lengths"):
            P.parse_lengths(bad)
    for bad in ("5/5", "x", "-1/2", "1/0"):
        with pytest.raises(ValueError, match="--shard"):
            P.parse_shard(bad)
    with pytest.raises(ValueError, match="unknown method 'magic'"):
        P.parse_methods("full,magic")
    with pytest.raises(ValueError, match="unknown task"):
        P.parse_tasks("passkey,nope")
    with pytest.raises(ValueError, match="--tasks is empty"):
        P.parse_tasks(" , ")
    assert P.parse_tasks(None) == list(P.TASKS)


def test_prompt_format(tiny):
    tok = tiny.tokenizer
    s = make_suite(tok, 400, 1, 0, tasks=["passkey"])[0]
    q = s.question.strip()
    text = prompts.render_prompt(tok, s)                          # RULER's placement by default ...
    assert text.startswith("<user>" + s.context + s.question + "</user>")  # ... the question after the text
    assert text.count(q) == 1
    assert text.endswith("<assistant>" + s.answer_prefix)       # the model continues the answer prefix
    assert prompts.prompt_ids(tok, s) == tok.encode(text)       # no BOS for this tokenizer
    both = prompts.render_prompt(tok, s, "both")
    assert both.startswith("<user>" + q + "\n\n" + s.context)    # the question before the context ...
    assert (s.context + s.question + "</user>") in both          # ... and after it
    assert both.index(q) < both.index(s.context) < both.rindex(q)
    with pytest.raises(ValueError, match="--question"):
        prompts.user_message(s, "before")


def test_suites_fit_the_length(tiny):
    plan = P.EvalPlan(lengths=[640, 768], methods=["full"], tasks=["passkey", "variable_tracking"], samples=2,
                      max_new_tokens=4)
    suites = prompts.build_suites(tiny.tokenizer, plan)
    for n, suite in suites.items():
        assert [s.task for s in suite] == ["passkey"] * 2 + ["variable_tracking"] * 2
        for s in suite:
            total = len(prompts.prompt_ids(tiny.tokenizer, s)) + plan.max_new(s.task)
            assert 0.97 * n <= total <= n, (n, s.task, total)   # RULER: template + prompt + answer fit in n
    assert prompts.suite_hash(suites) == prompts.suite_hash(prompts.build_suites(tiny.tokenizer, plan))  # deterministic
    assert prompts.suite_hash(suites, "both") != prompts.suite_hash(suites)  # the placement is part of it
    both = dataclasses.replace(plan, question="both")
    longer = {n: len(prompts.prompt_ids(tiny.tokenizer, s, "both")) for n, (s, *_) in
              prompts.build_suites(tiny.tokenizer, both).items()}
    assert all(0.97 * n <= longer[n] + 4 <= n for n in longer)  # fitted with the question stated twice



def test_a_sample_whose_own_overhead_is_longer_is_fitted_again(tiny, monkeypatch):
    """The overhead is measured on a probe sample; one whose template, key or question takes more tokens is
    fitted again to a shorter target, so that it too fits in the length."""
    plan = P.EvalPlan(lengths=[768], methods=["full"], tasks=["passkey"], samples=2, max_new_tokens=4)
    real = prompts.prompt_ids
    monkeypatch.setattr(prompts, "prompt_ids", lambda tok, s, q="after": real(tok, s, q) + [0] * 20 * (s.depth == 1.0))
    first, last = prompts.build_suites(tiny.tokenizer, plan)[768]
    assert (first.depth, last.depth) == (0.0, 1.0)
    assert first.target_tokens - last.target_tokens >= 10    # the second sample was fitted again, shorter
    for s in (first, last):
        assert 0.97 * 768 <= len(prompts.prompt_ids(tiny.tokenizer, s)) + 4 <= 768

# ------------------------------------------------------------------------------------------------ dNLL
def _engine(tiny, settings, n=700):
    from tailorkv.engine.generate import Engine
    from tailorkv.engine.methods import build_cache
    return Engine(tiny, build_cache(tiny, settings, n))


def test_teacher_forcing_shares_the_greedy_path(tiny):
    s = make_suite(tiny.tokenizer, 480, 1, 0, tasks=["passkey"])[0]
    ids = prompts.prompt_ids(tiny.tokenizer, s)
    full = MethodSettings(method="full")
    with torch.inference_mode():
        ref = D.greedy(_engine(tiny, full), ids, 6, own_nll=True)
        assert len(ref["nll"]) == len(ref["picked"]) >= 1 and ref["agree"] == []
        nll, agree = D.teacher_force(_engine(tiny, full), ids, ref["picked"])
        assert nll == pytest.approx(ref["nll"], abs=1e-6) and all(agree)  # full's own picks, teacher-forced
        small = MethodSettings(method="tailorkv", quant_layers=[0], budget=40, sink=4, recent=8, channels=2)
        g = D.greedy(_engine(tiny, small), ids, 6, follow=ref["picked"])
        tf, tf_agree = D.teacher_force(_engine(tiny, small), ids, ref["picked"])
    k = len(g["nll"])  # the terms up to (and with) the first pick that left full's answer
    assert 1 <= k <= len(tf) and g["nll"] == pytest.approx(tf[:k], abs=1e-6) and g["agree"] == tf_agree[:k]
    assert (k == len(tf)) == (g["picked"][:len(tf)] == ref["picked"])


def test_run_sample_dnll(tiny):
    s = make_suite(tiny.tokenizer, 480, 1, 0, tasks=["passkey"])[0]
    full = D.run_sample(tiny, MethodSettings(method="full"), s, 6)
    ans = full["answer_ids"]
    assert full["nll_tokens"] == len(ans) >= 1 and full["agree"] == 100.0 and "tf" not in full
    # every layer sparse with a budget covering the context: exact, so the greedy pass is the teacher forcing
    wide = MethodSettings(method="tailorkv", quant_layers=[], budget=800, sink=8, recent=16, channels=4)
    r = D.run_sample(tiny, wide, s, 6, reference=ans)
    assert r["tf"] == "shared" and r["nll"] == pytest.approx(full["nll"], abs=1e-5) and r["agree"] == 100.0
    assert "answer_ids" not in r
    small = MethodSettings(method="streamingllm", budget=24, sink=4, recent=8)
    r = D.run_sample(tiny, small, s, 6, reference=ans)
    assert r["tf"] == "separate" and r["nll_tokens"] == len(ans) and r["nll"] > full["nll"] and r["agree"] < 100
    assert D.run_sample(tiny, small, s, 6)["nll"] is None  # no reference: nothing to score


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
    assert math.isfinite(r["kl_mean"]) and r["kl_mean"] >= 0 and 0 <= r["top1_agreement"] <= 100


def test_recall_probe_against_brute_force(tiny):
    """Recall of one decode step recomputed independently from the layer's stored K and the picked rows."""
    from tailorkv.engine.generate import Engine
    from tailorkv.engine.methods import build_cache
    s = MethodSettings(method="tailorkv", quant_layers=[0], budget=40, sink=4, recent=8, channels=2)
    eng = Engine(tiny, build_cache(tiny, s, 400), use_cuda_graph=False)
    ids = fidelity_ids(tiny.tokenizer, 200)
    eng.forward(ids[:199])
    layer = eng.cache.layers[2]
    inner = layer.selector
    keys_before, _ = layer.held_kv()  # positions 0..198, read independently of the probe
    lo, hi = layer.regions()["middle"].start, layer.regions()["middle"].stop
    seen = {}

    class Spy(ChannelSelector):
        def select(self, lay, q):
            pos = super().select(lay, q)
            seen.update(q=q.clone(), pos=pos.clone())
            return pos
    layer.selector = Spy(inner.rule, inner.channel_rule)
    with RecallProbe(eng.cache) as probe:
        eng.forward([ids[199]])
        probe.end_step()
    assert isinstance(layer.selector, Spy)  # the probe put back what it wrapped
    layer.selector = inner
    # brute force on layer 2 (the probe's value for it is its second entry: layers 1 and 2 are sparse)
    new_k = torch.cat(layer.held_kv(), 0)[0:1, :, 199:200]   # this step's key, now held
    keys = torch.cat([keys_before[0], new_k[0]], 1).double()
    q = seen["q"][0, :, 0].double()
    g = q.shape[0] // keys.shape[0]
    sel = seen["pos"][0] - lo  # [Hkv, topk], relative to the middle
    vals = []
    for h in range(q.shape[0]):
        p = torch.softmax(keys[h // g] @ q[h] / math.sqrt(q.shape[1]), 0)
        mid = p[lo:hi]
        vals.append(1 - (mid.sum() - mid[sel[h // g]].sum()))
    assert probe.values[1] == pytest.approx(float(torch.stack(vals).mean()), abs=1e-5)
    per_layer = probe.summary()["attn_recall_per_layer"]
    assert set(per_layer) == {1, 2} and per_layer[2] == pytest.approx(probe.values[1])


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
    assert res["schema"] == 2 and res["kind"] == "tailorkv-eval" and res["command"].startswith("tailorkv")
    assert {"date", "git_commit", "torch", "gpu", "device"} <= set(res["env"]) and res["env"]["git_commit"]
    assert res["model"]["n_layers"] == 3
    e = res["eval"]
    assert e["lengths"] == [512, 640] and e["methods"] == METHODS and e["tasks"] == TASKS.split(",")
    assert e["question"] == "after" and e["samples_per_task"] == 1
    assert e["max_new_tokens"] == {"passkey": 4, "variable_tracking": 4}
    assert [g["label"] for g in e["budgets"]] == GROUPS and e["split"] == "shrink"
    assert e["n_items"] == 2 * 2 + 2 * len(RUNS) and e["n_records"] == 2 * 2 * len(RUNS) + 2 * len(RUNS)
    assert res["shard"] is None and res["complete"] is True
    assert set(res["settings"]) == set(GROUPS)
    for n, share in (("512", 61), ("640", 77)):  # 12% of the length; 8 + 16 fit in half of it
        for m, s in res["settings"]["64"][n].items():
            assert s["method"] == m and (s["budget"], s["sink"], s["recent"], s["channels"]) == (64, 8, 16, 4)
        assert [(s["budget"], s["sink"], s["recent"]) for s in res["settings"]["12%"][n].values()] == \
            [(share, 8, 16)] * 3
    policies = {"full": ["full"] * 3, "tailorkv": ["quant", "sparse", "sparse"], "streamingllm": ["streamingllm"] * 3}
    assert res["layer_policies"] == {g: policies for g in GROUPS}
    recs = res["records"]
    assert len(recs) == 2 * 2 * len(RUNS) and [r["index"] for r in recs] == list(range(len(recs)))
    assert [(r["budget"], r["method"]) for r in recs[:len(RUNS)]] == RUNS
    keys = {"index", "item", "kind", "length", "budget", "method", "task", "sample", "prompt_hash", "n_tokens",
            "prompt_tokens", "answers", "prediction", "score", "new_tokens", "stop", "loaded_frac", "attended_frac",
            "status", "max_new_tokens", "prefill_s", "decode_s", "nll", "nll_tokens", "dnll", "agree"}
    hashes = {}
    for r in recs:
        assert keys <= set(r), keys - set(r)
        assert r["status"] == "ok" and r["kind"] == "task" and isinstance(r["prediction"], str)
        assert 0 <= r["score"] <= 100 and r["answers"] and 1 <= r["new_tokens"] <= 4
        assert r["prompt_tokens"] + 4 <= r["length"] * 1.03
        hashes.setdefault(r["item"], set()).add(r["prompt_hash"])
        assert r["nll_tokens"] >= 1 and math.isfinite(r["nll"]) and 0 <= r["agree"] <= 100
        if r["method"] == "full":
            assert r["loaded_frac"] is None and r["attended_frac"] is None and r["budget"] is None
            assert r["dnll"] == 0.0 and len(r["answer_ids"]) == r["nll_tokens"] and "tf" not in r
            ref = r
            continue
        assert r["dnll"] == pytest.approx(r["nll"] - ref["nll"]) and r["nll_tokens"] == ref["nll_tokens"]
        assert r["tf"] in ("shared", "separate") and r["item"] == ref["item"]
        if r["method"] == "tailorkv":  # top-K = 64 - 8 - 16 = 40 (or 37, 53 at 12%) of ~500 tokens
            assert 0 < r["loaded_frac"] < 0.12 and r["loaded_frac"] < r["attended_frac"] < 0.2
        else:
            assert r["loaded_frac"] is None and 0 < r["attended_frac"] <= 77 / 400
    assert len(hashes) == 2 * 2 and all(len(h) == 1 for h in hashes.values())  # same sample for all runs
    fid = res["fidelity"]
    assert [(f["length"], f["budget"], f["method"]) for f in fid] == [(n, b, m) for n in (512, 640) for b, m in RUNS]
    for f in fid:
        assert f["status"] == "ok" and f["steps"] == 4 and 0 <= f["top1_agreement"] <= 100 and f["kl_mean"] >= 0
        if f["method"] == "full":
            assert f["top1_agreement"] == 100.0 and f["kl_mean"] == 0.0
        if f["method"] == "tailorkv":
            assert 0 < f["attn_recall"] <= 1
    summ = res["summary"]["budgets"]
    assert set(summ) == set(GROUPS)
    for g in GROUPS:
        for n in ("512", "640"):
            for m in METHODS:
                cell = summ[g]["per_length"][n][m]
                assert cell["n"] == 2 and cell["failed"] == 0
                scores = [r["score"] for r in recs if str(r["length"]) == n and r["method"] == m
                          and r["budget"] == (None if m == "full" else g)]
                assert cell["tasks"] == dict(zip(TASKS.split(","), scores))
                assert cell["average"] == pytest.approx(sum(scores) / 2) and cell["average_se"] is None  # 1/task
                dnll = [r["dnll"] for r in recs if str(r["length"]) == n and r["method"] == m
                        and r["budget"] == (None if m == "full" else g)]
                assert cell["dnll"] == pytest.approx(sum(dnll) / 2) and cell["dnll_se"] is None
        assert set(summ[g]["overall"]) == set(METHODS) and summ[g]["overall"]["full"]["diff"] == 0.0
    assert summ["64"]["per_length"]["512"]["full"] == summ["12%"]["per_length"]["512"]["full"]
    for name in ("eval_scores-64.png", "eval_scores-12pct.png", "eval_budgets.png", "eval_fidelity.png"):
        check_png(os.path.join(out, name))
    assert "Average" in output and "fidelity vs full" in output and "records ok" in output
    assert "every budget" in output and "dNLL" in output


def test_shards_merge_into_the_single_run(tiny_dir, single, tmp_path):
    out = str(tmp_path / "sharded")
    for i in range(3):
        r = invoke("eval", "--model", tiny_dir, *COMMON, "--out", out, "--shard", f"{i}/3")
        assert r.exit_code == 0, r.output
        part = load(os.path.join(out, f"eval.shard-{i}-of-3.json"))
        assert part["shard"] == {"index": i, "count": 3} and part["complete"] is True
        assert all(x["item"] % 3 == i for x in part["records"] + part["fidelity"])
    r = invoke("eval-merge", out)
    assert r.exit_code == 0, r.output
    merged, ref = load(os.path.join(out, "eval.json")), load(os.path.join(single[0], "eval.json"))
    n_items = merged["eval"]["n_items"]  # items, as the shards count them (it used to print the records' count)
    assert f"merged 3 shards ({n_items} items, {len(merged['records']) + len(merged['fidelity'])} records)" \
        in " ".join(r.output.split()), r.output
    assert S.strip_timing(merged["records"]) == S.strip_timing(ref["records"])
    assert S.strip_timing(merged["fidelity"]) == S.strip_timing(ref["fidelity"])
    for key in ("summary", "settings", "eval", "suites_hash", "complete"):
        assert merged[key] == ref[key], key
    assert len(merged["merged_from"]) == 3 and merged["shard"] is None
    assert "--shard" not in merged["command"] and merged["args"]["shard"] is None  # the whole run's command
    check_png(os.path.join(out, "eval_budgets.png"))
    # a shard cut short (as a time limit leaves it): an error naming --partial, which merges what finished
    path = os.path.join(out, "eval.shard-2-of-3.json")
    part = load(path)
    last = max(r["item"] for r in part["records"])
    with open(path, "w") as f:
        json.dump(dict(part, records=[r for r in part["records"] if r["item"] != last], complete=False), f)
    r = invoke("eval-merge", out)
    assert r.exit_code == 1 and "--partial" in r.output and "Traceback" not in r.output
    r = invoke("eval-merge", out, "--partial")
    assert r.exit_code == 0, r.output
    cut = load(os.path.join(out, "eval.json"))
    assert cut["complete"] is False and any(w.startswith("partial merge") for w in cut["warnings"])
    assert len(cut["records"]) < len(merged["records"]) and "partial merge" in r.output
    assert r.output.count("records without a result") == 1  # once, with the tables (it came on stderr too)
    n_cut = sum(c["n"] for c in cut["summary"]["budgets"][next(iter(cut["summary"]["budgets"]))]["overall"].values())
    n_all = sum(c["n"] for c in merged["summary"]["budgets"][next(iter(merged["summary"]["budgets"]))]["overall"].values())
    assert n_cut < n_all
    # a missing shard is a one-line error
    os.remove(os.path.join(out, "eval.shard-1-of-3.json"))
    r = invoke("eval-merge", out)
    assert r.exit_code == 1 and "shards [1] of 3 are missing" in r.output and "Traceback" not in r.output
    r = invoke("eval-merge", out, "--partial")  # a shard killed before its first save left no file
    assert r.exit_code == 0 and "shards [1] of 3 wrote no file" in r.output, r.output
    assert load(os.path.join(out, "eval.json"))["complete"] is False
    # a file that is not a shard's results: one line naming it
    for text in ("[]", '{"shard": {"count": 3, "index": 0}}', "{not json"):
        with open(os.path.join(out, "eval.shard-0-of-3.json"), "w") as f:
            f.write(text)
        assert_one_line_error(invoke("eval-merge", out, "--partial"), "eval.shard-0-of-3.json is not an eval "
                              "results file", "rerun that shard")


def test_resume_finishes_an_interrupted_shard(tiny_dir, tmp_path):
    out = str(tmp_path / "resumed")
    args = ["eval", "--model", tiny_dir, *COMMON, "--out", out, "--shard", "0/2"]
    assert invoke(*args).exit_code == 0
    path = os.path.join(out, "eval.shard-0-of-2.json")
    whole = load(path)
    first, second = sorted({r["item"] for r in whole["records"]})[:2]
    kept = [r for r in whole["records"] if r["item"] == first]
    redo = [r for r in whole["records"] if r["item"] == second][:2]
    redo[1] = dict(redo[1], status="error", score=None)                         # a failed item is redone whole
    cut = dict(whole, records=kept + redo, fidelity=[], complete=False)         # as an interrupt leaves it
    with open(path, "w") as f:
        json.dump(cut, f)
    r = invoke(*args, "--resume")
    assert r.exit_code == 0, r.output
    assert "1 item done" in r.output
    res = load(path)
    assert res["complete"] is True
    assert S.strip_timing(res["records"]) == S.strip_timing(whole["records"])
    assert S.strip_timing(res["fidelity"]) == S.strip_timing(whole["fidelity"])
    assert res["records"][0]["wall_s"] == whole["records"][0]["wall_s"]  # kept, not run again
    # another run's file is refused in one line, and left as it was
    r = invoke(*args, "--resume", "--seed", "5")
    assert r.exit_code == 1 and "holds another run" in r.output and "'eval' differs" in r.output
    assert "loading" not in r.output  # found before the weights load
    assert load(path) == res


def test_resume_takes_a_file_written_before_a_settings_field_existed():
    """A run started before an upgrade added a MethodSettings field (here kt_bits) resumes after it when the field
    is at its default; set to anything else it is another run."""
    from tailorkv.engine.evaluation.merge import check_same_run
    plan = P.EvalPlan(lengths=[512], methods=["full", "tailorkv"], tasks=["passkey"], samples=1)
    fresh = S.results(command="", args={}, env={}, model={}, plan=plan, shard=None, records=[])

    def without(d, key):
        return {k: without(v, key) for k, v in d.items() if k != key} if isinstance(d, dict) else d
    old = without(json.loads(json.dumps(fresh, default=str)), "kt_bits")
    assert "kt_bits" in json.dumps(fresh["settings"]) and "kt_bits" not in json.dumps(old)
    check_same_run(old, fresh, "eval.json")
    plan.base = MethodSettings(kt_bits=8)
    changed = S.results(command="", args={}, env={}, model={}, plan=plan, shard=None, records=[])
    with pytest.raises(ValueError, match="holds another run"):
        check_same_run(old, changed, "eval.json")


def test_resume_of_a_run_on_other_prompts_names_the_cause():
    from tailorkv.engine.evaluation.merge import SAME_KEYS, check_same_run
    plan = P.EvalPlan(lengths=[512], methods=["full"], tasks=["passkey"], samples=1)
    prev = S.results(command="", args={}, env={}, model={}, plan=plan, shard=None, records=[], suites_hash="a1")
    fresh = S.results(command="", args={}, env={}, model={}, plan=plan, shard=None, records=[], suites_hash="b2")
    with pytest.raises(ValueError, match="ran other prompts.*--overwrite"):
        check_same_run(json.loads(json.dumps(prev, default=str)), fresh, "eval.json", SAME_KEYS)


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
    assert r.exit_code == 130 and "interrupted: 2 items saved" in r.output
    saved = load(os.path.join(out, "eval.json"))
    assert saved["complete"] is False and [x["item"] for x in saved["records"]] == [0] * len(RUNS) + [1] * len(RUNS)
    monkeypatch.setattr(D, "run_item", real)
    again = shlex.split(r.output.split("to finish, run: ")[1].strip())  # the command it prints works as it is
    assert again[:2] == ["tailorkv", "eval"] and "--resume" in again and again[again.index("--out") + 1] == out
    r = invoke(*again[1:])
    assert r.exit_code == 0, r.output
    assert "2 items done" in r.output
    assert load(os.path.join(out, "eval.json"))["complete"] is True


def test_an_earlier_run_is_kept_unless_overwrite_or_resume(tiny_dir, tmp_path):
    out = tmp_path / "again"
    out.mkdir()
    (out / "eval.json").write_text('{"earlier": true}')
    args = ["eval", "--model", tiny_dir, *COMMON, "--out", str(out)]
    r = invoke(*args)
    assert_one_line_error(r, "already holds an earlier run's results: pass --overwrite", "--resume finishes")
    assert " parameters, " not in r.output
    assert_one_line_error(invoke(*args, "--resume", "--overwrite"), "use one of them")
    # --resume on a file that is not an eval's results: refused before the model loads, the file kept
    r = invoke(*args, "--resume")
    assert_one_line_error(r, "is not an eval results file (no eval, records", "--overwrite instead of --resume")
    assert " parameters, " not in r.output and (out / "eval.json").read_text() == '{"earlier": true}'
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert_one_line_error(invoke("eval", "--model", tiny_dir, *COMMON, "--out", str(a_file / "sub")),
                          "a_file is a file, not a folder")
    assert_one_line_error(invoke("eval-merge", str(tmp_path), "--out", str(a_file / "sub")),
                          "a_file is a file, not a folder")
    assert_one_line_error(invoke("eval-merge", str(a_file)), "a_file is a file: give the folder the shards wrote to")
    assert_one_line_error(invoke("eval", "--model", tiny_dir, *COMMON, "--out", str(a_file)),
                          "a_file is a file: give a folder")
    # eval-merge replaces an earlier merge, not a whole run's results
    assert_one_line_error(invoke("eval-merge", str(out)), "holds results that no merge wrote: pass --overwrite")
    assert (out / "eval.json").read_text() == '{"earlier": true}'


def test_no_chart_of_an_earlier_run_stays_beside_eval_json(tiny_dir, single, tmp_path, monkeypatch):
    """--overwrite with other budget groups and no fidelity, cut short by Ctrl-C, then resumed: the folder holds
    this run's charts only (the earlier run's eval_scores-64.png, -12pct.png and eval_fidelity.png used to stay)."""
    import shutil
    out = str(tmp_path / "again")
    shutil.copytree(single[0], out)
    args = ["eval", "--model", tiny_dir, "--device", "cpu", "--lengths", "512", "--samples", "2", "--tasks",
            "passkey", "--max-new-tokens", "2", "--methods", "full,streamingllm", "--budgets", "64", "--out", out]
    real = D.run_item
    calls = []

    def run_item(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(D, "run_item", run_item)
    r = invoke(*args, "--overwrite")
    assert r.exit_code == 130 and "1 item saved" in r.output, r.output
    charts = {"eval.json", "eval_scores.png", "eval_budgets.png"}
    assert set(os.listdir(out)) == charts
    assert load(os.path.join(out, "eval.json"))["complete"] is False
    monkeypatch.setattr(D, "run_item", real)
    r = invoke(*args, "--resume")
    assert r.exit_code == 0, r.output
    assert set(os.listdir(out)) == charts and load(os.path.join(out, "eval.json"))["complete"] is True


def test_the_default_folder_is_claimed_before_the_model_loads(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "eval").write_text("a file where eval/results/ would go")
    r = invoke("eval", "--model", tiny_dir, *COMMON)
    assert_one_line_error(r, "cannot make the results folder eval/results/", "or pass --out DIR")
    assert " parameters, " not in r.output
    os.unlink(tmp_path / "eval")
    monkeypatch.setattr(D, "run_item", lambda *a, **kw: (_ for _ in ()).throw(KeyboardInterrupt))
    r = invoke("eval", "--model", tiny_dir, *COMMON)
    assert r.exit_code == 130 and "no item had finished, nothing was written" in r.output
    assert os.listdir(tmp_path / "eval" / "results") == []  # the folder it made for the run went with it


def test_fidelity_only_with_budget_frac(tiny_dir, tmp_path):
    out = str(tmp_path / "fid")
    r = invoke("eval", "--model", tiny_dir, "--device", "cpu", "--lengths", "256,320", "--samples", "0",
               "--methods", "snapkv,quest", "--budget-frac", "0.2", "--fidelity-tokens", "3", "--out", out)
    assert r.exit_code == 0, r.output
    res = load(os.path.join(out, "eval.json"))
    assert res["records"] == [] and len(res["fidelity"]) == 4 and res["complete"] is True
    s = res["settings"]["20%"]
    assert (s["256"]["snapkv"]["budget"], s["256"]["snapkv"]["sink"], s["256"]["snapkv"]["recent"]) == (51, 12, 13)
    assert s["256"]["snapkv"]["snap_window"] == 25 and s["320"]["quest"]["budget"] == 64
    assert res["eval"]["budgets"] == [{"label": "20%", "kind": "frac", "frac": 0.2, "tokens": None}]
    assert {f["budget"] for f in res["fidelity"]} == {"20%"}
    check_png(os.path.join(out, "eval_fidelity.png"))
    assert not os.path.exists(os.path.join(out, "eval_scores.png"))
    assert not os.path.exists(os.path.join(out, "eval_budgets.png"))
    assert "fidelity vs full" in r.output


def test_paper_protocol_gives_baselines_dense_layers(tiny_dir, tmp_path):
    out = str(tmp_path / "paper")
    r = invoke("eval", "--model", tiny_dir, "--device", "cpu", "--lengths", "512", "--samples", "1", "--tasks",
               "passkey", "--max-new-tokens", "2", "--methods", "full,snapkv,quest", "--budgets", "64",
               "--protocol", "paper", "--out", out)
    assert r.exit_code == 0, r.output
    res = load(os.path.join(out, "eval.json"))
    assert res["eval"]["protocol"] == "paper" and "dense" in res["eval"]["protocol_convention"]
    assert res["layer_policies"]["64"] == {"full": ["full"] * 3, "snapkv": ["full", "snapkv", "snapkv"],
                                           "quest": ["full", "full", "quest"]}
    s = res["settings"]["64"]["512"]
    assert s["quest"]["dense_layers"] == [0, 1] and s["snapkv"]["free_generated"] is True
    assert all(x["status"] == "ok" for x in res["records"]) and len(res["records"]) == 3


@pytest.mark.parametrize("args, message", [
    (["--methods", "full,magic"], "unknown method 'magic'"),
    (["--lengths", "4k,abc"], "--lengths 'abc' is not a length"),
    (["--lengths", "8k"], "beyond what"),
    (["--shard", "3/2", "--out", "x"], "--shard 3/2"),
    (["--shard", "0/2"], "--shard needs --out"),
    (["--resume"], "--resume needs --out"),
    (["--tasks", "nope"], "unknown task 'nope'"),
    (["--methods", "tailorkv", "--quant-layers", "7"], "out of range"),
    (["--methods", "snapkv", "--budget", "30", "--protocol", "legacy"], "observation window"),
    (["--budgets", "3%,abc"], "--budgets 'abc' is not a budget"),
    (["--budgets", "150%"], "must be in (0, 100%]"),
    (["--budgets", "3%", "--budget-frac", "0.03"], "--budgets and --budget-frac both given"),
    (["--budget-frac", "2"], "--budget-frac must be in (0, 1]"),
    # a budget knob that every budget group sets for itself did nothing without a word
    (["--methods", "full,streamingllm", "--budgets", "64", "--budget", "100"],
     "--budget has no effect here: the budget groups of --budgets or --budget-frac set every method's budget"),
    (["--methods", "full,snapkv", "--budget-frac", "0.1", "--budget", "100"], "drop --budget or put it in --budgets"),
    (["--methods", "tailorkv", "--budgets", "3%", "--split", "paper", "--recent", "8"],
     "--recent has no effect here: --split paper gives sink and recent budget/16 each; drop --recent"),
    (["--methods", "tailorkv", "--budgets", "1024,192", "--channels", "8"],
     "--channels has no effect here: the paper's budget groups (192, 1024) bring their own sink, recent and r"),
    (["--methods", "streamingllm", "--budgets", "1024", "--sink", "8"], "drop --sink or add another budget"),
    (["--methods", "quest", "--budgets", "8"], "quest at length 512 budget 8: its 8 tokens must be at least one "
                                               "quest page (16 tokens): raise that budget in --budgets"),
    (["--methods", "full,streamingllm", "--channels", "4"], "--channels has no effect under full, streamingllm"),
    (["--samples", "-1"], "--samples must be 0 or more, got -1: e.g. --samples 20"),
    (["--fidelity-tokens", "-1"], "--fidelity-tokens must be 0 (off) or more, got -1"),
    (["--samples", "0", "--fidelity-tokens", "0"], "nothing to do: --samples 0 and no --fidelity-tokens: give one"),
    (["--budgets", "3%"], "--budgets has no effect under full: it keeps every token"),
    (["--methods", "full,tailorkv", "--split", "paper"], "--split has no effect here: it places sink and recent"),
    (["--methods", "tailorkv", "--budgets", "1024", "--split", "paper"], "--split has no effect here"),
    (["--lengths", "100"], "--lengths 100 is too short: passkey: the prompt needs"),
    (["--fidelity-tokens", "600"], "--fidelity-tokens 600 must be smaller than the length 512: lower"),
    (["--max-new-tokens", "100000"], "--max-new-tokens 100000 leaves no room for the prompt in the length 512"),
    (["--max-new-tokens", "500"], "--lengths 512 leaves no room for passkey: its 500 new tokens take nearly all"),
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
    # a fidelity item names its budget group: the two groups' lines of one method used to read the same
    whats = [line.split("] ", 1)[1].split(":")[0] for line in lines]
    assert len(set(whats)) == len(whats), whats
    assert "512 fidelity tailorkv @ 64" in whats and "640 fidelity streamingllm @ 12%" in whats, whats


def test_budgets_that_cover_the_whole_context_are_named():
    from tailorkv.engine.evaluation.budgets import parse_budgets
    from tailorkv.engine.evaluation.command import whole_context_notes
    plan = P.EvalPlan(lengths=[512, 2048], methods=["full", "tailorkv", "quest"], tasks=["passkey"], samples=1)
    assert whole_context_notes(plan) == [
        "tailorkv @ budget 1024: 1024 tokens cover the whole context at 512: its sparse layers attend to every token "
        "there (its 1/2-bit layers stay quantized)",
        "quest @ budget 1024: 1024 tokens cover the whole context at 512: it attends to every token there, like full"]
    plan = P.EvalPlan(lengths=[512, 2048], methods=["full", "tailorkv"], tasks=["passkey"], samples=1,
                      budgets=parse_budgets("25%"))
    assert whole_context_notes(plan) == []


def test_a_given_sink_scaled_down_by_small_budgets_is_named():
    from tailorkv.engine.evaluation.budgets import parse_budgets
    from tailorkv.engine.evaluation.command import shrunk_notes
    from tailorkv.engine.settings import MethodSettings
    plan = P.EvalPlan(lengths=[512], methods=["full", "tailorkv"], tasks=["passkey"], samples=1,
                      budgets=parse_budgets("3%,50%"), base=MethodSettings(method="full", sink=4, recent=8))
    assert shrunk_notes(plan, ["sink"]) == [
        "--sink 4 does not fit in every budget (--split shrink keeps sink + recent within half of it): sink 2 for "
        "tailorkv @ 3% at 512. --split paper gives budget/16 each"]
    assert shrunk_notes(plan, []) == []  # the default sink, scaled as the convention says: no note
    plan.budgets = parse_budgets("50%")
    assert shrunk_notes(plan, ["sink", "recent"]) == []
    plan.budgets = parse_budgets("1024,50%")  # the paper's 1024 brings its own sink 64: not a scaling to name
    assert shrunk_notes(plan, ["sink", "recent"]) == []


def test_a_length_too_short_for_a_task_is_refused_before_loading(tiny_dir):
    """--lengths 64 passes the argument check (at least 64 tokens) but leaves passkey's prompt no room: found
    from the tokenizer alone, before the weights load (it used to fail after them)."""
    r = invoke("eval", "--model", tiny_dir, "--device", "cpu", "--lengths", "64", "--samples", "1",
               "--tasks", "passkey", "--methods", "full")
    assert_one_line_error(r, "--lengths 64 is too short: passkey: the prompt needs", "use a longer length")
    assert "loading" not in r.output

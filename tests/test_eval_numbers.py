"""The numbers of eval.json, checked against values worked out by hand: the stratified standard errors of
summary.py (per length and across lengths), the paired method - full `diff`, merge_shards' consistency checks
and a correct merge, and results.numbered_dir's folder names."""
import datetime
import json
import math
import os
import re
import statistics
from types import SimpleNamespace

import pytest

from tailorkv.engine import results as R
from tailorkv.engine.evaluation import summary as S
from tailorkv.engine.evaluation.budgets import Budget
from tailorkv.engine.evaluation.merge import merge_shards
from tailorkv.engine.evaluation.plan import EvalPlan

PK, VT = "passkey", "variable_tracking"


def rec(length, task, sample, method, budget, score, status="ok", **kw):
    """A task record as driver.run_item writes it (the fields summary.py reads, plus index/item)."""
    r = {"index": 0, "item": 0, "kind": "task", "length": length, "budget": budget, "method": method, "task": task,
         "sample": sample, "status": status, "score": score if status == "ok" else None,
         "loaded_frac": None, "attended_frac": None}
    r.update(kw)
    return r


# ------------------------------------------------------------------------------------------------ stratified
def test_stratified_mean_and_se_by_hand():
    by_task = {"a": [100.0, 0.0, 100.0], "b": [0.0, 0.0, 100.0, 100.0], "ignored": [5.0, 7.0]}
    mean, se = S.stratified(by_task, ["a", "b"])
    # task means 200/3 and 50; sample variances 10000/3 (n=3) and 10000/3 (n=4)
    assert mean == pytest.approx((200 / 3 + 50) / 2)
    assert se == pytest.approx(math.sqrt((10000 / 3) / 3 + (10000 / 3) / 4) / 2)
    assert se == pytest.approx(22.0479, abs=1e-4)


def test_stratified_matches_the_formula_with_unequal_tasks():
    by_task = {"x": [0.3, 1.7, 2.2, 0.9, 1.1], "y": [4.0, 2.5], "z": [-1.0, 0.5, 0.25]}
    tasks = ["x", "y", "z"]
    mean, se = S.stratified(by_task, tasks)
    assert mean == pytest.approx(sum(statistics.mean(by_task[t]) for t in tasks) / 3)
    assert se == pytest.approx(math.sqrt(sum(statistics.stdev(by_task[t]) ** 2 / len(by_task[t]) for t in tasks)) / 3)
    # not the naive SE of the pooled samples
    pooled = [x for t in tasks for x in by_task[t]]
    assert se != pytest.approx(statistics.stdev(pooled) / math.sqrt(len(pooled)))


def test_stratified_none_cases():
    assert S.stratified({"a": [1.0, 2.0]}, ["a", "b"]) == (None, None)         # a task without a score
    assert S.stratified({"a": [1.0, 2.0], "b": []}, ["a", "b"]) == (None, None)
    assert S.stratified({}, []) == (None, None)
    mean, se = S.stratified({"a": [1.0, 3.0], "b": [10.0]}, ["a", "b"])       # a task with one sample: no SE
    assert mean == pytest.approx(6.0) and se is None
    mean, se = S.stratified({"a": [4.0, 4.0], "b": [1.0, 1.0, 1.0]}, ["a", "b"])
    assert mean == pytest.approx(2.5) and se == 0.0


def test_combine_across_lengths():
    mean, se = S.combine([10.0, 20.0, 60.0], [3.0, 4.0, 12.0])
    assert mean == pytest.approx(30.0) and se == pytest.approx(13 / 3)  # sqrt(9 + 16 + 144) / 3
    assert S.combine([10.0, None], [1.0, 1.0]) == (None, None)
    assert S.combine([], []) == (None, None)
    mean, se = S.combine([1.0, 2.0], [0.5, None])
    assert mean == pytest.approx(1.5) and se is None


# ------------------------------------------------------------------------------------------------ summarize
def two_budget_plan():
    return EvalPlan(lengths=[512, 640], methods=["full", "streamingllm"], tasks=[PK, VT], samples=2,
                    budgets=[Budget("64", tokens=64), Budget("10%", frac=0.1)])


def two_budget_records():
    """Scores per (length, method, budget), samples 0 and 1 of each task:
    512 full      PK 100 100  VT 100   0
    512 sl @ 64   PK 100   0  VT   0   0     diffs PK 0 -100, VT -100 0
    640 full      PK 100   0  VT 100 100
    640 sl @ 64   PK 100 100  VT   0 100     diffs PK 0 100,  VT -100 0
    sl @ 10%: every score 0; at 512 PK sample 0 ran out of memory.
    dNLL / agree of sl @ 64: 512 PK 0.5 1.5, VT 0.25 0.75 (agree 90 70 80 60); 640 PK 1 1, VT 2 2 (agree 50)."""
    out = []
    table = {(512, "full", None): {PK: [100, 100], VT: [100, 0]},
             (512, "streamingllm", "64"): {PK: [100, 0], VT: [0, 0]},
             (640, "full", None): {PK: [100, 0], VT: [100, 100]},
             (640, "streamingllm", "64"): {PK: [100, 100], VT: [0, 100]},
             (512, "streamingllm", "10%"): {PK: [0, 0], VT: [0, 0]},
             (640, "streamingllm", "10%"): {PK: [0, 0], VT: [0, 0]}}
    dnll = {512: {PK: [0.5, 1.5], VT: [0.25, 0.75]}, 640: {PK: [1.0, 1.0], VT: [2.0, 2.0]}}
    agree = {512: {PK: [90.0, 70.0], VT: [80.0, 60.0]}, 640: {PK: [50.0, 50.0], VT: [50.0, 50.0]}}
    fracs = {(PK, 0): 0.1, (PK, 1): 0.2, (VT, 0): 0.3, (VT, 1): None}
    for (n, m, b), by_task in table.items():
        for t, scores in by_task.items():
            for s, score in enumerate(scores):
                kw = {}
                if m == "full":
                    kw = {"dnll": 0.0, "agree": 100.0}
                elif b == "64":
                    kw = {"dnll": dnll[n][t][s], "agree": agree[n][t][s], "attended_frac": 0.5}
                    if n == 512:
                        kw["loaded_frac"] = fracs[(t, s)]
                status = "oom" if (n, b, t, s) == (512, "10%", PK, 0) else "ok"
                out.append(rec(n, t, s, m, b, float(score), status=status, **kw))
    return out


@pytest.mark.parametrize("order", ["as built", "reversed"])
def test_summarize_per_length_cells_by_hand(order):
    records = two_budget_records()
    if order == "reversed":  # pairing with full goes by (length, task, sample), not by record order
        records = records[::-1]
    summ = S.summarize(records, two_budget_plan())["budgets"]
    assert list(summ) == ["64", "10%"]
    sl = summ["64"]["per_length"]["512"]["streamingllm"]
    assert sl["tasks"] == {PK: pytest.approx(50.0), VT: pytest.approx(0.0)}
    assert sl["average"] == pytest.approx(25.0)
    assert sl["average_se"] == pytest.approx(25.0)          # sqrt(5000/2 + 0/2) / 2
    assert sl["diff"] == pytest.approx(-50.0)               # (mean(0, -100) + mean(-100, 0)) / 2
    assert sl["diff_se"] == pytest.approx(math.sqrt(5000 / 2 + 5000 / 2) / 2)  # paired: var(0,-100) = 5000
    assert sl["dnll"] == pytest.approx(0.75)                # (1.0 + 0.5) / 2
    assert sl["dnll_se"] == pytest.approx(math.sqrt(0.5 / 2 + 0.125 / 2) / 2)
    assert sl["agree"] == pytest.approx(75.0)
    assert sl["loaded_frac"] == pytest.approx(0.2) and sl["attended_frac"] == pytest.approx(0.5)
    assert (sl["n"], sl["failed"], sl["budget_tokens"]) == (4, 0, 64)
    sl640 = summ["64"]["per_length"]["640"]["streamingllm"]
    assert sl640["average"] == pytest.approx(75.0) and sl640["average_se"] == pytest.approx(25.0)
    assert sl640["diff"] == pytest.approx(0.0)              # (mean(0, 100) + mean(-100, 0)) / 2
    assert sl640["diff_se"] == pytest.approx(math.sqrt(5000 / 2 + 5000 / 2) / 2)
    assert sl640["dnll"] == pytest.approx(1.5) and sl640["dnll_se"] == 0.0
    full = summ["64"]["per_length"]["512"]["full"]
    assert full["average"] == pytest.approx(75.0) and full["average_se"] == pytest.approx(25.0)
    assert full["diff"] == 0.0 and full["diff_se"] == 0.0 and full["budget_tokens"] is None
    assert full["dnll"] == 0.0 and full["agree"] == pytest.approx(100.0) and full["loaded_frac"] is None
    # exact methods run once and show in every budget group
    assert summ["10%"]["per_length"]["512"]["full"] == full
    assert summ["10%"]["per_length"]["640"]["full"] == summ["64"]["per_length"]["640"]["full"]
    # 10% at 512: the OOM sample is counted, not scored; PK keeps one sample, so no SE
    low = summ["10%"]["per_length"]["512"]["streamingllm"]
    assert (low["n"], low["failed"], low["budget_tokens"]) == (3, 1, 51)  # round(0.1 * 512)
    assert low["average"] == 0.0 and low["average_se"] is None
    assert low["diff"] == pytest.approx(-75.0) and low["diff_se"] is None  # PK: 0 - 100; VT: mean(-100, 0)
    assert low["dnll"] is None and low["agree"] is None
    assert summ["10%"]["per_length"]["640"]["streamingllm"]["budget_tokens"] == 64


def test_summarize_overall_by_hand():
    summ = S.summarize(two_budget_records(), two_budget_plan())["budgets"]
    sl = summ["64"]["overall"]["streamingllm"]
    assert sl["tasks"] == {PK: pytest.approx(75.0), VT: pytest.approx(25.0)}
    assert sl["average"] == pytest.approx(50.0)                        # (25 + 75) / 2
    assert sl["average_se"] == pytest.approx(math.sqrt(25 ** 2 + 25 ** 2) / 2)
    assert sl["diff"] == pytest.approx(-25.0)                          # (-50 + 0) / 2
    assert sl["diff_se"] == pytest.approx(25.0)                        # sqrt(2 * 2500) / 2
    assert sl["dnll"] == pytest.approx(1.125)
    assert sl["dnll_se"] == pytest.approx(math.sqrt(0.3125 / 4 + 0.0) / 2)
    assert sl["agree"] == pytest.approx(62.5)
    assert (sl["n"], sl["failed"]) == (8, 0)
    full = summ["64"]["overall"]["full"]
    assert full["average"] == pytest.approx(75.0) and full["average_se"] == pytest.approx(math.sqrt(1250) / 2)
    assert full["diff"] == 0.0 and full["diff_se"] == 0.0 and (full["n"], full["failed"]) == (8, 0)
    low = summ["10%"]["overall"]["streamingllm"]
    assert low["average"] == 0.0 and low["average_se"] is None         # 512's cell has no SE
    # 640: PK diffs -100 0, VT -100 -100 -> -75, like 512
    assert low["diff"] == pytest.approx(-75.0) and low["diff_se"] is None
    assert summ["10%"]["per_length"]["640"]["streamingllm"]["diff_se"] == pytest.approx(math.sqrt(5000 / 2) / 2)
    assert (low["n"], low["failed"]) == (7, 1) and low["dnll"] is None


def test_diff_leaves_out_samples_whose_full_run_failed():
    plan = EvalPlan(lengths=[512], methods=["full", "streamingllm"], tasks=[PK, VT], samples=2,
                    budgets=[Budget("64", tokens=64)])
    records = [rec(512, PK, 0, "full", None, 100.0), rec(512, PK, 1, "full", None, None, status="error"),
               rec(512, VT, 0, "full", None, 100.0), rec(512, VT, 1, "full", None, 0.0),
               rec(512, PK, 0, "streamingllm", "64", 100.0), rec(512, PK, 1, "streamingllm", "64", 0.0),
               rec(512, VT, 0, "streamingllm", "64", 0.0), rec(512, VT, 1, "streamingllm", "64", 0.0)]
    cells = S.summarize(records, plan)["budgets"]["64"]["per_length"]["512"]
    sl = cells["streamingllm"]
    assert sl["average"] == pytest.approx(25.0) and sl["average_se"] == pytest.approx(25.0)  # all 4 scored
    assert sl["diff"] == pytest.approx(-25.0)   # PK: only sample 0 pairs (0); VT: mean(-100, 0)
    assert sl["diff_se"] is None                # PK has one paired sample
    assert (cells["full"]["n"], cells["full"]["failed"]) == (3, 1)
    assert cells["full"]["average"] == pytest.approx(75.0) and cells["full"]["average_se"] is None


def test_a_task_without_an_ok_sample_leaves_the_average_empty():
    plan = EvalPlan(lengths=[512], methods=["full", "streamingllm"], tasks=[PK, VT], samples=1,
                    budgets=[Budget("64", tokens=64)])
    records = [rec(512, PK, 0, "full", None, 100.0), rec(512, VT, 0, "full", None, 100.0),
               rec(512, PK, 0, "streamingllm", "64", 100.0), rec(512, VT, 0, "streamingllm", "64", None, "oom")]
    summ = S.summarize(records, plan)["budgets"]["64"]
    sl = summ["per_length"]["512"]["streamingllm"]
    assert sl["tasks"] == {PK: 100.0, VT: None} and sl["average"] is None and sl["diff"] is None
    over = summ["overall"]["streamingllm"]
    assert over["tasks"] == {PK: 100.0, VT: None} and over["average"] is None and over["diff"] is None
    assert (over["n"], over["failed"]) == (1, 1)


# ------------------------------------------------------------------------------------------------ merge
FILE = "eval.shard-{}-of-{}.json"
LAYERS = {"64": {"full": ["full", "full"], "streamingllm": ["streamingllm", "streamingllm"]}}


def merge_plan(**kw):
    return EvalPlan(lengths=[512], methods=["full", "streamingllm"], tasks=[PK], samples=2,
                    budgets=[Budget("64", tokens=64)], fidelity_tokens=4, **kw)


def all_records():
    """Items 0, 1: passkey samples 0, 1 (records full, sl @ 64 each); items 2, 3: fidelity of full, sl @ 64."""
    task = [dict(rec(512, PK, s, m, b, score), index=2 * s + j, item=s)
            for s, scores in enumerate([(100.0, 100.0), (100.0, 0.0)])
            for j, (m, b, score) in enumerate(zip(("full", "streamingllm"), (None, "64"), scores))]
    fid = [{"index": 4, "item": 2, "kind": "fidelity", "length": 512, "budget": None, "method": "full",
            "tokens": 4, "status": "ok", "top1_agreement": 100.0, "kl_mean": 0.0},
           {"index": 5, "item": 3, "kind": "fidelity", "length": 512, "budget": "64", "method": "streamingllm",
            "tokens": 4, "status": "ok", "top1_agreement": 75.0, "kl_mean": 0.2}]
    return task + fid


def shard(i, n, plan=None, records=None, **kw):
    """A shard's results as `tailorkv eval --shard i/n` writes them, read back from JSON; records: the file's
    records (default: shard i's share of all_records())."""
    plan = plan or merge_plan()
    records = [r for r in all_records() if r["item"] % n == i] if records is None else records
    args = dict(command=f"tailorkv eval --model tiny --lengths 512 --shard {i}/{n} --out d",
                args={"lengths": "512", "shard": f"{i}/{n}"}, env={"git_commit": "abc123", "date": "2026-01-01"},
                model={"name": "tiny-llama", "path": "/m/tiny-llama"}, plan=plan, shard=(i, n),
                records=records, suites_hash="h1", layer_policies=LAYERS)
    args.update(kw)
    return json.loads(json.dumps(S.results(**args)))


def test_the_hand_made_records_are_the_plans():
    keys = merge_plan().record_keys()
    assert [(r["item"], r["budget"], r["method"]) for r in all_records()] == keys
    assert shard(0, 2)["complete"] is True and shard(1, 2)["complete"] is True


def test_merge_of_two_shards_is_the_union_in_plan_order():
    s0, s1 = shard(0, 2), shard(1, 2)
    assert [r["index"] for r in s0["records"] + s0["fidelity"]] == [0, 1, 4]
    assert [r["index"] for r in s1["records"] + s1["fidelity"]] == [2, 3, 5]
    merged, warnings = merge_shards([(FILE.format(1, 2), s1), (FILE.format(0, 2), s0)])
    assert warnings == [] and merged["complete"] is True and merged["shard"] is None
    expect = all_records()
    assert merged["records"] == [r for r in expect if r["kind"] == "task"]
    assert merged["fidelity"] == [r for r in expect if r["kind"] == "fidelity"]
    assert merged["command"] == "tailorkv eval --model tiny --lengths 512 --out d"
    assert merged["args"] == {"lengths": "512", "shard": None}
    assert [m["file"] for m in merged["merged_from"]] == [FILE.format(1, 2), FILE.format(0, 2)]
    for key in ("eval", "settings", "suites_hash", "layer_policies", "model"):
        assert merged[key] == s0[key], key
    cell = merged["summary"]["budgets"]["64"]["per_length"]["512"]["streamingllm"]
    # sl scores 100, 0 against full's 100, 100: paired diffs 0, -100
    assert cell["average"] == pytest.approx(50.0) and cell["diff"] == pytest.approx(-50.0)
    assert cell["diff_se"] == pytest.approx(math.sqrt(5000 / 2)) and cell["n"] == 2


def test_shards_at_different_commits_merge_with_a_warning():
    s1 = shard(1, 2, env={"git_commit": "def456", "date": "2026-01-02"})
    merged, warnings = merge_shards([(FILE.format(0, 2), shard(0, 2)), (FILE.format(1, 2), s1)])
    assert warnings == ["the shards ran at different commits: ['abc123', 'def456']"]
    assert merged["complete"] is True and merged["warnings"] == []


def _changed(key, value):
    def change(res):
        res[key] = value
        return res
    return change


def _settings_budget(res):
    res["settings"]["64"]["512"]["streamingllm"]["budget"] = 65
    return res


DIFFER = [
    ("settings", _settings_budget),
    ("eval", lambda res: shard(1, 2, plan=merge_plan(seed=1))),
    ("suites_hash", _changed("suites_hash", "h2")),
    ("layer_policies", _changed("layer_policies", {"64": {"full": ["full"] * 2, "streamingllm": ["full"] * 2}})),
    ("schema", _changed("schema", S.SCHEMA + 1)),
    ("kind", _changed("kind", "tailorkv-bench")),
]


@pytest.mark.parametrize("key, change", DIFFER, ids=[k for k, _ in DIFFER])
def test_shards_of_different_runs_are_refused(key, change):
    s1 = change(shard(1, 2))
    assert s1[key] != shard(0, 2)[key]
    with pytest.raises(ValueError, match=re.escape(f"{FILE.format(1, 2)} and {FILE.format(0, 2)} differ in "
                                                   f"'{key}': they are not shards of one run")):
        merge_shards([(FILE.format(0, 2), shard(0, 2)), (FILE.format(1, 2), s1)])


def test_a_seed_changes_eval_but_not_settings():
    """So the 'eval' case above is refused for 'eval' itself, not for a settings difference."""
    assert shard(1, 2, plan=merge_plan(seed=1))["settings"] == shard(1, 2)["settings"]


def test_shards_of_different_models_are_refused():
    s1 = shard(1, 2, model={"name": "other-model", "path": "/m/other-model"})
    with pytest.raises(ValueError, match=re.escape(f"{FILE.format(1, 2)} and {FILE.format(0, 2)} ran different "
                                                   f"models")):
        merge_shards([(FILE.format(0, 2), shard(0, 2)), (FILE.format(1, 2), s1)])
    # the same model from another path is the same model
    s1 = shard(1, 2, model={"name": "tiny-llama", "path": "/elsewhere/tiny-llama"})
    merged, _ = merge_shards([(FILE.format(0, 2), shard(0, 2)), (FILE.format(1, 2), s1)])
    assert merged["complete"] is True


def test_shards_of_different_counts_are_refused():
    with pytest.raises(ValueError, match=re.escape(f"{FILE.format(1, 3)} is one of 3 shards, {FILE.format(0, 2)} "
                                                   f"one of 2")):
        merge_shards([(FILE.format(0, 2), shard(0, 2)), (FILE.format(1, 3), shard(1, 3))])


def test_repeated_shard_numbers_are_refused():
    with pytest.raises(ValueError, match=re.escape("shard numbers repeat: [0, 0]")):
        merge_shards([(FILE.format(0, 2), shard(0, 2)), ("copy-of-" + FILE.format(0, 2), shard(0, 2))])


def test_a_record_in_two_shards_is_refused():
    twice = all_records()[1]  # item 0's sl record: shard 0's, and also (wrongly) in shard 1's file
    s1 = shard(1, 2, records=[r for r in all_records() if r["item"] % 2 == 1] + [twice])
    assert [r["index"] for r in s1["records"]] == [1, 2, 3]
    with pytest.raises(ValueError, match=re.escape(f"record 1 (item 0) appears in {FILE.format(0, 2)} and "
                                                   f"{FILE.format(1, 2)}")):
        merge_shards([(FILE.format(0, 2), shard(0, 2)), (FILE.format(1, 2), s1)])


def test_missing_shards_and_records_need_partial():
    with pytest.raises(ValueError, match=re.escape("shards [1] of 2 are missing")):
        merge_shards([(FILE.format(0, 2), shard(0, 2))])
    merged, warnings = merge_shards([(FILE.format(0, 2), shard(0, 2))], partial=True)
    assert merged["complete"] is False and warnings[0] == "partial merge: shards [1] of 2 wrote no file"
    assert [r["index"] for r in merged["records"] + merged["fidelity"]] == [0, 1, 4]
    # shard 1 stopped before item 1's sl record (index 3)
    cut = shard(1, 2, records=[r for r in all_records() if r["item"] % 2 == 1 and r["index"] != 3])
    with pytest.raises(ValueError, match=re.escape("1 record without a result (first: item 1)")):
        merge_shards([(FILE.format(0, 2), shard(0, 2)), (FILE.format(1, 2), cut)])
    merged, warnings = merge_shards([(FILE.format(0, 2), shard(0, 2)), (FILE.format(1, 2), cut)], partial=True)
    assert merged["complete"] is False and warnings[0].startswith("partial merge: 1 of 6 records without a result")


def test_nothing_or_a_non_shard_first_is_refused():
    with pytest.raises(ValueError, match="no eval.shard-"):
        merge_shards([])
    whole = json.loads(json.dumps(S.results(command="c", args={}, env={}, model={"name": "tiny-llama"},
                                            plan=merge_plan(), shard=None, records=all_records())))
    with pytest.raises(ValueError, match=re.escape("eval.json is not a shard file")):
        merge_shards([("eval.json", whole), (FILE.format(1, 2), shard(1, 2))])


# ------------------------------------------------------------------------------------------------ numbered_dir
@pytest.fixture
def day(monkeypatch):
    fake = SimpleNamespace(date=SimpleNamespace(today=lambda: datetime.date(2026, 3, 9)))
    monkeypatch.setattr(R, "datetime", fake)
    return "2026-03-09"


def test_numbered_dir_counts_up_past_folders_that_hold_results(tmp_path, day):
    root = str(tmp_path / "results")
    base = os.path.join(root, f"{day}-smollm2-135m")
    first = R.numbered_dir("smollm2-135m", root, "eval.json")
    assert first == base and not os.path.exists(root)  # a name only: nothing made
    os.makedirs(base)
    assert R.numbered_dir("smollm2-135m", root, "eval.json") == base  # a folder without results is reused
    (tmp_path / "results" / f"{day}-smollm2-135m" / "eval.json").write_text("{}")
    assert R.numbered_dir("smollm2-135m", root, "eval.json") == base + "-2"
    assert R.numbered_dir("smollm2-135m", root, "bench.json") == base  # only its own kind of results counts
    os.makedirs(base + "-2")
    (tmp_path / "results" / f"{day}-smollm2-135m-2" / "eval.json").write_text("{}")
    assert R.numbered_dir("smollm2-135m", root, "eval.json") == base + "-3"


@pytest.mark.parametrize("model, stem", [
    ("/a/my model/", "my-model"),                              # a folder path: its last part, made safe
    ("HuggingFaceTB/SmolLM2-360M-Instruct", "SmolLM2-360M-Instruct"),
    ("./models/llama 3.1 (8B)!", "llama-3.1-8B"),
    ("/", "model"),                                            # nothing left: a fallback name
    (".", "my model dir"),                                     # the folder the user runs in: its own name
    ("sub/..", "my model dir"),
])
def test_numbered_dir_names_the_model_safely(tmp_path, day, model, stem, monkeypatch):
    (tmp_path / "my model dir" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "my model dir")
    stem = stem.replace(" ", "-")
    out = R.numbered_dir(model, str(tmp_path), "eval.json")
    assert os.path.dirname(out) == str(tmp_path)
    name = os.path.basename(out)
    assert name == f"{day}-{stem}" and re.fullmatch(r"[A-Za-z0-9._-]+", name)


def test_numbered_dir_uses_todays_date(tmp_path):
    before = datetime.date.today().isoformat()
    out = R.numbered_dir("m", str(tmp_path), "eval.json")
    after = datetime.date.today().isoformat()
    assert os.path.basename(out) in (f"{before}-m", f"{after}-m")


def _edit(change):
    def edit(res):
        exec(change, {}, {"res": res})
        return res
    return edit


MALFORMED = [('res["records"] = None', "its 'records' is null"),
             ('res["records"][0]["score"] = "abc"', "record 0's 'score' is \"abc\", not a number"),
             ('res["records"][0]["index"] = 1.5', "record 0 has no int 'index'"),
             ('res["records"][1] = 7', "record 1 is 7"),
             ('res["shard"] = {"index": "a"}', "its 'shard' lacks a whole index and count"),
             ('res["eval"] = []', "its 'eval' is []")]


@pytest.mark.parametrize("change, why", MALFORMED, ids=[c for c, _ in MALFORMED])
def test_a_results_file_of_the_wrong_types_is_named(tmp_path, change, why):
    """A hand-edited shard: one message naming the entry, before any reader trips on it."""
    from tailorkv.engine.evaluation.merge import read_results
    path = tmp_path / FILE.format(0, 2)
    path.write_text(json.dumps(_edit(change)(shard(0, 2))))
    with pytest.raises(ValueError, match=re.escape(f"{path} is not an eval results file ({why})")):
        read_results(str(path))
    path.write_text(json.dumps(shard(0, 2)))
    assert read_results(str(path))["records"]


def test_a_shard_whose_plan_is_malformed_is_named():
    s0, s1 = shard(0, 2), shard(1, 2)
    del s0["eval"]["lengths"], s1["eval"]["lengths"]
    with pytest.raises(ValueError, match=re.escape(f"{FILE.format(0, 2)} is not an eval results file (its 'eval' "
                                                   "entry is malformed: KeyError('lengths')): rerun that shard")):
        merge_shards([(FILE.format(0, 2), s0), (FILE.format(1, 2), s1)])


def test_the_title_names_budgets_and_tailorkvs_settings_only_where_they_ran():
    from tailorkv.engine.evaluation.labels import budget_line
    e = merge_plan().to_dict()
    assert budget_line(dict(e, methods=["full"])) == "no budgets (every method keeps every token)"
    assert budget_line(dict(e, methods=["full", "streamingllm"])).startswith("budgets 64 (split shrink)")
    assert "channels" not in budget_line(dict(e, methods=["full", "streamingllm"]))
    assert budget_line(dict(e, methods=["tailorkv"])).endswith("-bit quant layers, r = 12 channels")
    paper = dict(e, methods=["tailorkv"], budgets=[{"label": "192", "kind": "paper", "frac": None, "tokens": 192},
                                                   {"label": "1024", "kind": "paper", "frac": None, "tokens": 1024}])
    assert budget_line(paper).startswith("budgets 192 (the paper's split), 1024 (the paper's split), ")  # no --split
    assert budget_line(paper).endswith("r = 8 / 12 channels")


def test_a_tables_title_stays_on_one_line():
    from rich.console import Console
    from tailorkv.engine.evaluation.report import score_tables
    res = shard(0, 2)
    res["eval"]["methods"] = ["full"]  # a narrow table: narrower than its titles
    con = Console(width=200, record=True)
    for t in score_tables(res):
        con.print(t)
    text = con.export_text()
    lines = [line.rstrip() for line in text.splitlines()]
    assert "length 512: score 0-100" in lines and "average score over tasks (dNLL)" in lines, text  # no budget: full
    res["eval"]["methods"] = ["full", "streamingllm"]
    con = Console(width=200, record=True)
    for t in score_tables(res):
        con.print(t)
    lines = [line.rstrip() for line in con.export_text().splitlines()]
    assert "budget 64, length 512: score 0-100" in lines
    assert "budget 64 tokens per layer" in lines and not any("top-K" in line for line in lines)  # no tailorkv split

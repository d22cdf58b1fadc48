"""Budget groups of `tailorkv eval` (shares, tokens, the paper's splits), each method's settings in a group, and
the work items / records of a plan (no model needed)."""
import pytest

from tailorkv.engine.evaluation import budgets as B, plan as P
from tailorkv.engine.settings import MethodSettings

METHODS = ["full", "tailorkv", "streamingllm"]


def test_parse_budgets():
    got = B.parse_budgets("1%, 3%,0.03,6%,192,1024,100,0.5")
    assert [b.label for b in got] == ["1%", "3%", "6%", "192", "1024", "100", "50%"]  # 3% and 0.03: one group
    assert [b.kind for b in got] == ["frac"] * 3 + ["paper", "paper", "tokens", "frac"]
    assert got[1].frac == pytest.approx(0.03) and got[4].tokens == 1024
    assert [b.tokens for b in B.parse_budgets("1k,0.5k,2K")] == [1024, 512, 2048]  # as --ctx counts tokens
    for bad in ("abc", "3x", "1e", "", "0%", "150%", "1.5", "1", "-4", "xk", "-1k"):
        with pytest.raises(ValueError, match="--budgets"):
            B.parse_budgets(bad)


def test_split_rules():
    assert B.split_budget(61, 64, 64, "shrink") == (15, 15)   # 64 + 64 > 30: scaled into budget // 2
    assert B.split_budget(2048, 64, 64, "shrink") == (64, 64)  # fits: unchanged
    assert B.split_budget(1024, 64, 64, "paper") == (64, 64)  # budget / 16 each
    assert B.split_budget(61, 64, 64, "paper") == (4, 4) and B.split_budget(20, 64, 64, "paper") == (1, 1)
    with pytest.raises(ValueError, match="--split"):
        B.split_budget(61, 64, 64, "even")


def test_budget_frac():
    assert B.budget_from_frac(0.03, 4096, 64, 64) == (123, 30, 31)  # 64+64 > 61: scaled into budget // 2
    assert B.budget_from_frac(0.25, 4096, 64, 64) == (1024, 64, 64)  # fits: unchanged
    assert B.budget_from_frac(0.03, 8192, 8, 56) == (246, 8, 56)
    b, s, r = B.budget_from_frac(0.01, 2048, 64, 64)
    assert b == 20 and s + r <= b // 2
    with pytest.raises(ValueError):
        B.budget_from_frac(0, 4096, 64, 64)


def test_settings_in_each_group():
    base = MethodSettings(sink=64, recent=64, budget=999, channels=12)
    three, b192, b1024, b100 = B.parse_budgets("3%,192,1024,100")

    def knobs(s):
        return s.method, s.budget, s.sink, s.recent, s.channels
    assert knobs(B.settings_for(base, "tailorkv", 2048, three)) == ("tailorkv", 61, 15, 15, 12)  # the first eval's
    assert knobs(B.settings_for(base, "tailorkv", 8192, three)) == ("tailorkv", 246, 61, 62, 12)
    assert knobs(B.settings_for(base, "tailorkv", 2048, three, "paper")) == ("tailorkv", 61, 4, 4, 12)
    assert knobs(B.settings_for(base, "tailorkv", 8192, b1024)) == ("tailorkv", 1024, 64, 64, 12)
    assert knobs(B.settings_for(base, "tailorkv", 8192, b192)) == ("tailorkv", 192, 8, 56, 8)  # r = 8 too
    assert knobs(B.settings_for(base, "quest", 4096, b100)) == ("quest", 100, 25, 25, 12)
    assert B.settings_for(base, "snapkv", 4096, three).snap_window == 32
    assert B.settings_for(base, "snapkv", 2048, three).snap_window == 30  # capped at budget // 2
    assert knobs(B.settings_for(base, "tailorkv", 4096, None)) == ("tailorkv", 999, 64, 64, 12)  # as given
    assert knobs(B.settings_for(base, "tailorkv", 4096, B.Budget("999"))) == ("tailorkv", 999, 64, 64, 12)
    assert base.method == "full" and base.budget == 999  # not mutated


def _plan(**kw):
    return P.EvalPlan(**{**dict(lengths=[512, 640], methods=METHODS, tasks=["passkey", "variable_tracking"],
                                samples=3, fidelity_tokens=4), **kw})


def test_runs_items_and_records():
    plan = _plan(methods=["snapkv", "full", "tailorkv"], budgets=B.parse_budgets("3%,1024"))
    assert plan.runs() == [(None, "full"), ("3%", "snapkv"), ("3%", "tailorkv"), ("1024", "snapkv"),
                           ("1024", "tailorkv")]                 # exact methods once, full first
    items = plan.items()
    tasks = [it for it in items if it["kind"] == "task"]
    fid = [it for it in items if it["kind"] == "fidelity"]
    assert len(tasks) == 2 * 2 * 3 and len(fid) == 2 * 5 and [it["index"] for it in items] == list(range(len(items)))
    assert [(it["length"], it["budget"], it["method"]) for it in fid[:5]] == [(512, b, m) for b, m in plan.runs()]
    keys = plan.record_keys()
    assert len(keys) == len(tasks) * 5 + len(fid) and keys[:5] == [(0, b, m) for b, m in plan.runs()]
    assert plan.record_index()[(1, "3%", "snapkv")] == 6
    s = plan.settings_dict()
    assert set(s) == {"3%", "1024"} and s["1024"]["640"]["tailorkv"]["budget"] == 1024
    assert plan.settings("full", 512, None) == plan.settings("full", 512, "3%")  # exact: the first group's
    assert plan.to_dict()["n_records"] == len(keys)
    assert P.EvalPlan.from_dict(plan.to_dict()).record_keys() == keys
    assert _plan().budgets == [B.Budget(str(MethodSettings().budget))]  # no budgets: the knobs, one group


@pytest.mark.parametrize("n", [1, 2, 3, 5, 14])
def test_shards_partition_the_plan(n):
    plan = _plan(budgets=B.parse_budgets("3%,6%"))
    items = plan.items()
    parts = [{it["index"] for it in P.shard_items(items, (i, n))} for i in range(n)]
    assert sum(len(p) for p in parts) == len(items)           # disjoint ...
    assert set().union(*parts) == set(range(len(items)))      # ... and covering
    assert max(len(p) for p in parts) - min(len(p) for p in parts) <= 1
    recs = [k for i in range(n) for k in plan.record_keys(P.shard_items(items, (i, n)))]
    assert len(recs) == len(set(recs)) and set(recs) == set(plan.record_keys())  # records follow items


def test_plan_errors():
    with pytest.raises(ValueError, match="--split"):
        _plan(split="half").validate()
    with pytest.raises(ValueError, match="--question"):
        _plan(question="before").validate()
    with pytest.raises(ValueError, match="smaller than --sink 64 . --recent 64"):  # the knobs as given
        _plan(base=MethodSettings(budget=100, sink=64, recent=64)).validate()
    _plan(base=MethodSettings(budget=100, sink=64, recent=64), budgets=B.parse_budgets("100")).validate()  # shrunk


def test_protocols():
    base = MethodSettings(sink=64, recent=64, budget=999)
    three = B.parse_budgets("3%")[0]

    def run(method, protocol, split="shrink"):
        return B.settings_for(base, method, 2048, three, split, protocol)
    for m in ("tailorkv", "streamingllm", "snapkv", "quest"):  # plain: same tokens, generated ones on top
        s = run(m, "plain")
        assert (s.budget, s.dense_layers, s.free_generated) == (61, None, True)
    assert run("snapkv", "plain", "paper").snap_window == 8     # <= sink + recent (4 + 4)
    assert run("snapkv", "legacy", "paper").snap_window == 30   # the first eval's: <= budget // 2
    assert [run(m, "paper").dense_layers for m in ("tailorkv", "streamingllm", "snapkv", "quest", "full")] == \
        [None, [0], [0], [0, 1], None]
    assert all(run(m, "paper").free_generated for m in ("streamingllm", "quest"))
    legacy = run("quest", "legacy")
    assert (legacy.dense_layers, legacy.free_generated) == (None, False)
    with pytest.raises(ValueError, match="--protocol"):
        run("quest", "fair")
    plan = _plan(protocol="paper", budgets=[three])
    assert plan.settings("quest", 1024, "3%").dense_layers == [0, 1]
    assert plan.to_dict()["protocol"] == "paper" and "layers 0 and 1" in plan.to_dict()["protocol_convention"]
    assert P.EvalPlan.from_dict(plan.to_dict()).protocol == "paper"

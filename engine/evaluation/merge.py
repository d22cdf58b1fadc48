"""Putting shard files back together (`tailorkv eval-merge`) and picking up an interrupted run (`--resume`)."""
from __future__ import annotations

import dataclasses
import json
import shlex

from tailorkv.engine.errors import InputError
from tailorkv.engine import ui
from tailorkv.engine.evaluation.plan import EvalPlan
from tailorkv.engine.evaluation.summary import results
from tailorkv.engine.settings import MethodSettings

SAME_KEYS = ("schema", "kind", "eval", "settings", "layer_policies", "suites_hash")


def merge_shards(shards: list[tuple[str, dict]], partial: bool = False) -> tuple[dict, list[str]]:
    """[(file name, shard results)] -> (merged results, warnings). Raises InputError when the shards do not
    belong to one plan, overlap, or leave items out (partial: items left out are a warning, the merged results
    say complete: false and every table cell counts the samples it averages)."""
    if not shards:
        raise InputError("no eval.shard-*-of-*.json files to merge")
    name0, first = shards[0]
    count = first["shard"]["count"] if first.get("shard") else None
    if count is None:
        raise InputError(f"{name0} is not a shard file (no 'shard' entry)")
    warnings: list[str] = []
    for name, res in shards[1:]:
        for key in SAME_KEYS:
            if res.get(key) != first.get(key):
                raise InputError(f"{name} and {name0} differ in '{key}': they are not shards of one run")
        if (res.get("model") or {}).get("name") != (first.get("model") or {}).get("name"):
            raise InputError(f"{name} and {name0} ran different models")
        if res["shard"]["count"] != count:
            raise InputError(f"{name} is one of {res['shard']['count']} shards, {name0} one of {count}")
    got = sorted(res["shard"]["index"] for _, res in shards)
    if len(set(got)) != len(got):
        raise InputError(f"shard numbers repeat: {got}")
    missing = sorted(set(range(count)) - set(got))
    if missing and not partial:
        raise InputError(f"shards {missing} of {count} are missing: run them (--shard i/{count}), or merge the "
                         f"others with --partial")
    if missing:
        warnings.append(f"partial merge: shards {missing} of {count} wrote no file")
    try:
        plan = EvalPlan.from_dict(first["eval"])
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"{name0} is not an eval results file (its 'eval' entry is malformed: {e!r}): rerun that "
                         f"shard with --overwrite") from None
    records, seen = [], {}
    for name, res in shards:
        for r in res["records"] + res["fidelity"]:
            if r["index"] in seen:
                raise InputError(f"record {r['index']} (item {r['item']}) appears in {seen[r['index']]} and {name}")
            seen[r["index"]] = name
            records.append(r)
    keys = plan.record_keys()
    left = sorted(set(range(len(keys))) - set(seen))
    if left and not partial:
        raise InputError(f"{ui.count(len(left), 'record')} without a result (first: item {keys[left[0]][0]}): a shard "
                         f"did not finish; rerun it with --resume, or merge what finished with --partial")
    if left:
        items = sorted({keys[i][0] for i in left})
        warnings.append(f"partial merge: {len(left)} of {ui.count(len(keys), 'record')} without a result (items "
                        f"{', '.join(map(str, items[:10]))}{' ...' if len(items) > 10 else ''}); the tables "
                        f"average the samples that finished")
    commits = {res["env"].get("git_commit") for _, res in shards}
    if len(commits) > 1:
        warnings.append(f"the shards ran at different commits: {sorted(map(str, commits))}")
    merged = results(command=without_shard(first["command"]), args={**first["args"], "shard": None},
                     env=first["env"], model=first["model"],
                     plan=plan, shard=None, records=records, suites_hash=first.get("suites_hash"),
                     layer_policies=first.get("layer_policies"),
                     warnings=(first.get("warnings") or []) + [w for w in warnings if w.startswith("partial")],
                     merged_from=[{"file": name, "command": res["command"], "date": res["env"].get("date"),
                                   "git_commit": res["env"].get("git_commit")} for name, res in shards])
    return merged, warnings


def without_shard(command: str) -> str:
    """A shard's command line less its --shard: the command of the whole run."""
    words = shlex.split(command)
    keep = [w for i, w in enumerate(words) if not (w == "--shard" or w.startswith("--shard=")
                                                  or (i and words[i - 1] == "--shard"))]
    return shlex.join(keep)


def resumable_records(prev: dict, fresh: dict, name: str, plan: EvalPlan) -> list[dict]:
    """The records of the finished items of an earlier results file `prev` of the same run as `fresh` (an empty
    results dict of the run about to start): items whose every record is there and 'ok' (an item with a
    failed or missing record runs again whole). InputError when `prev` belongs to another run."""
    check_same_run(prev, fresh, name, SAME_KEYS + ("shard",))
    if (prev.get("model") or {}).get("name") != (fresh.get("model") or {}).get("name"):
        raise InputError(f"--resume: {name} ran another model: use another --out")
    want: dict = {}
    for i, key in enumerate(plan.record_keys()):
        want.setdefault(key[0], set()).add(i)
    by_item: dict = {}
    for r in prev["records"] + prev["fidelity"]:
        by_item.setdefault(r["item"], []).append(r)
    return [r for item, rs in by_item.items() if {r["index"] for r in rs} == want.get(item)
            and all(r["status"] == "ok" for r in rs) for r in rs]


PLAN_KEYS = ("schema", "kind", "eval", "settings", "shard")  # known before the model loads


def check_same_run(prev: dict, fresh: dict, name: str, keys=PLAN_KEYS) -> None:
    """--resume: an InputError when `prev` (a results file) and `fresh` (results of the run about to start)
    differ in `keys`: PLAN_KEYS alone before the model loads, SAME_KEYS and the shard after."""
    fresh = _as_written_then(prev, json.loads(json.dumps(fresh, default=str)))  # tuples -> lists, as read back
    for key in keys:
        if prev.get(key) == fresh.get(key):
            continue
        if key == "suites_hash":
            raise InputError(f"--resume: {name} ran other prompts (another tokenizer, or a version of tailorkv that "
                             f"fitted them to the length otherwise): start it over with --overwrite, or use "
                             f"another --out")
        raise InputError(f"--resume: {name} holds another run (its '{key}' differs): use the command that "
                         f"wrote it, or another --out")


RESULT_KEYS = ("eval", "records", "fidelity", "env", "command", "args", "model")


def read_results(path: str) -> dict:
    """An eval.json or shard file; an InputError saying why it is not one (unreadable, not JSON, fields missing)."""
    try:
        with open(path, "rb") as f:
            res = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is not an eval results file (not JSON: {e})") from None
    missing = [k for k in RESULT_KEYS if k not in res] if isinstance(res, dict) else list(RESULT_KEYS)
    if missing:
        raise InputError(f"{path} is not an eval results file (no {', '.join(missing)})")
    bad = malformed(res)
    if bad:
        raise InputError(f"{path} is not an eval results file ({bad})")
    return res


NUMBER = (int, float)
ENTRY_TYPES = {"eval": dict, "records": list, "fidelity": list, "env": dict, "command": str, "args": dict,
               "model": dict, "shard": (dict, type(None))}
RECORD_TYPES = {"index": int, "item": int, "status": str, "kind": str, "method": str, "length": int}
RECORD_NUMBERS = ("score", "dnll", "agree", "wall_s", "nll_method", "nll_full", "kl_mean", "kl_max", "attn_recall",
                  "sample")


def malformed(res: dict) -> str | None:
    """What in a results file's entries and records is not of the type its readers take (a hand edit, another
    program's file), or None."""
    for key, want in ENTRY_TYPES.items():
        if key in res and not isinstance(res[key], want):
            return f"its '{key}' is {json.dumps(res[key])[:40]}"
    if res.get("shard") is not None and not all(isinstance(res["shard"].get(k), int) for k in ("index", "count")):
        return "its 'shard' lacks a whole index and count"
    for n, r in enumerate(res["records"] + res["fidelity"]):
        if not isinstance(r, dict):
            return f"record {n} is {json.dumps(r)[:40]}"
        for key, want in RECORD_TYPES.items():
            if not isinstance(r.get(key), want) or isinstance(r.get(key), bool):
                return f"record {n} has no {want.__name__} '{key}'"
        for key in RECORD_NUMBERS:
            v = r.get(key)
            if v is not None and (not isinstance(v, NUMBER) or isinstance(v, bool)):
                return f"record {n}'s '{key}' is {json.dumps(v)[:40]}, not a number"
    return None


def _as_written_then(prev, fresh):
    """fresh without the MethodSettings fields that prev, written before they existed, lacks and that fresh holds at
    their default (a run started before an upgrade resumes after it when it changes nothing)."""
    if not (isinstance(prev, dict) and isinstance(fresh, dict)):
        return fresh
    return {k: _as_written_then(prev[k], v) if k in prev else v for k, v in fresh.items()
            if k in prev or _SETTINGS_DEFAULTS.get(k, _NONE) != v}


_NONE = object()
_SETTINGS_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MethodSettings)
                      if f.default is not dataclasses.MISSING}

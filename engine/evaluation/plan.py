"""What one `tailorkv eval` run does: the parsed options, each method's settings, and the list of work items.

The flattened item list (task items: lengths, then tasks, then samples; then fidelity items: lengths, then
methods) is what `--shard i/n` splits: shard i runs the items whose index % n == i, so the shards of one plan
partition it exactly and `eval-merge` puts the records back in index order.

Conventions (written down here because they change the numbers):
- Question placement (--question): RULER's by default, ``after``: the user message is context + question;
  ``both`` states the question before the context too (this engine's first eval did).
- Length: RULER's convention. --lengths L is the whole sequence: chat template + prompt + the task's max new
  tokens fit in L (prompts.build_suites).
- Budget: every method gets the same knobs (budget, sink, recent, channels, bits, quant layers).
  With --budget-frac F the budget at length L is round(F * L); if sink + recent exceed half of it they are scaled
  down (proportionally, rounded down) to fit in budget // 2, so top-K keeps at least half; SnapKV's observation
  window is capped at budget // 2 the same way. Quest still needs budget >= one page (16 tokens).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tailorkv.engine import ui
from tailorkv.engine.evaluation.tasks import TASKS
from tailorkv.engine.settings import METHODS, MethodSettings

MARGIN = 16  # free cache slots after prompt + max new tokens
QUESTION_PLACEMENTS = ("after", "both")

# greedy tokens generated per task: enough for the whole answer (digits are one token each in SmolLM2)
MAX_NEW_TOKENS = {
    "passkey": 32,
    "niah_single": 32,
    "niah_single_essay": 32,
    "niah_multikey": 32,
    "niah_multivalue": 64,    # 4 values of 7 digits
    "niah_multiquery": 64,    # 4 keys' values
    "variable_tracking": 48,
    "common_words": 120,
    "frequent_words": 48,
}
DEFAULT_MAX_NEW = 64        # a task not in the table


# ------------------------------------------------------------------------------------------------ parsing
def parse_length(text: str) -> int:
    """'4096', '4k', '0.5k', '1m' -> tokens (k = 1024). ValueError naming --lengths otherwise."""
    n = ui.parse_length(text, "--lengths")
    if n < 64:
        raise ValueError(f"--lengths: {text} is too short; use at least 64 tokens")
    return n


def parse_lengths(text: str) -> list[int]:
    parts = ui.split_list(text)
    if not parts:
        raise ValueError("--lengths is empty: give at least one length, e.g. 4k")
    out = []
    for p in parts:
        n = parse_length(p)
        if n not in out:
            out.append(n)
    return out


def parse_methods(text: str) -> list[str]:
    names = ui.split_list(text)
    if not names:
        raise ValueError(f"--methods is empty: name at least one of {', '.join(METHODS)}")
    bad = [m for m in names if m not in METHODS]
    if bad:
        raise ValueError(f"unknown method '{bad[0]}' in --methods: choose from {', '.join(METHODS)}")
    return names


def parse_tasks(text: str | None) -> list[str]:
    names = ui.split_list(text) or list(TASKS)
    bad = [t for t in names if t not in TASKS]
    if bad:
        raise ValueError(f"unknown task '{bad[0]}' in --tasks: choose from {', '.join(TASKS)}")
    return names


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'i/n' with 0 <= i < n -> (i, n); None -> None."""
    if text is None:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard '{text}' is not i/n: write e.g. 0/4 (shards 0/4 .. 3/4)") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard {text}: need 0 <= i < n, e.g. 0/4 .. 3/4")
    return i, n


def length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def shard_filename(i: int, n: int) -> str:
    return f"eval.shard-{i}-of-{n}.json"


# ------------------------------------------------------------------------------------------------ settings
def budget_from_frac(frac: float, length: int, sink: int, recent: int) -> tuple[int, int, int]:
    """(budget, sink, recent) at `length` for --budget-frac: budget = round(frac * length) (at least 2);
    sink + recent scaled down (proportionally, rounded down) to fit in budget // 2 when they exceed it."""
    if not 0 < frac <= 1:
        raise ValueError(f"--budget-frac must be in (0, 1], got {frac}")
    budget = max(2, round(frac * length))
    half = budget // 2
    if sink + recent > half:
        total = sink + recent
        sink = sink * half // total
        recent = half - sink
    return budget, sink, recent


def settings_for(base: MethodSettings, method: str, length: int, budget_frac: float | None) -> MethodSettings:
    """The settings of `method` at `length`: the shared knobs of `base`, with --budget-frac applied."""
    s = dataclasses.replace(base, method=method, extra=dict(base.extra))
    if budget_frac:
        s.budget, s.sink, s.recent = budget_from_frac(budget_frac, length, base.sink, base.recent)
        s.snap_window = max(1, min(base.snap_window, s.budget // 2))
    s.validate()
    return s


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class EvalPlan:
    lengths: list[int]
    methods: list[str]
    tasks: list[str]
    samples: int                        # per task and length
    seed: int = 0
    base: MethodSettings = field(default_factory=MethodSettings)
    budget_frac: float | None = None
    max_new_tokens: int | None = None   # overrides MAX_NEW_TOKENS for every task
    fidelity_tokens: int = 0            # 0: no fidelity items
    question: str = "after"             # QUESTION_PLACEMENTS

    def validate(self) -> None:
        if not self.lengths:
            raise ValueError("--lengths is empty: give at least one length, e.g. 4k")
        if not self.methods:
            raise ValueError("--methods is empty")
        if self.samples < 0:
            raise ValueError("--samples must be 0 or more")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be at least 1")
        if self.fidelity_tokens < 0:
            raise ValueError("--fidelity-tokens must be 0 (off) or more")
        if self.samples == 0 and not self.fidelity_tokens:
            raise ValueError("nothing to do: --samples 0 and no --fidelity-tokens")
        if self.question not in QUESTION_PLACEMENTS:
            raise ValueError(f"--question {self.question}: use {' or '.join(QUESTION_PLACEMENTS)}")
        for n in self.lengths:
            if self.fidelity_tokens and self.fidelity_tokens >= n:
                raise ValueError(f"--fidelity-tokens {self.fidelity_tokens} must be smaller than the length {n}")
        for n in self.lengths:
            for m in self.methods:
                settings_for(self.base, m, n, self.budget_frac)

    def max_new(self, task: str) -> int:
        return self.max_new_tokens or MAX_NEW_TOKENS.get(task, DEFAULT_MAX_NEW)

    def settings(self, method: str, length: int) -> MethodSettings:
        return settings_for(self.base, method, length, self.budget_frac)

    def items(self) -> list[dict]:
        """Every work item in plan order; item["index"] is its position."""
        out: list[dict] = []
        if self.samples:
            for n in self.lengths:
                for m in self.methods:
                    for ti, task in enumerate(self.tasks):
                        for s in range(self.samples):
                            out.append({"kind": "task", "length": n, "method": m, "task": task, "sample": s,
                                        "suite_index": ti * self.samples + s})
        if self.fidelity_tokens:
            for n in self.lengths:
                for m in self.methods:
                    out.append({"kind": "fidelity", "length": n, "method": m})
        for i, it in enumerate(out):
            it["index"] = i
        return out

    def to_dict(self) -> dict:
        return {"lengths": self.lengths, "methods": self.methods, "tasks": self.tasks,
                "samples_per_task": self.samples, "seed": self.seed, "budget_frac": self.budget_frac,
                "max_new_tokens": {t: self.max_new(t) for t in self.tasks},
                "max_new_tokens_override": self.max_new_tokens, "fidelity_tokens": self.fidelity_tokens,
                "question": self.question,
                "base_settings": self.base.to_dict(), "n_items": len(self.items()), "margin": MARGIN,
                "length_convention": "chat template + prompt + max new tokens fit in the length (RULER)",
                "question_convention": {"after": "context, then the question (RULER)",
                                        "both": "the question, the context, the question again"}[self.question],
                "budget_convention": ("same knobs for every method; --budget-frac F: budget = round(F * length), "
                                      "sink + recent scaled to fit budget // 2, snapkv window <= budget // 2")}

    def settings_dict(self) -> dict:
        return {str(n): {m: self.settings(m, n).to_dict() for m in self.methods} for n in self.lengths}

    @classmethod
    def from_dict(cls, e: dict) -> "EvalPlan":
        """The plan an eval.json's "eval" entry describes."""
        names = {f.name for f in dataclasses.fields(MethodSettings)}
        base = MethodSettings(**{k: v for k, v in e["base_settings"].items() if k in names})
        return cls(lengths=list(e["lengths"]), methods=list(e["methods"]), tasks=list(e["tasks"]),
                   samples=e["samples_per_task"], seed=e["seed"], base=base, budget_frac=e["budget_frac"],
                   max_new_tokens=e["max_new_tokens_override"], fidelity_tokens=e["fidelity_tokens"],
                   question=e.get("question", "both"))


def shard_items(items: list[dict], shard: tuple[int, int] | None) -> list[dict]:
    if shard is None:
        return list(items)
    i, n = shard
    return [it for it in items if it["index"] % n == i]

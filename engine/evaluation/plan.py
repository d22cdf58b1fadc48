"""What one `tailorkv eval` run does: the parsed options, each method's settings, and the list of work items.

Work items, in plan order: task items (lengths, then tasks, then samples), each one sample run by every method
in every budget group (runs(): the exact methods once, full first, then each budget's other methods), one record
per run; then fidelity items (lengths, then runs()), one record each. `--shard i/n` runs the items whose index
% n == i, so the shards of one plan partition it exactly; `eval-merge` puts the records back in plan order.

Conventions (written down here because they change the numbers):
- Question placement (--question): RULER's by default, ``after``: the user message is context + question;
  ``both`` states the question before the context too (this engine's first eval did).
- Length: RULER's convention. --lengths L is the whole sequence: chat template + prompt + the task's max new
  tokens fit in L (prompts.build_suites).
- Budgets and protocols (what each method's budget counts): budgets.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tailorkv.engine.errors import InputError
from tailorkv.engine import ui
from tailorkv.engine.evaluation.budgets import (BUDGET_CONVENTION, EXACT_METHODS, KNOBS, PROTOCOL_CONVENTION,
                                               PROTOCOLS, SPLITS, Budget, settings_for)
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
    """'4096', '4k', '0.5k', '1m' -> tokens (k = 1024). InputError naming --lengths otherwise."""
    n = ui.parse_length(text, "--lengths")
    if n < 64:
        raise InputError(f"--lengths: {text} is too short; use at least 64 tokens")
    return n


def parse_lengths(text: str) -> list[int]:
    parts = ui.split_list(text)
    if not parts:
        raise InputError("--lengths is empty: give at least one length, e.g. 4k")
    out = []
    for p in parts:
        n = parse_length(p)
        if n not in out:
            out.append(n)
    return out


def parse_methods(text: str) -> list[str]:
    names = ui.known_names(text, METHODS, "method", "--methods")
    if not names:
        raise InputError(f"--methods is empty: name at least one of {', '.join(METHODS)}")
    return names


def parse_tasks(text: str | None) -> list[str]:
    """None (no --tasks): every task."""
    if text is None:
        return list(TASKS)
    names = ui.known_names(text, TASKS, "task", "--tasks")
    if not names:
        raise InputError(f"--tasks is empty: name at least one of {', '.join(TASKS)} (or leave --tasks out for all)")
    return names


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """'i/n' with 0 <= i < n -> (i, n); None -> None."""
    if text is None:
        return None
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise InputError(f"--shard '{text}' is not i/n: write e.g. 0/4 (shards 0/4 .. 3/4)") from None
    if n < 1 or not 0 <= i < n:
        raise InputError(f"--shard {text}: need 0 <= i < n, e.g. 0/4 .. 3/4")
    return i, n


def length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def shard_filename(i: int, n: int) -> str:
    return f"eval.shard-{i}-of-{n}.json"


# ------------------------------------------------------------------------------------------------ the plan
@dataclass
class EvalPlan:
    lengths: list[int]
    methods: list[str]
    tasks: list[str]
    samples: int                        # per task and length
    seed: int = 0
    base: MethodSettings = field(default_factory=MethodSettings)
    budgets: list[Budget] | None = None  # None: one group, the knobs of `base` as given
    max_new_tokens: int | None = None   # overrides MAX_NEW_TOKENS for every task
    fidelity_tokens: int = 0            # 0: no fidelity items
    question: str = "after"             # QUESTION_PLACEMENTS
    split: str = "shrink"               # SPLITS: sink / recent inside share and absolute budgets
    protocol: str = "plain"             # PROTOCOLS: what each method's budget counts (budgets.py)

    def __post_init__(self):
        if not self.budgets:
            self.budgets = [Budget(str(self.base.budget))]

    def validate(self) -> None:
        if not self.lengths:
            raise InputError("--lengths is empty: give at least one length, e.g. 4k")
        if not self.methods:
            raise InputError("--methods is empty: name at least one, e.g. --methods full,tailorkv")
        if self.samples < 0:
            raise InputError(f"--samples must be 0 or more, got {self.samples}: e.g. --samples 20")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise InputError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}: or leave it out "
                             f"(each task's own)")
        if self.fidelity_tokens < 0:
            raise InputError(f"--fidelity-tokens must be 0 (off) or more, got {self.fidelity_tokens}: e.g. "
                             f"--fidelity-tokens 64")
        if self.samples == 0 and not self.fidelity_tokens:
            raise InputError("nothing to do: --samples 0 and no --fidelity-tokens: give one of them, e.g. --samples 20")
        if self.question not in QUESTION_PLACEMENTS:
            raise InputError(f"--question {self.question}: use {' or '.join(QUESTION_PLACEMENTS)}")
        if self.split not in SPLITS:
            raise InputError(f"--split {self.split}: use {' or '.join(SPLITS)}")
        if self.protocol not in PROTOCOLS:
            raise InputError(f"--protocol {self.protocol}: use {', '.join(PROTOCOLS)}")
        for n in self.lengths:
            if self.max_new_tokens is not None and self.samples and self.max_new_tokens >= n:
                raise InputError(f"--max-new-tokens {self.max_new_tokens} leaves no room for the prompt in the length "
                                 f"{n} (a length holds prompt and answer): lower --max-new-tokens, e.g. 64, or "
                                 f"raise --lengths")
            if self.fidelity_tokens and self.fidelity_tokens >= n:
                raise InputError(f"--fidelity-tokens {self.fidelity_tokens} must be smaller than the length {n}: "
                                 f"lower --fidelity-tokens, e.g. 64, or raise --lengths")
        for n in self.lengths:
            for b, m in self.runs():
                try:
                    self.settings(m, n, b)
                except InputError as e:
                    raise InputError(f"{m} at length {length_label(n)}{'' if b is None else f' budget {b}'}: "
                                     f"{e}") from None

    def max_new(self, task: str) -> int:
        return self.max_new_tokens or MAX_NEW_TOKENS.get(task, DEFAULT_MAX_NEW)

    def budget(self, label: str | None) -> Budget | None:
        return None if label is None else next(b for b in self.budgets if b.label == label)

    def settings(self, method: str, length: int, budget: str | None = KNOBS) -> MethodSettings:
        """budget None (the exact methods' records): the first group's settings, which they ignore."""
        group = self.budgets[0] if budget is None else self.budget(budget)
        return settings_for(self.base, method, length, group, self.split, self.protocol)

    def runs(self) -> list[tuple[str | None, str]]:
        """(budget label, method) of every method run per sample: the exact methods once (budget None, full
        first), then per budget group every other method."""
        exact = sorted((m for m in self.methods if m in EXACT_METHODS), key=EXACT_METHODS.index)
        return [(KNOBS, m) for m in exact] + [(b.label, m) for b in self.budgets for m in self.methods
                                              if m not in EXACT_METHODS]

    def items(self) -> list[dict]:
        """Every work item in plan order; item["index"] is its position. A task item is one sample run by every
        method in every budget group (runs()); a fidelity item is one (length, budget, method)."""
        out: list[dict] = []
        if self.samples:
            for n in self.lengths:
                for ti, task in enumerate(self.tasks):
                    for s in range(self.samples):
                        out.append({"kind": "task", "length": n, "task": task, "sample": s,
                                    "suite_index": ti * self.samples + s})
        if self.fidelity_tokens:
            for n in self.lengths:
                for b, m in self.runs():
                    out.append({"kind": "fidelity", "length": n, "budget": b, "method": m})
        for i, it in enumerate(out):
            it["index"] = i
        return out

    def record_keys(self, items: list[dict] | None = None) -> list[tuple[int, str | None, str]]:
        """(item index, budget, method) of every record the items (default: all) produce, in plan order."""
        keys = []
        for it in self.items() if items is None else items:
            runs = self.runs() if it["kind"] == "task" else [(it["budget"], it["method"])]
            keys += [(it["index"], b, m) for b, m in runs]
        return keys

    def record_index(self) -> dict:
        """(item index, budget, method) -> the record's index in plan order."""
        if getattr(self, "_index", None) is None:
            self._index = {key: i for i, key in enumerate(self.record_keys())}
        return self._index

    def to_dict(self) -> dict:
        return {"lengths": self.lengths, "methods": self.methods, "tasks": self.tasks,
                "samples_per_task": self.samples, "seed": self.seed,
                "budgets": [b.to_dict() for b in self.budgets], "split": self.split, "protocol": self.protocol,
                "max_new_tokens": {t: self.max_new(t) for t in self.tasks},
                "max_new_tokens_override": self.max_new_tokens, "fidelity_tokens": self.fidelity_tokens,
                "question": self.question,
                "base_settings": self.base.to_dict(), "n_items": len(self.items()),
                "n_records": len(self.record_keys()), "margin": MARGIN,
                "length_convention": "chat template + prompt + max new tokens fit in the length (RULER)",
                "question_convention": {"after": "context, then the question (RULER)",
                                        "both": "the question, the context, the question again"}[self.question],
                "budget_convention": BUDGET_CONVENTION, "protocol_convention": PROTOCOL_CONVENTION[self.protocol]}

    def settings_dict(self) -> dict:
        """{budget label: {length: {method: settings}}} (exact methods ignore theirs)."""
        return {b.label: {str(n): {m: self.settings(m, n, b.label).to_dict() for m in self.methods}
                          for n in self.lengths} for b in self.budgets}

    @classmethod
    def from_dict(cls, e: dict) -> "EvalPlan":
        """The plan an eval.json's "eval" entry describes."""
        names = {f.name for f in dataclasses.fields(MethodSettings)}
        base = MethodSettings(**{k: v for k, v in e["base_settings"].items() if k in names})
        budgets = [Budget(b["label"], b["frac"], b["tokens"]) for b in e["budgets"]]
        return cls(lengths=list(e["lengths"]), methods=list(e["methods"]), tasks=list(e["tasks"]),
                   samples=e["samples_per_task"], seed=e["seed"], base=base, budgets=budgets,
                   max_new_tokens=e["max_new_tokens_override"], fidelity_tokens=e["fidelity_tokens"],
                   question=e["question"], split=e["split"], protocol=e["protocol"])


def shard_items(items: list[dict], shard: tuple[int, int] | None) -> list[dict]:
    if shard is None:
        return list(items)
    i, n = shard
    return [it for it in items if it["index"] % n == i]

"""Budget groups of `tailorkv eval` and each method's settings in one: --budgets 1%,3%,192,1024 (or --budget-frac F,
or the --budget/--sink/--recent knobs as given).

- A share F of the length: budget = round(F * L) tokens at length L.
- A number of tokens: that many at every length; 192 and 1024 bring the paper's split and r
  (LongBench 192 = sink 8 + top-K 128 + recent 56 with r = 8; RULER 1024 = 64 + 896 + 64 with r = 12).
- Sink and recent inside the other budgets (--split): ``shrink`` (this engine's first eval) keeps --sink and
  --recent, scaled down (proportionally, rounded down) to fit in budget // 2 when they exceed it, so top-K keeps
  at least half; ``paper`` gives each budget / 16 (the proportions of the paper's 1024 split), top-K the rest.
- Quest still needs budget >= one page (16 tokens).

Protocols (--protocol), i.e. what each method's budget counts (PROTOCOL_CONVENTION says it in one line each):
- ``plain`` (default): every method keeps the same number of prompt tokens per layer and step, the budget;
  the tokens generated after the prompt are attended on top by every method (MethodSettings.free_generated;
  answers here are at most 120 tokens). Every positional part is inside the budget: tailorkv's sink and recent,
  StreamingLLM's sink and window, Quest's last page, SnapKV's observation window, which is at most
  sink + recent (the share tailorkv keeps by position) and at most budget // 2. Baselines budget every layer;
  tailorkv's quantization-friendly layers (layer 0 for SmolLM2) hold every token at 1-2 bits, as the method
  prescribes.
- ``paper``: plain, plus the TailorKV paper's protocol for baselines (its Table 8; Quest's own paper too):
  layer 0 dense (the `full` policy) for StreamingLLM and SnapKV, layers 0 and 1 dense for Quest
  (MethodSettings.dense_layers), so they get what tailorkv's quantized layer 0 gets.
- ``legacy``: this engine's first eval (eval/results/2026-11-29-h200-smollm2-2k-4k-8k): each policy's own rule
  for generated tokens (StreamingLLM's window and Quest's pages count them, tailorkv and SnapKV keep them
  outside), SnapKV's window <= budget // 2, no dense layers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tailorkv.engine.errors import InputError
from tailorkv.engine import ui
from tailorkv.engine.settings import MethodSettings

SPLITS = ("shrink", "paper")
PAPER_SPLITS = {192: (8, 56, 8), 1024: (64, 64, 12)}  # budget: (sink, recent, r) of LongBench / RULER runs
EXACT_METHODS = ("full", "offload")  # budget-free: run once per sample, shown in every budget group
BUDGET_CONVENTION = ("same knobs for every method; a share F: budget = round(F * length); a number: that many "
                     "tokens (192: sink 8 + top-K 128 + recent 56 with r = 8; 1024: 64 + 896 + 64 with r = 12); "
                     "--split shrink: --sink + --recent scaled to fit budget // 2, paper: budget / 16 each")


@dataclass(frozen=True)
class Budget:
    """One budget group. frac: a share of each length; tokens: absolute (192 and 1024 carry the paper's split
    and r); neither: the --budget/--sink/--recent/--channels knobs as given."""
    label: str
    frac: float | None = None
    tokens: int | None = None

    @property
    def kind(self) -> str:
        if self.frac is not None:
            return "frac"
        if self.tokens is None:
            return "knobs"
        return "paper" if self.tokens in PAPER_SPLITS else "tokens"

    def at(self, length: int, base: MethodSettings) -> int:
        """Tokens at `length`."""
        if self.frac is not None:
            return max(2, round(self.frac * length))
        return base.budget if self.tokens is None else self.tokens

    def to_dict(self) -> dict:
        return {"label": self.label, "kind": self.kind, "frac": self.frac, "tokens": self.tokens}


def budgeted(methods) -> list[str]:
    """The methods a budget group limits (all but EXACT_METHODS), in their order."""
    return [m for m in methods if m not in EXACT_METHODS]


def parse_budget(text: str) -> Budget:
    """'3%' or '0.03' -> a fraction of the length; '1024' or '1k' -> tokens."""
    t = text.strip().lower()
    bad = InputError(f"--budgets '{text}' is not a budget: write a share of the length (3% or 0.03) or a number "
                     f"of tokens (192, 1024, 1k)")
    try:
        if t[-1:] in ("k", "m"):
            tokens = ui.parse_length(t, "--budgets")
        elif t.endswith("%") or "." in t:
            frac = float(t[:-1]) / 100 if t.endswith("%") else float(t)
            if not 0 < frac <= 1:
                raise InputError(f"--budgets {text}: a share of the length must be in (0, 100%]")
            return Budget(f"{frac * 100:g}%", frac=frac)
        else:
            tokens = int(t)
    except ValueError as e:
        raise (e if str(e).startswith("--budgets " + text) else bad) from None
    if tokens < 2:
        raise InputError(f"--budgets {text}: a budget needs at least 2 tokens")
    return Budget(str(tokens), tokens=tokens)


def parse_budgets(text: str) -> list[Budget]:
    parts = ui.split_list(text)
    if not parts:
        raise InputError("--budgets is empty: give e.g. 1%,3%,6%,12%,25% or 1024")
    out: list[Budget] = []
    for p in parts:
        b = parse_budget(p)
        if b.label not in [x.label for x in out]:  # 3% and 0.03 are one budget
            out.append(b)
    return out


def split_budget(budget: int, sink: int, recent: int, rule: str) -> tuple[int, int]:
    """(sink, recent) inside `budget` (top-K gets the rest). shrink: --sink and --recent, scaled down
    (proportionally, rounded down) to fit in budget // 2 when they exceed it; paper: budget / 16 each (the
    proportions of the paper's 1024 = 64 + 896 + 64), at least 1."""
    if rule == "paper":
        edge = max(1, round(budget / 16))
        return edge, edge
    if rule != "shrink":
        raise InputError(f"--split {rule}: use {' or '.join(SPLITS)}")
    half = budget // 2
    if sink + recent > half:
        total = sink + recent
        sink = sink * half // total
        recent = half - sink
    return sink, recent


def budget_from_frac(frac: float, length: int, sink: int, recent: int) -> tuple[int, int, int]:
    """(budget, sink, recent) at `length` for --budget-frac F with the shrink split."""
    if not 0 < frac <= 1:
        raise InputError(f"--budget-frac must be in (0, 1], got {frac}")
    budget = max(2, round(frac * length))
    return (budget, *split_budget(budget, sink, recent, "shrink"))


PROTOCOLS = ("plain", "paper", "legacy")
PAPER_DENSE = {"streamingllm": [0], "snapkv": [0], "quest": [0, 1]}  # the paper's Table 8 protocol (Quest's own)
PROTOCOL_CONVENTION = {
    "plain": "every method's budget counts the prompt tokens a layer keeps; tokens generated after the prompt "
             "are attended on top by every method; positional windows (sink, recent, snapkv's observation "
             "window <= sink + recent, quest's last page) inside the budget; every baseline layer budgeted",
    "paper": "plain, with the TailorKV paper's protocol for baselines: layer 0 dense for streamingllm and snapkv, "
             "layers 0 and 1 dense for quest",
    "legacy": "this engine's first eval: streamingllm and quest count generated tokens in the budget, tailorkv "
              "and snapkv keep them outside; snapkv window <= budget // 2; every baseline layer budgeted"}
KNOBS = None  # the budget key of exact methods' records (their settings ignore every budget)


def settings_for(base: MethodSettings, method: str, length: int, budget: Budget | None,
                 split: str = "shrink", protocol: str = "plain") -> MethodSettings:
    """The settings of `method` at `length` in a budget group: the shared knobs of `base` with the budget's
    tokens and split (the paper's budgets bring their own sink, recent and r), under `protocol` (PROTOCOLS)."""
    if protocol not in PROTOCOLS:
        raise InputError(f"--protocol {protocol}: use {', '.join(PROTOCOLS)}")
    s = dataclasses.replace(base, method=method, extra=dict(base.extra))
    if budget is not None and budget.kind != "knobs":
        s.budget = budget.at(length, base)
        if budget.kind == "paper":
            s.sink, s.recent, s.channels = PAPER_SPLITS[budget.tokens]
        else:
            s.sink, s.recent = split_budget(s.budget, base.sink, base.recent, split)
        if protocol == "legacy":
            s.snap_window = max(1, min(base.snap_window, s.budget // 2))
    if protocol != "legacy":
        s.snap_window = max(1, min(base.snap_window, s.sink + s.recent, s.budget // 2))
        dense = PAPER_DENSE.get(method) if protocol == "paper" else None
        s.dense_layers = list(dense) if dense else None
    s.free_generated = protocol != "legacy"
    if budget is not None and budget.kind != "knobs":  # the group set the budget, not --budget
        s.validate("its {n} tokens", "raise that budget in --budgets (or --budget-frac)")
    else:
        s.validate()
    return s

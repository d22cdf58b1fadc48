"""RULER's string-match scoring (Hsieh et al. 2024), scores in 0..1 (the eval driver reports x100).

Rules, applied to the model's generated text ``pred`` and the sample's expected strings ``refs``:
- ``string_match_all``: the fraction of refs that occur in pred as substrings, case-insensitive.
  Used by every task whose answer is a set (NIAH, variable tracking, common/frequent words, pass key):
  finding 3 of 4 values scores 0.75.
- ``string_match_part``: 1 if any ref occurs in pred (case-insensitive), else 0 (the max over refs).
  Used where any one of several accepted answers is enough (RULER's QA tasks).
Before matching, pred is stripped and control characters become spaces; nothing else is normalized
(no punctuation or article removal), exactly substring containment as in RULER.
"""
from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _clean(pred: str) -> str:
    return _CONTROL.sub(" ", pred).strip().lower()


def string_match_all(pred: str, refs: list[str]) -> float:
    if not refs:
        raise ValueError("no reference answers")
    text = _clean(pred)
    return sum(r.lower() in text for r in refs) / len(refs)


def string_match_part(pred: str, refs: list[str]) -> float:
    if not refs:
        raise ValueError("no reference answers")
    text = _clean(pred)
    return float(max(r.lower() in text for r in refs))


METRICS = {"all": string_match_all, "part": string_match_part}


def score(pred: str, refs: list[str], metric: str) -> float:
    """Score one prediction with the named metric ("all" or "part")."""
    try:
        return METRICS[metric](pred, refs)
    except KeyError:
        raise ValueError(f"unknown metric {metric!r}: use one of {sorted(METRICS)}") from None

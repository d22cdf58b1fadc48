"""Synthetic long-context evaluation (RULER-style tasks generated on the fly) and its scoring."""
from .scoring import score, string_match_all, string_match_part
from .tasks import TASKS, Sample, make_suite

__all__ = ["TASKS", "Sample", "make_suite", "score", "string_match_all", "string_match_part"]

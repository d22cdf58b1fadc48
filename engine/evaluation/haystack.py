"""Filler text for the synthetic long-context tasks, and made-up words.

Two filler sources, both cut into "units" (one sentence each, carrying its own trailing separator):
- ``noise``: RULER's repeated-sentence noise, "The grass is green. The sky is blue. ..." cycled forever.
- ``essay``: ``essays.txt`` next to this module: original prose on mundane topics written for this project
  (no digits in it, so it never collides with a needle value; no sentence twice). It holds ~17k SmolLM2
  tokens, so a stretch of up to 16k tokens from any start (the stream wraps from its end to its beginning)
  never repeats a sentence; longer prompts cycle it.

``Filler.take(n_words)`` returns the first ``n_words`` words of the endless stream as units (the last unit
cut short when the count ends inside a sentence); the tasks fit prompt lengths by searching on ``n_words``.
``WordPool`` draws unique pronounceable made-up words from syllables, deterministically from its rng.
"""
from __future__ import annotations

import functools
import itertools
import random
import re
from pathlib import Path

NOISE_TEXT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ESSAY_PATH = Path(__file__).with_name("essays.txt")

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(text.strip()) if s.strip()]


def noise_units() -> tuple[str, ...]:
    return tuple(s + " " for s in split_sentences(NOISE_TEXT))


@functools.lru_cache(maxsize=1)
def essay_units() -> tuple[str, ...]:
    """Sentences of essays.txt; the last sentence of each paragraph ends with a blank line."""
    units = []
    for paragraph in re.split(r"\n\s*\n", ESSAY_PATH.read_text(encoding="utf-8")):
        sentences = split_sentences(" ".join(paragraph.split()))
        if sentences:
            units += [s + " " for s in sentences[:-1]]
            units.append(sentences[-1] + "\n\n")
    return tuple(units)


def filler_units(kind: str) -> tuple[str, ...]:
    if kind == "noise":
        return noise_units()
    if kind == "essay":
        return essay_units()
    raise ValueError(f"unknown haystack {kind!r}: use 'noise' or 'essay'")


class Filler:
    """An endless stream of filler units (cycled), starting at unit ``start``."""

    def __init__(self, units: tuple[str, ...], start: int = 0):
        self.units = units
        self.start = start % len(units)
        self.words = [len(u.split()) for u in units]

    def _cycle(self):
        n = len(self.units)
        for i in itertools.count(self.start):
            yield self.units[i % n], self.words[i % n]

    def take(self, n_words: int) -> list[str]:
        out, left = [], n_words
        for unit, w in self._cycle():
            if left <= 0:
                break
            if w <= left:
                out.append(unit)
            else:  # the count ends inside this sentence: keep its first `left` words
                out.append(" ".join(unit.split()[:left]) + " ")
            left -= w
        return out

    def boundaries_around(self, n_words: int) -> tuple[int, int]:
        """Word counts of the sentence ends just at/below and just above ``n_words``."""
        total = 0
        for _, w in self._cycle():
            if total + w > n_words:
                return total, total + w
            total += w
        raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------- made-up words
_ONSETS = "b d f g k l m n p r s t v z".split()
_VOWELS = "a e i o u".split()


class WordPool:
    """Unique pronounceable made-up words, drawn on demand from ``rng``.

    Every word is ``syllables`` consonant-vowel pairs, so all words have the same length and none is a
    substring of another (substring matching in the scorer stays unambiguous).
    """

    def __init__(self, rng: random.Random, syllables: int = 3):
        self.rng, self.syllables = rng, syllables
        self.words: list[str] = []
        self._seen: set[str] = set()

    def draw(self, n: int) -> list[str]:
        out = []
        while len(out) < n:
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(self.syllables))
            if w not in self._seen:
                self._seen.add(w)
                self.words.append(w)
                out.append(w)
        return out

    def first(self, n: int) -> list[str]:
        """The first ``n`` words ever drawn (drawing more if needed): a stable, growable list."""
        if n > len(self.words):
            self.draw(n - len(self.words))
        return self.words[:n]

"""Synthetic long-context tasks for `tailorkv eval`, written from RULER's task descriptions (Hsieh et al. 2024).

Every task is a function ``(tokenizer, target_tokens, rng, **options) -> Sample``. The tokenizer is duck-typed
(``encode(text) -> list[int]``, ``decode(ids) -> str``); all randomness comes from ``rng``, so a seed fixes the
sample. The prompt is ``context + question`` (the question starts with a blank line); its token count under the
tokenizer is fitted to at most ``target_tokens`` and within 2% of it by searching on the amount of filler (words
of haystack, list items, coded words), then preferring a haystack that ends on a whole sentence when that stays
within 1% below the target.

Needles are inserted between filler sentences: a needle at depth d (0..1) goes to the sentence boundary whose
token offset into the haystack is closest to d times the haystack's token length (per-sentence token counts
come from the tokenizer), so it lands within one sentence of the requested position.

Tasks (``TASKS`` registry): passkey, niah_single (noise haystack), niah_single_essay, niah_multikey (3
distractor needles with other keys), niah_multivalue (4 values for one key), niah_multiquery (4 keys asked at
once), variable_tracking, common_words, frequent_words. ``make_suite`` builds a deterministic suite.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import random
import string
import uuid
from dataclasses import dataclass, field
from typing import Callable

from tailorkv.engine.errors import InputError
from .haystack import Filler, WordPool, filler_units

TOLERANCE = 0.02  # target - TOLERANCE * target <= n_tokens <= target


@dataclass(frozen=True)
class Sample:
    task: str
    context: str          # instructions + the long text
    question: str         # put right after the context; starts with a blank line
    answers: list[str]    # every expected string
    metric: str           # "all" or "part" (see scoring.py)
    n_tokens: int         # tokens of context + question under the tokenizer
    prompt_hash: str      # sha256(context + question), first 16 hex digits
    depth: float | None = None  # where the (first queried) needle sits, 0..1 of the haystack
    answer_prefix: str = ""     # RULER-style start of the answer, for drivers that prefill it
    target_tokens: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return self.context + self.question


def _sample(task, tokenizer, target, context, question, answers, **extra) -> Sample:
    prompt = context + question
    return Sample(task=task, context=context, question=question, answers=list(answers), metric="all",
                  n_tokens=len(tokenizer.encode(prompt)),
                  prompt_hash=hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16],
                  target_tokens=target, **extra)


# ------------------------------------------------------------------------------------------------ length fitting
def _fit(measure: Callable[[int], int], target: int, task: str) -> int:
    """The largest filler amount n whose prompt length measure(n) stays within target (measure grows with n)."""
    t0 = measure(0)
    if t0 > target:
        raise InputError(f"{task}: the prompt needs {t0} tokens without any filler, more than the {target} it "
                         f"may have; use a longer length")
    lo, hi = 0, 64
    while measure(hi) <= target:  # grow by linear extrapolation until the target is bracketed
        slope = max((measure(hi) - measure(lo)) / (hi - lo), 1e-3)
        lo, hi = hi, min(hi * 16, hi + int((target - measure(hi)) / slope * 1.05) + 1)
    slack, bisect_next = max(1, target // 1000), False
    while hi - lo > 1 and target - measure(lo) > slack:  # interpolation search, bisection as a safeguard
        width = hi - lo
        if bisect_next:
            guess = (lo + hi) // 2
        else:
            guess = lo + round((target - measure(lo)) * width / max(measure(hi) - measure(lo), 1))
        guess = min(max(guess, lo + 1), hi - 1)
        if measure(guess) <= target:
            lo = guess
        else:
            hi = guess
        bisect_next = hi - lo > width / 2
    return lo


def _measurer(tokenizer, render: Callable[[int], str]) -> Callable[[int], int]:
    return functools.lru_cache(maxsize=None)(lambda n: len(tokenizer.encode(render(n))))


class _Haystack:
    """Filler sentences with items (needles, statements) inserted at depth fractions of the token length."""

    def __init__(self, tokenizer, kind: str, rng: random.Random):
        units = filler_units(kind)
        starts = [0] + [i + 1 for i, u in enumerate(units[:-1]) if u.endswith("\n\n")]  # paragraph starts
        self.filler = Filler(units, 0 if kind == "noise" else rng.choice(starts))
        self.tokenizer = tokenizer
        self._bias = len(tokenizer.encode(""))  # e.g. a BOS the tokenizer adds to every encode
        self._counts: dict[str, int] = {}

    def _tokens(self, unit: str) -> int:
        if unit not in self._counts:
            self._counts[unit] = max(len(self.tokenizer.encode(unit)) - self._bias, 0)
        return self._counts[unit]

    def text(self, n_words: int, items: list[tuple[float, str]]) -> str:
        units = self.filler.take(n_words)
        offsets = [0]
        for u in units:
            offsets.append(offsets[-1] + self._tokens(u))
        placed = []
        for order, (depth, item) in enumerate(items):
            want = depth * offsets[-1]
            k = bisect.bisect_left(offsets, want)
            if k > 0 and (k == len(offsets) or want - offsets[k - 1] <= offsets[k] - want):
                k -= 1
            placed.append((k, depth, order, item))
        placed.sort()
        out, j = [], 0
        for k in range(len(units) + 1):
            while j < len(placed) and placed[j][0] == k:
                out.append(placed[j][3] + " ")
                j += 1
            if k < len(units):
                out.append(units[k])
        return "".join(out).rstrip()


def _haystack_sample(task, tokenizer, target, rng, *, haystack, header, items, question, answers,
                     answer_prefix, depth=None, meta=None) -> Sample:
    hay = _Haystack(tokenizer, haystack, rng)
    question = "\n\n" + question

    def context(n):
        return header + "\n\n" + hay.text(n, items)

    measure = _measurer(tokenizer, lambda n: context(n) + question)
    n = _fit(measure, target, task)
    for b in sorted(hay.filler.boundaries_around(n), key=lambda b: abs(b - n)):  # end on a whole sentence
        if 0 <= target - measure(b) <= target * TOLERANCE / 2:
            n = b
            break
    return _sample(task, tokenizer, target, context(n), question, answers, depth=depth,
                   answer_prefix=answer_prefix, meta=dict(meta or {}, haystack=haystack))


# ------------------------------------------------------------------------------------------------ value makers
_KINDS = {"number": "numbers", "word": "words", "uuid": "uuids"}


def _unique(make: Callable[[], str], used: set[str]) -> str:
    while (v := make()) in used:
        pass
    used.add(v)
    return v


def _value(rng: random.Random, kind: str, pool: WordPool) -> str:
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "word":
        return pool.draw(1)[0]
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown value type {kind!r}: use one of {sorted(_KINDS)}")


def _key(rng: random.Random, kind: str, pool: WordPool) -> str:
    return "-".join(pool.draw(2)) if kind == "word" else _value(rng, kind, pool)


def _join(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + " and " + keys[-1]


# ------------------------------------------------------------------------------------------------ tasks
def niah(tokenizer, target_tokens: int, rng: random.Random, *, haystack: str = "noise", n_queries: int = 1,
         n_values: int = 1, n_distractors: int = 0, value_type: str = "number", key_type: str = "word",
         depth: float | None = None, task: str = "niah") -> Sample:
    """Needle(s) "One of the special magic numbers for {key} is: {value}." in a haystack.

    n_queries keys are asked at once, each with n_values values (all are answers); n_distractors more keys
    get one needle each and are not asked. The first queried needle sits at ``depth`` (random if None),
    every other needle at a random depth.
    """
    if value_type not in _KINDS or key_type not in _KINDS:
        raise ValueError(f"value_type and key_type must be one of {sorted(_KINDS)}")
    pool, used = WordPool(random.Random(rng.getrandbits(64))), set()
    keys = [_unique(lambda: _key(rng, key_type, pool), used) for _ in range(n_queries + n_distractors)]
    values = [[_unique(lambda: _value(rng, value_type, pool), used)
               for _ in range(n_values if i < n_queries else 1)] for i in range(len(keys))]
    kind = _KINDS[value_type]
    needles = [f"One of the special magic {kind} for {k} is: {v}." for k, vs in zip(keys, values) for v in vs]
    depth = rng.random() if depth is None else float(depth)
    items = [(depth, needles[0])] + [(rng.random(), n) for n in needles[1:]]
    asked = _join(keys[:n_queries])
    if n_queries == 1 and n_values == 1:
        question = f"What is the special magic {kind[:-1]} for {asked} mentioned in the provided text?"
        prefix = f"The special magic {kind[:-1]} for {asked} mentioned in the provided text is"
    else:
        question = f"What are all the special magic {kind} for {asked} mentioned in the provided text?"
        prefix = f"The special magic {kind} for {asked} mentioned in the provided text are"
    header = (f"Some special magic {kind} are hidden in the text below. Memorize them: you will be asked "
              f"about them afterwards.")
    answers = [v for vs in values[:n_queries] for v in vs]
    return _haystack_sample(task, tokenizer, target_tokens, rng, haystack=haystack, header=header, items=items,
                            question=question, answers=answers, answer_prefix=prefix, depth=depth,
                            meta={"needles": needles, "keys": keys[:n_queries]})


def passkey(tokenizer, target_tokens: int, rng: random.Random, *, depth: float | None = None, digits: int = 5,
            haystack: str = "noise", task: str = "passkey") -> Sample:
    """A pass key sentence hidden in repeated "The grass is green. ..." noise."""
    key = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    depth = rng.random() if depth is None else float(depth)
    header = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
              "memorize it. I will quiz you about it afterwards.")
    return _haystack_sample(task, tokenizer, target_tokens, rng, haystack=haystack, header=header,
                            items=[(depth, needle)], question="What is the pass key?", answers=[key],
                            answer_prefix="The pass key is", depth=depth, meta={"needles": [needle]})


def variable_tracking(tokenizer, target_tokens: int, rng: random.Random, *, num_chains: int = 1,
                      num_hops: int = 4, haystack: str = "noise", task: str = "variable_tracking") -> Sample:
    """Chains "VAR A = 12345." "VAR B = VAR A." ... in noise; answer: every variable of the first chain.

    The other chains (distractors) hold other values. Statements sit at random depths, in chain order.
    """
    used: set[str] = set()
    names = [_unique(lambda: "".join(rng.choices(string.ascii_uppercase, k=5)), used)
             for _ in range(num_chains * (num_hops + 1))]
    values = [_unique(lambda: str(rng.randint(10_000, 99_999)), used) for _ in range(num_chains)]
    items, chains = [], []
    for c in range(num_chains):
        chain = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        statements = [f"VAR {chain[0]} = {values[c]}."]
        statements += [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])]
        items += zip(sorted(rng.random() for _ in statements), statements)
        chains.append(chain)
    header = "Memorize and track the chains of variable assignments hidden in the following text."
    question = f"Question: Find all variables that are assigned the value {values[0]} in the text above."
    prefix = (f"Answer: According to the chains of variable assignments in the text above, {num_hops + 1} "
              f"variables are assigned the value {values[0]}, they are:")
    return _haystack_sample(task, tokenizer, target_tokens, rng, haystack=haystack, header=header, items=items,
                            question=question, answers=chains[0], answer_prefix=prefix,
                            meta={"value": values[0], "chains": chains, "values": values})


def common_words(tokenizer, target_tokens: int, rng: random.Random, *, num_common: int = 10,
                 freq_common: int = 30, freq_rare: int = 3, task: str = "common_words") -> Sample:
    """A numbered word list: num_common words appear freq_common times, the others freq_rare times.

    Answer: the num_common most common words. For short prompts the frequencies shrink so the common words
    take at most half the list (they stay strictly more frequent than every other word).
    """
    pool, seed = WordPool(random.Random(rng.getrandbits(64))), rng.getrandbits(64)
    header = ("Below is a numbered list of words. Some words appear more often than others. Memorize the ones "
              "that appear most often.")
    question = f"\n\nQuestion: What are the {num_common} most common words in the above list?"
    prefix = f"Answer: The top {num_common} words that appear most often in the list are:"
    probe = WordPool(random.Random(0)).draw(100)
    per_item = len(tokenizer.encode("\n".join(f"{i + 900}. {w}" for i, w in enumerate(probe)))) / 100
    budget = (target_tokens - len(tokenizer.encode(header + question))) / per_item
    freq_common = min(freq_common, max(2, int(budget // (2 * num_common))))
    freq_rare = max(1, min(freq_rare, freq_common // 4))

    def context(n_rare_items: int) -> str:
        words = pool.first(num_common + -(-n_rare_items // freq_rare))
        items = words[:num_common] * freq_common + [words[num_common + i // freq_rare] for i in range(n_rare_items)]
        random.Random(seed).shuffle(items)
        return header + "\n\n" + "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))

    n = _fit(_measurer(tokenizer, lambda n: context(n) + question), target_tokens, task)
    return _sample(task, tokenizer, target_tokens, context(n), question, pool.first(num_common),
                   answer_prefix=prefix, meta={"freq_common": freq_common, "freq_rare": freq_rare})


def _zipf_counts(total: int, vocab: int, alpha: float, top: int) -> list[int]:
    """Word counts by rank summing to ~total, with rank `top` strictly rarer than rank `top - 1`."""
    weights = [r ** -alpha for r in range(1, vocab + 1)]
    norm = sum(weights)
    raw = [total * w / norm for w in weights]
    counts = [int(x) for x in raw]
    for r in sorted(range(vocab), key=lambda r: (counts[r] - raw[r], r))[:total - sum(counts)]:
        counts[r] += 1  # largest remainders first
    counts[top - 1] = max(counts[top - 1], counts[top] + 1)
    for r in range(top - 2, -1, -1):
        counts[r] = max(counts[r], counts[r + 1])
    return counts


def frequent_words(tokenizer, target_tokens: int, rng: random.Random, *, alpha: float = 2.0,
                   vocab_size: int = 1000, top: int = 3, task: str = "frequent_words") -> Sample:
    """Made-up "coded" words with Zipf(alpha) frequencies, shuffled; answer: the `top` most frequent."""
    vocab, seed = WordPool(random.Random(rng.getrandbits(64))).draw(vocab_size), rng.getrandbits(64)
    header = ("The text below is written in a made-up code. Keep track of how often each coded word appears: "
              f"you will be asked for the {top} most frequent ones.")
    question = (f"\n\nQuestion: What are the {top} most frequently appearing coded words in the above text? "
                "Do not explain.")
    prefix = f"Answer: According to the coded text above, the {top} most frequently appearing coded words are:"

    def context(total: int) -> str:
        words = [w for w, c in zip(vocab, _zipf_counts(total, vocab_size, alpha, top)) for _ in range(c)]
        random.Random(seed).shuffle(words)
        return header + "\n\n" + " ".join(words)

    n = _fit(_measurer(tokenizer, lambda n: context(n) + question), target_tokens, task)
    return _sample(task, tokenizer, target_tokens, context(n), question, vocab[:top], answer_prefix=prefix,
                   meta={"alpha": alpha})


# ------------------------------------------------------------------------------------------------ registry
def _variant(fn, name: str, uses_depth: bool, **defaults):
    def generate(tokenizer, target_tokens: int, rng: random.Random, **options) -> Sample:
        return fn(tokenizer, target_tokens, rng, **{**defaults, **options, "task": name})
    generate.__name__ = generate.__qualname__ = name
    generate.__doc__ = fn.__doc__
    generate.uses_depth = uses_depth
    generate.defaults = defaults
    return generate


TASKS: dict[str, Callable[..., Sample]] = {
    "passkey": _variant(passkey, "passkey", True),
    "niah_single": _variant(niah, "niah_single", True, haystack="noise"),
    "niah_single_essay": _variant(niah, "niah_single_essay", True, haystack="essay"),
    "niah_multikey": _variant(niah, "niah_multikey", True, haystack="essay", n_distractors=3),
    "niah_multivalue": _variant(niah, "niah_multivalue", True, haystack="essay", n_values=4),
    "niah_multiquery": _variant(niah, "niah_multiquery", True, haystack="essay", n_queries=4),
    "variable_tracking": _variant(variable_tracking, "variable_tracking", False),
    "common_words": _variant(common_words, "common_words", False),
    "frequent_words": _variant(frequent_words, "frequent_words", False),
}


def make_sample(tokenizer, length: int, name: str, index: int, samples_per_task: int, seed: int) -> Sample:
    """Sample `index` of task `name` in a suite of samples_per_task per task: its own rng seeded from (seed, task,
    index), so a task's samples don't change when other tasks are added; needle tasks sweep depth evenly over 0..1."""
    rng = random.Random(f"tailorkv-eval:{seed}:{name}:{index}")
    options = {}
    if TASKS[name].uses_depth:
        options["depth"] = index / (samples_per_task - 1) if samples_per_task > 1 else 0.5
    return TASKS[name](tokenizer, length, rng, **options)


def make_suite(tokenizer, length: int, samples_per_task: int, seed: int,
               tasks: list[str] | None = None) -> list[Sample]:
    """samples_per_task samples (make_sample) of each task (all of TASKS by default) at `length` tokens."""
    names = list(TASKS) if tasks is None else list(tasks)
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}: choose from {sorted(TASKS)}")
    return [make_sample(tokenizer, length, name, i, samples_per_task, seed)
            for name in names for i in range(samples_per_task)]

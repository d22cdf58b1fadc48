"""Synthetic long-context tasks: placement, length fitting, answers, determinism, scoring (no model needed)."""
import random
import re
from collections import Counter

import pytest

from tailorkv.engine.evaluation import TASKS, make_suite, score, string_match_all, string_match_part
from tailorkv.engine.evaluation.haystack import Filler, WordPool, essay_units


class WordTokenizer:
    """One token per word or punctuation mark; ids assigned on first sight."""

    def __init__(self):
        self.ids, self.words = {}, []

    def encode(self, text):
        out = []
        for w in re.findall(r"\w+|[^\w\s]", text):
            if w not in self.ids:
                self.ids[w] = len(self.words)
                self.words.append(w)
            out.append(self.ids[w])
        return out

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


class CharTokenizer:
    """One token per character, plus a BOS on every encode (checks that the BOS bias is handled)."""

    def encode(self, text):
        return [0] + [ord(c) + 1 for c in text]

    def decode(self, ids):
        return "".join(chr(i - 1) for i in ids if i)


@pytest.fixture
def tok():
    return WordTokenizer()


def _gen(name, tok, target, seed=0, **options):
    return TASKS[name](tok, target, random.Random(seed), **options)


def _token_fraction(tok, sample, needle):
    """Token offset of the needle inside the haystack body, as a fraction of the body's token length."""
    body_start = sample.context.index("\n\n") + 2
    at = sample.context.index(needle)
    before = len(tok.encode(sample.context[body_start:at]))
    return before / len(tok.encode(sample.context[body_start:]))


# ------------------------------------------------------------------------------------------ needle placement
@pytest.mark.parametrize("name", ["passkey", "niah_single", "niah_single_essay"])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_lands_at_depth(tok, name, depth):
    s = _gen(name, tok, 2000, depth=depth)
    assert s.depth == depth
    needle = s.meta["needles"][0]
    assert s.context.count(needle) == 1
    assert abs(_token_fraction(tok, s, needle) - depth) <= 0.05


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_depth_with_char_tokenizer_and_bos(depth):
    tok = CharTokenizer()
    s = _gen("niah_single", tok, 3000, depth=depth)
    needle = s.meta["needles"][0]
    body = s.context[s.context.index("\n\n") + 2:]
    assert abs(body.index(needle) / len(body) - depth) <= 0.05
    assert 0.98 * 3000 <= s.n_tokens <= 3000


def test_first_queried_needle_at_depth_in_multi_needle_tasks(tok):
    for name in ("niah_multikey", "niah_multivalue", "niah_multiquery"):
        s = _gen(name, tok, 2000, depth=0.25)
        assert abs(_token_fraction(tok, s, s.meta["needles"][0]) - 0.25) <= 0.05


# ------------------------------------------------------------------------------------------ length fitting
@pytest.mark.parametrize("target", [500, 2000, 8000])
@pytest.mark.parametrize("name", list(TASKS))
def test_prompt_length_within_2_percent(tok, name, target):
    s = _gen(name, tok, target, seed=target)
    assert s.n_tokens == len(tok.encode(s.context + s.question)) == len(tok.encode(s.prompt))
    assert 0.98 * target <= s.n_tokens <= target, (s.n_tokens, target)
    assert s.target_tokens == target and s.task == name


def test_too_short_target_is_a_clear_error(tok):
    with pytest.raises(ValueError, match="longer length"):
        _gen("niah_multiquery", tok, 20)


# ------------------------------------------------------------------------------------------ answers
@pytest.mark.parametrize("name", list(TASKS))
def test_answers_present_in_context_and_score_one(tok, name):
    s = _gen(name, tok, 1500, seed=3)
    assert s.answers and s.metric in ("all", "part")
    for a in s.answers:
        assert a in s.context
    assert score(" ".join(s.answers), s.answers, s.metric) == 1.0


@pytest.mark.parametrize("value_type", ["number", "word", "uuid"])
def test_value_types(tok, value_type):
    s = _gen("niah_single", tok, 800, value_type=value_type)
    (v,) = s.answers
    pattern = {"number": r"\d{7}", "word": r"[a-z]{6}",
               "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"}
    assert re.fullmatch(pattern[value_type], v)
    assert f"is: {v}." in s.context


def test_multivalue_all_values_present_for_one_key(tok):
    s = _gen("niah_multivalue", tok, 2000, seed=5)
    (key,) = s.meta["keys"]
    assert len(s.answers) == 4 and len(set(s.answers)) == 4
    for v in s.answers:
        assert f"One of the special magic numbers for {key} is: {v}." in s.context
    assert key in s.question
    assert string_match_all(" ".join(s.answers[:3]), s.answers) == 0.75


def test_multikey_distractors_have_other_keys(tok):
    s = _gen("niah_multikey", tok, 2000, seed=6)
    keys = re.findall(r"special magic numbers for (\S+) is:", s.context)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert keys.count(s.meta["keys"][0]) == 1
    assert s.meta["keys"][0] in s.question and all(k not in s.question for k in keys if k != s.meta["keys"][0])


def test_multiquery_asks_every_key(tok):
    s = _gen("niah_multiquery", tok, 2000, seed=7)
    assert len(s.meta["keys"]) == 4 and all(k in s.question for k in s.meta["keys"])
    found = dict(re.findall(r"special magic numbers for (\S+) is: (\d+)\.", s.context))
    assert [found[k] for k in s.meta["keys"]] == s.answers


def _resolve(context):
    assign = dict(re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", context))
    order = [m.group(1) for m in re.finditer(r"VAR ([A-Z]{5}) =", context)]

    def value(name, seen=()):
        rhs = assign[name]
        if rhs.startswith("VAR "):
            ref = rhs[4:]
            assert order.index(ref) < order.index(name), "a variable is used before it is assigned"
            return value(ref, seen + (name,))
        return rhs
    return {name: value(name) for name in assign}


@pytest.mark.parametrize("seed", range(4))
def test_variable_tracking_chain_is_consistent(tok, seed):
    s = _gen("variable_tracking", tok, 3000, seed=seed, num_chains=3, num_hops=4)
    resolved = _resolve(s.context)
    value = s.meta["value"]
    assert value in s.question
    assert len(resolved) == 15
    assert sorted(n for n, v in resolved.items() if v == value) == sorted(s.answers)
    assert len(s.answers) == 5
    for chain, other in zip(s.meta["chains"][1:], s.meta["values"][1:]):
        assert other != value and all(resolved[n] == other for n in chain)


def test_common_words_top10(tok):
    s = _gen("common_words", tok, 4000, seed=2)
    words = re.findall(r"^\d+\. (\w+)$", s.context, flags=re.M)
    counts = Counter(words).most_common()
    top = {w for w, _ in counts[:10]}
    assert top == set(s.answers)
    assert counts[9][1] > counts[10][1]  # the top 10 are strictly more common than the rest
    assert [int(n) for n in re.findall(r"^(\d+)\.", s.context, flags=re.M)] == list(range(1, len(words) + 1))


@pytest.mark.parametrize("target", [500, 4000])
def test_frequent_words_top3(tok, target):
    s = _gen("frequent_words", tok, target, seed=4)
    body = s.context.split("\n\n", 1)[1]
    counts = Counter(body.split()).most_common()
    assert {w for w, _ in counts[:3]} == set(s.answers)
    assert counts[2][1] > counts[3][1]


# ------------------------------------------------------------------------------------------ determinism
def test_suite_is_deterministic_by_seed():
    a = make_suite(WordTokenizer(), 1000, 2, seed=11)
    b = make_suite(WordTokenizer(), 1000, 2, seed=11)
    c = make_suite(WordTokenizer(), 1000, 2, seed=12)
    assert [s.prompt_hash for s in a] == [s.prompt_hash for s in b]
    assert [s.answers for s in a] == [s.answers for s in b]
    assert len({s.prompt_hash for s in a}) == len(a) == 2 * len(TASKS)
    assert not {s.prompt_hash for s in a} & {s.prompt_hash for s in c}
    assert [s.task for s in a] == [n for n in TASKS for _ in range(2)]
    # a task's samples don't depend on which other tasks are in the suite
    only = make_suite(WordTokenizer(), 1000, 2, seed=11, tasks=["frequent_words"])
    assert [s.prompt_hash for s in only] == [s.prompt_hash for s in a if s.task == "frequent_words"]
    assert [s.depth for s in a if s.task == "passkey"] == [0.0, 1.0]


def test_make_suite_rejects_unknown_task(tok):
    with pytest.raises(ValueError, match="unknown task"):
        make_suite(tok, 1000, 1, 0, tasks=["nope"])


def test_word_pool_is_deterministic_and_unique():
    a = WordPool(random.Random(1)).draw(500)
    assert a == WordPool(random.Random(1)).draw(500)
    assert len(set(a)) == 500 and len({len(w) for w in a}) == 1


def test_essay_has_no_digits_and_no_repeated_sentence():
    units = essay_units()
    text = "".join(units)
    assert not re.search(r"\d", text)
    assert len(text.split()) >= 13000
    sentences = [u.strip() for u in units]
    assert len(set(sentences)) == len(sentences), [s for s, c in Counter(sentences).items() if c > 1][:3]


@pytest.fixture(scope="module")
def smollm2_tok():
    from helpers import smollm2_gguf_or_skip
    from tailorkv.models.gguf import gguf_tokenizer
    return gguf_tokenizer(smollm2_gguf_or_skip())


def _sentences(text):
    from tailorkv.engine.evaluation.haystack import split_sentences
    return [s for s in split_sentences(" ".join(text.split())) if len(s.split()) > 3]


def test_essay_is_16k_smollm2_tokens_and_8k_texts_never_repeat(smollm2_tok):
    """The corpus holds >= 16k tokens, so any 8k stretch of the (cycled) essay stream, from any start, holds
    each sentence at most once; checked on a real 8k haystack and on the 8k fidelity text."""
    from tailorkv.engine.evaluation.fidelity import fidelity_ids
    tok = smollm2_tok
    assert sum(len(tok.encode(u)) for u in essay_units()) >= 16 * 1024
    s = _gen("niah_multikey", tok, 8192, seed=1)
    body = _sentences(s.context.split("\n\n", 1)[1])
    assert len(body) > 300 and len(set(body)) == len(body)
    # the worst start: the last paragraph, so the stream wraps around to the corpus' beginning
    units = essay_units()
    last = max(i + 1 for i, u in enumerate(units[:-1]) if u.endswith("\n\n"))
    wrapped = "".join(Filler(units, last).take(7500))
    assert len(tok.encode(wrapped)) >= 8192
    body = _sentences(wrapped)
    assert len(set(body)) == len(body)
    text = _sentences(tok.decode(fidelity_ids(tok, 8192)))
    assert len(text) > 300 and len(set(text)) == len(text)


# ------------------------------------------------------------------------------------------ scoring (RULER)
def test_string_match_all():
    assert string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert string_match_all("The number is 123.", ["123", "456"]) == 0.5
    assert string_match_all("nothing here", ["123", "456", "789", "000"]) == 0.0
    assert string_match_all("KELOBI, tasumo", ["kelobi", "Tasumo", "ziraru"]) == pytest.approx(2 / 3)
    assert string_match_all("  abc\x00def  ", ["abc", "def"]) == 1.0  # control characters don't glue words


def test_string_match_part():
    assert string_match_part("The answer is Paris.", ["paris", "Lyon"]) == 1.0
    assert string_match_part("The answer is PARIS", ["Paris"]) == 1.0
    assert string_match_part("No idea", ["Paris", "Lyon"]) == 0.0
    assert string_match_part("Lyon and Paris", ["Paris", "Lyon", "Nice"]) == 1.0  # max, not a fraction
    assert string_match_part("12345", ["1234"]) == 1.0  # substring containment, as in RULER


def test_score_dispatch():
    assert score("a b", ["a", "c"], "all") == 0.5
    assert score("a b", ["a", "c"], "part") == 1.0
    with pytest.raises(ValueError):
        score("a", ["a"], "exact")
    with pytest.raises(ValueError):
        string_match_all("a", [])

"""The prompts `tailorkv eval` feeds: the user message (question placement), the chat template, the answer prefix,
and the samples of every length fitted so that template + prompt + answer fit in the length (RULER).

- The user message is ``context + question`` (``after``, RULER's placement: the question starts with a blank
  line) or ``question.strip() + "\\n\\n" + context + question`` (``both``: before and after the long text).
- It is rendered with the model's chat template, then the sample's answer_prefix is appended to the assistant
  turn, so the model continues e.g. "The pass key is ...". BOS is prepended only when the tokenizer wants one
  and the template does not write it (as engine.chat.ChatSession does).
- Each task's text is fitted to at most L - max_new - overhead, where overhead (template, the question stated
  first, the answer prefix) is measured on a probe sample of that task at that length; a sample whose own
  overhead is larger (a longer key or question) is fitted again to a target shorter by the excess.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

from tailorkv.engine.errors import InputError
from tailorkv.engine.evaluation.tasks import Sample, make_sample
from tailorkv.models.tokenizer import bos_prefix


def user_message(sample: Sample, question: str = "after") -> str:
    """The long text and the question: after it (RULER), or before and after it ('both')."""
    if question == "after":
        return sample.context + sample.question
    if question == "both":
        return sample.question.strip() + "\n\n" + sample.context + sample.question
    raise InputError(f"--question {question}: use after or both")


def render_prompt(tokenizer, sample: Sample, question: str = "after") -> str:
    """Chat-templated user message, then the answer prefix at the start of the assistant turn."""
    msg = [{"role": "user", "content": user_message(sample, question)}]
    if hasattr(tokenizer, "apply_chat_template"):
        text = tokenizer.apply_chat_template(msg, add_generation_prompt=True)
    else:  # a bare test tokenizer
        text = f"user: {msg[0]['content']}\nassistant: "
    return text + sample.answer_prefix


def prompt_ids(tokenizer, sample: Sample, question: str = "after") -> list[int]:
    return bos_prefix(tokenizer) + tokenizer.encode(render_prompt(tokenizer, sample, question))


def build_suites(tokenizer, plan, lengths: Iterable[int] | None = None) -> dict[int, list[Sample]]:
    """The samples of each length, identical for every method: per task, the text is fitted so that the
    rendered prompt plus the task's max new tokens fit in the length (overhead measured on a probe sample, then
    each sample refitted while it overruns). The suite is ordered like make_suite's: tasks in plan order,
    samples_per_task each."""
    out: dict[int, list[Sample]] = {}
    if not plan.samples:
        return out
    for n in (plan.lengths if lengths is None else lengths):
        suite: list[Sample] = []
        for task in plan.tasks:
            room = n - plan.max_new(task)
            if room < 16:
                raise InputError(f"--lengths {n} leaves no room for {task}: its {plan.max_new(task)} new tokens "
                                 f"take nearly all of it: use a longer length or fewer --max-new-tokens")
            try:
                probe = make_sample(tokenizer, room, task, 0, 1, plan.seed)
            except InputError as e:
                raise InputError(f"--lengths {n} is too short: {e}") from None
            overhead = len(prompt_ids(tokenizer, probe, plan.question)) - probe.n_tokens
            if room - overhead < 16:
                raise InputError(f"--lengths {n} leaves no room for {task}: the prompt template and "
                                 f"{plan.max_new(task)} new tokens need more; use a longer length")
            suite += [_fitted(tokenizer, plan, n, task, i, room - overhead) for i in range(plan.samples)]
        out[n] = suite
    return out


def _fitted(tokenizer, plan, n: int, task: str, index: int, target: int) -> Sample:
    """Sample `index` of `task` whose rendered prompt and max new tokens take at most the length n."""
    room = n - plan.max_new(task)
    for _ in range(8):
        try:
            s = make_sample(tokenizer, target, task, index, plan.samples, plan.seed)
        except InputError as e:
            raise InputError(f"--lengths {n} is too short: {e}") from None
        excess = len(prompt_ids(tokenizer, s, plan.question)) - room
        if excess <= 0:
            return s
        target -= excess
    raise AssertionError(f"{task} sample {index}: its prompt still overruns {room} tokens after 8 refits")


def suite_hash(suites: dict[int, list[Sample]], question: str = "after") -> str:
    """Identifies the prompts: every sample's text and the question placement."""
    h = hashlib.sha256(f"question={question};".encode())
    for n in sorted(suites):
        for s in suites[n]:
            h.update(f"{n}:{s.task}:{s.prompt_hash};".encode())
    return h.hexdigest()[:16]

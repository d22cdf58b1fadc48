"""The chat as a person meets it: `tailorkv run` in a pseudo-terminal with the default sampling settings (a fixed
seed), three turns typed at its prompt. It recalls the name given in turn 1 and never loops on a sentence."""
import contextlib
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from helpers import smollm2_gguf_or_skip

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = ">>> "
TURNS = ["Hi! My name is Zorbak and my favourite number is 417.",
         "Tell me one short fact about the Moon.",
         "What is my name?"]


class Terminal:
    """A child process on a pseudo-terminal: type lines, read until the prompt comes back."""

    def __init__(self, args: list[str], env: dict):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self.seen = ""

    def read_until(self, marker: str, timeout: float) -> str:
        start, end = len(self.seen), time.monotonic() + timeout
        while marker not in self.seen[start:]:
            left = end - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                raise AssertionError(f"no {marker!r} within {timeout} s; the screen so far:\n{self.seen[-3000:]}")
            ready, _, _ = select.select([self.master], [], [], min(left, 1.0))
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode("utf-8", "replace")
                except OSError:  # the child closed the terminal
                    pass
        i = self.seen.index(marker, start)
        return self.seen[start:i]

    def type(self, line: str) -> None:
        data = (line + "\n").encode()
        while data:
            data = data[os.write(self.master, data):]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.master)


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r", "")


def sentences(text: str) -> list[str]:
    return [s.strip().lower() for s in re.split(r"(?<=[.!?])\s+|\n+", text) if len(s.strip()) > 3]


@contextlib.contextmanager
def chat(*flags: str):
    """`tailorkv run` on SmolLM2 in a pseudo-terminal, past its banner (yielded with it); /exit ends it cleanly."""
    smollm2_gguf_or_skip()
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), TERM="xterm", COLUMNS="200")
    term = Terminal([sys.executable, "-m", "tailorkv.cli", "run", "--device", "cpu", *flags], env)
    try:
        yield term, term.read_until(PROMPT, 180)
        term.type("/exit")
        assert term.proc.wait(timeout=30) == 0
    finally:
        term.close()


@pytest.mark.slow
def test_three_turn_chat_recalls_the_name_and_does_not_loop():
    with chat("--seed", "7", "-n", "48") as (term, banner):
        assert "temp 0.2, top-k 40, top-p 0.9, min-p 0.05, repeat-penalty 1.1 over 64" in plain(banner)
        answers = []
        for text in TURNS:
            term.type(text)
            screen = plain(term.read_until(PROMPT, 120))
            assert "error" not in screen.lower(), screen
            answer = screen.split(text, 1)[-1].rsplit("prefill ", 1)[0].strip()
            answers.append(answer)
            for s in set(sentences(answer)):
                assert sentences(answer).count(s) <= 2, f"'{s}' repeated in: {answer}"
        assert "zorbak" in answers[2].lower(), answers


@pytest.mark.slow
def test_a_pasted_line_longer_than_the_terminals_own_line_limit_arrives_whole():
    """A terminal's line editing keeps 4095 bytes of a line; the chat reads through readline, which keeps all."""
    with chat("--temp", "0", "-n", "2") as (term, _):
        term.type("apple " * 1500 + "What is the capital of France?")
        screen = plain(term.read_until(PROMPT, 300))
        prefill = re.search(r"prefill (\d+) tok", screen)
        assert prefill and int(prefill.group(1)) > 1500, screen[-2000:]

"""Multi-turn chat over one Engine: the cache is kept across turns, so a turn prefills only its new tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tailorkv.engine.errors import InputError
from tailorkv.engine.generate import Engine, TurnStats
from tailorkv.models.tokenizer import bos_prefix


class StopText:
    """The answer as it streams, cut at the first stop string (llama.cpp's and vLLM's rule: the stop string and
    what follows are neither shown nor kept). Text that could be the start of a stop string waits for the next
    piece before it is shown."""

    def __init__(self, stop: tuple[str, ...], on_text: Callable[[str], None] | None):
        self.stop, self.on_text, self.text, self.shown = stop, on_text, "", 0

    def push(self, piece: str) -> bool:
        """Adds a decoded piece; True once a stop string has appeared."""
        self.text += piece
        cut = self._cut()
        self._show(len(self.text) - self._pending() if cut is None else cut)
        return cut is not None

    def finish(self) -> str:
        """The answer: everything before the first stop string, all of it shown."""
        cut = self._cut()
        end = len(self.text) if cut is None else cut
        self._show(end)
        return self.text[:end]

    def _cut(self) -> int | None:
        found = [i for i in (self.text.find(x) for x in self.stop) if i >= 0]
        return min(found) if found else None

    def _pending(self) -> int:
        """The longest end of the text that begins some stop string."""
        return max((n for x in self.stop for n in range(min(len(x) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(x[:n])), default=0)

    def _show(self, end: int) -> None:
        if end > self.shown:
            piece, self.shown = self.text[self.shown:end], end  # first: a Ctrl-C inside on_text shows it once
            if self.on_text:
                self.on_text(piece)


@dataclass
class ChatSession:
    engine: Engine
    system: str | None = None
    use_template: bool = True
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if self.system is not None:  # "" too: an empty system message, in place of a template's default one
            self.messages.append({"role": "system", "content": self.system})

    def render(self, messages: list[dict]) -> str:
        tok = self.engine.tokenizer
        if not self.use_template:
            return "".join(m["content"] for m in messages if m["role"] != "system")
        from jinja2.exceptions import TemplateError
        try:
            return tok.apply_chat_template(messages, add_generation_prompt=True)
        except TemplateError as e:  # the template's own raise_exception: what it says of the conversation
            fix = "restart without --system, or with --no-chat-template" \
                if any(m["role"] == "system" for m in messages) else "restart with --no-chat-template"
            raise InputError(f"the model's chat template refuses this conversation ({e}): {fix}") from None

    def new_ids(self, text: str) -> list[int]:
        """Token ids to feed after what the cache holds so that it holds `text`. The cache's text is derived
        from its token ids; when the new text does not extend it, the cache is rebuilt from scratch."""
        tok = self.engine.tokenizer
        held = tok.decode(self.engine.tokens) if self.engine.tokens else ""
        if held and text.startswith(held):
            return tok.encode(text[len(held):])
        self.engine.reset()
        return bos_prefix(tok) + tok.encode(text)

    def send(self, user_text: str, max_new_tokens: int = 512, stop: tuple[str, ...] = (),
             on_text: Callable[[str], None] | None = None) -> tuple[str, TurnStats]:
        """One turn. On KeyboardInterrupt the partial answer is kept in the history and the cache repaired; on
        any other error the turn is dropped from the history (the earlier turns stay) and the cache repaired."""
        tok = self.engine.tokenizer
        pending = self.messages + [{"role": "user", "content": user_text}]
        ids = self.new_ids(self.render(pending))
        self.engine.check_fits(len(ids))  # before touching history: a too-long prompt loses nothing
        self.messages = pending
        decoder = tok.stream()
        answer = StopText(stop, on_text)

        def on_token(t: int) -> bool:
            s = decoder.push(t)
            return answer.push(s) if s else False

        try:
            out, stats = self.engine.generate(ids, max_new_tokens, on_token)
        except KeyboardInterrupt:
            self.engine.recover()
            self.messages.append({"role": "assistant", "content": self._answer(decoder, answer)})
            raise
        except Exception:  # out of memory, a failing kernel: the turn is dropped, the conversation kept
            self.messages = pending[:-1]
            try:
                self.engine.recover()
            except Exception:
                self.engine.reset()  # the next turn prefills the whole conversation again
            raise
        text = self._answer(decoder, answer)
        self.messages.append({"role": "assistant", "content": text})
        if stats.stop == "stop string":
            self._drop_stopped_tokens(out[:-1], text)
        return text, stats

    def _drop_stopped_tokens(self, fed: list[int], text: str) -> None:
        """After a stop string the cache holds the answer's tokens but the last; those that ran past the text kept
        (a stop string over several tokens) go too, so that the next turn extends the cache."""
        keep = len(fed)
        while keep and not text.startswith(self.engine.tokenizer.decode(fed[:keep])):
            keep -= 1
        if keep < len(fed):
            self.engine.rewind(len(self.engine.tokens) - (len(fed) - keep))

    @staticmethod
    def _answer(decoder, answer: StopText) -> str:
        rest = decoder.flush()
        if rest:
            answer.push(rest)
        return answer.finish()

    def reset(self) -> None:
        self.engine.reset()
        self.messages = [m for m in self.messages if m["role"] == "system"]

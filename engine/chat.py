"""Multi-turn chat over one Engine: the cache is kept across turns, so a turn prefills only its new tokens."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from tailorkv.engine.generate import Engine, TurnStats
from tailorkv.models.tokenizer import bos_prefix


@dataclass
class ChatSession:
    engine: Engine
    system: str | None = None
    use_template: bool = True
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if self.system:
            self.messages.append({"role": "system", "content": self.system})

    def render(self, messages: list[dict]) -> str:
        tok = self.engine.tokenizer
        if not self.use_template:
            return "".join(m["content"] for m in messages if m["role"] != "system")
        return tok.apply_chat_template(messages, add_generation_prompt=True)

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
        pieces: list[str] = []

        def on_token(t: int) -> bool:
            s = decoder.push(t)
            if s:
                pieces.append(s)
                if on_text:
                    on_text(s)
            return bool(stop) and any(x in "".join(pieces) for x in stop)

        try:
            _, stats = self.engine.generate(ids, max_new_tokens, on_token)
        except KeyboardInterrupt:
            self.engine.recover()
            self.messages.append({"role": "assistant", "content": self._answer(pieces, decoder, stop, on_text)})
            raise
        except Exception:  # out of memory, a failing kernel: the turn is dropped, the conversation kept
            self.messages = pending[:-1]
            try:
                self.engine.recover()
            except Exception:
                self.engine.reset()  # the next turn prefills the whole conversation again
            raise
        answer = self._answer(pieces, decoder, stop, on_text)
        self.messages.append({"role": "assistant", "content": answer})
        return answer, stats

    @staticmethod
    def _answer(pieces: list[str], decoder, stop: tuple[str, ...], on_text) -> str:
        rest = decoder.flush()
        if rest:
            pieces.append(rest)
            if on_text:
                on_text(rest)
        answer = "".join(pieces)
        for x in stop:
            if x in answer:
                answer = answer[:answer.index(x)]
        return answer

    def reset(self) -> None:
        self.engine.reset()
        self.messages = [m for m in self.messages if m["role"] == "system"]

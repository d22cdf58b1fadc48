"""Prefill and decode over one ModelCache: the token loop, stop conditions and per-turn timing."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from tailorkv.engine.cache import ModelCache
from tailorkv.engine.errors import InputError
from tailorkv.engine.runner import Runner
from tailorkv.engine.sampling import Sampler, SamplingParams


class ContextTooLong(InputError):
    pass


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    new_tokens: int = 0
    decode_s: float = 0.0
    stop: str = ""

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s else 0.0


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """One model, one cache, its runner, and the token ids the cache holds (`tokens`)."""

    def __init__(self, loaded, cache: ModelCache, sampling: SamplingParams | None = None,
                 use_cuda_graph: bool = True):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.cache = cache
        self.runner = Runner(self.model, cache, use_cuda_graph)
        self.device = self.runner.device
        self.sampling = sampling or SamplingParams()
        self.sampler = Sampler(self.sampling, self.device)
        self.tokens: list[int] = []
        self.rewind_emptied = False  # the last rewind could not cut the cache and emptied it
        self.eos_ids = set(loaded.cfg.eos_ids) | set(getattr(self.tokenizer, "eos_ids", []) or [])

    @property
    def max_len(self) -> int:
        return self.cache.max_len

    def reset(self) -> None:
        self.cache.reset()
        self.tokens = []
        self.rewind_emptied = False

    def check_fits(self, n_new: int) -> None:
        need, model_max = len(self.tokens) + n_new, self.loaded.cfg.max_context
        if need <= self.max_len:
            return
        fixes = []
        if need <= model_max:
            fixes.append(f"raise --ctx (the model supports {model_max})")
        if self.tokens and n_new < self.max_len:
            fixes.append("/reset the chat (the conversation so far fills the rest)")
        if n_new >= self.max_len or not fixes:
            fixes.append("shorten the prompt")
        raise ContextTooLong(f"the prompt needs {need} tokens but --ctx is {self.max_len}: {' or '.join(fixes)}")

    def forward(self, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Feed ids after what the cache holds; returns logits of the last (or every) position."""
        self.check_fits(len(ids))
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        if len(ids) == 1 and not all_logits:
            logits = self.runner.decode(x)
        else:
            logits = self.runner.prefill(x, all_logits=all_logits)
        self.tokens.extend(ids)
        return logits

    def recover(self) -> None:
        """After an interrupt the cache may hold a different number of tokens than `tokens` (or a step was
        cut short inside a policy that cannot undo it): cut it back, or rebuild it from the token ids."""
        try:
            if not self.cache.intact:
                raise RuntimeError("rebuild")
            self.cache.truncate(len(self.tokens))
        except RuntimeError:
            ids, self.tokens = self.tokens, []
            self.cache.reset()
            if ids:
                self.forward(ids)

    def rewind(self, length: int) -> None:
        """Forget the tokens from `length` on; where a policy cannot (the 1/2-bit layers keep no exact copy of what
        they quantized) the cache is emptied, and the next prompt rebuilds it."""
        try:
            self.cache.truncate(length)
        except RuntimeError:
            self.reset()
            self.rewind_emptied = True
            return
        del self.tokens[length:]

    def generate(self, prompt_ids: list[int], max_new_tokens: int = 256,
                 on_token: Callable[[int], bool | None] | None = None) -> tuple[list[int], TurnStats]:
        """Prefill prompt_ids, then sample until EOS, max_new_tokens or the context is full.
        on_token(id) may return True to stop (a stop string was seen). EOS is not fed to the cache."""
        st = TurnStats(prompt_tokens=len(prompt_ids))
        t0 = time.perf_counter()
        logits = self.forward(prompt_ids)
        self.runner.prepare_decode()  # counted in the prefill (the time to the first token), not in the decode
        self.sampler.warm_up(logits)
        sync(self.device)
        st.prefill_s = time.perf_counter() - t0
        out: list[int] = []
        t0 = time.perf_counter()
        try:
            while True:
                tok = int(self.sampler(logits, out)[0])
                if tok in self.eos_ids:
                    st.stop = "eos"
                    break
                out.append(tok)
                if on_token is not None and on_token(tok):
                    st.stop = "stop string"  # not fed: the answer kept ends before the stop string, in this token
                    break
                if len(out) >= max_new_tokens:
                    st.stop = "length"
                    if len(self.tokens) < self.max_len:  # else the answer keeps it; the cache has no room
                        self.forward([tok])
                    break
                if len(self.tokens) + 1 > self.max_len:
                    st.stop = "context full"
                    break
                logits = self.forward([tok])
        finally:
            st.new_tokens = len(out)
            st.decode_s = time.perf_counter() - t0
        return out, st

"""Next-token choice: greedy, or temperature with top-k, top-p and min-p, after a repetition penalty over the
last n tokens, from a seeded generator.

Where the defaults come from (first that applies): the flag, the model's generation_config.json (or a GGUF's
general.sampling.* metadata), the defaults llama.cpp users know (LLAMA_CPP_DEFAULTS)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence

import torch

from tailorkv.engine.errors import InputError

# repeat_penalty: llama.cpp's default until 2024 (and Ollama's); here it looks at the answer being written only,
# so that copying a name from the conversation is not penalized (on SmolLM2 a penalty over the prompt turned
# "Zorbak" into "Zabrak" in 7 of 8 seeds).
LLAMA_CPP_DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, repeat_last_n=64)

# generation_config.json keys -> our fields (transformers' names)
HF_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
           "repetition_penalty": "repeat_penalty"}
# GGUF metadata (llama.cpp's general.sampling.*) -> our fields
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
             "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repeat_penalty",
             "general.sampling.penalty_last_n": "repeat_last_n"}


EXAMPLES = {"temperature": "0.7", "top_p": "0.9", "top_k": "40", "min_p": "0.05", "repeat_penalty": "1.1",
            "repeat_last_n": "64", "seed": "42"}  # the fix each error names


def _eg(name: str) -> str:
    return f"e.g. --{name.replace('_', '-')} {EXAMPLES[name]}"


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0        # 1: off
    top_k: int = 0            # 0: off
    min_p: float = 0.0        # 0: off; else drop tokens below min_p x the top token's probability
    repeat_penalty: float = 1.0  # 1: off; else llama.cpp's rule over the last repeat_last_n tokens
    repeat_last_n: int = 64   # 0: off, -1: the whole answer
    seed: int | None = None

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InputError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}: "
                                 f"{_eg(name)}")
        if self.temperature < 0:
            raise InputError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature:g}: {_eg('temperature')}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"--top-p must be in (0, 1] (1 = off), got {self.top_p:g}: {_eg('top_p')}")
        if self.top_k < 0:
            raise InputError(f"--top-k must be >= 0 (0 = off), got {self.top_k}: {_eg('top_k')}")
        if not 0 <= self.min_p < 1:
            raise InputError(f"--min-p must be in [0, 1) (0 = off), got {self.min_p:g}: {_eg('min_p')}")
        if self.repeat_penalty <= 0:
            raise InputError(f"--repeat-penalty must be > 0 (1 = off), got {self.repeat_penalty:g}: {_eg('repeat_penalty')}")
        if self.repeat_last_n < -1:
            raise InputError(f"--repeat-last-n must be >= -1 (0 = off, -1 = the whole answer), got {self.repeat_last_n}: "
                             f"{_eg('repeat_last_n')}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            raise InputError(f"--seed must be in 0 .. 2^63 - 1, got {self.seed}: {_eg('seed')}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        """'temp 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat-penalty 1.1 over 64' (what is on)."""
        parts = ["greedy" if self.greedy else f"temp {self.temperature:g}"]
        if not self.greedy:
            parts += [f"top-k {self.top_k}"] if self.top_k else []
            parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
            parts += [f"min-p {self.min_p:g}"] if self.min_p else []
        if self.repeat_penalty != 1 and self.repeat_last_n:
            n = "all" if self.repeat_last_n < 0 else self.repeat_last_n
            parts.append(f"repeat-penalty {self.repeat_penalty:g} over {n}")
        if self.seed is not None:
            parts.append(f"seed {self.seed}")
        return ", ".join(parts)


def model_defaults(model_file: dict) -> dict:
    """Sampling values a model ships: the fields named in its generation_config.json (or GGUF metadata, keys
    as in GGUF_KEYS). do_sample false means greedy."""
    out = {}
    for key, name in {**HF_KEYS, **GGUF_KEYS}.items():
        if model_file.get(key) is not None:
            out[name] = model_file[key]
    if model_file.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def resolve(flags: dict, model_file: dict | None = None, greedy: bool = False,
            model_source: str = "the model's generation config") -> tuple[SamplingParams, str]:
    """flags: the values the user gave (None = not given). model_file: the model's sampling values (named as
    in generation_config.json). greedy: the default temperature is 0 (one-shot -p). Returns the parameters
    and where the defaults came from."""
    base = dict(LLAMA_CPP_DEFAULTS)
    known = {f.name for f in fields(SamplingParams)}
    given = {k: v for k, v in flags.items() if v is not None and k in known}
    shipped = {k: v for k, v in model_defaults(model_file or {}).items() if k not in given}
    base.update(shipped)
    if greedy:
        base["temperature"] = 0.0
    p = SamplingParams(**{k: v for k, v in {**base, **given}.items() if k in known})
    p.validate()
    unused = {"seed"} | ({"top_k", "top_p", "min_p"} if p.greedy else set())  # no effect: not named as sources
    overridden = {"temperature"} if greedy else set()  # by the one-shot's greedy default, not the model's
    flagged, from_model = sorted(set(given) - unused), sorted(set(shipped) - unused - overridden)
    parts = [f"{', '.join(flagged)} from the flags"] if flagged else []
    parts += [f"{', '.join(from_model)} from {model_source}"] if from_model else []
    source = ", ".join(parts + ["the rest llama.cpp defaults" if parts else "llama.cpp defaults"])
    return p, source


class Sampler:
    def __init__(self, params: SamplingParams, device):
        self.p = params
        self.gen = torch.Generator(device=device)
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()
        self.warm = False

    def warm_up(self, logits: torch.Tensor) -> None:
        """Run every op of a choice once, with a scratch generator (the seeded draws are untouched): on a GPU
        their kernels load at first use, which would otherwise land in the first token's time."""
        if self.warm:
            return
        self.warm = True
        seeded, self.gen = self.gen, torch.Generator(device=self.gen.device)
        try:
            self(logits, [0])
        finally:
            self.gen = seeded

    def penalize(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """llama.cpp's repetition penalty: each distinct token of the last n of `history` (the answer so far)
        has its logit divided by the penalty when positive, multiplied when negative. The ids reach the GPU
        from pinned memory without a host sync: choosing a token stays queued behind the step that makes its
        logits (with a sync here and a mask on the device, the penalty cost 1.1 ms per token on an H200)."""
        p, n = self.p.repeat_penalty, self.p.repeat_last_n
        if p == 1 or n == 0 or not history:
            return logits
        recent = history if n < 0 else history[-n:]
        ids = torch.tensor(sorted({t for t in map(int, recent) if 0 <= t < logits.shape[-1]}), dtype=torch.long)
        if logits.device.type == "cuda":
            ids = ids.pin_memory().to(logits.device, non_blocking=True)
        picked = logits.index_select(-1, ids)
        big = torch.finfo(logits.dtype).max  # a penalty far from 1 may overflow: inf - inf would be NaN below
        return logits.clone().index_copy_(-1, ids, torch.where(picked > 0, picked / p, picked * p).clamp(-big, big))

    def __call__(self, logits: torch.Tensor, history: Sequence[int] = ()) -> torch.Tensor:
        """logits [B, V] (float) -> token ids [B]. history: the answer's tokens so far (for the penalty)."""
        logits = self.penalize(logits.float(), history)
        if self.p.temperature < torch.finfo(logits.dtype).tiny:  # greedy, or a temperature that fp32 rounds to 0
            return logits.argmax(-1)
        logits = (logits - logits.amax(-1, keepdim=True)) / self.p.temperature  # <= 0: a tiny temperature gives -inf
        k = min(self.p.top_k or logits.shape[-1], logits.shape[-1])
        vals, order = torch.topk(logits, k, dim=-1)  # sorted, largest first: top-p and min-p work on these
        probs = vals.softmax(-1)
        if self.p.top_p < 1:
            vals = vals.masked_fill(probs.cumsum(-1) - probs > self.p.top_p, float("-inf"))  # smallest set >= top_p
        if self.p.min_p:
            vals = vals.masked_fill(probs < self.p.min_p * probs[..., :1], float("-inf"))
        pick = torch.multinomial(vals.softmax(-1), 1, generator=self.gen)
        return order.gather(-1, pick).squeeze(-1)

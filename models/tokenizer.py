"""Tokenizer: a `tokenizers` BPE built from GGUF metadata or read from an HF folder, plus chat templates
and streaming decode."""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Callable, Iterable

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _BackendTokenizer

from tailorkv.models.errors import LoadError, UnsupportedModel

# Tokens that end an assistant turn in chat models; generation stops on them as on eos.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>")

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# GGUF tokenizer.ggml.token_type values
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4


def end_of_turn_ids(eos: int | list[int] | None, token_to_id: Callable[[str], int | None]) -> list[int]:
    """eos id(s) first, then the chat end-of-turn tokens the vocabulary has."""
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    ids += [token_to_id(t) for t in END_OF_TURN]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


class Tokenizer:
    """encode() never adds BOS; `add_bos` says whether the model expects one in front of a raw prompt
    (chat templates usually write it themselves)."""

    def __init__(self, backend: _BackendTokenizer, bos_id: int | None = None, eos_ids: Iterable[int] = (),
                 chat_template: str | None = None, add_bos: bool = False):
        self.backend = backend
        self.bos_id = bos_id
        self.add_bos = add_bos and bos_id is not None
        self.eos_ids = list(eos_ids)
        self.chat_template = chat_template
        self.bos_token = backend.id_to_token(bos_id) if bos_id is not None else None
        self.eos_token = backend.id_to_token(self.eos_ids[0]) if self.eos_ids else None
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def max_id(self) -> int:
        """The largest id it can give (ids may skip numbers: this, not vocab_size, bounds them)."""
        return max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)

    def encode(self, text: str) -> list[int]:
        """Special tokens written in the text (e.g. <|im_start|>) become their ids; no BOS is added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    def stream(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)

    # chat

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """Render the model's jinja2 chat template the way HF transformers does; without one,
        a plain 'role: content' transcript."""
        if not self.chat_template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            return text + ("assistant: " if add_generation_prompt else "")
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)

    # constructors

    @classmethod
    def from_gguf_metadata(cls, metadata: Callable, path: str) -> "Tokenizer":
        """metadata(key, default) reads a GGUF file's metadata (models.gguf.gguf_tokenizer passes it)."""
        def m(key, default=None):
            return metadata("tokenizer.ggml." + key, default)

        kind, tokens, types = m("model"), m("tokens"), m("token_type")
        if not tokens:
            raise LoadError(f"{path} has no tokenizer in its metadata: use a GGUF file that embeds one")
        types = types or [1] * len(tokens)
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, m("merges") or [], m("pre", "default"), path)
        elif kind == "llama":
            backend = _sentencepiece_bpe(tokens, m("scores"), types, m("unknown_token_id"),
                                         m("add_space_prefix", True))
        else:
            raise UnsupportedModel(f"{os.path.basename(path)} has a '{kind}' tokenizer: only BPE tokenizers "
                                   f"(gpt2, llama) are supported; use a Hugging Face folder with tokenizer.json")
        special = {_CONTROL, _UNKNOWN}
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty in special])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
        return cls(backend, bos_id=m("bos_token_id"),
                   eos_ids=end_of_turn_ids(m("eos_token_id"), backend.token_to_id),
                   chat_template=metadata("tokenizer.chat_template"),
                   add_bos=bool(m("add_bos_token", kind == "llama")))

    @classmethod
    def from_hf_folder(cls, folder: str) -> "Tokenizer":
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise LoadError(f"{folder} has no tokenizer.json: copy it from the model's Hugging Face repository")
        try:
            backend = _BackendTokenizer.from_file(path)
        except Exception as e:
            raise LoadError(f"{path} cannot be read ({e}): restore the file") from None
        tok_cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
        gen_cfg = _read_json(os.path.join(folder, "generation_config.json"))
        model_cfg = _read_json(os.path.join(folder, "config.json"))

        def token_id(key: str) -> int | None:
            tok = tok_cfg.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            if tok is not None and backend.token_to_id(tok) is not None:
                return backend.token_to_id(tok)
            return gen_cfg.get(f"{key}_id", model_cfg.get(f"{key}_id"))

        eos = [token_id("eos_token")]
        for cfg in (gen_cfg, model_cfg):
            extra = cfg.get("eos_token_id")
            eos += extra if isinstance(extra, list) else [extra]
        bos = token_id("bos_token")
        add_bos = tok_cfg.get("add_bos_token", backend.encode("a").ids[:1] == [bos])
        return cls(backend, bos_id=bos, eos_ids=end_of_turn_ids(eos, backend.token_to_id),
                   chat_template=_hf_chat_template(folder, tok_cfg), add_bos=bool(add_bos))


class StreamDecoder:
    """Token-by-token decoding that only ever returns complete characters.

    Text is decoded over a short window of ids (the previous chunk as context, so decoders that strip or
    merge across token boundaries stay consistent) and the new part is returned once it no longer ends
    in U+FFFD, i.e. once a multi-byte character is complete."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # ids before this are already returned

    def _new_text(self) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        now = self.tok.decode(self.ids[self.prefix:], self.skip)
        return now[len(before):]

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self._new_text()
        if not text or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text

    def flush(self) -> str:
        text = self._new_text() if self.read < len(self.ids) else ""
        self.prefix = self.read = len(self.ids)
        return text


def _jinja_env():
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise LoadError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): restore the file") from None


def _hf_chat_template(folder: str, tok_cfg: dict) -> str | None:
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = tok_cfg.get("chat_template")
    if template is None:
        template = _read_json(os.path.join(folder, "chat_template.json")).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str, path: str) -> _BackendTokenizer:
    llama3 = pre in ("llama-bpe", "llama3", "smaug-bpe")
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ", 1)) for m in merges],
                     ignore_merges=llama3)
    tok = _BackendTokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not llama3)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif llama3:
        split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre in ("default", "gpt-2", "gpt2"):
        tok.pre_tokenizer = byte_level
    else:
        raise UnsupportedModel(f"{os.path.basename(path)} uses the '{pre}' pre-tokenizer, which tailorkv does not "
                               f"know: use a Hugging Face folder with tokenizer.json for this model")
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores, types: list[int], unk_id: int | None,
                       add_space_prefix: bool) -> _BackendTokenizer:
    """Llama-2 style SentencePiece BPE: every split of a normal piece into two known pieces is a merge,
    ranked by the piece's score (higher first). Byte tokens <0xNN> serve the byte fallback."""
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = scores or [-float(i) for i in range(len(tokens))]
    merges = []
    for piece, i in vocab.items():
        if types[i] != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], vocab[left], vocab[right], left, right))
    merges.sort()
    unk = tokens[unk_id] if unk_id is not None else None
    tok = _BackendTokenizer(models.BPE(vocab, [(a, b) for *_, a, b in merges], unk_token=unk,
                                       fuse_unk=True, byte_fallback=True))
    prefix = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence(prefix + [normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return tok


def bos_prefix(tokenizer) -> list[int]:
    """[bos] when the tokenizer wants one in front of a prompt and its chat template does not write it."""
    tmpl = getattr(tokenizer, "chat_template", None) or ""
    bos_tok = getattr(tokenizer, "bos_token", None)
    bos_id = getattr(tokenizer, "bos_id", None)
    wants = getattr(tokenizer, "add_bos", False) and not (bos_tok and bos_tok in tmpl)
    return [bos_id] if wants and bos_id is not None else []

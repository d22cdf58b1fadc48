"""Tokenizer from GGUF metadata and from HF folders, checked against transformers; chat templates; streaming."""
import json
import os

import gguf
import pytest
from tokenizers import Tokenizer as BackendTokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tailorkv.models.errors import LoadError, UnsupportedModel
from tailorkv.models.gguf import gguf_tokenizer
from tailorkv.models.tokenizer import Tokenizer
from helpers import smollm2_gguf_or_skip

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n\nmany   spaces",
    "The capital of France is Paris.",
    "naïve café — résumé, Ünïcödé",
    "日本語のテキストと中文",
    "emoji 🎉🚀👍🏽 mix",
    "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "code: def f(x):\n    return x ** y  # comment",
    "I'm sure they've said we'll go, can't you?",
    "URL https://example.com/a?b=c&d=e",
    "",
]
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.", "Hello world, hello there!",
    "Long context inference with a KV cache.", "Tokenizers split text into pieces; merges join them again.",
    "the cat sat on the mat", "she sells sea shells by the sea shore", "I'm sure they've said we'll go.",
] * 3
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf_or_skip()
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return gguf_tokenizer(path), ref


def write_gguf_tokenizer(path, tokens, kind="gpt2", pre="smollm", merges=None, scores=None, types=None):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(kind)
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types or [1] * len(tokens))
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def train_byte_level(specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>")) -> BackendTokenizer:
    tok = BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


# SmolLM2 GGUF


def test_smollm2_ids_match_transformers(smollm2):
    ours, ref = smollm2
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), repr(text)
        assert ours.decode(ours.encode(text)) == text


def test_smollm2_digits_split_one_by_one(smollm2):
    ours, _ = smollm2
    ids = ours.encode(" 4827369")
    assert [ours.id_to_token(i) for i in ids] == ["Ġ", "4", "8", "2", "7", "3", "6", "9"]
    assert [ours.id_to_token(i) for i in ours.encode("year 2024")] == ["year", "Ġ", "2", "0", "2", "4"]
    assert ours.decode(ids) == " 4827369"


def test_smollm2_special_tokens(smollm2):
    ours, _ = smollm2
    start, end = ours.token_to_id("<|im_start|>"), ours.token_to_id("<|im_end|>")
    assert ours.encode("<|im_start|>") == [start] and ours.encode("<|im_end|>") == [end]
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == start and ids[-1] == end and ids.count(start) == ids.count(end) == 1
    assert (ours.bos_id, ours.eos_ids, ours.bos_token, ours.eos_token) == (1, [2], "<|im_start|>", "<|im_end|>")
    assert ours.vocab_size == 49152 and not ours.add_bos
    assert ours.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_smollm2_unicode_round_trip(smollm2):
    ours, _ = smollm2
    for text in ["🎉🚀👍🏽", "日本語のテキスト", "中文字符", "àéîõü ñ ç ß Ø", "Ω≈ç√∫˜µ≤≥÷", "mixed 🎉 日本 é"]:
        assert ours.decode(ours.encode(text)) == text


def test_smollm2_chat_template_matches_transformers(smollm2):
    ours, ref = smollm2
    for msgs in (MESSAGES, MESSAGES[1:2]):
        for gen in (True, False):
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == \
                ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def test_stream_decoder_holds_back_partial_characters(smollm2):
    ours, _ = smollm2
    text = "Hi 🎉 日本語 naïve 👍🏽 done"
    ids = ours.encode(text)
    stream = ours.stream()
    pieces = [stream.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the emoji spans several tokens: nothing is printed until it is whole
    assert "".join(pieces) + stream.flush() == ours.decode(ids) == text


def test_fallback_chat_format():
    tok = Tokenizer(train_byte_level())
    assert tok.chat_template is None
    assert tok.apply_chat_template(MESSAGES[1:3]) == "user: Hi there\nassistant: Hello!\nassistant: "
    assert tok.apply_chat_template(MESSAGES[1:2], add_generation_prompt=False) == "user: Hi there\n"


# synthetic GGUF tokenizers


@pytest.mark.parametrize("pre", ["llama-bpe", "smollm", "gpt-2"])
def test_byte_level_gguf_matches_transformers(tmp_path, pre):
    trained = json.loads(train_byte_level().to_str())
    vocab = trained["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in trained["model"]["merges"]]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    write_gguf_tokenizer(tmp_path / "t.gguf", tokens, pre=pre, merges=merges, types=types)
    ours = gguf_tokenizer(str(tmp_path / "t.gguf"))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in TEXTS + ["the lazy dog   sat\n\n  on 12345 mats"]:
        if pre == "smollm" and any(c.isdigit() for c in text):
            continue  # transformers' converter does not split digits
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), (pre, text)
    if pre == "llama-bpe":  # digits in groups of up to three
        assert [w for w, _ in ours.backend.pre_tokenizer.pre_tokenize_str("1234567")] == ["123", "456", "7"]


def spm_gguf(path):
    """A Llama-2 style SentencePiece vocabulary: specials, byte tokens, merged pieces scored by merge rank."""
    tok = BackendTokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=200, show_progress=False))
    trained = json.loads(tok.to_str())["model"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    scores, types = [0.0] * len(tokens), [2, 3, 3] + [6] * 256
    for rank, m in enumerate(trained["merges"]):
        piece = "".join(m) if isinstance(m, list) else m.replace(" ", "")
        if piece not in tokens:
            tokens.append(piece), scores.append(-float(rank)), types.append(1)
    for i, c in enumerate(t for t in trained["vocab"] if len(t) == 1):
        tokens.append(c), scores.append(-1000.0 - i), types.append(1)
    write_gguf_tokenizer(path, tokens, kind="llama", pre=None, scores=scores, types=types)


def test_sentencepiece_gguf(tmp_path):
    spm_gguf(tmp_path / "spm.gguf")
    ours = gguf_tokenizer(str(tmp_path / "spm.gguf"))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    plain = ["The quick brown fox", "hello there, the lazy cat!", "sea shells über 🎉 naïve", "a  b   c", "x\ny"]
    for text in plain:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    # llama.cpp (and Llama-2's own tokenizer.json) prepend the space to every text piece, also after a
    # special token and before leading spaces; transformers' GGUF converter does so only at the start.
    assert ours.encode("<s>the")[:2] == [1, ours.token_to_id("\u2581the")]
    assert ours.encode("  x")[:2] == [ours.token_to_id("\u2581")] * 2
    stream = ours.stream()
    ids = ours.encode("the cat 🎉 sat")
    pieces = [stream.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) + stream.flush() == "the cat 🎉 sat"


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    write_gguf_tokenizer(tmp_path / "x.gguf", ["a", "b", "ab"], pre="some-new-model", merges=["a b"])
    with pytest.raises(UnsupportedModel, match="'some-new-model' pre-tokenizer"):
        gguf_tokenizer(str(tmp_path / "x.gguf"))


# Hugging Face folder

TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}\n"
    "    {% if loop.first and message['role'] == 'system' %}\n"
    "[SYS] {{ message['content'] | trim }}\n"
    "    {% else %}\n"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "    {% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def hf_folder(path, template_file=False):
    train_byte_level().save(str(path / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
           "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True}}
    if template_file:
        (path / "chat_template.jinja").write_text(TEMPLATE)
    else:
        cfg["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))


@pytest.mark.parametrize("template_file", [False, True])
def test_hf_folder(tmp_path, template_file):
    hf_folder(tmp_path, template_file)
    ours = Tokenizer.from_hf_folder(str(tmp_path))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for text in TEXTS + ["the lazy dog sat on 12345 mats"]:
        assert ours.encode(text) == fast.encode(text, add_special_tokens=False), repr(text)
        assert ours.decode(ours.encode(text)) == text
    assert ours.bos_id == 0 and ours.bos_token == "<|endoftext|>"
    assert ours.eos_ids == [2, 0] and ours.eos_token == "<|im_end|>"
    assert ours.chat_template == TEMPLATE and not ours.add_bos
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for msgs in (MESSAGES, MESSAGES[1:2]):
        for gen in (True, False):
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == \
                ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    from jinja2.exceptions import TemplateError
    with pytest.raises(TemplateError, match="bad role"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_hf_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(LoadError, match="no tokenizer.json"):
        Tokenizer.from_hf_folder(str(tmp_path))

"""Multi-turn chat on SmolLM2: the cache is kept across turns, a turn prefills only its new tokens, and the
logits equal a fresh prefill of the whole conversation. Ctrl-C keeps the history and a usable cache."""
import pytest

from tailorkv.engine.chat import ChatSession
from tailorkv.engine.generate import Engine
from tailorkv.engine.methods import build_cache
from tailorkv.engine.settings import MethodSettings
from tailorkv.models.loader import load_model
from helpers import rel_err


@pytest.fixture(scope="module")
def smol():
    return load_model("smollm2-135m")


def new_chat(smol, method="full", **kw):
    cache = build_cache(smol, MethodSettings(method, **kw), max_len=2048)
    return ChatSession(Engine(smol, cache))


def test_second_turn_prefills_only_new_tokens(smol):
    chat = new_chat(smol)
    eng = chat.engine
    chat.send("My name is Ada and I live in Lisbon.", max_new_tokens=12)
    held = list(eng.tokens)
    seen = {}
    real_forward = eng.forward

    def spy(ids, all_logits=False):
        out = real_forward(ids, all_logits)
        if len(ids) > 1:
            seen["ids"], seen["logits"] = list(ids), out.clone()
        return out

    eng.forward = spy
    answer, stats = chat.send("What is my name?", max_new_tokens=12)
    assert stats.prompt_tokens == len(seen["ids"]) < len(held)
    assert eng.tokens[:len(held)] == held  # the first turn was not fed again
    full_text = chat.render(chat.messages[:-1])
    assert smol.tokenizer.decode(held + seen["ids"]) == full_text
    fresh = new_chat(smol).engine
    ref = fresh.forward(held + seen["ids"])
    assert rel_err(seen["logits"], ref) < 1e-4


def test_interrupt_keeps_history_and_cache(smol):
    chat = new_chat(smol)
    count = {"n": 0}

    def stop_after_three(_):
        count["n"] += 1
        if count["n"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        chat.send("Tell me a long story about a cat.", max_new_tokens=50, on_text=stop_after_three)
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    assert chat.messages[1]["content"]  # the partial answer is kept
    eng = chat.engine
    assert eng.cache.length == len(eng.tokens)
    answer, _ = chat.send("What is the capital of France?", max_new_tokens=16)
    assert "Paris" in answer


def test_context_full_keeps_history(smol):
    chat = new_chat(smol)
    chat.send("Hi!", max_new_tokens=4)
    before = [dict(m) for m in chat.messages]
    from tailorkv.engine.generate import ContextTooLong
    with pytest.raises(ContextTooLong):
        chat.send("word " * 3000)
    assert chat.messages == before


def test_a_failing_turn_keeps_the_conversation(smol):
    """Out of memory (or any error) inside a turn: that turn is dropped, the earlier ones stay, the cache is
    repaired, and the next turn answers as if the failed one never happened."""
    import torch
    chat = new_chat(smol)
    chat.send("My name is Ada.", max_new_tokens=8)
    before, held = [dict(m) for m in chat.messages], list(chat.engine.tokens)
    real = chat.engine.model.forward
    calls = {"n": 0}

    def fail_in_decode(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # the prefill and one decode step went through
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*a, **kw)

    chat.engine.model.forward = fail_in_decode
    with pytest.raises(torch.cuda.OutOfMemoryError):
        chat.send("Tell me a long story.", max_new_tokens=20)
    del chat.engine.model.forward
    assert chat.messages == before
    eng = chat.engine
    assert eng.cache.length == len(eng.tokens)
    answer, stats = chat.send("What is my name?", max_new_tokens=12)
    assert eng.tokens[:len(held)] == held or stats.prompt_tokens > len(held)  # kept, or rebuilt from the history
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]


def test_stop_strings_are_neither_shown_nor_kept():
    """llama.cpp's rule: the answer ends before the first stop string; text that may begin one waits for the
    next piece, so a stop string split over tokens never reaches the screen either."""
    from tailorkv.engine.chat import StopText
    shown = []
    s = StopText(("###", "END"), shown.append)
    assert [s.push(p) for p in ["Hello", " wor", "ld#", "#"]] == [False] * 4
    assert "".join(shown) == "Hello world"  # "##" might begin "###": held back
    assert s.push("# and more") is True
    assert s.finish() == "Hello world" and "".join(shown) == "Hello world"
    shown.clear()
    s = StopText(("###",), shown.append)
    s.push("a#")
    s.push("b")  # "#b" begins no stop string: all of it is shown
    assert s.finish() == "a#b" and "".join(shown) == "a#b"
    shown.clear()
    s = StopText((), shown.append)
    for p in ["x", "y"]:
        assert s.push(p) is False
    assert s.finish() == "xy" and shown == ["x", "y"]  # no stop strings: every piece shown as it comes

    def interrupted_while_shown(piece):
        shown.append(piece)
        raise KeyboardInterrupt
    shown.clear()
    s = StopText((), interrupted_while_shown)
    with pytest.raises(KeyboardInterrupt):
        s.push("Rome")
    s.on_text = shown.append
    assert s.finish() == "Rome" and shown == ["Rome"]  # shown once, not again when the answer is finished


@pytest.mark.parametrize("method, stop, reprefill", [
    ("full", ".", False),           # the stop string lies in the answer's last token, which is not fed
    ("full", "capital of", False),  # over two tokens: the one fed past the kept text is cut from the cache
    ("tailorkv", ".", False),
    ("tailorkv", "capital of", False),  # the 1/2-bit layers cut the token still exact in their residual
])
def test_a_turn_after_a_stop_string_prefills_only_its_own_tokens(smol, method, stop, reprefill):
    kw = dict(budget=256, sink=16, recent=32, quant_layers=[0]) if method == "tailorkv" else {}
    chat = new_chat(smol, method, **kw)
    eng = chat.engine
    answer, stats = chat.send("What is the capital of France?", max_new_tokens=24, stop=(stop,))
    assert stats.stop == "stop string" and stop not in answer
    assert eng.cache.length == len(eng.tokens)
    first = len(eng.tokens)
    _, stats = chat.send("And of Germany?", max_new_tokens=4)
    assert (stats.prompt_tokens > first) == reprefill
    assert smol.tokenizer.decode(eng.tokens).startswith(chat.render(chat.messages[:-1]))


def test_a_cache_emptied_by_a_stop_string_says_so(smol):
    """A cut the 1/2-bit layers cannot make (a token they already quantized) empties the cache: the stats line
    says why and what follows, not a bare 'KV 0/...'."""
    from tailorkv.engine.repl import kv_line
    chat = new_chat(smol, "tailorkv", budget=256, sink=16, recent=32, quant_layers=[0])
    eng = chat.engine
    eng.forward(list(range(100, 400)))  # past the 128-token key residual: the first 256 keys quantized
    eng.rewind(200)
    assert eng.tokens == [] and eng.rewind_emptied
    assert "KV 0/" in kv_line(eng) and "(emptied: the stop string ended inside tokens that the tailorkv cache " \
        "cannot drop; the next turn prefills the conversation again)" in kv_line(eng)
    eng.forward([100, 101])
    eng.reset()
    assert "emptied" not in kv_line(eng)


def test_context_full_fixes_fit_the_case(smol):
    from tailorkv.engine.generate import ContextTooLong
    eng = Engine(smol, build_cache(smol, MethodSettings("full"), max_len=64))
    with pytest.raises(ContextTooLong, match=r"needs 100 tokens but --ctx is 64: raise --ctx \(the model supports "
                                             r"8192\) or shorten the prompt$"):
        eng.check_fits(100)
    with pytest.raises(ContextTooLong, match=r"needs 9000 tokens but --ctx is 64: shorten the prompt$"):
        eng.check_fits(9000)  # beyond the model: raising --ctx cannot help
    eng.forward(list(range(10, 60)))
    with pytest.raises(ContextTooLong, match=r"needs 70 tokens .*raise --ctx .* or /reset the chat .*fills the rest\)$"):
        eng.check_fits(20)  # the history is the cause: /reset helps, shortening a 20-token line would not


def test_an_empty_system_message_replaces_the_templates_default(smol):
    """--system "": an empty system message is given, so SmolLM2's template leaves out its default one."""
    default = ChatSession(new_chat(smol).engine).render([{"role": "user", "content": "Hi"}])
    chat = ChatSession(new_chat(smol).engine, system="")
    empty = chat.render(chat.messages + [{"role": "user", "content": "Hi"}])
    assert "SmolLM" in default and "SmolLM" not in empty and "<|im_start|>system\n<|im_end|>" in empty


def test_an_answer_that_ends_at_max_new_tokens_as_the_context_fills_is_kept(smol):
    """The answer's last token (-n reached) arrives when the context has no room left for it: the turn ends by
    length with every token kept, not with 'the prompt needs N+1 tokens' dropping the whole answer."""
    chat = ChatSession(Engine(smol, build_cache(smol, MethodSettings("full"), max_len=64)), use_template=False)
    eng = chat.engine
    eng.eos_ids = set()  # the answer runs until a limit
    prompt = chat.new_ids("one two three four five six")
    eng.reset()
    n = 64 - len(prompt) + 1  # its last token would be the 65th in a 64-token context
    answer, stats = chat.send("one two three four five six", max_new_tokens=n)
    assert stats.stop == "length" and stats.new_tokens == n
    assert chat.messages[-1] == {"role": "assistant", "content": answer} and answer
    assert len(eng.tokens) == eng.cache.length == 64  # the last token is not fed: no room for it
    from tailorkv.engine.generate import ContextTooLong
    with pytest.raises(ContextTooLong):
        chat.send(" seven", max_new_tokens=4)
    assert chat.messages[-1] == {"role": "assistant", "content": answer}

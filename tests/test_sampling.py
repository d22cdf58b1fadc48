"""The sampler's filters and penalty, and where its defaults come from (flag > the model's file > llama.cpp)."""
import pytest
import torch

from tailorkv.engine.sampling import LLAMA_CPP_DEFAULTS, Sampler, SamplingParams, resolve


def draws(params, logits, n=400, history=()):
    s = Sampler(params, "cpu")
    return {int(s(logits, history)[0]) for _ in range(n)}


def test_greedy_and_repeat_penalty():
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.2]])
    p = SamplingParams(temperature=0, repeat_penalty=1.1)
    assert int(Sampler(p, "cpu")(logits)[0]) == 0
    assert int(Sampler(p, "cpu")(logits, history=[0])[0]) == 1      # 2.0 / 1.1 < 1.9
    s = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=1), "cpu")
    out = s.penalize(logits, [2, 0])  # only the last token (0) is in the window
    assert torch.allclose(out, torch.tensor([[1.0, 1.9, -1.0, -1.2]]))
    out = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=-1), "cpu").penalize(logits, [2, 0])
    assert torch.allclose(out, torch.tensor([[1.0, 1.9, -2.0, -1.2]]))  # negative logits are multiplied
    assert torch.equal(Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=0), "cpu").penalize(logits, [0]),
                       logits)


def test_penalty_skips_ids_outside_the_vocabulary_and_penalizes_every_row():
    logits = torch.tensor([[2.0, -1.0, 0.5], [1.0, 3.0, -2.0]])
    out = Sampler(SamplingParams(repeat_penalty=2.0), "cpu").penalize(logits, [1, 7, 1, -3])
    assert torch.equal(out, torch.tensor([[2.0, -2.0, 0.5], [1.0, 1.5, -2.0]]))
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5]))  # the caller's logits are left as they were


@pytest.mark.cuda
def test_choosing_a_token_queues_without_a_host_sync():
    """Only int() on the chosen token waits for the GPU (a sync inside cost 1.1 ms per token on an H200)."""
    logits = torch.randn(1, 128256, device="cuda")
    s = Sampler(resolve({"seed": 0})[0], "cuda")
    s(logits, [5, 9, 5])  # first call: lazy initialization may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tok = s(logits, [5, 9, 5, 11])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert 0 <= int(tok[0]) < 128256


def test_warm_up_leaves_the_seeded_draws_as_they_were():
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0, top_k=40, repeat_penalty=1.1, seed=3)
    a, b = Sampler(p, "cpu"), Sampler(p, "cpu")
    a.warm_up(logits)
    assert a.warm and [int(a(logits, [1])[0]) for _ in range(20)] == [int(b(logits, [1])[0]) for _ in range(20)]


def test_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert draws(SamplingParams(temperature=1, top_k=2, seed=0), logits) == {0, 1}
    assert draws(SamplingParams(temperature=1, top_p=0.7, seed=0), logits) == {0, 1}    # 0.5 + 0.3 reach 0.7
    assert draws(SamplingParams(temperature=1, min_p=0.25, seed=0), logits) == {0, 1, 2}  # 0.15 >= 0.125
    assert draws(SamplingParams(temperature=1, seed=0), logits) == {0, 1, 2, 3}


@pytest.mark.parametrize("params, history, expected", [
    (dict(temperature=1e-40), [], 0),
    (dict(temperature=1e-300), [], 0),
    (dict(temperature=0.5, repeat_penalty=1e-300), [1], 1),  # a penalty below 1 favours the tokens seen
])
def test_values_that_push_logits_past_fp32_still_sample(params, history, expected):
    """A tiny temperature or penalty sends the top logits to inf: that token is chosen (inf - inf used to give NaN
    probabilities, and torch.multinomial a traceback)."""
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.2]])
    assert draws(SamplingParams(seed=0, **params), logits, n=20, history=history) == {expected}


def test_seed_repeats():
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0, seed=3)
    a, b = Sampler(p, "cpu"), Sampler(p, "cpu")
    assert [int(a(logits)[0]) for _ in range(20)] == [int(b(logits)[0]) for _ in range(20)]


def test_defaults_come_from_flags_then_model_then_llama_cpp():
    p, source = resolve({})
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05) and source == "llama.cpp defaults"
    assert p.repeat_penalty == LLAMA_CPP_DEFAULTS["repeat_penalty"] and p.repeat_last_n == 64
    model = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05, "bos_token_id": 1}
    p, source = resolve({}, model)
    assert (p.temperature, p.top_p, p.repeat_penalty, p.top_k) == (0.6, 0.9, 1.05, 40)
    assert "temperature" in source and "llama.cpp" in source
    p, source = resolve({"temperature": 1.2, "top_k": 5, "seed": 3}, model)
    assert (p.temperature, p.top_k, p.top_p) == (1.2, 5, 0.9)
    assert source == ("temperature, top_k from the flags, repeat_penalty, top_p from the model's generation config, "
                      "the rest llama.cpp defaults")  # each value credited to where it came from
    assert resolve({}, {"do_sample": False, "temperature": 0.6})[0].greedy
    assert resolve({}, model, greedy=True)[0].greedy and not resolve({"temperature": 0.5}, model, greedy=True)[0].greedy
    # greedy: the model's top_p and temperature take no part, so they are not named as where values came from
    assert resolve({"temperature": 0}, model)[1] == ("temperature from the flags, repeat_penalty from the model's "
                                                     "generation config, the rest llama.cpp defaults")
    assert resolve({}, model, greedy=True)[1] == ("repeat_penalty from the model's generation config, the rest "
                                                  "llama.cpp defaults")
    assert resolve({"temperature": 0.5}, model, greedy=True)[1].startswith("temperature from the flags, "
                                                                            "repeat_penalty, top_p from the model's")
    p, _ = resolve({}, {"general.sampling.temp": 0.3, "general.sampling.penalty_last_n": 32})  # GGUF metadata
    assert (p.temperature, p.repeat_last_n) == (0.3, 32)


@pytest.mark.parametrize("flags, message", [
    ({"temperature": -0.1}, "--temperature"), ({"top_p": 1.5}, "--top-p"), ({"top_k": -1}, "--top-k"),
    ({"min_p": -0.1}, "--min-p"), ({"repeat_penalty": 0}, "--repeat-penalty"), ({"repeat_last_n": -2}, "--repeat-last-n"),
])
def test_bad_values(flags, message):
    with pytest.raises(ValueError, match=message):
        resolve(flags)

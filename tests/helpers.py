"""Shared test helpers: tiny random Llama checkpoints (with or without transformers), results-file checks."""
import os
import random

import pytest
import torch

# the seed of every test's random inputs: fresh per run, shown beside each failure (conftest); TAILORKV_SEED replays
SEED = int(os.environ.get("TAILORKV_SEED", random.randrange(2**31)))


def assert_one_line_error(res, *needles):
    """A user error as the CLI must show it: a non-zero exit, no traceback, and one line `error: ...` naming
    the cause and the fix, after at most the load progress lines (`loading ...` and the load line)."""
    text = res.output
    assert res.exit_code != 0, text
    assert "Traceback" not in text and res.exc_info[0] is SystemExit, text
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error:"), text
    assert all(line.startswith("loading ") or " parameters, " in line for line in lines[:-1]), text
    for n in needles:
        assert n in lines[-1], text


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any() and not torch.isnan(b).any(), "NaN"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def smollm2_gguf_or_skip() -> str:
    """The SmolLM2 GGUF's path, or skip the test with the loader's reason."""
    from tailorkv.models.errors import LoadError
    from tailorkv.models.loader import smollm2_gguf_path
    try:
        return smollm2_gguf_path()
    except LoadError as e:
        pytest.skip(str(e))


def write_tiny_hf(folder, *, seed=0, vocab=300, tie=False, rope_scaling="llama3", n_layers=3):
    from transformers import LlamaConfig, LlamaForCausalLM
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64} if rope_scaling == "llama3" else None
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=n_layers,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                      rope_theta=10000.0, rope_scaling=scaling, tie_word_embeddings=tie, rms_norm_eps=1e-5,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def write_tiny_folder(folder, *, hidden=64, n_layers=3, n_heads=8, n_kv=2, head_dim=8, vocab=300, max_pos=1024,
                      seed=0, std=0.15, chat_template=None):
    """A tiny HF folder without transformers: config.json, model.safetensors (random Llama), a byte-level
    tokenizer.json and, with chat_template, a tokenizer_config.json."""
    import json
    import os

    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tailorkv.models.config import ModelConfig
    from tailorkv.models.llama import Llama

    os.makedirs(folder, exist_ok=True)
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
          "intermediate_size": 96, "num_hidden_layers": n_layers, "num_attention_heads": n_heads,
          "num_key_value_heads": n_kv, "head_dim": head_dim, "vocab_size": vocab,
          "max_position_embeddings": max_pos, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    torch.manual_seed(seed)
    model = Llama(ModelConfig.from_hf(hf))
    params = dict(model.named_parameters())
    tensors = {}
    for name in model.checkpoint_names():  # HF names: q_proj, k_proj, ... (the model stacks some of them)
        slot = model.checkpoint_slot(name)
        like = params[slot[0]][slot[1]:slot[2]] if slot else params[name]
        tensors[name] = (torch.ones_like(like) if name.endswith("norm.weight") else torch.randn_like(like) * std)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(os.path.join(folder, "tokenizer.json"))
    if chat_template is not None:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": chat_template}, f)
    return folder


def load_json_strict(path):
    """A results file, failing on NaN or Infinity."""
    import json

    def no_nan(name):
        raise AssertionError(f"{name} in {path}")
    with open(path) as f:
        return json.load(f, parse_constant=no_nan)


def check_png(path):
    import os
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 1000, path


def prefill_then_decode(loaded, ids, n_prompt):
    """Logits [T, V] of ids [1, T] from our model with the full cache: the first n_prompt tokens in one prefill,
    then one cached decode step per token."""
    from tailorkv.engine.methods import build_cache
    from tailorkv.engine.settings import MethodSettings
    from tailorkv.engine.runner import Runner
    runner = Runner(loaded.model, build_cache(loaded, MethodSettings("full"), max_len=ids.shape[1]))
    got = [runner.prefill(ids[:, :n_prompt], all_logits=True)[0]]
    for t in range(n_prompt, ids.shape[1]):
        got.append(runner.decode(ids[:, t:t + 1]).clone())
    return torch.cat(got)


class One:
    """One cache policy driven the way the model cache drives it (plan, run, commit around each call), with
    the old single-layer surface: attend(q, k, v, start) goes back to `start` first when it is behind."""

    def __init__(self, policy):
        from tailorkv.engine.cache import ModelCache
        self.policy = policy
        self.mc = ModelCache([policy])

    def attend(self, q, k, v, start, q_hat=None):
        """q_hat: a predicted query handed to the policy inside the step, as the layer before would."""
        if start < self.mc.length:
            self.mc.truncate(start)
        assert start == self.mc.length, (start, self.mc.length)
        step = self.mc.begin(k.shape[2])
        if q_hat is not None:
            self.policy.predict_query(q_hat)
        out = self.mc.attend(0, q, k, v, step)
        self.mc.finish(step)
        return out

    @property
    def length(self):
        return self.mc.length

    def truncate(self, length):
        self.mc.truncate(length)

    def reset(self):
        self.mc.reset()

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def __setattr__(self, name, value):
        if name in ("policy", "mc"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.policy, name, value)


def random_keys(g, B, H, T, D, bits, device, sketch=False):
    """Packed keys of T tokens (a multiple of 32 / bits; any T for a sketch) in quantize_keys' layout, or in
    quantize_sketch's: quantized real data for the whole groups, then random codes, scales and mins for a
    partial group."""
    from tailorkv.ops.quant import codes_per_word, quantize_keys, quantize_sketch
    Tq = T - T % 64
    k = torch.randn(B, H, Tq, D, generator=g) * torch.exp(torch.randn(D, generator=g))
    kc, ks, km = (quantize_sketch if sketch else quantize_keys)(k, bits, 64)
    if T > Tq:
        rows = T - Tq if sketch else (T - Tq) // codes_per_word(bits)   # a token's row / a word row per CPW tokens
        extra = torch.randint(-2**31, 2**31, (B, H, rows, kc.shape[3]), generator=g, dtype=torch.int64)
        kc = torch.cat([kc, extra.to(torch.int32)], 2)
        ks = torch.cat([ks, torch.rand(B, H, 1, D, generator=g).half()], 2)
        km = torch.cat([km, -torch.rand(B, H, 1, D, generator=g).half()], 2)
    return kc.to(device), ks.to(device), km.to(device)


def lowest_ties_topk(scores, k):
    """The SET of the k largest, ties at the k-th value broken by the lowest index, ascending (on the CPU)."""
    _, perm = torch.sort(-scores.double().cpu(), dim=-1, stable=True)
    return perm[..., :k].sort(-1).values


# a chat template in the tiny checkpoints of the eval tests: roles as tags
TAG_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")


def invoke_eval(*args):
    """The eval commands (eval, eval-merge, eval-compare) run through click's test runner."""
    import click
    from click.testing import CliRunner
    from tailorkv.engine.evaluation.command import register

    @click.group()
    def group():
        pass
    register(group)
    return CliRunner().invoke(group, list(args))

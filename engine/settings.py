"""Method settings: the one place for the defaults of every cache policy (the paper's, where it has them)."""
from __future__ import annotations

from dataclasses import dataclass, field, asdict

from tailorkv.engine.errors import InputError
from tailorkv.ops.select_rules import CHANNEL_RULES

METHODS = ("full", "tailorkv", "offload", "streamingllm", "snapkv", "quest")
SELECT_MODES = ("channels", "sketch", "sketch-ahead")  # where a sparse layer's approximate scores come from
SKETCH_BITS = (1, 2, 4)                 # the key sketch's precision
KT_BITS = (16, 8)                       # the K^T store's precision (8: e4m3, a power-of-two scale per channel)
PREDICT_WEIGHTS = ("bf16", "fp8")       # the W_q copy that the one-layer-early query prediction reads
SELECT_RULES = ("paper", "lse", "psum")  # how a GQA group's query heads pick their KV head's top-K tokens
DEFAULT_BITS = 1  # quantized layers' bits when neither --bits nor the model's config ("bits") names them

# The methods each knob changes; under the others it has no effect (the CLI refuses it there).
KNOB_USERS = {
    "bits": ("tailorkv",),
    "budget": ("tailorkv", "streamingllm", "snapkv", "quest"),
    "sink": ("tailorkv", "streamingllm"),
    "recent": ("tailorkv",),
    "channels": ("tailorkv",),
    "quant_layers": ("tailorkv",),
    "layer_profile": ("tailorkv",),
    "select": ("tailorkv",),
    "sketch_bits": ("tailorkv",),
    "kt_bits": ("tailorkv",),
    "kt_cache": ("tailorkv",),
    "predict_ahead": ("tailorkv",),
    "predict_weights": ("tailorkv",),
    "select_rule": ("tailorkv",),
    "channel_rule": ("tailorkv",),
    "own_query_below": ("tailorkv",),
}
SELECT_KNOBS = {  # tailorkv's knobs that only some --select modes use
    "sketch_bits": ("sketch", "sketch-ahead"),
    "channels": ("channels",),
    "channel_rule": ("channels",),
    "kt_bits": ("channels",),
    "kt_cache": ("channels",),
}


def quant_shape_error(head_dim: int, bits: int, group: int) -> str | None:
    """Why the 1/2-bit layers cannot hold this head dimension (None: they can): a token's channels pack into
    32-bit words of 32 / bits codes, and the values' scale groups are min(group, head_dim) channels."""
    per_word, vgroup = 32 // bits, min(group, head_dim)
    if head_dim % per_word or head_dim % vgroup:
        return (f"need a head dimension that is a multiple of {per_word} and of {vgroup}, and this model's is "
                f"{head_dim}")
    return None


@dataclass
class MethodSettings:
    method: str = "full"
    bits: int | None = None  # quantized layers: 1 or 2 bits; None: the model's config's "bits", else DEFAULT_BITS
    #                          (engine.methods.with_model_defaults, called by build_cache and by the commands)
    group: int = 64          # quantization group (tokens for keys, channels for values)
    residual: int = 128      # full-precision recent tokens in quantized layers
    budget: int = 1024       # tokens attended per sparse layer: sink + top-K + recent
    sink: int = 64
    recent: int = 64
    channels: int = 12       # r: channels per KV head used for approximate scores
    select_rule: str = "lse"   # SELECT_RULES: paper = summed logits of the group's heads (the reference code);
    #                            lse / psum = logsumexp of their logits / sum of their softmax probabilities
    channel_rule: str = "paper"  # CHANNEL_RULES: paper = |group mean of q_hat| x max|K|; max = max over the
    #                              group of |q_hat_h| x max|K|; l2 = the group's L2 norm of q_hat x max|K|
    # (the defaults: eval/results/2026-11-30-cpu-selection-rules)
    select: str = "channels"   # SELECT_MODES: channels = the paper's r channels of K^T fetched from host memory;
    #                            sketch = a low-bit copy of the middle's keys on the device scores every channel
    #                            sketch-ahead = the same sketch scored one layer early from the predicted query,
    #                            the chosen K/V rows gathered on the copy stream under the layer before's compute
    sketch_bits: int = 2       # bits of the sketch (SKETCH_BITS)
    kt_bits: int = 16          # KT_BITS: bits per element of the host K^T store that --select channels reads
    #                            (8: float8 e4m3 with a power-of-two scale per KV head and channel: half the bytes)
    kt_cache: bool = False     # each sparse layer keeps its r channels' K^T rows on the device between steps and
    #                            reads only the channels it did not hold (+r / head_dim of the keys on the device)
    quant_layers: list[int] | None = None  # None: from the layer profile
    layer_profile: str | None = None  # a `tailorkv profile` JSON; None: the model's shipped one (configs/profiles)
    own_query_below: float = 0.5  # sparse layers whose profiled q-hat cosine (one-layer-early prediction) is below
    #                               this select from their own query, without the prefetch; 0 = never
    own_query_layers: list[int] | None = None  # None: from the profile and own_query_below (build_cache)
    predict_ahead: int = 1   # a sparse layer's query predicted from the input of the layer this many before it
    #                          (the paper's: 1); more gives its selection and fetch more layers to run under
    predict_weights: str = "bf16"  # PREDICT_WEIGHTS: the model's W_q, or e4m3 copies of it (half the bytes)
    page: int = 16           # quest page size
    snap_window: int = 32    # snapkv observation window (last prompt queries)
    snap_pool: int = 7       # snapkv pooling kernel
    dense_layers: list[int] | None = None  # layers that use the `full` policy whatever the method
    free_generated: bool = False  # True: the budget counts kept prompt tokens only; tokens generated after the
    #                               prompt are attended on top by every policy (eval's plain/paper protocols).
    #                               False: each policy's own rule (streamingllm's window and quest's pages
    #                               hold them inside the budget; tailorkv's tail and snapkv keep them outside)
    extra: dict = field(default_factory=dict)

    @property
    def topk(self) -> int:
        return max(0, self.budget - self.sink - self.recent)

    @property
    def sketched(self) -> bool:
        """The sparse layers keep a key sketch on the device (--select sketch or sketch-ahead)."""
        return self.select in ("sketch", "sketch-ahead")

    @property
    def combine_rule(self) -> str:
        """ops.sparse_select.combine_heads' name for select_rule."""
        return "sum" if self.select_rule == "paper" else self.select_rule

    def validate(self, budget_named: str = "--budget {n}", raise_budget: str = "raise --budget") -> None:
        """budget_named / raise_budget: how messages name the budget and its fix (an eval group names its own)."""
        bud = budget_named.format(n=self.budget)
        if self.method not in METHODS:
            raise InputError(f"unknown method '{self.method}'; choose one of {', '.join(METHODS)}")
        if self.bits not in (None, 1, 2):
            raise InputError(f"--bits must be 1 or 2, got {self.bits}")
        for flag, n in (("--sink", self.sink), ("--recent", self.recent)):
            if n < 0:
                raise InputError(f"{flag} must be at least 0 tokens, got {n}: e.g. {flag} 64")
        if self.budget < 1:
            raise InputError(f"--budget must be a count of tokens above 0, got {self.budget}: e.g. --budget 1024")
        if self.method == "tailorkv" and self.budget < self.sink + self.recent:
            raise InputError(f"{bud} is smaller than --sink {self.sink} + --recent {self.recent}: {raise_budget} "
                             f"or lower --sink / --recent")
        if self.method == "streamingllm" and self.budget <= self.sink:
            raise InputError(f"{bud} must exceed --sink {self.sink} under streamingllm: {raise_budget} or lower "
                             f"--sink")
        if self.method == "snapkv" and not 1 <= self.snap_window < self.budget:
            raise InputError(f"{bud} must exceed snapkv's observation window ({self.snap_window} tokens): "
                             f"{raise_budget}")
        if self.method == "quest" and not 1 <= self.page <= self.budget:
            raise InputError(f"{bud} must be at least one quest page ({self.page} tokens): {raise_budget}")
        if self.channels < 1:
            raise InputError(f"--channels must be at least 1, got {self.channels}: e.g. the paper's 12")
        if self.select not in SELECT_MODES:
            raise InputError(f"--select {self.select}: use {', '.join(SELECT_MODES)}")
        if self.sketch_bits not in SKETCH_BITS:
            raise InputError(f"--sketch-bits must be 1, 2 or 4, got {self.sketch_bits}")
        if self.kt_bits not in KT_BITS:
            raise InputError(f"--kt-bits must be 16 or 8, got {self.kt_bits}")
        if self.select_rule not in SELECT_RULES:
            raise InputError(f"--select-rule {self.select_rule}: use {', '.join(SELECT_RULES)}")
        if self.channel_rule not in CHANNEL_RULES:
            raise InputError(f"--channel-rule {self.channel_rule}: use {', '.join(CHANNEL_RULES)}")
        if not 0.0 <= self.own_query_below <= 1.0:
            raise InputError(f"--own-query-below must be a cosine in [0, 1] (0 = never), got {self.own_query_below}")
        if self.predict_ahead < 1:
            raise InputError(f"--predict-ahead must be at least 1 (the layer before), got {self.predict_ahead}")
        if self.predict_weights not in PREDICT_WEIGHTS:
            raise InputError(f"--predict-weights {self.predict_weights}: use {', '.join(PREDICT_WEIGHTS)}")
        if self.dense_layers is not None and any(not isinstance(i, int) or i < 0 for i in self.dense_layers):
            raise InputError(f"dense layers {self.dense_layers}: give layer numbers >= 0")

    def check_model(self, head_dim: int, n_layers: int) -> None:
        """Checks that need the model's shape (tailorkv's knobs; quant_layers as its layer profile resolved them)."""
        if self.method != "tailorkv":
            return
        if self.channels > head_dim:
            raise InputError(f"--channels {self.channels} is more than the model's head dimension ({head_dim}): "
                             f"use at most {head_dim}")
        bits = self.bits or DEFAULT_BITS
        err = quant_shape_error(head_dim, bits, self.group)
        if self.quant_layers and err:
            fixes = (["--bits 2"] if bits == 1 and not quant_shape_error(head_dim, 2, self.group) else []) + \
                ["--quant-layers ''", "another --method"]
            raise InputError(f"tailorkv's {bits}-bit layers {err}: use {' or '.join(fixes)}")
        per_word = 32 // self.sketch_bits  # the sketch packs a token's channels in 32-bit words
        if self.sketched and head_dim % per_word:
            raise InputError(f"--select {self.select}'s {self.sketch_bits}-bit sketch packs {per_word} channels per "
                             f"word, and this model's head dimension ({head_dim}) is not a multiple of {per_word}: "
                             f"use --select channels" + (" or --sketch-bits 4" if head_dim % 8 == 0 else ""))
        self.check_layers(n_layers)
        if self.predict_ahead >= n_layers:
            raise InputError(f"--predict-ahead {self.predict_ahead} reaches before the first layer: the model has "
                             f"{n_layers} layers, use at most {n_layers - 1}")

    def check_layers(self, n_layers: int, quant_layers: list[int] | None = None) -> None:
        """Layer numbers within the model's: tailorkv's quantized layers (`quant_layers`, else the settings'), and
        any method's dense layers."""
        quant = (self.quant_layers if quant_layers is None else quant_layers) if self.method == "tailorkv" else []
        for flag, layers in (("--quant-layers", quant), ("dense layer", self.dense_layers)):
            bad = sorted(i for i in layers or [] if not 0 <= i < n_layers)
            if bad:
                raise InputError(f"{flag} {bad[0]} is out of range: the model has layers 0..{n_layers - 1}")

    def to_dict(self) -> dict:
        return asdict(self)

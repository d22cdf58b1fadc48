"""A plain-PyTorch Llama. It knows nothing about cache policies: each attention layer hands (q, k, v) to the
ModelCache and gets the attention output back.

The projections that read the same input are one weight each, so a decode step reads them in one GEMV:
`qkv_proj` holds the rows of HF's q_proj, k_proj and v_proj, `gate_up_proj` those of gate_proj and up_proj
(`Llama.checkpoint_slot` tells a loader where each checkpoint tensor goes). The residual stream is updated in
place with the next norm fused in (ops.fused: one kernel each on the GPU)."""
from __future__ import annotations

import torch
from torch import nn

from tailorkv.models.config import ModelConfig
from tailorkv.models.rope import Rope
from tailorkv.ops.fused import add_rms_norm, rms_norm, silu_mul_halves
from tailorkv.ops.host_gather import gather_rows
from tailorkv.ops.linear import fp8_rows, linear, linear_fp8

MLP_CHUNK = 4096  # prefill tokens per MLP call: bounds the [T, hidden_dim] activations


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)

    def add_then_norm(self, residual, x):
        """residual += x (in place); returns norm(residual)."""
        return add_rms_norm(residual, x, self.weight, self.eps)[0]


class Stacked:
    """A module whose weight STACKED holds the rows of the checkpoint tensors PARTS, in order, of `sizes` rows."""
    STACKED: str
    PARTS: tuple[str, ...]
    sizes: list[int]

    def part_rows(self, part: str) -> tuple[int, int]:
        i = self.PARTS.index(part)
        return sum(self.sizes[:i]), sum(self.sizes[:i + 1])


class Attention(nn.Module, Stacked):
    STACKED, PARTS = "qkv_proj", ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.sizes = [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]
        self.qkv_proj = nn.Linear(cfg.dim, sum(self.sizes), bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def heads(self, x, n):  # [B, T, n*hd] -> [B, n, T, hd] (a view)
        b, t, _ = x.shape
        return x.view(b, t, n, self.hd).transpose(1, 2)

    def project_qkv(self, x):
        """x [B, T, dim] -> q, k, v [B, T, n * hd]. A long prompt's q is written over x chunk by chunk (where q is
        as wide as x; the caller reads x no more): no [T, (Hq + 2 Hkv) hd] output beside x."""
        t, nq = x.shape[1], self.sizes[0]
        if t <= MLP_CHUNK or nq != x.shape[-1]:
            return linear(x, self.qkv_proj.weight).split(self.sizes, -1)
        kv = torch.empty(*x.shape[:2], self.sizes[1] + self.sizes[2], dtype=x.dtype, device=x.device)
        for s in range(0, t, MLP_CHUNK):
            part = linear(x[:, s:s + MLP_CHUNK], self.qkv_proj.weight)
            kv[:, s:s + MLP_CHUNK] = part[..., nq:]
            x[:, s:s + MLP_CHUNK] = part[..., :nq]
        return (x, *kv.split(self.sizes[1:], -1))

    def forward(self, q, k, v, positions, rope: Rope, attend):
        """project_qkv's q, k, v -> the attention output per head [B, Hq, T, D], before the output projection
        (`attend` may write it over q)."""
        q, k = rope(self.heads(q, self.n_heads), self.heads(k, self.n_kv), positions)
        return attend(q, k, self.heads(v, self.n_kv))

    def project(self, o):
        """o [B, Hq, T, D] (a chunk of tokens) -> [B, T, dim]."""
        b, _, t, _ = o.shape
        return linear(o.transpose(1, 2).reshape(b, t, -1), self.o_proj.weight)

    def query(self, x, positions, rope: Rope, fp8=None):
        """This layer's roped query alone for input x [B, T, dim] -> [B, Hq, T, D] (reads only W_q, or its
        fp8_rows codes and scales `fp8`)."""
        q = linear(x, self.qkv_proj.weight[:self.sizes[0]]) if fp8 is None else linear_fp8(x, *fp8)
        return rope(self.heads(q, self.n_heads), None, positions)[0]


class MLP(nn.Module, Stacked):
    STACKED, PARTS = "gate_up_proj", ("gate_proj", "up_proj")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.sizes = [cfg.hidden_dim, cfg.hidden_dim]
        self.gate_up_proj = nn.Linear(cfg.dim, 2 * cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        return linear(silu_mul_halves(linear(x, self.gate_up_proj.weight)), self.down_proj.weight)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, x_holder: list, i, step, rope, cache, next_norm: RMSNorm):
        """x_holder = [this layer's normed input], handed over (a long prompt's input is freed before the
        attention); h the residual stream (updated in place). Returns next_norm(h)."""
        x = x_holder.pop()
        cache.layer_input(i, x, step)
        q, k, v = self.self_attn.project_qkv(x)
        del x
        o = self.self_attn(q, k, v, step.positions, rope, lambda q, k, v: cache.attend(i, q, k, v, step))
        del q, k, v

        def rest(part, o_part):  # the output projection, the MLP and the next norm over some of the tokens
            m = self.mlp(self.post_attention_layernorm.add_then_norm(part, self.self_attn.project(o_part)))
            return next_norm.add_then_norm(part, m)
        if h.shape[1] <= MLP_CHUNK:  # a decode step or a short prompt: no copy into an output buffer
            return rest(h, o)
        # long prompts in chunks: [T, dim] temporaries stay small. A token-major o (written over q, which lies
        # over x) takes each chunk's result in place of the rows its output projection has just read.
        tok = o.transpose(1, 2)
        own = tok.is_contiguous() and tok.dtype == h.dtype and tok.shape[:2] == h.shape[:2] and tok.numel() == h.numel()
        out = tok.view(h.shape) if own else torch.empty_like(h)
        for s in range(0, h.shape[1], MLP_CHUNK):
            out[:, s:s + MLP_CHUNK] = rest(h[:, s:s + MLP_CHUNK], o[:, :, s:s + MLP_CHUNK])
        return out


class Inner(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Inner(cfg)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope = Rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def checkpoint_slot(self, name: str) -> tuple[str, int, int] | None:
        """A checkpoint tensor stacked into a weight here -> (parameter name, first row, end row), else None;
        e.g. 'model.layers.0.self_attn.k_proj.weight' -> ('model.layers.0.self_attn.qkv_proj.weight', Hq*D, ...)."""
        module, _, leaf = name.rpartition(".")
        parent, _, part = module.rpartition(".")
        try:
            owner = self.get_submodule(parent)
        except AttributeError:
            return None
        if leaf != "weight" or not isinstance(owner, Stacked) or part not in owner.PARTS:
            return None
        return (f"{parent}.{owner.STACKED}.weight", *owner.part_rows(part))

    def checkpoint_names(self) -> list[str]:
        """The tensor names of an HF checkpoint of this model (stacked weights under their parts' names)."""
        out = []
        for name, _ in self.named_parameters():
            module, _, _ = name.rpartition(".")
            parent, _, child = module.rpartition(".")
            owner = self.get_submodule(parent) if parent else None
            if isinstance(owner, Stacked) and child == owner.STACKED:
                out += [f"{parent}.{p}.weight" for p in owner.PARTS]
            else:
                out.append(name)
        return out

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, step, cache, all_logits: bool = False) -> torch.Tensor:
        """tokens [B, T] of `step` (engine.step.Step: its positions, made by `cache.begin`); returns logits
        [B, T, V] (all_logits) or [B, V] (last)."""
        h = self.embed(tokens)
        layers = self.model.layers
        x = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            holder = [x]
            del x
            x = layer(h, holder, i, step, self.rope, cache, nxt)
        if not all_logits:
            x = x[:, -1:]
        logits = linear(x, self.output_weight).float()
        return logits if all_logits else logits[:, -1]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> [B, T, dim]. A table in pinned host memory (models/loader.py puts an untied one
        there for a GPU) is read row by row over PCIe with the ids on the device: no sync, graph-capturable."""
        w = self.model.embed_tokens.weight
        if w.device == tokens.device:
            return self.model.embed_tokens(tokens)
        rows = gather_rows(w.view(1, 1, *w.shape), tokens.reshape(1, 1, -1), tokens.device)
        return rows.view(*tokens.shape, w.shape[-1])

    def project_query(self, layer_idx: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer layer_idx's roped query for normalized input x [B, T, dim] at `positions` -> [B, Hq, T, D]."""
        return self.model.layers[layer_idx].self_attn.query(x, positions, self.rope)

    def query_predictor(self, weights: str = "bf16"):
        """project_query from W_q as stored ("bf16"), or from e4m3 copies of every layer's W_q made now ("fp8":
        half the bytes read per prediction, at ~2^-4 relative error per weight)."""
        if weights != "fp8":
            return self.project_query
        codes = [fp8_rows(layer.self_attn.qkv_proj.weight[:layer.self_attn.sizes[0]]) for layer in self.model.layers]
        return lambda i, x, positions: self.model.layers[i].self_attn.query(x, positions, self.rope, codes[i])

"""A plain-PyTorch Llama. It knows nothing about cache policies: each attention layer hands (q, k, v) to the
ModelCache and gets the attention output back. Module names follow HF checkpoints, so state dicts load as is."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tailorkv.models.config import ModelConfig
from tailorkv.models.rope import Rope

MLP_CHUNK = 4096  # prefill tokens per MLP call: bounds the [T, hidden_dim] activations


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def heads(self, x, n):  # [B, T, n*hd] -> [B, n, T, hd]
        b, t, _ = x.shape
        return x.view(b, t, n, self.hd).transpose(1, 2)

    def forward(self, x, positions, rope: Rope, attend):
        q = rope(self.heads(self.q_proj(x), self.n_heads), positions)
        k = rope(self.heads(self.k_proj(x), self.n_kv), positions)
        v = self.heads(self.v_proj(x), self.n_kv)
        o = attend(q, k, v)
        del q, k, v  # long prompts: free them before the output projection
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, i, step, rope, cache):
        x = self.input_layernorm(h)
        cache.layer_input(i, x, step)
        attn = self.self_attn(x, step.positions, rope, lambda q, k, v: cache.attend(i, q, k, v, step))
        del x
        h = h + attn if h.shape[1] <= MLP_CHUNK else h.add_(attn)  # long prompts: in place, h is ours
        del attn
        if h.shape[1] <= MLP_CHUNK:
            return h + self.mlp(self.post_attention_layernorm(h))
        for s in range(0, h.shape[1], MLP_CHUNK):  # in place: h is this layer's own tensor
            part = h[:, s:s + MLP_CHUNK]
            part += self.mlp(self.post_attention_layernorm(part))
        return h


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

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, step, cache, all_logits: bool = False) -> torch.Tensor:
        """tokens [B, T] of `step` (engine.step.Step: its positions, made by `cache.begin`); returns logits
        [B, T, V] (all_logits) or [B, V] (last)."""
        h = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, i, step, self.rope, cache)
        if not all_logits:
            h = h[:, -1:]
        logits = F.linear(self.model.norm(h), self.output_weight).float()
        return logits if all_logits else logits[:, -1]

    def project_query(self, layer_idx: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Layer layer_idx's roped query for normalized input x [B, T, dim] at `positions` -> [B, Hq, T, D]."""
        attn = self.model.layers[layer_idx].self_attn
        return self.rope(attn.heads(attn.q_proj(x), attn.n_heads), positions)

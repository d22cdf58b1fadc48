"""Shared test helpers: a tiny random HF Llama checkpoint written with transformers."""
import torch

from tests.conftest import rel_err  # noqa: F401


def write_tiny_hf(folder, *, seed=0, vocab=300, tie=False, rope_scaling="llama3", n_layers=3):
    from transformers import LlamaConfig, LlamaForCausalLM
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64} if rope_scaling == "llama3" else None
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=n_layers,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                      rope_theta=10000.0, rope_scaling=scaling, tie_word_embeddings=tie, rms_norm_eps=1e-5,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    return model

"""Tiny Hugging Face models with fixed-seed random weights, for tests (no hub access)."""

from __future__ import annotations

import torch
import transformers

#: architecture → config kwargs for a small model (a few layers, hidden 64).
TINY_CONFIGS = {
    "llama": dict(cls="LlamaConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=256),
    "gpt2": dict(cls="GPT2Config", n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=256,
                 bos_token_id=0, eos_token_id=0),
    "opt": dict(cls="OPTConfig", hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=256, max_position_embeddings=256,
                word_embed_proj_dim=64),
    # tensor-parallel coverage: multi-query (1 kv head), q/k/v biases, uneven heads and vocab
    "mistral": dict(cls="MistralConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=256,
                    max_position_embeddings=256),
    "qwen2": dict(cls="Qwen2Config", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=256),
    "llama-7heads": dict(cls="LlamaConfig", hidden_size=112, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=7, num_key_value_heads=7,
                         vocab_size=257, max_position_embeddings=256),
    "llama-gqa-6q3kv": dict(cls="LlamaConfig", hidden_size=96, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                            vocab_size=256, max_position_embeddings=256),
}


def tiny_causal_lm(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32):
    """A small ``AutoModelForCausalLM`` of ``arch`` with weights drawn from ``seed``."""
    spec = dict(TINY_CONFIGS[arch])
    config = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def prompt_ids(batch: int = 1, length: int = 8, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g)

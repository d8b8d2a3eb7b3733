"""Built-in benchmark models: realistic shapes with fixed-seed random weights (no download).

Presets are named by family and shape (``<model_type>-<layers>l-<hidden>h``, ``-gqa`` when the
attention has fewer key/value heads than query heads), never by the checkpoints they imitate.
Random weights make the text meaningless but the arithmetic (and so the speed) is the real one.
Mixture-of-Experts presets add ``-<experts>e`` (``-top<k>`` in their description); their
routing over random weights is close to uniform, which is what the roofline's byte count of
the experts a step reads assumes only where it cannot count them (see :mod:`.roofline`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class Preset:
    """One built-in model shape.

    Attributes:
        name: what ``--preset`` takes.
        config_class: the ``transformers`` config class name (``"LlamaConfig"``, ...).
        config: keyword arguments of that config class.
        about: one line on what the shape is typical of.
    """

    name: str
    config_class: str
    config: dict[str, Any] = field(default_factory=dict)
    about: str = ""

    def hf_config(self):
        """The ``transformers`` config object of this shape."""
        import transformers

        return getattr(transformers, self.config_class)(**self.config)


_GPT2_COMMON = dict(vocab_size=50257, n_positions=1024, bos_token_id=50256, eos_token_id=50256)
_LLAMA_COMMON = dict(vocab_size=32000, max_position_embeddings=4096, bos_token_id=1,
                     eos_token_id=2, hidden_act="silu")

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("gpt2-12l-768h", "GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, **_GPT2_COMMON),
           "~124M, GPT-2-small shape: learned positions, LayerNorm, GELU MLP, tied embeddings"),
    Preset("gpt2-24l-1024h", "GPT2Config",
           dict(n_embd=1024, n_layer=24, n_head=16, **_GPT2_COMMON),
           "~355M, GPT-2-medium shape"),
    Preset("opt-24l-1024h", "OPTConfig",
           dict(hidden_size=1024, ffn_dim=4096, num_hidden_layers=24, num_attention_heads=16,
                vocab_size=50272, max_position_embeddings=2048, word_embed_proj_dim=512,
                do_layer_norm_before=False, bos_token_id=2, eos_token_id=2, pad_token_id=1),
           "~331M, OPT-350m shape: post-LayerNorm, 512-wide embeddings projected to 1024"),
    Preset("llama-20l-1536h-gqa", "LlamaConfig",
           dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=20,
                num_attention_heads=24, num_key_value_heads=4, tie_word_embeddings=True,
                **_LLAMA_COMMON),
           "~0.5B Llama-style: RMSNorm, rotary, SwiGLU, 24 query / 4 key-value heads"),
    Preset("llama-22l-2048h-gqa", "LlamaConfig",
           dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
                **_LLAMA_COMMON),
           "~1.1B Llama-style: 32 query / 4 key-value heads, untied output embeddings"),
    Preset("llama-80l-512h-gqa", "LlamaConfig",
           dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=80,
                num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False,
                **_LLAMA_COMMON),
           "~0.26B deep, narrow Llama-style: 80 layers (a 70B model's depth) at 512 wide, "
           "8 query / 2 key-value heads (pipeline stages of many cheap layers)"),
    Preset("llama-2l-64h-gqa", "LlamaConfig",
           dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
                bos_token_id=0, eos_token_id=0),
           "tiny Llama-style (for tests and smoke runs; measures overhead, not bandwidth)"),
    Preset("mixtral-18l-1024h-8e", "MixtralConfig",
           dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=18,
                num_attention_heads=16, num_key_value_heads=4, num_local_experts=8,
                num_experts_per_tok=2, tie_word_embeddings=False, **_LLAMA_COMMON),
           "~1.0B Mixtral-style MoE: 8 experts top-2 (~0.34B read per token), 16 query / 4 "
           "key-value heads"),
    # Qwen2-MoE, not DeepSeek-V3: DeepSeek-V3's attention is multi-head latent attention (a
    # low-rank KV cache) and its router is grouped and sigmoid-scored, so its numbers would mix
    # the attention's cost into the experts'; Qwen2-MoE has the same fine-grained experts with
    # a shared expert (sigmoid-gated) behind a plain grouped-query attention.
    Preset("moe-shared-12l-1024h-64e", "Qwen2MoeConfig",
           dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=256,
                shared_expert_intermediate_size=1024, num_hidden_layers=12,
                num_attention_heads=16, num_key_value_heads=4, num_experts=64,
                num_experts_per_tok=6, norm_topk_prob=False, use_sliding_window=False,
                tie_word_embeddings=False, **_LLAMA_COMMON),
           "~0.74B DeepSeek-shaped fine-grained MoE (Qwen2-MoE): 64 experts top-6 and one "
           "shared expert per layer (~0.19B read per token)"),
    Preset("mixtral-2l-64h-4e", "MixtralConfig",
           dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                num_experts_per_tok=2, vocab_size=256, max_position_embeddings=512,
                bos_token_id=0, eos_token_id=0),
           "tiny Mixtral-style MoE, 4 experts top-2 (for tests and smoke runs)"),
    Preset("moe-shared-2l-64h-8e", "Qwen2MoeConfig",
           dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=False, use_sliding_window=False, vocab_size=256,
                max_position_embeddings=512, bos_token_id=0, eos_token_id=0),
           "tiny fine-grained MoE with a shared expert (Qwen2-MoE), 8 experts top-2 (for tests "
           "and smoke runs)"),
    Preset("gpt2-2l-64h", "GPT2Config",
           dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=512,
                bos_token_id=0, eos_token_id=0),
           "tiny GPT-2 shape (for tests and smoke runs)"),
)}


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (case-insensitive); unknown names list the presets."""
    preset = PRESETS.get(name.lower())
    if preset is None:
        raise ConfigError(f"unknown preset {name!r}; built-in presets: {', '.join(PRESETS)} "
                          f"(see `shardwise bench --list-presets`)")
    return preset


def build_preset(name: str, dtype: torch.dtype | None = None, seed: int = 0):
    """A ``AutoModelForCausalLM`` of preset ``name`` with weights drawn from ``seed``, in eval mode."""
    from transformers import AutoModelForCausalLM

    preset = get_preset(name)
    torch.manual_seed(seed)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    return AutoModelForCausalLM.from_config(preset.hf_config(), **kwargs).eval()


def count_parameters(name: str) -> int:
    """Parameters of preset ``name`` (tied weights once), counted on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(get_preset(name).hf_config())
    return sum(p.numel() for p in model.parameters())


def describe_presets() -> str:
    """A table of the presets (name, parameters, shape) for ``--list-presets``."""
    lines = [f"{'preset':<26} {'params':>8}  about"]
    for name, preset in PRESETS.items():
        lines.append(f"{name:<26} {count_parameters(name) / 1e6:>7.1f}M  {preset.about}")
    return "\n".join(lines)

"""Phi-3 policy: fused ``qkv_proj`` with output features [q | k | v] (q heads, then kv heads,
grouped-query), fused ``gate_up_proj`` with output features [gate | up] (``chunk(2)`` in the
forward), separate ``o_proj``/``down_proj``, untied embeddings.

HF's plan for Phi-3 marks the fused projections ``colwise_gather_output`` (gathering the full
q|k|v on every rank), which shardwise does not apply; the HF plan then defers to this policy,
which splits the fused layers by their parts instead, so no gather is needed.

The attention forward finds the end of q with ``self.config.num_attention_heads * head_dim``:
``attention_config_attrs`` gives each attention module its own view of the config with the rank's
head counts (the model's config is unchanged).
"""

from shardwise.inject.spec import MLP, Attention, InjectionSpec, Positions, Residual
from shardwise.policy import Policy
from shardwise.sharding.roles import (ColumnParallel, Fused, Heads, RowParallel,
                                      VocabParallelEmbedding, VocabParallelHead)

#: qkv_proj output features: [q heads × head_dim | kv heads × head_dim | kv heads × head_dim]
QKV = Fused(parts=(("q", "heads"), ("k", "kv_heads"), ("v", "kv_heads")))
#: gate_up_proj output features: [gate (intermediate) | up (intermediate)], each split evenly
GATE_UP = Fused(parts=(("gate", "even"), ("up", "even")))


class Phi3Policy(Policy):
    """Tensor-parallel data for ``model_type == "phi3"``."""

    name = "phi3"
    model_types = ("phi3",)
    tp_plan = {
        "embed_tokens": VocabParallelEmbedding(),
        "layers.*.self_attn.qkv_proj": ColumnParallel(QKV),
        "layers.*.self_attn.o_proj": RowParallel(Heads("heads")),  # [hidden, heads*head_dim]
        "layers.*.mlp.gate_up_proj": ColumnParallel(GATE_UP),
        "layers.*.mlp.down_proj": RowParallel(),  # input [intermediate]: the rank's gate/up slice
        "lm_head": VocabParallelHead(),
    }
    attention_modules = ("layers.*.self_attn",)
    # q/k/v are viewed with -1 heads; k/v are sliced with num_key_value_heads, and repeat_kv (eager
    # and SDPA) uses num_key_value_groups.
    attention_attrs = {"num_key_value_heads": "kv_heads", "num_key_value_groups": "kv_groups"}
    attention_config_attrs = {"num_attention_heads": "q_heads", "num_key_value_heads": "kv_heads"}
    # Kernel injection: RMSNorm, fused qkv [q | k | v], rotary from rotary_emb (partial and
    # long-rope scaling included), fused [gate | up] SiLU MLP, sliding window when configured.
    injection = InjectionSpec(
        base_model="model", layers="layers", embed="embed_tokens",
        positions=Positions("rotary", rotary_module="rotary_emb"),
        attention=Attention(qkv=("self_attn.qkv_proj",), out_proj="self_attn.o_proj",
                            window_config="sliding_window"),
        mlp=MLP("gated", in_proj=("mlp.gate_up_proj",), out_proj="mlp.down_proj"),
        residual=Residual("rms", attn_norm="input_layernorm",
                          mlp_norm="post_attention_layernorm", final_norm="norm"))

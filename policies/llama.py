"""Llama-family policy: Llama, Mistral, Qwen2 (separate q/k/v/o, gated MLP, GQA).

HF ships a ``tp_plan`` for these models, which shardwise uses for the roles; this policy adds what
that plan lacks — how the projections are organised by heads (so uneven head counts and
grouped-query attention split by whole heads/kv groups) and the attention attribute that follows
the split — and its own plan for when the HF one is absent.
"""

from shardwise.inject.spec import MLP, Attention, InjectionSpec, Positions, Residual
from shardwise.policy import Policy
from shardwise.sharding.roles import (ColumnParallel, Heads, RowParallel, VocabParallelEmbedding,
                                      VocabParallelHead)


class LlamaPolicy(Policy):
    name = "llama"
    model_types = ("llama", "mistral", "qwen2")
    tp_plan = {
        "embed_tokens": VocabParallelEmbedding(),
        "layers.*.self_attn.q_proj": ColumnParallel(),
        "layers.*.self_attn.k_proj": ColumnParallel(),
        "layers.*.self_attn.v_proj": ColumnParallel(),
        "layers.*.self_attn.o_proj": RowParallel(),
        "layers.*.mlp.gate_proj": ColumnParallel(),
        "layers.*.mlp.up_proj": ColumnParallel(),
        "layers.*.mlp.down_proj": RowParallel(),
        "lm_head": VocabParallelHead(),
    }
    layouts = {
        "layers.*.self_attn.q_proj": Heads("heads"),  # weight [heads*head_dim, hidden]
        "layers.*.self_attn.k_proj": Heads("kv_heads"),  # [kv_heads*head_dim, hidden]
        "layers.*.self_attn.v_proj": Heads("kv_heads"),
        "layers.*.self_attn.o_proj": Heads("heads"),  # input side [hidden, heads*head_dim]
    }
    attention_modules = ("layers.*.self_attn",)
    # The HF forward reshapes with -1 heads; only repeat_kv's group count is stored.
    attention_attrs = {"num_key_value_groups": "kv_groups"}
    # Kernel injection: RMSNorm, rotary "half" from the model's own rotary_emb (rope scaling
    # included), SiLU-and-mul MLP, separate q/k/v (GQA read from the weight shapes).
    injection = InjectionSpec(
        base_model="model", layers="layers", embed="embed_tokens",
        positions=Positions("rotary", rotary_module="rotary_emb", rotary_style="half"),
        attention=Attention(
            qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            out_proj="self_attn.o_proj",
            # Mistral: one window for every layer; Qwen2: the layers its layer_types mark sliding
            window_config="sliding_window", layer_kinds_config="layer_types",
            windowed_kinds=("sliding_attention",)),
        mlp=MLP("gated", in_proj=("mlp.gate_proj", "mlp.up_proj"), out_proj="mlp.down_proj",
                activation_config=("hidden_act",)),
        residual=Residual("rms", attn_norm="input_layernorm",
                          mlp_norm="post_attention_layernorm", final_norm="norm"))

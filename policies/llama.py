"""Llama-family policy: Llama, Mistral, Qwen2 (separate q/k/v/o, gated MLP, GQA).

HF ships a ``tp_plan`` for these models, which shardwise uses for the roles; this policy adds what
that plan lacks — how the projections are organised by heads (so uneven head counts and
grouped-query attention split by whole heads/kv groups) and the attention attribute that follows
the split — and its own plan for when the HF one is absent.
"""

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

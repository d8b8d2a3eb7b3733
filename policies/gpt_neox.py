"""GPT-NeoX policy (Pythia, GPT-NeoX-20B): fused ``query_key_value`` whose output features are
interleaved per head — weight [heads × (q, k, v) × head_dim, hidden] — so a rank must keep whole
[3, head_dim] head blocks, not a contiguous third; ``dense`` reads the heads back; partial rotary
(``rotary_pct``) inside each head; optional parallel residual; untied ``embed_in``/``lm_head``.

HF ships a ``base_model_tp_plan`` for GPT-NeoX (plain ``colwise`` on ``query_key_value``), which
shardwise uses for the roles: the layouts below still apply to it (a plan's role without a
layout takes the policy's), which is what makes that plan faithful — an even split of the fused
output would cut through heads whenever the head count does not divide by tp_size. The policy's
own plan (also sharding ``embed_in``) is used where the HF plan is absent.
"""

from shardwise.inject.spec import MLP, Attention, InjectionSpec, Positions, Residual
from shardwise.policy import Policy
from shardwise.sharding.roles import (ColumnParallel, Heads, PerHeadInterleaved, RowParallel,
                                      VocabParallelEmbedding, VocabParallelHead)


class GPTNeoXPolicy(Policy):
    """Tensor-parallel data for ``model_type == "gpt_neox"``."""

    name = "gpt_neox"
    model_types = ("gpt_neox",)
    tp_plan = {
        "embed_in": VocabParallelEmbedding(),
        "layers.*.attention.query_key_value": ColumnParallel(),
        "layers.*.attention.dense": RowParallel(),
        "layers.*.mlp.dense_h_to_4h": ColumnParallel(),  # [intermediate, hidden]
        "layers.*.mlp.dense_4h_to_h": RowParallel(),  # [hidden, intermediate]
        "lm_head": VocabParallelHead(),
    }
    layouts = {
        # [heads, 3 (q, k, v), head_dim] along the output features (bias alike)
        "layers.*.attention.query_key_value": PerHeadInterleaved(per_head=3),
        # input features [heads, head_dim]: the same heads
        "layers.*.attention.dense": Heads("heads"),
    }
    attention_modules = ("layers.*.attention",)
    # The forward views qkv as (..., -1, 3 * head_size): no head count is stored on the module;
    # head_size is the only size it reads, and the split leaves it unchanged.
    attention_attrs = {"head_size": "head_dim"}
    # Kernel injection: fused qkv [heads, 3, head_dim] (the grouped layout with one q head per
    # group), partial rotary from the model's rotary_emb, the residual form from the config.
    injection = InjectionSpec(
        base_model="gpt_neox", layers="layers", embed="embed_in",
        positions=Positions("rotary", rotary_module="rotary_emb"),
        attention=Attention(qkv=("attention.query_key_value",), qkv_layout="grouped",
                            out_proj="attention.dense"),
        mlp=MLP("plain", in_proj=("mlp.dense_h_to_4h",), out_proj="mlp.dense_4h_to_h"),
        residual=Residual("layer", attn_norm="input_layernorm",
                          mlp_norm="post_attention_layernorm", final_norm="final_layer_norm",
                          parallel_config="use_parallel_residual"))

"""Falcon policy: fused ``query_key_value`` in its three layouts, rotary or ALiBi positions,
parallel attention/MLP, tied ``word_embeddings`` / ``lm_head``; no HF tp_plan.

``FalconAttention._split_heads`` reads ``query_key_value``'s output three ways, which are one
layout — [kv groups, (q heads of the group, k, v), head_dim] (:class:`GroupedInterleaved`) —
with three kv head counts:

=============================  ======================================  ===================
config                         output features                         kv heads
=============================  ======================================  ===================
``new_decoder_architecture``   [num_kv_heads, heads/kv + 2, head_dim]  ``num_kv_heads``
``multi_query`` (Falcon-7B)    [heads + 2, head_dim] = [q | k | v]     1 (on every rank)
neither                        [heads, 3, head_dim]                    ``num_attention_heads``
=============================  ======================================  ===================

so the rank keeps its q heads of each of its kv groups plus the groups' k, v, and the forward,
given the rank's ``num_heads`` / ``num_kv_heads``, splits them the same way. Uneven head counts
split by whole heads (Falcon-7B's 71 heads: 36 | 35 on 2 ranks, the single kv head on both).

With ``alibi=True`` ``FalconModel.forward`` builds the bias for all heads and folds it into the
4-D attention mask ([batch, heads, q, k]); both arrive at each attention as arguments and are
narrowed to the rank's heads (``head_sliced_inputs``; a [batch, 1, q, k] causal mask of the
rotary models passes through). ``parallel_attn`` needs nothing: the attention's ``dense`` and
the MLP's ``dense_4h_to_h`` each all-reduce before they are added.
"""

from dataclasses import replace

from shardwise.inject.spec import MLP, Attention, InjectionSpec, Positions, Residual
from shardwise.policy import IfConfig, Policy
from shardwise.sharding import HeadSlicedInput
from shardwise.sharding.roles import (ColumnParallel, GroupedInterleaved, Heads, RowParallel,
                                      VocabParallelEmbedding, VocabParallelHead)

#: the residual forms of the injected layer: sequential from two norms, or attention and MLP in
#: parallel from one (``injection_overrides`` picks by config)
SEQUENTIAL = Residual("layer", attn_norm="input_layernorm", mlp_norm="post_attention_layernorm",
                      final_norm="ln_f")
PARALLEL = replace(SEQUENTIAL, mlp_norm=None, parallel=True)


class FalconPolicy(Policy):
    name = "falcon"
    model_types = ("falcon",)
    tp_plan = {
        "word_embeddings": VocabParallelEmbedding(),
        "h.*.self_attention.query_key_value": ColumnParallel(GroupedInterleaved(shared=2)),
        "h.*.self_attention.dense": RowParallel(Heads("heads")),  # [hidden, heads × head_dim]
        "h.*.mlp.dense_h_to_4h": ColumnParallel(),
        "h.*.mlp.dense_4h_to_h": RowParallel(),
        "lm_head": VocabParallelHead(),  # tied to word_embeddings: same slice, stays tied
    }
    attention_modules = ("h.*.self_attention",)
    # _split_heads views with num_heads // num_kv_heads + 2 (or num_heads + 2, or num_heads × 3)
    # and the outputs are reshaped with num_heads; hidden_size/split_size are not read.
    attention_attrs = {"num_heads": "q_heads", "num_kv_heads": "kv_heads"}
    # ALiBi: alibi [batch, heads, 1, seq] and the mask it is folded into [batch, heads, q, k]
    head_sliced_inputs = {"h.*.self_attention": (HeadSlicedInput("alibi", dim=1),
                                                 HeadSlicedInput("attention_mask", dim=1))}
    head_config = {
        "num_heads": ("num_attention_heads",),
        # the kv heads query_key_value holds (see the table above)
        "num_kv_heads": (IfConfig(1, {"multi_query": True, "new_decoder_architecture": False}),
                         "num_kv_heads"),  # = num_attention_heads unless set (FalconConfig)
        "head_dim": ("head_dim",),
        "hidden_size": ("hidden_size",),
    }
    # Kernel injection: fused qkv in the grouped layout (all three Falcon layouts are one, see
    # above); the sequential, rotary form below, changed by the config as the HF layer is.
    injection = InjectionSpec(
        base_model="transformer", layers="h", embed="word_embeddings",
        positions=Positions("rotary", rotary_module="rotary_emb"),
        attention=Attention(qkv=("self_attention.query_key_value",), qkv_layout="grouped",
                            out_proj="self_attention.dense"),
        mlp=MLP("plain", in_proj=("mlp.dense_h_to_4h",), out_proj="mlp.dense_4h_to_h",
                activation_config=("activation",)),
        residual=SEQUENTIAL)
    injection_overrides = (
        # ALiBi, scaled with the scores (FalconAttention multiplies after adding it)
        ({"alibi": True}, {"positions": Positions("alibi", alibi_scaled=True)}),
        # attention and MLP in parallel from one norm (Falcon-7B, and the new architecture) …
        ({"parallel_attn": True}, {"residual": PARALLEL}),
        ({"new_decoder_architecture": True}, {"residual": PARALLEL}),
        # … or from two (Falcon-40B/180B)
        ({"new_decoder_architecture": True, "num_ln_in_parallel_attn": 2},
         {"residual": replace(PARALLEL, attn_norm="ln_attn", mlp_norm="ln_mlp")}),
    )

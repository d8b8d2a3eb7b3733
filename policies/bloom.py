"""BLOOM policy: fused ``query_key_value`` interleaved per head, ALiBi position biases, the
embedding LayerNorm, tied ``word_embeddings`` / ``lm_head``; no HF tp_plan.

Layouts (``nn.Linear`` weights are [out, in]):

* ``self_attention.query_key_value`` [heads × (q, k, v) × head_dim, hidden]: ``BloomAttention``
  views its output as ``(batch, seq, num_heads, 3, head_dim)``, so the rank keeps whole
  ``[3, head_dim]`` blocks of its heads (:class:`PerHeadInterleaved`);
* ``self_attention.dense`` [hidden, heads × head_dim]: input side by heads;
* ``mlp.dense_h_to_4h`` / ``dense_4h_to_h``: the usual column → row pair.

ALiBi: ``BloomModel.forward`` builds ``alibi`` [batch × n_head, 1, seq] (index ``b * n_head +
h``) with the slopes of *all* ``config.n_head`` heads and hands the same tensor to every layer.
Each rank's attention holds heads ``[h0, h1)`` of the whole model, so a pre-hook on each
attention instance narrows ``alibi`` to those heads (their slopes, not the first ones):
``head_sliced_inputs``. ``BloomModel.num_heads`` stays global — the slopes depend on the total
head count.
"""

from shardwise.inject.spec import MLP, Attention, InjectionSpec, Positions, Residual
from shardwise.policy import Policy
from shardwise.sharding import HeadSlicedInput
from shardwise.sharding.roles import (ColumnParallel, Heads, PerHeadInterleaved, RowParallel,
                                      VocabParallelEmbedding, VocabParallelHead)


class BloomPolicy(Policy):
    name = "bloom"
    model_types = ("bloom",)
    tp_plan = {
        "word_embeddings": VocabParallelEmbedding(),  # word_embeddings_layernorm: replicated
        "h.*.self_attention.query_key_value": ColumnParallel(PerHeadInterleaved(per_head=3)),
        "h.*.self_attention.dense": RowParallel(Heads("heads")),
        "h.*.mlp.dense_h_to_4h": ColumnParallel(),
        "h.*.mlp.dense_4h_to_h": RowParallel(),
        "lm_head": VocabParallelHead(),  # tied to word_embeddings: same slice, stays tied
    }
    attention_modules = ("h.*.self_attention",)
    # The forward views with num_heads and merges heads to num_heads * head_dim; hidden_size and
    # split_size are the attention width (the pretraining_tp slow path slices dense by it).
    attention_attrs = {"num_heads": "q_heads", "hidden_size": "q_width", "split_size": "q_width"}
    # alibi [batch * n_head, 1, seq]: batch and heads folded in dim 0, heads inner
    head_sliced_inputs = {"h.*.self_attention": (HeadSlicedInput("alibi", dim=0, folded=True),)}
    head_config = {"num_heads": ("n_head",), "num_kv_heads": (), "head_dim": (),
                   "hidden_size": ("hidden_size",)}
    # Kernel injection: LayerNorm on the embeddings, fused qkv [heads, 3, head_dim], ALiBi (each
    # rank's slopes), tanh-GELU MLP (BLOOM's config names no activation).
    injection = InjectionSpec(
        base_model="transformer", layers="h", embed="word_embeddings",
        positions=Positions("alibi"),
        attention=Attention(qkv=("self_attention.query_key_value",), qkv_layout="grouped",
                            out_proj="self_attention.dense"),
        mlp=MLP("plain", in_proj=("mlp.dense_h_to_4h",), out_proj="mlp.dense_4h_to_h",
                activation_config=(), activation="gelu_pytorch_tanh"),
        residual=Residual("layer", attn_norm="input_layernorm",
                          mlp_norm="post_attention_layernorm", final_norm="ln_f",
                          embed_norm="word_embeddings_layernorm"),
        refuse_config=(("apply_residual_connection_post_layernorm", True,
                        "the residual taken after the LayerNorm"),))

"""BERT policy (``BertModel``, ``BertForMaskedLM`` and the other heads): an encoder with separate
``query`` / ``key`` / ``value`` projections; no HF tp_plan.

Per layer (``nn.Linear`` weights are [out, in]):

* ``attention.self.query|key|value`` [heads × head_dim, hidden]: column-parallel by heads (the
  forward views them as ``(*shape, -1, attention_head_size)``, so the head count follows the
  width);
* ``attention.output.dense`` [hidden, heads × head_dim]: row-parallel by heads (all-reduce, then
  the residual LayerNorm on the full hidden state);
* ``intermediate.dense`` / ``output.dense``: the column → row MLP pair.

``embeddings.word_embeddings`` is vocab-parallel (position / token-type embeddings and the
LayerNorm replicated); the MLM ``cls.predictions.decoder`` is tied to it and vocab-parallel too
(its per-token bias is sliced with it); the pooler and the MLM transform are replicated.
Attention is non-causal; nothing about masks changes (they broadcast over heads).

Kernel injection (``injection``): the ``BertEncoder`` is replaced by shardwise's post-LayerNorm
encoder (:mod:`shardwise.inject.encoder`); embeddings, pooler and heads stay HF's.
"""

from shardwise.inject.encoder import EncoderAttention, EncoderInjectionSpec, EncoderMLP
from shardwise.policy import Policy
from shardwise.sharding.roles import (ColumnParallel, Heads, RowParallel, VocabParallelEmbedding,
                                      VocabParallelHead)


class BertPolicy(Policy):
    name = "bert"
    model_types = ("bert",)
    tp_plan = {
        "embeddings.word_embeddings": VocabParallelEmbedding(),
        "encoder.layer.*.attention.self.query": ColumnParallel(Heads("heads")),
        "encoder.layer.*.attention.self.key": ColumnParallel(Heads("heads")),
        "encoder.layer.*.attention.self.value": ColumnParallel(Heads("heads")),
        "encoder.layer.*.attention.output.dense": RowParallel(Heads("heads")),
        "encoder.layer.*.intermediate.dense": ColumnParallel(),
        "encoder.layer.*.output.dense": RowParallel(),
        "cls.predictions.decoder": VocabParallelHead(),  # MLM head, tied to word_embeddings
    }
    attention_modules = ("encoder.layer.*.attention.self",)
    # Not read by the forward (it reshapes with -1 heads) but kept true for whoever inspects it.
    attention_attrs = {"num_attention_heads": "q_heads", "all_head_size": "q_width",
                       "attention_head_size": "head_dim"}
    # Kernel injection: post-LayerNorm encoder layers, separate query/key/value, GELU MLP.
    # transformers 5 BERT has absolute positions only; an older config asking for relative ones
    # ("relative_key", "relative_key_query") is refused rather than silently run as absolute.
    injection = EncoderInjectionSpec(
        encoder="encoder", layers="layer",
        attention=EncoderAttention(
            qkv=("attention.self.query", "attention.self.key", "attention.self.value"),
            out_proj="attention.output.dense", norm="attention.output.LayerNorm"),
        mlp=EncoderMLP(in_proj="intermediate.dense", out_proj="output.dense",
                       norm="output.LayerNorm", activation_config=("hidden_act",)),
        require_config=(("position_embedding_type", "absolute"),))

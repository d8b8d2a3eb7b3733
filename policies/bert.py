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
"""

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

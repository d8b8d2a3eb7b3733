"""OPT policy: separate q/k/v/out_proj, fc1/fc2 directly in the decoder layer, tied embeddings
(``word_embed_proj_dim`` may differ from hidden: project_in/out stay replicated), no HF
tp_plan."""

from shardwise.policy import Policy
from shardwise.sharding.roles import (ColumnParallel, Heads, RowParallel, VocabParallelEmbedding,
                                      VocabParallelHead)


class OPTPolicy(Policy):
    name = "opt"
    model_types = ("opt",)
    tp_plan = {
        "decoder.embed_tokens": VocabParallelEmbedding(),
        "decoder.layers.*.self_attn.q_proj": ColumnParallel(Heads("heads")),
        "decoder.layers.*.self_attn.k_proj": ColumnParallel(Heads("heads")),
        "decoder.layers.*.self_attn.v_proj": ColumnParallel(Heads("heads")),
        "decoder.layers.*.self_attn.out_proj": RowParallel(Heads("heads")),
        "decoder.layers.*.fc1": ColumnParallel(),
        "decoder.layers.*.fc2": RowParallel(),
        "lm_head": VocabParallelHead(),
    }
    attention_modules = ("decoder.layers.*.self_attn",)
    # The HF forward views q/k/v as (bsz, -1, num_heads, head_dim).
    attention_attrs = {"num_heads": "q_heads", "embed_dim": "q_width"}

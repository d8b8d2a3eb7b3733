"""GPT-2 policy: fused ``c_attn`` Conv1D (weight [hidden, 3*hidden] = [q | k | v] on the output
side), tied wte / lm_head, no HF tp_plan."""

from shardwise.policy import Policy
from shardwise.sharding.roles import (ColumnParallel, Fused, Heads, RowParallel,
                                      VocabParallelEmbedding, VocabParallelHead)

QKV = Fused(parts=(("q", "heads"), ("k", "kv_heads"), ("v", "kv_heads")))


class GPT2Policy(Policy):
    name = "gpt2"
    model_types = ("gpt2",)
    tp_plan = {
        "wte": VocabParallelEmbedding(),
        "h.*.attn.c_attn": ColumnParallel(QKV),
        "h.*.attn.c_proj": RowParallel(Heads("heads")),
        "h.*.mlp.c_fc": ColumnParallel(),
        "h.*.mlp.c_proj": RowParallel(),
        "lm_head": VocabParallelHead(),  # tied to wte: same slice, stays tied
    }
    attention_modules = ("h.*.attn",)
    # c_attn's output is split with split_size; heads are reshaped with -1.
    attention_attrs = {"num_heads": "q_heads", "split_size": "q_width", "embed_dim": "q_width"}
    head_config = {"num_heads": ("n_head",), "num_kv_heads": (), "head_dim": (),
                   "hidden_size": ("n_embd",)}

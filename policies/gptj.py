"""GPT-J policy: separate q/k/v/out projections without bias, partial rotary on the first
``rotary_dim`` features of every head (per head, so a head split leaves it unchanged), attention
and MLP in parallel from one LayerNorm (each ends in its own row-parallel all-reduce, so the sum
``attn + mlp + residual`` is the full one), ``fc_in``/``fc_out`` MLP, untied ``lm_head`` with a
bias (split with its vocabulary rows), no HF tp_plan."""

from shardwise.inject.spec import MLP, Attention, InjectionSpec, Positions, Residual
from shardwise.policy import Policy
from shardwise.sharding.roles import (ColumnParallel, Heads, RowParallel, VocabParallelEmbedding,
                                      VocabParallelHead)


class GPTJPolicy(Policy):
    """Tensor-parallel data for ``model_type == "gptj"``."""

    name = "gptj"
    model_types = ("gptj",)
    tp_plan = {
        "wte": VocabParallelEmbedding(),
        # q/k/v weight [heads*head_dim, hidden]: the rank's heads (output side)
        "h.*.attn.q_proj": ColumnParallel(Heads("heads")),
        "h.*.attn.k_proj": ColumnParallel(Heads("heads")),
        "h.*.attn.v_proj": ColumnParallel(Heads("heads")),
        "h.*.attn.out_proj": RowParallel(Heads("heads")),  # [hidden, heads*head_dim]
        "h.*.mlp.fc_in": ColumnParallel(),  # [n_inner, hidden]
        "h.*.mlp.fc_out": RowParallel(),  # [hidden, n_inner]
        "lm_head": VocabParallelHead(),  # [vocab, hidden] + bias [vocab]
    }
    attention_modules = ("h.*.attn",)
    # _split_heads/_merge_heads use (num_attention_heads, head_dim); embed_dim kept consistent.
    attention_attrs = {"num_attention_heads": "q_heads", "embed_dim": "q_width"}
    head_config = {"num_heads": ("n_head",), "num_kv_heads": (), "head_dim": (),
                   "hidden_size": ("n_embd",)}
    # Kernel injection: one LayerNorm feeding attention and MLP in parallel, interleaved partial
    # rotary over the first rotary_dim dims of each head (GPT-J has no rotary module: the table
    # is built from rotary_dim), bias+GELU MLP.
    injection = InjectionSpec(
        base_model="transformer", layers="h", embed="wte",
        positions=Positions("rotary", rotary_style="interleaved", rotary_dim_config="rotary_dim"),
        attention=Attention(qkv=("attn.q_proj", "attn.k_proj", "attn.v_proj"),
                            out_proj="attn.out_proj"),
        mlp=MLP("plain", in_proj=("mlp.fc_in",), out_proj="mlp.fc_out",
                activation_config=("activation_function",)),
        residual=Residual("layer", attn_norm="ln_1", mlp_norm=None, final_norm="ln_f",
                          parallel=True))

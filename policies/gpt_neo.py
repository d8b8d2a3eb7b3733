"""GPT-Neo policy: separate q/k/v projections (no bias) and ``out_proj`` (with bias) inside
``attn.attention`` (``GPTNeoAttention`` wraps the self-attention that alternates global and local,
sliding-window, attention per layer; the window mask is a per-module buffer over positions, so it
is unchanged by the head split), ``c_fc``/``c_proj`` nn.Linear MLP, learned position embeddings
``wpe`` (replicated), ``wte`` tied to ``lm_head``, no HF tp_plan."""

from shardwise.inject.spec import MLP, Attention, InjectionSpec, Positions, Residual
from shardwise.policy import Policy
from shardwise.sharding.roles import (ColumnParallel, Heads, RowParallel, VocabParallelEmbedding,
                                      VocabParallelHead)


class GPTNeoPolicy(Policy):
    """Tensor-parallel data for ``model_type == "gpt_neo"``."""

    name = "gpt_neo"
    model_types = ("gpt_neo",)
    tp_plan = {
        "wte": VocabParallelEmbedding(),
        # q/k/v weight [heads*head_dim, hidden]: the rank's heads (output side)
        "h.*.attn.attention.q_proj": ColumnParallel(Heads("heads")),
        "h.*.attn.attention.k_proj": ColumnParallel(Heads("heads")),
        "h.*.attn.attention.v_proj": ColumnParallel(Heads("heads")),
        # out_proj weight [hidden, heads*head_dim]: the same heads on the input side; bias once
        "h.*.attn.attention.out_proj": RowParallel(Heads("heads")),
        "h.*.mlp.c_fc": ColumnParallel(),  # [intermediate, hidden]
        "h.*.mlp.c_proj": RowParallel(),  # [hidden, intermediate]
        "lm_head": VocabParallelHead(),  # tied to wte: same slice, stays tied
    }
    attention_modules = ("h.*.attn.attention",)
    # _split_heads/_merge_heads view with (num_heads, head_dim); embed_dim kept consistent.
    attention_attrs = {"num_heads": "q_heads", "embed_dim": "q_width"}
    head_config = {"num_heads": ("num_heads",), "num_kv_heads": (), "head_dim": (),
                   "hidden_size": ("hidden_size",)}
    # Kernel injection: LayerNorm, learned positions (wpe), separate q/k/v, bias+GELU MLP; GPT-Neo
    # does not scale attention scores, and its "local" layers attend over window_size tokens.
    injection = InjectionSpec(
        base_model="transformer", layers="h", embed="wte",
        positions=Positions("learned", embed="wpe"),
        attention=Attention(
            qkv=("attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj"),
            out_proj="attn.attention.out_proj", scale=1.0, window_config="window_size",
            layer_kinds_config="attention_layers", windowed_kinds=("local",)),
        mlp=MLP("plain", in_proj=("mlp.c_fc",), out_proj="mlp.c_proj",
                activation_config=("activation_function",)),
        residual=Residual("layer", attn_norm="ln_1", mlp_norm="ln_2", final_norm="ln_f"))

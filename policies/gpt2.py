"""GPT-2 policy: fused ``c_attn`` Conv1D (weight [hidden, 3*hidden] = [q | k | v] on the output
side), tied wte / lm_head, no HF tp_plan."""

from shardwise.inject.spec import MLP, Attention, InjectionSpec, Positions, Residual
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
    # Kernel injection: LayerNorm, learned positions (wpe), fused c_attn [q | k | v] Conv1D,
    # bias+GELU MLP (the activation named by activation_function: gelu_new = tanh).
    injection = InjectionSpec(
        base_model="transformer", layers="h", embed="wte",
        positions=Positions("learned", embed="wpe"),
        attention=Attention(qkv=("attn.c_attn",), out_proj="attn.c_proj",
                            inverse_layer_scale_config="scale_attn_by_inverse_layer_idx",
                            unscaled_config="scale_attn_weights"),
        mlp=MLP("plain", in_proj=("mlp.c_fc",), out_proj="mlp.c_proj",
                activation_config=("activation_function",)),
        residual=Residual("layer", attn_norm="ln_1", mlp_norm="ln_2", final_norm="ln_f"))

"""Mixtral policy: Llama-style attention (separate q/k/v/o, GQA, rotary) and a Mixture-of-Experts
block on every layer (``mlp``: a softmax top-k router ``gate`` whose k weights are renormalised,
and HF's stacked ``experts``).

The MoE block is data (:class:`~shardwise.moe.MoESpec`): the generic mechanism
(:mod:`shardwise.moe`) runs it through the moe kernels. Tensor parallelism splits the attention
by heads; the router is replicated and the experts are split by expert (expert parallelism),
not by the plan's linear roles.
"""

from shardwise.inject.spec import MLP, Attention, InjectionSpec, Positions, Residual
from shardwise.moe import MoESpec
from shardwise.policy import Policy
from shardwise.sharding.roles import (ColumnParallel, Heads, RowParallel, VocabParallelEmbedding,
                                      VocabParallelHead)

#: the attention of the Llama-style MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE)
ATTENTION_TP_PLAN = {
    "embed_tokens": VocabParallelEmbedding(),
    "layers.*.self_attn.q_proj": ColumnParallel(),
    "layers.*.self_attn.k_proj": ColumnParallel(),
    "layers.*.self_attn.v_proj": ColumnParallel(),
    "layers.*.self_attn.o_proj": RowParallel(),
}
ATTENTION_LAYOUTS = {
    "layers.*.self_attn.q_proj": Heads("heads"),  # weight [heads*head_dim, hidden]
    "layers.*.self_attn.k_proj": Heads("kv_heads"),  # [kv_heads*head_dim, hidden]
    "layers.*.self_attn.v_proj": Heads("kv_heads"),
    "layers.*.self_attn.o_proj": Heads("heads"),  # input side [hidden, heads*head_dim]
}
#: the dense MLP the injected layer calls on a layer that is not MoE (Qwen-MoE's
#: ``mlp_only_layers``); Mixtral has none, every layer holds its MoE block at ``mlp``
DENSE_MLP = MLP("gated", in_proj=("mlp.gate_proj", "mlp.up_proj"), out_proj="mlp.down_proj",
                activation_config=("hidden_act",))


def llama_like_injection(**attention) -> InjectionSpec:
    """The injection data of a Llama-style decoder (RMSNorm, the model's own rotary module,
    separate q/k/v) whose MLP is an MoE block on its MoE layers; ``attention``: extra
    :class:`Attention` fields (windows, q/k norms)."""
    return InjectionSpec(
        base_model="model", layers="layers", embed="embed_tokens",
        positions=Positions("rotary", rotary_module="rotary_emb", rotary_style="half"),
        attention=Attention(qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                            out_proj="self_attn.o_proj", **attention),
        mlp=DENSE_MLP,
        residual=Residual("rms", attn_norm="input_layernorm",
                          mlp_norm="post_attention_layernorm", final_norm="norm"))


class MixtralPolicy(Policy):
    name = "mixtral"
    model_types = ("mixtral",)
    tp_plan = {**ATTENTION_TP_PLAN, "lm_head": VocabParallelHead()}
    layouts = ATTENTION_LAYOUTS
    attention_modules = ("layers.*.self_attn",)
    attention_attrs = {"num_key_value_groups": "kv_groups"}
    moe = MoESpec(block="mlp", router="gate", experts="experts", renormalize=True)
    injection = llama_like_injection(window_config="sliding_window")

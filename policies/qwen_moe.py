"""Qwen-MoE policies: Qwen2-MoE and Qwen3-MoE — Llama-style attention and, on their MoE layers
(``decoder_sparse_step``, ``mlp_only_layers``: the plan's ``moe_layers``), a Mixture-of-Experts
block at ``mlp`` (softmax top-k router ``gate``, renormalised where ``norm_topk_prob``); the
other layers keep a dense gated MLP at the same name.

* Qwen2-MoE: q/k/v biases, a shared expert (``shared_expert``, a gated MLP) scaled by
  ``sigmoid(shared_expert_gate(x))``; sliding windows on the layers its ``layer_types`` mark.
* Qwen3-MoE: per-head RMSNorms on q and k (``q_norm``/``k_norm``) before the rotary; no shared
  expert; one sliding window for every layer when ``use_sliding_window``.
"""

from shardwise.moe import MoESpec
from shardwise.policy import Policy
from shardwise.sharding.roles import ColumnParallel, RowParallel, VocabParallelHead

from .mixtral import ATTENTION_LAYOUTS, ATTENTION_TP_PLAN, llama_like_injection

#: the dense MLP of the layers that are not MoE (and, on Qwen2-MoE, the shared expert): split
#: as Llama's MLP
_DENSE_TP_PLAN = {
    "layers.*.mlp.gate_proj": ColumnParallel(),
    "layers.*.mlp.up_proj": ColumnParallel(),
    "layers.*.mlp.down_proj": RowParallel(),
}


class Qwen2MoePolicy(Policy):
    name = "qwen2_moe"
    model_types = ("qwen2_moe",)
    tp_plan = {**ATTENTION_TP_PLAN, **_DENSE_TP_PLAN,
               "layers.*.mlp.shared_expert.gate_proj": ColumnParallel(),
               "layers.*.mlp.shared_expert.up_proj": ColumnParallel(),
               "layers.*.mlp.shared_expert.down_proj": RowParallel(),
               "lm_head": VocabParallelHead()}
    layouts = ATTENTION_LAYOUTS
    attention_modules = ("layers.*.self_attn",)
    attention_attrs = {"num_key_value_groups": "kv_groups"}
    moe = MoESpec(block="mlp", router="gate", experts="experts", renormalize="norm_topk_prob",
                  shared="shared_expert", shared_gate="shared_expert_gate")
    injection = llama_like_injection(window_config="sliding_window",
                                     layer_kinds_config="layer_types",
                                     windowed_kinds=("sliding_attention",))


class Qwen3MoePolicy(Policy):
    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    tp_plan = {**ATTENTION_TP_PLAN, **_DENSE_TP_PLAN, "lm_head": VocabParallelHead()}
    layouts = ATTENTION_LAYOUTS
    attention_modules = ("layers.*.self_attn",)
    attention_attrs = {"num_key_value_groups": "kv_groups"}
    moe = MoESpec(block="mlp", router="gate", experts="experts", renormalize="norm_topk_prob")
    injection = llama_like_injection(window_config="sliding_window",
                                     qk_norm=("self_attn.q_norm", "self_attn.k_norm"))

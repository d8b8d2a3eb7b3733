"""DeepSeek-V3 policy: multi-head latent attention, a sigmoid-scored MoE with shared experts.

The family's three quirks, each data:

* **attention** is multi-head latent attention (:class:`~shardwise.inject.spec.LatentAttention`,
  run by :mod:`shardwise.inject.mla`: the KV cache holds one latent per token, decode is
  absorbed): the queries through a LoRA (``q_a_proj`` → ``q_a_layernorm`` → ``q_b_proj``) or,
  with ``q_lora_rank=None``, one ``q_proj``; rotary positions on the ``qk_rope_head_dim`` part,
  interleaved pairs unless ``rope_interleave`` is off;
* **the MoE block** (:class:`~shardwise.moe.MoESpec`): router logits in float32, sigmoid
  scores, ``e_score_correction_bias`` added for the choice only, group-limited top-k
  (``n_group`` / ``topk_group``, in the plan's facts), weights renormalised by
  ``norm_topk_prob`` and scaled by ``routed_scaling_factor``, and an always-on
  ``shared_experts`` MLP without a gate;
* **leading dense layers**: the first ``first_k_dense_replace`` layers keep a dense MLP under
  the same name ``mlp`` (the plan's ``moe_layers`` through ``Policy.moe_layer_rules``).

Tensor parallelism: HF's plan names the MLPs and experts only, the experts in styles shardwise
does not apply, so a model with MoE layers defers to this plan (a config whose layers are all
dense gets HF's MLP-only plan: the attention whole on every rank, the injected layer reading its
heads from the weights). This one splits the attention by heads — the queries (``q_proj`` or LoRA's ``q_b_proj``)
and ``kv_b_proj`` column-parallel, ``o_proj`` row-parallel, each in whole head blocks of its own
width (``HeadBlocks``: nope + rope, nope + v, v) — while the low-rank down-projections, their
norms and so the latent cache stay whole on every rank; the dense and shared-expert MLPs, the
embedding and the head split as Llama's. HF's attention forward reshapes with -1 heads: no
attribute follows the split.
"""

from shardwise.inject.spec import MLP, InjectionSpec, LatentAttention, Positions, Residual
from shardwise.moe import MoESpec
from shardwise.policy import Policy
from shardwise.sharding.roles import (ColumnParallel, HeadBlocks, RowParallel,
                                      VocabParallelEmbedding, VocabParallelHead)

_ROTARY = Positions("rotary", rotary_module="rotary_emb", rotary_style="interleaved")
_ROTARY_HALF = Positions("rotary", rotary_module="rotary_emb", rotary_style="half")


class DeepseekV3Policy(Policy):
    name = "deepseek_v3"
    model_types = ("deepseek_v3",)
    tp_plan = {
        "embed_tokens": VocabParallelEmbedding(),
        "layers.*.self_attn.q_proj": ColumnParallel(),
        "layers.*.self_attn.q_b_proj": ColumnParallel(),
        "layers.*.self_attn.kv_b_proj": ColumnParallel(),
        "layers.*.self_attn.o_proj": RowParallel(),
        "layers.*.mlp.gate_proj": ColumnParallel(),  # the leading dense layers
        "layers.*.mlp.up_proj": ColumnParallel(),
        "layers.*.mlp.down_proj": RowParallel(),
        "layers.*.mlp.shared_experts.gate_proj": ColumnParallel(),
        "layers.*.mlp.shared_experts.up_proj": ColumnParallel(),
        "layers.*.mlp.shared_experts.down_proj": RowParallel(),
        "lm_head": VocabParallelHead(),
    }
    layouts = {  # [heads, nope + rope], [heads, nope + v], input side [hidden, heads * v]
        "layers.*.self_attn.q_proj": HeadBlocks("heads"),
        "layers.*.self_attn.q_b_proj": HeadBlocks("heads"),
        "layers.*.self_attn.kv_b_proj": HeadBlocks("heads"),
        "layers.*.self_attn.o_proj": HeadBlocks("heads"),
    }
    moe = MoESpec(block="mlp", router="gate", experts="experts", layout="stacked",
                  scoring="sigmoid", router_dtype="float32", renormalize="norm_topk_prob",
                  scale_config="routed_scaling_factor",
                  correction_bias="e_score_correction_bias", shared="shared_experts")
    injection = InjectionSpec(
        base_model="model", layers="layers", embed="embed_tokens",
        positions=_ROTARY,
        attention=LatentAttention(
            out_proj="self_attn.o_proj", q_proj="self_attn.q_proj",
            q_a_proj="self_attn.q_a_proj", q_a_norm="self_attn.q_a_layernorm",
            q_b_proj="self_attn.q_b_proj", kv_a_proj="self_attn.kv_a_proj_with_mqa",
            kv_a_norm="self_attn.kv_a_layernorm", kv_b_proj="self_attn.kv_b_proj"),
        mlp=MLP("gated", in_proj=("mlp.gate_proj", "mlp.up_proj"), out_proj="mlp.down_proj",
                activation_config=("hidden_act",)),
        residual=Residual("rms", attn_norm="input_layernorm",
                          mlp_norm="post_attention_layernorm", final_norm="norm"))
    # HF rotates "half" pairs (rotate_half) unless rope_interleave is set
    injection_overrides = (({"rope_interleave": False}, {"positions": _ROTARY_HALF}),
                           ({"rope_interleave": None}, {"positions": _ROTARY_HALF}))

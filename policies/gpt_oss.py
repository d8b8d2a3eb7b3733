"""GPT-OSS policy: Llama-style attention (separate q/k/v/o with biases, GQA, rotary) with two
quirks, and a Mixture-of-Experts block on every layer.

Attention:

* attention sinks: each query head's learned logit ``self_attn.sinks`` joins every softmax's
  denominator (``Attention.sinks``; the attention kernels' ``sinks=``);
* alternating windows: the layers ``layer_types`` marks ``"sliding_attention"`` see the last
  ``sliding_window`` tokens, the ``"full_attention"`` ones everything;
* the rotary module returns each frequency once (cos/sin ``[.., head_dim // 2]``, YaRN scaling
  included): ``Positions.rotary_half_table``.

MoE block (``mlp``, :class:`~shardwise.moe.MoESpec` layout ``"gpt_oss"``): a router with a bias
whose top-k logits are softmaxed (= the softmax over every expert, renormalised over the top k),
experts with biases and the clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``) stored
transposed with gate/up interleaved (converted once to the kernels' layout by
:mod:`shardwise.moe`, undone by ``close()``); the block returns ``(hidden, router scores)``.
Tensor parallelism splits the attention by heads; the router is replicated and the experts are
split by expert (expert parallelism).
"""

from shardwise.inject.spec import MLP, Attention, InjectionSpec, Positions, Residual
from shardwise.moe import MoESpec
from shardwise.policy import Policy
from shardwise.policies.mixtral import ATTENTION_LAYOUTS, ATTENTION_TP_PLAN
from shardwise.sharding.roles import VocabParallelHead


class GptOssPolicy(Policy):
    name = "gpt_oss"
    model_types = ("gpt_oss",)
    tp_plan = {**ATTENTION_TP_PLAN, "lm_head": VocabParallelHead()}
    layouts = ATTENTION_LAYOUTS
    attention_modules = ("layers.*.self_attn",)
    attention_attrs = {"num_key_value_groups": "kv_groups"}
    attention_head_params = {"sinks": "heads"}  # [heads]: the HF forward reads the rank's
    moe = MoESpec(block="mlp", router="router", experts="experts", layout="gpt_oss",
                  renormalize=True, clamp_config="swiglu_limit", alpha_config="swiglu_alpha",
                  clamp_attrs=("limit", "alpha"), returns_router_scores=True)
    injection = InjectionSpec(
        base_model="model", layers="layers", embed="embed_tokens",
        positions=Positions("rotary", rotary_module="rotary_emb", rotary_style="half",
                            rotary_half_table=True),
        attention=Attention(
            qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            out_proj="self_attn.o_proj", sinks="self_attn.sinks",
            window_config="sliding_window", layer_kinds_config="layer_types",
            windowed_kinds=("sliding_attention",)),
        # every GPT-OSS layer is MoE: the dense MLP is never called (the injector needs one)
        mlp=MLP("gated", in_proj=("mlp.gate_proj", "mlp.up_proj"), out_proj="mlp.down_proj"),
        residual=Residual("rms", attn_norm="input_layernorm",
                          mlp_norm="post_attention_layernorm", final_norm="norm"))

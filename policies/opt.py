"""OPT policy: separate q/k/v/out_proj, fc1/fc2 directly in the decoder layer, tied embeddings
(``word_embed_proj_dim`` may differ from hidden: project_in/out stay replicated), no HF
tp_plan."""

from shardwise.inject.spec import MLP, Attention, InjectionSpec, Positions, Residual
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
    # Kernel injection: pre-LayerNorm layers, learned positions with OPT's offset of 2 counted
    # from each sequence's first real token, ReLU MLP, optional project_in/project_out.
    injection = InjectionSpec(
        base_model="model.decoder", layers="layers", embed="embed_tokens",
        positions=Positions("learned", embed="embed_positions", offset=2, from_mask=True),
        attention=Attention(qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                            out_proj="self_attn.out_proj"),
        mlp=MLP("plain", in_proj=("fc1",), out_proj="fc2",
                activation_config=("activation_function",)),
        residual=Residual("layer", attn_norm="self_attn_layer_norm",
                          mlp_norm="final_layer_norm", final_norm="final_layer_norm"),
        project_in="project_in", project_out="project_out",
        refuse_config=(("do_layer_norm_before", False, "post-LayerNorm layers, as in opt-350m"),
                       ("layer_norm_elementwise_affine", False, "LayerNorms without weights"),
                       ("_remove_final_layer_norm", True, "no final LayerNorm")))

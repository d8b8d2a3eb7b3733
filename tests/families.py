"""The one registry of test families: every tiny model the tests build, once, with what it is and
which capabilities its parity is checked for. Parity files choose their families here
(:func:`families`) instead of keeping their own lists, so a family added below reaches every test
whose capability it claims.

A *family* is a tiny config (a few layers, hidden 64-112, vocab 256-257, fixed-seed random
weights: tests/models.py builds it) of one HF architecture, or a variant of one that exercises a
layout, a head split or an attention path of its own (``falcon-mqa``, ``llama-7heads``,
``mistral-sw4`` ...).

Capabilities (a family's fields; the test files that read them):

* ``inject`` — world sizes whose kernel-injection parity with HF is checked: ``1`` test_inject.py
  (fp32 and bf16 per family), ``2`` test_inject_tp.py (fp32 and bf16, fp32 only where
  ``uneven_heads``); BERT's own cases are test_inject_bert.py's.
* ``graph_step`` — the graph-safe decode step (captured, head included) checked against HF
  (test_inject.py), on families that between them have rotary, learned and ALiBi positions,
  local and sliding windows.
* ``core`` — one family per linear kind, what a test uses where two families cover the code:
  ``llama`` (``nn.Linear``, untied head, rotary) and ``gpt2`` (transformers ``Conv1D``, tied head,
  learned positions): the CPU compiled graphs (test_cpu_graphs.py), quantized checkpoints
  (test_quant_checkpoint.py), quantization with fp32 models / under injection (test_quant.py).
* ``quant_bits`` — weight-only quantization bits whose parity with the fp32 model is checked at
  TP=1 (test_quant.py) and TP=2 (test_quant_tp.py), within :data:`QUANT_BOUNDS`.
* ``tp`` — the TP=2 split matches the single-process model (test_tp.py, test_tp_families_a.py,
  test_tp_families_b.py, by model type); ``tp_even`` — each rank then holds exactly half of the
  sharded weights (no replicated kv head, whole heads split evenly); ``uneven_heads`` — the
  query heads do not split evenly over 2 ranks (7 heads: 4 | 3).
* ``checkpoint`` — world sizes at which a saved HF directory read by shardwise's loader matches
  ``from_pretrained`` (test_checkpoint.py).

Facts used to select: ``kind`` (``"causal"`` LM or ``"encoder"``), ``model_type`` (the HF config's)
and ``positions`` (``"rotary"``, ``"learned"`` or ``"alibi"``).

Every family, whatever its capabilities: the engine with no transform gives HF's logits, greedy
tokens and pipeline output (test_generate.py; ``bert`` as HF's ``BertLMHeadModel``).

Tolerances: one per test, in its file, for every causal family alike (fp32 within 5e-7 of HF
under injection, 7e-7 at TP=2 ...). The one family with bounds of its own is ``bert`` (scrambled
weights, outputs up to ~4, every padded position compared: test_inject_bert.py's docstring gives
the measured values): ``Family.tolerances`` holds them by the name of the check, and
test_inject_bert.py / test_tp_families_b.py read them there. An MoE family may state its own
bf16 bound for test_moe.py (``moe_bf16``, measured and explained in its row: ``deepseek_v3``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

#: weight-only quantization, bits → (max relative logit error ‖Δ‖/‖ref‖, min argmax agreement)
#: against the fp32 model, bf16 compute (test_quant.py's docstring gives the measured values)
QUANT_BOUNDS = {8: (0.03, 0.90), 4: (0.25, 0.60)}


@dataclass(frozen=True)
class Family:
    """One tiny test model: its config and the capabilities its parity is checked for (see the
    module docstring)."""

    name: str
    #: ``cls`` (a transformers config class name) + that config's keyword arguments
    config: dict
    positions: str
    kind: str = "causal"
    inject: tuple[int, ...] = ()
    graph_step: bool = False
    core: bool = False
    quant_bits: tuple[int, ...] = ()
    tp: bool = False
    tp_even: bool = False
    uneven_heads: bool = False
    checkpoint: tuple[int, ...] = ()
    #: Mixture-of-Experts: the ep sizes whose parity with HF is checked (``1`` test_moe.py, one
    #: process; ``2`` test_moe_ep.py, 2 gloo ranks, tp 1 and 2 where the heads divide)
    moe: tuple[int, ...] = ()
    #: check name → bound, where this family has one of its own
    tolerances: dict = field(default_factory=dict)

    @cached_property
    def model_type(self) -> str:
        """The HF ``model_type`` of its config class (``"falcon"`` for ``falcon-mqa``)."""
        import transformers

        return getattr(transformers, self.config["cls"]).model_type


def _cfg(cls: str, **kwargs) -> dict:
    return dict(cls=cls, **kwargs)


#: what the Llama-style configs (Llama, Mistral, Qwen2, Phi-3) share: 2 layers of MLP width 128,
#: 256 tokens, 256 positions
_LLAMA_LIKE = dict(intermediate_size=128, num_hidden_layers=2, vocab_size=256,
              max_position_embeddings=256)
_EVERY_WORLD = (1, 2)

_FAMILIES = [
    Family("llama", _cfg("LlamaConfig", hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, **_LLAMA_LIKE),
           positions="rotary", inject=_EVERY_WORLD, graph_step=True, core=True,
           quant_bits=(8, 4), tp=True, tp_even=True, checkpoint=_EVERY_WORLD),
    Family("gpt2", _cfg("GPT2Config", n_embd=64, n_layer=2, n_head=4, vocab_size=256,
                        n_positions=256, bos_token_id=0, eos_token_id=0),
           positions="learned", inject=_EVERY_WORLD, graph_step=True, core=True,
           quant_bits=(8, 4), tp=True, tp_even=True, checkpoint=_EVERY_WORLD),
    Family("opt", _cfg("OPTConfig", hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                       num_attention_heads=4, vocab_size=256, max_position_embeddings=256,
                       word_embed_proj_dim=64),
           positions="learned", inject=_EVERY_WORLD, graph_step=True, quant_bits=(8, 4),
           tp=True, tp_even=True, checkpoint=_EVERY_WORLD),
    # tensor-parallel coverage: multi-query (1 kv head, replicated: not an even split), q/k/v
    # biases, uneven heads and vocab
    Family("mistral", _cfg("MistralConfig", hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=1, head_dim=16, **_LLAMA_LIKE),
           positions="rotary", inject=_EVERY_WORLD, tp=True),
    Family("qwen2", _cfg("Qwen2Config", hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, **_LLAMA_LIKE),
           positions="rotary", inject=_EVERY_WORLD, tp=True, tp_even=True,
           checkpoint=_EVERY_WORLD),
    Family("llama-7heads", _cfg("LlamaConfig", hidden_size=112, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=7,
                                num_key_value_heads=7, vocab_size=257,
                                max_position_embeddings=256),
           positions="rotary", inject=(2,), tp=True, uneven_heads=True, checkpoint=(2,)),
    # 6 query heads split 3 | 3, their 3 kv heads 2 | 1
    Family("llama-gqa-6q3kv", _cfg("LlamaConfig", hidden_size=96, num_attention_heads=6,
                                   num_key_value_heads=3, **_LLAMA_LIKE),
           positions="rotary", tp=True),
    # tensor-parallel families A: local/global attention, partial rotary + parallel attn/MLP,
    # per-head interleaved fused qkv, fused [q|k|v] and [gate|up]
    Family("gpt_neo", _cfg("GPTNeoConfig", hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, attention_types=[[["global", "local"], 1]],
                           window_size=4, vocab_size=256, max_position_embeddings=256,
                           bos_token_id=0, eos_token_id=0),
           positions="learned", inject=_EVERY_WORLD, graph_step=True, tp=True, tp_even=True),
    Family("gptj", _cfg("GPTJConfig", n_embd=64, n_inner=128, n_layer=2, n_head=4, rotary_dim=8,
                        vocab_size=256, n_positions=256, bos_token_id=0, eos_token_id=0),
           positions="rotary", inject=_EVERY_WORLD, tp=True, tp_even=True),
    Family("gpt_neox", _cfg("GPTNeoXConfig", hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25,
                            use_parallel_residual=True, vocab_size=256,
                            max_position_embeddings=256),
           positions="rotary", inject=_EVERY_WORLD, tp=True, tp_even=True),
    Family("phi3", _cfg("Phi3Config", hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        **_LLAMA_LIKE),
           positions="rotary", inject=_EVERY_WORLD, tp=True, tp_even=True),
    # 7 heads of 16 (hidden 112) over 2 ranks: 4 | 3 whole [q, k, v] head blocks; vocab 257
    Family("gpt_neox-7heads", _cfg("GPTNeoXConfig", hidden_size=112, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=7, rotary_pct=0.25,
                                   use_parallel_residual=True, vocab_size=257,
                                   max_position_embeddings=256),
           positions="rotary", inject=(2,), tp=True, uneven_heads=True),
    # tensor-parallel families B. BLOOM: fused per-head q|k|v, ALiBi (4 heads: slopes 1/4 … 1/256)
    Family("bloom", _cfg("BloomConfig", hidden_size=64, n_layer=2, n_head=4, vocab_size=256),
           positions="alibi", inject=_EVERY_WORLD, graph_step=True, tp=True, tp_even=True),
    # Falcon, its layouts: new decoder architecture (grouped kv, two LayerNorms, biases here) …
    Family("falcon", _cfg("FalconConfig", hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                          bias=True, vocab_size=256),
           positions="rotary", inject=_EVERY_WORLD, quant_bits=(8, 4), tp=True, tp_even=True),
    # … multi-query [q | k | v] with parallel attention (Falcon-7B): the kv head on both ranks …
    Family("falcon-mqa", _cfg("FalconConfig", hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, multi_query=True,
                              new_decoder_architecture=False, parallel_attn=True,
                              vocab_size=256),
           positions="rotary", inject=_EVERY_WORLD, tp=True),
    # … with uneven heads (7 over 2 ranks: 4 | 3, like Falcon-7B's 71) …
    Family("falcon-7heads-mqa", _cfg("FalconConfig", hidden_size=112, num_hidden_layers=2,
                                     num_attention_heads=7, multi_query=True,
                                     new_decoder_architecture=False, parallel_attn=True,
                                     vocab_size=256),
           positions="rotary", inject=(2,), tp=True, uneven_heads=True),
    # … and multi-head [heads, 3, head_dim], sequential, ALiBi (Falcon-RW)
    Family("falcon-alibi", _cfg("FalconConfig", hidden_size=64, num_hidden_layers=2,
                                num_attention_heads=4, multi_query=False,
                                new_decoder_architecture=False, parallel_attn=False, alibi=True,
                                bias=True, vocab_size=256),
           positions="alibi", inject=_EVERY_WORLD, graph_step=True, tp=True, tp_even=True),
    # the same with eager attention (Falcon cannot switch it after construction)
    Family("falcon-alibi-eager", _cfg("FalconConfig", hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, multi_query=False,
                                      new_decoder_architecture=False, parallel_attn=False,
                                      alibi=True, bias=True, vocab_size=256,
                                      attn_implementation="eager"),
           positions="alibi", tp=True, tp_even=True),
    # sliding windows shorter than the test prompts: every layer (Mistral), the layers past
    # max_window_layers (Qwen2's layer_types)
    Family("mistral-sw4", _cfg("MistralConfig", hidden_size=64, num_attention_heads=4,
                               num_key_value_heads=2, sliding_window=4, **_LLAMA_LIKE),
           positions="rotary", inject=(1,), graph_step=True),
    Family("qwen2-sw4", _cfg("Qwen2Config", hidden_size=64, num_attention_heads=4,
                             num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                             max_window_layers=1, **_LLAMA_LIKE),
           positions="rotary", inject=(1,)),
    # an encoder: build it with tiny_encoder (tiny_causal_lm gives HF's BertLMHeadModel)
    Family("bert", _cfg("BertConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, vocab_size=256, max_position_embeddings=64),
           positions="learned", kind="encoder", inject=_EVERY_WORLD, tp=True, tp_even=True,
           tolerances={"inject_fp32": 4e-6, "inject_bf16": 0.07, "inject_tp_bf16": 0.094,
                       "tp_fp32": 1e-6}),
    # Mixture-of-Experts families (``moe``): each helper appends its own rows below its marker
    # -- moe: mixtral, qwen2_moe, qwen3_moe --
    # Mixtral: every layer MoE (4 experts, top-2, renormalised); Qwen2-MoE: a leading dense
    # layer (mlp_only_layers), 8 experts top-2 unnormalised, a gated shared expert, q/k/v
    # biases; Qwen3-MoE: per-head q/k norms, 8 experts top-2 renormalised, head_dim 16
    Family("mixtral", _cfg("MixtralConfig", hidden_size=64, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
                           max_position_embeddings=256),
           positions="rotary", moe=_EVERY_WORLD),
    Family("qwen2_moe", _cfg("Qwen2MoeConfig", hidden_size=64, intermediate_size=128,
                             moe_intermediate_size=32, shared_expert_intermediate_size=64,
                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                             mlp_only_layers=[0], vocab_size=256,
                             max_position_embeddings=256),
           positions="rotary", moe=_EVERY_WORLD),
    Family("qwen3_moe", _cfg("Qwen3MoeConfig", hidden_size=64, intermediate_size=128,
                             moe_intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                             vocab_size=256, max_position_embeddings=256),
           positions="rotary", moe=_EVERY_WORLD),
    # -- moe: deepseek_v3 --
    # DeepSeek-V3: multi-head latent attention (query LoRA, latent 32 + rotary 8, key part 16,
    # value 16: v narrower than q/k), interleaved rotary; a leading dense layer
    # (first_k_dense_replace), 8 experts in 4 groups (2 chosen), top-2, sigmoid router with
    # correction bias, routed_scaling_factor 1.5, 1 shared expert. Its bf16 bound is its own:
    # sigmoid scores of tiny random routers lie within a bf16 ulp of each other, so HF's own
    # bf16 model re-routes tokens against its fp32 one and lands 0.037 from it (at V3's scale
    # 2.5: 0.067); shardwise's bf16 is 0.004 from HF fp32 and 0.037 from HF bf16 (measured;
    # another group split only moves which model re-routes: 2 groups, HF 0.004, shardwise 0.018)
    Family("deepseek_v3", _cfg("DeepseekV3Config", hidden_size=64, intermediate_size=128,
                               moe_intermediate_size=32, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                               v_head_dim=16, n_routed_experts=8, n_group=4, topk_group=2,
                               num_experts_per_tok=2, n_shared_experts=1,
                               routed_scaling_factor=1.5, first_k_dense_replace=1,
                               num_mtp_layers=0, vocab_size=256, max_position_embeddings=256),
           positions="rotary", moe=_EVERY_WORLD, tolerances={"moe_bf16": 0.05}),
    # its attention alone (every layer dense): one q_proj (no query LoRA), "half" rotary
    # (rope_interleave off), a value wider than q/k (v 32 > 16 + 8), YaRN as V3's (mscale in
    # the score scale: 0.265, not 24 ** -0.5)
    Family("deepseek_v3-mla", _cfg("DeepseekV3Config", hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=32,
                                   rope_interleave=False, first_k_dense_replace=2,
                                   num_mtp_layers=0, vocab_size=256,
                                   max_position_embeddings=256,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                    "factor": 4.0, "mscale": 1.0,
                                                    "mscale_all_dim": 1.0, "beta_fast": 32.0,
                                                    "beta_slow": 1.0,
                                                    "original_max_position_embeddings": 64}),
           positions="rotary", inject=(1,), graph_step=True),
    # -- moe: gpt_oss --
    # GPT-OSS: attention sinks, a sliding layer (window 4, shorter than the test prompts) then a
    # full one, YaRN rotary (each frequency once), q/k/v/o biases; 4 experts top-2 with a router
    # bias, expert biases and the clamped SwiGLU (limit 0.1: it bites at these tiny weights);
    # tp=2, ep=2 and both on 2 ranks also in test_attention_sinks.py
    Family("gpt_oss", _cfg("GptOssConfig", hidden_size=64, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                           sliding_window=4, swiglu_limit=0.1, vocab_size=256,
                           max_position_embeddings=256,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                            "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                            "truncate": False,
                                            "original_max_position_embeddings": 64}),
           positions="rotary", inject=(1,), graph_step=True, moe=_EVERY_WORLD),
]

#: family name → :class:`Family`, in registry order
FAMILIES: dict[str, Family] = {f.name: f for f in _FAMILIES}
if len(FAMILIES) != len(_FAMILIES):
    raise RuntimeError("tests/families.py: a family name is registered twice")

_FIELDS = {f.name for f in dataclasses.fields(Family)} | {"model_type"}
_WORLDS = {"inject", "checkpoint", "quant_bits", "moe"}  # tuple fields: a criterion is a member


def family(name: str) -> Family:
    """The registered family ``name`` (a ``KeyError`` listing the registered names if none)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"no test family {name!r}: tests/families.py registers "
                       f"{', '.join(FAMILIES)}") from None


def _matches(fam: Family, key: str, want) -> bool:
    have = getattr(fam, key)
    if key in _WORLDS:
        return bool(have) == want if isinstance(want, bool) else want in have
    if isinstance(want, (list, tuple, set, frozenset)):
        return have in want
    return have == want


def families(**criteria) -> list[str]:
    """Names of the families matching every criterion, in registry order.

    A criterion names a :class:`Family` field: ``kind="causal"``, ``tp=True``,
    ``model_type=("bloom", "falcon")`` (a collection: the field is one of them). For the tuple
    fields (``inject``, ``checkpoint``, ``quant_bits``, ``moe``) a number asks for a member
    (``inject=2``: injection checked at TP=2) and a bool for any/none. No criterion: every
    family. A selection that matches nothing is an error (a parametrize over ``[]`` would pass
    silently).
    """
    unknown = set(criteria) - _FIELDS
    if unknown:
        raise TypeError(f"families(): no field {', '.join(sorted(unknown))}; "
                        f"the fields are {', '.join(sorted(_FIELDS))}")
    names = [f.name for f in _FAMILIES
             if all(_matches(f, key, want) for key, want in criteria.items())]
    if not names:
        raise ValueError(f"families({criteria}) selects no family: see tests/families.py")
    return names

"""MoE injection data: how a family's Hugging Face Mixture-of-Experts block is laid out.

A family policy sets ``moe = MoESpec(...)`` (:attr:`shardwise.policy.Policy.moe`); the one generic
MoE mechanism (:mod:`shardwise.moe`) reads nothing else, so a new MoE family is a policy, not new
code. Which layers are MoE, how many experts, top-k and the router groups are the plan's
(:class:`shardwise.plan.ExpertPlan`, read through ``Policy.moe_config``); this spec says where the
parts are and how the router scores.

Names are dotted attribute paths: ``block`` on one decoder layer, the rest on the block.

Example (Qwen2-MoE)::

    MoESpec(block="mlp", router="gate", experts="experts", renormalize="norm_topk_prob",
            shared="shared_expert", shared_gate="shared_expert_gate")

The experts module's contract (what :mod:`shardwise.moe` installs on HF's experts module, and
what a replacement such as a quantized experts module implements): called as a module,
``experts(x [T, H], experts [T, k] int64, weights [T, k] float) → [T, H]``, where an expert index
is *local* to the rank (``0 .. E_local - 1``) and ``E_local`` itself marks a slot whose expert
lives on another rank (it contributes nothing here; see the ``moe_grouped_mlp`` kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

#: expert weight layouts: "stacked" = HF's MixtralExperts (gate_up_proj [E, 2I, H], gate rows
#: then up rows; down_proj [E, H, I]); "gpt_oss" = GptOssExperts (gate_up_proj [E, H, 2I] with
#: gate/up interleaved, gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H])
EXPERT_LAYOUTS = ("stacked", "gpt_oss")
SCORINGS = ("softmax", "sigmoid")
#: the router logits' dtype: "input" = the hidden states' (Mixtral, Qwen), "float32" (DeepSeek-V3)
ROUTER_DTYPES = ("input", "float32")


@dataclass(frozen=True)
class MoESpec:
    """One family's MoE block, as data (validated on construction).

    Attributes:
        block: the MoE block on a decoder layer (``"mlp"``, ``"block_sparse_moe"``); layers the
            plan does not list as MoE keep their dense MLP (``InjectionSpec.mlp``).
        router: the router on the block (``"gate"``, ``"router"``): a module holding ``weight``
            [E, H] and, when the family has one, ``bias`` [E] (GPT-OSS).
        experts: the experts module on the block, holding the 3-D expert weights.
        layout: the experts' weight layout (:data:`EXPERT_LAYOUTS`).
        scoring: ``"softmax"`` or ``"sigmoid"`` (DeepSeek-V3).
        router_dtype: the dtype of the router logits (:data:`ROUTER_DTYPES`).
        renormalize: divide the top-k weights by their sum: a bool, or the config attribute that
            says (``"norm_topk_prob"``).
        scale_config: config attribute with a factor on the routed weights
            (``"routed_scaling_factor"``); None: 1.
        correction_bias: router attribute with a bias added to the scores for the choice only
            (DeepSeek-V3's ``"e_score_correction_bias"``); None: none.
        activation_config: config attributes naming the experts' activation, tried in order.
        clamp_config / alpha_config: config attributes of GPT-OSS's clamped SwiGLU (limit,
            alpha); None: the plain GLU.
        clamp_attrs: the experts module's attributes holding the same (limit, alpha), read
            where the config lacks them (transformers before 5.2x kept them on the module).
        shared: the always-on shared expert(s) on the block, a dense gated MLP
            (``"shared_expert"``, ``"shared_experts"``); None: none.
        shared_gate: a linear [1, H] on the block whose sigmoid scales the shared expert's
            output (Qwen2-MoE's ``"shared_expert_gate"``); None: unscaled.
        returns_router_scores: the block's forward returns ``(hidden, router_scores)`` and the
            HF decoder layer unpacks it (GPT-OSS), instead of the hidden states alone.
    """

    block: str
    router: str
    experts: str = "experts"
    layout: str = "stacked"
    scoring: str = "softmax"
    router_dtype: str = "input"
    renormalize: bool | str = True
    scale_config: str | None = None
    correction_bias: str | None = None
    activation_config: tuple[str, ...] = ("hidden_act",)
    clamp_config: str | None = None
    alpha_config: str | None = None
    clamp_attrs: tuple[str, str] | None = None
    shared: str | None = None
    shared_gate: str | None = None
    returns_router_scores: bool = False

    def __post_init__(self) -> None:
        problems = []
        for name in ("block", "router", "experts"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                problems.append(f"{name}={value!r} (a dotted module name)")
        for name, value, allowed in (("layout", self.layout, EXPERT_LAYOUTS),
                                     ("scoring", self.scoring, SCORINGS),
                                     ("router_dtype", self.router_dtype, ROUTER_DTYPES)):
            if value not in allowed:
                problems.append(f"{name}={value!r} (one of {allowed})")
        if not isinstance(self.renormalize, (bool, str)):
            problems.append(f"renormalize={self.renormalize!r} (a bool or a config attribute)")
        if self.shared_gate and not self.shared:
            problems.append("shared_gate needs shared (the shared expert it scales)")
        if (self.clamp_config is None) != (self.alpha_config is None):
            problems.append("clamp_config and alpha_config go together (GPT-OSS's SwiGLU)")
        if problems:
            raise ConfigError("invalid MoESpec: " + "; ".join(problems))

"""Injection data: how a family's Hugging Face layers map onto shardwise's inference layer.

A family policy (:class:`shardwise.policy.Policy`) sets ``injection = InjectionSpec(...)``; the one
generic injector (:mod:`shardwise.inject.injector`) reads nothing else. Names are dotted attribute
paths: ``base_model`` on the ``*ForCausalLM`` shell, ``embed``/``pos_embed``/``final_norm``/
``layers``/``rotary_module`` on the base model, the rest on one decoder layer.
"""

from __future__ import annotations

from dataclasses import dataclass

#: HF activation names → (kernel op, GELU approximation). Anything else is refused at injection.
ACTIVATIONS: dict[str, tuple[str, str]] = {
    "silu": ("silu_and_mul", ""), "swish": ("silu_and_mul", ""),
    "gelu": ("bias_gelu", "none"),
    "gelu_new": ("bias_gelu", "tanh"), "gelu_pytorch_tanh": ("bias_gelu", "tanh"),
}
NORMS = ("rms", "layer")
POSITIONS = ("rotary", "learned")
MLPS = ("gated", "plain")


@dataclass(frozen=True)
class InjectionSpec:
    """One family's layer layout, as data (see the module docstring).

    Attributes:
        base_model: the decoder stack on the causal-LM shell (``"model"``, ``"transformer"``).
        layers: the ``ModuleList`` of decoder layers on the base model.
        embed: token embedding on the base model.
        final_norm: the norm after the last layer, on the base model.
        norm: ``"rms"`` (weight only) or ``"layer"`` (weight and bias); eps is read from the
            norm module (``variance_epsilon`` or ``eps``).
        attn_norm / mlp_norm: the layer's norms before attention / before the MLP
            (``mlp_norm=None`` with ``parallel_residual``: one norm feeds both, GPT-J).
        qkv: one fused projection (``("attn.c_attn",)``, output ``[q | k | v]``) or three
            (``q``, ``k``, ``v``) — linears or transformers ``Conv1D``s, called as modules so
            tensor-parallel hooks run.
        out_proj: the attention output projection (row-parallel under TP: its all-reduce hook
            is the communicator's).
        positions: ``"rotary"`` (the base model's own rotary module gives cos/sin, so rope
            scaling variants come for free) or ``"learned"`` (``pos_embed`` added to the input).
        rotary_style: ``"half"`` (Llama/NeoX) or ``"interleaved"`` (GPT-J).
        mlp: ``"gated"`` (``mlp_in`` = gate, up; ``silu(gate) * up``) or ``"plain"``
            (``mlp_in`` = one projection, then the activation).
        mlp_out: the MLP's output projection (row-parallel under TP).
        activation_config: config attributes naming the activation, tried in order.
        parallel_residual: ``x + attn(n1(x)) + mlp(n2(x))`` instead of the sequential form.
        inverse_layer_scale_config: config flag that divides the attention scale by
            ``layer_idx + 1`` (GPT-2's ``scale_attn_by_inverse_layer_idx``).
        unscaled_config: config flag that, when False, means no ``1/sqrt(d)`` scale
            (GPT-2's ``scale_attn_weights``).
    """

    base_model: str
    layers: str
    embed: str
    final_norm: str
    norm: str
    attn_norm: str
    mlp_norm: str | None
    qkv: tuple[str, ...]
    out_proj: str
    positions: str
    mlp: str
    mlp_in: tuple[str, ...]
    mlp_out: str
    activation_config: tuple[str, ...] = ("hidden_act",)
    rotary_module: str | None = None
    rotary_style: str = "half"
    pos_embed: str | None = None
    parallel_residual: bool = False
    inverse_layer_scale_config: str | None = None
    unscaled_config: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.norm not in NORMS:
            problems.append(f"norm={self.norm!r} (one of {NORMS})")
        if self.positions not in POSITIONS:
            problems.append(f"positions={self.positions!r} (one of {POSITIONS})")
        if self.mlp not in MLPS:
            problems.append(f"mlp={self.mlp!r} (one of {MLPS})")
        if len(self.qkv) not in (1, 3):
            problems.append(f"qkv={self.qkv!r} (one fused or three projections)")
        if len(self.mlp_in) != (2 if self.mlp == "gated" else 1):
            problems.append(f"mlp_in={self.mlp_in!r} (gated: gate, up; plain: one)")
        if self.positions == "rotary" and not self.rotary_module:
            problems.append("rotary positions need rotary_module")
        if self.positions == "learned" and not self.pos_embed:
            problems.append("learned positions need pos_embed")
        if self.mlp_norm is None and not self.parallel_residual:
            problems.append("mlp_norm=None needs parallel_residual=True")
        if problems:
            raise ValueError("invalid InjectionSpec: " + "; ".join(problems))

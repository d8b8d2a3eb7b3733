"""Injection data: how a family's Hugging Face layers map onto shardwise's inference layer.

A family policy (:class:`shardwise.policy.Policy`) sets ``injection = InjectionSpec(...)``; the one
generic injector (:mod:`shardwise.inject.injector`) reads nothing else. Names are dotted attribute
paths: ``base_model`` on the ``*ForCausalLM`` shell, ``embed``/``pos_embed``/``final_norm``/
``layers``/``rotary_module`` on the base model, the rest on one decoder layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: HF activation names → (kernel op, GELU approximation). Anything else is refused at injection.
ACTIVATIONS: dict[str, tuple[str, str]] = {
    "silu": ("silu_and_mul", ""), "swish": ("silu_and_mul", ""),
    "gelu": ("bias_gelu", "none"),
    "gelu_new": ("bias_gelu", "tanh"), "gelu_pytorch_tanh": ("bias_gelu", "tanh"),
    "gelu_fast": ("bias_gelu", "tanh"), "relu": ("bias_relu", ""),
}
NORMS = ("rms", "layer")
POSITIONS = ("rotary", "learned", "alibi")
MLPS = ("gated", "plain")
QKV_LAYOUTS = ("blocks", "grouped")


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
        qkv: one fused projection (``("attn.c_attn",)``) or three (``q``, ``k``, ``v``) —
            linears or transformers ``Conv1D``s, called as modules so tensor-parallel hooks run.
        qkv_layout: the fused projection's output features: ``"blocks"`` = ``[q | k | v]``
            (GPT-2, Phi-3) or ``"grouped"`` = ``[kv_heads, q_per_kv + 2, head_dim]`` — each kv
            group's q heads, then its k and v (Falcon; GPT-NeoX and BLOOM are the case
            ``q_per_kv = 1``: ``[heads, 3, head_dim]``).
        out_proj: the attention output projection (row-parallel under TP: its all-reduce hook
            is the communicator's).
        positions: ``"rotary"`` (cos/sin from the base model's own ``rotary_module``, so rope
            scaling variants come for free, or — without one — built from ``rotary_dim_config``
            and ``rotary_base``), ``"learned"`` (``pos_embed`` added to the input) or
            ``"alibi"`` (per-head linear key-position biases; BLOOM, Falcon-RW).
        rotary_style: ``"half"`` (Llama/NeoX) or ``"interleaved"`` (GPT-J).
        rotary_dim_config: config attribute with the rotated dims per head (None: all of them)
            when the table is built here (GPT-J's ``rotary_dim``); rotary_base: its base.
        pos_offset: added to position ids before ``pos_embed`` (OPT's offset of 2).
        positions_from_mask: without explicit position ids, a left-padded sequence counts its
            positions from its first real token (OPT), else positions are ``past + arange``.
        alibi_scaled: the ALiBi bias is multiplied by the attention scale too (Falcon).
        attention_scale: a fixed score scale instead of ``head_dim ** -0.5`` (GPT-Neo: 1.0).
        window_config: config attribute with a sliding-window size (None or absent: no window);
            a query at position i then sees keys j with ``i - j < window``.
        layer_kinds_config / windowed_kinds: config attribute listing each layer's kind, and the
            kinds that use the window (absent list: every layer does — Mistral, Phi-3).
        embed_norm: a norm on the base model applied to the embeddings (BLOOM).
        project_in / project_out: optional linears on the base model after the embeddings /
            after the final norm (OPT's ``word_embed_proj_dim``); absent or None: skipped.
        mlp: ``"gated"`` (``mlp_in`` = gate, up — or one fused ``[gate | up]`` projection;
            ``silu(gate) * up``) or ``"plain"`` (``mlp_in`` = one projection, then the
            activation).
        mlp_out: the MLP's output projection (row-parallel under TP).
        activation_config: config attributes naming the activation, tried in order;
            activation: the name to use when none of them is set (BLOOM has no such attribute).
        parallel_residual: ``x + attn(n1(x)) + mlp(n2(x))`` instead of the sequential form;
            parallel_residual_config: config flag that decides it instead (GPT-NeoX).
        refuse_config: ``(attribute, value, what)`` rows: a config with that value is a layer
            structure the injected layer does not implement (``what`` names it in the error).
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
    activation: str | None = None
    qkv_layout: str = "blocks"
    rotary_module: str | None = None
    rotary_style: str = "half"
    rotary_dim_config: str | None = None
    rotary_base: float = 10000.0
    pos_embed: str | None = None
    pos_offset: int = 0
    positions_from_mask: bool = False
    alibi_scaled: bool = False
    attention_scale: float | None = None
    window_config: str | None = None
    layer_kinds_config: str | None = None
    windowed_kinds: tuple[str, ...] = ()
    embed_norm: str | None = None
    project_in: str | None = None
    project_out: str | None = None
    parallel_residual: bool = False
    parallel_residual_config: str | None = None
    inverse_layer_scale_config: str | None = None
    unscaled_config: str | None = None
    refuse_config: tuple[tuple[str, Any, str], ...] = ()

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
        if self.qkv_layout not in QKV_LAYOUTS:
            problems.append(f"qkv_layout={self.qkv_layout!r} (one of {QKV_LAYOUTS})")
        if len(self.mlp_in) not in ((1, 2) if self.mlp == "gated" else (1,)):
            problems.append(f"mlp_in={self.mlp_in!r} (gated: gate, up or one fused [gate | up]; "
                            f"plain: one)")
        if self.positions == "learned" and not self.pos_embed:
            problems.append("learned positions need pos_embed")
        if self.mlp_norm is None and not self.parallel_residual:
            problems.append("mlp_norm=None needs parallel_residual=True")
        if problems:
            raise ValueError("invalid InjectionSpec: " + "; ".join(problems))

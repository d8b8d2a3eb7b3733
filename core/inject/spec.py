"""Injection data: how a family's Hugging Face layers map onto shardwise's inference layer.

A family policy (:class:`shardwise.policy.Policy`) sets ``injection = InjectionSpec(...)``; the one
generic injector (:mod:`shardwise.inject.injector`) reads nothing else. The spec holds the
structural names of the decoder stack and four groups, so a new family quirk lands in one of
them:

* :class:`Positions` — how token positions enter (rotary, learned embeddings, ALiBi);
* :class:`Attention` — the q/k/v and output projections, the score scale, sliding windows;
* :class:`MLP` — the MLP's projections and its activation;
* :class:`Residual` — the norms and the residual form (sequential or parallel).

Names are dotted attribute paths: ``base_model`` on the ``*ForCausalLM`` shell; ``layers``,
``embed``, ``project_in``/``project_out``, ``Residual.final_norm``/``embed_norm``,
``Positions.embed``/``rotary_module`` on the base model; the rest on one decoder layer.

Example (Llama)::

    InjectionSpec(
        base_model="model", layers="layers", embed="embed_tokens",
        positions=Positions("rotary", rotary_module="rotary_emb"),
        attention=Attention(qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                            out_proj="self_attn.o_proj"),
        mlp=MLP("gated", in_proj=("mlp.gate_proj", "mlp.up_proj"), out_proj="mlp.down_proj"),
        residual=Residual("rms", attn_norm="input_layernorm",
                          mlp_norm="post_attention_layernorm", final_norm="norm"))

A config-dependent variant (``Policy.injection_overrides``) replaces a whole group:
``({"alibi": True}, {"positions": Positions("alibi", alibi_scaled=True)})``.

The flat fields of earlier versions (``norm=``, ``qkv=``, ``rotary_module=`` …) are refused with
a :class:`MovedFieldError` naming each one's new place (:data:`MOVED`), when a spec is built or
replaced with them and when one is read (:class:`GroupedSpec`, which the encoder spec of
:mod:`shardwise.inject.encoder` shares).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

#: HF activation names → (kernel op, GELU approximation). Anything else is refused at injection.
ACTIVATIONS: dict[str, tuple[str, str]] = {
    "silu": ("silu_and_mul", ""), "swish": ("silu_and_mul", ""),
    "gelu": ("bias_gelu", "none"),
    "gelu_new": ("bias_gelu", "tanh"), "gelu_pytorch_tanh": ("bias_gelu", "tanh"),
    "gelu_fast": ("bias_gelu", "tanh"), "relu": ("bias_relu", ""),
}
NORMS = ("rms", "layer")
POSITIONS = ("rotary", "learned", "alibi")
ROTARY_STYLES = ("half", "interleaved")
MLPS = ("gated", "plain")
QKV_LAYOUTS = ("blocks", "grouped")


class MovedFieldError(ConfigError, AttributeError):
    """A flat :class:`InjectionSpec` field of earlier versions was used; the message names the
    group it moved to (see :data:`MOVED`)."""


def _check(owner: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"invalid {owner}: " + "; ".join(problems))


def _is_names(value: Any, counts: tuple[int, ...]) -> bool:
    """Whether ``value`` is a tuple of ``counts`` non-empty module names."""
    return (isinstance(value, tuple) and len(value) in counts
            and all(isinstance(n, str) and n for n in value))


@dataclass(frozen=True)
class Positions:
    """How token positions enter the decoder (validated on construction).

    Attributes:
        kind: ``"rotary"`` (cos/sin from the base model's own ``rotary_module``, so rope scaling
            variants come for free, or — without one — built from ``rotary_dim_config`` and
            ``rotary_base``), ``"learned"`` (``embed`` added to the input) or ``"alibi"``
            (per-head linear key-position biases; BLOOM, Falcon-RW).
        rotary_module: the base model's rotary embedding module (``"rotary_emb"``); None: the
            table is built here.
        rotary_style: ``"half"`` (Llama/NeoX) or ``"interleaved"`` (GPT-J).
        rotary_half_table: the ``rotary_module`` returns each frequency once, cos/sin
            ``[.., rotary_dim // 2]`` (GPT-OSS), not twice ``[.., rotary_dim]`` (Llama's
            ``cat(freqs, freqs)``).
        rotary_dim_config: config attribute with the rotated dims per head (None: all of them)
            when the table is built here (GPT-J's ``rotary_dim``).
        rotary_base: the base of a table built here.
        embed: the learned position embedding on the base model (``"wpe"``).
        offset: added to position ids before ``embed`` (OPT's offset of 2).
        from_mask: without explicit position ids, a left-padded sequence counts its positions
            from its first real token (OPT), else positions are ``past + arange``.
        alibi_scaled: the ALiBi bias is multiplied by the attention scale too (Falcon).
    """

    kind: str
    rotary_module: str | None = None
    rotary_style: str = "half"
    rotary_half_table: bool = False
    rotary_dim_config: str | None = None
    rotary_base: float = 10000.0
    embed: str | None = None
    offset: int = 0
    from_mask: bool = False
    alibi_scaled: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.kind not in POSITIONS:
            problems.append(f"kind={self.kind!r} (one of {POSITIONS})")
        if self.rotary_style not in ROTARY_STYLES:
            problems.append(f"rotary_style={self.rotary_style!r} (one of {ROTARY_STYLES})")
        if self.kind == "learned" and not self.embed:
            problems.append("learned positions need embed (the position embedding)")
        _check("Positions", problems)


@dataclass(frozen=True)
class Attention:
    """The attention block of one decoder layer (validated on construction).

    Attributes:
        qkv: one fused projection (``("attn.c_attn",)``) or three (``q``, ``k``, ``v``) —
            linears, transformers ``Conv1D``s or quantized linears, called as modules so
            tensor-parallel hooks run.
        out_proj: the attention output projection (row-parallel under TP: its all-reduce hook
            is the communicator's). Its parent module's ``scaling``, when it has one, is the
            score scale.
        qkv_layout: the fused projection's output features: ``"blocks"`` = ``[q | k | v]``
            (GPT-2, Phi-3) or ``"grouped"`` = ``[kv_heads, q_per_kv + 2, head_dim]`` — each kv
            group's q heads, then its k and v (Falcon; GPT-NeoX and BLOOM are the case
            ``q_per_kv = 1``: ``[heads, 3, head_dim]``).
        scale: a fixed score scale instead of ``head_dim ** -0.5`` (GPT-Neo: 1.0).
        window_config: config attribute with a sliding-window size (None or absent: no window);
            a query at position i then sees keys j with ``i - j < window``.
        layer_kinds_config / windowed_kinds: config attribute listing each layer's kind, and the
            kinds that use the window (absent list: every layer does — Mistral, Phi-3).
        inverse_layer_scale_config: config flag that divides the score scale by
            ``layer_idx + 1`` (GPT-2's ``scale_attn_by_inverse_layer_idx``).
        unscaled_config: config flag that, when False, means no ``1/sqrt(d)`` scale
            (GPT-2's ``scale_attn_weights``).
        qk_norm: the per-head norms of q and k (``("self_attn.q_norm", "self_attn.k_norm")``,
            Qwen3-MoE), applied over each head's ``head_dim`` before the rotary; None: none.
        sinks: the parameter on the layer holding each query head's attention-sink logit
            [heads], which joins every softmax's denominator (GPT-OSS's ``"self_attn.sinks"``;
            the kernels' ``sinks=``); None: none.
    """

    qkv: tuple[str, ...]
    out_proj: str
    qkv_layout: str = "blocks"
    scale: float | None = None
    window_config: str | None = None
    layer_kinds_config: str | None = None
    windowed_kinds: tuple[str, ...] = ()
    inverse_layer_scale_config: str | None = None
    unscaled_config: str | None = None
    qk_norm: tuple[str, str] | None = None
    sinks: str | None = None

    @property
    def fused(self) -> bool:
        """One fused q/k/v projection (else three)."""
        return len(self.qkv) == 1

    @property
    def cache_tensors(self) -> int:
        """Tensors per layer in the static KV cache: keys and values (a
        :class:`LatentAttention`'s latent is both: 1)."""
        return 2

    def __post_init__(self) -> None:
        problems = []
        if not _is_names(self.qkv, (1, 3)):
            problems.append(f"qkv={self.qkv!r} (one fused or three projections, as a tuple)")
        if not isinstance(self.out_proj, str) or not self.out_proj:
            problems.append(f"out_proj={self.out_proj!r} (a dotted module name)")
        if self.qkv_layout not in QKV_LAYOUTS:
            problems.append(f"qkv_layout={self.qkv_layout!r} (one of {QKV_LAYOUTS})")
        if self.windowed_kinds and not self.layer_kinds_config:
            problems.append("windowed_kinds needs layer_kinds_config (where the kinds are read)")
        if self.qk_norm is not None and not _is_names(self.qk_norm, (2,)):
            problems.append(f"qk_norm={self.qk_norm!r} (the q norm and the k norm, as a tuple)")
        if self.sinks is not None and (not isinstance(self.sinks, str) or not self.sinks):
            problems.append(f"sinks={self.sinks!r} (a dotted parameter name, or None)")
        _check("Attention", problems)


@dataclass(frozen=True)
class LatentAttention(Attention):
    """Multi-head latent attention (DeepSeek-V2/V3's MLA; validated on construction): keys and
    values come from one low-rank latent per token shared by every head, plus one rotary key
    part shared by every head. The injected layer runs it with :mod:`shardwise.inject.mla`,
    whose docstring gives the math and the KV cache it keeps (the latent: :attr:`cache_tensors`
    is 1). ``qkv`` stays empty; the score scale, windows and ``out_proj`` are as
    :class:`Attention` (the scale: the attention module's ``scaling``, YaRN's factor included,
    or ``scale``). The widths (latent, key parts, value) are read from the weights' shapes.

    Attributes:
        q_proj: the one query projection [heads * (nope + rope), hidden] of a model without
            query LoRA (DeepSeek's ``q_lora_rank=None``).
        q_a_proj / q_a_norm / q_b_proj: the query LoRA: down-projection, its RMS norm, and the
            up-projection to [heads * (nope + rope)]. A model has these or ``q_proj``; the
            policy may name both and each layer uses what it holds.
        kv_a_proj: hidden → [latent | rotary key] (``kv_a_proj_with_mqa``).
        kv_a_norm: the RMS norm of the latent.
        kv_b_proj: latent → per head [key without rotary | value] (column-parallel by heads
            under TP); it has no bias.
    """

    qkv: tuple[str, ...] = ()
    out_proj: str = ""
    q_proj: str | None = None
    q_a_proj: str | None = None
    q_a_norm: str | None = None
    q_b_proj: str | None = None
    kv_a_proj: str = ""
    kv_a_norm: str = ""
    kv_b_proj: str = ""

    @property
    def cache_tensors(self) -> int:
        """The latent cache is keys and values at once (:mod:`shardwise.inject.mla`)."""
        return 1

    def __post_init__(self) -> None:
        problems = []
        if self.qkv:
            problems.append(f"qkv={self.qkv!r} (latent attention has no q/k/v projections: "
                            f"leave it empty)")
        for name in ("out_proj", "kv_a_proj", "kv_a_norm", "kv_b_proj"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                problems.append(f"{name}={value!r} (a dotted module name)")
        lora = (self.q_a_proj, self.q_a_norm, self.q_b_proj)
        if not self.q_proj and not all(lora):
            problems.append("the queries need q_proj or all of q_a_proj, q_a_norm, q_b_proj")
        if self.qkv_layout != "blocks" or self.qk_norm is not None:
            problems.append("qkv_layout / qk_norm do not apply to latent attention")
        if self.windowed_kinds and not self.layer_kinds_config:
            problems.append("windowed_kinds needs layer_kinds_config (where the kinds are read)")
        _check("LatentAttention", problems)


@dataclass(frozen=True)
class MLP:
    """The MLP of one decoder layer (validated on construction).

    Attributes:
        kind: ``"gated"`` (``in_proj`` = gate, up — or one fused ``[gate | up]`` projection;
            ``act(gate) * up``) or ``"plain"`` (``in_proj`` = one projection, then the
            activation).
        in_proj: the input projection(s) (column-parallel under TP).
        out_proj: the output projection (row-parallel under TP).
        activation_config: config attributes naming the activation, tried in order (one of
            :data:`ACTIVATIONS`; gated MLPs take SiLU, plain ones GELU or ReLU).
        activation: the name to use when none of them is set (BLOOM has no such attribute).
    """

    kind: str
    in_proj: tuple[str, ...]
    out_proj: str
    activation_config: tuple[str, ...] = ("hidden_act",)
    activation: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.kind not in MLPS:
            problems.append(f"kind={self.kind!r} (one of {MLPS})")
        if not _is_names(self.in_proj, (1, 2) if self.kind == "gated" else (1,)):
            problems.append(f"in_proj={self.in_proj!r} (gated: gate, up or one fused "
                            f"[gate | up]; plain: one; as a tuple)")
        if not isinstance(self.out_proj, str) or not self.out_proj:
            problems.append(f"out_proj={self.out_proj!r} (a dotted module name)")
        if not isinstance(self.activation_config, tuple):
            problems.append(f"activation_config={self.activation_config!r} (a tuple)")
        if self.activation is not None and self.activation not in ACTIVATIONS:
            problems.append(f"activation={self.activation!r} (one of {tuple(ACTIVATIONS)})")
        _check("MLP", problems)


@dataclass(frozen=True)
class Residual:
    """The residual stream: its norms and its form (validated on construction).

    Attributes:
        norm: ``"rms"`` (weight only) or ``"layer"`` (weight and bias); eps is read from each
            norm module (``variance_epsilon`` or ``eps``).
        attn_norm / mlp_norm: the layer's norms before attention / before the MLP
            (``mlp_norm=None`` with ``parallel``: one norm feeds both, GPT-J).
        final_norm: the norm after the last layer, on the base model.
        embed_norm: a norm on the base model applied to the embeddings (BLOOM).
        parallel: ``x + attn(n1(x)) + mlp(n2(x))`` instead of the sequential form;
            parallel_config: config flag that decides it instead (GPT-NeoX).
    """

    norm: str
    attn_norm: str
    mlp_norm: str | None
    final_norm: str
    embed_norm: str | None = None
    parallel: bool = False
    parallel_config: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.norm not in NORMS:
            problems.append(f"norm={self.norm!r} (one of {NORMS})")
        if self.mlp_norm is None and not self.parallel:
            problems.append("mlp_norm=None needs parallel=True")
        _check("Residual", problems)


#: flat field of earlier versions → its place now (``group.field``)
MOVED: dict[str, str] = {
    "final_norm": "residual.final_norm", "norm": "residual.norm",
    "attn_norm": "residual.attn_norm", "mlp_norm": "residual.mlp_norm",
    "embed_norm": "residual.embed_norm", "parallel_residual": "residual.parallel",
    "parallel_residual_config": "residual.parallel_config",
    "qkv": "attention.qkv", "qkv_layout": "attention.qkv_layout",
    "out_proj": "attention.out_proj", "attention_scale": "attention.scale",
    "window_config": "attention.window_config",
    "layer_kinds_config": "attention.layer_kinds_config",
    "windowed_kinds": "attention.windowed_kinds",
    "inverse_layer_scale_config": "attention.inverse_layer_scale_config",
    "unscaled_config": "attention.unscaled_config",
    "mlp_in": "mlp.in_proj", "mlp_out": "mlp.out_proj",
    "activation_config": "mlp.activation_config", "activation": "mlp.activation",
    "rotary_module": "positions.rotary_module", "rotary_style": "positions.rotary_style",
    "rotary_dim_config": "positions.rotary_dim_config", "rotary_base": "positions.rotary_base",
    "pos_embed": "positions.embed", "pos_offset": "positions.offset",
    "positions_from_mask": "positions.from_mask", "alibi_scaled": "positions.alibi_scaled",
}


class GroupedSpec:
    """Base of the injection specs whose fields are grouped into sub-specs: the flat fields of
    earlier versions are refused with a :class:`MovedFieldError` naming each one's new place,
    when a spec is built or ``dataclasses.replace``-d with them (before ``__init__``, so not as
    "unexpected keyword argument") and when one is read.

    A subclass sets ``_moved`` (flat name → ``group.field``), ``_kind_fields`` (flat names that
    are a group's name now, their string value the group's ``kind`` → the group's class name),
    ``_groups`` (field → the group class it must hold) and ``_layout`` (its signature, shown in
    the error).
    """

    _moved: dict[str, str] = {}
    _kind_fields: dict[str, str] = {}
    _groups: dict[str, type] = {}
    _layout = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        flat = {name: value for name, value in kwargs.items()
                if name in cls._moved or (name in cls._kind_fields and isinstance(value, str))}
        if flat:
            rows = [f"{name}={value!r} -> {cls._kind_fields[name]}({value!r}, ...)"
                    if name in cls._kind_fields else f"{name} -> {cls._moved[name]}"
                    for name, value in flat.items()]
            raise MovedFieldError(
                f"{cls.__name__} was given flat field(s) of an earlier shardwise: "
                f"{'; '.join(rows)}. The fields are grouped now: {cls.__name__}({cls._layout}); "
                f"see {cls.__module__}")
        return super().__new__(cls)

    def __getattr__(self, name: str) -> Any:
        # only reached when normal lookup fails: maybe a flat field of earlier versions
        cls = type(self)
        if name in cls._moved:
            raise MovedFieldError(f"{cls.__name__}.{name} moved to {cls.__name__}."
                                  f"{cls._moved[name]} (the fields are grouped now; see "
                                  f"{cls.__module__})")
        raise AttributeError(f"{cls.__name__!r} object has no attribute {name!r}")

    def _group_problems(self) -> list[str]:
        """Each group field that does not hold its group class."""
        return [f"{name}={getattr(self, name)!r} (a {group.__name__}(...))"
                for name, group in self._groups.items()
                if not isinstance(getattr(self, name), group)]


@dataclass(frozen=True)
class InjectionSpec(GroupedSpec):
    """One decoder family's layer layout, as data (see the module docstring).

    Attributes:
        base_model: the decoder stack on the causal-LM shell (``"model"``, ``"transformer"``).
        layers: the ``ModuleList`` of decoder layers on the base model.
        embed: token embedding on the base model.
        positions: how positions enter (:class:`Positions`).
        attention: the attention projections, score scale and windows (:class:`Attention`).
        mlp: the MLP's projections and activation (:class:`MLP`).
        residual: the norms and residual form (:class:`Residual`).
        project_in / project_out: optional linears on the base model after the embeddings /
            after the final norm (OPT's ``word_embed_proj_dim``); absent or None: skipped.
        refuse_config: ``(attribute, value, what)`` rows: a config with that value is a layer
            structure the injected layer does not implement (``what`` names it in the error).

    Raises:
        MovedFieldError: built or ``dataclasses.replace``-d with a flat field of earlier
            versions (the message maps each to its group); also when one is read.
        ValueError: a group is missing or of the wrong type, or a value is invalid.
    """

    base_model: str
    layers: str
    embed: str
    positions: Positions
    attention: Attention
    mlp: MLP
    residual: Residual
    project_in: str | None = None
    project_out: str | None = None
    refuse_config: tuple[tuple[str, Any, str], ...] = ()

    _moved = MOVED
    _kind_fields = {"positions": "Positions", "mlp": "MLP"}
    _groups = {"positions": Positions, "attention": Attention, "mlp": MLP, "residual": Residual}
    _layout = ("base_model, layers, embed, positions=Positions(...), attention=Attention(...), "
               "mlp=MLP(...), residual=Residual(...), project_in, project_out, refuse_config")

    def __post_init__(self) -> None:
        problems = []
        for name in ("base_model", "layers", "embed"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                problems.append(f"{name}={value!r} (a dotted module name)")
        problems += self._group_problems()
        if not all(isinstance(r, tuple) and len(r) == 3 for r in self.refuse_config):
            problems.append(f"refuse_config={self.refuse_config!r} ((attribute, value, what) "
                            f"rows)")
        _check("InjectionSpec", problems)

"""The ``quant=`` config: parse and validate it, every key used or rejected by name.

Accepted (shardwise's names and DeepSpeed-Inference's)::

    quant = {
        "enabled": True,                    # optional; False turns quantization off
        "weight": {
            "enabled": True,                # optional; False turns quantization off
            "num_bits": 8,                  # 8 or 4
            "group_size": 128,              # columns per scale; -1 = one scale per output row
            "q_type": "symmetric",          # or "asymmetric" (adds a zero point per group)
            "q_groups": 1,                  # DeepSpeed MoQ: groups per row (see below)
            "mlp_extra_grouping": False,    # DeepSpeed MoQ: twice the groups in MLP layers
        },
        "lm_head": False,                   # also quantize the output head (off by default);
                                            # or {"num_bits": 8, "group_size": -1} (see below)
        "activation": {"enabled": False},   # accepted only disabled: activations are not
                                            # quantized
        "allow_slow_kernels": False,        # opt in to layers no fast kernel can run (below)
    }

Values are type-checked: ``num_bits`` is the integer 4 or 8 (not ``8.0``, ``True`` or ``"8"``),
switches are ``True``/``False``, sizes are integers; anything else is a named
:class:`~shardwise.errors.ConfigError`.

Kernels and the compute dtype
-----------------------------
Every quantized layer runs the first fast (non-reference) ``quant_linear`` kernel the
accelerator's backends offer for its spec: in the model's dtype when one takes it, else in the
first of the accelerator's dtypes (preferred first) that has one — e.g. an fp32 model on CPU runs
its quantized linears in bf16 (torch's packed CPU kernels are bf16-only), the input cast to bf16
and the output cast back to fp32 (see :class:`~shardwise.quant.QuantLinear`). A layer no fast
kernel can run (e.g. int4 with a group size or ``out_features`` the device's kernel does not
take) would run the torch reference, which dequantizes the weight on every call and is several
times slower than the unquantized model: that is a :class:`ConfigError` naming the settings that
would be fast, unless ``allow_slow_kernels=True`` accepts it (one log line then says which layers
run the reference). ``allow_slow_kernels`` is a run-time permission, not a weight format: it is
not compared when a saved quantized checkpoint's settings are matched against ``quant=``.

The output head (``lm_head``)
-----------------------------
``lm_head=True`` quantizes the output head too; ``lm_head={"num_bits": 8 | 4, "group_size": G}``
does so with its own bits / group size (``{"enabled": False}`` is ``False``). Defaults: the
weights' settings, except that **a head tied to the input embeddings gets 8 bits when the weights
get 4, in groups of 32** (Q8_0's block; the weights' group size where they have the same bits and
give one: :data:`TIED_HEAD_BITS`, :data:`TIED_HEAD_GROUP`) — llama.cpp keeps its Q4_0 files' tied table at Q8_0, and
measured on SmolLM2-135M-Instruct an int4 tied table costs more quality than all the int4 layers
together (benchmarks/README.md, llama.cpp section). A tied head is stored ONCE, quantized: the
head runs the quantized linear kernel and the input embedding becomes a
:class:`~shardwise.quant.tied.QuantEmbedding` that dequantizes only the rows it looks up
(:mod:`shardwise.quant.tied`).

``dtype=torch.int8`` (DeepSpeed's spelling) means ``quant={"weight": {"num_bits": 8}}`` with the
accelerator's preferred compute dtype (bf16 on a CPU with native bf16, see
:func:`shardwise.config.InferenceConfig`).

Group size
----------
* ``group_size`` given: used for every quantized layer whose input features it divides. A layer
  it does not divide (e.g. 128 on SmolLM2-135M's 576) is never refused: it gets the largest
  divisor of its input features below ``group_size`` (finer groups, so never less accurate) that
  a fast kernel takes (:func:`fitting_group_sizes` lists the candidates; 96 for 576), or one
  scale per output row where no divisor of at least 16 exists. The quantization report's notes
  name those layers and the size each got.
* neither ``group_size`` nor ``q_groups``: 8 bits → one scale per output row (per channel);
  4 bits → groups of 128 columns, or of 64 / 32 where 128 does not divide a layer's input
  features, else per channel (every default fits every layer).
* DeepSpeed MoQ ``q_groups = G``: DeepSpeed splits a weight matrix into G blocks of whole rows,
  each with one scale. shardwise always keeps one scale per output row, which is already at least
  as fine as any row blocking, so G is mapped onto the other axis: **each row is cut into G groups
  along the input features** (``group_size = in_features // G``; G=1 is per channel).
  ``mlp_extra_grouping=True`` doubles G for the MLP layers (``in_features // (2 G)``), as
  DeepSpeed doubles the MLP's groups. ``q_groups`` and ``group_size`` together are an error.
"""

from __future__ import annotations

import difflib
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import ConfigError, NotSupportedYetError

ALLOWED_BITS = (4, 8)
TOP_KEYS = ("enabled", "weight", "lm_head", "activation", "allow_slow_kernels")
WEIGHT_KEYS = ("enabled", "num_bits", "group_size", "q_type", "q_groups", "mlp_extra_grouping")
#: Keys of the dict form of ``lm_head``.
HEAD_KEYS = ("enabled", "num_bits", "group_size")
#: The bits of a tied head (input embeddings and output head, one table) by the weights' bits,
#: when ``lm_head`` does not say (module docstring).
TIED_HEAD_BITS = {8: 8, 4: 8}
#: The group size of a tied head with other bits than the weights' when ``lm_head`` does not
#: say: Q8_0's block (per output row cost SmolLM2-135M's int8 model 0.016 agreement and 0.3
#: perplexity against the bf16 table; benchmarks/README.md, llama.cpp section).
TIED_HEAD_GROUP = 32
#: DeepSpeed keys we know and do not support (rejected with this reason).
_UNSUPPORTED = {
    "qkv": "DeepSpeed's fused-qkv quantization switch (shardwise quantizes q/k/v like every "
           "other planned linear)",
    "quantized_initialization": "loading pre-quantized DeepSpeed checkpoints",
    "post_init_quant": "DeepSpeed's post-init per-layer quantization table",
}
#: Default 4-bit group sizes, tried in order (the first dividing in_features wins).
INT4_DEFAULT_GROUPS = (128, 64, 32)
#: The smallest group a ``group_size`` that does not divide a layer falls back to (smaller groups
#: cost more scale bytes and kernel calls than they gain; below it: one scale per output row).
MIN_FALLBACK_GROUP = 16
_MLP_NAME = re.compile(r"(^|\.)(mlp|ffn|feed_forward|fc1|fc2|c_fc|gate_proj|up_proj|down_proj|"
                       r"gate_up_proj|dense_h_to_4h|dense_4h_to_h|w1|w2|w3)(\.|$)")


@dataclass(frozen=True)
class QuantConfig:
    """A validated weight-quantization setting.

    bits: 4 or 8; group_size: columns per scale (-1 per channel) or None for the default (module
    docstring); q_groups: DeepSpeed MoQ groups per row (None unless given); mlp_extra_grouping:
    double ``q_groups`` in MLP layers; symmetric: no zero points; lm_head: quantize the output
    head too; lm_head_bits / lm_head_group_size: the head's own bits / group size (None: the
    defaults of :meth:`for_head`); allow_slow_kernels: let layers no fast kernel takes run the
    (slow) torch reference instead of raising (module docstring; not part of equality: it is no
    weight format). Built directly, the fields are checked as :func:`parse_quant` checks them.
    """

    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True
    q_groups: int | None = None
    mlp_extra_grouping: bool = False
    lm_head: bool = False
    allow_slow_kernels: bool = field(default=False, compare=False)
    lm_head_bits: int | None = None
    lm_head_group_size: int | None = None

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        _check_group_size(self.group_size)
        _check_q_groups(self.q_groups)
        if self.lm_head_bits is not None:
            _check_bits(self.lm_head_bits)
        _check_group_size(self.lm_head_group_size)
        for name in ("symmetric", "mlp_extra_grouping", "lm_head", "allow_slow_kernels"):
            _bool(getattr(self, name), name)

    def group_size_for(self, name: str, in_features: int) -> int:
        """The group size of layer ``name`` with ``in_features`` inputs (module docstring);
        raises :class:`ConfigError` naming the layer when a DeepSpeed ``q_groups`` does not
        cut it into equal groups. An explicit ``group_size`` that does not divide the layer's
        inputs is never refused: the largest fitting size below it is used
        (:func:`fitting_group_sizes`; the quantizer reports which layers)."""
        return self.group_sizes_for(name, in_features)[0]

    def group_sizes_for(self, name: str, in_features: int) -> tuple[int, ...]:
        """The group sizes layer ``name`` with ``in_features`` inputs may use, best first: the
        one :meth:`group_size_for` gives, then (only where an explicit ``group_size`` does not
        divide ``in_features``) the other fitting sizes of :func:`fitting_group_sizes`, for a
        quantizer to pick the first a fast kernel takes. Raises as :meth:`group_size_for`."""
        if self.q_groups is None and self.group_size not in (None, -1):
            return fitting_group_sizes(self.group_size, in_features)
        if self.q_groups is not None:
            groups = self.q_groups * (2 if self.mlp_extra_grouping and is_mlp(name) else 1)
            if in_features % groups:
                raise ConfigError(
                    f"q_groups={self.q_groups}{' (x2 for MLP: mlp_extra_grouping)' if groups != self.q_groups else ''}"
                    f" does not divide layer {name!r}'s {in_features} input features into "
                    f"equal groups; choose q_groups dividing it, or group_size")
            return (in_features // groups,)
        if self.group_size == -1:
            return (in_features,)
        if self.bits == 4:
            return (next((g for g in INT4_DEFAULT_GROUPS if in_features % g == 0), in_features),)
        return (in_features,)

    def for_head(self, tied: bool) -> "QuantConfig":
        """The settings the output head is quantized with (module docstring): ``lm_head_bits``
        / ``lm_head_group_size`` where given; else a ``tied`` head gets
        :data:`TIED_HEAD_BITS` (8 bits for 4-bit weights) in groups of :data:`TIED_HEAD_GROUP`
        (the weights' group size where the bits are the same and one is given), an untied one
        the weights' settings. The result quantizes one layer (no ``q_groups``)."""
        bits = self.lm_head_bits or (TIED_HEAD_BITS[self.bits] if tied else self.bits)
        group = self.lm_head_group_size
        same = bits == self.bits and self.q_groups is None
        if group is None and same and (self.group_size is not None or not tied):
            group = self.group_size  # same bits: the weights' groups
        elif group is None and tied:
            group = TIED_HEAD_GROUP  # other bits, or no group given: Q8_0's block
        return QuantConfig(bits=bits, group_size=group, symmetric=self.symmetric,
                           allow_slow_kernels=self.allow_slow_kernels)

    def describe(self) -> str:
        if self.q_groups is not None:
            groups = f"q_groups={self.q_groups}" + (" (x2 MLP)" if self.mlp_extra_grouping else "")
        elif self.group_size is None:
            groups = "per-channel" if self.bits == 8 else "groups of 128 (64/32 where needed)"
        else:
            groups = "per-channel" if self.group_size == -1 else f"groups of {self.group_size}"
        kind = "symmetric" if self.symmetric else "asymmetric"
        head = ""
        if self.lm_head:
            own = [f"int{self.lm_head_bits}"] if self.lm_head_bits else []
            if self.lm_head_group_size is not None:
                own.append("per-channel" if self.lm_head_group_size == -1
                           else f"groups of {self.lm_head_group_size}")
            head = f", lm_head too{' (' + ', '.join(own) + ')' if own else ''}"
        return f"int{self.bits} {kind}, {groups}{head}"

    def to_dict(self) -> dict[str, Any]:
        """The ``quant=`` dict that builds this config again."""
        weight: dict[str, Any] = {"num_bits": self.bits,
                                  "q_type": "symmetric" if self.symmetric else "asymmetric"}
        if self.group_size is not None:
            weight["group_size"] = self.group_size
        if self.q_groups is not None:
            weight["q_groups"] = self.q_groups
            weight["mlp_extra_grouping"] = self.mlp_extra_grouping
        head: Any = self.lm_head
        if self.lm_head and (self.lm_head_bits or self.lm_head_group_size is not None):
            head = {"num_bits": self.lm_head_bits} if self.lm_head_bits else {}
            if self.lm_head_group_size is not None:
                head["group_size"] = self.lm_head_group_size
        out: dict[str, Any] = {"weight": weight, "lm_head": head}
        if self.allow_slow_kernels:
            out["allow_slow_kernels"] = True
        return out


def fitting_group_sizes(requested: int, in_features: int) -> tuple[int, ...]:
    """Group sizes for a layer with ``in_features`` inputs when ``requested`` columns per scale
    were asked for, best first: ``(requested,)`` when it divides ``in_features``; else every
    divisor of ``in_features`` below ``requested`` and at least :data:`MIN_FALLBACK_GROUP` (half ``requested`` when that is
    smaller)
    (finer groups than asked: never less accurate), largest first; else (no such divisor, e.g.
    twice a prime) one scale per output row, ``(in_features,)``. E.g. 128 on SmolLM2's 576
    inputs: 96, 72, 64, 48, 36, 32, 24, 18, 16."""
    if in_features % requested == 0:
        return (requested,)
    lowest = min(MIN_FALLBACK_GROUP, max(1, requested // 2))  # a small request: down to half
    smaller = tuple(d for d in range(min(requested, in_features), lowest - 1, -1)
                    if in_features % d == 0)
    return smaller or (in_features,)


def is_mlp(name: str) -> bool:
    """Whether module ``name`` is an MLP linear (by the names the families use)."""
    return bool(_MLP_NAME.search(name))


def _unknown(key: Any, valid: tuple[str, ...], where: str) -> ConfigError:
    if not isinstance(key, str):
        return ConfigError(f"{where} keys are strings, got {type(key).__name__} {key!r} "
                           f"(valid: {', '.join(valid)})")
    if key in _UNSUPPORTED:
        return NotSupportedYetError(f"{where} key {key!r} ({_UNSUPPORTED[key]}) is not supported "
                                    f"by this version of shardwise; remove it")
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown {where} key {key!r}{hint} (valid: {', '.join(valid)})")


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"quant {name} must be true or false, got "
                          f"{type(value).__name__} {value!r}")
    return value


def _is_int(value: Any) -> bool:
    """A true integer: ``int`` (numpy integers included through ``__index__``), never a bool or
    a float such as ``8.0``."""
    if isinstance(value, bool) or isinstance(value, float):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _check_bits(bits: Any) -> int:
    if not _is_int(bits) or operator.index(bits) not in ALLOWED_BITS:
        raise ConfigError(f"quant num_bits must be the integer 4 or 8, got "
                          f"{type(bits).__name__} {bits!r}")
    return operator.index(bits)


def _check_group_size(group_size: Any) -> int | None:
    if group_size is None:
        return None
    if not _is_int(group_size) or (operator.index(group_size) <= 0
                                   and operator.index(group_size) != -1):
        raise ConfigError(f"quant group_size must be a positive integer or -1 (per output row), "
                          f"got {type(group_size).__name__} {group_size!r}")
    return operator.index(group_size)


def _check_q_groups(q_groups: Any) -> int | None:
    if q_groups is None:
        return None
    if not _is_int(q_groups) or operator.index(q_groups) < 1:
        raise ConfigError(f"quant q_groups must be a positive integer, got "
                          f"{type(q_groups).__name__} {q_groups!r}")
    return operator.index(q_groups)


def _check_keys(value: Mapping, valid: tuple[str, ...], where: str) -> None:
    for key in value:
        if key not in valid or not isinstance(key, str):
            raise _unknown(key, valid, where)


def _check_activation(activation: Any) -> None:
    """Activation quantization is refused: only ``{"enabled": False}`` (DeepSpeed's keys kept)."""
    keys = ("enabled", "num_bits", "q_type", "q_groups")
    if not isinstance(activation, Mapping):
        raise ConfigError(f"quant activation must be a dict like {{'enabled': False}}, got "
                          f"{type(activation).__name__} {activation!r}")
    _check_keys(activation, keys, "quant activation")
    if _bool(activation.get("enabled", False), "activation.enabled"):
        raise NotSupportedYetError("quant activation.enabled=True asks for activation "
                                   "quantization, which shardwise does not do: weights are "
                                   "quantized, activations stay in floating point; remove it")


def parse_quant(value: Any, *, default_bits: int | None = None) -> QuantConfig | None:
    """A :class:`QuantConfig` from ``quant=`` (a dict, a QuantConfig, or None); None when
    quantization is off. Every key is used or rejected by name (closest-name suggestion) and
    every value type-checked (module docstring), all as :class:`ConfigError`."""
    if value is None:
        return QuantConfig(bits=default_bits) if default_bits else None
    if isinstance(value, QuantConfig):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"quant must be a dict like {{'weight': {{'num_bits': 8}}}}, got "
                          f"{type(value).__name__} {value!r}")
    _check_keys(value, TOP_KEYS, "quant")
    if not _bool(value.get("enabled", True), "enabled"):
        return None
    _check_activation(value.get("activation", {}))
    weight = value.get("weight", {})
    if not isinstance(weight, Mapping):
        raise ConfigError(f"quant weight must be a dict like {{'num_bits': 8}}, got "
                          f"{type(weight).__name__} {weight!r}")
    _check_keys(weight, WEIGHT_KEYS, "quant weight")
    if not _bool(weight.get("enabled", True), "weight.enabled"):
        return None
    bits = _check_bits(weight.get("num_bits", default_bits or 8))
    if default_bits is not None and bits != default_bits:
        raise ConfigError(f"dtype=int8 asks for 8-bit weights but quant num_bits is {bits}; "
                          f"drop dtype=int8 (give the compute dtype) or num_bits")
    q_type = weight.get("q_type", "symmetric")
    if not isinstance(q_type, str) or q_type not in ("symmetric", "asymmetric"):
        raise ConfigError(f"quant q_type must be 'symmetric' or 'asymmetric', got "
                          f"{type(q_type).__name__} {q_type!r}")
    group_size = _check_group_size(weight.get("group_size"))
    q_groups = _check_q_groups(weight.get("q_groups"))
    if q_groups is not None and group_size is not None:
        raise ConfigError("quant weight gives both group_size and q_groups (DeepSpeed's name for "
                          "groups per row); give one")
    extra = _bool(weight.get("mlp_extra_grouping", False), "mlp_extra_grouping")
    if extra and q_groups is None:
        q_groups = 1  # DeepSpeed's default q_groups, doubled for the MLP
    head, head_bits, head_group = _check_head(value.get("lm_head", False))
    return QuantConfig(bits=bits, group_size=group_size, symmetric=q_type == "symmetric",
                       q_groups=q_groups, mlp_extra_grouping=extra, lm_head=head,
                       allow_slow_kernels=_bool(value.get("allow_slow_kernels", False),
                                                "allow_slow_kernels"),
                       lm_head_bits=head_bits, lm_head_group_size=head_group)


def _check_head(value: Any) -> tuple[bool, int | None, int | None]:
    """``lm_head`` (a bool, or a dict of :data:`HEAD_KEYS`) → (quantize the head, its bits or
    None, its group size or None)."""
    if isinstance(value, bool):
        return value, None, None
    if not isinstance(value, Mapping):
        raise ConfigError(f"quant lm_head must be true or false, or a dict like "
                          f"{{'num_bits': 8, 'group_size': -1}}, got {type(value).__name__} "
                          f"{value!r}")
    _check_keys(value, HEAD_KEYS, "quant lm_head")
    if not _bool(value.get("enabled", True), "lm_head.enabled"):
        return False, None, None
    bits = _check_bits(value["num_bits"]) if "num_bits" in value else None
    return True, bits, _check_group_size(value.get("group_size"))

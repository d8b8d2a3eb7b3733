"""Step 6 of the engine: quantize the planned linears in place (``quantize_model``), usable alone.

Which layers: every ``nn.Linear`` / transformers ``Conv1D`` the model's tensor-parallel plan
names as column- or row-parallel (attention and MLP projections) — the plan ``init_inference``
would shard with (the user's ``injection_policy``, the model's HF ``tp_plan``, the family policy,
then the heuristic); the output head only with ``lm_head=True``; embeddings never. A model no plan
covers falls back to every Linear/Conv1D except the output head (noted in the report).

How: each weight is quantized in float32 on the target device (:func:`quantize_weight`, so under
tensor parallelism each rank quantizes its own slice and the scales follow their rows), the
``quant_linear`` kernel is resolved for its spec and compute dtype, ``impl.fn.prepack`` runs once,
and a :class:`QuantLinear` replaces the module in place, carrying its forward hooks (the
row-parallel all-reduce). Layers that resolve to the torch reference (which dequantizes per
call) are announced in ONE log line per call; nothing is dequantized at rest.

Checkpoint loading (``core/checkpoint``) quantizes while it reads, so the full-precision model
never sits on the device: build a :class:`Quantizer` for the (meta) model, and for each module
``quantizer.wants(name)`` names, call ``quantizer.quantize_tensor_for(name, weight, bias)`` with
that rank's slice, then ``quantizer.install(model, name, qlinear)``; finally
``quantizer.finish(model)`` logs the fallback line and returns the :class:`QuantReport`.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ..accelerator import Accelerator
from ..errors import ConfigError
from ..kernel_registry import REFERENCE, registry
from ..sharding.plan import _conv1d_class, choose_plan
from ..sharding.roles import ColumnParallel, RowParallel
from .config import QuantConfig, is_mlp, parse_quant
from .modules import QuantLinear, carry_hooks, set_submodule
from shardwise.kernels.reference.quant import QuantizationError, quantize_weight

log = logging.getLogger(__name__)

#: Attribute set on a quantized model (holds its QuantReport); quantizing twice is refused.
QUANT_ATTR = "_shardwise_quant_report"


class AlreadyQuantizedError(ConfigError):
    """The model (or a layer) is already quantized."""


@dataclass
class QuantizedLayer:
    name: str
    kind: str  # "attention", "mlp", "lm_head"
    backend: str
    bits: int
    group_size: int
    shape: tuple[int, int]  # (out, in)
    weight_bytes: int  # packed bytes


@dataclass
class QuantReport:
    """What ``quantize_model`` did.

    bytes_before: the model's bytes unquantized in the compute dtype (float tensors counted at
    the compute dtype's size); bytes_after: the bytes it holds now (parameters + packed weights);
    both are this rank's under tensor parallelism. layers: name → :class:`QuantizedLayer`.
    """

    config: QuantConfig
    dtype: torch.dtype
    device: str
    bytes_before: int = 0
    bytes_after: int = 0
    layers: dict[str, QuantizedLayer] = field(default_factory=dict)
    source: str = "plan"
    fallback: str | None = None  # the one log line, when some layers run the reference
    notes: list[str] = field(default_factory=list)

    @property
    def layers_quantized(self) -> int:
        return len(self.layers)

    def backends(self) -> dict[str, dict[str, int]]:
        """Layer kind → backend → number of layers."""
        out: dict[str, Counter] = {}
        for layer in self.layers.values():
            out.setdefault(layer.kind, Counter())[layer.backend] += 1
        return {k: dict(v) for k, v in out.items()}

    def summary(self) -> str:
        kinds = "; ".join(f"{k}: " + ", ".join(f"{n}x {b}" for b, n in v.items())
                          for k, v in self.backends().items())
        ratio = self.bytes_before / self.bytes_after if self.bytes_after else 0.0
        return (f"quantized {self.layers_quantized} layers ({self.config.describe()}, compute "
                f"{str(self.dtype).removeprefix('torch.')} on {self.device}; {kinds}); model "
                f"{self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB "
                f"({ratio:.2f}x smaller)")

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "dtype": str(self.dtype).removeprefix("torch."),
                "device": self.device, "bytes_before": self.bytes_before,
                "bytes_after": self.bytes_after, "layers_quantized": self.layers_quantized,
                "backends": self.backends(), "source": self.source, "fallback": self.fallback,
                "notes": list(self.notes)}


# ----- bytes ----------------------------------------------------------------------------------------

def model_bytes(model: nn.Module) -> int:
    """Parameters (tied ones once) plus the packed weights of every QuantLinear."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.weight_nbytes for m in model.modules() if isinstance(m, QuantLinear))


def bytes_in_dtype(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of the parameters with every floating one held in ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() * (size if p.is_floating_point() else p.element_size())
               for p in model.parameters())


# ----- which layers ----------------------------------------------------------------------------------

def _is_target_kind(module: nn.Module) -> bool:
    conv1d = _conv1d_class()
    return isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d))


def is_quantizable(module: nn.Module) -> bool:
    """Whether ``module`` is a kind :class:`Quantizer` can quantize (``nn.Linear`` or
    transformers ``Conv1D``)."""
    return _is_target_kind(module)


def layer_kind(name: str, lm_head_name: str | None) -> str:
    if name == lm_head_name:
        return "lm_head"
    return "mlp" if is_mlp(name) else "attention"


def _output_name(model: nn.Module) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None
    return next((n for n, m in model.named_modules() if m is head), None)


def quant_targets(model: nn.Module, config: QuantConfig, roles: Mapping[str, Any] | None = None,
                  injection_policy: Mapping | None = None) -> tuple[list[str], str]:
    """(module names to quantize, where the names came from). ``roles``: name → sharding Role
    (e.g. ``PreparedShards.roles``); None chooses the plan as ``init_inference`` would."""
    source = "plan"
    if roles is None:
        try:
            from ..policy import policy_for

            roles = choose_plan(model, injection_policy, policy_for(model)).resolve(model)
        except Exception as exc:  # no plan: every linear but the head
            log.debug("no plan for quantization (%s); using every linear", exc)
            roles, source = None, "all linears (no tensor-parallel plan for this model)"
    head = _output_name(model)
    modules = dict(model.named_modules())
    if roles is None:
        names = [n for n, m in modules.items() if n and _is_target_kind(m) and n != head]
    else:
        names = [n for n, r in roles.items() if isinstance(r, (ColumnParallel, RowParallel))
                 and n in modules and _is_target_kind(modules[n]) and n != head]
    if config.lm_head:
        if head is None or not _is_target_kind(modules[head]):
            raise ConfigError(f"quant lm_head=True but {type(model).__name__} has no linear "
                              f"output head (get_output_embeddings)")
        embed = getattr(model, "get_input_embeddings", lambda: None)()
        if embed is not None and getattr(embed, "weight", None) is modules[head].weight:
            raise ConfigError(f"quant lm_head=True but {head!r} is tied to the input embeddings: "
                              "the embedding table stays in the compute dtype, so quantizing "
                              "the head would add bytes, not save them; remove lm_head")
        names.append(head)
    return names, source


# ----- the quantizer -------------------------------------------------------------------------------

class Quantizer:
    """Quantizes weights one module at a time (the engine's step 6 and the checkpoint loader's
    hook; module docstring)."""

    def __init__(self, config: QuantConfig | Mapping, accelerator: Accelerator, dtype: torch.dtype,
                 device: torch.device | str | None = None,
                 names: Iterable[str] | None = None, lm_head_name: str | None = None) -> None:
        self.config = config if isinstance(config, QuantConfig) else parse_quant(config)
        if self.config is None:
            raise ConfigError("quantization is disabled in this quant config")
        self.accelerator, self.dtype = accelerator, dtype
        self.device = torch.device(device) if device is not None else accelerator.device()
        self.names = set(names) if names is not None else None
        self.lm_head_name = lm_head_name
        self.layers: dict[str, QuantizedLayer] = {}

    @classmethod
    def for_model(cls, model: nn.Module, config: QuantConfig | Mapping, accelerator: Accelerator,
                  dtype: torch.dtype, device=None, roles=None,
                  injection_policy=None) -> "Quantizer":
        """A quantizer whose :meth:`wants` are the layers :func:`quant_targets` picks (works on
        a model on the meta device: only names and types are read)."""
        config = config if isinstance(config, QuantConfig) else parse_quant(config)
        _refuse_twice(model)
        names, source = quant_targets(model, config, roles, injection_policy)
        q = cls(config, accelerator, dtype, device, names, _output_name(model))
        q.source = source
        return q

    source = "plan"

    def wants(self, module_name: str) -> bool:
        """Whether ``module_name`` is to be quantized."""
        return self.names is None or module_name in self.names

    def check(self, module_name: str, in_features: int) -> None:
        """Raise (naming the layer) unless the settings fit a layer with ``in_features`` inputs
        (this rank's, under tensor parallelism): the group size divides them, 4 bits need an
        even count. For validating every layer before any is quantized."""
        self.config.group_size_for(module_name, in_features)
        if self.config.bits == 4 and in_features % 2:
            raise QuantizationError(f"layer {module_name!r}: 4-bit packing needs an even number "
                                    f"of input features, got {in_features}")

    def quantize_tensor_for(self, module_name: str, weight: torch.Tensor,
                            bias: torch.Tensor | None = None, *, conv1d: bool = False
                            ) -> QuantLinear:
        """A :class:`QuantLinear` on the quantizer's device for ``weight`` (``[out, in]``, or
        ``[in, out]`` with ``conv1d=True``: transformers' Conv1D layout), e.g. one rank's slice
        as the checkpoint loader reads it. The weight may be on any device (host memory is
        fine); only the packed form lands on the device."""
        w = weight.detach()
        w = w.t() if conv1d else w
        if w.dim() != 2:
            raise QuantizationError(f"layer {module_name!r}: expected a 2-d weight, got "
                                    f"{tuple(weight.shape)}")
        out_features, in_features = w.shape
        group_size = self.config.group_size_for(module_name, in_features)
        try:
            qw = quantize_weight(w.to(self.device), bits=self.config.bits, group_size=group_size,
                                 symmetric=self.config.symmetric)
        except QuantizationError as exc:
            raise QuantizationError(f"layer {module_name!r}: {exc}") from None
        impl = registry.resolve("quant_linear", self.accelerator, self.dtype,
                                device_type=self.device.type, **qw.spec.as_shape())
        packed = impl.fn.prepack(qw, self.device, self.dtype)
        del qw
        if bias is not None:
            bias = bias.detach().to(device=self.device, dtype=self.dtype)
        module = QuantLinear(packed, impl, bias, source="conv1d" if conv1d else "linear")
        self.layers[module_name] = QuantizedLayer(
            module_name, layer_kind(module_name, self.lm_head_name), impl.backend,
            self.config.bits, group_size, (out_features, in_features), module.weight_nbytes)
        return module

    def install(self, model: nn.Module, name: str, new: QuantLinear) -> None:
        """Put ``new`` in place of module ``name``, carrying its instance hooks."""
        old = model.get_submodule(name)
        carry_hooks(old, new)
        set_submodule(model, name, new)

    def quantize_module(self, model: nn.Module, name: str) -> QuantLinear:
        """Quantize the Linear/Conv1D called ``name`` in place."""
        module = model.get_submodule(name)
        if isinstance(module, QuantLinear):
            raise AlreadyQuantizedError(f"layer {name!r} is already quantized; quantize a model "
                                        "once, from its full-precision weights")
        if not _is_target_kind(module):
            raise ConfigError(f"layer {name!r} is a {type(module).__name__}, not an nn.Linear or "
                              "transformers Conv1D; only those can be quantized")
        conv1d = not isinstance(module, nn.Linear)
        new = self.quantize_tensor_for(name, module.weight, getattr(module, "bias", None),
                                       conv1d=conv1d)
        self.install(model, name, new)
        return new

    def fallback_line(self) -> str | None:
        """The one line saying which layers run the reference (None when none do)."""
        slow = [layer for layer in self.layers.values() if layer.backend == REFERENCE]
        if not slow:
            return None
        kinds = sorted({f"int{layer.bits}" for layer in slow})
        fast = [b for b in self.accelerator.ordered_kernel_backends() if b != REFERENCE]
        dtype = str(self.dtype).removeprefix("torch.")
        if fast:
            why = (f"no {'/'.join(kinds)} quant_linear kernel of backend(s) {', '.join(fast)} "
                   f"takes {dtype} activations with these shapes/group sizes on "
                   f"{self.device.type}")
            better = self._dtypes_with_kernels(slow[0])
            if better:
                why += f" (this device's kernels take {'/'.join(better)}: use that dtype)"
        else:
            why = f"accelerator {self.accelerator.name!r} lists no kernel backend"
        return (f"shardwise quant: {len(slow)} of {len(self.layers)} quantized layers "
                f"({'/'.join(kinds)}) run the torch reference kernel, which dequantizes each "
                f"layer per call (correct but slow): {why}")

    def _dtypes_with_kernels(self, layer: QuantizedLayer) -> list[str]:
        """Other compute dtypes of the accelerator for which a fast backend takes ``layer``."""
        shape = {"bits": layer.bits, "group_size": layer.group_size,
                 "symmetric": self.config.symmetric, "out_features": layer.shape[0], "in_features": layer.shape[1]}
        out = []
        for dtype in self.accelerator.supported_dtypes:
            try:
                impl = registry.resolve("quant_linear", self.accelerator, dtype,
                                        device_type=self.device.type, **shape)
            except Exception:  # a backend predicate that needs more than these shape keys
                continue
            if dtype != self.dtype and impl.backend != REFERENCE:
                out.append(str(dtype).removeprefix("torch."))
        return out

    def finish(self, model: nn.Module, bytes_before: int | None = None) -> QuantReport:
        """Log the fallback line once, mark the model quantized, and return the report."""
        report = QuantReport(self.config, self.dtype, str(self.device),
                             bytes_before=bytes_before or 0, layers=dict(self.layers),
                             source=self.source)
        report.fallback = self.fallback_line()
        if report.fallback:
            log.warning(report.fallback)
        report.bytes_after = model_bytes(model)
        setattr(model, QUANT_ATTR, report)
        return report


def _refuse_twice(model: nn.Module) -> None:
    if getattr(model, QUANT_ATTR, None) is not None or any(
            isinstance(m, QuantLinear) for m in model.modules()):
        raise AlreadyQuantizedError(
            f"{type(model).__name__} is already quantized; quantizing again would compound the "
            "rounding error. Quantize once, from the full-precision model (or load the saved "
            "quantized weights with shardwise.quant.load_quantized)")


@torch.no_grad()
def quantize_model(model: nn.Module, spec: QuantConfig | Mapping, accelerator: Accelerator,
                   dtype: torch.dtype, names: Iterable[str] | None = None, *,
                   device: torch.device | str | None = None, roles: Mapping | None = None,
                   injection_policy: Mapping | None = None) -> QuantReport:
    """Quantize ``model``'s planned linears in place and put the rest on ``device`` in ``dtype``.

    Args:
        model: a model with real weights (under tensor parallelism: this rank's shards).
        spec: a :class:`QuantConfig` or the ``quant=`` dict.
        accelerator: where it runs (its kernel backends are tried in order).
        dtype: the compute dtype (activations, embeddings, norms, biases).
        names: module names to quantize; None picks them from the plan (module docstring).
        device: default ``accelerator.device()``.
        roles: module name → sharding role, e.g. from ``PreparedShards.roles``.

    Returns:
        the :class:`QuantReport` (also stored on the model as ``_shardwise_quant_report``).

    Raises:
        AlreadyQuantizedError: the model is already quantized.
        QuantizationError / ConfigError: bad bits, a group size not dividing a layer's inputs
            (naming the layer) — before any layer is replaced.
    """
    from ..transforms import cast_and_move

    config = spec if isinstance(spec, QuantConfig) else parse_quant(spec)
    if config is None:
        raise ConfigError("quantization is disabled in this quant config")
    _refuse_twice(model)
    if names is None:
        quantizer = Quantizer.for_model(model, config, accelerator, dtype, device, roles,
                                        injection_policy)
        targets = sorted(quantizer.names, key=list(dict(model.named_modules())).index)
    else:
        targets = list(names)
        quantizer = Quantizer(config, accelerator, dtype, device, targets, _output_name(model))
        quantizer.source = "names given"
    modules = dict(model.named_modules())
    for name in targets:  # validate every layer before touching any
        if name not in modules:
            raise ConfigError(f"no module named {name!r} to quantize")
        module = modules[name]
        if isinstance(module, QuantLinear):
            raise AlreadyQuantizedError(f"layer {name!r} is already quantized")
        if not _is_target_kind(module):
            raise ConfigError(f"layer {name!r} is a {type(module).__name__}, not an nn.Linear or "
                              "transformers Conv1D; only those can be quantized")
        quantizer.check(name, module.weight.shape[1 if isinstance(module, nn.Linear) else 0])
    bytes_before = bytes_in_dtype(model, dtype)
    for name in targets:
        quantizer.quantize_module(model, name)
    cast_and_move(model, quantizer.device, dtype)
    return quantizer.finish(model, bytes_before)

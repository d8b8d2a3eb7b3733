"""The engine's quantize step (after sharding, before injection): quantize the planned linears
in place (``quantize_model``), usable alone.

Which layers: every ``nn.Linear`` / transformers ``Conv1D`` the model's tensor-parallel plan
names as column- or row-parallel (attention and MLP projections) — the plan ``init_inference``
would shard with (the user's ``injection_policy``, the model's HF ``tp_plan``, the family policy,
then the heuristic); the output head only with ``lm_head`` (its own settings:
:meth:`QuantConfig.for_head`); an input embedding only as the table of a head tied to it, stored
once (:mod:`.tied`: the embedding becomes a :class:`~.tied.QuantEmbedding` reading the head's
packed rows). A model no plan
covers falls back to every Linear/Conv1D except the output head (noted in the report).

How: each weight is quantized in float32 on the target device (:func:`quantize_weight`, so under
tensor parallelism each rank quantizes its own slice and the scales follow their rows), the
``quant_linear`` kernel is resolved for its spec (:meth:`Quantizer.resolve_kernel`: the first fast
kernel in the model's dtype, else in another of the accelerator's dtypes, e.g. bf16 for an fp32
model on CPU; the layer then casts its input to that dtype and its output back),
``impl.fn.prepack`` runs once, and a :class:`QuantLinear` replaces the module in place, carrying
its forward hooks (the row-parallel all-reduce). Nothing is dequantized at rest.

Slow kernels are refused: a layer only the torch reference can run (it dequantizes the weight on
every call, several times slower than the unquantized model) is a :class:`ConfigError` naming the
settings that would be fast, raised while validating, before any layer is replaced — unless the
config says ``allow_slow_kernels=True``; those layers are then announced in ONE log line.
:func:`check_fits` runs every check without touching the model (``init_inference`` calls it before
its first in-place transform).

Checkpoint loading quantizes while it reads, so the full-precision model never sits on the
device: :meth:`Quantizer.reading_hook` is the generic per-tensor hook the loader calls
(:class:`QuantizeOnRead`, a :class:`~shardwise.checkpoint.TensorHook`): it checks every wanted
layer before any data is read, quantizes each weight slice as it arrives
(``quantizer.quantize_tensor_for``), puts the QuantLinear in (``quantizer.install``) and takes its
bias whenever that is read; ``quantizer.finish(model)`` logs the fallback line and returns the
:class:`QuantReport`.

Each linear replaced by a QuantLinear is recorded in the active ledger (``init_inference``'s):
undoing it puts the original module back with its weight rebuilt by dequantizing (lossy: the
float weight is not kept, so memory holds one copy of the model).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch
from torch import nn

from ..accelerator import Accelerator
from ..checkpoint.extensions import TensorHook, TensorRef
from ..errors import ConfigError
from ..kernel_registry import REFERENCE, KernelImpl, registry
from ..sharding.plan import _conv1d_class, choose_plan
from ..sharding.roles import ColumnParallel, RowParallel
from .config import MIN_FALLBACK_GROUP, QuantConfig, is_mlp, parse_quant
from .experts import QuantExperts, check_experts, expert_modules, quantize_experts_module
from .modules import QuantLinear, swap_quantized
from .tied import (embedding_problem, refuse_tied, tie_embedding, tied_embedding_name,
                   tied_head_problem)
from shardwise.kernels.reference.quant import QuantizationError, QuantSpec, quantize_weight


if TYPE_CHECKING:
    from ..plan import Plan

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
    #: the activation dtype its kernel runs in (None: unknown, e.g. an old checkpoint)
    compute_dtype: torch.dtype | None = None


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

    def kernel_dtypes(self) -> list[str]:
        """The activation dtypes the quantized layers' kernels run in (e.g. ``["bfloat16"]`` for
        an fp32 model on CPU)."""
        return sorted({str(layer.compute_dtype).removeprefix("torch.")
                       for layer in self.layers.values() if layer.compute_dtype is not None})

    def summary(self) -> str:
        kinds = "; ".join(f"{k}: " + ", ".join(f"{n}x {b}" for b, n in v.items())
                          for k, v in self.backends().items())
        ratio = self.bytes_before / self.bytes_after if self.bytes_after else 0.0
        model_dtype = str(self.dtype).removeprefix("torch.")
        other = [d for d in self.kernel_dtypes() if d != model_dtype]
        kernels = f", quantized layers in {'/'.join(other)}" if other else ""
        return (f"quantized {self.layers_quantized} layers ({self.config.describe()}, compute "
                f"{model_dtype}{kernels} on {self.device}; {kinds}); model "
                f"{self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB "
                f"({ratio:.2f}x smaller)")

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "dtype": str(self.dtype).removeprefix("torch."),
                "device": self.device, "bytes_before": self.bytes_before,
                "bytes_after": self.bytes_after, "layers_quantized": self.layers_quantized,
                "backends": self.backends(), "kernel_dtypes": self.kernel_dtypes(),
                "source": self.source, "fallback": self.fallback,
                "notes": list(self.notes)}


# ----- bytes ----------------------------------------------------------------------------------------

def model_bytes(model: nn.Module) -> int:
    """Parameters (tied ones once) plus the packed weights of every QuantLinear and
    QuantExperts."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + sum(m.weight_nbytes for m in model.modules()
                        if isinstance(m, (QuantLinear, QuantExperts)))


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
                  injection_policy: Mapping | None = None,
                  plan: "Plan | None" = None) -> tuple[list[str], str]:
    """(module names to quantize, where the names came from). ``plan``: the engine's
    :class:`~shardwise.plan.Plan`, whose roles are taken as they are (none there: no plan fits
    the model, so every linear but the head) with nothing looked up again. Without it,
    ``roles``: name → sharding Role (e.g. ``PreparedShards.roles``), or None to choose the plan
    as ``init_inference`` would (a quantizer used on its own)."""
    source = "plan"
    if plan is not None:
        roles = plan.roles
        if roles is None:
            source = f"all linears ({plan.roles_source})"
    elif roles is None:
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
        embed = tied_embedding_name(model, modules[head])
        problem = embed and embedding_problem(embed, modules[embed])
        if problem:
            raise refuse_tied(head, problem)
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
        #: head name → the input embedding tied to it (stored once: :mod:`.tied`)
        self.tied: dict[str, str] = {}
        self.layers: dict[str, QuantizedLayer] = {}

    @classmethod
    def for_model(cls, model: nn.Module, config: QuantConfig | Mapping, accelerator: Accelerator,
                  dtype: torch.dtype, device=None, roles=None,
                  injection_policy=None, plan: "Plan | None" = None) -> "Quantizer":
        """A quantizer whose :meth:`wants` are the layers :func:`quant_targets` picks (works on
        a model on the meta device: only names and types are read)."""
        config = config if isinstance(config, QuantConfig) else parse_quant(config)
        _refuse_twice(model)
        names, source = quant_targets(model, config, roles, injection_policy, plan)
        q = cls(config, accelerator, dtype, device, names, _output_name(model))
        q.source = source
        q.find_tied(model)
        return q

    def find_tied(self, model: nn.Module) -> None:
        """Record which wanted head is tied to ``model``'s input embeddings (:attr:`tied`)."""
        head = self.lm_head_name
        if head is not None and self.wants(head):
            embed = tied_embedding_name(model, model.get_submodule(head))
            if embed is not None:
                self.tied[head] = embed

    def config_for(self, module_name: str) -> QuantConfig:
        """The settings layer ``module_name`` is quantized with: the head's own
        (:meth:`QuantConfig.for_head`, tied or not) for the output head, else the config."""
        if module_name == self.lm_head_name and module_name is not None:
            return self.config.for_head(module_name in self.tied)
        return self.config

    source = "plan"

    def wants(self, module_name: str) -> bool:
        """Whether ``module_name`` is to be quantized."""
        return self.names is None or module_name in self.names

    def check(self, module_name: str, in_features: int, out_features: int | None = None) -> None:
        """Raise (naming the layer) unless the settings fit a layer with ``in_features`` inputs
        and ``out_features`` outputs (this rank's, under tensor parallelism): the group size
        divides the inputs, 4 bits need an even count, and a fast kernel takes the layer (or
        ``allow_slow_kernels`` is set; the kernel check needs ``out_features``). Pure: for
        validating every layer before any is quantized."""
        config = self.config_for(module_name)
        if config.bits == 4 and in_features % 2:
            raise QuantizationError(f"layer {module_name!r}: 4-bit packing needs an even number "
                                    f"of input features, got {in_features}")
        if out_features is None:
            config.group_size_for(module_name, in_features)  # raises where none fits
            return
        spec, impl, dtype = self.choose_spec(module_name, in_features, out_features)
        self._refuse_slow(module_name, spec, impl)
        if module_name in self.tied:
            problem = tied_head_problem(impl.fn.prepack, spec, self.device, dtype)
            if problem:
                raise refuse_tied(module_name, problem)

    def choose_spec(self, module_name: str, in_features: int, out_features: int
                    ) -> tuple[QuantSpec, KernelImpl, torch.dtype]:
        """(the weight spec, its kernel, the kernel's activation dtype) for layer
        ``module_name``: the first of the config's group sizes for it
        (:meth:`QuantConfig.group_sizes_for`: one, unless an explicit ``group_size`` does not
        divide ``in_features``; then the fitting smaller ones, largest first) that a fast
        kernel takes, else the first of them (which the slow-kernel check then judges)."""
        config = self.config_for(module_name)
        sizes = config.group_sizes_for(module_name, in_features)
        first = None
        for size in sizes:
            spec = QuantSpec(config.bits, size, config.symmetric, in_features, out_features)
            impl, dtype = self.resolve_kernel(spec)
            if impl.backend != REFERENCE:
                return spec, impl, dtype
            first = first or (spec, impl, dtype)
        return first

    # ----- which kernel, in which dtype ---------------------------------------------------------

    def compute_dtypes(self) -> list[torch.dtype]:
        """The activation dtypes a quantized layer may run its kernel in, best first: the
        model's dtype, then the accelerator's other dtypes (its preferred one first), those
        with the model dtype's range before narrower ones (bf16 before fp16 for fp32)."""
        others = [self.accelerator.preferred_dtype,
                  *[d for d in self.accelerator.supported_dtypes]]
        others = [d for i, d in enumerate(others) if d.is_floating_point and d != self.dtype
                  and d not in others[:i]]
        top = torch.finfo(self.dtype).max if self.dtype.is_floating_point else float("inf")
        others.sort(key=lambda d: torch.finfo(d).max < top)  # stable: keeps the order otherwise
        return [self.dtype, *others]

    def resolve_kernel(self, spec: QuantSpec) -> tuple[KernelImpl, torch.dtype]:
        """(the ``quant_linear`` implementation, the activation dtype it runs in) for a weight
        of ``spec``: the first non-reference kernel over :meth:`compute_dtypes`, else the torch
        reference in the model's dtype. Asks the registry only (never tests a device name)."""
        for dtype in self.compute_dtypes():
            impl = registry.resolve("quant_linear", self.accelerator, dtype,
                                    device_type=self.device.type, **spec.as_shape())
            if impl.backend != REFERENCE:
                return impl, dtype
        return registry.resolve("quant_linear", self.accelerator, self.dtype,
                                device_type=self.device.type, **spec.as_shape()), self.dtype

    def _is_fast(self, spec: QuantSpec) -> bool:
        return self.resolve_kernel(spec)[0].backend != REFERENCE

    def _refuse_slow(self, module_name: str, spec: QuantSpec, impl: KernelImpl) -> None:
        """The ConfigError for a layer that would run the reference (module docstring)."""
        if impl.backend != REFERENCE or self.config.allow_slow_kernels:
            return
        bits = f"int{spec.bits}"
        where = f"the {self.accelerator.name!r} accelerator ({self.device})"
        raise ConfigError(
            f"quant {self.config.describe()}: layer {module_name!r} ([out, in] = "
            f"[{spec.out_features}, {spec.in_features}], {bits}, group size {spec.group_size}) "
            f"has no fast quant_linear kernel on {where}: {self._why_slow(spec)}. It would run "
            f"the torch reference, which dequantizes the weight on every call (several times "
            f"slower than not quantizing). {self._what_is_fast(spec)}; or accept the slow "
            f"kernel explicitly with quant={{..., 'allow_slow_kernels': True}}")

    def _why_slow(self, spec: QuantSpec) -> str:
        """What each fast backend of the accelerator says about ``spec``."""
        reasons = []
        for backend in self.accelerator.ordered_kernel_backends():
            if backend == REFERENCE:
                continue
            error = registry.load_backend(backend)
            impl = None if error else registry.implementations("quant_linear").get(backend)
            if impl is None:
                reasons.append(f"backend {backend!r} has no quant_linear kernel here"
                               f"{' (' + error + ')' if error else ''}")
                continue
            explain = getattr(impl.fn, "unsupported_reason", None)
            dtypes = [d for d in self.compute_dtypes() if impl.dtypes is None or d in impl.dtypes]
            if not dtypes:
                names = "/".join(sorted(str(d).removeprefix("torch.") for d in impl.dtypes))
                reasons.append(f"backend {backend!r} takes {names} activations, which this "
                               f"accelerator does not run")
                continue
            whys = {dtype: explain(device_type=self.device.type, dtype=dtype, **spec.as_shape())
                    for dtype in dtypes} if callable(explain) else {}
            if len(set(whys.values())) > 1:  # say why for each activation dtype tried
                why = "; ".join(f"in {str(d).removeprefix('torch.')}: {w or 'refused'}"
                                for d, w in whys.items())
            else:
                why = next(iter(whys.values()), None)
            reasons.append(f"backend {backend!r}: {why or 'refuses this weight'}")
        if not reasons:
            return (f"accelerator {self.accelerator.name!r} lists no kernel backend besides the "
                    f"torch reference")
        return "; ".join(reasons)

    def _what_is_fast(self, spec: QuantSpec) -> str:
        """The settings that would be fast for this layer, probed through the registry."""
        fast = []
        sizes = [g for g in (16, 32, 64, 128, 256, 512, 1024) if spec.in_features % g == 0]
        for g in sizes + [spec.in_features]:
            probe = QuantSpec(spec.bits, g, spec.symmetric, spec.in_features, spec.out_features)
            if g != spec.group_size and self._is_fast(probe):
                fast.append("-1 (per channel)" if g == spec.in_features else str(g))
        other = 8 if spec.bits == 4 else 4
        probe = QuantSpec(other, spec.in_features if other == 8 else spec.group_size,
                          spec.symmetric, spec.in_features, spec.out_features)
        hints = []
        if fast:
            hints.append(f"fast int{spec.bits} group sizes for this layer here: "
                         f"{', '.join(dict.fromkeys(fast))}")
        if self._is_fast(probe):
            hints.append(f"num_bits={other} is fast for it")
        if not hints:
            return ("No int4/int8 setting has a fast kernel for this layer here: leave the "
                    "model unquantized")
        return "Choose a fast setting (" + "; ".join(hints) + ")"

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
        spec, impl, kernel_dtype = self.choose_spec(module_name, in_features, out_features)
        group_size = spec.group_size
        self._refuse_slow(module_name, spec, impl)  # before the (costly) quantization
        try:
            qw = quantize_weight(w.to(self.device), bits=spec.bits, group_size=group_size,
                                 symmetric=spec.symmetric)
        except QuantizationError as exc:
            raise QuantizationError(f"layer {module_name!r}: {exc}") from None
        packed = impl.fn.prepack(qw, self.device, kernel_dtype)
        del qw
        if bias is not None:
            bias = bias.detach().to(device=self.device, dtype=self.dtype)
        module = QuantLinear(packed, impl, bias, source="conv1d" if conv1d else "linear")
        self.layers[module_name] = QuantizedLayer(
            module_name, layer_kind(module_name, self.lm_head_name), impl.backend,
            spec.bits, group_size, (out_features, in_features), module.weight_nbytes,
            kernel_dtype)
        return module

    def install(self, model: nn.Module, name: str, new: QuantLinear) -> None:
        """Put ``new`` in place of module ``name``, carrying its instance hooks; recorded in
        the active ledger (module docstring): the undo puts the original module back with its
        weight (and bias) rebuilt from ``new`` by dequantizing, in the dtype and on the device
        they had."""
        swap_in(model, name, new)
        if name in self.tied:  # the embedding reads the head's table: stored once
            tie_embedding(model, self.tied[name], new, name, self.dtype)

    def reading_hook(self) -> "QuantizeOnRead":
        """The checkpoint loader's per-tensor hook quantizing this quantizer's layers as their
        slices are read (``load_checkpoint(..., hooks=[quantizer.reading_hook()])``)."""
        return QuantizeOnRead(self)

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
        """The one line saying which layers run the reference (None when none do; they can
        only with ``allow_slow_kernels=True``)."""
        slow = [layer for layer in self.layers.values() if layer.backend == REFERENCE]
        if not slow:
            return None
        kinds = sorted({f"int{layer.bits}" for layer in slow})
        first = slow[0]
        spec = QuantSpec(first.bits, first.group_size, self.config.symmetric, first.shape[1],
                         first.shape[0])
        return (f"shardwise quant: {len(slow)} of {len(self.layers)} quantized layers "
                f"({'/'.join(kinds)}) run the torch reference kernel, which dequantizes each "
                f"layer per call (correct but slow; allowed by allow_slow_kernels=True), e.g. "
                f"{first.name!r}: {self._why_slow(spec)}")

    def finish(self, model: nn.Module, bytes_before: int | None = None) -> QuantReport:
        """Log the fallback line once, mark the model quantized, and return the report."""
        report = QuantReport(self.config, self.dtype, str(self.device),
                             bytes_before=bytes_before or 0, layers=dict(self.layers),
                             source=self.source)
        report.fallback = self.fallback_line()
        if report.fallback:
            log.warning(report.fallback)
        report.notes.extend(regrouped_notes(self.config, report.layers))
        for note in report.notes:
            log.info("shardwise quant: %s", note)
        report.bytes_after = model_bytes(model)
        setattr(model, QUANT_ATTR, report)
        return report


def regrouped_notes(config: QuantConfig, layers: Mapping[str, QuantizedLayer]) -> list[str]:
    """One line per (input features, group size used) for the layers whose explicit
    ``group_size`` did not divide their input features (:meth:`QuantConfig.group_sizes_for`),
    naming how many, the first of them and the size they got; empty when none."""
    asked = config.group_size
    if config.q_groups is not None or asked in (None, -1):
        return []
    changed: dict[tuple[int, int], list[str]] = {}
    for layer in layers.values():
        if layer.kind == "lm_head" and (layer.bits != config.bits
                                        or config.lm_head_group_size is not None):
            continue  # the head's own settings (QuantConfig.for_head), not the weights'
        if layer.group_size != asked:
            changed.setdefault((layer.shape[1], layer.group_size), []).append(layer.name)
    notes = []
    for (in_features, used), names in changed.items():
        if used == in_features and in_features < asked:
            how = "one group per output row (the layer has fewer inputs than a group)"
        elif used == in_features:
            how = (f"one scale per output row (no divisor of {in_features} of at least "
                   f"{min(MIN_FALLBACK_GROUP, max(1, asked // 2))} fits)")
        else:
            how = f"groups of {used} (a divisor of {in_features}: finer than asked)"
        notes.append(f"group_size={asked} does not divide the {in_features} input features of "
                     f"{len(names)} layer{'s' if len(names) > 1 else ''} (e.g. {names[0]!r}): "
                     f"{'they use' if len(names) > 1 else 'it uses'} {how}")
    return notes


def swap_in(model: nn.Module, name: str, new: QuantLinear) -> None:
    """Put ``new`` in place of module ``name`` (a Linear/Conv1D), carrying its instance hooks,
    recorded in the active ledger: undoing puts the original module back, its weight rebuilt
    by dequantizing ``new`` (lossy; the float weight is not kept)."""
    swap_quantized(model, name, new, "quantized linear",
                   f"weight of {name!r} rebuilt by dequantizing its int{new.spec.bits} weight "
                   f"(lossy: dequantized, the float weight was not kept)",
                   lambda old: _dequantize_into(old, new), ("weight",))


def _dequantize_into(old: nn.Module, new: QuantLinear):
    """The undo of replacing ``old`` by ``new``: re-point ``old``'s weight (``[out, in]``, or
    Conv1D ``[in, out]``) and bias at ``new``'s dequantized ones, in the dtype and on the
    device ``old``'s had (meta stays meta). Holds no float weight until it runs."""
    weight = getattr(old, "weight", None)
    dtype, device, shape = weight.dtype, weight.device, tuple(weight.shape)
    bias = getattr(old, "bias", None)
    bias_dtype = bias.dtype if isinstance(bias, torch.Tensor) else None

    @torch.no_grad()
    def undo() -> None:
        if device.type == "meta":
            rebuilt = torch.empty(shape, dtype=dtype, device="meta")
        else:
            w = new.dequantized_weight(dtype)  # [out, in]
            rebuilt = (w if new.source == "linear" else w.t()).contiguous().to(device)
        old.weight.data = rebuilt
        if bias_dtype is not None and new.bias is not None:
            old.bias.data = new.bias.detach().to(device=device, dtype=bias_dtype)
    return undo


class QuantizeOnRead(TensorHook):
    """The loader's per-tensor hook quantizing while reading (module docstring): the wanted
    layers' weights are quantized as their slices arrive and their biases joined to them in
    whichever order the files hold them."""

    name = "shardwise.quant"

    def __init__(self, quantizer: "Quantizer") -> None:
        self.quantizer = quantizer
        self.layers: dict[str, bool] = {}  # wanted layer → whether it is a transformers Conv1D
        self.biases: dict[str, torch.Tensor] = {}  # bias read before its weight
        self.installed: dict[str, QuantLinear] = {}
        #: the module name a tied weight is offered under → the head it is quantized for
        self.read_as: dict[str, str] = {}
        self.bytes_before = 0  # this rank's parameters unquantized in the compute dtype
        self._root: nn.Module | None = None  # the model being loaded (plan)

    def plan(self, model: nn.Module, tensors: list[TensorRef]) -> None:
        """Match the quantizer's layers with the tensors read and check the settings fit each
        layer's (this rank's) input features — every check before any data is read."""
        self._root = model
        modules = dict(model.named_modules())
        size = torch.empty((), dtype=self.quantizer.dtype).element_size()
        self.bytes_before = sum(
            math.prod(t.shape) * (size if t.dtype.is_floating_point else t.dtype.itemsize)
            for t in tensors if not t.is_buffer)
        for t in tensors:  # model order, so the first layer that does not fit is named
            name = next((n.removesuffix(".weight") for n in t.names if n.endswith(".weight")
                         and self.quantizer.wants(n.removesuffix(".weight"))
                         and is_quantizable(modules.get(n.removesuffix(".weight")))), None)
            if name is None:
                continue
            if len(t.names) > 1:
                self._plan_tied(name, t.names)
            conv1d = not isinstance(modules[name], nn.Linear)
            shape = t.shape  # [out, in]; Conv1D [in, out]
            self.quantizer.check(name, shape[0 if conv1d else 1], shape[1 if conv1d else 0])
            self.layers[name] = conv1d

    def _plan_tied(self, name: str, names: tuple[str, ...]) -> None:
        """A weight read once for several names: only the output head tied to the input
        embeddings (:mod:`.tied`) is quantized so (stored once); the loader offers it under its
        first name, which :meth:`on_tensor` maps back to the head."""
        tied = self.quantizer.tied.get(name)
        if tied is None or set(names) != {f"{name}.weight", f"{tied}.weight"}:
            others = [n for n in names if n != f"{name}.weight"]
            raise ConfigError(f"layer {name!r}'s weight is tied to {others}; only an output "
                              f"head tied to the input embeddings can be quantized (once), "
                              f"remove lm_head=True")
        self.read_as[names[0].rpartition(".")[0]] = name

    def on_tensor(self, module_name: str, module: nn.Module, param: str,
                  tensor: torch.Tensor) -> bool:
        if param == "weight":
            module_name = self.read_as.get(module_name, module_name)
        if module_name not in self.layers or param not in ("weight", "bias"):
            return False
        if param == "bias":
            installed = self.installed.get(module_name)
            if installed is None:
                self.biases[module_name] = tensor  # joined when its weight arrives
            else:
                installed.bias = nn.Parameter(tensor.to(device=self.quantizer.device,
                                                        dtype=self.quantizer.dtype),
                                              requires_grad=False)
            return True
        qlinear = self.quantizer.quantize_tensor_for(module_name, tensor,
                                                     self.biases.pop(module_name, None),
                                                     conv1d=self.layers[module_name])
        self.quantizer.install(self._root, module_name, qlinear)
        self.installed[module_name] = qlinear
        return True

    def finish(self, model: nn.Module) -> QuantReport:
        missing = sorted(set(self.layers) - set(self.installed))
        if missing:
            raise ConfigError(f"the checkpoint holds no weight for the layers {missing[:3]} "
                              f"to quantize")
        return self.quantizer.finish(model, self.bytes_before)


def _refuse_twice(model: nn.Module) -> None:
    if getattr(model, QUANT_ATTR, None) is not None or any(
            isinstance(m, (QuantLinear, QuantExperts)) for m in model.modules()):
        raise AlreadyQuantizedError(
            f"{type(model).__name__} is already quantized; quantizing again would compound the "
            "rounding error. Quantize once, from the full-precision model (or load the saved "
            "quantized weights with shardwise.quant.load_quantized)")


def _weight_shape(module: nn.Module) -> tuple[int, int]:
    """(out_features, in_features) of a Linear or transformers Conv1D (weight ``[in, out]``)."""
    out_features, in_features = module.weight.shape
    return (out_features, in_features) if isinstance(module, nn.Linear) else \
        (in_features, out_features)


def _local_shapes(prepared: Any, rank: int) -> dict[str, tuple[int, int]]:
    """Module name → this rank's (out, in) under the tensor-parallel ``prepared``
    (:class:`~shardwise.sharding.PreparedShards`), for the modules it splits."""
    out = {}
    for spec in prepared.specs if prepared is not None else ():
        module = spec.module
        if not _is_target_kind(module):
            continue
        weight = list(module.weight.shape)  # [out, in]; Conv1D [in, out]
        weight[spec.dim] = sum(b - a for a, b in spec.ranges[rank])
        out[spec.name] = tuple(weight) if isinstance(module, nn.Linear) else tuple(weight[::-1])
    return out


def _validate_targets(model: nn.Module, quantizer: Quantizer, targets: Iterable[str],
                      shapes: Mapping[str, tuple[int, int]] | None = None) -> None:
    """Every check of every target layer, before any is touched: it exists, is a Linear/Conv1D
    not yet quantized, and the settings fit it with a fast kernel (:meth:`Quantizer.check`).
    ``shapes``: name → (out, in) overriding the module's own (this rank's slice)."""
    modules = dict(model.named_modules())
    for name in targets:
        if name not in modules:
            raise ConfigError(f"no module named {name!r} to quantize")
        module = modules[name]
        if isinstance(module, QuantLinear):
            raise AlreadyQuantizedError(f"layer {name!r} is already quantized")
        if not _is_target_kind(module):
            raise ConfigError(f"layer {name!r} is a {type(module).__name__}, not an nn.Linear or "
                              "transformers Conv1D; only those can be quantized")
        out_features, in_features = (shapes or {}).get(name) or _weight_shape(module)
        quantizer.check(name, in_features, out_features)


def check_fits(model: nn.Module, spec: QuantConfig | Mapping | None, accelerator: Accelerator,
               dtype: torch.dtype, *, roles: Mapping | None = None,
               injection_policy: Mapping | None = None, prepared: Any = None, rank: int = 0,
               device: torch.device | str | None = None,
               plan: "Plan | None" = None) -> list[str]:
    """Raise what :func:`quantize_model` would raise for these settings, without changing
    ``model`` (nor quantizing anything): a malformed config, a model already quantized,
    DeepSpeed ``q_groups`` that do not cut a layer's inputs equally (an explicit ``group_size``
    that does not divide them is not refused: see :meth:`Quantizer.choose_spec`), an odd input
    count at 4 bits, or a layer only the slow reference kernel could
    run (unless ``allow_slow_kernels``), each a :class:`ConfigError` naming the layer. For
    callers that must fail before their first in-place change (``init_inference``).

    Args:
        model: the model as it is now (real weights or on the meta device: only names, types
            and shapes are read).
        spec: the ``quant=`` dict or a :class:`QuantConfig` (None or disabled: nothing to check).
        accelerator, dtype: where and in which model dtype it will run.
        roles / injection_policy / plan: as :func:`quant_targets` (which layers).
        prepared, rank: a tensor-parallel :class:`~shardwise.sharding.PreparedShards` not yet
            applied and this rank: the layers are checked with this rank's slice of them (the
            roles default to ``prepared.roles``).
        device: the device it will run on (default ``accelerator.device()``).

    Returns:
        the names of the layers that would be quantized.
    """
    config = spec if isinstance(spec, QuantConfig) else parse_quant(spec)
    if config is None:
        return []
    if roles is None and prepared is not None:
        roles = prepared.roles
    quantizer = Quantizer.for_model(model, config, accelerator, dtype, device, roles,
                                    injection_policy, plan)
    order = list(dict(model.named_modules()))
    targets = sorted(quantizer.names, key=order.index)
    _validate_targets(model, quantizer, targets, _local_shapes(prepared, rank))
    experts = expert_modules(model)
    _validate_experts(model, quantizer, experts)
    return targets + experts


@torch.no_grad()
def quantize_model(model: nn.Module, spec: QuantConfig | Mapping, accelerator: Accelerator,
                   dtype: torch.dtype, names: Iterable[str] | None = None, *,
                   device: torch.device | str | None = None, roles: Mapping | None = None,
                   injection_policy: Mapping | None = None,
                   plan: "Plan | None" = None) -> QuantReport:
    """Quantize ``model``'s planned linears in place and put the rest on ``device`` in ``dtype``.

    Args:
        model: a model with real weights (under tensor parallelism: this rank's shards).
        spec: a :class:`QuantConfig` or the ``quant=`` dict.
        accelerator: where it runs (its kernel backends are tried in order).
        dtype: the model's dtype (embeddings, norms, biases, and the activations between
            layers). A quantized layer runs its kernel in it when a fast kernel takes it, else
            in the accelerator's dtype that has one (its input cast to that dtype, its output
            back to ``dtype``; see the module docstring).
        names: module names to quantize; None picks them from the plan (module docstring).
        device: default ``accelerator.device()``.
        roles / injection_policy / plan: which layers, as :func:`quant_targets` (``plan``: the
            engine's, nothing looked up again).

    Returns:
        the :class:`QuantReport` (also stored on the model as ``_shardwise_quant_report``).

    Raises:
        AlreadyQuantizedError: the model is already quantized.
        QuantizationError / ConfigError: bad bits, a group size not dividing a layer's inputs,
            a layer no fast kernel takes without ``allow_slow_kernels`` (each naming the
            layer) — all before any layer is replaced (:func:`check_fits` raises the same
            without quantizing).
    """
    from ..transforms import cast_and_move

    config = spec if isinstance(spec, QuantConfig) else parse_quant(spec)
    if config is None:
        raise ConfigError("quantization is disabled in this quant config")
    _refuse_twice(model)
    if names is None:
        quantizer = Quantizer.for_model(model, config, accelerator, dtype, device, roles,
                                        injection_policy, plan)
        targets = sorted(quantizer.names, key=list(dict(model.named_modules())).index)
    else:
        targets = list(names)
        quantizer = Quantizer(config, accelerator, dtype, device, targets, _output_name(model))
        quantizer.source = "names given"
        quantizer.find_tied(model)
    experts = expert_modules(model)
    if names is not None:  # experts modules named among the names
        experts = [n for n in experts if n in targets]
        targets = [n for n in targets if n not in experts]
    _validate_targets(model, quantizer, targets)  # every layer before touching any
    _validate_experts(model, quantizer, experts)
    bytes_before = bytes_in_dtype(model, dtype)
    for name in targets:
        quantizer.quantize_module(model, name)
    for name in experts:
        quantize_experts_module(quantizer, model, name)
    cast_and_move(model, quantizer.device, dtype)
    return quantizer.finish(model, bytes_before)


def _validate_experts(model: nn.Module, quantizer: Quantizer, names: Iterable[str]) -> None:
    """Every check of the experts modules ``names`` (:func:`~.experts.check_experts`), before
    any module is touched."""
    for name in names:
        check_experts(quantizer, name, model.get_submodule(name))


@torch.no_grad()
def quantize_model_experts(model: nn.Module, report: QuantReport, accelerator: Accelerator,
                           dtype: torch.dtype, device: torch.device | str | None = None
                           ) -> QuantReport:
    """Quantize ``model``'s experts modules in place with ``report``'s settings and add them to
    ``report`` (bytes included): for a model whose linears were quantized while its checkpoint
    was read (the experts' 3-D weights are read whole, then quantized here, after sharding, so
    under expert parallelism each rank quantizes its own). Nothing to do for a dense model."""
    experts = [n for n in expert_modules(model)
               if not isinstance(model.get_submodule(n), QuantExperts)]
    if not experts:
        return report
    quantizer = Quantizer(report.config, accelerator, dtype, device)
    _validate_experts(model, quantizer, experts)
    for name in experts:
        quantize_experts_module(quantizer, model, name)
    report.layers.update(quantizer.layers)
    report.bytes_after = model_bytes(model)  # bytes_before: the reader counted every tensor
    return report

"""Quantized Mixture-of-Experts experts: :class:`QuantExperts` replaces a Hugging Face experts
module (the one holding the stacked 3-D expert weights) with int8/int4 weights and the grouped
``quant_moe_mlp`` kernel.

Which modules: every module holding 3-D ``gate_up_proj`` and ``down_proj`` tensors (HF's
``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``DeepseekV3Experts``: gate_up
``[E, 2I, H]`` with the I gate rows first, down ``[E, H, I]``, activation ``act_fn``; and
``GptOssExperts``: gate_up ``[E, H, 2I]`` with gate/up interleaved, down ``[E, I, H]``, biases,
its clamped SwiGLU's ``limit``/``alpha``), found by structure, so a new family's experts are
covered without code. Under expert parallelism the module holds only this rank's experts after
sharding (step 5), so each rank quantizes its own ``E_local`` experts.

How: each stacked weight is quantized row by row as a ``[E * N, K]`` linear would be (every
expert its own scales per output row and group: :func:`~shardwise.kernels.reference.quant.
quantize_experts`), with the group size the ``quant=`` settings give the MLP layer of that input
width (``gate_up``: K = H; ``down``: K = I); GPT-OSS's are first converted to the stacked layout.
The ``quant_moe_mlp`` kernel is resolved as ``quant_linear``'s is (the first fast one over the
model's dtype, then the accelerator's others: an fp32 model on CPU runs it in bf16, the input
cast to bf16 and the output back), and a layer only the reference could run is refused unless
``allow_slow_kernels``. On CPU it is :class:`shardwise.kernels.cpu.quant.CpuQuantMoE`: the native
AVX512-VNNI kernel the dense quantized linears run, where it builds — **the activations entering
each expert matrix are rounded to int8 per block of 16 (8-bit) / 32 (4-bit) columns** (the
token for gate_up, the float32 GLU output for down), the numerics it declares (oracle
:func:`shardwise.kernels.reference.moe.int8_activation_moe_mlp`; against HF on the same
dequantized expert weights, fp32 tiny models: 0.02-0.1% relative logit error, identical greedy
tokens); its packed experts take the model's dtype as it is (``compute_dtype`` None: an fp32
model's experts are not cast to bf16) — else (or with ``SHARDWISE_CPU_QUANT_KERNEL=torch``)
torch's packed weight-only kernels in bf16, under their rules (no int4 groups of 16).

The module honours the experts-module contract (:mod:`shardwise.moe.spec`): called as a module,
``experts(x [T, H], ids [T, k] local to the rank, weights [T, k]) → [T, H]``, an id equal to the
experts it holds (``E_local``) contributing nothing. It keeps no ``gate_up_proj`` attribute, so
the MoE mechanism (:func:`shardwise.moe.install_moe`) calls it as it is; HF's own MoE blocks call
it the same way.

Undo (``engine.close()``): the original experts module is put back with its weights rebuilt by
dequantizing, in its own layout, dtype and device (lossy, as for quantized linears).

Saving and loading (:mod:`shardwise.quant.checkpoint`): :meth:`QuantExperts.describe_tensors`,
:meth:`~QuantExperts.packed_meta` and the :class:`ExpertsShape` describe the module; a loader
makes an empty one with :meth:`QuantExperts.empty_like` and fills its buffers as saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ConfigError
from ..kernel_registry import REFERENCE, KernelImpl, registry
from .modules import PackedLayout, kernel_for_backend, swap_quantized
from shardwise.kernels.reference import moe as ref_moe
from shardwise.kernels.reference.quant import (PackedQuantExperts, QuantizationError, QuantSpec,
                                               quantize_experts)

if TYPE_CHECKING:
    from .transform import Quantizer

#: the report's layer kind of quantized experts
EXPERTS_KIND = "experts"
#: HF activation module class names → the kernels' activation
_ACTIVATIONS = {"SiLUActivation": "silu", "SiLU": "silu", "GELUActivation": "gelu",
                "GELU": "gelu"}
#: the two stacked matrices, as they are named in the report (``<experts>.<matrix>``)
MATRICES = ("gate_up_proj", "down_proj")


# ----- what an experts module holds -------------------------------------------------------------


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` holds HF's stacked 3-D expert weights (gate_up_proj, down_proj)."""
    gate_up, down = (getattr(module, n, None) for n in MATRICES)
    return (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3)


def expert_modules(model: nn.Module) -> list[str]:
    """Names of the experts modules of ``model`` (:func:`is_experts_module`), in model order."""
    return [name for name, m in model.named_modules() if name and is_experts_module(m)]


#: the layouts an experts module's weights are held in (``ExpertsShape.layout``)
LAYOUTS = ("stacked", "gpt_oss")


@dataclass(frozen=True)
class ExpertsShape:
    """One experts module as the kernel sees it.

    layout: ``"stacked"`` or ``"gpt_oss"`` (as it is held now); experts: E held (this rank's);
    hidden: H; inter: I; activation: ``"silu"``/``"gelu"``; clamp/alpha: GPT-OSS's clamped
    SwiGLU (None: the plain GLU).
    """

    layout: str
    experts: int
    hidden: int
    inter: int
    activation: str
    clamp: float | None = None
    alpha: float = ref_moe.GPT_OSS_ALPHA

    def math(self) -> dict[str, Any]:
        """The kernel's activation keywords."""
        kw: dict[str, Any] = {"activation": self.activation}
        if self.clamp is not None:
            kw.update(clamp=self.clamp, alpha=self.alpha)
        return kw


def experts_shape(name: str, module: nn.Module) -> ExpertsShape:
    """The :class:`ExpertsShape` of experts module ``name``; a :class:`ConfigError` naming it
    when its weights are not one of the two layouts or its activation is not one the kernels
    run."""
    gate_up, down = module.gate_up_proj, module.down_proj
    gpt_oss = hasattr(module, "gate_up_proj_bias") and not getattr(module, "_shardwise_stacked",
                                                                    False)
    if gpt_oss:  # [E, H, 2I], [E, I, H]
        e, h, two_i = gate_up.shape
        expected = (e, two_i // 2, h)
    else:  # [E, 2I, H], [E, H, I]
        e, two_i, h = gate_up.shape
        expected = (e, h, two_i // 2)
    if two_i % 2 or tuple(down.shape) != expected:
        raise ConfigError(f"experts {name!r}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                          f"{tuple(down.shape)} are neither HF's stacked layout ([E, 2I, H], "
                          f"[E, H, I]) nor GPT-OSS's ([E, H, 2I], [E, I, H]); they cannot be "
                          f"quantized")
    if gpt_oss:
        return ExpertsShape("gpt_oss", e, h, two_i // 2, "silu", float(module.limit),
                            float(module.alpha))
    act = type(getattr(module, "act_fn", None)).__name__
    if act not in _ACTIVATIONS:
        raise ConfigError(f"experts {name!r}: activation {act} is not one the quantized experts "
                          f"kernel runs (SiLU, exact GELU); leave the model unquantized")
    return ExpertsShape("stacked", e, h, two_i // 2, _ACTIVATIONS[act])


def _stacked(module: nn.Module, shape: ExpertsShape):
    """(gate_up [E, 2I, H], down [E, H, I], gate_up_bias [E, 2I] | None, down_bias [E, H] | None)
    in the kernels' layout (GPT-OSS's converted: a copy)."""
    if shape.layout == "stacked":
        return (module.gate_up_proj.detach(), module.down_proj.detach(),
                _bias(module, "gate_up_proj_bias"), _bias(module, "down_proj_bias"))
    gate_up, gate_up_bias, down, down_bias = ref_moe.gpt_oss_layout(
        module.gate_up_proj.detach(), module.gate_up_proj_bias.detach(),
        module.down_proj.detach(), module.down_proj_bias.detach())
    return gate_up, down, gate_up_bias, down_bias


def _bias(module: nn.Module, name: str) -> torch.Tensor | None:
    bias = getattr(module, name, None)
    return bias.detach() if isinstance(bias, torch.Tensor) else None


# ----- the module -------------------------------------------------------------------------------


class QuantExperts(PackedLayout):
    """The experts of one MoE layer with int8/int4 weights (module docstring): called as
    ``experts(x [T, H], ids [T, k], weights [T, k]) → [T, H]``.

    Attributes:
        num_experts: experts held (E_local under expert parallelism); hidden_dim (H),
            intermediate_dim (I): as HF's experts modules name them.
        spec: the gate_up matrix's :class:`QuantSpec` per expert (the down matrix's is
            ``down_spec``); backend, compute_dtype: the kernel's (inputs of another dtype are
            cast to it and the output back, as :class:`~shardwise.quant.QuantLinear` does).
        gate_up_proj_bias / down_proj_bias: GPT-OSS's biases in the kernels' layout
            (Parameters in the model's dtype), else None.
    """

    #: Lets byte counters (benchmark roofline, quant report) count these buffers as weights.
    counts_buffers_as_weights = True

    def __init__(self, gate_up: PackedQuantExperts, down: PackedQuantExperts, kernel: KernelImpl,
                 shape: ExpertsShape, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = (shape.experts, shape.hidden,
                                                                    shape.inter)
        self.shape = shape
        self.kernel = kernel
        self.backend, self.compute_dtype = gate_up.backend, gate_up.dtype
        self.spec, self.down_spec = gate_up.spec, down.spec
        self._meta = {"gate_up": dict(gate_up.meta), "down": dict(down.meta)}
        self._names = {"gate_up": tuple(gate_up.tensors), "down": tuple(down.tensors)}
        for part, packed in (("gate_up", gate_up), ("down", down)):
            for name, tensor in packed.tensors.items():
                self.register_buffer(f"{part}_{name}", tensor)
        self.gate_up_proj_bias = _param(gate_up_bias)
        self.down_proj_bias = _param(down_bias)
        self._math = shape.math()
        self._packed = self.packed_view()

    def packed_view(self) -> dict[str, PackedQuantExperts]:
        specs = {"gate_up": self.spec, "down": self.down_spec}
        return {part: PackedQuantExperts(self.backend, specs[part], self.num_experts,
                                         self.compute_dtype,
                                         {n: getattr(self, f"{part}_{n}") for n in names},
                                         self._meta[part])
                for part, names in self._names.items()}

    @property
    def packed(self) -> dict[str, PackedQuantExperts]:
        """``{"gate_up": ..., "down": ...}`` over the current buffers (rebuilt whenever they
        change, never in ``forward``: a compiled step would guard on a cache)."""
        return self._packed

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], local expert ids [T, k] (``num_experts`` = another rank's expert), weights
        [T, k] → [T, H] in x.dtype."""
        x = hidden_states
        if self.compute_dtype is not None and x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        out = self.kernel(x, self._packed["gate_up"], self._packed["down"], top_k_index,
                          top_k_weights, gate_up_bias=self.gate_up_proj_bias,
                          down_bias=self.down_proj_bias, **self._math)
        return out.to(hidden_states.dtype)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the packed weights (scales included), biases excluded."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values() if b is not None)

    @torch.no_grad()
    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E, 2I, H], down [E, H, I]) in float32, as the kernel computes with them
        (the kernel's own ``dequantize``: exact for the native CPU layout and torch's int8, the
        identity run for torch's CPU int4)."""
        return (self.kernel.fn.dequantize(self._packed["gate_up"]),
                self.kernel.fn.dequantize(self._packed["down"]))

    # ----- saving and loading (shardwise.quant.checkpoint) ---------------------------------------

    def describe_tensors(self) -> dict[str, tuple[list[int], str]]:
        """Buffer name (``gate_up_<t>`` / ``down_<t>``) → (shape, dtype name) of the packed
        tensors, each with the leading ``[E]`` (experts held) dimension (see
        :meth:`empty_like`)."""
        return {f"{part}_{n}": (list(getattr(self, f"{part}_{n}").shape),
                                str(getattr(self, f"{part}_{n}").dtype).removeprefix("torch."))
                for part, names in self._names.items() for n in names}

    def packed_meta(self) -> dict[str, dict[str, Any]]:
        """``{"gate_up": meta, "down": meta}``: each matrix's layout settings (JSON values)."""
        return {part: dict(meta) for part, meta in self._meta.items()}

    @classmethod
    def empty_like(cls, specs: tuple[QuantSpec, QuantSpec], backend: str,
                   compute_dtype: torch.dtype | None, meta: dict[str, dict],
                   shapes: dict[str, tuple[list[int], str]], shape: ExpertsShape,
                   bias_shapes: dict[str, list[int] | None],
                   device: torch.device | str | None = None,
                   bias_dtype: torch.dtype | None = None) -> "QuantExperts":
        """A shell with uninitialised buffers of the given shapes/dtypes, to load a saved state
        dict into (nothing is quantized). ``specs``: (gate_up, down) per-expert specs;
        ``shapes``: :meth:`describe_tensors`' output; ``shape``: the module's
        :class:`ExpertsShape`; ``bias_shapes``: ``{"gate_up_proj_bias": [E, 2I] | None,
        "down_proj_bias": [E, H] | None}``, made in ``bias_dtype`` (default the compute dtype,
        else float32). The kernel is ``backend``'s ``quant_moe_mlp`` (KeyError when that backend
        cannot run here)."""
        kernel = kernel_for_backend(backend, "quant_moe_mlp")
        packed = {}
        for part, spec in zip(("gate_up", "down"), specs):
            prefix = f"{part}_"
            tensors = {n[len(prefix):]: torch.empty(s, dtype=getattr(torch, dt), device=device)
                       for n, (s, dt) in shapes.items() if n.startswith(prefix)}
            packed[part] = PackedQuantExperts(backend, spec, shape.experts, compute_dtype,
                                              tensors, dict(meta[part]))
        bias_dtype = bias_dtype or compute_dtype or torch.float32
        biases = [torch.empty(s, dtype=bias_dtype, device=device) if s is not None else None
                  for s in (bias_shapes.get("gate_up_proj_bias"),
                            bias_shapes.get("down_proj_bias"))]
        return cls(packed["gate_up"], packed["down"], kernel, shape, *biases)

    def extra_repr(self) -> str:
        s, d = self.spec, self.down_spec
        kind = "sym" if s.symmetric else "asym"
        return (f"experts={self.num_experts}, hidden={self.hidden_dim}, "
                f"inter={self.intermediate_dim}, int{s.bits} {kind}, groups "
                f"{s.group_size}/{d.group_size}, {self.shape.activation}"
                f"{', clamped' if self.shape.clamp is not None else ''}, "
                f"backend={self.backend}, "
                f"compute={str(self.compute_dtype).removeprefix('torch.')}")


def _param(tensor: torch.Tensor | None) -> nn.Parameter | None:
    return nn.Parameter(tensor.detach(), requires_grad=False) if tensor is not None else None


# ----- quantizing one module --------------------------------------------------------------------


def expert_specs(quantizer: "Quantizer", name: str, shape: ExpertsShape
                 ) -> tuple[QuantSpec, QuantSpec]:
    """(gate_up, down) per-expert specs under the quantizer's settings; a ConfigError naming
    the matrix when a group size does not fit it."""
    config = quantizer.config
    specs = []
    for matrix, (out_f, in_f) in zip(MATRICES, ((2 * shape.inter, shape.hidden),
                                                (shape.hidden, shape.inter))):
        layer = f"{name}.{matrix}"
        group = config.group_size_for(layer, in_f)
        if config.bits == 4 and in_f % 2:
            raise QuantizationError(f"layer {layer!r}: 4-bit packing needs an even number of "
                                    f"input features, got {in_f}")
        specs.append(QuantSpec(config.bits, group, config.symmetric, in_f, out_f))
    return specs[0], specs[1]


def resolve_experts_kernel(quantizer: "Quantizer", specs: tuple[QuantSpec, QuantSpec]
                           ) -> tuple[KernelImpl, torch.dtype]:
    """(the ``quant_moe_mlp`` implementation, its activation dtype): the first non-reference
    kernel over the quantizer's compute dtypes, else the reference in the model's dtype."""
    for dtype in quantizer.compute_dtypes():
        impl = registry.resolve("quant_moe_mlp", quantizer.accelerator, dtype,
                                device_type=quantizer.device.type, specs=specs)
        if impl.backend != REFERENCE:
            return impl, dtype
    return registry.resolve("quant_moe_mlp", quantizer.accelerator, quantizer.dtype,
                            device_type=quantizer.device.type, specs=specs), quantizer.dtype


def check_experts(quantizer: "Quantizer", name: str, module: nn.Module) -> None:
    """Every check of experts module ``name`` (layout, activation, group sizes, a fast kernel or
    ``allow_slow_kernels``), without changing it."""
    shape = experts_shape(name, module)
    specs = expert_specs(quantizer, name, shape)
    _refuse_slow(quantizer, name, specs, resolve_experts_kernel(quantizer, specs)[0])


def _refuse_slow(quantizer: "Quantizer", name: str, specs, impl: KernelImpl) -> None:
    if impl.backend != REFERENCE or quantizer.config.allow_slow_kernels:
        return
    reasons = []
    for backend in quantizer.accelerator.ordered_kernel_backends():
        if backend == REFERENCE or registry.load_backend(backend):
            continue
        other = registry.implementations("quant_moe_mlp").get(backend)
        if other is None:
            reasons.append(f"backend {backend!r} has no quant_moe_mlp kernel")
            continue
        dtypes = [d for d in quantizer.compute_dtypes()
                  if other.dtypes is None or d in other.dtypes]
        why = other.fn.unsupported_reason(device_type=quantizer.device.type, dtype=dtypes[0],
                                          specs=specs) if dtypes else "no dtype it takes"
        reasons.append(f"backend {backend!r}: {why or 'refuses these weights'}")
    gate_up, down = specs
    raise ConfigError(
        f"quant {quantizer.config.describe()}: experts {name!r} (gate_up [{gate_up.out_features},"
        f" {gate_up.in_features}] group {gate_up.group_size}, down [{down.out_features}, "
        f"{down.in_features}] group {down.group_size} per expert) have no fast quant_moe_mlp "
        f"kernel on the {quantizer.accelerator.name!r} accelerator ({quantizer.device}): "
        f"{'; '.join(reasons) or 'no kernel backend besides the torch reference'}. The "
        f"reference dequantizes every expert on every call; choose settings a fast kernel takes "
        f"(e.g. num_bits=8, or int4 groups of 32/64/128 dividing both widths), or accept it "
        f"with quant={{..., 'allow_slow_kernels': True}}")


@torch.no_grad()
def quantize_experts_module(quantizer: "Quantizer", model: nn.Module, name: str) -> QuantExperts:
    """Quantize experts module ``name`` of ``model`` and put a :class:`QuantExperts` in its
    place (recorded in the active ledger: the undo dequantizes back into the original)."""
    from .transform import QuantizedLayer

    module = model.get_submodule(name)
    shape = experts_shape(name, module)
    specs = expert_specs(quantizer, name, shape)
    impl, kernel_dtype = resolve_experts_kernel(quantizer, specs)
    _refuse_slow(quantizer, name, specs, impl)
    gate_up, down, gate_up_bias, down_bias = _stacked(module, shape)
    packed = []
    for weight, spec in zip((gate_up, down), specs):
        qw = quantize_experts(weight.to(quantizer.device), spec.bits, spec.group_size,
                              spec.symmetric)
        packed.append(impl.fn.prepack(qw, shape.experts, quantizer.device, kernel_dtype))
        del qw
    biases = [b.to(device=quantizer.device, dtype=quantizer.dtype) if b is not None else None
              for b in (gate_up_bias, down_bias)]
    new = QuantExperts(packed[0], packed[1], impl, shape, *biases)
    swap_in_experts(model, name, new)
    for matrix, spec, p in zip(MATRICES, specs, packed):
        layer = f"{name}.{matrix}"
        quantizer.layers[layer] = QuantizedLayer(
            layer, EXPERTS_KIND, impl.backend, spec.bits, spec.group_size,
            (shape.experts * spec.out_features, spec.in_features), p.nbytes,
            p.dtype or quantizer.dtype)  # None: the kernel takes the model's dtype as it is
    return new


def swap_in_experts(model: nn.Module, name: str, new: QuantExperts) -> None:
    """Put ``new`` in place of experts module ``name`` (its instance hooks carried), recorded in
    the active ledger: the undo puts the original back with its weights rebuilt by
    dequantizing ``new`` (lossy), in their own layout, dtype and device."""
    swap_quantized(model, name, new, "quantized experts",
                   f"expert weights of {name!r} rebuilt by dequantizing their int{new.spec.bits} "
                   f"weights (lossy: the float weights were not kept)",
                   lambda old: _dequantize_into(old, new), ("gate_up_proj", "down_proj"))


def _dequantize_into(old: nn.Module, new: QuantExperts):
    """The undo: ``old``'s weights (and GPT-OSS biases) rebuilt from ``new`` in the layout,
    dtype and device they had (meta stays meta)."""
    layout = new.shape.layout
    saved = {p: (getattr(old, p).dtype, getattr(old, p).device, tuple(getattr(old, p).shape))
             for p in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
             if isinstance(getattr(old, p, None), torch.Tensor)}

    @torch.no_grad()
    def undo() -> None:
        gate_up, down = new.dequantized()  # [E, 2I, H], [E, H, I] float32
        gu_bias, dn_bias = new.gate_up_proj_bias, new.down_proj_bias
        if layout == "gpt_oss":
            gate_up, down = _interleave(gate_up.transpose(1, 2)), down.transpose(1, 2)
            gu_bias = _interleave(gu_bias) if gu_bias is not None else None
        rebuilt = {"gate_up_proj": gate_up, "down_proj": down, "gate_up_proj_bias": gu_bias,
                   "down_proj_bias": dn_bias}
        for param, (dtype, device, shape) in saved.items():
            value = rebuilt[param]
            if device.type == "meta":
                value = torch.empty(shape, dtype=dtype, device="meta")
            getattr(old, param).data = value.detach().to(device=device, dtype=dtype).contiguous()
    return undo


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] gate half then up half → GPT-OSS's interleaved [..., 2I] (gate even, up odd)."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2).contiguous()

"""The one generic Mixture-of-Experts mechanism: every family's MoE block run from its
:class:`~shardwise.moe.MoESpec` and the plan's :class:`~shardwise.plan.ExpertPlan`, through the
``moe`` kernels, this rank's experts only.

:func:`install_moe` (``init_inference``'s MoE step, after quantization and before injection;
usable alone) gives each MoE block of the plan's ``moe_layers`` an instance forward
(:class:`MoEBlockForward`, recorded in the active ledger: ``engine.close()`` removes it):

1. the router's logits ``x [T, H] @ router.weight [E, H]ᵀ (+ router.bias)`` in the spec's
   ``router_dtype``, scored by ``kernels.moe_route`` (softmax/sigmoid, correction bias, the
   plan's router groups, renormalisation, the config's scaling factor) → global expert ids
   ``[T, k]`` and float32 weights ``[T, k]``;
2. global → local ids with the plan's expert range ``[start, end)``: an expert outside it (on
   another ep rank) becomes the sentinel ``E_local = end - start`` (it contributes nothing
   here: the experts-module contract, :mod:`shardwise.moe.spec`);
3. the experts module called as a module, ``experts(x, local ids, weights) → [T, H]``: HF's
   experts module gets an instance forward on ``kernels.moe_grouped_mlp``
   (:class:`ExpertsKernelForward`); a replacement that already honours the contract (a
   quantized experts module) is called as it is;
4. with ep > 1 the ranks' shares are combined over the ep group (``moe={"dispatch": ...}``):
   one all-reduce of the routed output (every rank holds the same tokens and computed its own
   experts' share), or the tokens sent to their experts' ranks and back by all-to-all
   (:mod:`shardwise.moe.dispatch`);
5. the shared expert(s), called as modules (their tensor-parallel hooks run), scaled by
   ``sigmoid(shared_gate(x))`` where the family has one, added.

The block returns what the HF decoder layer expects: the hidden states ``[b, s, H]``, or
``(hidden, router weights [T, k])`` where ``MoESpec.returns_router_scores`` (GPT-OSS). Every
step has static shapes and no host synchronisation when the kernels resolved for the dtype are
capturable (the CPU backend's are), so a graph strategy captures MoE decode steps too.

Expert layouts: ``"stacked"`` (HF's ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) is the
kernels' own; ``"gpt_oss"`` is converted once, in place, to it by :func:`to_stacked_layout`
(recorded: ``close()`` converts back).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.extensions import CHECKPOINT_VIEW
from ..errors import ConfigError
from ..kernel_registry import registry
from ..ledger import record, set_forward
from ..policy import first_config_value
from .spec import MoESpec

log = logging.getLogger(__name__)

#: HF activation names → the ``moe_grouped_mlp`` activation
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu"}


class MoEError(ConfigError):
    """The model's MoE blocks cannot be run by shardwise's MoE mechanism (no MoE policy, a block
    or expert weights not where or as the policy says, an activation the kernels lack)."""


# ----- what the mechanism reads -----------------------------------------------------------------


@dataclass(frozen=True)
class RouterSettings:
    """How one model's router scores, resolved from its :class:`MoESpec`, config and plan."""

    top_k: int
    scoring: str
    float32: bool  # logits computed in float32 (else the hidden states' dtype)
    renormalize: bool
    scale: float
    n_group: int = 1
    topk_group: int = 1

    def route_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``moe_route`` (bias excepted: it is per block)."""
        return dict(scoring=self.scoring, n_group=self.n_group, topk_group=self.topk_group,
                    renormalize=self.renormalize, scale=self.scale)


@dataclass(frozen=True)
class ExpertMath:
    """The experts' MLP as the kernel runs it: activation and GPT-OSS's clamped SwiGLU."""

    activation: str
    clamp: float | None = None
    alpha: float | None = None

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"activation": self.activation}
        if self.clamp is not None:
            kw["clamp"] = self.clamp
            kw["alpha"] = self.alpha
        return kw


@dataclass(frozen=True)
class MoEKernels:
    """The moe ops one model calls, resolved once for its dtype."""

    route: Callable
    grouped_mlp: Callable
    backends: dict[str, str]
    capturable: bool
    #: ``grouped_mlp`` takes the ``sentinel`` hint (False: no id is another rank's expert)
    sentinel_hint: bool = False


@dataclass
class MoEReport:
    """What :func:`install_moe` did (``engine.moe``)."""

    layers: tuple[int, ...]
    expert_range: tuple[int, int]
    total: int
    ep_size: int
    backends: dict[str, str]
    capturable: bool
    #: how the ep ranks combine the routed outputs: "all_reduce" or "all_to_all"
    dispatch: str = "all_reduce"
    #: layer index → ``"kernel"`` (HF's experts module on the moe kernels) or the class name of
    #: a replacement called as it is (a quantized experts module)
    experts: dict[int, str] = field(default_factory=dict)

    def summary(self) -> str:
        start, end = self.expert_range
        kinds = sorted(set(self.experts.values()))
        return (f"MoE: {len(self.layers)} blocks through the moe kernels "
                f"({', '.join(f'{op}={b}' for op, b in self.backends.items())}), experts "
                f"[{start}, {end}) of {self.total} on this rank (ep={self.ep_size}"
                f"{', ' + self.dispatch if self.ep_size > 1 else ''}); experts modules: "
                f"{', '.join(kinds) or 'none'}")


def _moe_spec(policy) -> MoESpec:
    spec = getattr(policy, "moe", None) if policy is not None else None
    if not isinstance(spec, MoESpec):
        name = getattr(policy, "name", None)
        raise MoEError(f"the model is a Mixture-of-Experts model but "
                       f"{'policy ' + repr(name) if name else 'no registered policy'} gives no "
                       f"MoESpec (Policy.moe) saying where its router and experts are; add one "
                       f"to the family's policy, or run without replace_with_kernel_inject, "
                       f"ep_size > 1 and quant (the HF MoE blocks then run as they are)")
    return spec


def router_settings(spec: MoESpec, config: Any, experts_plan) -> RouterSettings:
    """The router's scoring from ``spec``, the model ``config`` and the plan's experts."""
    renormalize = spec.renormalize
    if isinstance(renormalize, str):
        renormalize = bool(getattr(config, renormalize, False))
    scale = getattr(config, spec.scale_config, None) if spec.scale_config else None
    n_group, topk_group = experts_plan.groups or (1, 1)
    return RouterSettings(top_k=experts_plan.top_k, scoring=spec.scoring,
                          float32=spec.router_dtype == "float32", renormalize=bool(renormalize),
                          scale=1.0 if scale is None else float(scale), n_group=int(n_group),
                          topk_group=int(topk_group))


def expert_math(spec: MoESpec, config: Any, experts: nn.Module | None = None) -> ExpertMath:
    """The experts' activation (and clamped SwiGLU) from ``spec`` and ``config``; the clamp's
    limit and alpha from the ``experts`` module (``spec.clamp_attrs``) where the config lacks
    them."""
    act = first_config_value(config, spec.activation_config) or "silu"
    if act not in ACTIVATIONS:
        raise MoEError(f"the experts' activation {act!r} ({'/'.join(spec.activation_config)}) "
                       f"is not one the moe kernels run ({', '.join(ACTIVATIONS)}); run without "
                       f"replace_with_kernel_inject, ep_size > 1 and quant")
    if spec.clamp_config is None:
        return ExpertMath(ACTIVATIONS[act])
    clamp, alpha = getattr(config, spec.clamp_config, None), getattr(config, spec.alpha_config,
                                                                       None)
    if (clamp is None or alpha is None) and spec.clamp_attrs and experts is not None:
        clamp, alpha = (getattr(experts, name, None) for name in spec.clamp_attrs)
    if clamp is None or alpha is None:
        where = f" or the experts' {' and '.join(spec.clamp_attrs)}" if spec.clamp_attrs else ""
        raise MoEError(f"the policy's clamped SwiGLU reads config.{spec.clamp_config} and "
                       f"config.{spec.alpha_config}{where}; the model has neither")
    return ExpertMath(ACTIVATIONS[act], float(clamp), float(alpha))


def resolve_moe_kernels(accelerator, dtype: torch.dtype) -> MoEKernels:
    """``moe_route`` and ``moe_grouped_mlp`` for ``dtype`` on ``accelerator`` (the torch reference
    where no backend has them: correct, not capturable)."""
    route = registry.resolve("moe_route", accelerator, dtype)
    mlp = registry.resolve("moe_grouped_mlp", accelerator, dtype)
    return MoEKernels(route.fn, mlp.fn, {"moe_route": route.backend,
                                         "moe_grouped_mlp": mlp.backend},
                      capturable=route.capturable and mlp.capturable,
                      sentinel_hint=_takes_keyword(mlp.fn, "sentinel"))


def _takes_keyword(fn, name: str) -> bool:
    """Whether ``fn`` takes the keyword ``name`` (False for a builtin or an op without a
    Python signature)."""
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def decoder_layers(model: nn.Module, policy) -> nn.ModuleList:
    """The model's decoder layers: the policy's injection spec says where (base model, layers);
    without one, the ``ModuleList`` as long as the config's layer count."""
    config = getattr(model, "config", None)
    spec = policy.injection_spec(config) if policy is not None else None
    if spec is not None and hasattr(spec, "layers") and hasattr(spec, "base_model"):
        try:
            return model.get_submodule(f"{spec.base_model}.{spec.layers}")
        except AttributeError:
            pass
    count = first_config_value(config, ("num_hidden_layers", "n_layer", "num_layers"))
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise MoEError(f"cannot find the decoder layers of {type(model).__name__}: its policy names "
                   f"none and no ModuleList has the config's {count} layers")


def _submodule(owner: nn.Module, name: str) -> nn.Module | None:
    try:
        return owner.get_submodule(name)
    except AttributeError:
        return None


def is_hf_experts(experts: nn.Module) -> bool:
    """Whether ``experts`` holds HF's 3-D expert weights (then the mechanism gives it the kernel
    forward); a module without them (a quantized replacement) is called as it is."""
    weight = getattr(experts, "gate_up_proj", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 3


@dataclass(frozen=True)
class BlockParts:
    """One MoE block's parts, as the spec names them."""

    block: nn.Module
    router: nn.Module
    experts: nn.Module
    shared: nn.Module | None
    shared_gate: nn.Module | None
    correction_bias: torch.Tensor | None

    @classmethod
    def of(cls, layer: nn.Module, spec: MoESpec, index: int) -> "BlockParts":
        """The block of decoder ``layer`` (layer ``index``) and its parts; a named MoEError
        when one is missing."""
        block = _submodule(layer, spec.block)
        if block is None:
            raise MoEError(f"layer {index}: no MoE block {spec.block!r} (the plan lists the layer "
                           f"as MoE); the policy's MoESpec does not match the model")
        parts = {}
        for what in ("router", "experts", "shared", "shared_gate"):
            name = getattr(spec, what)
            parts[what] = _submodule(block, name) if name else None
            if name and parts[what] is None:
                raise MoEError(f"layer {index}: the MoE block {spec.block!r} "
                               f"({type(block).__name__}) has no {what} {name!r}; the policy's "
                               f"MoESpec does not match the model")
        bias = getattr(parts["router"], spec.correction_bias, None) if spec.correction_bias \
            else None
        if spec.correction_bias and not isinstance(bias, torch.Tensor):
            raise MoEError(f"layer {index}: the router has no correction bias "
                           f"{spec.correction_bias!r}")
        return cls(block, parts["router"], parts["experts"], parts["shared"],
                   parts["shared_gate"], bias)


def _check_block(parts: BlockParts, index: int, total: int, local: int, hidden: int | None,
                 spec: MoESpec) -> None:
    """Router and expert weights have the shapes the plan and spec say."""
    weight = getattr(parts.router, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != total:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
        raise MoEError(f"layer {index}: the router's weight must be [{total} experts, hidden], "
                       f"got {shape}")
    if not is_hf_experts(parts.experts):
        return  # a replacement honouring the contract: its own checks
    rows = parts.experts.gate_up_proj.shape[0]
    if rows not in (total, local):
        raise MoEError(f"layer {index}: the experts hold {rows} experts; the plan expects "
                       f"{total} (all) or this rank's {local}")
    if spec.layout == "stacked" and hidden is not None and \
            parts.experts.gate_up_proj.shape[2] != hidden:
        raise MoEError(f"layer {index}: gate_up_proj {tuple(parts.experts.gate_up_proj.shape)} "
                       f"is not [E, 2I, H={hidden}] (the 'stacked' layout)")


def stage_moe_layers(plan) -> tuple[int, ...]:
    """The plan's MoE layers this rank runs: all of them, or under pipeline stages its stage's
    (the other stages' layers are stand-ins by then)."""
    moe = plan.experts.moe_layers
    if plan.stages is None:
        return tuple(moe)
    return tuple(i for i in moe if i in plan.stages.layers)


def check_moe(model: nn.Module, plan, accelerator=None, dtype: torch.dtype | None = None
              ) -> MoESpec:
    """What :func:`install_moe` would refuse, raised without changing ``model`` (the engine calls
    it before the first in-place change). Returns the policy's MoESpec."""
    spec = _moe_spec(plan.policy)
    experts_plan = plan.experts
    config = model.config
    layers = decoder_layers(model, plan.policy)
    start, end = experts_plan.range
    hidden = getattr(config, "hidden_size", None)
    for index in stage_moe_layers(plan):
        if index >= len(layers):
            raise MoEError(f"the plan lists layer {index} as MoE; the model has {len(layers)}")
        parts = BlockParts.of(layers[index], spec, index)
        _check_block(parts, index, experts_plan.total, end - start, hidden, spec)
        expert_math(spec, config, parts.experts)
    return spec


# ----- the GPT-OSS layout hook ------------------------------------------------------------------


def to_stacked_layout(experts: nn.Module, layout: str) -> None:
    """Convert ``experts``' weights once, in place, to the kernels' stacked layout
    (``gate_up_proj [E, 2I, H]`` gate rows then up rows, ``down_proj [E, H, I]``); recorded in
    the active ledger with the undo that converts back. ``"stacked"``: nothing to do.

    ``"gpt_oss"`` (GptOssExperts: ``gate_up_proj [E, H, 2I]`` gate/up interleaved,
    ``gate_up_proj_bias [E, 2I]`` interleaved, ``down_proj [E, I, H]``): the Parameters keep
    their identity (``.data`` replaced), so the model's ``state_dict`` names stay; a flag on the
    module (``_shardwise_stacked``) says it is converted, so a second call does nothing."""
    if layout == "stacked" or getattr(experts, "_shardwise_stacked", False):
        return
    if layout != "gpt_oss":
        raise MoEError(f"no conversion from the expert layout {layout!r}")
    from shardwise.kernels.reference.moe import gpt_oss_layout

    gate_up, gate_up_bias, down = (experts.gate_up_proj, experts.gate_up_proj_bias,
                                   experts.down_proj)
    new_gate_up, new_bias, new_down, _ = gpt_oss_layout(gate_up.data, gate_up_bias.data,
                                                        down.data, experts.down_proj_bias.data)
    gate_up.data, gate_up_bias.data, down.data = new_gate_up, new_bias, new_down
    experts._shardwise_stacked = True
    # save_checkpoint writes the GPT-OSS layout the model is built with, not the kernels'
    setattr(experts, CHECKPOINT_VIEW, lambda: _gpt_oss_layout_back(experts))

    def undo() -> None:  # stacked → GPT-OSS
        back = _gpt_oss_layout_back(experts)
        gate_up.data, gate_up_bias.data = back["gate_up_proj"], back["gate_up_proj_bias"]
        down.data = back["down_proj"]
        vars(experts).pop("_shardwise_stacked", None)
        vars(experts).pop(CHECKPOINT_VIEW, None)
    record(f"expert weights of {type(experts).__name__} converted to the stacked layout", undo)


def _gpt_oss_layout_back(experts: nn.Module) -> dict[str, torch.Tensor]:
    """The GPT-OSS layout of converted ``experts``' weights, as new tensors (transposed back,
    gate/up re-interleaved); the biases of ``down_proj`` never changed."""
    def interleave(t):  # [..., 2I] gate half then up half → [..., 2I] interleaved
        half = t.shape[-1] // 2
        return torch.stack([t[..., :half], t[..., half:]], dim=-1).flatten(-2)
    return {"gate_up_proj": interleave(experts.gate_up_proj.data.transpose(1, 2)).contiguous(),
            "gate_up_proj_bias": interleave(experts.gate_up_proj_bias.data).contiguous(),
            "down_proj": experts.down_proj.data.transpose(1, 2).contiguous()}


# ----- the forwards -------------------------------------------------------------------------------


class ExpertsKernelForward:
    """HF's experts module's instance forward on ``moe_grouped_mlp``: the experts-module
    contract, ``(x [T, H], experts [T, k] local ids, sentinel E_local, weights [T, k]) → [T, H]``.

    The weights are read from the module at each call (whatever the model then holds). A module
    still holding every expert while the plan gives this rank a range (ep > 1, the weights not
    sliced) is read through a view of its range."""

    def __init__(self, experts: nn.Module, kernels: MoEKernels, math: ExpertMath,
                 expert_range: tuple[int, int], total: int) -> None:
        self.experts, self.kernels, self.math = experts, kernels, math
        self.range, self.total = expert_range, total
        self.biases = hasattr(experts, "gate_up_proj_bias")
        #: every expert is here (no id is the sentinel): told to a kernel taking the hint
        self.local_only = tuple(expert_range) == (0, total) and kernels.sentinel_hint

    def _local(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        start, end = self.range
        if tensor is None or tensor.shape[0] != self.total or end - start == self.total:
            return tensor
        return tensor[start:end]

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        e = self.experts
        kw = self.math.kwargs()
        if self.local_only:
            kw["sentinel"] = False
        if self.biases:
            kw["gate_up_bias"] = self._local(e.gate_up_proj_bias)
            kw["down_bias"] = self._local(e.down_proj_bias)
        return self.kernels.grouped_mlp(hidden_states, self._local(e.gate_up_proj),
                                        self._local(e.down_proj), top_k_index, top_k_weights,
                                        **kw)


def to_local(experts: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Global expert ids [T, k] → this rank's local ids: ``id - start`` for ids in
    ``[start, end)``, the sentinel ``end - start`` (E_local) for the others."""
    outside = (experts < start) | (experts >= end)
    return (experts - start).masked_fill(outside, end - start)


class MoEBlockForward:
    """The instance forward of one MoE block (see the module docstring): hidden [..., H] →
    [..., H] (or ``(hidden, router weights)`` where the family's block returns both)."""

    def __init__(self, parts: BlockParts, spec: MoESpec, router: RouterSettings,
                 kernels: MoEKernels, expert_range: tuple[int, int], total: int,
                 ep_group: Any = None, dispatch: str = "all_reduce") -> None:
        self.parts, self.spec, self.router, self.kernels = parts, spec, router, kernels
        self.range, self.total = expert_range, total
        self.ep_group, self.dispatch = ep_group, dispatch
        self.sharded = expert_range != (0, total)
        self.route_kwargs = router.route_kwargs()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] → router logits [T, E] in the router's dtype."""
        router = self.parts.router
        weight, bias = router.weight, getattr(router, "bias", None)
        if self.router.float32:
            x, weight = x.float(), weight.float()
            bias = bias.float() if bias is not None else None
        else:
            weight = weight.to(x.dtype)
            bias = bias.to(x.dtype) if bias is not None else None
        return F.linear(x, weight, bias)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (weights [T, k] float32, global expert ids [T, k] int64)."""
        return self.kernels.route(self.logits(x), self.router.top_k,
                                  bias=self.parts.correction_bias, **self.route_kwargs)

    def routed(self, x: torch.Tensor, weights: torch.Tensor,
               experts: torch.Tensor) -> torch.Tensor:
        """The routed experts' output [T, H]: this rank's experts, summed over the ep group."""
        if self.dispatch == "all_to_all" and self.ep_group is not None:
            from . import dispatch as _dispatch  # helper B1's all-to-all path

            return _dispatch.all_to_all_experts(x, experts, weights, self.parts.experts,
                                                self.range, self.total, self.ep_group)
        local = to_local(experts, *self.range) if self.sharded else experts
        out = self.parts.experts(x, local, weights)
        if self.sharded and self.ep_group is not None:
            out = self.ep_group.all_reduce(out)  # every rank's experts' share → the sum
        return out

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert(s)' output [T, H] (None: the family has none)."""
        parts = self.parts
        if parts.shared is None:
            return None
        out = parts.shared(x)
        if parts.shared_gate is not None:
            out = torch.sigmoid(parts.shared_gate(x)) * out
        return out

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        weights, experts = self.route(x)
        out = self.routed(x, weights, experts)
        shared = self.shared(x)
        if shared is not None:
            out = out + shared
        out = out.reshape(shape)
        return (out, weights) if self.spec.returns_router_scores else out


# ----- install ------------------------------------------------------------------------------------


def install_moe(model: nn.Module, plan, accelerator, dtype: torch.dtype | None = None, *,
                dispatch: str = "all_reduce") -> MoEReport:
    """Give every MoE block of ``plan.experts.moe_layers`` the generic forward (see the module
    docstring), and HF's experts modules the kernel forward; each recorded in the active ledger
    (``engine.close()`` undoes them). Run after sharding and quantization (it calls whatever
    experts module the model then holds); before injection (the injected layer calls the block
    as a module).

    Args:
        plan: the model's :class:`~shardwise.plan.Plan` (its policy's MoESpec, its experts and,
            with ep > 1, the bound ep group).
        accelerator: resolves the moe kernels; ``dtype``: theirs (None: the router weight's).
        dispatch: ``"all_reduce"``, ``"all_to_all"`` or ``"auto"`` (the ``moe=`` setting;
            the engine's ranks hold the same tokens, so auto is all_reduce:
            :func:`shardwise.moe.dispatch.resolve_dispatch`).

    Raises:
        MoEError: no MoESpec, a block or weight not as the spec says, an unsupported activation.
        ConfigError: an unknown ``dispatch``.
    """
    from .dispatch import resolve_dispatch

    dispatch = resolve_dispatch(dispatch)  # before any change
    if plan.experts is None:
        raise MoEError(f"{type(model).__name__} is not a Mixture-of-Experts model (the plan has "
                       f"no experts)")
    spec = check_moe(model, plan, accelerator, dtype)
    experts_plan, config = plan.experts, model.config
    layers = decoder_layers(model, plan.policy)
    router = router_settings(spec, config, experts_plan)
    mine = stage_moe_layers(plan)
    first = next(iter(mine), None)  # None: every layer (of this stage) dense
    math = expert_math(spec, config, None if first is None else
                       BlockParts.of(layers[first], spec, first).experts)
    ep_group = plan.ep.group if plan.ep.enabled else None
    if plan.ep.enabled and ep_group is None:
        raise MoEError(f"ep_size={plan.ep.size}: the plan's expert-parallel group is not bound "
                       f"(Plan.bind with the communicator first)")
    report = None
    for index in mine:
        parts = BlockParts.of(layers[index], spec, index)
        if dtype is None:
            dtype = parts.router.weight.dtype
        if report is None:
            kernels = resolve_moe_kernels(accelerator, dtype)
            report = MoEReport(experts_plan.moe_layers, experts_plan.range, experts_plan.total,
                               plan.ep.size, kernels.backends, kernels.capturable, dispatch)
        if is_hf_experts(parts.experts):
            to_stacked_layout(parts.experts, spec.layout)
            set_forward(parts.experts, ExpertsKernelForward(
                parts.experts, kernels, math, experts_plan.range, experts_plan.total),
                "moe kernel forward")
            report.experts[index] = "kernel"
        else:
            report.experts[index] = type(parts.experts).__name__
        set_forward(parts.block, MoEBlockForward(parts, spec, router, kernels,
                                                 experts_plan.range, experts_plan.total,
                                                 ep_group, dispatch), "MoE block forward")
    if report is None:  # no MoE layer (possible for a config with every layer dense)
        report = MoEReport((), experts_plan.range, experts_plan.total, plan.ep.size, {}, True,
                           dispatch)
    log.info("shardwise: %s", report.summary())
    return report


def expert_ranges(model: nn.Module) -> dict[int, tuple[int, int, int]]:
    """``id(experts module)`` → ``(start, stop, total)``: the experts this rank holds of each MoE
    block :func:`install_moe` gave a forward (what a checkpoint records of a rank's experts);
    blocks without one are not listed (they hold every expert)."""
    out = {}
    for module in model.modules():
        forward = vars(module).get("forward")
        if isinstance(forward, MoEBlockForward):
            out[id(forward.parts.experts)] = (*forward.range, forward.total)
    return out

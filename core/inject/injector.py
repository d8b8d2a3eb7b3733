"""The one generic injector: a family policy's :class:`InjectionSpec` → the model's decoder stack
replaced in place by :class:`~shardwise.inject.layers.InjectedModel`; and decode-step graphs.

``inject_model(model, accelerator, dtype, max_tokens)`` is step 5 of ``init_inference`` and
usable alone; step 7, ``enable_graphs(model, accelerator)``, is in :mod:`.capture`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.kernels.reference.attention import alibi_slopes

from ..accelerator import Accelerator, dtype_name
from ..errors import ConfigError
from ..kernel_registry import REFERENCE, KernelImpl, registry
from ..ledger import replace_module
from ..policy import HeadCounts, first_config_value
from ..sharding.partition import HeadPartition
from .cache import check_kv_fits, free_memory_of, kv_cache_bytes
from .layers import InjectedModel, Kernels, LayerSetup, stage_of
from .mla import latent_cache_width
from .spec import ACTIVATIONS, Attention, InjectionSpec, LatentAttention, Positions

log = logging.getLogger(__name__)

#: the static KV cache's capacity when none is given (DeepSpeed's max_out_tokens default)
DEFAULT_MAX_TOKENS = 1024


class InjectionError(ConfigError):
    """The model cannot be injected (no policy with injection data, unsupported settings)."""


def supported_families() -> dict[str, tuple[str, ...]]:
    """Policy name → model types, for every registered policy with injection data."""
    from ..plugins import policy_plugins

    out = {}
    for name, record in sorted(policy_plugins().records.items()):
        cls = record.obj if record.loaded else None
        if isinstance(cls, type) and getattr(cls, "injection", None) is not None:
            out[name] = tuple(cls.model_types)
    return out


def _policy_and_spec(model: nn.Module, policy=None):
    from ..policy import policy_for

    policy = policy or policy_for(model)
    spec = policy.injection_spec(model.config) if policy is not None else None
    if spec is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        families = "; ".join(f"{n} ({', '.join(t)})" for n, t in supported_families().items())
        why = (f"no policy is registered for model_type {model_type!r}" if policy is None else
               f"policy {policy.name!r} has no injection data")
        raise InjectionError(
            f"replace_with_kernel_inject=True cannot inject {type(model).__name__}: {why}. "
            f"Families with kernel injection: {families or 'none installed'}. Without injection, "
            f"drop replace_with_kernel_inject (tensor_parallel={{'tp_size': N}} alone shards any "
            f"model with the HF layers)")
    from .encoder import EncoderInjectionSpec  # here: encoder.py imports this module

    if not isinstance(spec, (InjectionSpec, EncoderInjectionSpec)):
        raise InjectionError(f"policy {policy.name!r}: injection must be an InjectionSpec or an "
                             f"EncoderInjectionSpec, got {type(spec).__name__}")
    return policy, spec


def resolve_ops(accelerator: Accelerator, dtype: torch.dtype, ops: dict[str, str],
                what: str = "kernel injection") -> tuple[dict[str, Any], dict[str, str]]:
    """Resolve ``ops`` (slot → op name) for ``dtype``: (slot → function, op → backend). Ops that
    only the reference can run although the accelerator's backends implement them for other
    dtypes are logged in ONE line."""
    return _split(_resolve_impls(accelerator, dtype, ops, what), ops)


def _split(impls: dict[str, KernelImpl], ops: dict[str, str]):
    """(slot → function, op → backend) of resolved implementations."""
    return ({slot: impl.fn for slot, impl in impls.items()},
            {ops[slot]: impl.backend for slot, impl in impls.items()})


def _resolve_impls(accelerator: Accelerator, dtype: torch.dtype, ops: dict[str, str],
                   what: str, quiet: bool = False) -> dict[str, KernelImpl]:
    """slot → the resolved implementation (see :func:`resolve_ops`, which logs the same way)."""
    impls = {slot: registry.resolve(op, accelerator, dtype) for slot, op in ops.items()}
    fallen = []
    for slot, op in ops.items():
        if impls[slot].backend != REFERENCE:
            continue
        others = [b for b in registry.implementations(op)
                  if b != REFERENCE and b in accelerator.ordered_kernel_backends()]
        if others:
            fallen.append(f"{op} ({'/'.join(others)})")
    if fallen and not quiet:
        log.warning("shardwise: %s on %s in %s: %s %s no kernel for this dtype in the listed "
                    "backend; using the torch reference (same numbers, slower)", what,
                    accelerator.name, dtype_name(dtype), ", ".join(fallen),
                    "has" if len(fallen) == 1 else "have")
    return impls


def resolve_kernels(accelerator: Accelerator, dtype: torch.dtype, spec: InjectionSpec,
                    act_op: str, quiet: bool = False) -> Kernels:
    """The decoder layer's kernels for ``dtype`` (see :func:`resolve_ops`)."""
    ops = {"norm": "rms_norm" if spec.residual.norm == "rms" else "layer_norm", "rotary": "rotary",
           "act": act_op, "attention_prefill": "attention_prefill",
           "attention_decode": "attention_decode", "kv_cache_write": "kv_cache_write",
           "attention_chunks": "attention_chunks"}
    impls = _resolve_impls(accelerator, dtype, ops, "kernel injection", quiet)
    fns, backends = _split(impls, ops)
    return Kernels(**fns, backends=backends,
                   decode_capturable=impls["attention_decode"].capturable,
                   chunks_capturable=impls["attention_chunks"].capturable)


def _check_config(model: nn.Module, spec: InjectionSpec) -> tuple[str, str]:
    """The (kernel op, GELU approximation) of the model's activation; refuses settings the
    injected layer does not implement."""
    config, mlp = model.config, spec.mlp
    act = first_config_value(config, mlp.activation_config) or mlp.activation
    if act not in ACTIVATIONS or (ACTIVATIONS[act][0] == "silu_and_mul") != (mlp.kind == "gated"):
        raise InjectionError(f"activation {act!r} of {type(model).__name__} is not supported by "
                             f"the injected {mlp.kind} MLP (supported: "
                             f"{', '.join(ACTIVATIONS)}); run without replace_with_kernel_inject")
    for attr, value, what in spec.refuse_config:
        if getattr(config, attr, None) == value:
            raise InjectionError(f"{type(model).__name__} has {attr}={value!r} ({what}), a layer "
                                 f"structure the injected layers do not implement; run without "
                                 f"replace_with_kernel_inject (tensor_parallel alone works)")
    if getattr(config, "add_cross_attention", False):
        raise InjectionError("models with cross-attention are not supported by injection")
    return ACTIVATIONS[act]


def _scale(config: Any, attention: Attention, layer: nn.Module, index: int,
           head_dim: int) -> float:
    """The attention score scale of decoder layer ``index``."""
    if attention.scale is not None:
        return float(attention.scale)
    parent = attention.out_proj.rpartition(".")[0]
    scale = getattr(layer.get_submodule(parent) if parent else layer, "scaling", None)
    if scale is None:
        scale = head_dim ** -0.5
        unscaled = attention.unscaled_config
        if unscaled and getattr(config, unscaled, True) is False:
            scale = 1.0
        inverse = attention.inverse_layer_scale_config
        if inverse and getattr(config, inverse, False):
            scale = scale / float(index + 1)
    return float(scale)


def _windows(config: Any, attention: Attention, n_layers: int,
             max_tokens: int) -> list[int | None]:
    """Each layer's sliding window (None: full causal attention, also for a window the static
    cache is too short to ever apply: positions differ by at most max_tokens - 1)."""
    window = getattr(config, attention.window_config, None) if attention.window_config else None
    if not window or window >= max_tokens:
        return [None] * n_layers
    kinds = (getattr(config, attention.layer_kinds_config, None)
             if attention.layer_kinds_config else None)
    if kinds is None:
        return [int(window)] * n_layers
    return [int(window) if kind in attention.windowed_kinds else None
            for kind in kinds[:n_layers]]


def _local_heads(counts: HeadCounts, heads: HeadPartition | None
                 ) -> tuple[int, int, tuple[int, int]]:
    """(q heads, kv heads, q head range) this rank holds: ``heads``, the plan's head split
    (:attr:`shardwise.plan.Plan.heads`); None: all of them (one rank)."""
    if heads is None:
        return counts.num_heads, counts.num_kv_heads, (0, counts.num_heads)
    return heads.q_heads, heads.kv_heads, heads.q_range


def _own_layers(hf_layers: nn.ModuleList) -> list[nn.Module]:
    """The decoder layers this rank runs: all of them, or under pipeline stages this stage's
    (the others are stand-ins without modules: :func:`~shardwise.inject.layers.stage_of`)."""
    stage = stage_of(hf_layers)
    return list(hf_layers) if stage is None else [hf_layers[i] for i in stage.layers]


def _setups(model: nn.Module, spec: InjectionSpec, hf_layers: nn.ModuleList, counts: HeadCounts,
            heads: HeadPartition | None, act: tuple[str, str], max_tokens: int
            ) -> list[LayerSetup | None]:
    """Each layer's :class:`LayerSetup`: this rank's heads, scale, window, ALiBi slopes, sinks
    (None for another pipeline stage's layer: its stand-in stays)."""
    config, head_dim = model.config, counts.head_dim
    q_heads, kv_heads, (first_head, end_head) = _local_heads(counts, heads)
    positions, residual = spec.positions, spec.residual
    if spec.attention.sinks is not None and positions.kind == "alibi":
        raise InjectionError(f"{type(model).__name__}: its policy names attention sinks and "
                             f"ALiBi positions; the attention kernels take one or the other")
    slopes = (alibi_slopes(counts.num_heads)[first_head:end_head]  # [q_heads]: this rank's
              if positions.kind == "alibi" else None)
    parallel = (bool(getattr(config, residual.parallel_config, False))
                if residual.parallel_config else residual.parallel)
    if not parallel and residual.mlp_norm is None:
        raise InjectionError(f"{type(model).__name__}: the sequential residual form needs the "
                             f"norm before the MLP, which the policy does not name")
    out = []
    # latent attention decodes as multi-query attention over one latent "kv head" of L + R
    own = _own_layers(hf_layers)
    mine = {id(layer) for layer in own}
    cache_heads, cache_dim = ((1, latent_cache_width(own, spec.attention))
                              if isinstance(spec.attention, LatentAttention)
                              else (kv_heads, head_dim))
    windows = _windows(config, spec.attention, len(hf_layers), max_tokens)
    for index, (layer, window) in enumerate(zip(hf_layers, windows)):
        if id(layer) not in mine:
            out.append(None)
            continue
        scale = _scale(config, spec.attention, layer, index, head_dim)
        alibi = None if slopes is None else slopes * (scale if positions.alibi_scaled else 1.0)
        sinks = _sinks(model, spec.attention, layer, index, counts, heads)
        out.append(LayerSetup(q_heads, cache_heads, cache_dim, scale, window, alibi, act[1],
                              parallel, sinks))
    return out


def _sinks(model: nn.Module, attention: Attention, layer: nn.Module, index: int,
           counts: HeadCounts, heads: HeadPartition | None) -> torch.Tensor | None:
    """Layer ``index``'s attention-sink logits for this rank's query heads, [q_heads] float32
    (a copy), or None when the family has none (``Attention.sinks``). The parameter may hold
    every head (sliced here) or already only this rank's."""
    if attention.sinks is None:
        return None
    name = type(model).__name__
    try:
        sinks = layer.get_parameter(attention.sinks)
    except AttributeError as exc:
        raise InjectionError(f"{name} layer {index} has no attention-sink parameter "
                             f"{attention.sinks!r} (Attention.sinks of its policy)") from exc
    q_heads, _, (first, end) = _local_heads(counts, heads)
    if sinks.numel() == counts.num_heads:
        sinks = sinks[first:end]
    elif sinks.numel() != q_heads:
        raise InjectionError(f"{name} layer {index}: {attention.sinks} holds {sinks.numel()} "
                             f"sink logits, not one per head ({counts.num_heads}, or this "
                             f"rank's {q_heads})")
    return sinks.detach().float().reshape(q_heads).clone()


def _rotary_dim(config: Any, positions: Positions, head_dim: int) -> int | None:
    """Dims rotated per head by a table built here (None: no rotary, or the model's module)."""
    if positions.kind != "rotary" or positions.rotary_module:
        return None
    dim = (getattr(config, positions.rotary_dim_config, None)
           if positions.rotary_dim_config else None)
    return int(dim or head_dim)


@dataclass
class InjectionPlan:
    """Everything :func:`inject_model` decides before it changes the model (decoders)."""

    policy: Any
    spec: InjectionSpec
    parent: nn.Module  # the module holding the base model as attribute ``attr``
    attr: str
    base: nn.Module
    kernels: Kernels
    hf_layers: nn.ModuleList
    setups: list[LayerSetup]
    rotary_dim: int | None
    max_tokens: int

    @property
    def kv_heads(self) -> int:
        return self.setups[0].kv_heads if self.setups else 0

    @property
    def head_dim(self) -> int:
        return self.setups[0].head_dim if self.setups else 0

    def kv_bytes(self, dtype: torch.dtype, batch: int = 1) -> int:
        """Bytes of the static KV cache for ``batch`` sequences (this rank's kv heads)."""
        return kv_cache_bytes(len(self.hf_layers), batch, self.kv_heads, self.max_tokens,
                              self.head_dim, dtype, tensors=self.spec.attention.cache_tensors)


def plan_injection(model: nn.Module, accelerator: Accelerator, dtype: torch.dtype,
                   max_tokens: int | None, policy=None, heads: HeadPartition | None = None,
                   quiet: bool = False):
    """Every check :func:`inject_model` makes, and what it would build, without changing
    ``model``: an :class:`InjectionPlan` for a decoder, None for an encoder (whose own checks
    then run at :func:`inject_model`). Raises what :func:`inject_model` raises. ``quiet``:
    the kernel fallback line is left to the injection itself."""
    policy, spec = _policy_and_spec(model, policy)
    from .encoder import EncoderInjectionSpec

    if isinstance(spec, EncoderInjectionSpec):  # encoder-only (BERT): no KV cache
        if max_tokens is not None:
            raise InjectionError(f"max_tokens={max_tokens} (max_out_tokens) sizes the KV cache of "
                                 f"decoders; {type(model).__name__} is an encoder and has none: "
                                 f"drop it")
        return None
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    parent_name, _, attr = spec.base_model.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    base = getattr(parent, attr, None)
    if isinstance(base, InjectedModel):
        raise InjectionError(f"{type(model).__name__} is already injected")
    if not isinstance(base, nn.Module) or parent._modules.get(attr) is not base:
        raise InjectionError(f"policy {policy.name!r}: {type(model).__name__} has no "
                             f"submodule {spec.base_model!r}")
    act = _check_config(model, spec)
    counts = policy.head_counts(model.config)
    if counts is None:
        raise InjectionError(f"policy {policy.name!r} finds no head counts in the config")
    kernels = resolve_kernels(accelerator, dtype, spec, act[0], quiet)
    hf_layers = base.get_submodule(spec.layers)
    return InjectionPlan(policy, spec, parent, attr, base, kernels, hf_layers,
                         _setups(model, spec, hf_layers, counts, heads, act, max_tokens),
                         _rotary_dim(model.config, spec.positions, counts.head_dim), max_tokens)


def check_injection(model: nn.Module, accelerator: Accelerator, dtype: torch.dtype,
                    max_tokens: int | None, device: torch.device, policy=None,
                    heads: HeadPartition | None = None) -> None:
    """What :func:`inject_model` would refuse, raised without changing ``model``; and the static
    KV cache of one sequence checked against ``device``'s free memory (as the accelerator
    reports it), so an impossible ``max_tokens`` fails at init, not inside the allocator.

    Raises:
        InjectionError: as :func:`inject_model`.
        KVCacheMemoryError: the cache for one sequence needs more than the free memory (the
            message names the bytes, the free memory and the ``max_tokens`` that would fit).
    """
    plan = plan_injection(model, accelerator, dtype, max_tokens, policy, heads, quiet=True)
    if plan is None:
        return
    free = free_memory_of(accelerator.free_memory, device)
    if free is not None:
        check_kv_fits(plan.kv_bytes(dtype), free, batch=1, max_tokens=plan.max_tokens,
                      where=f"{accelerator.name} device {device}")


def inject_model(model: nn.Module, accelerator: Accelerator, dtype: torch.dtype,
                 max_tokens: int | None, policy=None, heads: HeadPartition | None = None,
                 fuse_projections: bool | None = None) -> nn.Module:
    """Replace ``model``'s decoder stack in place with shardwise's inference layers (run after
    sharding and quantization: the layers adopt whatever projection modules the model holds —
    ``nn.Linear``, transformers ``Conv1D``, quantized linears, sharded ones with their hooks —
    and call them as modules). Returns the new stack: an :class:`InjectedModel`, or for an
    encoder-only family an ``InjectedEncoder``. The model changes in one step, at the end — a
    failure before leaves it as it was — recorded in the active ledger
    (:func:`shardwise.ledger.replace_module`), so ``engine.close()`` puts the HF stack back.

    Args:
        max_tokens: the static KV cache's capacity (decoders; None: :data:`DEFAULT_MAX_TOKENS`).
            An encoder has no cache: a value for it is an error rather than ignored.
        policy: the model's policy (``init_inference`` passes its plan's; None: looked up).
        heads: this rank's head partition the model was sharded with (its heads, ALiBi
            slopes): ``init_inference`` passes its plan's; None: one rank, every head.
        fuse_projections: run separate q, k, v as one projection and separate gate, up as
            one, over one copy of the weights (the parts' tensors become views of the fused
            ones: :mod:`shardwise.inject.fuse`); None: the ``SHARDWISE_FUSE_PROJECTIONS``
            environment variable, default on. Groups that cannot be fused (a quantized layout
            without row dimension, hooks, meta tensors …) keep their projections.

    Raises:
        InjectionError: no policy with injection data (the message lists the families that have
            one), or a model setting the injected layers do not implement.
    """
    from .fuse import fuse_by_default

    fuse = fuse_by_default() if fuse_projections is None else bool(fuse_projections)
    plan = plan_injection(model, accelerator, dtype, max_tokens, policy, heads)
    if plan is None:
        from .encoder import inject_encoder

        policy, spec = _policy_and_spec(model, policy)
        return inject_encoder(model, policy, spec, accelerator, dtype)
    injected = InjectedModel(plan.base, plan.spec, plan.kernels, plan.max_tokens, plan.setups,
                             plan.rotary_dim, moe=getattr(plan.policy, "moe", None))
    injected.free_memory = accelerator.free_memory  # checked before each cache allocation
    replace_module(plan.parent, plan.attr, injected, "injected decoder stack")
    fused = injected.fuse_projections() if fuse else {}
    log.info("shardwise: injected %d %s layers (kernels: %s), static KV cache of %d tokens%s",
             len(plan.hf_layers), plan.policy.name,
             ", ".join(f"{op}={b}" for op, b in plan.kernels.backends.items()), plan.max_tokens,
             "".join(f"; {what} fused in {n} layers" for what, n in fused.items() if n))
    return injected


def injected_stack(model: nn.Module) -> InjectedModel | None:
    """The :class:`InjectedModel` inside ``model`` (None when it is not injected)."""
    for module in model.modules():
        if isinstance(module, InjectedModel):
            return module
    return None

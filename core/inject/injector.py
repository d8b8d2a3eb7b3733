"""The one generic injector: a family policy's :class:`InjectionSpec` → the model's decoder stack
replaced in place by :class:`~shardwise.inject.layers.InjectedModel`; and decode-step graphs.

``inject_model(model, accelerator, dtype, max_tokens)`` is step 5 of ``init_inference`` and
usable alone; ``enable_graphs(model, accelerator)`` is step 7.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..accelerator import Accelerator, GraphStrategy, dtype_name
from ..errors import ConfigError
from ..kernel_registry import REFERENCE, registry
from .cache import StaticKVCache
from .layers import InjectedModel, Kernels
from .spec import ACTIVATIONS, InjectionSpec

log = logging.getLogger(__name__)


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
    spec = getattr(policy, "injection", None)
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
    if not isinstance(spec, InjectionSpec):
        raise InjectionError(f"policy {policy.name!r}: injection must be an InjectionSpec, got "
                             f"{type(spec).__name__}")
    return policy, spec


def _config_value(config: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def resolve_kernels(accelerator: Accelerator, dtype: torch.dtype, spec: InjectionSpec,
                    act_op: str) -> Kernels:
    """Resolve every op the layer calls for ``dtype``; ops that only the reference can run
    although the accelerator's backends implement them for other dtypes are logged in ONE line."""
    ops = {"norm": "rms_norm" if spec.norm == "rms" else "layer_norm", "rotary": "rotary",
           "act": act_op, "attention_prefill": "attention_prefill",
           "attention_decode": "attention_decode", "kv_cache_write": "kv_cache_write"}
    impls = {slot: registry.resolve(op, accelerator, dtype) for slot, op in ops.items()}
    fallen = []
    for slot, op in ops.items():
        if impls[slot].backend != REFERENCE:
            continue
        others = [b for b in registry.implementations(op)
                  if b != REFERENCE and b in accelerator.ordered_kernel_backends()]
        if others:
            fallen.append(f"{op} ({'/'.join(others)})")
    if fallen:
        log.warning("shardwise: kernel injection on %s in %s: %s %s no kernel for this dtype "
                    "in the listed backend; using the torch reference (same numbers, slower)",
                    accelerator.name, dtype_name(dtype), ", ".join(fallen),
                    "has" if len(fallen) == 1 else "have")
    return Kernels(**{slot: impl.fn for slot, impl in impls.items()},
                   backends={ops[slot]: impl.backend for slot, impl in impls.items()})


def _check_config(model: nn.Module, spec: InjectionSpec, max_tokens: int) -> tuple[str, str]:
    config = model.config
    act = _config_value(config, spec.activation_config)
    if act not in ACTIVATIONS or (ACTIVATIONS[act][0] == "silu_and_mul") != (spec.mlp == "gated"):
        raise InjectionError(f"activation {act!r} of {type(model).__name__} is not supported by "
                             f"the injected {spec.mlp} MLP (supported: "
                             f"{', '.join(ACTIVATIONS)}); run without replace_with_kernel_inject")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < max_tokens:
        raise InjectionError(f"{config.model_type} uses sliding-window attention of {window} "
                             f"tokens, which the injected layers do not implement; set "
                             f"max_tokens <= {window} so the window never applies, or run "
                             f"without replace_with_kernel_inject")
    if getattr(config, "add_cross_attention", False):
        raise InjectionError("models with cross-attention are not supported by injection")
    return ACTIVATIONS[act]


def _scales(model: nn.Module, spec: InjectionSpec, hf_layers: nn.ModuleList,
            head_dim: int) -> list[float]:
    config = model.config
    out = []
    for i, layer in enumerate(hf_layers):
        attn = layer.get_submodule(spec.out_proj.rpartition(".")[0]) if "." in spec.out_proj \
            else layer
        scale = getattr(attn, "scaling", None)
        if scale is None:
            scale = head_dim ** -0.5
            if spec.unscaled_config and getattr(config, spec.unscaled_config, True) is False:
                scale = 1.0
            if spec.inverse_layer_scale_config and getattr(config,
                                                           spec.inverse_layer_scale_config, False):
                scale = scale / float(i + 1)
        out.append(float(scale))
    return out


def inject_model(model: nn.Module, accelerator: Accelerator, dtype: torch.dtype,
                 max_tokens: int, policy=None) -> InjectedModel:
    """Replace ``model``'s decoder stack in place with shardwise's inference layers (run after
    sharding: the layers use the sharded weights and their hooks). Returns the new stack.

    Raises:
        InjectionError: no policy with injection data (the message lists the families that have
            one), or a model setting the injected layers do not implement.
    """
    policy, spec = _policy_and_spec(model, policy)
    parent_name, _, attr = spec.base_model.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    base = getattr(parent, attr, None)
    if isinstance(base, InjectedModel):
        raise InjectionError(f"{type(model).__name__} is already injected")
    if base is None:
        raise InjectionError(f"policy {policy.name!r}: {type(model).__name__} has no "
                             f"{spec.base_model!r}")
    act = _check_config(model, spec, max_tokens)
    counts = policy.head_counts(model.config)
    if counts is None:
        raise InjectionError(f"policy {policy.name!r} finds no head counts in the config")
    kernels = resolve_kernels(accelerator, dtype, spec, act[0])
    hf_layers = base.get_submodule(spec.layers)
    q_share = counts.num_heads / (counts.num_heads + 2 * counts.num_kv_heads)
    injected = InjectedModel(base, spec, kernels, max_tokens, counts.head_dim, q_share,
                             _scales(model, spec, hf_layers, counts.head_dim), act)
    setattr(parent, attr, injected)
    log.info("shardwise: injected %d %s layers (kernels: %s), static KV cache of %d tokens",
             len(hf_layers), policy.name,
             ", ".join(f"{op}={b}" for op, b in kernels.backends.items()), max_tokens)
    return injected


def injected_stack(model: nn.Module) -> InjectedModel | None:
    """The :class:`InjectedModel` inside ``model`` (None when it is not injected)."""
    for module in model.modules():
        if isinstance(module, InjectedModel):
            return module
    return None


# ----- graphs -------------------------------------------------------------------------------------

class DecodeGraphs:
    """The decode step captured by the accelerator's graph strategy, one graph per batch size
    (the batch-size buckets: a static cache is allocated per batch size, and its graph is reused
    by every later ``generate`` with that batch size). Inputs of the captured step: input_ids
    and position_ids [batch, 1], the write index [1], lengths and starts [batch]."""

    def __init__(self, strategy: GraphStrategy) -> None:
        self.strategy = strategy
        self.graphs: dict[int, Any] = {}

    def clear(self) -> None:
        self.graphs.clear()

    def run(self, stack: InjectedModel, cache: StaticKVCache, input_ids: torch.Tensor,
            position_ids: torch.Tensor, past: int) -> torch.Tensor:
        b = input_ids.shape[0]
        device = input_ids.device
        args = (input_ids.reshape(b, 1).to(torch.int64), position_ids.reshape(b, 1).to(torch.int64),
                torch.full((1,), past, dtype=torch.int64, device=device),
                torch.full((b,), past + 1, dtype=torch.int64, device=device),
                cache.starts.to(torch.int64) if cache.starts is not None
                else torch.zeros(b, dtype=torch.int64, device=device))
        graph = self.graphs.get(b)
        if graph is None:
            def step(ids, pos, write_index, lengths, starts, _cache=cache):
                return stack.decode_step(_cache, ids, pos, write_index, lengths, starts)
            graph = self.graphs[b] = self.strategy.capture(step, *args)
        return graph(*args).clone()  # static outputs are overwritten by the next replay


def enable_graphs(model: nn.Module, accelerator: Accelerator) -> GraphStrategy:
    """Step 7: capture the injected decode step with the accelerator's graph strategy.

    A strategy that does not accelerate (the base eager strategy, which the CPU uses) is a
    documented no-op: the decode step runs eagerly and one line says so. An accelerating one is
    tried at once on a one-sequence step, so a strategy that cannot capture fails here, at init,
    with its reason — not in the middle of a generate.
    """
    stack = injected_stack(model)
    if stack is None:
        raise ConfigError("enable_graph captures the injected decode step: it needs "
                          "replace_with_kernel_inject=True")
    strategy = accelerator.graph_strategy()
    if not isinstance(strategy, GraphStrategy):
        raise ConfigError(f"accelerator {accelerator.name!r} returned {strategy!r} as its graph "
                          f"strategy, not a shardwise GraphStrategy")
    if not strategy.accelerates:
        log.info("shardwise: enable_graph on %s: its graph strategy %r runs the decode step "
                 "eagerly (a documented no-op: nothing to capture on this device)",
                 accelerator.name, strategy.name)
        return strategy
    graphs = DecodeGraphs(strategy)
    weight = stack.m.final_norm.weight
    try:
        with torch.inference_mode():
            cache = stack.new_cache(1, weight.dtype, weight.device)
            cache.length = 1
            ids = torch.zeros(1, 1, dtype=torch.int64, device=weight.device)
            graphs.run(stack, cache, ids, ids, 0)
    except Exception as exc:
        raise ConfigError(
            f"enable_graph: the {accelerator.name!r} graph strategy {strategy.name!r} cannot "
            f"capture the decode step ({type(exc).__name__}: {exc}); run with "
            f"enable_graph=False") from exc
    finally:
        stack._cache_generation += 1  # retire the trial cache
    stack.graphs = graphs
    log.info("shardwise: decode step captured with %s (one graph per batch size)", strategy.name)
    return strategy

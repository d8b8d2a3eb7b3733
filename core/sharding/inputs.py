"""Forward arguments that carry one slice per attention head of the *whole* model, narrowed to
the rank's heads on their way into a module.

Some families build a per-head tensor once, above the attention modules, for all
``config.num_attention_heads`` heads: BLOOM's ALiBi bias (``BloomModel.forward`` builds
``alibi`` [batch * heads, 1, seq] and passes it to every ``BloomAttention``), Falcon's ALiBi
bias and the attention mask it is folded into ([batch, heads, q, k]). Under tensor parallelism
an attention module holds only its rank's heads, so it must see only those heads' entries (the
ALiBi slopes of *its* heads, from the global head offset in the
:class:`~shardwise.sharding.partition.HeadPartition`).

A policy lists such arguments as data (:attr:`Policy.head_sliced_inputs
<shardwise.policy.Policy.head_sliced_inputs>`: module pattern → :class:`HeadSlicedInput` s,
defined in the leaf :mod:`shardwise.layout` and re-exported here); the
applier gives each matching module *instance* a forward pre-hook (:class:`HeadSlicer`) that
narrows those arguments. Nothing above the module (the model's forward, the shared alibi
builder) and no class is changed.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch import nn

from ..layout import HeadPartition, HeadSlicedInput, ShardingError
from ..ledger import add_hook
from .plan import pattern_matches

if TYPE_CHECKING:
    from ..policy import Policy


class HeadSlicer:
    """The forward pre-hook (``with_kwargs=True``) of one module: narrows its
    :class:`HeadSlicedInput` arguments to ``heads``. ``positions[i]`` is the position of
    ``inputs[i].arg`` among the forward's positional parameters (None: keyword only)."""

    def __init__(self, inputs: tuple[HeadSlicedInput, ...], positions: tuple[int | None, ...],
                 heads: HeadPartition) -> None:
        self.inputs, self.positions, self.heads = inputs, positions, heads

    def __call__(self, _module, args, kwargs):
        for spec, pos in zip(self.inputs, self.positions):
            if spec.arg in kwargs:
                kwargs[spec.arg] = spec.take(kwargs[spec.arg], self.heads)
            elif pos is not None and pos < len(args):
                args = (*args[:pos], spec.take(args[pos], self.heads), *args[pos + 1:])
        return args, kwargs


def head_sliced_modules(model: nn.Module, policy: "Policy", sharded: list[str], prefix: str
                        ) -> dict[str, tuple[nn.Module, tuple[HeadSlicedInput, ...],
                                             tuple[int | None, ...]]]:
    """Modules matching the policy's ``head_sliced_inputs`` patterns that contain a sharded
    module (their heads are split): name → (module, inputs, positional index of each). Raises
    :class:`ShardingError` when a module's forward has no such argument."""
    table: Mapping[str, tuple[HeadSlicedInput, ...]] = getattr(policy, "head_sliced_inputs", {})
    out = {}
    for name, module in model.named_modules():
        inputs = next((v for p, v in table.items() if name and pattern_matches(p, name, prefix)),
                      None)
        if not inputs or not any(s.startswith(name + ".") for s in sharded):
            continue
        params = inspect.signature(module.forward).parameters
        names = [n for n, p in params.items()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        missing = [i.arg for i in inputs if i.arg not in params and not takes_kwargs]
        if missing:
            raise ShardingError(f"policy {policy.name!r} slices argument(s) {', '.join(missing)} "
                                f"of {name!r} ({type(module).__name__}) by heads, but its forward "
                                f"has no such argument; fix the policy's head_sliced_inputs")
        positions = tuple(names.index(i.arg) if i.arg in names else None for i in inputs)
        out[name] = (module, tuple(inputs), positions)
    return out


def install_head_slicers(modules: Mapping[str, tuple], heads: HeadPartition | None) -> list:
    """Register a :class:`HeadSlicer` on each module of :func:`head_sliced_modules` for the
    rank's ``heads`` (each recorded in the active ledger); returns the hook handles."""
    if modules and heads is None:
        raise ShardingError("head-sliced arguments need the model's head counts")
    return [add_hook(module.register_forward_pre_hook(HeadSlicer(inputs, positions, heads),
                                                      with_kwargs=True),
                     f"head slicer of {name}")
            for name, (module, inputs, positions) in modules.items()]

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
<shardwise.policy.Policy.head_sliced_inputs>`: module pattern → :class:`HeadSlicedInput` s); the
applier gives each matching module *instance* a forward pre-hook (:class:`HeadSlicer`) that
narrows those arguments. Nothing above the module (the model's forward, the shared alibi
builder) and no class is changed.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import ShardingError
from .partition import HeadPartition
from .plan import pattern_matches

if TYPE_CHECKING:
    from ..policy import Policy


@dataclass(frozen=True)
class HeadSlicedInput:
    """One forward argument of a module that holds an entry per head of the whole model.

    Attributes:
        arg: the argument's name in the module's ``forward`` (found as a keyword, or at its
            position when passed positionally).
        dim: the dimension that holds the heads.
        folded: the dimension is batch and heads folded, heads inner (``b * heads + h``), as in
            BLOOM's ``alibi`` [batch * heads, 1, seq]; otherwise it holds the heads alone
            (Falcon's [batch, heads, 1, seq]).
        unit: ``"heads"`` (q heads) or ``"kv_heads"``.

    A ``None`` argument, or an unfolded head dimension of size 1 (a mask broadcast over the
    heads), passes through unchanged.
    """

    arg: str
    dim: int = 1
    folded: bool = False
    unit: str = "heads"

    def head_range(self, heads: HeadPartition) -> tuple[int, int, int]:
        """(total heads, first, stop) of the rank's heads in this argument."""
        if self.unit == "heads":
            return heads.num_heads, *heads.q_range
        if self.unit == "kv_heads":
            return heads.num_kv_heads, *heads.kv_range
        raise ShardingError(f"head-sliced argument {self.arg!r}: unknown unit {self.unit!r}; "
                            f"use heads or kv_heads")

    def take(self, value: Any, heads: HeadPartition) -> Any:
        """``value`` narrowed to the rank's heads (a contiguous copy; views of the shared tensor
        are not enough for forwards that ``view`` it)."""
        if not isinstance(value, torch.Tensor):
            return value
        total, h0, h1 = self.head_range(heads)
        dim = self.dim % value.dim()
        size = value.shape[dim]
        if not self.folded and size == 1:
            return value  # broadcast over the heads
        if self.folded and size % total == 0:
            grouped = value.unflatten(dim, (size // total, total))  # [.., batch, heads, ..]
            return grouped.narrow(dim + 1, h0, h1 - h0).flatten(dim, dim + 1).contiguous()
        if not self.folded and size == total:
            return value.narrow(dim, h0, h1 - h0).contiguous()
        layout = f"batch × {total} heads" if self.folded else f"{total} heads (or 1)"
        raise ShardingError(f"argument {self.arg!r} has shape {tuple(value.shape)}; dimension "
                            f"{self.dim} should hold {layout} (the policy's head_sliced_inputs "
                            f"does not fit this model)")


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
    rank's ``heads``; returns the hook handles."""
    if modules and heads is None:
        raise ShardingError("head-sliced arguments need the model's head counts")
    return [module.register_forward_pre_hook(HeadSlicer(inputs, positions, heads),
                                             with_kwargs=True)
            for module, inputs, positions in modules.values()]

"""Checkpoint keys → model tensors through transformers' own conversion mapping.

transformers (5.x) loads a checkpoint through a list of weight transforms per model class
(``transformers.conversion_mapping.get_model_conversion_mapping``): *renamings* (Mixtral's
``block_sparse_moe.`` → ``mlp.``) and *converters*, each building one model tensor from several
checkpoint tensors — the older one-tensor-per-expert layouts: Mixtral's
``experts.N.w1/w3.weight`` [I, H] stacked per expert and concatenated into
``experts.gate_up_proj`` [E, 2I, H], Qwen-MoE's ``experts.N.gate_proj/up_proj.weight`` likewise,
``experts.N.w2`` / ``down_proj`` into ``experts.down_proj`` [E, H, I]. shardwise asks transformers
for that list and renames keys with transformers' ``rename_source_key``, in the order
``from_pretrained`` does, so no family's names are written here.

A model tensor a converter builds is a :class:`Composite`: its checkpoint keys per source
pattern (in transformers' order, ``dot_natural_key``), assembled by the converter's own
operations. When the first operation stacks the per-module lists (``MergeModulelist``) along a
dim no later operation touches, a rank that keeps a range of that dim (its experts) hands only
those list entries to the operations: it reads only its own experts' tensors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from .errors import CheckpointError

Range = tuple[int, int]


@dataclass
class Composite:
    """A model tensor a transformers converter builds from several checkpoint tensors.

    Attributes:
        name: the model tensor's name (as transformers renames the keys).
        converter: the transformers ``WeightConverter`` that builds it (this tensor's own copy).
        sources: source pattern → its checkpoint keys, in transformers' order (for a
            per-expert pattern: expert 0, 1, …).
    """

    name: str
    converter: Any
    sources: dict[str, list[str]] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return [k for keys in self.sources.values() for k in keys]

    @property
    def stack_dim(self) -> int | None:
        """The dim the per-module lists are stacked along when a range of it can be built from
        the matching list entries alone (``MergeModulelist`` first, then only concatenations
        along other dims); None otherwise (the tensor is built whole, then narrowed). Negative
        dims are not resolved here (the rank is not known): such a converter counts as None."""
        from transformers.core_model_loading import Concatenate, MergeModulelist

        ops = list(self.converter.operations)
        if not ops or type(ops[0]) is not MergeModulelist or ops[0].dim < 0:
            return None
        dim = ops[0].dim
        if all(type(op) is Concatenate and 0 <= op.dim != dim for op in ops[1:]):
            return dim
        return None

    def count(self) -> int:
        """How many entries each source pattern's list holds (the checkpoint's expert count for
        a per-expert layout); the lists' lengths must agree (:func:`check_lists`)."""
        return len(next(iter(self.sources.values())))

    def build(self, load: Callable[[str], torch.Tensor], select: list[int] | None = None,
              shapes: dict[str, tuple[int, ...]] | None = None,
              into: "tuple[Callable[[str, torch.Tensor], None], torch.dtype] | None" = None
              ) -> torch.Tensor:
        """The tensor, built from ``load(key)`` of each key (of list entries ``select`` only,
        when given: a range of :attr:`stack_dim`) as the converter's operations build it.

        With the keys' ``shapes`` (their headers), a plain stack (``MergeModulelist``, then at
        most one ``Concatenate`` of the patterns along another dim) is built in place: the
        result is allocated once (its shape from the converter's own operations, run on the
        meta device) and each tensor goes into its slot as it is read — by ``into``'s
        ``fill(key, slot)`` (the result in ``into``'s dtype), else copied from ``load(key)`` —
        so no stacked or concatenated intermediate copy is ever held. Otherwise the converter
        runs as it is."""
        chosen = {p: keys if select is None else [keys[i] for i in select]
                  for p, keys in self.sources.items()}
        if shapes is not None and self._placement() is not None:
            return self._place(load, chosen, shapes, into)
        return self._convert(load, chosen)

    def _placement(self) -> tuple[int, int | None] | None:
        """(stack dim, concatenation dim or None) of a plain stack, else None."""
        ops = list(self.converter.operations)
        if self.stack_dim is None or len(ops) > 2:
            return None
        return self.stack_dim, ops[1].dim if len(ops) == 2 else None

    def _place(self, load: Callable[[str], torch.Tensor], chosen: dict[str, list[str]],
               shapes: dict[str, tuple[int, ...]], into=None) -> torch.Tensor:
        def empty(key: str) -> torch.Tensor:
            return torch.empty(shapes[key], device="meta")
        shape = self._convert(empty, chosen).shape  # what the converter builds: its own ops
        stack, cat = self._placement()
        out = None if into is None else torch.empty(shape, dtype=into[1])
        offset = 0
        for keys in chosen.values():  # the converter's pattern order, which Concatenate keeps
            width = 0
            for i, key in enumerate(keys):  # each one list entry, e.g. one expert's [I, H]
                piece = None if into is not None else load(key)
                if out is None:
                    out = torch.empty(shape, dtype=piece.dtype)
                dest = out
                if cat is not None:
                    width = shapes[key][cat if cat < stack else cat - 1]
                    dest = out.narrow(cat, offset, width)
                if into is not None:
                    into[0](key, dest.select(stack, i))
                else:
                    dest.select(stack, i).copy_(piece)
                del piece
            offset += width
        return out

    def _convert(self, load: Callable[[str], torch.Tensor],
                 chosen: dict[str, list[str]]) -> torch.Tensor:
        """The converter's own operations over the ``chosen`` keys (``load``-ed on demand)."""
        conv = copy.deepcopy(self.converter)
        for pattern, keys in chosen.items():
            for key in keys:
                conv.add_tensor(self.name, key, pattern, partial(load, key))
        built = conv.convert(self.name)
        if self.name not in built:
            raise CheckpointError(f"transformers' {type(conv).__name__} for {self.name!r} built "
                                  f"{', '.join(built)} instead; shardwise loads converters that "
                                  f"build one model tensor only")
        return built[self.name]

    def meta_shape(self, shapes: dict[str, tuple[int, ...]],
                   dtypes: dict[str, torch.dtype]) -> tuple[int, ...]:
        """The shape the converter builds, from the keys' header shapes (on the meta device:
        nothing read)."""
        def empty(key: str) -> torch.Tensor:
            return torch.empty(shapes[key], dtype=dtypes[key], device="meta")
        try:
            return tuple(self.build(empty).shape)
        except CheckpointError:
            raise
        except Exception as exc:  # the operations refuse the shapes (torch.cat / stack)
            raise CheckpointError(
                f"the checkpoint tensors {_some(self.keys)} do not build {self.name!r} the way "
                f"transformers converts them ({_ops(self.converter)}): {exc}") from None


def select(ranges: list[Range]) -> list[int]:
    """List entries ``ranges`` covers, in order (ranges concatenated, as the reader does)."""
    return [i for a, b in ranges for i in range(a, b)]


# ----- the mapping ---------------------------------------------------------------------------

@dataclass
class KeyMap:
    """Where each model tensor comes from: ``direct`` (model name → checkpoint key, one tensor
    renamed at most) and ``composite`` (model name → :class:`Composite`)."""

    direct: dict[str, str]
    composite: dict[str, Composite]


def key_map(model: nn.Module, keys: list[str]) -> KeyMap:
    """The model tensor each checkpoint key of ``keys`` loads into, as ``from_pretrained``
    renames it: every transformers renaming, then at most one converter; a key transformers
    would rename away from a name the model has keeps its name; keys that reach no model
    tensor are left out (the caller's older rules and its unexpected-keys check see them)."""
    renamings, converters = _transforms(model)
    if not renamings and not converters:
        return KeyMap({}, {})
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    wanted = dict(model.state_dict(keep_vars=True))  # names only: nothing is copied or read
    prefix = getattr(model, "base_model_prefix", None) or None
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    direct: dict[str, str] = {}
    composite: dict[str, Composite] = {}
    for key in sorted(keys, key=dot_natural_key):  # transformers' order: expert 0, 1, …, 10
        name, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
        if name not in wanted and key in wanted:  # renamed away from a name the model has
            name, pattern = key, None
        if name not in wanted:
            continue
        if pattern is None:
            direct.setdefault(name, key)
        else:
            entry = composite.setdefault(name, Composite(name, copy.deepcopy(by_pattern[pattern])))
            entry.sources.setdefault(pattern, []).append(key)
    for entry in composite.values():  # every source pattern present, in the converter's order
        entry.sources = {p: entry.sources.get(p, []) for p in entry.converter.source_patterns}
    return KeyMap(direct, composite)


def _transforms(model: nn.Module) -> tuple[list, list]:
    """(renamings, converters) transformers applies when loading ``model`` (none for a module
    that is not a transformers model, or a transformers without the conversion mapping)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers before 5: its models keep _checkpoint_conversion_mapping
        return [], []
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return [], []
    transforms = get_model_conversion_mapping(model)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


# ----- checks (headers only) ----------------------------------------------------------------

def check_lists(entry: Composite, model_shape: tuple[int, ...], experts: int | None) -> None:
    """The per-module lists of ``entry`` are complete: every source pattern has the same
    number of keys, numbered 0 … n-1, and n is the model's size along the stacked dim (the
    config's expert count: :class:`ExpertCountError` names both)."""
    from .errors import ExpertCountError

    counts = {p: len(keys) for p, keys in entry.sources.items()}
    if len(set(counts.values())) > 1:
        raise CheckpointError(
            f"the checkpoint tensors that build {entry.name!r} are incomplete: "
            + ", ".join(f"{n} key(s) match {p!r}" for p, n in counts.items())
            + f" ({_some(entry.keys)}); every pattern needs one tensor per expert")
    for pattern, keys in entry.sources.items():
        _check_numbering(entry.name, pattern, keys)
    dim = entry.stack_dim
    n = entry.count()
    if dim is not None and dim < len(model_shape) and n != model_shape[dim]:
        raise ExpertCountError(expert_count_message(
            entry.name, n, model_shape[dim], experts,
            f"{n} tensors per pattern {', '.join(map(repr, entry.sources))} "
            f"(e.g. {entry.keys[0]!r})"))


def _check_numbering(name: str, pattern: str, keys: list[str]) -> None:
    """The one dotted number that varies across ``keys`` (the expert index) runs 0 … n-1."""
    numbers = [[int(p) for p in k.split(".") if p.isdigit()] for k in keys]
    if len(keys) < 2 or len({len(n) for n in numbers}) != 1:
        return
    varying = [i for i in range(len(numbers[0])) if len({n[i] for n in numbers}) > 1]
    if len(varying) != 1:
        return
    found = [n[varying[0]] for n in numbers]
    if found != list(range(len(keys))):
        raise CheckpointError(
            f"the checkpoint tensors matching {pattern!r} that build {name!r} are numbered "
            f"{_some(found)}, not 0 … {len(keys) - 1}: an expert is missing or numbered twice; "
            f"the checkpoint is incomplete")


def expert_count_message(name: str, found: int, model: int, experts: int | None,
                         what: str) -> str:
    """The :class:`ExpertCountError` message: both counts, where each comes from, what to do."""
    config = f" (its config's expert count is {experts})" if experts is not None else ""
    return (f"the checkpoint holds {found} experts for {name!r} ({what}) but the model built "
            f"from the config has {model}{config}: the checkpoint and the config do not belong "
            f"together; use the config.json saved with the checkpoint (or a model built from "
            f"it), whose expert count is {found}")


def _ops(converter: Any) -> str:
    return " → ".join(type(op).__name__ for op in converter.operations)


def _some(values: list, limit: int = 4) -> str:
    shown = ", ".join(map(repr, values[:limit]))
    return shown + (f", … ({len(values)} in all)" if len(values) > limit else "")


"""Fused input projections: one product for q|k|v and one for gate|up, over one copy of the weights.

Families whose checkpoints keep q, k and v (Llama, Qwen2, Mistral, OPT, GPT-Neo, GPT-J …) and
gate and up (the gated MLPs) as separate linears cost five products per layer where two would
do: at batch-1 decode each is a small GEMV whose fixed cost (a kernel launch on a GPU, the
dispatch and the native quantized kernel's call on a CPU) is a large share of its time. At
injection (:func:`fuse_layer`) each such group of an :class:`~shardwise.inject.layers.
InjectedLayer` becomes ONE projection (:class:`FusedProjection`) whose output is the parts'
outputs side by side — ``[q | k | v]`` split by the layer's widths, ``[gate | up]`` the
activation kernel's fused input — for float linears (fp32/bf16/fp16 ``nn.Linear``) and for the
quantized ones (:class:`~shardwise.quant.QuantLinear`, in the layouts whose tensors stack their
output rows along one dimension: :func:`shardwise.quant.modules.quant_row_dims`).

**One copy of the weights.** The fused tensors (the concatenation of the parts' tensors along
their output-row dimension; per-row scales, zeros and biases likewise) *are* the storage: each
part's parameters and buffers are re-pointed at views of them (``param.data = view``, the same
Parameter objects), so ``state_dict``, ``save_pretrained``, ``engine.save_checkpoint`` and the
quantized checkpoints see the names, shapes and values they saw before (safetensors writes
disjoint views of one storage as separate tensors). The concatenation allocates one group's
tensors at a time; the parts' old storage is freed as they are re-pointed (inside
``init_inference`` the ledger's snapshot keeps the originals until the end of init, as for every
transform). The fused module is held by the layer only (unregistered), so nothing new appears in
``state_dict``; an injected model is therefore not moved with ``.to()`` after init (no injected
model is: its static cache lives on the device).

**Undo.** Each fusion is recorded in the active ledger (:mod:`shardwise.ledger`): the undo gives
each part's tensors their own storage again (a copy of the view, bit for bit), so
``engine.close()`` hands back parameters that share nothing. :meth:`FusedProjection.release`
does the same outside the ledger (the offload step, which streams each part's tensors as
per-layer blobs, keeps offloaded models on the unfused path:
``InjectedModel.unfuse_projections``).

**Graphs.** A graph strategy that lays weights out anew for its captured code (the CPU's blocked
layout) is given the fused modules instead of their parts (:func:`layout_targets`); after it,
:meth:`FusedProjection.follow_layout` re-points the parts at views of the new layout when the
layout's instance forward can split itself (``split_views``), else the parts keep the old
layout's storage (a second copy of that group, logged).

**When a group is left unfused** (its parts run as before): a part that is not a plain
``nn.Linear`` or a :class:`~shardwise.quant.QuantLinear` (a transformers ``Conv1D``, a LoRA
wrapper, an instance-level forward), one with hooks, parts whose input width, dtypes, devices,
bias presence or quantization settings differ, tensors on the meta device (offloaded), and
quantized layouts without a row dimension (torch's opaque CPU int4 layout) or whose row blocks
a part does not fill (the native CPU layout stacks rows by 16). :func:`fusion_report` says
which groups of a model were fused.

**Off switch.** ``inject_model(..., fuse_projections=False)``, or the environment variable
``SHARDWISE_FUSE_PROJECTIONS=0`` (:data:`FUSE_ENV`) for every injection in the process
(``init_inference`` included), or ``init_inference(fuse_projections=False)``. Default on.
Measured (benchmarks/fused_projections.py, SmolLM2-135M batch 1, 2 threads, interleaved, quiet
2-core AMD EPYC; results/cpu-fused-projections{,-graphs}-quiet.json): eager fp32 0.98x, bf16
1.10x, int8 1.07x, int4 1.09x; compiled step (graphs) fp32 0.96x, bf16 0.96x, int8 1.10x, int4
1.14x. The native int8/int4 kernel is bound by its per-call cost, which fusion cuts per layer;
the compiled bf16 row product is faster per part, so its class says ``unfused_faster`` and
those layers run unfused under graphs; the fp32 blocked layout is left fused (0.96x: putting
its layers back on their parts after the layout is not supported). On a GPU each fused group
is one kernel launch instead of two or three (untimed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import ConfigError
from ..ledger import active, record
from .layers import out_width

log = logging.getLogger(__name__)

#: environment switch for fused projections: "0"/"false"/"off"/"no" turn them off
FUSE_ENV = "SHARDWISE_FUSE_PROJECTIONS"
_OFF = frozenset({"0", "false", "off", "no"})
_ON = frozenset({"", "1", "true", "on", "yes"})
#: the hook dicts a part must have empty (its hooks would be skipped by the fused product)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
          "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


def fuse_by_default() -> bool:
    """Whether injection fuses projections when not told (:data:`FUSE_ENV`, default on).

    Raises:
        ConfigError: the variable holds something other than an on/off word.
    """
    value = os.environ.get(FUSE_ENV, "").strip().lower()
    if value not in _ON | _OFF:
        raise ConfigError(f"{FUSE_ENV}={value!r}: use 1/true/on or 0/false/off (fused q|k|v and "
                          f"gate|up projections at injection, default on)")
    return value not in _OFF


@dataclass(frozen=True)
class _Slot:
    """One tensor of a projection module that stacks output rows: its attribute ``name``, the
    dimension its rows run along (negative: from the end), output rows per index along it
    (the native CPU layout packs 16), and whether it is a Parameter (else a buffer)."""

    name: str
    dim: int
    rows: int
    parameter: bool


def _slots(module: nn.Module) -> list[_Slot] | None:
    """The row-stacked tensors of ``module``; None when it is not a module kind fused here."""
    from ..quant.modules import QuantLinear, quant_row_dims

    bias = [_Slot("bias", -1, 1, True)] if getattr(module, "bias", None) is not None else []
    if type(module) is nn.Linear:
        return [_Slot("weight", -2, 1, True), *bias]
    if isinstance(module, QuantLinear):
        dims = quant_row_dims(module)
        if dims is None or any(n not in dims[0] for n in module._tensor_names):
            return None
        table, rows = dims
        return [_Slot(n, table[n], rows, False) for n in module._tensor_names] + bias
    return None


def _kind_key(module: nn.Module) -> tuple:
    """What must be equal across the parts of one fused group, beside the output width."""
    from ..quant.modules import QuantLinear

    bias = getattr(module, "bias", None)
    bias_key = None if bias is None else (bias.dtype, bias.device)
    if isinstance(module, QuantLinear):
        spec = module.spec
        return ("quant", module.backend, module.compute_dtype, spec.bits, spec.group_size,
                spec.symmetric, spec.in_features, module.source, repr(sorted(module.meta.items())),
                bias_key,
                tuple((n, getattr(module, n).dtype, getattr(module, n).device)
                      for n in module._tensor_names))
    w = module.weight
    return ("linear", w.dtype, w.device, w.shape[1], bias_key)


def _tensors(module: nn.Module, slots: list[_Slot]) -> list[torch.Tensor]:
    return [getattr(module, s.name) for s in slots]


def why_not_fusable(parts: tuple[nn.Module, ...]) -> str | None:
    """Why ``parts`` cannot run as one projection (module docstring), None when they can."""
    if len(parts) < 2:
        return "a single projection"
    slots = [_slots(p) for p in parts]
    if any(s is None for s in slots):
        kinds = ", ".join(sorted({type(p).__name__ for p, s in zip(parts, slots) if s is None}))
        return f"{kinds} is not a plain nn.Linear or a QuantLinear with a row-stacked layout"
    for part in parts:
        if "forward" in part.__dict__:
            return f"{type(part).__name__} has an instance-level forward"
        if any(getattr(part, h, None) for h in _HOOKS):
            return f"{type(part).__name__} has forward hooks"
    if len({_kind_key(p) for p in parts}) != 1 or any(s != slots[0] for s in slots):
        return "the parts differ in input width, dtype, device, bias or quantization"
    if any(t.is_meta for part, s in zip(parts, slots) for t in _tensors(part, s)):
        return "its tensors are on the meta device (offloaded)"
    rows = slots[0][0].rows
    if any(out_width(p) % rows for p in parts[:-1]):
        return f"the layout stacks rows by {rows} and a part's width is not a multiple"
    return None


@dataclass(eq=False)
class _UndoState:
    """What :meth:`FusedProjection.release` needs: the storage addresses the parts' views point
    into (the fused tensors, also after a new layout), the ledger that recorded the fusion
    (None outside ``init_inference``) and the ids of the parts' Parameters that held the
    tensors the ledger recorded when it was opened (the model's own weights: the undo's copy
    gives those back; a Parameter fused from another step's output is that step's to rebuild,
    :func:`_relocated`). Addresses and ids differ from process to process: a compiled step's
    key describes this by its type alone (``describe_opaque``)."""

    describe_opaque = True

    storages: set[int] = field(default_factory=set)
    ledger: Any = None
    originals: set[int] = field(default_factory=set)

    def __reduce__(self):
        # a pickled copy is empty: the compiler pickles the state its guards reach (a saved
        # step), and a copy of the ledger's storage weak references would free each reference
        # twice when collected (a segfault); the copy never undoes anything
        return _UndoState, ()


@dataclass(eq=False)
class FusedProjection:
    """One projection standing for ``parts`` (their outputs side by side, in order).

    Attributes:
        module: what the layer calls: an ``nn.Linear`` or a ``QuantLinear`` over the fused
            tensors (unregistered: not in ``state_dict``).
        parts: the adopted HF (or quantized) modules, whose tensors are views of ``module``'s.
        widths: each part's output width.
        what: ``"q|k|v"`` or ``"gate|up"`` (logs, reports).
    """

    module: nn.Module
    parts: tuple[nn.Module, ...]
    widths: tuple[int, ...]
    what: str
    #: the undo's bookkeeping (process-specific: kept out of a compiled step's key)
    undo: "_UndoState" = field(default_factory=lambda: _UndoState())

    @property
    def _storages(self) -> set[int]:
        return self.undo.storages

    @_storages.setter
    def _storages(self, value: set[int]) -> None:
        self.undo.storages = value

    @property
    def _ledger(self) -> Any:
        return self.undo.ledger

    @property
    def _originals(self) -> set[int]:
        return self.undo.originals

    def _remember(self) -> None:
        self._storages |= {t.untyped_storage().data_ptr()
                           for t in list(self.module.parameters()) + list(self.module.buffers())
                           if not t.is_meta}

    def _shares(self, t: torch.Tensor) -> bool:
        return not t.is_meta and t.untyped_storage().data_ptr() in self._storages

    def release(self) -> None:
        """Give every part's tensors that still view the fused storage their own: a Parameter
        that held the model's own tensor before the fusion gets that tensor back while the
        ledger still keeps it (an unfusing inside ``init_inference``: the original stays the
        weight, nothing is dropped), else a contiguous copy, bit for bit; the fused module is
        then unused. Used as the ledger's undo and by ``InjectedLayer.unfuse_projections``. A
        copy moves values, it rebuilds nothing: the ledger is told (:func:`_relocated`), so a
        weight some step changed without an undo is still named by ``close()``."""
        with torch.no_grad():
            for part in self.parts:
                for t in list(part.parameters(recurse=False)):
                    if not self._shares(t):
                        continue
                    old = t.data
                    kept = self._original(t)
                    t.data = kept if kept is not None else old.clone(
                        memory_format=torch.contiguous_format)
                    if id(t) not in self._originals:  # fused from a step's output
                        _relocated(self._ledger, old, t.data)
                for name, t in list(part.named_buffers(recurse=False)):
                    if self._shares(t):
                        setattr(part, name, t.clone(memory_format=torch.contiguous_format))
        self._storages = set()  # nothing views the fused storage now (it may be reused)

    def _original(self, t: torch.Tensor) -> torch.Tensor | None:
        """The tensor ``t`` held before the fusion, when it was the model's own and the ledger
        still keeps it with the values it has now (shape, dtype and device of the view)."""
        if self._ledger is None or id(t) not in self._originals:
            return None
        kept = self._ledger.original(t)
        if kept is None or (kept.shape, kept.dtype, kept.device) != (t.shape, t.dtype, t.device):
            return None
        return kept

    def follow_layout(self) -> bool:
        """After a graph strategy laid ``module``'s weight out anew (``share_weights``):
        re-point the parts at views of the new layout through the layout forward's
        ``split_views(parts, widths)``. Returns whether the parts share the fused storage
        (False: they keep the old layout's storage, a second copy of this group; logged)."""
        weight = getattr(self.module, "weight", None)
        if not isinstance(weight, torch.Tensor) or self._shares(weight):
            return True
        split = getattr(self.module.__dict__.get("forward"), "split_views", None)
        if split is not None and split(self.parts, self.widths):
            self._remember()
            return True
        log.warning("shardwise: the graph strategy laid the fused %s weight out in a layout its "
                    "parts cannot view; they keep their own copy (set %s=0 to keep one)",
                    self.what, FUSE_ENV)
        return False


def fuse(parts: tuple[nn.Module, ...], what: str) -> FusedProjection | None:
    """``parts`` as one :class:`FusedProjection` (their tensors re-pointed at views of the fused
    ones, recorded in the active ledger with :meth:`FusedProjection.release` as the undo);
    None, logged at debug level, when they cannot be fused (:func:`why_not_fusable`)."""
    reason = why_not_fusable(parts)
    if reason is not None:
        log.debug("shardwise: %s left unfused: %s", what, reason)
        return None
    slots = _slots(parts[0])
    widths = tuple(out_width(p) for p in parts)
    ledger = active()
    originals = {id(t) for p in parts for t in p.parameters(recurse=False)
                 if _holds_original(ledger, t)}
    with torch.no_grad():
        fused = {s.name: torch.cat([getattr(p, s.name).detach() for p in parts], dim=s.dim)
                 for s in slots}  # each [..., sum of the parts' rows, ...] along s.dim
        module = _fused_module(parts[0], fused, sum(widths))
        for s in slots:
            sizes = [-(-w // s.rows) for w in widths]  # indices per part along s.dim
            for part, view in zip(parts, fused[s.name].split(sizes, dim=s.dim)):
                _point(part, s, view)
    group = FusedProjection(module, tuple(parts), widths, what,
                            _UndoState(ledger=ledger, originals=originals))
    group._remember()
    record(f"fused {what} projection (the parts' tensors were views of it: copied back, "
           f"exactly)", group.release)
    return group


def _point(part: nn.Module, slot: _Slot, view: torch.Tensor) -> None:
    """Re-point ``part``'s tensor ``slot`` at ``view`` (a Parameter keeps its object)."""
    if slot.parameter:
        getattr(part, slot.name).data = view
    else:
        setattr(part, slot.name, view)  # QuantLinear rebuilds its packed view


def _fused_module(first: nn.Module, fused: dict[str, torch.Tensor], width: int) -> nn.Module:
    """A module of ``first``'s kind over the ``fused`` tensors, ``width`` outputs."""
    from ..quant.modules import QuantLinear
    from shardwise.kernels.reference.quant import PackedQuantWeight

    bias = fused.get("bias")
    if isinstance(first, QuantLinear):
        spec = dataclasses.replace(first.spec, out_features=width)
        packed = PackedQuantWeight(first.backend, spec, first.compute_dtype,
                                   {n: fused[n] for n in first._tensor_names}, dict(first.meta))
        return QuantLinear(packed, first.kernel, bias, first.source).train(first.training)
    weight = fused["weight"]  # [width, in]
    module = nn.Linear(weight.shape[1], width, bias=bias is not None, device="meta")
    module.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        module.bias = nn.Parameter(bias, requires_grad=False)
    return module.train(first.training)


def _holds_original(ledger: Any, param: torch.Tensor) -> bool:
    """Whether ``param`` holds the tensor ``ledger`` recorded for it when it was opened
    (:meth:`~shardwise.ledger.Ledger.holds_original`). False without a ledger."""
    return ledger is not None and ledger.holds_original(param)


def _relocated(ledger: Any, old: torch.Tensor, new: torch.Tensor) -> None:
    """Tell ``ledger`` that an undo moved ``old`` (what init left in the model, fused from
    another step's output) to ``new``, the same values, rebuilding nothing
    (:meth:`~shardwise.ledger.Ledger.relocated`)."""
    if ledger is not None:
        ledger.relocated(old, new)


def layout_targets(modules: list[nn.Module], groups: list[FusedProjection]) -> list[nn.Module]:
    """``modules`` (the leaves a graph strategy may lay out) with each fused group's parts
    replaced by its fused module (which the captured step calls)."""
    parts = {id(p) for g in groups for p in g.parts}
    return [m for m in modules if id(m) not in parts] + [g.module for g in groups]


def stack_groups(stack: nn.Module) -> Iterator[FusedProjection]:
    """Every :class:`FusedProjection` of the injected ``stack``'s layers."""
    for layer in getattr(stack, "_own", ()):
        yield from layer.fused_groups


def fusion_report(stack: nn.Module) -> dict[str, int]:
    """``{"q|k|v": n, "gate|up": m}``: how many layers of ``stack`` run each fused group."""
    out = {"q|k|v": 0, "gate|up": 0}
    for group in stack_groups(stack):
        out[group.what] = out.get(group.what, 0) + 1
    return out

"""Loading a checkpoint straight into offload blobs: the whole model is never resident.

``init_inference(None, checkpoint=DIR, offload={"device": "nvme", "nvme_path": ...})`` reads
the checkpoint with the ordinary loader (:func:`shardwise.checkpoint.load_checkpoint`: this
rank's slices only, converted to the compute dtype while read) through one more tensor hook,
:class:`WriteThrough`. The hook knows which loaded tensors belong to which *unit* (the input
embedding, each decoder layer, the output embedding: :func:`checkpoint_units`); it lets the
other reading hooks (quantize-while-reading) take each tensor first, assigns the rest itself,
and as soon as a unit holds every tensor it was waiting for it

1. lays the unit out (:func:`shardwise.offload.store.layout_unit`) and writes its blob
   (:meth:`~shardwise.offload.store.DiskStore.write_unit`), and
2. puts the unit's tensors back on the ``meta`` device (same shapes and dtypes), so their
   memory is freed before the next unit is read.

So at most the units being read are materialised at once (one, when the files hold each unit's
tensors together, as every ``save_pretrained`` does), plus the resident parts (final norm,
position tables, ...); the store writes each tensor straight from its memory.

What is streamed of a unit (:func:`unit_tensors`): its parameters and the packed buffers of its
quantized modules (modules with ``counts_buffers_as_weights``), deduplicated by identity, keyed
by their path inside the unit (``"self_attn.q_proj.weight"``; the keys stay the same after
injection, which adopts the same submodules under the same names). Other buffers stay
resident. A tensor shared by two units (tied input and output embeddings) is written in both
blobs and released once both are written.

Under pipeline stages a rank's units are its stage's only (:mod:`shardwise.offload.stages`):
the loader skips the other stages' tensors (``skip_modules``), the modules the pipeline step
will replace are neither units nor resident (``dropped_modules``: a tied table read as the
first stage's embedding belongs to that unit alone), and the stage's blobs are a shard of their
own (the split in the fingerprint, the stage and its units in the shard).

After the load the unit tensors are on ``meta``: the later engine steps must leave them there
(:func:`to_resident` moves and casts only the real tensors) and the offload step binds them to
ring slots from the store :class:`WrittenStore` describes. The loader's own pass over meta
buffers (it recomputes non-persistent buffers built on meta) runs before the hooks finish, so
released packed buffers are kept out of the modules' buffer tables until :meth:`finish`.

Bad input (before any data is read): a store that would not fit the disk under ``nvme_path``
(the float size of the unit tensors, an upper bound of the quantized one), units that already
hold real tensors, a unit holding tensors a saved quantized checkpoint stores raw (loading such a
checkpoint offloaded is not supported yet).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from ..checkpoint.extensions import TensorHook, TensorRef
from ..errors import ConfigError
from .config import OffloadConfig, OffloadError, check_space
from .store import ALIGN, DiskStore, MemoryStore, UnitEntry, align_up, layout_unit

#: ``LoadReport.results`` key of :class:`WriteThrough`'s :class:`WrittenStore`
HOOK_NAME = "shardwise.offload"
#: bumped whenever what a checkpoint-written blob holds changes (part of the fingerprint)
CHECKPOINT_FORMAT = 1


@dataclass(frozen=True)
class CheckpointUnit:
    """One unit of a model about to be loaded: its execution-order ``index``, qualified
    ``name`` (``"model.layers.3"``) and ``module``."""

    index: int
    name: str
    module: nn.Module


@dataclass
class WrittenStore:
    """What :class:`WriteThrough` wrote: the offload step binds the meta unit tensors to ring
    slots from it instead of repacking.

    Attributes:
        store: the :class:`~shardwise.offload.store.DiskStore` (its manifest written: complete),
            or for the ``"cpu"`` tier the :class:`~shardwise.offload.store.MemoryStore`.
        units: every unit's :class:`~shardwise.offload.store.UnitEntry`, in index order; the
            entries' keys are the tensors streamed (everything else stays resident).
        bytes_written: the blobs' bytes (padded).
        write_seconds: time spent packing and writing blobs (inside the load's time).
        max_units_resident: the most units holding real tensors at once during the load.
    """

    store: DiskStore | MemoryStore
    units: tuple[UnitEntry, ...]
    bytes_written: int = 0
    write_seconds: float = 0.0
    max_units_resident: int = 0

    def summary(self) -> str:
        where = getattr(self.store, "path", "host memory")
        return (f"{len(self.units)} units written to {where} while reading the "
                f"checkpoint ({self.bytes_written / 2**20:.1f} MiB, {self.write_seconds:.2f} s; "
                f"at most {self.max_units_resident} unit(s) resident at once)")


# ----- units ---------------------------------------------------------------------------------

def checkpoint_units(model: nn.Module, policy: Any = None) -> list[CheckpointUnit]:
    """The units of ``model`` (on meta, before loading) in execution order: the input embedding,
    each decoder layer (:func:`shardwise.moe.block.decoder_layers` with ``policy``), the output
    embedding (absent for a model without a head; skipped when it is the input embedding's
    module itself). The same modules, in the same order, that the offload step streams."""
    from ..moe.block import decoder_layers

    names = {id(m): n for n, m in model.named_modules()}
    modules = [model.get_input_embeddings(), *decoder_layers(model, policy)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module):
        modules.append(head)
    units, seen = [], set()
    for module in modules:
        if module is None or id(module) in seen:
            continue
        if id(module) not in names:
            raise ConfigError(f"the unit module {type(module).__name__} is not a submodule of "
                              f"{type(model).__name__}; cannot offload it")
        seen.add(id(module))
        units.append(CheckpointUnit(len(units), names[id(module)], module))
    return units


def unit_tensors(module: nn.Module, resident: set[int] = frozenset()
                 ) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """What a unit streams: ``(key, owner, attribute, tensor)`` for each parameter and each
    packed buffer of a quantized module (``counts_buffers_as_weights``) under ``module``, in
    module order, each tensor once (its first key). Other buffers stay resident, and so do
    empty tensors and those whose id is in ``resident`` (a module outside every unit holds
    them too: :func:`resident_ids`), as the offload step decides."""
    out, seen = [], set(resident)
    for prefix, owner in module.named_modules():
        tables = [owner._parameters]
        if getattr(owner, "counts_buffers_as_weights", False):
            tables.append(owner._buffers)
        for table in tables:
            for attr, t in table.items():
                if t is None or id(t) in seen or t.numel() == 0:
                    continue
                seen.add(id(t))
                out.append((f"{prefix}.{attr}" if prefix else attr, owner, attr, t))
    return out


def resident_ids(model: nn.Module, units: Sequence[CheckpointUnit],
                 dropped: Sequence[str] = ()) -> set[int]:
    """ids of the tensors registered on a module outside every unit (they stay resident),
    the modules under ``dropped`` (names: the pipeline step replaces them) not counted."""
    inside = {id(m) for u in units for m in u.module.modules()}
    return {id(t) for n, m in model.named_modules() if id(m) not in inside
            and not _inside(n, dropped)
            for table in (m._parameters, m._buffers) for t in table.values() if t is not None}


def _inside(name: str, modules: Sequence[str]) -> bool:
    """Whether ``name`` (a module's or a tensor's) is one of ``modules`` or lies inside one."""
    return any(name == m or name.startswith(m + ".") for m in modules)


def _unit_of(name: str, units: Sequence[CheckpointUnit]) -> list[int]:
    """Indices of the units whose module holds the tensor called ``name``."""
    return [u.index for u in units if name.startswith(u.name + ".")]


# ----- fingerprint ---------------------------------------------------------------------------

def checkpoint_fingerprint(desc: Any, *, dtype: torch.dtype, rank: int, tp_size: int,
                           units: Sequence[CheckpointUnit], quant: Any = None,
                           extra: Mapping[str, Any] | None = None,
                           stage: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None
                           ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """What blobs written from a checkpoint depend on, as ``(fingerprint, shard)`` (the
    :class:`~shardwise.offload.store.DiskStore` arguments, split as the offload step splits
    them). ``fingerprint``, the same on every rank: the checkpoint's files (path, size,
    modification time), the compute dtype, the quant settings, the tp size, the units,
    :data:`CHECKPOINT_FORMAT` and ``extra``; ``shard``: this rank (None at tp size 1). Another
    checkpoint or setting gives another store directory (the old one is listed as stale, never
    read); the ranks of one run keep their shards side by side.

    With pipeline stages (``stage``: :func:`shardwise.offload.stages.stage_identity`'s pair)
    the split joins the fingerprint, and this rank's stage, its rank and its units (this
    stage's only) form the shard: each stage's blobs are a directory of their own, and blobs
    of another stage or split are never used."""
    files = []
    for f in desc.files:
        st = Path(f).stat()
        files.append([str(Path(f).resolve()), st.st_size, st.st_mtime_ns])
    to_dict = getattr(quant, "to_dict", None)
    fingerprint = {
        "kind": "checkpoint", "format": CHECKPOINT_FORMAT, "source": str(desc.source),
        "files": files, "dtype": str(dtype).removeprefix("torch."), "tp_size": tp_size,
        "units": [u.name for u in units],
        "quant": to_dict() if callable(to_dict) else (None if quant is None else str(quant)),
        **dict(extra or {})}
    if stage is not None:
        shared, own = stage
        fingerprint.update(shared)
        return fingerprint, {"rank": rank, **own, "units": fingerprint.pop("units")}
    return fingerprint, ({"rank": rank} if tp_size > 1 else None)


# ----- the hook ------------------------------------------------------------------------------

class WriteThrough(TensorHook):
    """The loader's tensor hook writing each unit's blob as soon as the unit is read, then
    putting its tensors back on meta (module docstring).

    Args:
        store: where the blobs go (nothing is written before the first unit completes).
        units: :func:`checkpoint_units` of the model being loaded.
        dtype: the load's dtype (floating tensors arrive in it): sizes the space check.
        inner: the other reading hooks (e.g. ``Quantizer.reading_hook()``), offered each tensor
            first; their results are in :attr:`inner_results` after :meth:`finish`.
        settings: the offload settings (their ``nvme_path``'s free space is checked in
            :meth:`plan`, before any data is read); None skips the check.
        quantizer: the reading quantizer, when quantizing while reading: each unit's MoE
            experts modules (read whole, 3-D) are quantized with it just before the unit is
            written, as the engine's step 6 would after the load.
        dropped: names of modules the pipeline step replaces on this rank
            (:func:`shardwise.offload.stages.replaced_modules`): a tensor read under one of
            them belongs to the unit its other name is in, and their own tensors neither
            stream nor stay resident.
    """

    name = HOOK_NAME

    def __init__(self, store: DiskStore | MemoryStore, units: Sequence[CheckpointUnit],
                 dtype: torch.dtype | None, inner: Iterable[TensorHook] = (),
                 settings: OffloadConfig | None = None, quantizer: Any = None,
                 dropped: Sequence[str] = ()) -> None:
        self.store, self.units, self.dtype = store, list(units), dtype
        self.dropped = tuple(dropped)
        self.inner = tuple(inner)
        self.settings, self.quantizer = settings, quantizer
        self.inner_results: dict[str, Any] = {}
        self.entries: dict[int, UnitEntry] = {}
        self.bytes_written = 0
        self.write_seconds = 0.0
        self.max_units_resident = 0
        self._root: nn.Module | None = None
        self._refs: dict[tuple[str, str], TensorRef] = {}
        self._ref_units: dict[tuple[str, str], list[int]] = {}
        self._pending: dict[int, set[tuple[str, str]]] = {}
        self._started: set[int] = set()  # units holding at least one real tensor
        self._stashed: list[tuple[nn.Module, str, torch.Tensor]] = []  # released packed buffers

    # ----- before any data
    def plan(self, model: nn.Module, tensors: list[TensorRef]) -> None:
        """Map every tensor the load reads to its unit(s), refuse units already holding real
        tensors, check the disk holds the blobs; then the inner hooks plan."""
        self._root = model
        resident = resident_ids(model, self.units, self.dropped)
        for u in self.units:
            real = [k for k, _, _, t in unit_tensors(u.module, resident) if not t.is_meta]
            if real:
                raise OffloadError(
                    f"offload while loading a checkpoint: unit {u.name!r} already holds real "
                    f"tensors (e.g. {real[0]!r}); build the model on the meta device "
                    f"(`with torch.device('meta'):`) or pass model=None")
        self._pending = {u.index: set() for u in self.units}
        nbytes = {u.index: 0 for u in self.units}
        for ref in tensors:
            key = (ref.module, ref.param)
            self._refs[key] = ref
            if ref.is_buffer:
                continue  # buffers stay resident: the loader assigns them
            names = [n for n in ref.names if not _inside(n, self.dropped)]
            owners = [_unit_of(n, self.units) for n in names]
            if not owners or not all(owners):
                continue  # not in a unit, or a module outside every unit holds it too
            owners = sorted({i for found in owners for i in found})
            self._ref_units[key] = owners
            size = align_up(math.prod(ref.shape) * self._itemsize(ref.dtype))
            for i in owners:
                self._pending[i].add(key)
                nbytes[i] += size
        self._check_raw(tensors, resident)
        empty = [u.name for u in self.units if not self._pending[u.index]]
        if empty:
            raise OffloadError(f"offload while loading a checkpoint: the checkpoint fills no "
                               f"tensor of the unit(s) {empty[:3]}; it does not fit this model")
        if self.settings is not None:
            # the float size: an upper bound of the quantized blobs, known before reading
            check_space(self.settings, sum(nbytes.values()) + ALIGN * (len(self.units) + 2)
                        + (64 << 10))
        for hook in self.inner:
            hook.plan(model, tensors)

    def _itemsize(self, dtype: torch.dtype) -> int:
        if dtype.is_floating_point and self.dtype is not None:
            return self.dtype.itemsize
        return dtype.itemsize

    def _check_raw(self, tensors: list[TensorRef], resident: set[int]) -> None:
        """Every streamed tensor of every unit must reach the hooks as a plain tensor: one the
        checkpoint lacks, or one the load reads as an extension stores it (a saved quantized
        checkpoint's packed layers, never shown to hooks), is refused by name."""
        read = {n for ref in tensors if not ref.is_buffer for n in ref.names}
        for u in self.units:
            for key, _, _, _ in unit_tensors(u.module, resident):
                if f"{u.name}.{key}" not in read:
                    raise OffloadError(
                        f"offload while loading a checkpoint: {u.name}.{key} is not read from "
                        f"the checkpoint as a plain tensor (missing from it, or stored packed "
                        f"by a saved quantized checkpoint); offloading such a checkpoint is not "
                        f"supported yet: load the full-precision checkpoint (with quant=... to "
                        f"quantize it while reading)")

    # ----- each tensor
    def on_tensor(self, module_name: str, module: nn.Module, param: str,
                  tensor: torch.Tensor) -> bool:
        key = (module_name, param)
        took = any(h.on_tensor(module_name, module, param, tensor) for h in self.inner)
        owners = self._ref_units.get(key)
        if owners is None:
            return took  # resident: the loader assigns it unless an inner hook took it
        if not took:
            self._assign(self._refs[key], tensor)
        ready = []
        for i in owners:
            self._started.add(i)
            self._pending[i].discard(key)
            if not self._pending[i] and i not in self.entries:
                ready.append(i)
        self.max_units_resident = max(self.max_units_resident,
                                      len(self._started) - len(self.entries))
        if ready:
            self._flush(ready)
        return True

    def _assign(self, ref: TensorRef, tensor: torch.Tensor) -> None:
        """Put ``tensor`` under every name of ``ref`` as the loader would (a frozen Parameter),
        left in host memory: it only goes to disk."""
        value = nn.Parameter(tensor, requires_grad=False)
        for name in ref.names:
            owner, _, attr = name.rpartition(".")
            self._root.get_submodule(owner)._parameters[attr] = value

    # ----- a unit complete
    @torch.no_grad()
    def _flush(self, ready: list[int]) -> None:
        """Write each ready unit's blob, then release the tensors no unwritten unit holds and
        give their memory back to the OS."""
        start = time.perf_counter()
        written = [self._write(self.units[i]) for i in ready]
        self._release([t for tensors in written for t in tensors])
        del written  # the last references to the units' real tensors (but the loader's own)
        release_heap()
        self.write_seconds += time.perf_counter() - start

    def _write(self, unit: CheckpointUnit) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
        """Lay out and write ``unit``'s blob; returns its streamed tensors."""
        self._quantize_experts(unit)
        tensors = unit_tensors(unit.module, resident_ids(self._root, self.units, self.dropped))
        meta = [k for k, _, _, t in tensors if t.is_meta]
        if meta:
            raise OffloadError(f"offload while loading a checkpoint: unit {unit.name!r} is "
                               f"complete but {unit.name}.{meta[0]} was never read")
        entry = layout_unit(unit.index, unit.name, [(k, t) for k, _, _, t in tensors])
        self.store.write_unit(entry, [t for _, _, _, t in tensors])
        self.entries[unit.index] = entry
        self.bytes_written += entry.nbytes
        return tensors

    def _quantize_experts(self, unit: CheckpointUnit) -> None:
        """With quantize-while-reading: the unit's MoE experts modules, read whole, quantized
        now (what the engine's step 6 does after a resident load)."""
        if self.quantizer is None:
            return
        from ..quant.experts import QuantExperts, expert_modules, quantize_experts_module

        for name in expert_modules(unit.module):
            full = f"{unit.name}.{name}"
            if not isinstance(self._root.get_submodule(full), QuantExperts):
                quantize_experts_module(self.quantizer, self._root, full)

    def _release(self, tensors: list[tuple[str, nn.Module, str, torch.Tensor]]) -> None:
        """Each written tensor no unit still to be written holds goes back to meta, under every
        owner and name it has in the model (a tied Parameter stays one Parameter)."""
        held = {id(t) for u in self.units if u.index not in self.entries
                for _, _, _, t in unit_tensors(u.module)}
        replaced: dict[int, torch.Tensor] = {}
        for _, _, _, t in tensors:
            if id(t) not in held and id(t) not in replaced:
                replaced[id(t)] = _meta_like(t)
        if not replaced:
            return
        for owner in self._root.modules():
            for attr, t in list(owner._parameters.items()):
                if t is not None and id(t) in replaced:
                    owner._parameters[attr] = replaced[id(t)]
            buffers = [a for a, t in owner._buffers.items() if t is not None and id(t) in replaced]
            if buffers:
                self._stash_buffers(owner, buffers, replaced)

    def _stash_buffers(self, owner: nn.Module, attrs: list[str],
                       replaced: dict[int, torch.Tensor]) -> None:
        """A quantized module's packed buffers go to meta and its packed view is rebuilt over
        them (so it lets go of the real tensors); they are then kept out of the buffer table
        until :meth:`finish` (the loader recomputes meta buffers before the hooks finish)."""
        for attr in attrs:
            owner._buffers[attr] = replaced[id(owner._buffers[attr])]
        if callable(getattr(owner, "packed_view", None)):
            owner._packed = owner.packed_view()
        for attr in attrs:
            self._stashed.append((owner, attr, owner._buffers.pop(attr)))

    # ----- after every tensor
    def finish(self, model: nn.Module) -> WrittenStore:
        """Every unit written? Then the manifest (the store is complete), the released packed
        buffers back in their tables (on meta), the inner hooks' results."""
        missing = [u.name for u in self.units if u.index not in self.entries]
        if missing:
            raise OffloadError(f"offload while loading a checkpoint: the unit(s) {missing[:3]} "
                               f"were never completely read")
        for owner, attr, meta in self._stashed:
            owner._buffers[attr] = meta
        self._stashed.clear()
        entries = tuple(self.entries[u.index] for u in self.units)
        finish = getattr(self.store, "finish", None)  # a DiskStore's manifest (the cpu tier: none)
        if callable(finish):
            finish(entries)
        release_heap()
        self.inner_results = {h.name: h.finish(model) for h in self.inner}
        return WrittenStore(self.store, entries, self.bytes_written, self.write_seconds,
                            self.max_units_resident)


def _libc_malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere: other allocators return memory themselves)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _libc_malloc_trim()


def release_heap() -> None:
    """Give the heap memory freed by a released unit back to the OS (glibc ``malloc_trim``).

    Why: glibc raises its mmap threshold to the size of each large block freed, so after the
    first unit every weight the loader reads comes from the heap, and freed heap memory is kept
    (only a heap's free top is returned, and a small live allocation above it pins the rest).
    Measured on a 69 MB fp32 Llama (8 layers of 7 MB) read unit by unit: the load's peak RSS
    grew by 50 MB, 43 MB of it kept after the load; trimming after each unit: 14 MB (one unit
    plus, then, the store's staging copy of it), under 1 MB kept."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """``t``'s shape and dtype on meta (a frozen Parameter for a Parameter)."""
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta


# ----- the load ------------------------------------------------------------------------------

def load_to_store(model: nn.Module, desc: Any, settings: OffloadConfig, *,
                  units: Sequence[CheckpointUnit], prepared: Any = None, rank: int = 0,
                  tp_size: int = 1, device: torch.device | str = "cpu",
                  dtype: torch.dtype | None = None, hooks: Sequence[TensorHook] = (),
                  experts: int | None = None, quant: Any = None,
                  fingerprint_extra: Mapping[str, Any] | None = None,
                  pinned: Any = None, skip_modules: Sequence[str] = (),
                  dropped_modules: Sequence[str] | None = None,
                  stage: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None):
    """:func:`shardwise.checkpoint.load_checkpoint` with :class:`WriteThrough`: the units are
    written to a :class:`~shardwise.offload.store.DiskStore` under ``settings.nvme_path`` (the
    ``"nvme"`` tier; the ``"cpu"`` tier: a :class:`~shardwise.offload.store.MemoryStore` of
    host buffers, pinned with ``pin_memory``) as they are read and left on meta; everything
    else is loaded as usual.

    Args:
        model: the meta skeleton (``_checkpoint.skeleton``).
        desc: the checkpoint's :class:`~shardwise.checkpoint.Description`.
        settings: the ``"nvme"`` offload settings.
        units: :func:`checkpoint_units` of ``model``.
        prepared, rank, device, dtype, experts: as ``load_checkpoint``'s.
        tp_size: the tp size (in the fingerprint).
        hooks: the engine's other reading hooks (quantize-while-reading).
        quant: the quant settings (in the fingerprint).
        pinned: the ``"cpu"`` tier's pinned-buffer factory (the accelerator's
            ``pinned_host_buffer`` when ``pin_memory`` is on), or None for pageable buffers.
        skip_modules: modules whose tensors this rank does not read (another pipeline stage
            runs them), as ``load_checkpoint``'s.
        dropped_modules: modules the pipeline step replaces on this rank (``skip_modules``
            and a tied head off the last stage: :func:`shardwise.offload.stages.
            replaced_modules`); None: ``skip_modules``. ``units`` must then be this stage's
            (:func:`shardwise.offload.stages.stage_units`).
        stage: with pipeline stages, :func:`shardwise.offload.stages.stage_identity`'s pair
            (the split in the fingerprint; the stage and its units in the shard).

    Returns:
        The ``LoadReport``: its ``results`` hold the inner hooks' results under their names
        (e.g. ``"shardwise.quant"``, as without offload) and the :class:`WrittenStore` under
        :data:`HOOK_NAME`.
    """
    from .. import checkpoint as _checkpoint

    if settings.device == "nvme" and not settings.nvme_path:
        raise OffloadError("loading a checkpoint straight into offload blobs on the 'nvme' tier "
                           "needs an nvme_path (the directory the blobs are written to)")
    if dtype is None:
        raise OffloadError("loading a checkpoint straight into offload blobs needs the compute "
                           "dtype (the blobs hold the weights as they run)")
    fingerprint, shard = checkpoint_fingerprint(desc, dtype=dtype, rank=rank, tp_size=tp_size,
                                                units=units, quant=quant, extra=fingerprint_extra,
                                                stage=stage)
    store = DiskStore(settings.nvme_path, fingerprint, shard) if settings.device == "nvme" else \
        MemoryStore(pinned)
    quantizer = next((getattr(h, "quantizer") for h in hooks if hasattr(h, "quantizer")), None)
    dropped = tuple(skip_modules if dropped_modules is None else dropped_modules)
    hook = WriteThrough(store, units, dtype, hooks, settings, quantizer, dropped)
    loaded = _checkpoint.load_checkpoint(model, desc, prepared=prepared, rank=rank,
                                         device=device, dtype=dtype, hooks=[hook],
                                         experts=experts, skip_modules=tuple(skip_modules))
    loaded.results.update(hook.inner_results)
    return loaded


# ----- the later steps over meta units -------------------------------------------------------

def to_resident(module: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """``module.to(device=device, dtype=dtype)`` for the real tensors only: the meta ones (the
    offloaded units, bound to ring slots at run time) stay as they are. Floating and complex
    tensors are cast, the others only moved (as ``Module.to``); quantized modules' packed
    buffers keep their dtypes (their own ``_apply``)."""
    device = torch.device(device)

    def convert(t: torch.Tensor) -> torch.Tensor:
        if t.is_meta:
            return t
        cast = dtype if (t.is_floating_point() or t.is_complex()) else None
        return t.to(device, cast)
    return module._apply(convert)


def adopt_written(units: Sequence[Any], written: WrittenStore,
                  device: torch.device | str = "cpu") -> list[UnitEntry]:
    """Match the offload step's units (:func:`shardwise.offload.transform.offload_units`, after
    the later steps: injected layers included) with the blobs :class:`WriteThrough` wrote, in
    place: each unit's tensors are narrowed to its blob's keys, in the blob's order (what the
    ring binds), the others stay resident; and each meta Parameter is replaced, under every
    name the units give it (tied ones stay one object), by a placeholder on ``device`` of its
    shape and dtype holding one element (a stride-0 view), since the ring rebinds a Parameter
    through ``.data``, which cannot turn a meta tensor into a real one (a dense tensor of any
    device can be rebound to a view of any other: ``device`` only decides where the one
    element lives; pass the slots' device). Returns the entries, one per unit.

    Raises:
        OffloadError: the units differ from the written ones (names, order), or a unit holds a
            tensor on meta that its blob lacks (it could never be bound): a step between the
            load and the offload step changed the units.
    """
    entries = {e.name: e for e in written.units}
    names = [u.name for u in units]
    if names != [e.name for e in written.units]:
        raise OffloadError(f"the offload step's units {names[:4]}... are not the units written "
                           f"while loading the checkpoint {[e.name for e in written.units][:4]}"
                           f"...; a step changed the model's layers in between")
    out = []
    for unit in units:
        entry = entries[unit.name]
        by_key = {r.key: r for r in unit.tensors}
        missing = [t.key for t in entry.tensors if t.key not in by_key]
        unbound = [r.key for r in unit.tensors
                   if r.current().is_meta and r.key not in {t.key for t in entry.tensors}]
        if missing or unbound:
            raise OffloadError(f"unit {unit.name!r}: its blob written while loading holds "
                               f"{[t.key for t in entry.tensors][:4]}..., the model has "
                               f"{missing[:2] or unbound[:2]} {'missing' if missing else 'on meta'}"
                               f"; a step changed the unit between the load and the offload step")
        for t in entry.tensors:
            ref = by_key[t.key]
            got = ref.current()
            if tuple(got.shape) != t.shape or got.dtype != t.dtype:
                raise OffloadError(f"{unit.name}.{t.key} is {got.dtype} {list(got.shape)} in the "
                                   f"model but {t.dtype} {list(t.shape)} in its blob; a step "
                                   f"cast or resized it after the load")
        unit.tensors[:] = [by_key[t.key] for t in entry.tensors]
        out.append(entry)
    _placeholders(units, torch.device(device))
    return out


def _placeholders(units: Sequence[Any], device: torch.device) -> None:
    """Every meta Parameter of ``units``' tensors becomes a one-element stride-0 Parameter on
    ``device`` (same shape and dtype) at each of its places, the refs pointing at it."""
    new: dict[int, nn.Parameter] = {}
    for unit in units:
        for ref in unit.tensors:
            old = ref.tensor
            if not (ref.is_parameter and old.is_meta):
                continue
            if id(old) not in new:
                one = torch.zeros(1, dtype=old.dtype, device=device)
                new[id(old)] = nn.Parameter(one.expand(old.shape), requires_grad=False)
            ref.tensor = new[id(old)]
            for owner, attr in ref.places:
                owner._parameters[attr] = ref.tensor

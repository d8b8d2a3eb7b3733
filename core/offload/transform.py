"""The offload step of ``init_inference``: repack the streamed units, free them, build the ring.

Runs after injection and before graphs, over the model as the earlier steps left it (sharded
per rank, cast, quantized, injected), so what is streamed is exactly what runs:

1. :func:`offload_units` — the *units*, in cyclic execution order: the input embedding, each
   decoder (or encoder) layer (the injected ones when the model is injected: they own the same
   HF submodules), the output embedding. Each unit's tensors are every parameter and buffer of
   its submodules, deduplicated by identity; a tensor a resident module shares stays resident.
   Everything else (final norm, positions, rotary tables) stays resident. Tied embeddings: the
   shared Parameter is in both units' blobs.
2. The store: the units' blobs in this rank's directory under ``nvme_path`` (keyed by a
   fingerprint of the model config, dtype, quant settings, injection, tp size and rank, the
   shardwise version and a digest of each unit's tensors: a changed model or setting never
   reuses stale blobs), reused as they are when complete; or, for the ``"cpu"`` tier, pinned
   host buffers.
3. The ring's slots are sized by the largest decoder layer; a unit larger than a slot is
   handled by :mod:`shardwise.offload.chunks`: an output head streams in row chunks (each a
   *piece* of the ring, a byte range of its blob), an input embedding reads only the rows of
   its ids, and a unit that can be neither stays resident. Every other unit is one piece.
4. The resident copies are freed: every streamed tensor is pointed at a zero-copy view of a
   ring slot (Parameters keep their object: ``param.data = view``; buffers are replaced in
   ``module._buffers``; quantized modules' packed views are rebuilt), or, for a chunked or
   gathered table, at a stride-0 placeholder; so steady memory holds the resident parts plus
   the ring.
5. The :class:`~shardwise.offload.ring.Ring` and each whole unit's forward hooks: pre-forward
   acquires the unit (binding its tensors to its slot), post-forward releases it and prefetches
   the next pieces; a chunked head's and a gathered embedding's instance-level ``forward``.

Every change is recorded in the active :class:`~shardwise.ledger.Ledger`: ``engine.close()``
removes the hooks, reads each unit back into ordinary tensors (older undos — dequantize, cast
back, un-inject — then run on those), and closes the ring; a failed init restores the snapshot
and closes the ring.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..ledger import active, add_hook, record, set_forward
from . import chunks as _chunks
from . import store as _store
from .config import (OffloadConfig, OffloadError, check_ring_fits, check_space,
                     parse_offload)
from .ring import DeviceLoader, HostLoader, Loader, Ring
from .stages import stage_dims

log = logging.getLogger(__name__)

#: bumped when what the fingerprint covers or the unit layout changes
FINGERPRINT_FORMAT = 1
#: reader threads filling host slots from disk
READ_THREADS = 2


# ----- the units ----------------------------------------------------------------------------------


@dataclass
class TensorRef:
    """One streamed tensor of a unit.

    key: its path inside the unit (``"mlp.down_proj.weight"``); owner, attr: the module and
    name it is registered under (first place); is_parameter: a Parameter (rebound through
    ``.data``, the object stays) or a buffer (replaced in ``owner._buffers``); places: every
    (module, name) it is registered under inside the unit (a shared submodule: several);
    tensor: the Parameter object (for a buffer, the buffer as found).
    """

    key: str
    owner: nn.Module
    attr: str
    is_parameter: bool
    tensor: torch.Tensor
    places: list[tuple[nn.Module, str]] = field(default_factory=list)

    def current(self) -> torch.Tensor:
        """The tensor the model holds at this place now."""
        table = self.owner._parameters if self.is_parameter else self.owner._buffers
        return table[self.attr].detach()

    def point(self, value: torch.Tensor) -> None:
        """Make the model hold ``value`` here (a Parameter keeps its object)."""
        if self.is_parameter:
            self.tensor.data = value
        else:
            for owner, attr in self.places:
                owner._buffers[attr] = value


@dataclass
class Unit:
    """A module whose forward runs as one piece and whose tensors stream together.

    index: position in cyclic execution order; name: its qualified name in the model; module;
    tensors: its :class:`TensorRef`\\ s; repacked: the modules with a packed view over their
    buffers (quantized linears and experts) to rebuild after a rebind."""

    index: int
    name: str
    module: nn.Module
    tensors: list[TensorRef]
    repacked: list[nn.Module] = field(default_factory=list)
    piece: int | None = None  # its position in the ring when streamed whole


def _unit_modules(model: nn.Module, plan: Any, stack: nn.Module | None) -> list[nn.Module]:
    """Input embedding, the layers, output embedding (each once; missing ones left out)."""
    if stack is not None and hasattr(stack, "_layers"):
        layers = list(stack._layers[0])  # the injected layers (they adopted the HF children)
    else:
        from ..moe.block import decoder_layers

        layers = list(decoder_layers(model, getattr(plan, "policy", None)))
    found = [model.get_input_embeddings(), *layers, model.get_output_embeddings()]
    out, seen = [], set()
    for module in found:
        if isinstance(module, nn.Module) and id(module) not in seen:
            seen.add(id(module))
            out.append(module)
    return out


def _resident_tensor_ids(model: nn.Module, units: Sequence[nn.Module]) -> set[int]:
    """ids of the tensors registered on modules outside every unit (they stay resident)."""
    inside = {id(m) for unit in units for m in unit.modules()}
    ids = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        for table in (module._parameters, module._buffers):
            ids.update(id(t) for t in table.values() if t is not None)
        ids.update(id(v) for v in vars(module).values() if isinstance(v, torch.Tensor))
    return ids


def _unit_tensors(module: nn.Module, resident: set[int]) -> list[TensorRef]:
    """The unit's streamed tensors (see :class:`TensorRef`), in module order."""
    refs: dict[int, TensorRef] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        for is_param, table in ((True, sub._parameters), (False, sub._buffers)):
            for attr, t in table.items():
                if t is None or t.numel() == 0 or id(t) in resident:
                    continue
                ref = refs.get(id(t))
                if ref is None:
                    key = f"{path}.{attr}" if path else attr
                    ref = refs[id(t)] = TensorRef(key, sub, attr, is_param, t)
                if all(o is not sub or a != attr for o, a in ref.places):
                    ref.places.append((sub, attr))
    return list(refs.values())


def _packed_modules(module: nn.Module) -> list[nn.Module]:
    """Submodules keeping a packed view over their buffers (``PackedLayout``: quantized linears
    and experts), which must be rebuilt whenever their buffers are rebound."""
    from ..quant.modules import PackedLayout

    return [m for m in module.modules() if isinstance(m, PackedLayout)]


def offload_units(model: nn.Module, plan: Any, stack: nn.Module | None = None) -> list[Unit]:
    """The units of ``model`` in cyclic execution order (module docstring).

    Args:
        model: the model as the earlier steps left it.
        plan: the engine's :class:`~shardwise.plan.Plan` (its policy locates the layers).
        stack: the injected stack (``InjectedModel`` / ``InjectedEncoder``), if any: its layers
            are the units.
    """
    modules = _unit_modules(model, plan, stack)
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    resident = _resident_tensor_ids(model, modules)
    units = []
    for module in modules:
        tensors = _unit_tensors(module, resident)
        if tensors:
            units.append(Unit(len(units), names.get(id(module), type(module).__name__), module,
                              tensors, _packed_modules(module)))
    return units


# ----- the fingerprint ----------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    """``value`` as plain JSON data (anything else by ``str``)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _model_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    return _jsonable(to_dict()) if callable(to_dict) else repr(config)


def store_fingerprint(model: nn.Module, units: Sequence[Unit], plan: Any,
                      extra: Mapping | None = None) -> tuple[dict, dict | None]:
    """What the blobs depend on, as (fingerprint, shard).

    ``fingerprint``, the same on every rank: the format, the shardwise version, the model
    config, the parallel sizes (tp, ep) and ``extra`` (the engine's dtype, quant settings,
    injection). ``shard``: this rank's coordinates and each unit's name and
    :func:`~shardwise.offload.store.content_digest` (what this rank holds) — None on a single
    rank, where the digests join the fingerprint. A changed model or setting thus never
    reuses stale blobs, and the ranks of one run keep their shards side by side
    (:class:`~shardwise.offload.store.DiskStore`)."""
    from .. import __version__

    dims = {name: getattr(plan, name) for name in ("tp", "ep") if hasattr(plan, name)}
    dims.update(stage_dims(plan))  # a pipeline stage's blobs: a shard of their own
    dp = getattr(plan, "dp", None)
    if dp is not None and dp.size > 1:  # replicas write side by side, never into one folder
        dims["dp"] = dp
    digests = [[u.name, _store.content_digest(r.current() for r in u.tensors)] for u in units]
    fingerprint = {"format": FINGERPRINT_FORMAT, "shardwise": __version__,
                   "model": _model_config(model), "sizes": {k: d.size for k, d in dims.items()},
                   "extra": _jsonable(dict(extra or {}))}
    if all(d.size == 1 for d in dims.values()):
        return {**fingerprint, "units": digests}, None
    return fingerprint, {"coords": {k: d.coord for k, d in dims.items()}, "units": digests}


# ----- the report ---------------------------------------------------------------------------------


@dataclass
class OffloadReport:
    """What the offload step did (``engine.offload``).

    tier: ``"nvme"`` or ``"cpu"``; path: the store directory (None for ``"cpu"``); units: the
    units' names in execution order; ring_bytes: bytes of the ring's slots (buffer_count × the
    largest unit); resident_bytes: bytes of the model's tensors that stay resident;
    streamed_bytes_per_pass: bytes read for one pass over every unit; direct_io /
    fallback_reason: whether disk reads bypass the page cache, and why not; stale: sibling
    store directories of other models or settings (never read); reused: the store was complete
    and nothing was written; buffer_count: the ring's slots; slot_bytes: bytes of one slot (the
    largest decoder layer's blob: ``slot_unit``); chunked: the heads streamed in row chunks
    (name -> chunks; each chunk is one of ``units``); gathered: the input embeddings whose rows
    are read on demand (not in ``units``; their reads are in :meth:`stats`'
    ``gathered_bytes``); resident_units: units larger than a slot that can be neither chunked
    nor gathered, units another module reads outside their forward (a quantized tied head's
    table, read by its ``QuantEmbedding``), or units sharing a tensor with one that stays: kept
    in memory, in ``resident_bytes`` (:mod:`shardwise.offload.chunks`); graphs: what
    ``enable_graph`` captured (:mod:`shardwise.offload.graphs`), None without graphs.
    """

    tier: str
    path: str | None
    units: list[str]
    ring_bytes: int
    resident_bytes: int
    streamed_bytes_per_pass: int
    direct_io: bool
    fallback_reason: str | None
    stale: list[str]
    reused: bool
    buffer_count: int = 0
    ring: Ring | None = field(default=None, repr=False)
    slot_bytes: int = 0
    slot_unit: str | None = None
    chunked: dict[str, int] = field(default_factory=dict)
    gathered: list[str] = field(default_factory=list)
    resident_units: list[str] = field(default_factory=list)
    #: what ``enable_graph`` captured, one line (None: no graphs); see
    #: :mod:`shardwise.offload.graphs`
    graphs: str | None = None

    def stats(self) -> dict:
        """Reading since the last :meth:`reset_stats`: ``bytes_read``, ``read_s``, ``wait_s``
        (compute waiting for reads), ``overlap`` (1 - wait / read), ``passes`` (passes over the
        units), ``bytes_per_pass``, ``units_read`` and ``per_pass`` (the recent passes)."""
        return self.ring.stats.as_dict()

    def reset_stats(self) -> None:
        """Start counting afresh (e.g. after a warm-up)."""
        self.ring.stats.reset()

    @property
    def events(self) -> list[tuple[str, int, int]]:
        """The ring's recent events ``(kind, unit, slot)``: ``submit`` (a load started),
        ``acquire`` (a unit's forward starts), ``release`` (it ended)."""
        return list(self.ring.stats.events)

    def summary(self) -> str:
        """One line for the init log: tier, units, ring size, resident bytes, the store."""
        where = f" in {self.path}" if self.path else ""
        store = ("reused" if self.reused else "written") + where
        io = "" if self.tier != "nvme" else (
            ", direct I/O" if self.direct_io else f", buffered reads ({self.fallback_reason})")
        stale = f"; {len(self.stale)} stale store(s) beside it, not used" if self.stale else ""
        big = "".join(
            [f"; {name} in {k} row chunks" for name, k in self.chunked.items()]
            + [f"; {name} rows read on demand" for name in self.gathered]
            + [f"; {name} kept resident (larger than a slot, or read outside its forward)"
               for name in self.resident_units])
        sizing = (f" ({_mib(self.slot_bytes)} each, sized by {self.slot_unit})"
                  if self.slot_unit else "")
        return (f"offload ({self.tier}): {len(self.units)} units streamed, "
                f"{_mib(self.streamed_bytes_per_pass)} per pass; ring of {self.buffer_count} slots"
                f" = {_mib(self.ring_bytes)}{sizing}{big}; resident {_mib(self.resident_bytes)}; "
                f"blobs {store}{io}{stale}")

    def close(self) -> None:
        """Stop the ring's reader threads (``engine.close()`` does it). Idempotent."""
        if self.ring is not None:
            self.ring.close()


def _mib(nbytes: int) -> str:
    """MiB from 1 MiB on, KiB below (a tiny model's resident part is not "0.00 MiB")."""
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


# ----- the step -----------------------------------------------------------------------------------


def offload_model(model: nn.Module, settings: OffloadConfig | Mapping, accelerator: Any,
                  device: torch.device, plan: Any, *, stack: nn.Module | None = None,
                  fingerprint_extra: Mapping | None = None,
                  written: Any = None) -> OffloadReport:
    """Stream ``model``'s units from ``settings``' tier through a ring (module docstring).

    Args:
        model: the model as the earlier steps left it (its tensors on ``device``).
        settings: the ``offload=`` settings (an :class:`OffloadConfig` or its dict).
        accelerator: the engine's accelerator (``computes_in_host_memory`` picks the loader).
        device: the device the layers compute on.
        plan: the engine's plan (layers, tp/ep coordinates for the fingerprint).
        stack: the injected stack, if any.
        fingerprint_extra: more of what the blobs depend on (the engine passes dtype, quant
            settings, injection).
        written: the :class:`~shardwise.offload.checkpoint.WrittenStore` of a checkpoint loaded
            straight into blobs (the units' tensors then on meta): its store is used as it is,
            nothing is repacked.

    Returns:
        The :class:`OffloadReport` (``engine.offload``).

    Raises:
        OffloadError: nothing to stream, too little disk space for the blobs (checked before
            writing), or a ring that does not fit the device (naming the largest layer).
    """
    settings = parse_offload(settings)
    if stack is not None and hasattr(stack, "unfuse_projections"):
        # fused q|k|v and gate|up (shardwise.inject.fuse) make the parts views of one tensor
        # per group; the units stream each part's tensors as they are named, so offloaded
        # layers run their projections unfused (the parts get their own storage back)
        stack.unfuse_projections()
    units = offload_units(model, plan, stack)
    if not units:
        raise OffloadError(f"offload found nothing to stream in {type(model).__name__}: no input "
                           f"embedding, decoder layers or output embedding with weights; offload "
                           f"streams those of a transformer (drop offload for this model)")
    with torch.no_grad():
        if written is not None:  # the blobs were written while loading the checkpoint
            from .checkpoint import adopt_written

            entries, source, reused = adopt_written(units, written, device), written.store, False
        else:
            entries = [_store.layout_unit(u.index, u.name,
                                          [(r.key, r.current()) for r in u.tensors])
                       for u in units]
        embeds = _embeddings(model)
        sizing = _chunks.slot_bytes(entries, [i for i, u in enumerate(units)
                                              if u.module not in embeds])
        modes = _chunks.plan_modes(units, entries, sizing.nbytes, *embeds,
                                   pinned=_chunks.read_outside(model, units))
        check_ring_fits(accelerator, device, sizing.name, sizing.nbytes, settings.buffer_count)
        if written is None:
            fingerprint, shard = store_fingerprint(model, units, plan, fingerprint_extra)
            source, reused = _fill_store(settings, units, entries, fingerprint, shard,
                                         _pinner(settings, accelerator))
        pieces, owner = _pieces(units, entries, modes, sizing.nbytes)
        host = accelerator.computes_in_host_memory
        ranges = _chunks.RangeReader(source, threads=READ_THREADS)
        loader = _loader(settings, source, device, sizing.nbytes, host, ranges,
                         _pinner(settings, accelerator))
        views = _views(pieces, loader.slots)
        ring = Ring(pieces, loader, _binder(units, owner, views))
        streamed = {id(r.tensor) for u, m in zip(units, modes) if m != "resident"
                    for r in u.tensors if not (m == "chunked" and r.key == "bias")}
        resident = _resident_bytes(model, streamed)  # before the buffers are replaced
        try:
            _free(units, modes, entries, owner, views, loader.slots[0], ranges, device,
                  written is not None)
            _record_undo(units, ring, views, modes, entries, owner, ranges, device)
            _install_hooks([u for u, m in zip(units, modes) if m == "ring"], ring)
            _replace_forwards(units, modes, entries, pieces, ring, views, ranges, device)
            ring.start()
        except BaseException:
            ring.close()
            ranges.close()
            raise
    return OffloadReport(
        tier=settings.device, path=str(getattr(source, "path", "")) or None,
        units=[p.name for p in pieces], ring_bytes=sum(s.numel() for s in loader.slots),
        resident_bytes=resident,
        streamed_bytes_per_pass=sum(p.nbytes for p in pieces),
        direct_io=bool(getattr(loader, "direct_io", False)),
        fallback_reason=getattr(loader, "fallback_reason", None),
        stale=[str(p) for p in getattr(source, "stale", [])], reused=reused,
        buffer_count=settings.buffer_count, ring=ring, slot_bytes=loader.slots[0].numel(),
        slot_unit=sizing.name,
        chunked={u.name: sum(1 for p in pieces if p.blob is e)
                 for u, e, m in zip(units, entries, modes) if m == "chunked"},
        gathered=[u.name for u, m in zip(units, modes) if m == "gathered"],
        resident_units=[u.name for u, m in zip(units, modes) if m == "resident"])


def _embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(input embedding, output embedding) modules of ``model`` (None where it has none)."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        get = getattr(model, getter, None)
        try:
            module = get() if callable(get) else None
        except (NotImplementedError, AttributeError):
            module = None
        found.append(module if isinstance(module, nn.Module) else None)
    return found[0], found[1]


def _pieces(units: Sequence[Unit], entries: Sequence[Any], modes: Sequence[str],
            slot: int) -> tuple[list[_chunks.Piece], dict[int, int]]:
    """The ring's pieces in cyclic order (a ``"ring"`` unit whole, a ``"chunked"`` one in row
    chunks; gathered and resident units are not in the ring) and piece index -> unit index for
    the whole ones (the pieces whose tensors are bound into the model)."""
    pieces, owner = [], {}
    for unit, entry, mode in zip(units, entries, modes):
        if mode == "ring":
            owner[len(pieces)] = unit.index
            unit.piece = len(pieces)
            pieces.append(_chunks.whole_piece(len(pieces), entry))
        elif mode == "chunked":
            pieces.extend(_chunks.chunk_pieces(len(pieces), entry, slot))
    if not pieces:
        raise OffloadError("offload would stream nothing: every unit is larger than a ring slot "
                           "and stays resident; drop offload for this model")
    return pieces, owner


def _binder(units: Sequence[Unit], owner: Mapping[int, int], views: list):
    """The ring's bind callback: a whole unit's tensors pointed at the slot (a chunk is used
    straight from its view by :class:`~shardwise.offload.chunks.ChunkedLinear`)."""
    def bind(piece: int, s: int) -> None:
        unit = owner.get(piece)
        if unit is not None:
            _bind(units[unit], views[piece][s])
    return bind


def _pinner(settings: OffloadConfig, accelerator: Any) -> _store.Pinner | None:
    """What pins host buffers for this run: the accelerator's ``pinned_host_buffer`` when
    ``pin_memory`` is on, else None."""
    return accelerator.pinned_host_buffer if settings.pin_memory else None


def _fill_store(settings: OffloadConfig, units: Sequence[Unit], entries: Sequence[Any],
                fingerprint: Mapping, shard: Mapping | None,
                pinned: _store.Pinner | None) -> tuple[Any, bool]:
    """(the tier's store holding every unit's blob, whether it was reused): a complete
    :class:`DiskStore` is reused as it is, else written after the space check; the ``"cpu"``
    tier packs a :class:`MemoryStore`."""
    if settings.device == "nvme":
        store = _store.DiskStore(settings.nvme_path, fingerprint, shard=shard)
        if store.complete(entries):
            return store, True
        check_space(settings, _store.required_bytes(entries))
    else:
        store = _store.MemoryStore(pinned)
    for unit, entry in zip(units, entries):
        store.write_unit(entry, [r.current() for r in unit.tensors])
    if settings.device == "nvme":
        store.finish(entries)
    return store, False


def _loader(settings: OffloadConfig, store: Any, device: torch.device, slot_bytes: int,
            host: bool, ranges: _chunks.RangeReader, pinned: _store.Pinner | None) -> Loader:
    """The ring's loader: straight into host slots on a device that computes in host memory,
    else through host memory and a copy stream into device slots. Whole units are read by the
    store's reader, chunks by ``ranges`` (closed with the loader)."""
    count = settings.buffer_count
    if host:
        reader = _chunks.PieceReader(store.reader(threads=READ_THREADS), ranges)
        loader = HostLoader(reader, [_store.aligned_host_buffer(slot_bytes) for _ in range(count)])
        loader.direct_io, loader.fallback_reason = reader.direct_io, reader.fallback_reason
        return loader
    slots = [torch.empty(_store.align_up(slot_bytes), dtype=torch.uint8, device=device)
             for _ in range(count)]
    if settings.device == "cpu":  # pinned host blobs: nothing to read

        def in_memory(piece: Any, s: int) -> torch.Tensor:
            return store.buffer(piece.blob)[piece.offset:piece.offset + piece.nbytes]
        return DeviceLoader(device, slots, in_memory, workers=1, on_close=ranges.close)
    reader = _chunks.PieceReader(store.reader(threads=READ_THREADS), ranges)
    staging = [_store.aligned_host_buffer(slot_bytes, pinned) for _ in range(count)]

    def read(entry: Any, s: int) -> torch.Tensor:
        reader.submit(entry, staging[s]).result()
        return staging[s]
    loader = DeviceLoader(device, slots, read, workers=count - 1, on_close=reader.close)
    loader.direct_io, loader.fallback_reason = reader.direct_io, reader.fallback_reason
    return loader


def _views(entries: Sequence[Any], slots: Sequence[torch.Tensor]) -> list[list[list]]:
    """views[piece][slot]: the piece's tensors (in its layout's order: a whole unit's in its
    TensorRef order) as zero-copy views of the slot, made once (outside inference mode, so
    rebinding never mixes tensor kinds)."""
    out = []
    for entry in entries:
        per_slot = []
        for slot in slots:
            by_key = _store.unit_views(entry, slot)
            per_slot.append([by_key[t.key] for t in entry.tensors])
        out.append(per_slot)
    return out


def _bind(unit: Unit, views: Sequence[torch.Tensor]) -> None:
    """Point ``unit``'s tensors at ``views`` and rebuild its packed views."""
    for ref, view in zip(unit.tensors, views):
        ref.point(view)
    for module in unit.repacked:
        module._packed = module.packed_view()


def _read_blob(ranges: _chunks.RangeReader, entry: Any, device: torch.device
               ) -> dict[str, torch.Tensor]:
    """Every tensor of ``entry``'s blob, read from the store into new memory on ``device``."""
    buffer = _store.aligned_host_buffer(entry.nbytes)
    ranges.read(entry, 0, entry.nbytes, buffer)
    # .to() is the view itself where the device is the buffer's (the view keeps it alive)
    return {k: v.to(device) for k, v in _store.unit_views(entry, buffer).items()}


def _read_tensor(ranges: _chunks.RangeReader, entry: Any, key: str, device: torch.device
                 ) -> torch.Tensor:
    """One tensor of ``entry``'s blob, read from the store (its aligned bytes only) into new
    memory on ``device``."""
    te = next(t for t in entry.tensors if t.key == key)
    nbytes = _store.align_up(te.nbytes)
    buffer = _store.aligned_host_buffer(nbytes)
    ranges.read(entry, te.offset, nbytes, buffer)
    return buffer[:te.nbytes].view(te.dtype).view(te.shape).to(device, copy=True)


def _free(units: Sequence[Unit], modes: Sequence[str], entries: Sequence[Any],
          owner: Mapping[int, int], views: list, slot0: torch.Tensor,
          ranges: _chunks.RangeReader, device: torch.device, written: bool) -> None:
    """Free the resident copies: a ring unit's tensors on views of slot 0; a chunked head's
    weight and a gathered embedding's table on placeholders (its bias: read from the blob, kept
    resident); a resident unit as it is (loaded from its blob when the checkpoint went straight
    to the store)."""
    piece_of = {u: p for p, u in owner.items()}
    for unit, mode, entry in zip(units, modes, entries):
        if mode == "ring":
            _bind(unit, views[piece_of[unit.index]][0])
        elif mode in ("chunked", "gathered"):
            for ref in unit.tensors:  # a chunked head's bias [out] stays resident
                ref.point(_read_tensor(ranges, entry, ref.key, device) if ref.key == "bias"
                          else _chunks.placeholder(ref.current(), slot0))
        elif written:  # its tensors are placeholders: load them
            loaded = _read_blob(ranges, entry, device)
            _bind(unit, [loaded[r.key] for r in unit.tensors])


def _replace_forwards(units: Sequence[Unit], modes: Sequence[str], entries: Sequence[Any],
                      pieces: Sequence[Any], ring: Ring, views: list,
                      ranges: _chunks.RangeReader, device: torch.device) -> None:
    """Instance-level forwards (recorded) of the chunked heads and gathered embeddings."""
    for unit, mode, entry in zip(units, modes, entries):
        if mode == "chunked":
            mine = [p for p in pieces if p.blob is entry]
            bias = next((r.tensor for r in unit.tensors if r.key == "bias"), None)
            weight = next(t for t in entry.tensors if t.key == "weight")
            forward = _chunks.ChunkedLinear(ring, mine, lambda i, s: views[i][s][0], bias,
                                            weight.shape[0])
        elif mode == "gathered":
            weight = next(t for t in entry.tensors if t.key == "weight")
            forward = _chunks.GatheredEmbedding(ranges, entry, weight, device, ring.count_read)
        else:
            continue
        set_forward(unit.module, forward, f"offload {mode} forward of {unit.name}")


def _install_hooks(units: Sequence[Unit], ring: Ring) -> None:
    """Each unit's pre-forward hook acquires it, its post-forward hook (also after a failed
    forward) releases it; both recorded (undone at close). ``units``: the ring units, in ring
    order (``unit.piece``: its position in the ring)."""
    for unit in units:
        index = unit.piece

        def acquire(module, args, index=index):
            ring.acquire(index)

        def release(module, args, output, index=index):
            ring.release(index)
        add_hook(unit.module.register_forward_pre_hook(acquire),
                 f"offload pre-forward hook of {unit.name}")
        add_hook(unit.module.register_forward_hook(release, always_call=True),
                 f"offload post-forward hook of {unit.name}")


def _record_undo(units: Sequence[Unit], ring: Ring, views: list, modes: Sequence[str],
                 entries: Sequence[Any], owner: Mapping[int, int],
                 ranges: _chunks.RangeReader, device: torch.device) -> None:
    """Record in the active ledger: at close, read each streamed unit back into ordinary
    tensors on its device (a ring unit through the ring, then copied out of the slot; a chunked
    head chunk by chunk; a gathered table from its blob), before the older undos run; and close
    the ring whenever the model is given back (a failed init too)."""
    piece_of = {u: p for p, u in owner.items()}
    pieces = ring.entries

    def rebuild() -> None:
        done: set[int] = set()  # Parameters already read back (a tied table: once)
        with torch.no_grad():
            for unit, mode, entry in zip(units, modes, entries):
                if mode == "ring":
                    _read_back_ring(unit, ring, piece_of[unit.index])
                elif mode == "chunked":
                    _read_back_chunks(unit, entry, ring, views, pieces, device, done)
                elif mode == "gathered":
                    ref = unit.tensors[0]
                    if id(ref.tensor) not in done:
                        ref.point(_read_blob(ranges, entry, device)[ref.key].clone())
                        done.add(id(ref.tensor))
    streamed = sum(m != "resident" for m in modes)
    record(f"offloaded weights of {streamed} units (read back from the store)", rebuild)
    ledger = active()
    if ledger is not None:
        ledger.on_restore("close the offload ring", ring.close)


def _read_back_ring(unit: Unit, ring: Ring, piece: int) -> None:
    """A ring unit's tensors copied out of its slot into ordinary tensors."""
    ring.acquire(piece)
    try:
        for ref in unit.tensors:
            ref.point(ref.current().clone())
        for module in unit.repacked:
            module._packed = module.packed_view()
    finally:
        ring.release(piece)


def _read_back_chunks(unit: Unit, entry: Any, ring: Ring, views: list, pieces: Sequence[Any],
                      device: torch.device, done: set[int]) -> None:
    """A chunked head's weight assembled chunk by chunk through the ring (its bias is
    resident already)."""
    ref = next(r for r in unit.tensors if r.key == "weight")
    if id(ref.tensor) in done:
        return
    weight = next(t for t in entry.tensors if t.key == "weight")
    full = torch.empty(weight.shape, dtype=weight.dtype, device=device)  # [out, in]
    for piece in pieces:
        if piece.blob is not entry:
            continue
        s = ring.acquire(piece.index)
        try:
            full[piece.rows[0]:piece.rows[1]].copy_(views[piece.index][s][0])
        finally:
            ring.release(piece.index)
    ref.point(full)
    done.add(id(ref.tensor))


def _resident_bytes(model: nn.Module, streamed: set[int]) -> int:
    """Bytes of the model's parameters and buffers that are not streamed."""
    seen, total = set(), 0
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for t in table.values():
                if t is None or id(t) in seen or id(t) in streamed:
                    continue
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total

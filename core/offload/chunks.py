"""Units larger than a ring slot: the output head streamed in row chunks, the input embedding
read row by row.

The ring's slots are sized by the largest *decoder layer* (:func:`slot_bytes`), not by the
largest unit: a vocabulary-sized embedding or head (GPT-2 24l-1024h: 196 MiB against 48 MiB
layers) would otherwise make every slot four times larger than a layer needs. Each unit gets a
*mode* (:func:`plan_modes`):

* ``"ring"`` — streamed whole through the ring (every layer; an embedding or head that fits a
  slot, so small models are streamed exactly as before).
* ``"chunked"`` — an output head larger than a slot whose forward is ``nn.Linear``'s: its weight
  ``[out, in]`` is cut along dim 0 into ``k`` row ranges that each fit a slot; each range is a
  *piece* of the ring of its own (a byte range of the head's blob, read like a layer, so the
  chunks prefetch while the layers compute). The head module gets an instance-level ``forward``
  (:class:`ChunkedLinear`, recorded in the ledger: ``__call__`` and thus hooks such as the
  tensor-parallel all-gather still run) that acquires chunk after chunk and writes
  ``F.linear(x, w_k, b_k)`` into its slice of the logits: the same dot products as the
  unchunked head. A bias stays resident (``out`` elements: small). A quantized head (``QuantLinear``
  and kin: its forward is not ``nn.Linear``'s) is not chunked: it streams whole when it fits a
  slot, else it stays resident.
* ``"gathered"`` — an input embedding larger than a slot whose forward is ``nn.Embedding``'s and
  that has no ``max_norm`` (which rewrites the table while looking up): its ``forward``
  (:class:`GatheredEmbedding`) reads only the rows of the distinct ids it is given, from the
  embedding's own blob (the store holds a tied table in both units' blobs), in ``ALIGN``-aligned
  blocks (direct I/O where the store's reader uses it; adjacent blocks merged into one read).
  ``padding_idx``, ``scale_grad_by_freq`` and ``sparse`` only change gradients: the lookup is
  the same.
* ``"resident"`` — a unit larger than a slot that can be neither: its tensors stay in memory
  (counted in the report's ``resident_bytes``). A tensor shared by a resident unit and another
  unit (a tied embedding) keeps the other unit resident too. So does a unit whose module another
  module holds by plain reference (in its ``__dict__``, not as a child): that module reads the
  unit's tensors outside the unit's forward, when its slot holds some other unit — a quantized
  tied head, whose :class:`~shardwise.quant.tied.QuantEmbedding` looks up rows of the head's
  packed table before the first layer runs (:func:`read_outside`).

A streamed tensor not in any slot (a chunked or gathered weight) is pointed at a one-element
stride-0 view of slot 0: right shape and dtype, no memory of its own, contents meaningless
(like a ring unit's tensors outside its forward).
"""

from __future__ import annotations

import concurrent.futures
import errno
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .store import (ALIGN, TensorEntry, UnitEntry, _writable_view, align_up, aligned_host_buffer,
                    pread_exact, unit_filename)

#: the modes of a unit (module docstring)
MODES = ("ring", "chunked", "gathered", "resident")
#: threads reading a gathered embedding's row blocks at once. The rows are scattered 4 KiB
#: reads made while the ring's multi-MiB reads are in flight; one after another each waited
#: behind those (32 rows: ~100 ms on this VM's virtio disk with two ring reads streaming,
#: against ~10 ms with 8 at once: benchmarks/README.md, offload section)
ROW_THREADS = 16


# ----- pieces: what the ring streams -----------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """One thing the ring streams: a byte range of a unit's blob, laid out like a
    :class:`~shardwise.offload.store.UnitEntry` (``unit_views(piece, slot)`` works on it).

    Attributes:
        index: position in the ring's cyclic order.
        name: the unit's name, with the row range for a chunk (``"lm_head[0:8192]"``).
        blob: the unit whose blob holds it.
        offset: the range's first byte inside the blob (a multiple of ALIGN).
        nbytes: bytes read (a multiple of ALIGN).
        tensors: its tensors, offsets counted from ``offset``.
        rows: the row range ``(start, stop)`` of a chunk of a head's weight; None for a whole unit.
    """

    index: int
    name: str
    blob: UnitEntry
    offset: int
    nbytes: int
    tensors: tuple[TensorEntry, ...]
    rows: tuple[int, int] | None = None

    @property
    def whole(self) -> bool:
        """The piece is the whole blob (read as one unit)."""
        return self.offset == 0 and self.nbytes == self.blob.nbytes


def whole_piece(index: int, blob: UnitEntry) -> Piece:
    """The piece streaming all of ``blob``."""
    return Piece(index, blob.name, blob, 0, blob.nbytes, blob.tensors)


def row_multiple(row_bytes: int) -> int:
    """Rows per chunk must be a multiple of this for every chunk to start ALIGN-aligned."""
    return ALIGN // math.gcd(row_bytes, ALIGN)


def chunk_rows(weight: TensorEntry, slot: int) -> int:
    """Rows of ``weight`` [out, in] per chunk that fit ``slot`` bytes and keep every chunk's
    start ALIGN-aligned; 0 when not even one such group of rows fits."""
    row_bytes = weight.nbytes // weight.shape[0]
    m = row_multiple(row_bytes)
    return (slot // row_bytes) // m * m


def chunk_pieces(first: int, blob: UnitEntry, slot: int) -> list[Piece]:
    """The pieces of a chunked head's ``"weight"`` (ring positions from ``first``): as few row
    ranges of at most :func:`chunk_rows` rows as cover it, of balanced sizes (the last one may be
    shorter), each read as the aligned bytes holding it (the blob is ALIGN-padded after the
    tensor, so the last read stays inside it)."""
    weight = next(t for t in blob.tensors if t.key == "weight")
    out_rows, most = weight.shape[0], chunk_rows(weight, slot)
    row_bytes = weight.nbytes // out_rows
    rows = _balanced(out_rows, most, row_multiple(row_bytes))
    pieces = []
    for start in range(0, out_rows, rows):
        stop = min(start + rows, out_rows)
        shape = (stop - start, *weight.shape[1:])
        entry = TensorEntry("weight", weight.dtype, shape, 0, (stop - start) * row_bytes)
        pieces.append(Piece(first + len(pieces), f"{blob.name}[{start}:{stop}]", blob,
                            weight.offset + start * row_bytes, align_up(entry.nbytes), (entry,),
                            (start, stop)))
    return pieces


def _balanced(out_rows: int, most: int, m: int) -> int:
    """Rows per chunk: ``ceil(out_rows / k)`` rounded up to a multiple of ``m``, with ``k`` the
    fewest chunks of at most ``most`` rows (``most`` is a multiple of ``m``, so the result
    stays <= ``most``)."""
    chunks = math.ceil(out_rows / most)
    return math.ceil(math.ceil(out_rows / chunks) / m) * m


# ----- modes ------------------------------------------------------------------------------------


def _plain_forward(module: nn.Module, cls: type) -> bool:
    """``module`` is a ``cls`` whose forward is ``cls.forward`` (no subclass or instance
    override, which could compute something else from the weight)."""
    return (isinstance(module, cls) and type(module).forward is cls.forward
            and "forward" not in vars(module))


def can_gather(module: nn.Module, keys: Sequence[str], repacked: Sequence[nn.Module]) -> bool:
    """An embedding whose lookup :class:`GatheredEmbedding` computes exactly: a plain
    ``nn.Embedding`` without ``max_norm``, streaming only its 2-D ``weight``."""
    return (_plain_forward(module, nn.Embedding) and module.max_norm is None
            and list(keys) == ["weight"] and not repacked and module.weight.dim() == 2)


def can_chunk(module: nn.Module, keys: Sequence[str], repacked: Sequence[nn.Module],
              blob: UnitEntry, slot: int) -> bool:
    """A head :class:`ChunkedLinear` computes exactly: a plain ``nn.Linear`` streaming its 2-D
    ``weight`` (and ``bias``) whose rows fit a slot in aligned groups."""
    if not (_plain_forward(module, nn.Linear) and not repacked and "weight" in keys
            and set(keys) <= {"weight", "bias"}):
        return False
    weight = next(t for t in blob.tensors if t.key == "weight")
    return len(weight.shape) == 2 and chunk_rows(weight, slot) > 0


def slot_bytes(blobs: Sequence[UnitEntry], layer_indices: Sequence[int]) -> UnitEntry:
    """The unit the slots are sized by: the largest decoder layer (the largest unit when the
    model has no layer units)."""
    layers = [blobs[i] for i in layer_indices] or list(blobs)
    return max(layers, key=lambda e: e.nbytes)


def read_outside(model: nn.Module, units: Sequence[Any]) -> set[int]:
    """Indices of the units whose module some module of ``model`` holds by plain reference
    (an instance attribute that is no child module: e.g. ``QuantEmbedding.head``, the tied
    head whose packed table it reads rows of). Their tensors are read outside their own
    forward, so they must stay resident (module docstring)."""
    index = {id(u.module): i for i, u in enumerate(units)}
    found = set()
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, nn.Module) and id(value) in index:
                found.add(index[id(value)])
    return found


def plan_modes(units: Sequence[Any], blobs: Sequence[UnitEntry], slot: int,
               input_embedding: nn.Module | None, output_embedding: nn.Module | None,
               pinned: set[int] = frozenset()) -> list[str]:
    """Each unit's mode (module docstring). ``units``: the transform's units (``module``,
    ``tensors`` with ``key`` / ``tensor``, ``repacked``); ``blobs``: their layouts;
    ``pinned``: indices of units that stay resident whatever their size
    (:func:`read_outside`)."""
    modes = []
    for i, (unit, blob) in enumerate(zip(units, blobs)):
        keys = [r.key for r in unit.tensors]
        if i in pinned:
            modes.append("resident")
        elif blob.nbytes <= slot:
            modes.append("ring")
        elif unit.module is output_embedding and can_chunk(unit.module, keys, unit.repacked,
                                                          blob, slot):
            modes.append("chunked")
        elif unit.module is input_embedding and can_gather(unit.module, keys, unit.repacked):
            modes.append("gathered")
        else:
            modes.append("resident")
    return _resident_spreads(units, modes)


def _resident_spreads(units: Sequence[Any], modes: list[str]) -> list[str]:
    """A unit sharing a tensor with a resident unit is resident too (the shared tensor must stay
    real: a ring unit would rebind it, a chunked or gathered one would free it)."""
    changed = True
    while changed:
        changed = False
        kept = {id(r.tensor) for u, m in zip(units, modes) if m == "resident" for r in u.tensors}
        for i, unit in enumerate(units):
            if modes[i] != "resident" and any(id(r.tensor) in kept for r in unit.tensors):
                modes[i], changed = "resident", True
    return modes


# ----- reading byte ranges of blobs -------------------------------------------------------------


class RangeReader:
    """Reads byte ranges of a store's blobs into aligned host memory: the chunks of a head (on
    reader threads, for the ring) and the rows of a gathered embedding (on the calling thread).

    ``store`` is a :class:`~shardwise.offload.store.DiskStore` (files under ``store.path``, read
    with ``O_DIRECT`` when ``direct``; where the filesystem refuses it, buffered for good, with
    the reason in ``fallback_reason``) or a :class:`~shardwise.offload.store.MemoryStore` (the
    ``"cpu"`` tier: slices of its host buffers, nothing is read).
    """

    def __init__(self, store: Any, threads: int = 2, direct: bool = True) -> None:
        self.store = store
        self.on_disk = hasattr(store, "path")
        self.direct_io = bool(direct) and self.on_disk and hasattr(os, "O_DIRECT")
        self.fallback_reason: str | None = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads,
                                                           thread_name_prefix="shardwise-range")
        self._rows: concurrent.futures.ThreadPoolExecutor | None = None  # made on first use
        self._closed = False

    def path(self, blob: UnitEntry) -> Path:
        """The file of ``blob``."""
        return Path(self.store.path) / unit_filename(blob.index)

    def host(self, blob: UnitEntry, offset: int, nbytes: int) -> torch.Tensor | None:
        """For the ``"cpu"`` tier: the blob's bytes ``[offset, offset + nbytes)`` as a uint8 view
        of its host buffer (no copy); None on disk."""
        if self.on_disk:
            return None
        return self.store.buffer(blob)[offset:offset + nbytes]

    def read(self, blob: UnitEntry, offset: int, nbytes: int, dest: torch.Tensor) -> float:
        """Fill ``dest[:nbytes]`` with the blob's bytes ``[offset, offset + nbytes)``; the
        seconds it took. On disk ``offset``, ``nbytes`` and ``dest``'s address must be ALIGN
        multiples; an I/O error or short read raises ``OSError`` naming the file."""
        start = time.perf_counter()
        src = self.host(blob, offset, nbytes)
        if src is not None:
            dest[:nbytes].copy_(src)
            return time.perf_counter() - start
        path = self.path(blob)
        view = _writable_view(dest, nbytes)
        while True:
            direct = self.direct_io
            try:
                fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            except OSError as err:
                if direct and err.errno == errno.EINVAL:
                    self._fall_back(path, err)
                    continue
                raise OSError(err.errno, f"cannot open the blob of {blob.name!r}: "
                              f"{err.strerror}", str(path)) from err
            try:
                pread_exact(fd, view, nbytes, offset, path)
                return time.perf_counter() - start
            except OSError as err:
                if not (direct and err.errno == errno.EINVAL):
                    raise
                self._fall_back(path, err)
            finally:
                os.close(fd)

    def read_runs(self, blob: UnitEntry, runs: Sequence[tuple[int, int]],
                  dest: torch.Tensor) -> float:
        """Fill ``dest`` with the blob's byte ranges ``runs`` (``(start, stop)``, ALIGN-aligned)
        one after another, reading them concurrently (up to :data:`ROW_THREADS` at once); the
        wall seconds it took. After :meth:`close`, one after another on the calling thread.
        An I/O error raises ``OSError`` naming the file (the first one, once all are done)."""
        start = time.perf_counter()
        places, at = [], 0
        for a, b in runs:  # dest[at:at + b - a] <- bytes [a, b)
            places.append((a, b - a, at))
            at += b - a
        pool = self._row_pool() if len(places) > 1 and self.on_disk else None
        futures = []
        for a, n, at in places if pool is not None else ():
            try:
                futures.append(pool.submit(self.read, blob, a, n, dest[at:]))
            except RuntimeError:  # closed by another thread meanwhile: the rest on this one
                break
        for a, n, at in places[len(futures):]:
            self.read(blob, a, n, dest[at:])
        if futures:
            concurrent.futures.wait(futures)
            for f in futures:
                f.result()  # raises the first error
        return time.perf_counter() - start

    def _row_pool(self) -> concurrent.futures.ThreadPoolExecutor | None:
        """The row readers' pool (None once closed)."""
        with self._lock:
            if self._rows is None and not self._closed:
                self._rows = concurrent.futures.ThreadPoolExecutor(
                    ROW_THREADS, thread_name_prefix="shardwise-rows")
            return self._rows

    def _fall_back(self, path: Path, err: OSError) -> None:
        with self._lock:
            if self.direct_io:
                self.direct_io = False
                self.fallback_reason = (f"O_DIRECT failed on {path} ({err.strerror}); range "
                                        "reads go through the page cache")

    def submit(self, piece: Piece, dest: torch.Tensor) -> concurrent.futures.Future:
        """Read ``piece`` into ``dest`` (an aligned host slot) on a reader thread; the future's
        result is the seconds it took."""
        return self._pool.submit(self.read, piece.blob, piece.offset, piece.nbytes, dest)

    def close(self) -> None:
        """Wait for reads in flight and stop the threads (later row reads run on the caller)."""
        with self._lock:
            self._closed, rows, self._rows = True, self._rows, None
        self._pool.shutdown(wait=True)
        if rows is not None:
            rows.shutdown(wait=True)


class PieceReader:
    """The ring's reader of pieces: whole units through the store's
    :class:`~shardwise.offload.store.BlobReader` (``blobs``), byte ranges through a
    :class:`RangeReader` (``ranges``)."""

    def __init__(self, blobs: Any, ranges: RangeReader) -> None:
        self.blobs, self.ranges = blobs, ranges
        self.direct_io = blobs.direct_io
        self.fallback_reason = blobs.fallback_reason

    def submit(self, piece: Piece, dest: torch.Tensor) -> concurrent.futures.Future:
        if piece.whole:
            return self.blobs.submit(piece.blob, dest)
        return self.ranges.submit(piece, dest)

    def close(self) -> None:
        """Stop both readers' threads (a gathered embedding's synchronous reads still work)."""
        self.blobs.close()
        self.ranges.close()


# ----- the replaced forwards --------------------------------------------------------------------


class ChunkedLinear:
    """Instance-level ``forward`` of a chunked head: ``F.linear`` of each row chunk (acquired from
    the ring in turn: ring positions ``pieces``) into its slice of the output.

    ``views(piece_index, slot)`` returns the chunk's weight [rows, in] in that slot; ``bias``:
    the resident bias [out] or None; ``out_features``: the rows of the whole weight."""

    def __init__(self, ring: Any, pieces: Sequence[Piece],
                 views: Callable[[int, int], torch.Tensor], bias: torch.Tensor | None,
                 out_features: int) -> None:
        self.ring, self.pieces, self.views = ring, list(pieces), views
        self.bias, self.out_features = bias, out_features

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        # input [..., in] -> logits [..., out], one chunk [..., rows] at a time
        out = input.new_empty(*input.shape[:-1], self.out_features)
        for piece in self.pieces:
            start, stop = piece.rows
            s = self.ring.acquire(piece.index)
            try:
                bias = None if self.bias is None else self.bias[start:stop]
                out[..., start:stop] = F.linear(input, self.views(piece.index, s), bias)
            finally:
                self.ring.release(piece.index)
        return out

    def __repr__(self) -> str:
        return f"ChunkedLinear({len(self.pieces)} chunks of the ring)"


class GatheredEmbedding:
    """Instance-level ``forward`` of a gathered embedding: the rows of the distinct ids given,
    read from the embedding's blob (``reader``: a :class:`RangeReader`; ``weight``: the table's
    entry in ``blob``), looked up with ``F.embedding`` on ``device``. ``count(nbytes, seconds)``
    records each read in the ring's stats."""

    def __init__(self, reader: RangeReader, blob: UnitEntry, weight: TensorEntry,
                 device: torch.device, count: Callable[[int, float], None]) -> None:
        self.reader, self.blob, self.weight = reader, blob, weight
        self.device, self.count = device, count
        self.rows, self.dim = weight.shape
        self.row_bytes = weight.nbytes // self.rows

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        ids = input
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)  # sorted
        if unique.numel() and (unique[0] < 0 or unique[-1] >= self.rows):
            raise IndexError(f"index out of range in self: ids must lie in [0, {self.rows}), got "
                             f"{unique[0].item()}..{unique[-1].item()}")
        table = self.read_rows(unique.tolist()).to(self.device)  # [u, dim]
        return F.embedding(inverse.view(ids.shape).to(self.device), table)

    def read_rows(self, ids: Sequence[int]) -> torch.Tensor:
        """The rows ``ids`` (sorted, distinct) of the table: [len(ids), dim] in host memory."""
        dtype = self.weight.dtype
        first = self.weight.offset
        host = self.reader.host(self.blob, first, self.weight.nbytes)
        if host is not None:  # "cpu" tier: index the host buffer
            table = host.view(dtype).view(self.rows, self.dim)
            return table[torch.tensor(ids, dtype=torch.long)]
        runs = _runs([first + i * self.row_bytes for i in ids], self.row_bytes)
        total = sum(stop - start for start, stop in runs)
        scratch = aligned_host_buffer(max(total, ALIGN))
        # one aligned read per run of adjacent blocks, all at once; where: run start -> its
        # byte in scratch
        seconds = self.reader.read_runs(self.blob, runs, scratch)
        where, at = {}, 0
        for start, stop in runs:
            where[start] = at
            at += stop - start
        self.count(total, seconds)
        typed = scratch.view(dtype)
        elt = typed.element_size()
        out = torch.empty(len(ids), self.dim, dtype=dtype)
        run_starts = [s for s, _ in runs]
        r = 0
        for j, i in enumerate(ids):
            byte = first + i * self.row_bytes
            while r + 1 < len(runs) and runs[r + 1][0] <= byte:
                r += 1
            pos = (where[run_starts[r]] + byte - run_starts[r]) // elt
            out[j] = typed[pos:pos + self.dim]
        return out

    def __repr__(self) -> str:
        return f"GatheredEmbedding({self.rows} rows read on demand)"


def _runs(offsets: Sequence[int], nbytes: int) -> list[tuple[int, int]]:
    """The ALIGN-aligned byte ranges covering ``[o, o + nbytes)`` for each of ``offsets``
    (increasing), adjacent or overlapping ranges merged."""
    runs: list[list[int]] = []
    for o in offsets:
        start, stop = o // ALIGN * ALIGN, align_up(o + nbytes)
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], stop)
        else:
            runs.append([start, stop])
    return [(a, b) for a, b in runs]


def placeholder(like: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """A stride-0 view of ``slot``'s first element with ``like``'s shape and dtype: what a
    streamed tensor that is in no slot points at (no memory of its own)."""
    one = slot[:like.element_size()].view(like.dtype)  # [1]
    return one.view(*([1] * like.dim())).expand(like.shape) if like.dim() else one[0]

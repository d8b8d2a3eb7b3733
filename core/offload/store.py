"""Weight blobs for offloaded inference: aligned layout, files on disk, direct-I/O reader, probe.

A *unit* (an embedding, a decoder layer, the LM head) is streamed as one *blob*: its tensors
packed back to back, each at an offset that is a multiple of :data:`ALIGN`, zero padding in
between, the blob's length padded to ``ALIGN``. The same layout is used on disk (one file per
unit, read with ``O_DIRECT`` straight into an aligned host slot) and in host memory (the ``cpu``
tier), so a slot holding a unit's bytes is turned into the unit's tensors by zero-copy views
(:func:`unit_views`).

Pieces:

* :class:`TensorEntry` / :class:`UnitEntry` / :func:`layout_unit`: where each tensor lives in
  its blob (needs only dtypes and shapes, so ``meta`` tensors can be laid out).
* :func:`pack_into`, :func:`unit_views`, :func:`aligned_host_buffer`: bytes in and out of
  ALIGN-aligned host buffers.
* :class:`DiskStore`: one directory per fingerprint (model + settings) under the user's
  ``nvme_path`` (one subdirectory per rank of a sharded model); unit files are written to a
  temp name and renamed; the manifest is written last, atomically, so a store is either
  complete (manifest matches, every file full size) or unused.
  Sibling stores of other fingerprints are listed in ``stale`` and never read.
* :class:`BlobReader`: reader threads that fill host slots with ``os.preadv`` in chunks (the GIL
  is released during each read), with ``O_DIRECT`` where the filesystem allows it and a recorded
  fall back to buffered reads where it does not.
* :class:`MemoryStore`: the ``cpu`` tier, one (optionally pinned) host buffer per unit.
* :func:`read_probe`: the read bandwidth of a directory, measured with the reader's own method.

Only the standard library and torch are used.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import hashlib
import json
import math
import mmap
import os
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "MANIFEST",
    "BlobReader",
    "DiskStore",
    "MemoryStore",
    "TensorEntry",
    "UnitEntry",
    "align_up",
    "aligned_host_buffer",
    "registered_host_buffer",
    "content_digest",
    "fingerprint_key",
    "layout_unit",
    "pack_into",
    "read_probe",
    "required_bytes",
    "unit_filename",
    "unit_views",
]

ALIGN = 4096  # bytes: every tensor offset, blob length and host buffer address
FORMAT_VERSION = 1  # bump when the blob layout or the manifest's shape changes
MANIFEST = "manifest.json"  # written last: its presence (and content) marks a finished store
MARKER = "STORE.json"  # written first: marks a directory as a store (finished or not)
CHUNK = 8 << 20  # bytes per preadv/write call: big enough for full disk speed, small enough
#                  that several reader threads interleave

# dtype name in the manifest ("bfloat16") -> torch dtype; every dtype this torch knows.
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype)
}


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def unit_filename(index: int) -> str:
    """The file name of unit ``index``'s blob inside a store directory."""
    return f"unit-{index:05d}.bin"


# --------------------------------------------------------------------------------------------
# Layout


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a unit lives inside the unit's blob.

    Attributes:
        key: path of the tensor inside the unit (``"mlp.down_proj.weight"``).
        dtype: the tensor's dtype.
        shape: the tensor's shape (``()`` for a 0-dim tensor).
        offset: bytes from the blob's start; a multiple of :data:`ALIGN`.
        nbytes: the tensor's bytes (``numel * element_size``), unpadded.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> dict:
        """A JSON-able dict (dtype by name, shape as a list)."""
        return {
            "key": self.key,
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TensorEntry":
        """The inverse of :meth:`to_json`; an unknown dtype name raises ``ValueError``."""
        name = d["dtype"]
        if name not in _DTYPES:
            raise ValueError(
                f"the store manifest names dtype {name!r}, which this torch does not know; "
                "delete the store directory so the weights are repacked"
            )
        return cls(
            key=str(d["key"]),
            dtype=_DTYPES[name],
            shape=tuple(int(s) for s in d["shape"]),
            offset=int(d["offset"]),
            nbytes=int(d["nbytes"]),
        )


@dataclass(frozen=True)
class UnitEntry:
    """The layout of one unit's blob.

    Attributes:
        index: the unit's position in execution order (also names its file).
        name: the unit module's qualified name (``"model.layers.3"``).
        nbytes: the blob's length in bytes, padded to :data:`ALIGN`.
        tensors: the unit's tensors in blob order (increasing offsets).
    """

    index: int
    name: str
    nbytes: int
    tensors: tuple[TensorEntry, ...]

    def to_json(self) -> dict:
        """A JSON-able dict; ``UnitEntry.from_json(e.to_json()) == e``."""
        return {
            "index": self.index,
            "name": self.name,
            "nbytes": self.nbytes,
            "tensors": [t.to_json() for t in self.tensors],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "UnitEntry":
        """The inverse of :meth:`to_json`."""
        return cls(
            index=int(d["index"]),
            name=str(d["name"]),
            nbytes=int(d["nbytes"]),
            tensors=tuple(TensorEntry.from_json(t) for t in d["tensors"]),
        )


def _tensor_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements (works for ``meta`` tensors: only dtype and shape are read)."""
    return t.numel() * t.element_size()


def layout_unit(index: int, name: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> UnitEntry:
    """Lay out a unit's tensors in a blob: each at the next ALIGN multiple, in the given order.

    Args:
        index: the unit's position in execution order.
        name: the unit module's qualified name.
        tensors: ``(key, tensor)`` pairs; only dtype and shape are read, so ``meta`` tensors
            (a checkpoint not yet loaded) are fine. Keys must be distinct.

    Returns:
        The :class:`UnitEntry`; its ``nbytes`` is the end of the last tensor rounded up to ALIGN.

    Raises:
        ValueError: a key appears twice, or a tensor is not a plain strided tensor.
    """
    entries, offset, seen = [], 0, set()
    for key, t in tensors:
        if key in seen:
            raise ValueError(f"unit {name!r}: tensor key {key!r} appears twice; keys must be "
                             "distinct")
        if t.layout != torch.strided:
            raise ValueError(f"unit {name!r}: tensor {key!r} has layout {t.layout}; only dense "
                             "(strided) tensors can be streamed")
        seen.add(key)
        nbytes = _tensor_nbytes(t)
        entries.append(TensorEntry(key, t.dtype, tuple(t.shape), offset, nbytes))
        offset = align_up(offset + nbytes)
    return UnitEntry(index, name, offset, tuple(entries))


def required_bytes(units: Sequence[UnitEntry]) -> int:
    """Disk bytes a :class:`DiskStore` of ``units`` needs: the blobs plus a block per file and
    the manifest (a safe bound for the free-space check made before writing anything)."""
    return sum(u.nbytes for u in units) + ALIGN * (len(units) + 2) + (64 << 10)


# --------------------------------------------------------------------------------------------
# Host buffers


def _check_host_buffer(buffer: torch.Tensor, nbytes: int, what: str) -> None:
    """Raise ``ValueError`` unless ``buffer`` is a contiguous 1-D uint8 host tensor of >= nbytes."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"{what}: the buffer must be a contiguous 1-D uint8 tensor, got "
                         f"{buffer.dtype} of shape {tuple(buffer.shape)}")
    if buffer.numel() < nbytes:
        raise ValueError(f"{what}: the buffer holds {buffer.numel()} bytes, the unit needs "
                         f"{nbytes}; allocate slots of the largest unit's nbytes")


def unit_views(entry: UnitEntry, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Typed, shaped, zero-copy views of a unit's tensors inside ``buffer``.

    Args:
        entry: the unit's layout.
        buffer: a contiguous 1-D uint8 tensor of at least ``entry.nbytes`` bytes (on any device)
            holding the blob from its first byte.

    Returns:
        ``key -> tensor`` sharing ``buffer``'s memory (writing to a view writes the buffer).
    """
    _check_host_buffer(buffer, entry.nbytes, f"views of unit {entry.name!r}")
    views = {}
    for t in entry.tensors:
        raw = buffer[t.offset:t.offset + t.nbytes]  # uint8 [nbytes]
        views[t.key] = raw.view(t.dtype).view(t.shape)
    return views


def _check_tensors(entry: UnitEntry, tensors: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless ``tensors`` match ``entry``'s count, dtypes and shapes and hold
    data (not meta)."""
    if len(tensors) != len(entry.tensors):
        raise ValueError(f"unit {entry.name!r}: {len(tensors)} tensors given, the layout has "
                         f"{len(entry.tensors)}")
    for te, value in zip(entry.tensors, tensors):
        if value.dtype != te.dtype or tuple(value.shape) != te.shape:
            raise ValueError(f"unit {entry.name!r}: tensor {te.key!r} is {value.dtype} "
                             f"{tuple(value.shape)}, the layout says {te.dtype} {te.shape}")
        if value.is_meta:
            raise ValueError(f"unit {entry.name!r}: tensor {te.key!r} is on the meta device "
                             "(no data); load it before packing")


def pack_into(entry: UnitEntry, tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
    """Copy a unit's tensors into ``buffer`` in ``entry``'s layout, zeroing the padding.

    Args:
        entry: the unit's layout (from :func:`layout_unit`).
        tensors: the values, in ``entry.tensors`` order; any device and strides, dtype and shape
            must match the entry.
        buffer: a contiguous 1-D uint8 tensor of at least ``entry.nbytes`` bytes. Only the first
            ``entry.nbytes`` bytes are written.

    Raises:
        ValueError: count, dtype or shape differ from the entry, or the buffer is too small.
    """
    _check_tensors(entry, tensors)
    views = unit_views(entry, buffer)
    end = 0  # end of the previous tensor's bytes: [end, offset) is padding
    for te, value in zip(entry.tensors, tensors):
        buffer[end:te.offset].zero_()
        views[te.key].copy_(value.detach())
        end = te.offset + te.nbytes
    buffer[end:entry.nbytes].zero_()


def _hugepage_hint(m: mmap.mmap) -> None:
    """Ask for transparent huge pages on a big buffer (fewer page faults); a hint only."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and len(m) >= (2 << 20):
        try:
            m.madvise(advice)
        except OSError:
            pass  # THP disabled: ordinary pages work the same


def _mmap_address(m: mmap.mmap) -> int:
    """The address of an mmap's first byte (the temporary buffer export is released at once,
    so the mmap can still be closed later)."""
    first = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(first)
    finally:
        del first


def _unregister(runtime: Any, address: int, m: mmap.mmap) -> None:
    """Undo :func:`registered_host_buffer`: unpin the pages, then unmap them (in that order)."""
    runtime.cudaHostUnregister(address)
    m.close()


def registered_host_buffer(size: int, runtime: Any) -> torch.Tensor:
    """An exact-size page-locked uint8 [size] tensor: an anonymous mmap registered with a
    runtime that has CUDA's host-registration API (``cudaHostRegister`` /
    ``cudaHostUnregister`` / ``cudaError.success``: ``torch.cuda.cudart()``, ROCm through the
    same names), unregistered when the tensor is freed. Page-aligned; zero-filled.

    Raises:
        RuntimeError: the runtime refused (locked-memory limit or host memory too small).
    """
    m = mmap.mmap(-1, max(size, ALIGN))
    _hugepage_hint(m)
    address = _mmap_address(m)
    status = runtime.cudaHostRegister(address, size, 0)
    if status != runtime.cudaError.success:
        m.close()
        raise RuntimeError(f"could not pin {size} bytes of host memory ({status}): the locked-"
                           "memory limit (ulimit -l) or host memory is too small; pass "
                           "pin_memory=False to stream from pageable memory")
    holder = (ctypes.c_ubyte * size).from_address(address)  # a buffer torch.frombuffer can hold
    weakref.finalize(holder, _unregister, runtime, address, m)  # keeps m mapped until then
    return torch.frombuffer(holder, dtype=torch.uint8)


#: what pins host memory for a device: ``Accelerator.pinned_host_buffer`` (None: do not pin)
Pinner = Callable[[int], "torch.Tensor | None"]


def aligned_host_buffer(nbytes: int, pinned: Pinner | None = None) -> torch.Tensor:
    """A zeroed uint8 host tensor whose address and length are multiples of :data:`ALIGN`.

    Without ``pinned`` (or where it returns None: a device that computes in host memory), the
    memory is an anonymous ``mmap``: page-aligned, zero-filled lazily, and returned to the OS
    when the tensor is freed (``torch.frombuffer`` keeps the mmap alive as long as the tensor).

    With ``pinned`` — the engine's ``accelerator.pinned_host_buffer`` — the memory is
    page-locked the accelerator's way, so host-to-device copies from it run asynchronously at
    full speed. The exact size is asked for first; only a block that comes back at an address
    that is not a multiple of ALIGN is given back and asked for again ALIGN bytes larger, then
    sliced (pinned memory is scarce, and an allocator that rounds blocks up to a power of two
    would double a power-of-two request padded by one page).

    Args:
        nbytes: the bytes needed; the tensor's length is ``align_up(nbytes)``.
        pinned: the accelerator's pinned-buffer factory, or None.

    Returns:
        uint8 [align_up(nbytes)], ``data_ptr() % ALIGN == 0``, zero-filled, writable.

    Raises:
        ValueError: ``nbytes`` < 0.
        RuntimeError: pinning was refused by the runtime (locked-memory limit).
    """
    if nbytes < 0:
        raise ValueError(f"aligned_host_buffer: nbytes must be >= 0, got {nbytes}")
    size = align_up(nbytes)
    raw = pinned(size) if pinned is not None else None
    if raw is not None:
        if raw.data_ptr() % ALIGN:  # rare: mmap-backed and caching allocators align pages
            del raw
            raw = pinned(size + ALIGN)
        skip = (-raw.data_ptr()) % ALIGN
        return raw[skip:skip + size].zero_()
    m = mmap.mmap(-1, max(size, ALIGN))  # anonymous: page-aligned, zero-filled
    _hugepage_hint(m)
    return torch.frombuffer(m, dtype=torch.uint8)[:size]


def _writable_view(buffer: torch.Tensor, nbytes: int) -> memoryview:
    """A writable byte memoryview of the first ``nbytes`` of a contiguous host uint8 tensor.

    The view does not own the memory: the caller keeps ``buffer`` alive while it is used.
    """
    if nbytes == 0:
        return memoryview(bytearray(0))
    array = (ctypes.c_ubyte * nbytes).from_address(buffer.data_ptr())
    return memoryview(array).cast("B")


# --------------------------------------------------------------------------------------------
# Fingerprints


def content_digest(tensors: Iterable[torch.Tensor], samples: int = 64) -> str:
    """A cheap digest of tensors' contents: dtypes, shapes and up to ``samples`` evenly spaced
    elements of each (plus the first and last).

    Meant for the store fingerprint: it tells apart two models (or two quantizations) with the
    same architecture without reading every byte. It is not a cryptographic hash of the
    contents: weights that differ only in unsampled elements give the same digest.
    """
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        if t.is_meta or t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        n = min(samples, flat.numel())  # integer spacing: float32 steps overrun past 2**24
        idx = torch.arange(n + 1, device=flat.device) * (flat.numel() - 1) // n
        picked = flat[idx].cpu().contiguous()
        h.update(bytes(picked.view(torch.uint8).tolist()))
    return h.hexdigest()[:32]


def _canonical(fingerprint: Mapping[str, Any]) -> str:
    """The fingerprint as canonical JSON (sorted keys; non-JSON values such as dtypes by str)."""
    return json.dumps(fingerprint, sort_keys=True, separators=(",", ":"), default=str)


def fingerprint_key(fingerprint: Mapping[str, Any]) -> str:
    """A stable 16-hex-digit key of a fingerprint (names the store's directory)."""
    return hashlib.sha256(_canonical(fingerprint).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Disk store


def _fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory, fsync, rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _write_all(fd: int, view: memoryview) -> None:
    """Write every byte of ``view`` to ``fd`` in CHUNK pieces (os.write may write less)."""
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:done + CHUNK])


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as a memoryview of host memory (copied to the host only when it is
    elsewhere; a non-contiguous tensor is made contiguous)."""
    flat = t.detach().reshape(-1).cpu()  # .cpu(): the tensor itself when already there
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write every byte of ``view`` at ``offset`` in CHUNK pieces (os.pwrite may write less)."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + CHUNK], offset + done)


def pread_exact(fd: int, view: memoryview, nbytes: int, offset: int, path: str | Path, *,
                einval_as_is: bool = True) -> None:
    """Fill ``view[:nbytes]`` from the file at ``offset`` in CHUNK pieces (``os.preadv``
    releases the GIL). A short read is an OSError naming the file; any other error is re-raised
    naming the file and the byte, except EINVAL with ``einval_as_is`` (O_DIRECT refused: the
    caller falls back to buffered reads)."""
    done = 0
    while done < nbytes:
        try:
            n = os.preadv(fd, [view[done:min(done + CHUNK, nbytes)]], offset + done)
        except OSError as err:
            if einval_as_is and err.errno == errno.EINVAL:
                raise
            raise OSError(err.errno, f"reading at byte {offset + done}: {err.strerror}",
                          str(path)) from err
        if n <= 0:
            raise OSError(errno.EIO, f"short read: the file ended before byte "
                          f"{offset + nbytes}", str(path))
        done += n


def _drop_cache(fd: int) -> None:
    """Drop a file's pages from the page cache (a hint; ignored where unsupported)."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def _read_manifest(path: Path) -> dict | None:
    """The parsed manifest at ``path``, or None when it is missing or not valid JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _is_store(d: Path) -> bool:
    """Whether ``d`` is a store directory (marker or manifest), or a group of shard stores."""
    def marked(p: Path) -> bool:
        return (p / MANIFEST).exists() or (p / MARKER).exists()
    return d.is_dir() and (marked(d) or any(marked(s) for s in d.glob("shard-*")))


class DiskStore:
    """The ``nvme`` tier: one blob file per unit under ``root / fingerprint_key(fingerprint)``.

    Constructing a store writes nothing (the free-space check runs before any write). Write with
    :meth:`write_unit` for every unit, then :meth:`finish`; next time, :meth:`complete` says
    whether the files can be reused as they are.

    Ranks of one sharded model (tensor / expert parallel) pass the same ``fingerprint`` (what
    all shards share: model, dtype, quant, TP *size* ...) and their own ``shard`` (their
    coordinates): each gets ``root / fingerprint_key(fingerprint) / "shard-<key of shard>"``,
    and the other ranks' stores are siblings of the same model, not stale.

    Attributes:
        root: the user's ``nvme_path``.
        fingerprint: what the blobs depend on (model identity, dtype, quant, ...), as JSON.
        shard: this rank's coordinates (JSON), or None for an unsharded store.
        group: ``root / fingerprint_key(fingerprint)``: this model's directory.
        path: the directory holding the blobs: ``group``, or ``group / "shard-<key>"``.
        stale: directories under ``root`` holding stores of other fingerprints (a model or
            settings since changed). They are listed so the caller can report them; they are
            never read.

    Not thread-safe for writing: write units from one thread.
    """

    def __init__(self, root: str | Path, fingerprint: Mapping[str, Any],
                 shard: Mapping[str, Any] | None = None) -> None:
        self.root = Path(root)
        self.fingerprint = json.loads(_canonical(fingerprint))  # as it reads back from JSON
        self.shard = None if shard is None else json.loads(_canonical(shard))
        self.group = self.root / fingerprint_key(fingerprint)
        self.path = self.group if shard is None else self.group / f"shard-{fingerprint_key(shard)}"
        self.stale = self._find_stale()
        self._invalidated = False

    def _find_stale(self) -> list[Path]:
        """Directories under ``root`` other than ``group`` that are stores (or shard groups)."""
        if not self.root.is_dir():
            return []
        return sorted(d for d in self.root.iterdir() if d != self.group and _is_store(d))

    def _identity(self) -> dict:
        """What the marker and manifest record, and :meth:`complete` compares."""
        return {"format": FORMAT_VERSION, "fingerprint": self.fingerprint, "shard": self.shard}

    def unit_path(self, entry: UnitEntry) -> Path:
        """The blob file of ``entry``."""
        return self.path / unit_filename(entry.index)

    def complete(self, units: Sequence[UnitEntry]) -> bool:
        """True when the store holds exactly ``units``: a manifest of this format version with
        this fingerprint and these entries, and every unit file of its full size."""
        manifest = _read_manifest(self.path / MANIFEST)
        if manifest is None:
            return False
        if not isinstance(manifest, dict):
            return False
        identity = {k: manifest.get(k) for k in ("format", "fingerprint", "shard")}
        if identity != self._identity() or manifest.get("units") != [u.to_json() for u in units]:
            return False
        return all(self._file_size(u) == u.nbytes for u in units)

    def _file_size(self, entry: UnitEntry) -> int:
        """The size of ``entry``'s file, -1 when it does not exist."""
        try:
            return self.unit_path(entry).stat().st_size
        except FileNotFoundError:
            return -1

    def _prepare(self) -> None:
        """Create the directory with its marker, remove an old manifest (a half-rewritten store
        must never look complete) and temp files left by an interrupted write; once, before the
        first unit is written."""
        if self._invalidated:
            return
        if not self.root.is_dir():
            raise FileNotFoundError(errno.ENOENT, "the offload directory (nvme_path) does not "
                                    "exist; create it or pass another nvme_path", str(self.root))
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / MANIFEST).unlink(missing_ok=True)
        for leftover in self.path.glob(".*.tmp"):  # from a write that was interrupted
            leftover.unlink(missing_ok=True)
        _write_atomic(self.path / MARKER, _canonical(self._identity()).encode())
        self._invalidated = True

    def write_unit(self, entry: UnitEntry, tensors: Sequence[torch.Tensor]) -> None:
        """Write one unit's blob from its tensors, each at its offset in ``entry``'s layout,
        straight from the tensor's memory (no staging copy of the unit: a 200 MB embedding
        would otherwise be held twice while it is written); the padding is the file's zero
        holes. Then fsynced, renamed into place and dropped from the page cache, as
        :meth:`write_packed`.

        Args:
            entry: the unit's layout.
            tensors: its values in ``entry.tensors`` order (any device; one at a time is copied
                to the host when it is not there).
        """
        _check_tensors(entry, tensors)

        def fill(fd: int) -> None:
            os.ftruncate(fd, entry.nbytes)  # zero-filled: the alignment padding
            for spec, t in zip(entry.tensors, tensors):
                _pwrite_all(fd, _host_bytes(t), spec.offset)
        self._replace_unit_file(entry, fill)

    def write_packed(self, entry: UnitEntry, buffer: torch.Tensor) -> None:
        """Write one unit's blob from a host buffer already in its layout (e.g. filled tensor by
        tensor through :func:`unit_views` while a checkpoint streams in): written to a temp file
        in the store directory, fsynced, renamed into place, and dropped from the page cache
        (the store may be larger than RAM).

        Args:
            entry: the unit's layout.
            buffer: a contiguous 1-D uint8 host tensor whose first ``entry.nbytes`` bytes are
                the blob (padding included: zero it, as :func:`pack_into` does).
        """
        _check_host_buffer(buffer, entry.nbytes, f"writing unit {entry.name!r}")
        if buffer.device.type != "cpu":
            raise ValueError(f"writing unit {entry.name!r}: the buffer must be in host memory, "
                             f"got device {buffer.device}")
        self._replace_unit_file(
            entry, lambda fd: _write_all(fd, _writable_view(buffer, entry.nbytes)))

    def _replace_unit_file(self, entry: UnitEntry, fill: Callable[[int], None]) -> None:
        """``fill(fd)`` writes the unit's bytes into a temp file in the store directory, which
        is then fsynced, dropped from the page cache (the store may be larger than RAM) and
        renamed into place: a unit file is whole or absent."""
        self._prepare()
        target = self.unit_path(entry)
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=f".{target.name}.", suffix=".tmp")
        try:
            fill(fd)
            os.fsync(fd)
            _drop_cache(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, target)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            Path(tmp).unlink(missing_ok=True)
            raise

    def finish(self, units: Sequence[UnitEntry]) -> None:
        """Write the manifest (format version, fingerprint, every unit's entry), atomically and
        last: from then on :meth:`complete` is True for ``units``.

        Raises:
            OSError: a unit's file is missing or not of its full size (named).
        """
        for u in units:
            size = self._file_size(u)
            if size != u.nbytes:
                raise OSError(errno.EIO, f"unit {u.name!r} was not fully written ({size} of "
                              f"{u.nbytes} bytes); write it before finish()",
                              str(self.unit_path(u)))
        manifest = {**self._identity(), "units": [u.to_json() for u in units]}
        _write_atomic(self.path / MANIFEST, json.dumps(manifest, indent=1).encode())

    def reader(self, threads: int = 2, direct: bool = True) -> "BlobReader":
        """A :class:`BlobReader` of this store's files (``direct``: try ``O_DIRECT`` first).

        Where a unit file already exists, whether ``O_DIRECT`` works is probed now, so the
        reader's ``direct_io`` / ``fallback_reason`` are final when it is returned.
        """
        reader = BlobReader(self.path, threads=threads, direct=direct)
        files = sorted(self.path.glob("unit-*.bin")) if self.path.is_dir() else []
        if files:
            reader.probe(files[0])
        return reader


# --------------------------------------------------------------------------------------------
# Reader


class BlobReader:
    """Reader threads that fill host buffers with unit blobs from a store directory.

    Each read opens the unit's file (``O_DIRECT`` when ``direct_io``), checks its size, and
    reads it with ``os.preadv`` in CHUNK pieces straight into the destination buffer; the GIL is
    released during each call, so ``threads`` reads run at once. Where the filesystem refuses
    ``O_DIRECT`` (``EINVAL`` at open or at the first read, e.g. tmpfs), the reader switches to
    buffered reads for good and records why in ``fallback_reason``.

    Attributes:
        directory: the store directory (files named by :func:`unit_filename`).
        threads: reader threads (reads in flight at once).
        direct_io: whether reads bypass the page cache (False after a fall back, or if asked).
        fallback_reason: why direct I/O is not used (None while it is, or when not asked for).
    """

    def __init__(self, directory: str | Path, threads: int = 2, direct: bool = True) -> None:
        if threads < 1:
            raise ValueError(f"BlobReader: threads must be >= 1, got {threads}")
        self.directory = Path(directory)
        self.threads = threads
        self.direct_io = bool(direct) and hasattr(os, "O_DIRECT")
        self.fallback_reason: str | None = None
        if direct and not hasattr(os, "O_DIRECT"):
            self.fallback_reason = "this platform has no O_DIRECT"
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="shardwise-read")

    def path(self, entry: UnitEntry) -> Path:
        """The file holding ``entry``'s blob."""
        return self.directory / unit_filename(entry.index)

    def _fall_back(self, path: Path, err: OSError, where: str) -> None:
        """Switch to buffered reads for good, recording why."""
        with self._lock:
            if self.direct_io:
                self.direct_io = False
                self.fallback_reason = (f"O_DIRECT {where} failed on {path} ({err.strerror}): the "
                                        f"filesystem refuses direct I/O with {ALIGN}-byte "
                                        "alignment; reads go through the page cache")

    def _open(self, path: Path) -> tuple[int, bool]:
        """Open ``path`` for reading: ``(fd, direct)``; falls back on EINVAL from O_DIRECT."""
        if self.direct_io:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self._fall_back(path, err, "open")
        return os.open(path, os.O_RDONLY), False

    def probe(self, path: str | Path) -> None:
        """Settle ``direct_io`` now by reading the first ALIGN bytes of ``path`` (an existing
        blob file) the way a unit is read; an I/O error other than a refused O_DIRECT raises."""
        path = Path(path)
        if self.direct_io and path.stat().st_size >= ALIGN:
            buf = aligned_host_buffer(ALIGN)
            self._read_file(path, _writable_view(buf, ALIGN), ALIGN, f"probe of {path.name}")

    def submit(self, entry: UnitEntry, dest: torch.Tensor) -> concurrent.futures.Future:
        """Read ``entry``'s blob into ``dest[:entry.nbytes]`` on a reader thread.

        Args:
            entry: the unit's layout (its file is ``path(entry)``).
            dest: a contiguous 1-D uint8 CPU tensor of >= ``entry.nbytes`` bytes whose address
                is a multiple of ALIGN (an :func:`aligned_host_buffer`); kept alive by the
                reader until the read is done.

        Returns:
            A future whose result is the seconds the read took. It raises ``OSError`` naming
            the file on an I/O error, a missing file, or a file shorter than the blob.

        Raises:
            ValueError: ``dest`` is not such a tensor (checked before anything is queued).
        """
        _check_host_buffer(dest, entry.nbytes, f"reading unit {entry.name!r}")
        if dest.device.type != "cpu" or dest.data_ptr() % ALIGN:
            raise ValueError(f"reading unit {entry.name!r}: the destination must be host memory "
                             f"at an address that is a multiple of {ALIGN} (got device "
                             f"{dest.device}, address % {ALIGN} = {dest.data_ptr() % ALIGN}); "
                             "use aligned_host_buffer()")
        return self._pool.submit(self._read, entry, dest)

    def _read(self, entry: UnitEntry, dest: torch.Tensor) -> float:
        """Read one blob (on a reader thread); the seconds it took."""
        start = time.perf_counter()
        view = _writable_view(dest, entry.nbytes)  # dest stays alive: the future's call holds it
        self._read_file(self.path(entry), view, entry.nbytes, f"the blob of unit {entry.name!r}")
        return time.perf_counter() - start

    def _read_file(self, path: Path, view: memoryview, nbytes: int, what: str) -> None:
        """Fill ``view[:nbytes]`` from ``path``'s start; directly if allowed, and once more
        buffered when the first direct read is refused with EINVAL."""
        while True:
            fd, direct = self._open_checked(path, nbytes, what)
            try:
                self._read_range(fd, direct, path, view, nbytes)
                return
            except OSError as err:
                if not (direct and err.errno == errno.EINVAL):
                    raise
                self._fall_back(path, err, "read")  # direct_io is False now: next try is buffered
            finally:
                os.close(fd)

    def _open_checked(self, path: Path, nbytes: int, what: str) -> tuple[int, bool]:
        """Open ``path`` and check it holds ``nbytes``; OSError naming the file if not."""
        try:
            fd, direct = self._open(path)
        except OSError as err:
            raise OSError(err.errno, f"cannot open {what}: {err.strerror}", str(path)) from err
        size = os.fstat(fd).st_size
        if size < nbytes:
            os.close(fd)
            raise OSError(errno.EIO, f"{what} is {size} bytes, its layout needs {nbytes}: the "
                          f"store is damaged; delete {self.directory} so the weights are "
                          "repacked", str(path))
        return fd, direct

    def _read_range(self, fd: int, direct: bool, path: Path, view: memoryview, nbytes: int) -> None:
        """Fill ``view[:nbytes]`` from the file's start in CHUNK pieces; OSError on a short read.

        An EINVAL from O_DIRECT is re-raised as is (the caller falls back); any other error is
        re-raised naming the file.
        """
        if not direct:
            _advise_sequential(fd)
        pread_exact(fd, view, nbytes, 0, path, einval_as_is=direct)
        if not direct:
            _drop_cache(fd)

    def close(self) -> None:
        """Wait for reads in flight and stop the threads."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "BlobReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _advise_sequential(fd: int) -> None:
    """Tell the kernel a buffered read is sequential (larger read-ahead); a hint only."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except (AttributeError, OSError):
        pass


# --------------------------------------------------------------------------------------------
# Memory store


class MemoryStore:
    """The ``cpu`` tier: each unit's blob in its own ALIGN-aligned host buffer.

    With ``pinned`` (the accelerator's ``pinned_host_buffer``) the buffers are page-locked, so
    copies into device slots on a copy stream run asynchronously at full bandwidth; see
    :func:`aligned_host_buffer`.

    Attributes:
        pinned: the pinned-buffer factory, or None (pageable buffers).
    """

    def __init__(self, pinned: Pinner | None = None) -> None:
        self.pinned = pinned
        self._buffers: dict[int, torch.Tensor] = {}

    def write_unit(self, entry: UnitEntry, tensors: Sequence[torch.Tensor]) -> None:
        """Pack one unit's tensors into a new host buffer (replacing any earlier one)."""
        buf = aligned_host_buffer(entry.nbytes, self.pinned)
        pack_into(entry, tensors, buf)
        self._buffers[entry.index] = buf

    def buffer(self, entry: UnitEntry) -> torch.Tensor:
        """The uint8 [align_up(entry.nbytes)] host buffer holding ``entry``'s blob."""
        try:
            return self._buffers[entry.index]
        except KeyError:
            raise KeyError(f"unit {entry.name!r} (index {entry.index}) was never written to "
                           "this MemoryStore; call write_unit first") from None

    @property
    def nbytes(self) -> int:
        """Host bytes held by the store's buffers."""
        return sum(b.numel() for b in self._buffers.values())


# --------------------------------------------------------------------------------------------
# Read probe


def _write_probe_file(path: Path, nbytes: int, chunk: torch.Tensor) -> None:
    """Write ``nbytes`` of fresh random bytes (nothing a disk could compress or dedupe) to
    ``path``, fsync, and drop it from the page cache."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        done = 0
        while done < nbytes:
            n = min(chunk.numel(), nbytes - done)
            chunk[:n].random_(0, 256)
            done += os.write(fd, _writable_view(chunk, n))
        os.fsync(fd)
        _drop_cache(fd)
    finally:
        os.close(fd)


def read_probe(directory: str | Path, nbytes: int = 256 << 20, direct: bool = True,
               threads: int = 2) -> dict:
    """Measure the read bandwidth of ``directory`` the way a :class:`BlobReader` reads it.

    Writes ``nbytes`` (rounded up to ALIGN) of random bytes as ``2 * threads`` blob files in a
    temporary subdirectory, drops them from the page cache (``posix_fadvise DONTNEED``), reads
    them back concurrently with a ``BlobReader`` of ``threads`` threads into one aligned host
    buffer, and deletes them.

    Returns:
        ``{"gbps": GB/s (1e9 bytes), "direct_io": whether the reads bypassed the page cache,
        "fallback_reason": why not (or None), "nbytes": bytes read, "seconds": wall time}``.
    """
    if nbytes < 1 or threads < 1:
        raise ValueError(f"read_probe: nbytes and threads must be >= 1, got {nbytes} and "
                         f"{threads}")
    if not Path(directory).is_dir():
        raise FileNotFoundError(errno.ENOENT, "read_probe: no such directory", str(directory))
    parts = 2 * threads
    part = align_up(max(1, math.ceil(nbytes / parts)))
    units = [UnitEntry(i, f"probe{i}", part, ()) for i in range(parts)]
    tmp = Path(tempfile.mkdtemp(prefix=".shardwise-probe-", dir=directory))
    try:
        dest = aligned_host_buffer(part * parts)  # uint8 [parts * part]
        for u in units:
            _write_probe_file(tmp / unit_filename(u.index), part, dest[:min(part, CHUNK)])
        dest.fill_(0)  # fault every page in now: the timing is the disk's, as for ring slots
        with BlobReader(tmp, threads=threads, direct=direct) as reader:
            start = time.perf_counter()
            futures = [reader.submit(u, dest[u.index * part:(u.index + 1) * part]) for u in units]
            for f in futures:
                f.result()
            seconds = time.perf_counter() - start
        return {"gbps": part * parts / seconds / 1e9, "direct_io": reader.direct_io,
                "fallback_reason": reader.fallback_reason, "nbytes": part * parts,
                "seconds": seconds}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

"""Where each checkpoint tensor lives: a key → pieces index over safetensors / .bin / rank files,
and a reader that returns any index ranges of any dim of a tensor, converted to a dtype.

Safetensors headers are parsed here (8-byte length + JSON) so a truncated or corrupted file, a
missing tensor or a wrong shape fails before any weight is read. Data is read with positional
reads (``os.preadv``) at the header's offsets, never through a memory map (:mod:`.preads`): a
mapped file's pages count in the process's resident memory as soon as they are touched, and a
column slice of a row-major weight touches every page of it. So a rank holds its own slices plus
one bounded staging buffer, whatever it skips.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from .description import Description
from .errors import CheckpointError
from .extensions import extension, rank_entries
from .preads import StagingBuffer, read_contiguous, read_slice

log = logging.getLogger(__name__)

Range = tuple[int, int]
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
              "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
              "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
              "F8_E5M2": getattr(torch, "float8_e5m2", None)}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    """One tensor stored in one file."""

    file: Path
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = -1  # byte offset of its data in a safetensors file (-1: a .bin tensor)


@dataclass(frozen=True)
class Piece:
    """Global indices [start, stop) of ``dim`` of a checkpoint key, stored at
    [local, local + stop - start) of ``info``'s ``dim``; ``dim`` None: the whole tensor."""

    info: TensorInfo
    dim: int | None = None
    start: int = 0
    stop: int = 0
    local: int = 0
    owner: int = 0  # the saved rank whose file holds it


# ----- headers ------------------------------------------------------------------------------------

def safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """(tensor name → info, ``__metadata__``) of a safetensors file, checked as the safetensors
    format demands: a JSON object of well-formed entries whose byte ranges tile the data section
    exactly (in bounds, no overlap, no gap, nothing after the last), each ``numel * itemsize``
    bytes long."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is not a safetensors file (only {size} bytes): "
                                  f"truncated or corrupted; re-download or re-save it")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{path} has a corrupted safetensors header (claims {n} bytes, "
                                  f"file has {size}); re-download or re-save it")
        raw = _header_json(path, fh.read(n))
    meta = raw.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in meta.items()):
        raise CheckpointError(f"{path}: the header's __metadata__ must map strings to strings; "
                              f"the file is corrupted")
    tensors = {name: _tensor_info(path, name, entry, 8 + n) for name, entry in raw.items()}
    _check_tiling(path, tensors, 8 + n, size)
    return tensors, meta


def _header_json(path: Path, raw: bytes) -> dict:
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} has a corrupted safetensors header ({exc}); "
                              f"re-download or re-save it") from None
    except RecursionError:
        raise CheckpointError(f"{path} has a corrupted safetensors header (JSON nested too "
                              f"deeply); re-download or re-save it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupted safetensors header: the header is not a "
                              f"JSON object (got {type(header).__name__}); re-download or "
                              f"re-save it")
    return header


def _tensor_info(path: Path, name: str, entry: Any, data_start: int) -> TensorInfo:
    """One header entry, checked: a known dtype, a shape of natural numbers, and a byte range
    ``[begin, stop)`` of exactly ``numel * itemsize`` bytes."""
    ok = isinstance(entry, dict) and isinstance(entry.get("dtype"), str) \
        and isinstance(entry.get("shape"), list) and isinstance(entry.get("data_offsets"), list) \
        and len(entry["data_offsets"]) == 2 \
        and all(_natural(v) for v in [*entry["shape"], *entry["data_offsets"]])
    if not ok or entry["dtype"] not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{path}: header entry {name!r} is malformed ({_short(entry)}); "
                              f"the file is corrupted")
    dtype, (begin, stop), shape = SAFETENSORS_DTYPES[entry["dtype"]], entry["data_offsets"], \
        tuple(entry["shape"])
    if dtype is None:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which "
                              f"this torch ({torch.__version__}) does not have")
    if not begin <= stop or stop - begin != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(f"{path}: header entry {name!r} is malformed ({_short(entry)}: its "
                              f"byte range does not fit its shape and dtype); the file is "
                              f"corrupted")
    return TensorInfo(path, name, shape, dtype, data_start + begin)


def _check_tiling(path: Path, tensors: dict[str, TensorInfo], data_start: int, size: int) -> None:
    """The tensors' byte ranges, sorted, must follow each other exactly from the data section's
    start to the end of the file (what the safetensors format requires): an overlap would alias
    two tensors, a gap or trailing bytes mean the header does not describe the file."""
    spans = sorted((info.offset - data_start, info.offset - data_start + _nbytes(info), name)
                   for name, info in tensors.items())
    cursor, last = 0, None
    for begin, stop, name in spans:
        if begin < cursor:
            raise CheckpointError(f"{path}: tensor {name!r} (bytes [{begin}, {stop})) overlaps "
                                  f"{last!r} (which ends at {cursor}); the file is corrupted")
        if begin > cursor:
            raise CheckpointError(f"{path}: a gap of {begin - cursor} bytes before tensor "
                                  f"{name!r} (bytes [{begin}, {stop})): the header does not "
                                  f"describe the file, it is corrupted")
        cursor, last = stop, name
    if data_start + cursor > size:
        raise CheckpointError(f"{path} is truncated: its header needs {data_start + cursor} "
                              f"bytes, the file has {size}; re-download or re-save it")
    if data_start + cursor < size:
        raise CheckpointError(f"{path} has {size - data_start - cursor} bytes after the last "
                              f"tensor, which its header does not describe: the file is "
                              f"corrupted; re-download or re-save it")


def _nbytes(info: TensorInfo) -> int:
    return math.prod(info.shape) * info.dtype.itemsize


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def bin_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A ``pytorch_model*.bin`` state dict, memory-mapped (its tensors are read on use)."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only load failed" in str(exc).lower():  # torch's restricted unpickler
            raise CheckpointError(
                f"{path} refused: the file contains pickled objects other than tensors (never "
                f"unpickled: loading it could run arbitrary code); if you trust its source, "
                f"convert it to safetensors (from_pretrained(..., use_safetensors=False) then "
                f"save_pretrained(..., safe_serialization=True)) and load that") from None
        raise _unreadable_bin(path, exc) from None
    except Exception as exc:  # torch raises RuntimeError/EOFError/... for bad files
        raise _unreadable_bin(path, exc) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a state dict (got {type(state).__name__})")
    return state


def _unreadable_bin(path: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(f"{path} cannot be read as a PyTorch checkpoint ({type(exc).__name__}"
                           f": {_short(str(exc))}); it is truncated or corrupted")


# ----- the index ----------------------------------------------------------------------------------

@dataclass
class CheckpointIndex:
    """Checkpoint key → its pieces and full shape; plus open-file bookkeeping for reading.

    For a shardwise checkpoint with extension data (:mod:`.extensions`), ``extensions`` holds
    the reading rank's entries (name → entry) and ``per_rank`` the keys of the tensors they
    name, indexed from that rank's own file (whole: never merged or split).
    """

    pieces: dict[str, list[Piece]]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    bins: dict[Path, dict[str, torch.Tensor]]
    per_rank: set[str] = field(default_factory=set)
    extensions: dict[str, Any] = field(default_factory=dict)

    def keys(self) -> list[str]:
        return list(self.pieces)


def build_index(desc: Description, rank: int = 0,
                split_keep: Mapping[str, Range] | None = None) -> CheckpointIndex:
    """Read every file's header (never its data) and index the tensors of ``desc`` (for a
    shardwise checkpoint with extension data: as ``rank`` reads it; every rank file's entries
    are checked against its header). ``split_keep``: module name → the dim-0 range ``rank``
    keeps of that module's tensors an extension stores split over the rank files
    (:meth:`~.extensions.CheckpointExtension.split_tensors`: its experts); a module not named
    keeps all of them. Such a key is indexed as this rank's part: its shape has the kept
    length along dim 0, its pieces from the files holding them."""
    if desc.kind == "shardwise":
        return _shardwise_index(desc, rank, split_keep or {})
    index = CheckpointIndex({}, {}, {}, {})
    bins = [f for f in desc.files if f.suffix == ".bin"]
    if bins:
        warnings.warn(f"{len(bins)} pytorch_model*.bin file(s): .bin files cannot be read slice by "
                      f"slice, so every rank maps each one whole; convert the checkpoint to "
                      f"safetensors (save_pretrained(..., safe_serialization=True)) to load only "
                      f"each rank's slices", stacklevel=3)
    for path in desc.files:
        for name, info in _file_infos(path, index).items():
            if name in index.pieces:
                raise CheckpointError(f"tensor {name!r} is stored twice: in "
                                      f"{index.pieces[name][0].info.file} and in {path}")
            index.pieces[name] = [Piece(info)]
            index.shapes[name], index.dtypes[name] = info.shape, info.dtype
    return index


def _file_infos(path: Path, index: CheckpointIndex) -> dict[str, TensorInfo]:
    if path.suffix != ".bin":
        return safetensors_header(path)[0]
    state = bin_tensors(path)
    index.bins[path] = state
    return {k: TensorInfo(path, k, tuple(v.shape), v.dtype) for k, v in state.items()
            if isinstance(v, torch.Tensor)}


def _shardwise_index(desc: Description, rank: int = 0,
                     split_keep: Mapping[str, Range] | None = None) -> CheckpointIndex:
    headers = [safetensors_header(f) for f in desc.files]
    _check_rank_files(desc, headers)
    index = CheckpointIndex({}, {}, {}, {})
    if desc.extensions:
        _index_extensions(desc, headers, rank, index, split_keep or {})
    rank0 = headers[0][0]
    for name, info in rank0.items():
        if name not in desc.shards and name not in index.per_rank:
            index.pieces[name], index.shapes[name] = [Piece(info)], info.shape
            index.dtypes[name] = info.dtype
    for name, entry in desc.shards.items():
        dim, pieces = entry["dim"], []
        for rank, ((tensors, _), ranges) in enumerate(zip(headers, entry["ranges"])):
            local = 0
            for a, b in ranges:
                pieces.append(Piece(tensors[name], dim, a, b, local, rank))
                local += b - a
        shape = list(headers[0][0][name].shape)
        shape[dim] = entry["size"]
        index.pieces[name], index.shapes[name] = pieces, tuple(shape)
        index.dtypes[name] = headers[0][0][name].dtype
    return index


def _check_rank_files(desc: Description, headers: list) -> None:
    """Every rank file must come from the same save and hold its described slices."""
    for rank, (path, (tensors, meta)) in enumerate(zip(desc.files, headers)):
        if desc.save_id and meta.get("save_id") != desc.save_id:
            raise CheckpointError(f"rank file {path} belongs to another save (save_id "
                                  f"{meta.get('save_id')!r}, the description says "
                                  f"{desc.save_id!r}): the rank files disagree; re-save the "
                                  f"checkpoint from one run")
        for name, entry in desc.shards.items():
            info = tensors.get(name)
            if info is not None and entry["dim"] >= len(info.shape):
                raise CheckpointError(f"{desc.source}: shard entry for {name!r} splits dim "
                                      f"{entry['dim']}, which is out of range for its "
                                      f"{len(info.shape)}-d tensor in {path}; the description "
                                      f"is corrupted: re-save the checkpoint")
            want = sum(b - a for a, b in entry["ranges"][rank])
            if info is None or info.shape[entry["dim"]] != want:
                got = "absent" if info is None else f"shape {list(info.shape)}"
                raise CheckpointError(f"rank file {path} disagrees with the description: "
                                      f"{name!r} is {got}, expected {want} along dim "
                                      f"{entry['dim']}")
            first = headers[0][0][name]
            if (info.dtype, _others(info.shape, entry["dim"])) != \
                    (first.dtype, _others(first.shape, entry["dim"])):
                raise CheckpointError(f"rank files disagree on {name!r}: {desc.files[0]} has "
                                      f"{first.dtype} {list(first.shape)}, {path} has "
                                      f"{info.dtype} {list(info.shape)}")


def _index_extensions(desc: Description, headers: list, rank: int, index: CheckpointIndex,
                      split_keep: Mapping[str, Range]) -> None:
    """Check every rank file's extension entries (each by its extension, against the
    description's entry) and the tensors they name against the file's header, then index
    ``rank``'s tensors: those the extension stores split over the files (its
    ``split_tensors``) as ``split_keep`` says this rank keeps them, from every file holding a
    part; the others from ``rank``'s own file (whole: never merged or split)."""
    for name, entry in desc.extensions.items():
        ext = extension(name, desc.source)
        entries, wanted = [], []
        for path, (tensors, meta) in zip(desc.files, headers):
            where = f"rank file {path}"
            rank_entry = _rank_entries(meta, where).get(name)
            if rank_entry is None:
                raise CheckpointError(f"{where} has no {name!r} entry in its metadata although "
                                      f"the description names that extension; the rank files "
                                      f"do not belong to it: re-save the checkpoint")
            wanted.append(ext.rank_tensors(entry, rank_entry, where))
            _check_stored(tensors, wanted[-1], where, name)
            entries.append(rank_entry)
        split = ext.split_tensors(entry, entries)
        own = rank
        if not 0 <= rank < len(headers):
            if len(headers) > 1 and set(wanted[0]) - set(split):
                raise CheckpointError(
                    f"{desc.source} carries {name} data saved over {len(headers)} rank files "
                    f"(tp_size={desc.tp_size}, or the expert-parallel ranks); rank {rank} has no "
                    f"file in it: load it on at most {len(headers)} ranks, or save full "
                    f"precision to load at another split")
            own = 0  # one file (saved unsplit: whole), or every tensor split over the files
        index.extensions[name] = entries[own]
        for key in wanted[own]:
            if key in split:
                _index_split(key, split[key], headers, split_keep, index)
            else:
                info = headers[own][0][key]
                index.pieces[key] = [Piece(info, owner=own)]
                index.shapes[key], index.dtypes[key] = info.shape, info.dtype
            index.per_rank.add(key)


def _index_split(key: str, split: tuple[int, list], headers: list,
                 split_keep: Mapping[str, Range], index: CheckpointIndex) -> None:
    """Index what this rank keeps of ``key``, stored as dim-0 parts ``split`` = (size,
    [(file, (start, stop)), ...]): the kept range ``[a, b)`` (its module's in ``split_keep``,
    else all) becomes indices ``[0, b - a)`` of the indexed key, each from the file holding it."""
    size, parts = split
    a, b = split_keep.get(key.rpartition(".")[0], (0, size))
    pieces = []
    for file, (start, stop) in parts:
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            info = headers[file][0][key]
            pieces.append(Piece(info, 0, lo - a, hi - a, lo - start, file))
    covered = sum(p.stop - p.start for p in pieces)
    if not 0 <= a <= b <= size or covered != b - a:
        raise CheckpointError(f"{key!r}: this rank keeps [{a}, {b}) of dim 0, but the rank files "
                              f"hold {[list(r) for _, r in parts]} of {size}; the checkpoint "
                              f"and the split do not belong together")
    first = pieces[0].info if pieces else headers[parts[0][0]][0][key]
    index.pieces[key] = pieces or [Piece(first, 0, 0, 0, 0, parts[0][0])]
    index.shapes[key] = (b - a, *first.shape[1:])
    index.dtypes[key] = first.dtype


def _rank_entries(meta: dict[str, str], where: str) -> dict:
    def parse(text: str, key: str):
        try:
            return json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise CheckpointError(f"{where}: its {key!r} metadata is not valid JSON "
                                  f"({type(exc).__name__}); the file is corrupted: re-save "
                                  f"the checkpoint") from None
    return rank_entries(meta, where, parse)


def _check_stored(tensors: dict[str, TensorInfo], wanted: dict, where: str, name: str) -> None:
    """Every tensor an extension entry names is in the file with its shape (and dtype)."""
    for key, (shape, dtype) in wanted.items():
        info = tensors.get(key)
        stored = None if info is None else str(info.dtype).removeprefix("torch.")
        if info is None or list(info.shape) != list(shape) or \
                (dtype is not None and stored != dtype):
            got = "absent" if info is None else f"{stored} {list(info.shape)}"
            raise CheckpointError(f"{where}: tensor {key!r} is {got}, its {name!r} entry says "
                                  f"{dtype or 'floating'} {list(shape)}; the file is corrupted "
                                  f"or mixed up: re-save the checkpoint")


def _others(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return shape[:dim] + shape[dim + 1:]


# ----- reading ------------------------------------------------------------------------------------

class Reader:
    """Reads slices of indexed tensors; counts the bytes it reads. Close it (or use ``with``)."""

    def __init__(self, index: CheckpointIndex, rank: int = 0) -> None:
        self.index, self.rank = index, rank
        self.bytes_read = 0
        self._fds: dict[Path, int] = {}  # path → an open file descriptor (read with preadv)
        self._stage = StagingBuffer()

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._stage.release()

    def read_into(self, key: str, dest: torch.Tensor) -> None:
        """Fill ``dest`` (the whole tensor's shape; its dtype: a floating one, or the stored)
        with ``key``. A whole tensor of a safetensors file is read straight into a contiguous
        ``dest`` (converted through the staging buffer if the dtypes differ): no temporary
        copy, and the kernel, not a copy loop, touches ``dest``'s fresh pages."""
        pieces = self.index.pieces[key]
        info = pieces[0].info
        if len(pieces) > 1 or pieces[0].dim is not None or info.file in self.index.bins \
                or not dest.is_contiguous() or tuple(dest.shape) != info.shape:
            dest.copy_(self.read(key, None, None, dest.dtype))
            return
        read_contiguous(self._fd(info.file), info.offset, dest.reshape(-1), info.dtype,
                        self._stage, info.file)
        self.bytes_read += dest.numel() * info.dtype.itemsize

    def read(self, key: str, dim: int | None, ranges: list[Range] | None,
             dtype: torch.dtype | None) -> torch.Tensor:
        """``key``'s ``ranges`` along ``dim`` (None: the whole tensor), concatenated, as
        ``dtype`` (floating tensors only; None keeps the stored dtype)."""
        pieces = self.index.pieces[key]
        if ranges is None:
            if pieces[0].dim is None:
                return self._slice(pieces[0].info, None, 0, 0, dtype)
            dim, ranges = pieces[0].dim, [(0, self.index.shapes[key][pieces[0].dim])]
        parts = [t for a, b in ranges for t in self._range(key, dim, a, b, dtype)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def _range(self, key: str, dim: int, a: int, b: int,
               dtype: torch.dtype | None) -> list[torch.Tensor]:
        """[a, b) of ``dim``: from a whole tensor, or from the rank files' pieces (each index
        once, this rank's own file first: replicated kv heads are in several)."""
        pieces = sorted(self.index.pieces[key], key=lambda p: p.owner != self.rank)
        if pieces[0].dim is None:
            return [self._slice(pieces[0].info, dim, a, b, dtype)]
        if pieces[0].dim != dim:  # saved split along another dim: assemble, then narrow
            return [self.read(key, None, None, dtype).narrow(dim, a, b - a).clone()]
        out, cursor = [], a
        while cursor < b:
            p = next((p for p in pieces if p.start <= cursor < p.stop), None)
            if p is None:
                raise CheckpointError(f"{key!r}: indices [{cursor}, {b}) of dim {dim} are in no "
                                      f"rank file of the checkpoint")
            hi = min(b, p.stop)
            out.append(self._slice(p.info, dim, p.local + cursor - p.start,
                                   p.local + hi - p.start, dtype))
            cursor = hi
        return out

    def _slice(self, info: TensorInfo, dim: int | None, a: int, b: int,
               dtype: torch.dtype | None) -> torch.Tensor:
        """A fresh tensor (own memory, contiguous, in ``dtype``) holding [a, b) of ``dim`` of
        ``info`` (``dim`` None: all of it). Safetensors data is read at its offsets straight into
        the result (converting through a bounded staging buffer), never mapped."""
        floating = info.dtype.is_floating_point
        target = dtype if dtype is not None and floating else info.dtype
        if info.file in self.index.bins:
            view = self.index.bins[info.file][info.name]
            if dim is not None:
                view = view.narrow(dim, a, b - a)
            out = torch.empty(view.shape, dtype=target).copy_(view)
            del view
        else:
            out = read_slice(self._fd(info.file), info.offset, info.shape, info.dtype, dim, a, b,
                             target, self._stage, info.file)
        self.bytes_read += out.numel() * info.dtype.itemsize
        return out

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        return fd


def file_bytes(desc: Description) -> int:
    return sum(os.path.getsize(f) for f in desc.files)

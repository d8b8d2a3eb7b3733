"""Checkpoint descriptions: what files a checkpoint consists of and how they fit together.

A checkpoint is given as one of

* a Hugging Face model directory (``config.json`` + ``model.safetensors``, or sharded
  ``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``, or
  ``pytorch_model*.bin``);
* a description JSON file (or the same dict), DeepSpeed's shape accepted::

    {"type": "ds_model" | "hf" | "shardwise", "version": 1.0, "base_dir": "...",
     "checkpoints": ["a.safetensors", ...]  or  {"tp": [...], "non_tp": [...]},
     "tp_size": 2, "dtype": "bfloat16"}

  File names are relative to ``base_dir`` (the ``base_dir`` argument of ``init_inference``
  overrides the file's; default: the description file's folder). ``type: "shardwise"`` is what
  :func:`shardwise.checkpoint.save_checkpoint` writes: one file per rank plus the slicing
  metadata ("shards") needed to merge or split them at another tp size. Data other transforms
  store with the weights (a quantized model's settings and packed layers) rides in an opaque
  ``"extensions": {name: entry}`` section that each named extension validates
  (:mod:`.extensions`); a file saved before that section existed carries a quantized model's
  entry as ``"quant"``, read as the ``"shardwise.quant"`` extension's.

Confinement: every file a checkpoint names (weights, the HF index's ``weight_map``, config.json,
the description in a directory) is read only if its real path (symlinks and ``..`` resolved) lies
inside the checkpoint's folder: the model directory, or the description file's folder (a
description's own ``base_dir`` must lie inside that folder too). The one way out is the Hugging
Face hub cache's layout, where ``snapshots/<rev>/<file>`` links to ``../../blobs/<hash>``. A
caller who passes ``base_dir=`` (``init_inference``/``load_checkpoint``/:func:`describe`) chooses
the folder instead; a dict checkpoint is the caller's own, so its ``base_dir`` is too (default: the
working directory). A refused name is reported as given, never whether anything exists outside
or how large it is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import CheckpointError
from .extensions import LEGACY_DESCRIPTION_KEYS, extension

#: ``type`` values understood → (kind, the versions accepted; None = any).
TYPES = {"ds_model": "flat", "hf": "flat", "huggingface": "flat", "bloom": "flat",
         "shardwise": "shardwise"}
#: versions of each kind of description this shardwise reads
VERSIONS = {"flat": None, "shardwise": {1}}
DESCRIPTION_NAME = "shardwise_checkpoint.json"
_KEYS = {"type", "checkpoints", "version", "base_dir", "tp_size", "ep_size", "dtype",
         "parallelization", "shards", "save_id", "config", "replicated", "format", "extensions",
         *LEGACY_DESCRIPTION_KEYS}


@dataclass
class Description:
    """A resolved checkpoint: its kind, its files (absolute), and what the description says.

    Attributes:
        kind: ``"hf_dir"`` (a model directory), ``"flat"`` (a list of files, each holding whole
            tensors) or ``"shardwise"`` (per-rank files from :func:`save_checkpoint`).
        files: the weight files, in order (for ``shardwise``: rank 0's first).
        config_file: the model's ``config.json`` (its real path, checked to lie inside the
            folder; None when there is none).
        tp_size, dtype: as described (None when not said).
        shards: for ``shardwise``: parameter → ``{"dim", "size", "ranges"}`` (ranges per rank).
        save_id: for ``shardwise``: the id every rank file's metadata must carry.
        extensions: extension name → its entry (opaque here, checked by the extension: see
            :mod:`.extensions`); empty for a plain checkpoint.
    """

    kind: str
    files: list[Path]
    tp_size: int | None = None
    dtype: str | None = None
    shards: dict[str, dict] = field(default_factory=dict)
    save_id: str | None = None
    source: str = ""
    extensions: dict[str, Any] = field(default_factory=dict)
    config_file: Path | None = None  # config.json's real path, inside the checkpoint's folder


def describe(checkpoint: str | os.PathLike | Mapping, base_dir: str | os.PathLike | None = None
             ) -> Description:
    """The :class:`Description` of ``checkpoint`` (a directory, a description file, or a dict).
    Every named file must exist inside the checkpoint's folder (module docstring: confinement),
    or inside ``base_dir`` when the caller gives it; nothing is read beyond the description."""
    if base_dir is not None and not isinstance(base_dir, (str, os.PathLike)):
        raise CheckpointError(f"base_dir must be a folder path, got {type(base_dir).__name__} "
                              f"{base_dir!r}")
    if isinstance(checkpoint, Mapping):
        data = dict(checkpoint)
        own = _base_dir_field(data, "the checkpoint dict")
        return _from_mapping(data, Folder.of(base_dir or own or Path.cwd()), "the checkpoint dict")
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; pass a model directory "
                              f"(save_pretrained output) or a checkpoint description JSON file")
    if path.is_dir():
        folder = Folder.of(path)
        named = folder.file(DESCRIPTION_NAME, f"model directory {str(path)!r}")
        if named.is_file():
            return _from_description_file(named, folder, base_dir)
        return _from_hf_dir(path, folder)
    return _from_description_file(path, Folder.of(path.parent), base_dir)


def _from_description_file(path: Path, folder: "Folder",
                           base_dir: str | os.PathLike | None) -> Description:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint description {str(path)!r} is not valid JSON "
                              f"({type(exc).__name__}); pass a JSON description or a model "
                              f"directory") from None
    where = repr(str(path))
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint description {where} must be a JSON object, got "
                              f"{type(data).__name__}")
    own = _base_dir_field(data, where)
    if base_dir is not None:  # the caller's folder: trusted
        root = Folder.of(base_dir)
    elif own is not None:  # the description's: must lie inside its folder
        root = folder.subfolder(folder.file(own, f"{where} (its base_dir)"))
    else:
        root = folder
    return _from_mapping(data, root, where)


def _base_dir_field(data: dict[str, Any], where: str) -> str | None:
    own = data.get("base_dir")
    if own is not None and not isinstance(own, str):
        raise CheckpointError(f"{where}: base_dir must be a string (a folder path), got "
                              f"{type(own).__name__} {own!r}")
    return own or None


@dataclass(frozen=True)
class Folder:
    """The folder a checkpoint's reads are confined to: ``shown`` as given (for messages),
    ``roots`` the real paths files may resolve into (the folder's own, plus the hub cache's
    ``blobs`` folder when the folder is a hub snapshot)."""

    shown: Path
    roots: tuple[Path, ...]

    @classmethod
    def of(cls, path: str | os.PathLike) -> "Folder":
        real = Path(os.path.realpath(path))
        roots = [real]
        hub = real.parent.parent  # <cache>/models--org--name/snapshots/<rev>
        if real.parent.name == "snapshots" and (hub / "blobs").is_dir():
            roots.append(hub / "blobs")
        return cls(Path(path), tuple(roots))

    def subfolder(self, real: Path) -> "Folder":
        """A folder inside this one (already checked), with the same roots."""
        return Folder(real, self.roots)

    def file(self, name: str | os.PathLike, where: str) -> Path:
        """The real path of ``name`` (relative to the folder, or absolute) if it lies inside the
        folder; else :class:`CheckpointError`, which says nothing of what is outside."""
        try:
            real = Path(os.path.realpath(self.shown / name))
        except (ValueError, OSError):  # a NUL byte, a symlink loop
            real = None
        if real is None or not any(real.is_relative_to(r) for r in self.roots):
            raise CheckpointError(
                f"{where} names {str(name)!r}, which resolves outside the checkpoint folder "
                f"{str(self.shown)!r}: refused. A checkpoint's files are read only inside its "
                f"folder (no '..', absolute paths or symlinks leading out); to read files from "
                f"another folder, pass base_dir=... yourself")
        return real

    def config(self, where: str) -> Path | None:
        """``config.json`` of the folder (its real path), None when there is none."""
        real = self.file("config.json", where)
        return real if real.is_file() else None


def _from_hf_dir(path: Path, folder: Folder) -> Description:
    where = f"model directory {str(path)!r}"
    index = folder.file("model.safetensors.index.json", where)
    bin_index = folder.file("pytorch_model.bin.index.json", where)
    single = folder.file("model.safetensors", where)
    if index.is_file():
        files = _index_files(index, folder)
    elif single.is_file():
        files = [single]
    elif bin_index.is_file():
        files = _index_files(bin_index, folder)
    else:
        files = [folder.file(f.name, where) for f in (sorted(path.glob("pytorch_model*.bin"))
                                                      or sorted(path.glob("*.safetensors")))]
    if not files:
        raise CheckpointError(f"model directory {str(path)!r} has no weights (no model.safetensors"
                              f", model.safetensors.index.json or pytorch_model*.bin)")
    _require_files(files, where)
    config = folder.config(where)
    return Description("hf_dir", files, source=str(path),
                       config_file=config)


def _index_files(index: Path, folder: Folder) -> list[Path]:
    where = f"index {str(index)!r}"
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError,
            TypeError) as exc:
        raise CheckpointError(f"{where} is not a valid HF weight index (needs a 'weight_map'): "
                              f"{type(exc).__name__}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                   for v in weight_map.values()):
        raise CheckpointError(f"{where}: 'weight_map' must map tensor names to file names")
    return [folder.file(name, where) for name in dict.fromkeys(weight_map.values())]


def _from_mapping(data: dict[str, Any], root: Folder, where: str) -> Description:
    unknown = set(data) - _KEYS
    if unknown:
        raise CheckpointError(f"{where} has unknown field(s) {sorted(unknown)}; known: "
                              f"{sorted(_KEYS)}")
    kind = _kind(data, where)
    files = [root.file(f, where) for f in _file_names(data.get("checkpoints"), where)]
    _require_files(files, where)
    config = root.config(where)
    tp_size = data.get("tp_size")
    if tp_size is not None and (isinstance(tp_size, bool) or not isinstance(tp_size, int)
                                or tp_size < 1):
        raise CheckpointError(f"{where}: tp_size must be a positive integer, got {tp_size!r}")
    for name in ("dtype", "save_id"):
        if data.get(name) is not None and not isinstance(data[name], str):
            raise CheckpointError(f"{where}: {name} must be a string, got "
                                  f"{type(data[name]).__name__} {data[name]!r}")
    shards = data.get("shards")
    if shards is not None and not isinstance(shards, Mapping):
        raise CheckpointError(f"{where}: shards must be an object (tensor name → {{dim, size, "
                              f"ranges}}), got {type(shards).__name__}")
    desc = Description(kind, files, tp_size, data.get("dtype"), dict(shards or {}),
                       data.get("save_id"), where, _extensions(data, kind, where),
                       config_file=config)
    if kind == "shardwise":
        _check_shardwise(desc, where)
    return desc


def _extensions(data: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    """The description's extension entries (legacy keys included), each checked by its
    extension before any file is read."""
    section = data.get("extensions") or {}
    if not isinstance(section, Mapping):
        raise CheckpointError(f"{where}: 'extensions' must be an object (extension name → "
                              f"entry), got {type(section).__name__}")
    found = dict(section)
    for key, name in LEGACY_DESCRIPTION_KEYS.items():
        if data.get(key) is not None:
            found.setdefault(name, data[key])
    if found and kind != "shardwise":
        raise CheckpointError(f"{where} has extension entries ({', '.join(sorted(found))}), "
                              f"which only shardwise-saved checkpoints (type 'shardwise') "
                              f"carry; remove them")
    for name, entry in found.items():
        extension(name, where).check_description(entry, where)
    return found


def _kind(data: dict[str, Any], where: str) -> str:
    ctype = str(data.get("type", "")).lower()
    if ctype not in TYPES:
        raise CheckpointError(f"{where} has checkpoint type {data.get('type')!r}, which shardwise "
                              f"does not read; known types: {', '.join(TYPES)}")
    kind = TYPES[ctype]
    versions = VERSIONS[kind]
    version = data.get("version")
    if versions is not None and _version_number(version, where) not in versions:
        raise CheckpointError(f"{where} is a {ctype} checkpoint of version {version!r}; this "
                              f"shardwise reads version(s) {sorted(versions)}: upgrade shardwise "
                              f"or re-save the checkpoint")
    if version is not None:
        _version_number(version, where)
    return kind


def _version_number(version: Any, where: str) -> float:
    try:
        return float(version)
    except (TypeError, ValueError):
        raise CheckpointError(f"{where}: version {version!r} is not a number") from None


def _file_names(checkpoints: Any, where: str) -> list[str]:
    if isinstance(checkpoints, str):
        return [checkpoints]
    if isinstance(checkpoints, Mapping):  # DeepSpeed's {"tp": [...], "non_tp": [...]}
        unknown = set(checkpoints) - {"tp", "non_tp"}
        if unknown:
            raise CheckpointError(f"{where}: 'checkpoints' keys {sorted(unknown)} are not "
                                  f"understood; use 'tp' and 'non_tp'")
        for part in ("non_tp", "tp"):
            if not isinstance(checkpoints.get(part, []), list):
                raise CheckpointError(f"{where}: 'checkpoints'[{part!r}] must be a list of file "
                                      f"names, got {checkpoints[part]!r}")
        names = [*checkpoints.get("non_tp", []), *checkpoints.get("tp", [])]
    elif isinstance(checkpoints, list):
        names = checkpoints
    else:
        raise CheckpointError(f"{where} needs 'checkpoints': a list of file names (or DeepSpeed's "
                              f"{{'tp': [...], 'non_tp': [...]}}), got {checkpoints!r}")
    if not names or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{where}: 'checkpoints' must name at least one file, got "
                              f"{checkpoints!r}")
    return names


def _require_files(files: list[Path], where: str) -> None:
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{where} names shard file(s) that do not exist: "
                              f"{', '.join(missing)}")


def _check_shardwise(desc: Description, where: str) -> None:
    if desc.tp_size is None or len(desc.files) != desc.tp_size:
        raise CheckpointError(f"{where}: a shardwise checkpoint needs tp_size and one file per "
                              f"rank; it has tp_size={desc.tp_size} and {len(desc.files)} files")
    for name, entry in desc.shards.items():
        if not _shard_entry_ok(entry, desc.tp_size):
            raise CheckpointError(f"{where}: shard entry for {name!r} must have dim (≥ 0), size "
                                  f"(≥ 0) and one list of [start, stop) index ranges within "
                                  f"size per rank, got {entry!r}")


def _shard_entry_ok(entry: Any, tp_size: int) -> bool:
    """``{"dim": int ≥ 0, "size": int ≥ 0, "ranges": [[[a, b], ...] per rank]}``, 0 ≤ a ≤ b ≤ size.
    (Whether ``dim`` exists in the tensor is checked against the rank files' headers.)"""
    if not isinstance(entry, Mapping):
        return False
    dim, size, ranges = entry.get("dim"), entry.get("size"), entry.get("ranges")
    if not (_natural(dim) and _natural(size) and isinstance(ranges, list)
            and len(ranges) == tp_size):
        return False
    return all(isinstance(rank, list) and all(
        isinstance(r, list) and len(r) == 2 and _natural(r[0]) and _natural(r[1])
        and r[0] <= r[1] <= size for r in rank) for rank in ranges)


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

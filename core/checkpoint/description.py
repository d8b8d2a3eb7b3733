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
  metadata ("shards") needed to merge or split them at another tp size. A quantized model's
  description adds ``"quant": {"format", "config", "dtype", "layers"}`` (its settings; each rank
  file's metadata holds that rank's packed-layer manifest).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import CheckpointError

#: ``type`` values understood → (kind, the versions accepted; None = any).
TYPES = {"ds_model": "flat", "hf": "flat", "huggingface": "flat", "bloom": "flat",
         "shardwise": "shardwise"}
#: versions of each kind of description this shardwise reads
VERSIONS = {"flat": None, "shardwise": {1}}
DESCRIPTION_NAME = "shardwise_checkpoint.json"
_KEYS = {"type", "checkpoints", "version", "base_dir", "tp_size", "dtype", "parallelization",
         "shards", "save_id", "config", "replicated", "format", "quant"}


@dataclass
class Description:
    """A resolved checkpoint: its kind, its files (absolute), and what the description says.

    Attributes:
        kind: ``"hf_dir"`` (a model directory), ``"flat"`` (a list of files, each holding whole
            tensors) or ``"shardwise"`` (per-rank files from :func:`save_checkpoint`).
        files: the weight files, in order (for ``shardwise``: rank 0's first).
        config_dir: a folder with the model's ``config.json`` (None when there is none).
        tp_size, dtype: as described (None when not said).
        shards: for ``shardwise``: parameter → ``{"dim", "size", "ranges"}`` (ranges per rank).
        save_id: for ``shardwise``: the id every rank file's metadata must carry.
        quant: for a quantized ``shardwise`` save: its settings (``format``, ``config``: the
            ``quant=`` dict, ``dtype``: the compute dtype, ``layers``: the quantized layers'
            names); None for a full-precision checkpoint.
    """

    kind: str
    files: list[Path]
    config_dir: Path | None = None
    tp_size: int | None = None
    dtype: str | None = None
    shards: dict[str, dict] = field(default_factory=dict)
    save_id: str | None = None
    source: str = ""
    quant: dict | None = None


def describe(checkpoint: str | os.PathLike | Mapping, base_dir: str | os.PathLike | None = None
             ) -> Description:
    """The :class:`Description` of ``checkpoint`` (a directory, a description file, or a dict).
    Every named file must exist; nothing is read beyond the description itself."""
    if isinstance(checkpoint, Mapping):
        return _from_mapping(dict(checkpoint), Path(base_dir) if base_dir else Path.cwd(),
                             "the checkpoint dict")
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist; pass a model directory "
                              f"(save_pretrained output) or a checkpoint description JSON file")
    if path.is_dir():
        if (path / DESCRIPTION_NAME).is_file():
            return describe(path / DESCRIPTION_NAME, base_dir)
        return _from_hf_dir(path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint description {str(path)!r} is not valid JSON ({exc}); "
                              f"pass a JSON description or a model directory") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint description {str(path)!r} must be a JSON object")
    root = Path(base_dir) if base_dir else Path(data.get("base_dir") or path.parent)
    if not root.is_absolute():
        root = path.parent / root
    return _from_mapping(data, root, repr(str(path)))


def _from_hf_dir(path: Path) -> Description:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = _index_files(index)
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif (path / "pytorch_model.bin.index.json").is_file():
        files = _index_files(path / "pytorch_model.bin.index.json")
    else:
        files = sorted(path.glob("pytorch_model*.bin")) or sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model directory {str(path)!r} has no weights (no model.safetensors"
                              f", model.safetensors.index.json or pytorch_model*.bin)")
    _require_files(files, f"model directory {str(path)!r}")
    config_dir = path if (path / "config.json").is_file() else None
    return Description("hf_dir", files, config_dir, source=str(path))


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"index {str(index)!r} is not a valid HF weight index "
                              f"(needs a 'weight_map'): {exc}") from None
    return [index.parent / name for name in dict.fromkeys(weight_map.values())]


def _from_mapping(data: dict[str, Any], root: Path, where: str) -> Description:
    unknown = set(data) - _KEYS
    if unknown:
        raise CheckpointError(f"{where} has unknown field(s) {sorted(unknown)}; known: "
                              f"{sorted(_KEYS)}")
    kind = _kind(data, where)
    files = [root / f for f in _file_names(data.get("checkpoints"), where)]
    _require_files(files, where)
    config_dir = root if (root / "config.json").is_file() else None
    tp_size = data.get("tp_size")
    if tp_size is not None and (not isinstance(tp_size, int) or tp_size < 1):
        raise CheckpointError(f"{where}: tp_size must be a positive integer, got {tp_size!r}")
    desc = Description(kind, files, config_dir, tp_size, data.get("dtype"),
                       dict(data.get("shards") or {}), data.get("save_id"), where,
                       data.get("quant"))
    if kind == "shardwise":
        _check_shardwise(desc, where)
    if desc.quant is not None:
        _check_quant(desc, where)
    return desc


def _check_quant(desc: Description, where: str) -> None:
    """A quantized checkpoint's ``quant`` entry is well-formed (before any file is read)."""
    from ..quant.checkpoint import check_description_entry

    if desc.kind != "shardwise":
        raise CheckpointError(f"{where} has a 'quant' entry, which only shardwise-saved "
                              f"checkpoints (type 'shardwise') carry; remove it")
    check_description_entry(desc.quant, where, CheckpointError)


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
        ranges = entry.get("ranges") if isinstance(entry, Mapping) else None
        if not isinstance(ranges, list) or len(ranges) != desc.tp_size \
                or not isinstance(entry.get("dim"), int) or not isinstance(entry.get("size"), int):
            raise CheckpointError(f"{where}: shard entry for {name!r} must have dim, size and "
                                  f"one range list per rank, got {entry!r}")

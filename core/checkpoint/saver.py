"""Writing a sharded checkpoint: one safetensors file per rank plus a description.

Each rank writes the slices it holds of the sharded tensors; rank 0's file also holds the
replicated tensors (once). The description (``shardwise_checkpoint.json``, type ``"shardwise"``)
records, per sharded tensor, the dim split, its full size and every rank's index ranges, so
:func:`~shardwise.checkpoint.load_checkpoint` can load it at any tp size: the same one reads each
rank's own file, another merges or splits the pieces. ``config.json`` is written next to it.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..communicator import Communicator, LocalCommunicator
from ..sharding.apply import PreparedShards, param_ranges
from .description import DESCRIPTION_NAME


def _qckpt():
    """:mod:`shardwise.quant.checkpoint`, imported on first use (no kernels at import)."""
    from ..quant import checkpoint

    return checkpoint

VERSION = 1
#: safetensors metadata key of a rank file's quantization manifest (JSON)
QUANT_METADATA = "shardwise_quant"


def rank_file(rank: int, tp_size: int) -> str:
    return f"rank{rank:02d}-of-{tp_size:02d}.safetensors"


def save_checkpoint(model: nn.Module, path: str | Path, *, prepared: PreparedShards | None = None,
                    communicator: Communicator | None = None) -> Path:
    """Write ``model`` (sharded by ``prepared`` across ``communicator``, or whole) to ``path``;
    every rank calls it. A quantized model is written as it is (module docstring). Returns the
    description file's path."""
    comm = communicator or LocalCommunicator()
    tp = prepared.tp_size if prepared is not None else 1
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_id = _shared_id(comm)
    quant = _quant_manifest(model)
    per_rank = set(_qckpt().tensor_names(quant)) if quant else set()  # this rank's packed tensors
    shards = _shard_entries(prepared) if prepared is not None else {}
    shards = {k: v for k, v in shards.items() if k not in per_rank}
    if comm.rank < tp:
        _write_rank_file(model, out / rank_file(comm.rank, tp), shards, per_rank, quant,
                         {"save_id": save_id, "rank": str(comm.rank), "tp_size": str(tp)})
    comm.barrier()
    description = out / DESCRIPTION_NAME
    if comm.rank == 0:  # last, so a description means every rank file is complete
        _write_description(model, description, tp, save_id, shards, quant)
    comm.barrier()
    return description


def _write_rank_file(model: nn.Module, file: Path, shards: dict, per_rank: set[str],
                     quant: dict | None, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tensors = _rank_tensors(model, shards, int(metadata["rank"]), per_rank)
    metadata = {"format": "pt", **metadata}
    if quant:
        metadata[QUANT_METADATA] = json.dumps(quant)
    save_file(tensors, str(file), metadata=metadata)


def _write_description(model: nn.Module, description: Path, tp: int, save_id: str,
                       shards: dict, quant: dict | None) -> None:
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(description.parent)
    saved = set(_unique_state(model))
    body = {"type": "shardwise", "version": VERSION, "tp_size": tp,
            "dtype": (quant and quant.get("dtype")) or _dtype_name(model),
            "save_id": save_id, "checkpoints": [rank_file(r, tp) for r in range(tp)],
            "shards": {k: v for k, v in shards.items() if k in saved}}
    if quant:
        body["quant"] = _qckpt().description_entry(quant)
    description.write_text(json.dumps(body, indent=1))


def _shared_id(comm: Communicator) -> str:
    value = torch.tensor([uuid.uuid4().int & (2**62 - 1)], dtype=torch.int64)
    if comm.world_size > 1:
        value = comm.broadcast(value, src=0)
    return f"{int(value.item()):016x}"


def _shard_entries(prepared: PreparedShards) -> dict[str, dict[str, Any]]:
    """Tensor name → {dim, size, ranges per rank} for every sliced tensor (row-parallel biases,
    kept whole on rank 0, are replicated)."""
    out = {}
    for spec in prepared.specs:
        per_rank = [param_ranges(spec, r) for r in range(prepared.tp_size)]
        for pname, keep in per_rank[0].items():
            if isinstance(keep, tuple):
                out[f"{spec.name}.{pname}"] = {
                    "dim": keep[0], "size": spec.size,
                    "ranges": [[list(r) for r in rank[pname][1]] for rank in per_rank]}
    return out


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors once (the first name)."""
    seen, out = set(), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def _rank_tensors(model: nn.Module, shards: dict, rank: int,
                  per_rank: set[str]) -> dict[str, torch.Tensor]:
    """What ``rank``'s file holds: its slices of the sharded tensors, its own quantized tensors
    (``per_rank``), and on rank 0 the replicated rest."""
    out = {}
    for name, tensor in _unique_state(model).items():
        if name in shards or name in per_rank or rank == 0:
            out[name] = tensor.detach().to("cpu").contiguous()
    return out


def _quant_manifest(model: nn.Module) -> dict[str, Any] | None:
    """This rank's quantization manifest (None for a model without quantized layers)."""
    return _qckpt().manifest(model) if _qckpt().is_quantized(model) else None


def _dtype_name(model: nn.Module) -> str:
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"

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

VERSION = 1


def rank_file(rank: int, tp_size: int) -> str:
    return f"rank{rank:02d}-of-{tp_size:02d}.safetensors"


def save_checkpoint(model: nn.Module, path: str | Path, *, prepared: PreparedShards | None = None,
                    communicator: Communicator | None = None) -> Path:
    """Write ``model`` (sharded by ``prepared`` across ``communicator``, or whole) to ``path``;
    every rank calls it. Returns the description file's path."""
    from safetensors.torch import save_file

    comm = communicator or LocalCommunicator()
    tp = prepared.tp_size if prepared is not None else 1
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_id = _shared_id(comm)
    shards = _shard_entries(prepared) if prepared is not None else {}
    if comm.rank < tp:
        tensors = _rank_tensors(model, shards, comm.rank)
        save_file(tensors, str(out / rank_file(comm.rank, tp)),
                  metadata={"format": "pt", "save_id": save_id, "rank": str(comm.rank),
                            "tp_size": str(tp)})
    comm.barrier()
    description = out / DESCRIPTION_NAME
    if comm.rank == 0:  # last, so a description means every rank file is complete
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(out)
        saved = set(_unique_state(model))
        body = {"type": "shardwise", "version": VERSION, "tp_size": tp,
                "dtype": _dtype_name(model), "save_id": save_id,
                "checkpoints": [rank_file(r, tp) for r in range(tp)],
                "shards": {k: v for k, v in shards.items() if k in saved}}
        description.write_text(json.dumps(body, indent=1))
    comm.barrier()
    return description


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


def _rank_tensors(model: nn.Module, shards: dict, rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in _unique_state(model).items():
        if name in shards or rank == 0:
            out[name] = tensor.detach().to("cpu").contiguous()
    return out


def _dtype_name(model: nn.Module) -> str:
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"

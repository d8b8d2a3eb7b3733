"""Writing a sharded checkpoint: one safetensors file per rank plus a description.

Each rank writes the slices it holds of the sharded tensors (its tensor-parallel slices, and
under expert parallelism its experts: dim 0 of each experts module's parameters); rank 0's file
also holds the replicated tensors (once). The description (``shardwise_checkpoint.json``, type
``"shardwise"``) records, per sharded tensor, the dim split, its full size and every rank's index
ranges, so :func:`~shardwise.checkpoint.load_checkpoint` can load it at any tp or ep size: the
same one reads each rank's own file, another merges or splits the pieces. Its ``tp_size`` is the
number of rank files (the ranks the model was split over, by tp or ep); ``ep_size`` is recorded
too. ``config.json`` is written next to it.

Saving is atomic per file (a temporary name, renamed into place) and the description is the
commit point: it is renamed into place last, after every rank's file is complete, and a re-save
never overwrites a rank file the old description names. So an interrupted save leaves the
folder's previous checkpoint loadable; a completed one removes the rank files it replaced.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..communicator import Communicator, LocalCommunicator
from ..sharding.apply import PreparedShards, param_ranges
from ..sharding.specs import expert_param_ranges
from .description import DESCRIPTION_NAME
from .extensions import CHECKPOINT_VIEW, RANK_METADATA, SavedEntries, registered

VERSION = 1


def rank_file(rank: int, tp_size: int, save_id: str | None = None) -> str:
    """A rank file's name: ``rank00-of-02.safetensors``, or with the save id in it
    (``rank00-of-02.<save_id>.safetensors``) when an older checkpoint in the folder still uses
    the plain name."""
    tag = f".{save_id}" if save_id else ""
    return f"rank{rank:02d}-of-{tp_size:02d}{tag}.safetensors"


#: what :func:`save_checkpoint` writes (and so may remove once no description names it)
_RANK_FILE = re.compile(r"rank\d{2,}-of-\d{2,}(\.[0-9a-f]{16})?\.safetensors(\.tmp)?")


def save_checkpoint(model: nn.Module, path: str | Path, *, prepared: PreparedShards | None = None,
                    communicator: Communicator | None = None) -> Path:
    """Write ``model`` (sharded by ``prepared`` across ``communicator``, or whole) to ``path``;
    every rank calls it. Data a registered extension stores for the model (a quantized model's
    packed layers: :mod:`.extensions`) is written as it is. Returns the description's path.

    Re-saving into a folder that holds a checkpoint is atomic: every file is written under a
    temporary name and renamed into place, rank files never take a name the old description
    still uses (they get the save id in theirs), and rank 0 renames the description last, once
    every rank's file is complete. An interrupted save leaves the old checkpoint loadable; a
    complete one removes the rank files its description does not name."""
    comm = communicator or LocalCommunicator()
    tp = split_ranks(prepared)  # one file per rank holding its own slices
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_id, plain = _shared_id(comm, out, tp)
    names = [rank_file(r, tp, None if plain else save_id) for r in range(tp)]
    saved = _extension_entries(model)
    per_rank = {k for entries in saved.values() for k in entries.tensors}  # stored whole per rank
    shards = _shard_entries(prepared, tp) if prepared is not None else {}
    shards = {k: v for k, v in shards.items() if k not in per_rank}
    if comm.rank < tp:
        _write_rank_file(model, out / names[comm.rank], shards, per_rank, saved,
                         {"save_id": save_id, "rank": str(comm.rank), "tp_size": str(tp)})
    comm.barrier()
    description = out / DESCRIPTION_NAME
    if comm.rank == 0:  # last, so a description means every rank file is complete
        _write_description(model, description, tp, save_id, shards,
                           {n: e.description for n, e in saved.items()}, names,
                           prepared.ep_size if prepared is not None and prepared.experts else 1)
        _remove_stale(out, names)
    comm.barrier()
    return description


def _write_rank_file(model: nn.Module, file: Path, shards: dict, per_rank: set[str],
                     saved: dict[str, SavedEntries], metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    tensors = _rank_tensors(model, shards, int(metadata["rank"]), per_rank)
    metadata = {"format": "pt", **metadata}
    if saved:
        metadata[RANK_METADATA] = json.dumps({n: e.rank for n, e in saved.items()})
    _atomic(file, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def _write_description(model: nn.Module, description: Path, tp: int, save_id: str,
                       shards: dict, extensions: dict[str, Any], names: list[str],
                       ep: int = 1) -> None:
    """``shardwise_checkpoint.json`` (and ``config.json`` beside it): the rank files ``names``,
    the tensor-parallel ``shards`` stored, each extension's description entry."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        _atomic(description.parent / "config.json", lambda tmp: _save_config(config, tmp))
    stored = set(_unique_state(model))
    body = {"type": "shardwise", "version": VERSION, "tp_size": tp, "ep_size": ep,
            "dtype": _dtype_name(model),
            "save_id": save_id, "checkpoints": names,
            "shards": {k: v for k, v in shards.items() if k in stored}}
    if extensions:
        body["extensions"] = extensions
    _atomic(description, lambda tmp: tmp.write_text(json.dumps(body, indent=1)))


def _atomic(final: Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)``, flush it to disk, then rename it to ``final`` (atomic on POSIX): a reader
    sees the old ``final`` or the complete new one, never a partial file. An interrupted write
    removes its temporary file."""
    tmp = final.with_name(final.name + ".tmp")
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(final.parent)


def _save_config(config: Any, tmp: Path) -> None:
    """``config.save_pretrained`` (its checks included) into a scratch folder, moved to ``tmp``."""
    scratch = tmp.with_name(tmp.name + ".d")
    scratch.mkdir(exist_ok=True)
    try:
        config.save_pretrained(scratch)
        os.replace(scratch / "config.json", tmp)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # a directory on a filesystem that cannot sync one
        pass
    finally:
        os.close(fd)


def _remove_stale(out: Path, names: list[str]) -> None:
    """After the new description is in place: rank files (and leftover temporary ones) of
    earlier or interrupted saves, which it does not name."""
    keep = set(names)
    for f in out.iterdir():
        if f.name not in keep and _RANK_FILE.fullmatch(f.name) and f.is_file():
            f.unlink(missing_ok=True)


def _shared_id(comm: Communicator, out: Path, tp: int) -> tuple[str, bool]:
    """(the save id, whether the plain rank-file names are free in ``out``), as rank 0 sees
    them, on every rank."""
    plain = not any((out / rank_file(r, tp)).exists() for r in range(tp))
    value = torch.tensor([uuid.uuid4().int & (2**62 - 1), int(plain)], dtype=torch.int64)
    if comm.world_size > 1:
        value = comm.broadcast(value, src=0)
    return f"{int(value[0].item()):016x}", bool(value[1].item())


def split_ranks(prepared: PreparedShards | None) -> int:
    """The ranks ``prepared`` splits the model over (one rank file each): the tp size, or the
    ep size when experts are split over more (this version: each spans the world)."""
    if prepared is None:
        return 1
    return max(prepared.tp_size, prepared.ep_size if prepared.experts else 1)


def _shard_entries(prepared: PreparedShards, ranks: int) -> dict[str, dict[str, Any]]:
    """Tensor name → {dim, size, ranges per rank} for every sliced tensor (row-parallel biases,
    kept whole on rank 0, are replicated; an experts module's parameters are split along dim 0
    by each of the ``ranks`` ranks' experts)."""
    out = {}
    for spec in prepared.experts:
        per_rank = [expert_param_ranges(spec, prepared.ep_coord(r)) for r in range(ranks)]
        for pname, (dim, _) in per_rank[0].items():
            out[f"{spec.name}.{pname}"] = {
                "dim": dim, "size": spec.total,
                "ranges": [[list(r) for r in rank[pname][1]] for rank in per_rank]}
    for spec in prepared.specs:
        per_rank = [param_ranges(spec, r) for r in range(prepared.tp_size)]
        for pname, keep in per_rank[0].items():
            if isinstance(keep, tuple):
                out[f"{spec.name}.{pname}"] = {
                    "dim": keep[0], "size": spec.size,
                    "ranges": [[list(r) for r in rank[pname][1]] for rank in per_rank]}
    out.update(_head_param_entries(prepared))
    return out


def _head_param_entries(prepared: PreparedShards) -> dict[str, dict[str, Any]]:
    """The attention modules' per-head parameters the policy narrows to each rank's heads
    (``Policy.attention_head_params``: GPT-OSS's sinks), split along dim 0 by the heads."""
    out = {}
    params = getattr(prepared.policy, "attention_head_params", {})
    if not prepared.heads or not params:
        return out
    for name, module in prepared.attention.items():
        for attr, unit in params.items():
            if not isinstance(getattr(module, attr, None), torch.Tensor):
                continue
            ranges = [h.q_range if unit == "heads" else h.kv_range for h in prepared.heads]
            total = prepared.heads[0].num_heads if unit == "heads" else \
                prepared.heads[0].num_kv_heads
            out[f"{name}.{attr}"] = {"dim": 0, "size": total,
                                     "ranges": [[list(r)] for r in ranges]}
    return out


def _unique_state(model: nn.Module, views: bool = False) -> dict[str, torch.Tensor]:
    """The state dict with tied tensors once (the first name); with ``views``, a module's
    parameters a transform holds in another layout as that module's own layout gives them
    (:data:`~shardwise.checkpoint.extensions.CHECKPOINT_VIEW`)."""
    seen, out = set(), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    if views:
        for module_name, module in model.named_modules():
            view = vars(module).get(CHECKPOINT_VIEW)
            if callable(view):
                prefix = f"{module_name}." if module_name else ""
                out.update({prefix + k: v for k, v in view().items() if prefix + k in out})
    return out


def _rank_tensors(model: nn.Module, shards: dict, rank: int,
                  per_rank: set[str]) -> dict[str, torch.Tensor]:
    """What ``rank``'s file holds: its slices of the sharded tensors, its own whole tensors of
    extensions (``per_rank``), and on rank 0 the replicated rest."""
    out = {}
    for name, tensor in _unique_state(model, views=True).items():
        if name in shards or name in per_rank or rank == 0:
            out[name] = tensor.detach().to("cpu").contiguous()
    return out


def _extension_entries(model: nn.Module) -> dict[str, SavedEntries]:
    """Extension name → what it stores for ``model`` (only those storing something)."""
    out = {}
    for ext in registered():
        entries = ext.save_entries(model)
        if entries is not None:
            out[ext.name] = entries
    return out


def _dtype_name(model: nn.Module) -> str:
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"


# ----- pipeline stages ---------------------------------------------------------------------------

#: the Hugging Face index a pipeline engine's save writes (the commit point)
HF_INDEX = "model.safetensors.index.json"
#: what :func:`save_stages_checkpoint` writes (and so may remove once the index does not name it)
_STAGE_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors(\.tmp)?")


def stage_file(stage: int, stages: int) -> str:
    """Stage ``stage``'s file: ``model-00001-of-00002.safetensors`` (Hugging Face's names)."""
    return f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"


def save_stages_checkpoint(model: nn.Module, path: str | Path, stages,
                           communicator: Communicator) -> Path:
    """Write a pipeline engine's model (``stages``: this rank's
    :class:`~shardwise.pipeline.PipelineReport`) to ``path`` as a Hugging Face sharded
    checkpoint; every rank of the pipeline calls it. Each stage writes its own tensors into one
    file (``model-0000s-of-0000P.safetensors``): its decoder layers', the first stage also the
    embedding and every tensor outside the layers and the head (final norm, position tables:
    each stage holds a copy, written once), the last stage the head (not when it is tied to the
    embedding, which the first stage writes). The first stage writes ``config.json`` and, last,
    once every stage's file is complete, ``model.safetensors.index.json`` (the commit point).
    The folder then loads with ``init_inference(None, checkpoint=path, ...)`` at any
    pp / tp — each stage reading only its tensors — and with ``from_pretrained``.

    Returns the index's path; for stages carrying extension data (quantized stages: packed
    layers, no Hugging Face tensors) the description's path of the one shardwise checkpoint
    :func:`save_extended_stages` writes instead.

    Injected stages save as the model's own tensors (the injected layers adopt the HF
    modules' parameters; a layout a transform changed is saved as the module's own through
    :data:`~shardwise.checkpoint.extensions.CHECKPOINT_VIEW`, as :func:`save_checkpoint` does),
    so the folder loads with or without injection.

    Raises:
        NotSupportedYetError: tensor parallelism within the stages, extension data the
            stages cannot merge, or (for a Hugging Face save) a folder holding a shardwise
            checkpoint (its description would be read instead); each message says what to do.
    """
    comm = stages.communicator
    _check_stages_save(model, stages, communicator, Path(path))
    if _extension_entries(model):  # quantized stages: one shardwise checkpoint, tp size 1
        return save_extended_stages(model, path, stages)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    plan = stages.plan
    names = [stage_file(s, plan.size) for s in range(plan.size)]
    tensors = _stage_tensors(model, stages)
    _atomic(out / names[plan.coord], lambda tmp: _save_tensors(tensors, tmp))
    weight_map = {}
    for stage, stage_names in enumerate(_gather_names(comm, sorted(tensors))):
        weight_map.update({name: names[stage] for name in stage_names})
    comm.barrier()  # every stage's file is complete
    index = out / HF_INDEX
    if plan.first:
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            _atomic(out / "config.json", lambda tmp: _save_config(config, tmp))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        body = {"metadata": {"format": "pt", "saved_by": "shardwise pipeline stages",
                             "stages": plan.size, "first_stage_bytes": total},
                "weight_map": dict(sorted(weight_map.items()))}
        _atomic(index, lambda tmp: tmp.write_text(json.dumps(body, indent=1)))
        keep = set(names)
        for f in out.iterdir():  # earlier saves' stage files the index does not name
            if f.name not in keep and _STAGE_FILE.fullmatch(f.name) and f.is_file():
                f.unlink(missing_ok=True)
    comm.barrier()
    return index


def _check_stages_save(model: nn.Module, stages, communicator: Communicator, out: Path) -> None:
    from ..errors import NotSupportedYetError

    if stages.communicator.world_size != communicator.world_size:
        raise NotSupportedYetError(
            "saving a checkpoint from pipeline stages with tensor parallelism inside them is not "
            "supported yet (each stage's tensors are split over its tp ranks); save from an "
            "engine with pipeline_parallel alone, or with tensor_parallel alone")
    check_stages_target(model, stages, out)


def check_stages_target(model: nn.Module, stages, out: Path) -> None:
    """The refusals of a stages save that every rank can decide alone (the model's checkpoint
    extensions, the target folder): under tensor parallelism or replicas, where only some
    ranks write, every rank calls this first, so a refusal reaches every rank by name instead of
    leaving the others waiting for the writers.

    Raises:
        NotSupportedYetError: an extension the stages cannot merge, or a folder that holds a
            shardwise tensor-parallel checkpoint.
    """
    from ..errors import NotSupportedYetError

    mergeable = stages.MERGED_EXTENSIONS
    unknown = sorted(set(_extension_entries(model)) - set(mergeable))
    if unknown:
        raise NotSupportedYetError(
            f"saving a checkpoint from pipeline stages carrying the checkpoint extension(s) "
            f"{unknown} is not supported yet (the stages merge only {list(mergeable)}); save "
            f"from an engine without pipeline_parallel")
    if (out / DESCRIPTION_NAME).exists() and not _extension_entries(model):
        raise NotSupportedYetError(
            f"{out} holds a shardwise tensor-parallel checkpoint ({DESCRIPTION_NAME}), which a "
            f"load would read instead of the pipeline stages' files; save into another folder")


def _stage_tensors(model: nn.Module, stages, extended: frozenset[str] = frozenset()
                   ) -> dict[str, torch.Tensor]:
    """This stage's tensors (state-dict names → CPU tensors): those under its decoder layers;
    on the first stage also everything outside the layers and the head; on the last the head
    unless it is tied to the embedding. ``extended``: the tensors an extension stores for this
    stage (a quantized stage's packed layers): a head holding some is written by the last
    stage even when tied (an extension stores a tied table once, under the head's name), and
    the first stage's own copy of it (extension tensors under the embedding's name) is not."""
    from ..pipeline.transform import RemoteHead, RemoteLayer

    plan = stages.plan
    containers = {name.rpartition(".")[0] for name, m in model.named_modules()
                  if isinstance(m, RemoteLayer)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_name = next((n for n, m in model.named_modules() if m is head), None) \
        if isinstance(head, nn.Module) and not isinstance(head, RemoteHead) else None
    tied = plan.tied
    head_extended = head_name is not None and any(n.startswith(f"{head_name}.")
                                                  for n in extended)
    embed_name = plan.embed_name
    out = {}
    for name, tensor in _unique_state(model, views=True).items():
        in_layers = any(name.startswith(f"{c}.") for c in containers)
        in_head = head_name is not None and name.startswith(f"{head_name}.")
        if in_head:
            keep = plan.last and (not tied or head_extended)
        elif name in extended and embed_name and name.startswith(f"{embed_name}."):
            keep = False  # the first stage's copy of a tied table: the head's is stored
        else:
            keep = in_layers or plan.first
        if keep:
            out[name] = tensor.detach().to("cpu").contiguous()
    return out


def _save_tensors(tensors: dict[str, torch.Tensor], tmp: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(tmp), metadata={"format": "pt"})


def _gather_names(comm: Communicator, names: list[str]) -> list[list[str]]:
    """Every rank's ``names``, in rank order (two all-gathers: lengths, then the padded bytes)."""
    data = torch.tensor(list(json.dumps(names).encode()), dtype=torch.uint8)
    lengths = comm.all_gather(torch.tensor([data.numel()], dtype=torch.int64))
    longest = int(lengths.max())
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:data.numel()] = data
    every = comm.all_gather(padded.unsqueeze(0)).reshape(len(lengths), longest)
    return [json.loads(bytes(every[r, :int(lengths[r])].tolist()).decode())
            for r in range(len(lengths))]


# ----- pipeline stages carrying extension data (quantized stages) ---------------------------------

def save_extended_stages(model: nn.Module, path: str | Path, stages) -> Path:
    """Write pipeline stages whose model carries checkpoint-extension data (quantized stages:
    packed layers) as ONE shardwise checkpoint of the whole model at tp size 1 (a rank file and
    ``shardwise_checkpoint.json``, as :func:`save_checkpoint` writes for the same model in one
    process): every stage sends its tensors (as :func:`_stage_tensors` picks them) and its
    extensions' rank entries to the first stage; there ``stages.merge_entries`` (the pipeline
    package's: :meth:`~shardwise.pipeline.PipelineReport.merge_entries`) makes each
    extension's rank and description entries of the whole model, and the first stage writes
    the file, then the description last (the commit point). Every rank of the pipeline calls
    it. The first stage holds the whole model's tensors in host memory while it writes; the
    folder loads as any tp-size-1 shardwise checkpoint (a quantized one without
    re-quantizing). Returns the description's path."""
    comm, plan = stages.communicator, stages.plan
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_id, plain = _shared_id(comm, out, 1)
    saved = _extension_entries(model)
    extended = frozenset(k for entries in saved.values() for k in entries.tensors)
    tensors = _stage_tensors(model, stages, extended)
    parts = _gather_to_first(comm, plan, tensors, {n: e.rank for n, e in saved.items()})
    description = out / DESCRIPTION_NAME
    if plan.first:
        everything, names = {}, sorted({n for _, entries in parts for n in entries})
        for part, _ in parts:
            everything.update(part)
        merged = {n: stages.merge_entries(n, [entries.get(n) for _, entries in parts])
                  for n in names}  # name → (rank entry, description entry)
        name = rank_file(0, 1, None if plain else save_id)
        metadata = {"format": "pt", "save_id": save_id, "rank": "0", "tp_size": "1",
                    RANK_METADATA: json.dumps({n: rank for n, (rank, _) in merged.items()})}
        from safetensors.torch import save_file

        _atomic(out / name, lambda tmp: save_file(everything, str(tmp), metadata=metadata))
        _write_description(model, description, 1, save_id, {},
                           {n: entry for n, (_, entry) in merged.items()}, [name])
        _remove_stale(out, [name])
    comm.barrier()
    return description


def _gather_to_first(comm: Communicator, plan, tensors: dict[str, torch.Tensor],
                     entries: dict[str, Any]) -> list[tuple[dict[str, torch.Tensor], dict]]:
    """Every stage's (tensors, extension rank entries) on the first stage, first stage first
    (point-to-point: a length, then the safetensors bytes with the entries in their metadata);
    the other stages get an empty list."""
    from safetensors.torch import load as st_load, save as st_save

    first = plan.ranks[0]
    if not plan.first:
        data = st_save(tensors, metadata={"entries": json.dumps(entries)})
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        comm.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=first)
        comm.send(payload, dst=first)
        return []
    parts = [(tensors, entries)]
    for stage in range(1, plan.size):
        src = plan.ranks[stage]
        length = torch.zeros(1, dtype=torch.int64)
        comm.recv(length, src=src)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        comm.recv(payload, src=src)
        data = payload.numpy().tobytes()
        parts.append((st_load(data), json.loads(_safetensors_metadata(data)["entries"])))
    return parts


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of safetensors ``data`` (its JSON header)."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]).get("__metadata__", {})

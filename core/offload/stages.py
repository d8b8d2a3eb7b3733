"""Offload with pipeline stages (``offload=`` with ``pipeline_parallel=``).

Each rank streams only its own stage: by the time the offload step runs, the pipeline step has
replaced the other stages' decoder layers, the input embedding off the first stage and the
output head off the last by weightless stand-ins, so :func:`~shardwise.offload.transform.
offload_units` finds units with tensors only among this stage's modules (a stand-in has none).
What stages add here is the store's identity: each stage's blobs are a shard of their own
(:func:`stage_dims`), so two stages never share, nor take each other's blobs for stale ones.

With ``checkpoint=`` the units are written while the checkpoint is read, before the pipeline
step: :func:`replaced_modules` names what that step will replace, :func:`stage_units` keeps the
units this stage streams, and the loader reads only this stage's tensors
(:func:`shardwise.offload.checkpoint.load_to_store`'s ``skip_modules`` / ``dropped_modules``);
the stage's split joins the fingerprint and its coordinate and units the shard
(:func:`stage_identity`), so blobs of another stage or split are never used.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn


def stage_dims(plan: Any) -> dict[str, Any]:
    """``{"pp": plan.pp}`` when ``plan`` cuts the model into pipeline stages (its size then
    joins the store's fingerprint and this rank's stage its shard coordinates), else empty
    (a store without stages keeps the fingerprint it had)."""
    pp = getattr(plan, "pp", None)
    return {"pp": pp} if pp is not None and getattr(pp, "size", 1) > 1 else {}


def replaced_modules(model: nn.Module, layers: nn.ModuleList, stages: Any) -> tuple[str, ...]:
    """Names (``model.named_modules()``'s) of the modules the pipeline step replaces by
    stand-ins on this rank (``stages``: its :class:`~shardwise.pipeline.stages.StagePlan`): the
    modules the loader skips (:func:`~shardwise.pipeline.stages.foreign_modules`) plus the
    output head off the last stage, which the first stage reads when it is tied to the
    embedding (one table) but does not keep. Their tensors neither stream nor stay resident
    here."""
    from ..pipeline.stages import foreign_modules

    out = list(foreign_modules(model, layers, stages))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module) and not stages.last:
        name = next(n for n, m in model.named_modules() if m is head)
        if name not in out:
            out.append(name)
    return tuple(out)


def stage_units(units: Sequence[Any], replaced: Sequence[str]) -> list[Any]:
    """The checkpoint units (:class:`~shardwise.offload.checkpoint.CheckpointUnit`) this stage
    streams: those not among ``replaced``, renumbered in order from 0 (as the offload step
    numbers the units it finds after the pipeline step)."""
    kept = [u for u in units if u.name not in set(replaced)]
    return [type(u)(i, u.name, u.module) for i, u in enumerate(kept)]


def stage_identity(stages: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(fingerprint part, shard part)`` of a stage's checkpoint-written store: the split
    (every stage's layers: the same on every rank, so another split is another store group,
    listed as stale) and this rank's stage (its shard)."""
    return ({"pp": {"size": stages.size, "bounds": [list(b) for b in stages.bounds]}},
            {"stage": stages.coord})

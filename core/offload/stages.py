"""Offload with pipeline stages (``offload=`` with ``pipeline_parallel=``).

Each rank streams only its own stage: by the time the offload step runs, the pipeline step has
replaced the other stages' decoder layers, the input embedding off the first stage and the
output head off the last by weightless stand-ins, so :func:`~shardwise.offload.transform.
offload_units` finds units with tensors only among this stage's modules (a stand-in has none).
What stages add here is the store's identity: each stage's blobs are a shard of their own
(:func:`stage_dims`), so two stages never share, nor take each other's blobs for stale ones.
"""

from __future__ import annotations

from typing import Any


def stage_dims(plan: Any) -> dict[str, Any]:
    """``{"pp": plan.pp}`` when ``plan`` cuts the model into pipeline stages (its size then
    joins the store's fingerprint and this rank's stage its shard coordinates), else empty
    (a store without stages keeps the fingerprint it had)."""
    pp = getattr(plan, "pp", None)
    return {"pp": pp} if pp is not None and getattr(pp, "size", 1) > 1 else {}

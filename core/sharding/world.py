"""The tensor-parallel group versus the world: checked before any process group or weight work.

This version builds one tensor-parallel group that is the whole world (``world == tp_size``);
data-parallel replicas of TP groups (``world = replicas × tp_size``) are refused with that
explanation rather than guessed.
"""

from __future__ import annotations

import torch.distributed as dist

from ..communicator import world_size_from_env
from .errors import ShardingError


def current_world_size() -> int:
    """The world this process belongs to: the initialised default group, else ``WORLD_SIZE``."""
    return dist.get_world_size() if dist.is_initialized() else world_size_from_env()


def tp_world_problem(tp_size: int, world_size: int) -> str | None:
    """Why ``tp_size`` cannot run in a world of ``world_size`` ranks (None when it can)."""
    if tp_size == 1 or tp_size == world_size:
        return None
    how = (f"launch {tp_size} ranks, e.g. `torchrun --nproc-per-node {tp_size} your_script.py`"
           f" (WORLD_SIZE={tp_size})")
    if world_size == 1:
        return (f"tp_size={tp_size} needs {tp_size} ranks, but this process runs alone "
                f"(WORLD_SIZE is unset or 1); {how}")
    if tp_size > world_size or world_size % tp_size:
        return (f"tp_size={tp_size} does not fit a world of {world_size} ranks (the world must "
                f"be a multiple of tp_size); {how}")
    return (f"tp_size={tp_size} in a world of {world_size} ranks would need "
            f"{world_size // tp_size} data-parallel replicas, which this version does not "
            f"support; run with world size == tp_size ({how})")


def check_tp_world(tp_size: int, world_size: int | None = None) -> None:
    """Raise :class:`ShardingError` when ``tp_size`` does not fit the world (see above)."""
    problem = tp_world_problem(tp_size, current_world_size() if world_size is None else world_size)
    if problem:
        raise ShardingError(problem)

"""The error sharding raises: a :class:`~shardwise.ConfigError`, so it is raised before any heavy
work and callers catching bad configuration catch it too."""

from __future__ import annotations

from ..errors import ConfigError


class ShardingError(ConfigError):
    """A tensor-parallel plan cannot be applied: a size that does not split, a module a plan names
    that does not exist, a model with nothing to shard, a world size that does not fit."""

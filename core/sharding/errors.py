"""The error sharding raises: a :class:`~shardwise.ConfigError`, so it is raised before any heavy
work and callers catching bad configuration catch it too. Defined in the leaf
:mod:`shardwise.layout` (so :mod:`shardwise.policy` raises it without importing this package)."""

from __future__ import annotations

from ..layout import ShardingError

__all__ = ["ShardingError"]

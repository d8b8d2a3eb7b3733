"""Roles (what a module becomes under tensor parallelism) and layouts (how the split dimension is
organised): plain data defined in the leaf :mod:`shardwise.layout` (read it for the table of
roles and the list of layouts), re-exported here under their sharding names so policies write
``from shardwise.sharding.roles import ColumnParallel, Heads``."""

from __future__ import annotations

from ..layout import (HEAD_UNITS, ROLE_NAMES, ColumnParallel, Even, Fused, GroupedInterleaved,
                      HeadBlocks, Heads, Layout, PerHeadInterleaved, Replicated, Role, RowParallel,
                      ShardContext, VocabParallelEmbedding, VocabParallelHead)

__all__ = ["HEAD_UNITS", "ROLE_NAMES", "ColumnParallel", "Even", "Fused", "GroupedInterleaved",
           "HeadBlocks", "Heads", "Layout", "PerHeadInterleaved", "Replicated", "Role",
           "RowParallel", "ShardContext", "VocabParallelEmbedding", "VocabParallelHead"]

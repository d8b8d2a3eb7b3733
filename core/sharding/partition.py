"""Pure partition arithmetic (which slice of a dimension, which heads each rank keeps): defined in
the leaf :mod:`shardwise.layout`, re-exported here under its sharding name."""

from __future__ import annotations

from ..layout import (HeadCounts, HeadPartition, Range, divisors, even_range, even_sizes,
                      head_split_problem, working_head_tp_sizes)

__all__ = ["HeadCounts", "HeadPartition", "Range", "divisors", "even_range", "even_sizes",
           "head_split_problem", "working_head_tp_sizes"]

"""Tensor parallelism from a declarative plan: ``shardwise.sharding``.

One mechanism applies a plan — module-name patterns → roles (:mod:`shardwise.layout`) — to a
model in place; plans come from the user's ``injection_policy``, the model's HF ``tp_plan``, a
family :class:`~shardwise.policy.Policy`, or (last) a structural heuristic. Usable alone::

    from shardwise.sharding import shard_model
    report = shard_model(model, communicator=comm)     # plan chosen as init_inference would
    print(report.summary())

Modules: :mod:`.plan` (plans and their sources), :mod:`.specs` (planning: what each rank keeps,
every check, touching nothing), :mod:`.apply` (applying: slices, hooks, attention attributes,
each recorded in the ledger), :mod:`.report`, :mod:`.inputs` (forward arguments narrowed to the
rank's heads, e.g. BLOOM's ALiBi). Roles, layouts and head partitions are plain data in the leaf
:mod:`shardwise.layout` (re-exported by :mod:`.roles` and :mod:`.partition`), so
:mod:`shardwise.policy` and this package do not import each other.
"""

from .apply import (ConfigView, apply_shards, gather_whole, install_hooks, shard_model,
                    slice_all, slice_module)
from .errors import ShardingError
from .inputs import HeadSlicedInput
from .partition import HeadPartition, even_range, even_sizes, head_split_problem
from .plan import (PlanRow, ShardingPlan, choose_plan, heuristic_plan, pattern_matches,
                   plan_from_hf, plan_from_injection_policy, plan_from_policy)
from .report import ShardedModule, ShardReport
from .roles import (ColumnParallel, Even, Fused, GroupedInterleaved, Heads, Layout,
                    PerHeadInterleaved, Replicated, Role, RowParallel, ShardContext,
                    VocabParallelEmbedding, VocabParallelHead)
from .specs import (HeadSplit, PreparedShards, ShardSpec, module_kind, param_ranges, prepare,
                    prepare_for, resolve_plan)
from .world import check_tp_world, tp_world_problem

__all__ = [
    "PreparedShards", "ShardSpec", "HeadSplit", "apply_shards", "module_kind", "prepare",
    "prepare_for", "resolve_plan", "param_ranges", "shard_model", "slice_all", "slice_module",
    "install_hooks", "gather_whole", "ConfigView", "ShardingError", "HeadPartition",
    "even_range", "even_sizes", "head_split_problem", "PlanRow", "ShardingPlan", "choose_plan",
    "heuristic_plan", "pattern_matches", "plan_from_hf", "plan_from_injection_policy",
    "plan_from_policy", "ShardedModule", "ShardReport", "ColumnParallel", "Even", "Fused",
    "Heads", "Layout", "PerHeadInterleaved", "Replicated", "Role", "RowParallel", "ShardContext",
    "VocabParallelEmbedding", "VocabParallelHead", "check_tp_world", "tp_world_problem",
    "GroupedInterleaved", "HeadSlicedInput",
]

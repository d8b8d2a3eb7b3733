"""Tensor parallelism from a declarative plan: ``shardwise.sharding``.

One mechanism applies a plan — module-name patterns → :mod:`roles <shardwise.sharding.roles>` — to
a model in place; plans come from the user's ``injection_policy``, the model's HF ``tp_plan``, a
family :class:`~shardwise.policy.Policy`, or (last) a structural heuristic. Usable alone::

    from shardwise.sharding import shard_model
    report = shard_model(model, communicator=comm)     # plan chosen as init_inference would
    print(report.summary())

Modules: :mod:`.roles` (roles and layouts), :mod:`.partition` (pure split arithmetic),
:mod:`.plan` (plans and their sources), :mod:`.apply` (the applier), :mod:`.report`,
:mod:`.inputs` (forward arguments narrowed to the rank's heads, e.g. BLOOM's ALiBi).
"""

from .apply import (PreparedShards, ShardSpec, apply_shards, module_kind, prepare, prepare_for,
                    shard_model, slice_all, slice_module)
from .errors import ShardingError
from .inputs import HeadSlicedInput
from .partition import HeadPartition, even_range, even_sizes, head_split_problem
from .plan import (PlanRow, ShardingPlan, choose_plan, heuristic_plan, pattern_matches,
                   plan_from_hf, plan_from_injection_policy, plan_from_policy)
from .report import ShardedModule, ShardReport
from .world import check_tp_world, tp_world_problem
from .roles import (ColumnParallel, Even, Fused, Heads, Layout, PerHeadInterleaved, Replicated,
                    Role, RowParallel, ShardContext, VocabParallelEmbedding, VocabParallelHead)
from .roles import GroupedInterleaved

__all__ = [
    "PreparedShards", "ShardSpec", "apply_shards", "module_kind", "prepare", "prepare_for",
    "shard_model", "slice_all", "slice_module", "ShardingError", "HeadPartition", "even_range",
    "even_sizes", "head_split_problem", "PlanRow", "ShardingPlan", "choose_plan", "heuristic_plan",
    "pattern_matches", "plan_from_hf", "plan_from_injection_policy", "plan_from_policy",
    "ShardedModule", "ShardReport", "ColumnParallel", "Even", "Fused", "Heads", "Layout",
    "PerHeadInterleaved", "Replicated", "Role", "RowParallel", "ShardContext",
    "VocabParallelEmbedding", "VocabParallelHead", "check_tp_world", "tp_world_problem",
    "GroupedInterleaved", "HeadSlicedInput",
]

"""The resolved plan: every decision about how the model is split, made once, at the start of
``init_inference`` (docs/architecture.md, "One plan").

A :class:`Plan` is a plain object in the spirit of torchtitan's ``ParallelDims``: the world and,
per parallel dimension (:class:`Dim`: ``pp``, ``dp``, ``tp``, ``ep``), its size,
this rank's coordinate and its process group; the model's policy (looked up once), its head
counts and this rank's head / kv-head partition; the roles of every linear (the sharding plan's
rows resolved against the model) and, under tensor parallelism, every rank's slices. Sharding,
checkpoint loading, injection and quantization read it; none of them looks the policy up,
chooses a plan or splits heads again. ``engine.plan`` is the plan an engine was built with.

The dimensions and their checks (:func:`check_dims`), made before any process group exists:

* world = pp × tp × dp (``dp`` given: checked against the world; else the world's remainder);
  ranks are laid out tp fastest, then dp, then pp (Megatron's order), so
  ``rank = (pp_coord × dp + dp_coord) × tp + tp_coord``;
* data-parallel replicas: each replica — a TP group of tp ranks, or a pipeline of pp × tp
  ranks — runs on its own inputs. The engine broadcasts a replica's inputs from its first rank
  inside the replica (:attr:`Plan.inputs`, :meth:`Plan.input_ranks`) and every collective runs
  in a group inside it (tp: one stage of one replica, pp: one tp coordinate of one replica), so
  replicas never talk — except where they jointly form expert groups (below);
* ``tp_size=1`` in a larger world (each rank runs the whole model alone, as before) is dp =
  world with no collectives between the replicas — unless they form the expert-parallel group;
* the expert-parallel group is carved out of one pipeline stage's tp × dp ranks (as Megatron
  and vLLM do): ep divides tp × dp, and ``ep_coord = (dp_coord × tp + tp_coord) mod ep``. Under
  tensor parallelism (tp > 1) the expert group lies inside a tp group (ep divides tp: the
  ranks of a tp group hold the same tokens, the replicas stay apart); at tp 1 the expert groups
  span replicas, which then run on the same inputs (the engine broadcasts rank 0's to the
  world, as at pp 1);
* an ep group smaller than the world: several expert groups, each of ``ep`` consecutive ranks
  (``rank // ep``: ranks 0-1 and 2-3 at world 4, ep 2) holding every expert once, so each
  expert is held by ``world / ep`` ranks; the ranks hold the same tokens, so each group's
  all-reduce gives its ranks the whole MoE output. With pipeline stages each stage's tp × dp
  ranks (consecutive) hold whole expert groups;
* pipeline stages (``pipeline_parallel={"pp_size": P}``) run tp ranks per stage (each stage's
  layers split by tensor parallelism inside the stage), dp pipelines side by side:
  ``plan.stages`` (:class:`~shardwise.pipeline.StagePlan`) says which decoder layers each stage
  runs; ``pp_size`` above the layer count or a ``split`` that does not cover every layer once
  is a :class:`~shardwise.pipeline.PipelineConfigError`, checked before the dimensions.

Expert parallelism (``moe={"ep_size": N}``): the experts of every MoE layer are split by whole
experts over the N ep ranks (``plan.experts.ranges``; ``plan.sharding.experts`` the modules, an
:class:`~shardwise.layout.ExpertParallel` role); the dense parts follow tp: replicated at tp 1
(on 2 ranks ``ep_size=2`` alone), split by heads at tp = ep (``tp_size=2`` + ``ep_size=2``).

Mixture-of-Experts models: ``plan.experts`` (:class:`ExpertPlan`) holds the facts the policy reads
from the config (experts, top-k, shared experts, which layers are MoE) and every ep rank's expert
range (split ±1). ``moe=`` is checked against them first (a dense model, an expert count or type
not the model's, ep_size above the expert count), then the dimensions, so bad input gets its own
error before the dimensions'.

Process groups: at world 1 none; a dimension spanning the world gets the engine's communicator
(:meth:`Plan.bind`); otherwise the tp group is one stage's tp ranks of one replica and the pp
group the ranks of one tp coordinate of one replica across the stages (sub-groups of the world:
:meth:`Plan.dim_ranks`); the dp dimension has no group (replicas never talk), and
:attr:`Plan.inputs` is the group the engine broadcasts its inputs in.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping

import torch.distributed as dist
from torch import nn

from .communicator import env_world
from .config import MoEConfigError, MoESettings
from .errors import ConfigError, NotSupportedYetError
from .layout import HeadCounts, HeadPartition, Role, ShardingError, divisors
from .policy import GenericPolicy, MoEFacts, Policy, policy_for
from .sharding import plan as _plans
from .sharding.specs import (HeadSplit, PreparedShards, experts_only, no_policy_note, prepare,
                             prepare_experts, resolve_plan)
from .sharding.world import tp_world_problem

if TYPE_CHECKING:
    from .communicator import Communicator
    from .pipeline.config import PipelineSettings
    from .pipeline.stages import StagePlan

#: the dimensions, in rank-layout order (slowest first): pipeline, data, tensor; experts within
DIM_NAMES = ("pp", "dp", "tp", "ep")


class ParallelismNotSupportedError(ShardingError, NotSupportedYetError):
    """A combination of parallel dimensions this version does not run yet (an expert group
    spanning data-parallel replicas of a tensor-parallel group): the sizes are valid, the
    feature is not there yet."""


@dataclass(frozen=True)
class Dim:
    """One parallel dimension.

    Attributes:
        name: ``tp``, ``pp``, ``dp`` or ``ep``.
        size: how many ranks the dimension spans (1: not split along it).
        coord: this rank's coordinate along it, ``0 .. size - 1``.
        group: the :class:`~shardwise.Communicator` over the ranks that share every other
            coordinate with this one (None while the dimension needs no collectives: size 1,
            replicas that never talk, or before :meth:`Plan.bind`).
    """

    name: str
    size: int = 1
    coord: int = 0
    group: Any = None

    @property
    def enabled(self) -> bool:
        """Whether the model is split along this dimension (size > 1)."""
        return self.size > 1

    def __repr__(self) -> str:
        bound = ", group bound" if self.group is not None else ""
        return f"{self.name}={self.size}" + (f" (coord {self.coord}{bound})"
                                             if self.size > 1 else "")


def split_experts(total: int, ep: int) -> tuple[tuple[int, int], ...]:
    """Every ep rank's expert range ``[start, end)``: ``total`` experts over ``ep`` ranks, the
    first ``total % ep`` ranks one more (10 over 4: 3, 3, 2, 2)."""
    base, extra = divmod(total, ep)
    starts = [r * base + min(r, extra) for r in range(ep + 1)]
    return tuple((starts[r], starts[r + 1]) for r in range(ep))


@dataclass(frozen=True)
class ExpertPlan:
    """The Mixture-of-Experts part of the plan.

    Attributes:
        total: routed experts per MoE layer.
        top_k: experts each token is routed to.
        shared: shared (always-on) experts per MoE layer, replicated on every rank.
        moe_layers: indices of the decoder layers whose MLP is the MoE block.
        groups: group-limited routing ``(expert groups, groups each token may use)``
            (DeepSeek-V3's ``n_group`` / ``topk_group``); None: plain top-k.
        ranges: every ep rank's expert range ``[start, end)`` (:func:`split_experts`).
        coord: this rank's ep coordinate.
    """

    total: int
    top_k: int
    shared: int
    moe_layers: tuple[int, ...]
    groups: tuple[int, int] | None
    ranges: tuple[tuple[int, int], ...]
    coord: int = 0

    @classmethod
    def compute(cls, facts: MoEFacts, ep: "Dim") -> "ExpertPlan":
        return cls(facts.num_experts, facts.top_k, facts.shared, facts.moe_layers, facts.groups,
                   split_experts(facts.num_experts, ep.size), ep.coord)

    @property
    def range(self) -> tuple[int, int]:
        """This rank's experts ``[start, end)``."""
        return self.ranges[self.coord]

    def __repr__(self) -> str:
        start, end = self.range
        groups = f" in {self.groups[1]} of {self.groups[0]} groups" if self.groups else ""
        return (f"{self.total} per layer, top-{self.top_k}{groups}, {self.shared} shared, "
                f"{len(self.moe_layers)} MoE layers; this rank [{start}, {end}) of "
                f"{len(self.ranges)} ep ranks")


def check_dims(world: int, rank: int, tp: int = 1, pp: int = 1, dp: int | None = None,
               ep: int = 1, max_ep: int | None = None) -> dict[str, Dim]:
    """The dimensions for ``world`` ranks as name → :class:`Dim` (this ``rank``'s coordinates),
    after every check, before any process group exists. ``dp`` None: the world's remainder
    (``world // (pp × tp)``: the data-parallel replicas); given, it must make pp × tp × dp the
    world. ``max_ep``: the model's expert count (the ep sizes an error suggests are at most
    that).

    Raises:
        ShardingError: sizes that do not multiply to the world, or an ep that does not divide
            tp × dp (each naming the sizes that would work).
        ParallelismNotSupportedError: under tensor parallelism, an expert group wider than a tp
            group (ep not dividing tp_size; not supported yet: named, with the ep sizes that
            would work).
        ConfigError: a size that is not a positive integer.
    """
    for name, size in (("world", world), ("tp_size", tp), ("pp_size", pp), ("ep_size", ep),
                       ("dp_size", 1 if dp is None else dp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {size!r}")
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is not a rank of a world of {world}")
    if pp == 1 and dp is None:
        _check_tp_world(tp, world)
    if pp > 1 and world == 1:
        raise ShardingError(
            f"pipeline_parallel pp_size={pp} needs {pp * tp} ranks (pp_size × tp_size), but "
            f"this process runs alone (WORLD_SIZE is unset or 1); launch them, e.g. `shardwise "
            f"launch --nproc-per-node {pp * tp} your_script.py` (WORLD_SIZE={pp * tp})")
    if world % (pp * tp):
        raise ShardingError(
            f"world = pp × tp × dp: pp_size={pp} × tp_size={tp} does not divide the world of "
            f"{world} ranks; tp sizes that would (with pp_size={pp}): "
            f"{', '.join(map(str, divisors(world // pp) if world % pp == 0 else [])) or 'none'}")
    dp_size = world // (pp * tp) if dp is None else dp
    if pp * tp * dp_size != world:
        raise ShardingError(
            f"world = pp × tp × dp: {pp} × {tp} × {dp_size} = {pp * tp * dp_size}, not the "
            f"world of {world} ranks; with pp_size={pp} and tp_size={tp}, dp_size would be "
            f"{world // (pp * tp)} (or launch {pp * tp * dp_size} ranks)")
    if ep > 1 and world == 1:
        raise ShardingError(
            f"ep_size={ep} needs {ep} ranks (one share of the experts each), but this process "
            f"runs alone (WORLD_SIZE is unset or 1); launch {ep} ranks, e.g. `torchrun "
            f"--nproc-per-node {ep} your_script.py` (WORLD_SIZE={ep})")
    if (tp * dp_size) % ep:
        raise ShardingError(
            f"ep_size={ep} must divide tp × dp = {tp * dp_size} (the expert-parallel group is "
            f"carved out of one pipeline stage's tp × dp ranks); ep sizes that would work: "
            f"{', '.join(str(d) for d in divisors(tp * dp_size) if d <= (max_ep or d))}")
    _check_experts_in_tp(tp, dp_size, ep, max_ep)
    tp_coord = rank % tp
    dp_coord = (rank // tp) % dp_size
    pp_coord = rank // (tp * dp_size)
    return {"pp": Dim("pp", pp, pp_coord), "dp": Dim("dp", dp_size, dp_coord),
            "tp": Dim("tp", tp, tp_coord), "ep": Dim("ep", ep, (dp_coord * tp + tp_coord) % ep)}


def _check_experts_in_tp(tp: int, dp: int, ep: int, max_ep: int | None) -> None:
    """Under tensor parallelism with data-parallel replicas the expert group lies inside a tp
    group (ep divides tp): the replicas run on their own inputs, and an expert group spanning
    two of them would mix their tokens. Expert groups across replicas are the tp-1 layout."""
    if tp == 1 or dp == 1 or tp % ep == 0:
        return
    fits = [d for d in divisors(tp) if d <= (max_ep or d)]
    raise ParallelismNotSupportedError(
        f"ep_size={ep} with tp_size={tp} and {dp} data-parallel replicas: under tensor "
        f"parallelism the expert group lies inside a tp group (ep_size must divide "
        f"tp_size={tp}), and expert groups spanning replicas of a tp group are not supported "
        f"yet; ep sizes that would work: {', '.join(map(str, fits))} (or tp_size=1, where the "
        f"expert groups span the replicas)")


def _check_tp_world(tp: int, world: int) -> None:
    """The tensor-parallel size against the world alone, with the messages users know
    (:func:`~shardwise.sharding.tp_world_problem`) and the tp sizes that fit. A world of
    several tp groups is fine: data-parallel replicas of a TP group."""
    if world % tp == 0 and world > 1:
        return
    problem = tp_world_problem(tp, world)
    if problem is None:
        return
    if world > 1:
        problem += f"; tp sizes that fit a world of {world}: {', '.join(map(str, divisors(world)))}"
    raise ShardingError(problem)


def current_world() -> tuple[int, int]:
    """(world size, rank) of this process: the initialised default group, else torchrun's
    variables (checked), else (1, 0)."""
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    env = env_world()
    return env.world_size, env.rank or 0


@dataclass
class Plan:
    """Every decision about how the model is split, made once (see the module docstring).

    Attributes:
        world, rank: the world size and this process's rank in it.
        tp, pp, dp, ep: the :class:`Dim` s (size, this rank's coordinate, process group; the ep
            group is this rank's expert group, :meth:`dim_ranks`).
        policy: the model's :class:`~shardwise.policy.Policy` (the
            :class:`~shardwise.policy.GenericPolicy` when none is registered for its
            ``model_type``: see ``policy_registered``).
        policy_registered: whether a registered policy claims the model.
        head_counts: the model's :class:`~shardwise.layout.HeadCounts` (None: unknown).
        heads: this rank's :class:`~shardwise.layout.HeadPartition` (its q / kv head ranges;
            every head at tp 1); None when the head counts are unknown or do not split (then
            nothing may split by heads: ``sharding`` checked that).
        head_split: every tp rank's partition (:class:`~shardwise.sharding.HeadSplit`).
        sharding: every rank's slices (:class:`~shardwise.sharding.PreparedShards`) under
            tensor parallelism or with a user ``injection_policy``, and the experts modules'
            under expert parallelism (``sharding.experts``); else None. What step 5 applies:
            :attr:`shards`.
        roles: module name → :class:`~shardwise.layout.Role` for every module the sharding
            plan's rows name (the linears quantization picks from); None when no plan fits the
            model (quantization then takes every linear but the head).
        roles_source: where the roles came from (``injection_policy``, ``hf_tp_plan``,
            ``policy:<name>``, ``heuristic``), or why there are none.
        notes: remarks (a plan source not used, no registered policy).
        experts: the :class:`ExpertPlan` of a Mixture-of-Experts model (None: a dense model).
        stages: under pipeline parallelism (pp > 1) the
            :class:`~shardwise.pipeline.StagePlan`: every stage's decoder layers, this rank's
            stage; else None.
        inputs: after :meth:`bind`, the communicator over the ranks that run on the same
            inputs (the engine broadcasts them from its rank 0): this rank's replica with
            data-parallel replicas (:meth:`input_ranks`), else the world; None before.
    """

    world: int
    rank: int
    tp: Dim
    pp: Dim
    dp: Dim
    ep: Dim
    policy: Policy
    policy_registered: bool
    head_counts: HeadCounts | None
    heads: HeadPartition | None
    head_split: HeadSplit
    sharding: PreparedShards | None = None
    roles: dict[str, Role] | None = None
    roles_source: str = ""
    notes: list[str] = field(default_factory=list)
    experts: ExpertPlan | None = None
    stages: "StagePlan | None" = None
    inputs: Any = None

    @property
    def dims(self) -> dict[str, Dim]:
        """Name → :class:`Dim`, in rank-layout order."""
        return {name: getattr(self, name) for name in DIM_NAMES}

    @property
    def found_policy(self) -> Policy | None:
        """The registered policy (None when the model's type has none)."""
        return self.policy if self.policy_registered else None

    @property
    def sharded(self) -> bool:
        """Whether the model's weights are split across ranks (tp > 1)."""
        return self.tp.enabled

    @property
    def shards(self) -> PreparedShards | None:
        """The slices step 5 applies on this rank's model (tensor-parallel modules and, under
        expert parallelism, experts modules); None when every rank keeps the whole model."""
        return self.sharding if self.tp.enabled or self.ep.enabled else None

    @property
    def replicas_share_inputs(self) -> bool:
        """Whether the data-parallel replicas run on the same inputs: their ranks jointly form
        expert groups (tp 1 with ep > 1: an expert group spans several replicas, whose tokens
        must be the same for its all-reduce; the engine then broadcasts rank 0's inputs to the
        world, as without replicas)."""
        return self.dp.enabled and self.ep.size > self.tp.size

    def input_ranks(self) -> list[tuple[int, ...]]:
        """The groups of world ranks that run on the same inputs, in a fixed order: one per
        data-parallel replica (its pp × tp ranks, stage by stage), or the whole world when
        there are no replicas or they share inputs (:attr:`replicas_share_inputs`)."""
        tp, dp, pp = self.tp.size, self.dp.size, self.pp.size
        if dp == 1 or self.replicas_share_inputs:
            return [tuple(range(self.world))]
        return [tuple((p * dp + d) * tp + t for p in range(pp) for t in range(tp))
                for d in range(dp)]

    def bind(self, communicator: "Communicator") -> None:
        """Give each dimension that needs collectives its group: the world's ``communicator``
        when the dimension spans the world, else this rank's sub-group of it
        (:func:`~shardwise.communicator.subgroups`: the tp group is one stage's tp ranks of one
        replica, the pp group the ranks of this tp coordinate of this replica in every stage,
        the ep group this rank's expert group of ``ep`` consecutive ranks); and :attr:`inputs`,
        this rank's replica (the world without replicas). Every rank creates the same groups in
        the same order."""
        from .communicator import subgroups

        for dim in (self.tp, self.ep, self.pp):
            if not dim.enabled:
                continue
            if communicator.world_size == dim.size:
                group = communicator
            elif communicator.world_size == self.world and dim.name in ("tp", "pp", "ep"):
                group = subgroups(communicator, self.dim_ranks(dim.name))
            else:
                raise ShardingError(f"the plan's {dim.name}_size={dim.size} needs a "
                                    f"communicator of {dim.size} ranks (or of the plan's world "
                                    f"of {self.world}), got {communicator.world_size}")
            setattr(self, dim.name, replace(dim, group=group))
        groups = self.input_ranks()
        if len(groups) > 1 and communicator.world_size != self.world:
            raise ShardingError(f"the plan's {len(groups)} data-parallel replicas need the "
                                f"communicator of the plan's world of {self.world} ranks, got "
                                f"{communicator.world_size}")
        self.inputs = subgroups(communicator, groups) if len(groups) > 1 else communicator

    def dim_ranks(self, name: str) -> list[tuple[int, ...]]:
        """Every group of dimension ``name`` (``tp``, ``pp`` or ``ep``) as world ranks, in a fixed
        order (the layout: ``rank = (pp_coord × dp + dp_coord) × tp + tp_coord``; an ep group is
        ``ep`` consecutive ranks, ``ep_coord = rank mod ep``, inside one stage)."""
        tp, dp, pp = self.tp.size, self.dp.size, self.pp.size
        if name == "ep":
            ep = self.ep.size
            return [tuple(range(g * ep, (g + 1) * ep)) for g in range(self.world // ep)]
        if name == "tp":
            return [tuple((p * dp + d) * tp + t for t in range(tp))
                    for p in range(pp) for d in range(dp)]
        if name == "pp":
            return [tuple((p * dp + d) * tp + t for p in range(pp))
                    for d in range(dp) for t in range(tp)]
        raise ValueError(f"no rank groups for dimension {name!r}")

    def __repr__(self) -> str:
        dims = ", ".join(repr(d) for d in self.dims.values())
        policy = self.policy.name + ("" if self.policy_registered else " (none registered)")
        lines = [f"Plan(world={self.world}, rank={self.rank}: {dims}",
                 f"  policy: {policy}"]
        if self.heads is not None:
            h = self.heads
            lines.append(f"  heads: {h.q_heads} of {h.num_heads} q [{h.q_range[0]}, "
                         f"{h.q_range[1]}), {h.kv_heads} of {h.num_kv_heads} kv "
                         f"[{h.kv_range[0]}, {h.kv_range[1]}), head_dim {h.head_dim}")
        elif self.head_counts is not None:
            lines.append(f"  heads: {self.head_counts} (do not split: {self.head_split.error})")
        if self.experts is not None:
            lines.append(f"  experts: {self.experts!r}")
        if self.stages is not None:
            lines.append(f"  stages: {self.stages!r}")
        if self.roles is not None:
            counts: dict[str, int] = {}
            for role in self.roles.values():
                counts[role.name] = counts.get(role.name, 0) + 1
            lines.append(f"  roles from {self.roles_source}: "
                         + ", ".join(f"{n} {r}" for r, n in sorted(counts.items())))
        else:
            lines.append(f"  roles: none ({self.roles_source})")
        if self.sharding is not None:
            lines.append(f"  sharding: {len(self.sharding.specs)} modules split over "
                         f"{self.sharding.tp_size} ranks")
            if self.sharding.experts:
                lines.append(f"  experts modules: {len(self.sharding.experts)} split over "
                             f"{self.sharding.ep_size} ep ranks")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines) + ")"


def build_plan(model: nn.Module, *, tp_size: int = 1,
               injection_policy: Mapping | None = None, world: int | None = None,
               rank: int | None = None, pp_size: int = 1, dp_size: int | None = None,
               ep_size: int | None = None, moe: MoESettings | None = None,
               pipeline: "PipelineSettings | None" = None) -> Plan:
    """The :class:`Plan` for ``model`` in this process's world (``world`` / ``rank`` given:
    that world instead, e.g. to check every rank's plan on one process). ``moe``: the ``moe=``
    setting (its ``ep_size`` is the plan's unless ``ep_size`` is given). ``pipeline``: the
    ``pipeline_parallel=`` setting (its ``pp_size`` is the plan's; checked against the model's
    layers before the dimensions). Touches nothing.

    Raises:
        MoEConfigError: ``moe`` on a dense model, or its expert count / type not the model's.
        ShardingError: the sizes do not fit the world, or the model cannot be split as planned
            (a :class:`~shardwise.ConfigError`; named, with the sizes that would work).
        ParallelismNotSupportedError: a dimension not supported yet (:func:`check_dims`).
    """
    if world is None or rank is None:
        env_size, env_rank = current_world()
        world = env_size if world is None else world
        rank = env_rank if rank is None else rank
    if ep_size is None:
        ep_size = moe.ep_size if moe is not None else 1
    found = policy_for(model)  # the one lookup: everything below reads the plan
    policy = found or GenericPolicy()
    config = getattr(model, "config", None)
    facts = policy.moe_facts(config)
    _check_moe(facts, moe, config, ep_size, world, pp_size)
    if pipeline is not None:
        pp_size = pipeline.pp_size
        stage_layers = _stage_layers(model, policy, pipeline)  # the model's checks first
    dims = check_dims(world, rank, tp=tp_size, pp=pp_size, dp=dp_size, ep=ep_size,
                      max_ep=facts.num_experts if facts is not None else None)
    tp = dims["tp"]
    counts = policy.head_counts(config)
    split = HeadSplit.compute(counts, tp.size)
    heads = split.partitions[tp.coord] if split.partitions else None
    plan = Plan(world, rank, tp, dims["pp"], dims["dp"], dims["ep"], policy, found is not None,
                counts, heads, split)
    if facts is not None:
        plan.experts = ExpertPlan.compute(facts, dims["ep"])
    if tp.enabled or injection_policy:
        plan.sharding = prepare(model, resolve_plan(model, injection_policy, found), tp.size,
                                policy, heads=split)
        if found is None:
            plan.sharding.notes.append(no_policy_note(model))
        plan.roles, plan.roles_source = plan.sharding.roles, plan.sharding.plan.source
        plan.notes = list(plan.sharding.notes)
    else:
        _roles_at_one_rank(plan, model, found)
    if plan.ep.enabled:
        _plan_experts(plan, model)
    if plan.pp.enabled:
        plan.stages = _plan_stages(plan, model, stage_layers, pipeline)
    return plan


def _stage_layers(model: nn.Module, policy: Policy, pipeline: "PipelineSettings") -> nn.ModuleList:
    """The decoder layers pipeline stages cut, checked against ``pp_size`` / ``split`` (so a
    bad setting is named before the world is: a stage plan for stage 0 of a world of pp)."""
    from .pipeline.stages import plan_stages
    from .moe.block import MoEError, decoder_layers

    try:
        layers = decoder_layers(model, policy)
    except MoEError as exc:
        raise ShardingError(f"pipeline_parallel cuts the decoder layers, but {exc}") from None
    plan_stages(model, layers, pipeline, 0, tuple(range(pipeline.pp_size)))
    return layers


def _plan_stages(plan: Plan, model: nn.Module, layers: nn.ModuleList,
                 pipeline: "PipelineSettings") -> "StagePlan":
    """This rank's stage plan: stage = pp coordinate; stage s is rank s of this rank's pp group
    (the ranks of this tp coordinate in every stage: :meth:`Plan.dim_ranks`)."""
    from .pipeline.stages import plan_stages

    return plan_stages(model, layers, pipeline, plan.pp.coord, tuple(range(plan.pp.size)))


def _plan_experts(plan: Plan, model: nn.Module) -> None:
    """Expert parallelism: every experts module split by whole experts over the ep ranks
    (``plan.sharding.experts``; without tensor parallelism the dense parts stay whole)."""
    e = plan.experts
    specs = prepare_experts(model, plan.policy.moe, e.total, e.moe_layers, e.ranges)
    if not plan.tp.enabled:  # a tp-1 injection_policy's slices are no split: experts alone
        plan.sharding = experts_only(model, plan.policy, specs, plan.ep.size)
    else:
        plan.sharding.experts, plan.sharding.ep_size = specs, plan.ep.size


def _check_moe(facts: MoEFacts | None, moe: MoESettings | None, config: Any, ep_size: int,
               world: int, pp_size: int) -> None:
    """``moe=`` and ``ep_size`` against the model's experts, before the dimensions' checks (so
    bad input gets its own error before "not supported yet")."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int):
        return  # check_dims names the malformed size
    model_type = getattr(config, "model_type", None) or "this"
    if facts is None:
        if moe is not None or ep_size != 1:
            given = f"ep_size={ep_size}" if moe is None else f"moe= (ep_size={ep_size})"
            raise MoEConfigError(
                f"{given} is for Mixture-of-Experts models, but the {model_type!r} model has no "
                f"experts (its config sets none of num_local_experts, num_experts, "
                f"n_routed_experts); remove moe= for this dense model")
        return
    if moe is not None and moe.num_experts is not None:
        wrong = [n for n in moe.num_experts if n != facts.num_experts]
        if wrong:
            raise MoEConfigError(
                f"moe moe_experts={list(moe.num_experts)} but the {model_type!r} model has "
                f"{facts.num_experts} experts per MoE layer; give moe_experts={facts.num_experts} "
                f"or leave it out (shardwise reads the count from the model)")
    if moe is not None and moe.type is not None:
        kind = "residual" if facts.shared else "standard"
        if moe.type != kind:
            why = (f"{facts.shared} shared expert(s)" if facts.shared else "no shared expert")
            raise MoEConfigError(
                f"moe type={moe.type!r} does not match the {model_type!r} model: it has {why}, "
                f"a {kind!r} MoE; give type={kind!r} or leave it out")
    if ep_size > facts.num_experts:
        fits = [d for d in divisors(world // pp_size) if d <= facts.num_experts] \
            if world % pp_size == 0 else []
        raise ShardingError(
            f"ep_size={ep_size} is larger than the {model_type!r} model's {facts.num_experts} "
            f"experts (each expert-parallel rank needs at least one); ep sizes that would work "
            f"here: {', '.join(map(str, fits)) or 'none'}")


def _roles_at_one_rank(plan: Plan, model: nn.Module, found: Policy | None) -> None:
    """On one rank nothing is sharded, but quantization still picks the plan's linears: the
    plan ``init_inference`` would shard with, resolved; none when no plan fits the model."""
    try:
        rows = _plans.choose_plan(model, policy=found)
        plan.roles, plan.roles_source = rows.resolve(model), rows.source
    except Exception as exc:  # noqa: BLE001 — one rank shards nothing: a plan that does not
        # fit is no error here (the reason stays in roles_source, shown by repr(plan))
        plan.roles = None
        plan.roles_source = f"no tensor-parallel plan fits the model: {exc}"

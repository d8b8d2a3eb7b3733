"""Sharding, planning half: a plan resolved against a model → what every rank keeps, touching
nothing.

:func:`prepare` resolves a :class:`~shardwise.sharding.ShardingPlan` against a model and computes
every rank's slices (:class:`ShardSpec`: role, layout, split dim, ranges per rank), checks every
module, tied weight and attention module, and raises :class:`ShardingError` (with the tp sizes
that would work) before any weight changes. It runs without processes, so all ranks' slices can
be checked on one. :mod:`.apply` then applies the result on this rank; the checkpoint loader
reads :func:`param_ranges` to read only this rank's slices from disk.

Weight layouts per module type (:func:`module_kind`): ``nn.Linear`` weight is [out, in];
transformers' ``Conv1D`` (GPT-2) is [in, out]; ``nn.Embedding`` is [vocab, dim].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..layout import (ColumnParallel, Even, ExpertParallel, HeadCounts, HeadPartition, Layout,
                      Range, Role, RowParallel, ShardContext, ShardingError,
                      VocabParallelEmbedding, VocabParallelHead)
from .inputs import head_sliced_modules
from .plan import (ShardingPlan, _conv1d_class, base_prefix, choose_plan, first_match,
                   pattern_matches, plan_from_injection_policy)

if TYPE_CHECKING:
    from ..policy import Policy

#: Attribute set on a sharded model (holds its ShardReport); sharding twice is refused.
SHARDED_ATTR = "_shardwise_shard_report"


@dataclass(frozen=True)
class HeadSplit:
    """A model's head counts split over ``tp_size`` ranks, computed once: every rank's
    :class:`HeadPartition` (None when the counts are unknown or do not split) and, when they do
    not split, why (raised only if something actually splits by heads)."""

    counts: HeadCounts | None
    tp_size: int
    partitions: tuple[HeadPartition, ...] | None
    error: str = ""

    @classmethod
    def compute(cls, counts: HeadCounts | None, tp_size: int) -> "HeadSplit":
        if counts is None:
            return cls(None, tp_size, None)
        try:
            return cls(counts, tp_size, tuple(HeadPartition.compute(*counts, tp_size, r)
                                                for r in range(tp_size)))
        except ShardingError as exc:
            return cls(counts, tp_size, None, str(exc))


# ----- module kinds -------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightKind:
    """Where a module type keeps its features: the weight dims of output / input features and
    the attributes that hold their sizes (updated after slicing)."""

    out_dim: int
    in_dim: int
    out_attr: str
    in_attr: str


LINEAR = WeightKind(out_dim=0, in_dim=1, out_attr="out_features", in_attr="in_features")
CONV1D = WeightKind(out_dim=1, in_dim=0, out_attr="nf", in_attr="nx")  # weight [in, out]
EMBEDDING = WeightKind(out_dim=0, in_dim=1, out_attr="num_embeddings", in_attr="embedding_dim")


def module_kind(module: nn.Module) -> WeightKind | None:
    """The :class:`WeightKind` of a shardable module (None for anything else)."""
    if isinstance(module, nn.Linear):
        return LINEAR
    if isinstance(module, nn.Embedding):
        return EMBEDDING
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return CONV1D
    return None


#: role → (module kinds it accepts, which weight dim it splits: "out" or "in")
ROLE_TARGETS: dict[type[Role], tuple[tuple[WeightKind, ...], str]] = {
    ColumnParallel: ((LINEAR, CONV1D), "out"),
    RowParallel: ((LINEAR, CONV1D), "in"),
    VocabParallelEmbedding: ((EMBEDDING,), "out"),
    VocabParallelHead: ((LINEAR,), "out"),
}


# ----- prepare: resolve and validate, touching nothing --------------------------------------------

@dataclass
class ShardSpec:
    """One module to shard: its role and layout, the weight dim split, and every rank's ranges."""

    name: str
    module: nn.Module
    role: Role
    layout: Layout
    kind: WeightKind
    dim: int  # weight dim that is split
    size: int  # full size of that dim
    ranges: list[list[Range]]  # ranges[rank] = the [start, stop) ranges rank keeps


@dataclass
class PreparedShards:
    """A plan resolved against a model for ``tp_size`` ranks, every slice computed."""

    model: nn.Module
    plan: ShardingPlan
    policy: Policy
    tp_size: int
    specs: list[ShardSpec]
    roles: dict[str, Role]
    heads: list[HeadPartition] | None  # per rank; None when the head counts are unknown
    attention: dict[str, nn.Module]  # attention modules whose attributes follow the split
    notes: list[str] = field(default_factory=list)
    #: modules whose forward arguments are narrowed to the rank's heads (policy
    #: ``head_sliced_inputs``): name → (module, inputs, positions); see :mod:`.inputs`
    head_sliced: dict[str, tuple] = field(default_factory=dict)
    #: Mixture-of-Experts experts modules split by whole experts over ``ep_size`` ranks
    #: (:func:`prepare_experts`; empty without expert parallelism)
    experts: list["ExpertShardSpec"] = field(default_factory=list)
    ep_size: int = 1

    def ep_coord(self, rank: int) -> int:
        """The ep coordinate of world ``rank`` (one pipeline stage: the ep group is carved out
        of the tp × dp ranks, tp fastest, so ``rank mod ep``; see :mod:`shardwise.plan`)."""
        return rank % self.ep_size


def prepare(model: nn.Module, plan: ShardingPlan, tp_size: int,
            policy: Policy | None = None, heads: HeadSplit | None = None) -> PreparedShards:
    """Resolve ``plan`` on ``model`` and compute all ``tp_size`` ranks' slices, without modifying
    anything. ``policy`` supplies layouts, attention attributes and head counts (None: the
    :class:`~shardwise.policy.GenericPolicy`); ``heads`` is the model's head split when the
    caller computed it already (the engine's :class:`~shardwise.plan.Plan`), else it is computed
    from the policy's head counts. Raises :class:`ShardingError` for any module that cannot be
    sharded as planned."""
    if getattr(model, SHARDED_ATTR, None) is not None:
        raise ShardingError(f"{type(model).__name__} is already sharded; build a fresh model")
    if policy is None:
        from ..policy import GenericPolicy  # here: the policy module is not sharding's import

        policy = GenericPolicy()
    roles = plan.resolve(model)
    if heads is None or heads.tp_size != tp_size:
        heads = HeadSplit.compute(policy.head_counts(getattr(model, "config", None)), tp_size)
    prefix = base_prefix(model)
    modules = dict(model.named_modules())
    planned = [(name, modules[name], role,
                role.layout or first_match(policy.layouts, name, prefix) or Even())
               for name, role in roles.items() if role.shards]
    for name, module, role, _ in planned:
        _check_kind(name, module, role)
    try:
        specs = _specs(planned, heads)
    except ShardingError as exc:
        sizes = [n for n in range(1, 65) if _fits(planned, heads.counts, n)]
        if not sizes:
            raise
        raise ShardingError(f"{exc}. For the whole model, tp sizes that would work: "
                            f"{', '.join(map(str, sizes))}") from None
    if not specs:
        raise ShardingError(f"the {plan.source} plan shards no module of "
                            f"{type(model).__name__}: nothing to shard")
    _check_ties(model, specs)
    attention = _attention_modules(model, policy, specs, prefix)
    head_sliced = head_sliced_modules(model, policy, [s.name for s in specs], prefix)
    partitions = list(heads.partitions) if heads.partitions is not None else None
    if (attention or head_sliced) and partitions is None:
        raise ShardingError(heads.error or "attention attributes need the model's head counts")
    return PreparedShards(model, plan, policy, tp_size, specs, roles, partitions, attention,
                          list(plan.notes), head_sliced=head_sliced)


def _specs(planned: list[tuple[str, nn.Module, Role, Layout]], heads: HeadSplit
           ) -> list[ShardSpec]:
    return [_spec(name, module, role, layout, heads) for name, module, role, layout in planned]


def _fits(planned: list[tuple[str, nn.Module, Role, Layout]], counts: HeadCounts | None,
          tp_size: int) -> bool:
    """Whether every planned module splits over ``tp_size`` (for the error message)."""
    distinct = {(type(m), m.weight.shape, role, layout): (n, m, role, layout)
                for n, m, role, layout in planned}
    try:
        _specs(list(distinct.values()), HeadSplit.compute(counts, tp_size))
    except ShardingError:
        return False
    return True


def _check_kind(name: str, module: nn.Module, role: Role) -> None:
    if type(role) not in ROLE_TARGETS:
        raise ShardingError(f"plan gives {name!r} the role {type(role).__name__}, which the "
                            f"applier does not implement")
    kinds, _ = ROLE_TARGETS[type(role)]
    if module_kind(module) not in kinds:
        raise ShardingError(f"module {name!r} is a {type(module).__name__}; the {role.name} role "
                            f"applies to {', '.join(_kind_names(kinds))}")


def _spec(name: str, module: nn.Module, role: Role, layout: Layout, heads: HeadSplit
          ) -> ShardSpec:
    _, which = ROLE_TARGETS[type(role)]
    kind = module_kind(module)
    dim = kind.out_dim if which == "out" else kind.in_dim
    size = module.weight.shape[dim]
    what = f"{name} ({role.name}, {'output' if which == 'out' else 'input'} features)"
    ranges = []
    for rank in range(heads.tp_size):
        part = heads.partitions[rank] if heads.partitions else None
        ranges.append(layout.ranges(size, ShardContext(heads.tp_size, rank, part, heads.error),
                                    what))
    return ShardSpec(name, module, role, layout, kind, dim, size, ranges)


def _kind_names(kinds: tuple[WeightKind, ...]) -> list[str]:
    names = {LINEAR: "nn.Linear", CONV1D: "transformers Conv1D", EMBEDDING: "nn.Embedding"}
    return [names[k] for k in kinds]


def _check_ties(model: nn.Module, specs: list[ShardSpec]) -> None:
    """Tied weights (one Parameter in several modules, e.g. GPT-2's wte and lm_head) must be
    sliced identically everywhere, so they stay one tied Parameter."""
    by_module = {id(s.module): s for s in specs}
    users: dict[int, list[tuple[str, Any]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter):
            spec = by_module.get(id(module))
            key = (spec.dim, spec.ranges) if spec else "replicated"
            users.setdefault(id(weight), []).append((name, key))
    for entries in users.values():
        keys = {repr(k) for _, k in entries}
        if len(keys) > 1:
            names = ", ".join(n for n, _ in entries)
            raise ShardingError(f"tied weight shared by {names} would be sliced differently "
                                f"(or sharded in one and replicated in another); give the tied "
                                f"modules matching roles (e.g. vocab_embedding + vocab_head)")


def _attention_modules(model: nn.Module, policy: Policy, specs: list[ShardSpec],
                       prefix: str) -> dict[str, nn.Module]:
    """Attention modules (policy patterns) that contain a sharded module; their listed
    attributes must exist when the policy requires them."""
    if not policy.attention_modules or not (policy.attention_attrs
                                            or policy.attention_config_attrs):
        return {}
    sharded = [s.name for s in specs]
    out = {}
    for name, module in model.named_modules():
        if name and any(pattern_matches(p, name, prefix) for p in policy.attention_modules) \
                and any(s.startswith(name + ".") for s in sharded):
            config = getattr(module, "config", None)
            missing = [a for a in policy.attention_attrs if not hasattr(module, a)] + [
                f"config.{a}" for a in policy.attention_config_attrs if not hasattr(config, a)]
            if missing and policy.require_attention_attrs:
                raise ShardingError(f"policy {policy.name!r} sets {', '.join(missing)} on "
                                    f"attention module {name!r} ({type(module).__name__}), "
                                    f"which has no such attribute; fix the policy's "
                                    f"attention_attrs")
            out[name] = module
    return out


# ----- expert parallelism: experts modules split by whole experts ------------------------------

@dataclass
class ExpertShardSpec:
    """One Mixture-of-Experts experts module split over the ep ranks by whole experts
    (:class:`~shardwise.layout.ExpertParallel`).

    Attributes:
        name: the experts module's name in the model.
        module: the module.
        params: its own parameters split along dim 0 (every one of them: each holds an entry per
            expert, e.g. ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], GPT-OSS's biases).
        total: the experts E (dim 0 of each parameter before the split).
        ranges: every ep rank's experts ``[start, stop)`` (``plan.experts.ranges``).
    """

    name: str
    module: nn.Module
    params: tuple[str, ...]
    total: int
    ranges: tuple[Range, ...]
    role: Role = field(default_factory=ExpertParallel)

    def count(self, coord: int) -> int:
        """Experts ep rank ``coord`` holds."""
        start, stop = self.ranges[coord]
        return stop - start


def expert_param_ranges(spec: ExpertShardSpec, coord: int) -> dict[str, tuple[int, list[Range]]]:
    """What ep rank ``coord`` keeps of each parameter of ``spec.module``:
    ``{param: (0, [(start, stop)])}`` (the same form as :func:`param_ranges`' weight entry), for
    loaders that read only these experts from disk."""
    return {name: (0, [spec.ranges[coord]]) for name in spec.params}


def _experts_suffix(moe_spec: Any) -> str | None:
    """``<block>.<experts>``, where a family's MoE spec (``Policy.moe``) puts the experts
    module on a decoder layer (None: no spec)."""
    if moe_spec is None:
        return None
    return f"{moe_spec.block}.{moe_spec.experts}"


def prepare_experts(model: nn.Module, moe_spec: Any, total: int, moe_layers: tuple[int, ...],
                    ranges: tuple[Range, ...]) -> list[ExpertShardSpec]:
    """The experts modules of ``model`` split by whole experts over ``len(ranges)`` ep ranks,
    touching nothing. ``moe_spec``: the family's :class:`~shardwise.moe.MoESpec` (the modules
    named ``<layer>.<block>.<experts>``); None: every module holding a 3-D parameter whose dim 0
    is the expert count. One experts module per MoE layer (``moe_layers``) is expected.

    Raises:
        ShardingError: a different number of experts modules than MoE layers, or an experts
            module holding a parameter whose dim 0 is not the ``total`` experts (its layout is
            not the stacked one the split assumes).
    """
    suffix = _experts_suffix(moe_spec)
    found = []
    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if suffix is not None:
            if not (name == suffix or name.endswith("." + suffix)):
                continue
        elif not any(p.dim() == 3 and p.shape[0] == total for _, p in own):
            continue
        wrong = [f"{n} {tuple(p.shape)}" for n, p in own if p.dim() == 0 or p.shape[0] != total]
        if wrong or not own:
            raise ShardingError(
                f"experts module {name!r} ({type(module).__name__}) cannot be split by whole "
                f"experts: every parameter must hold the {total} experts along dim 0, but "
                f"{', '.join(wrong) or 'it has no parameters'}; give the family an MoESpec "
                f"naming its stacked experts module")
        found.append(ExpertShardSpec(name, module, tuple(n for n, _ in own), total, ranges))
    if len(found) != len(moe_layers):
        where = f"named '*.{suffix}'" if suffix else f"holding [{total}, ...] 3-D parameters"
        raise ShardingError(
            f"expert parallelism needs one experts module per MoE layer ({len(moe_layers)} "
            f"layers: {list(moe_layers)}); found {len(found)} {where}: "
            f"{[s.name for s in found][:6]}; the family's MoESpec (block, experts) does not fit "
            f"this model")
    return found


def experts_only(model: nn.Module, policy: Policy, specs: list[ExpertShardSpec],
                 ep_size: int) -> PreparedShards:
    """The slices of an expert-parallel model without tensor parallelism: no tp module is
    split (every rank keeps the dense parts whole), the experts modules are."""
    plan = ShardingPlan([], "expert parallelism (dense parts replicated)", strict=False)
    return PreparedShards(model, plan, policy, 1, [], {}, None, {}, experts=specs,
                          ep_size=ep_size)


def param_ranges(spec: ShardSpec, rank: int) -> dict[str, Any]:
    """What ``rank`` keeps of each parameter of ``spec.module``, without touching it:
    ``{"weight": (dim, ranges), "bias": (0, ranges) | "whole" | "zeros"}`` (a row-parallel bias
    is kept whole on rank 0 and zero elsewhere, as :func:`slice_module` does). For loaders that
    read only these slices from disk."""
    ranges = spec.ranges[rank]
    out: dict[str, Any] = {"weight": (spec.dim, ranges)}
    if isinstance(getattr(spec.module, "bias", None), torch.Tensor):
        if isinstance(spec.role, RowParallel):
            out["bias"] = "whole" if rank == 0 else "zeros"
        else:
            out["bias"] = (0, ranges)  # bias [out]
    return out


def prepare_for(model: nn.Module, plan: ShardingPlan | Mapping | None, tp_size: int,
                policy: Policy | None = None) -> PreparedShards:
    """:func:`prepare` after resolving ``plan`` (see :func:`~shardwise.sharding.shard_model`)
    and the policy (looked up by ``model.config.model_type`` when not given), for a caller
    using sharding alone; ``init_inference`` resolves both once, in its
    :class:`~shardwise.plan.Plan`."""
    from ..policy import policy_for  # here: the policy module is not sharding's import

    found = policy or policy_for(model)
    plan = resolve_plan(model, plan, found)
    prepared = prepare(model, plan, tp_size, found)
    if found is None:
        prepared.notes.append(no_policy_note(model))
    return prepared


def resolve_plan(model: nn.Module, plan: ShardingPlan | Mapping | None,
                 policy: Policy | None) -> ShardingPlan:
    """``plan`` as a :class:`ShardingPlan`: a mapping is the user's ``injection_policy``, None
    chooses one (:func:`~shardwise.sharding.choose_plan` with ``policy``)."""
    if isinstance(plan, Mapping):
        return plan_from_injection_policy(model, plan)
    if plan is None:
        return choose_plan(model, policy=policy)
    return plan


def no_policy_note(model: nn.Module) -> str:
    """The report's note for a model no registered policy claims."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return (f"no policy registered for model_type {model_type!r}: generic layouts "
            f"(HF-standard q/k/v/o names, else contiguous slices)")

"""The one generic applier: a resolved plan → weights sliced in place + instance-scoped hooks.

:func:`prepare` resolves a plan against a model and computes every rank's slices without touching
anything (so all errors come before any weight changes, and it runs without processes);
:func:`apply_shards` then slices this rank's weights, installs forward hooks for the collectives
(through the engine's :class:`~shardwise.Communicator`) and updates attention attributes from the
policy's data; :func:`shard_model` does both. Nothing is patched on a class: hooks, attributes and
parameters belong to module instances.

Weight layouts per module type (:data:`MODULE_KINDS`): ``nn.Linear`` weight is [out, in];
transformers' ``Conv1D`` (GPT-2) is [in, out]; ``nn.Embedding`` is [vocab, dim].
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..communicator import Communicator, LocalCommunicator
from .. import policy as _policy  # module import: shardwise.policy imports this package
from .errors import ShardingError
from .inputs import head_sliced_modules, install_head_slicers
from .partition import HeadPartition, Range
from .plan import (ShardingPlan, _conv1d_class, base_prefix, choose_plan, first_match,
                   pattern_matches)
from .report import ShardedModule, ShardReport
from .roles import (ColumnParallel, Even, Layout, Role, RowParallel, ShardContext,
                    VocabParallelEmbedding, VocabParallelHead)

if TYPE_CHECKING:
    from ..policy import HeadCounts, Policy

log = logging.getLogger(__name__)

#: Attribute set on a sharded model (holds its ShardReport); sharding twice is refused.
SHARDED_ATTR = "_shardwise_shard_report"


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


def prepare(model: nn.Module, plan: ShardingPlan, tp_size: int,
            policy: Policy | None = None) -> PreparedShards:
    """Resolve ``plan`` on ``model`` and compute all ``tp_size`` ranks' slices, without modifying
    anything. Raises :class:`ShardingError` for any module that cannot be sharded as planned."""
    if getattr(model, SHARDED_ATTR, None) is not None:
        raise ShardingError(f"{type(model).__name__} is already sharded; build a fresh model")
    policy = policy or _policy.GenericPolicy()
    roles = plan.resolve(model)
    counts = policy.head_counts(getattr(model, "config", None))
    prefix = base_prefix(model)
    modules = dict(model.named_modules())
    planned = [(name, modules[name], role,
                role.layout or first_match(policy.layouts, name, prefix) or Even())
               for name, role in roles.items() if role.shards]
    for name, module, role, _ in planned:
        _check_kind(name, module, role)
    try:
        heads, heads_error, specs = _specs(planned, counts, tp_size)
    except ShardingError as exc:
        sizes = [n for n in range(1, 65) if _fits(planned, counts, n)]
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
    if (attention or head_sliced) and heads is None:
        raise ShardingError(heads_error or "attention attributes need the model's head counts")
    return PreparedShards(model, plan, policy, tp_size, specs, roles, heads, attention,
                          list(plan.notes), head_sliced=head_sliced)


def _specs(planned: list[tuple[str, nn.Module, Role, Layout]], counts: HeadCounts | None,
           tp_size: int) -> tuple[list[HeadPartition] | None, str, list[ShardSpec]]:
    heads, heads_error = _head_partitions(counts, tp_size)
    specs = [_spec(name, module, role, layout, tp_size, heads, heads_error)
             for name, module, role, layout in planned]
    return heads, heads_error, specs


def _fits(planned: list[tuple[str, nn.Module, Role, Layout]], counts: HeadCounts | None,
          tp_size: int) -> bool:
    """Whether every planned module splits over ``tp_size`` (for the error message)."""
    distinct = {(type(m), m.weight.shape, role, layout): (n, m, role, layout)
                for n, m, role, layout in planned}
    try:
        _specs(list(distinct.values()), counts, tp_size)
    except ShardingError:
        return False
    return True


def _head_partitions(counts: HeadCounts | None, tp_size: int
                     ) -> tuple[list[HeadPartition] | None, str]:
    if counts is None:
        return None, ""
    try:
        return [HeadPartition.compute(*counts, tp_size, r) for r in range(tp_size)], ""
    except ShardingError as exc:  # raised only if something actually splits by heads
        return None, str(exc)


def _check_kind(name: str, module: nn.Module, role: Role) -> None:
    if type(role) not in ROLE_TARGETS:
        raise ShardingError(f"plan gives {name!r} the role {type(role).__name__}, which the "
                            f"applier does not implement")
    kinds, _ = ROLE_TARGETS[type(role)]
    if module_kind(module) not in kinds:
        raise ShardingError(f"module {name!r} is a {type(module).__name__}; the {role.name} role "
                            f"applies to {', '.join(_kind_names(kinds))}")


def _spec(name: str, module: nn.Module, role: Role, layout: Layout, tp_size: int,
          heads: list[HeadPartition] | None, heads_error: str) -> ShardSpec:
    _, which = ROLE_TARGETS[type(role)]
    kind = module_kind(module)
    dim = kind.out_dim if which == "out" else kind.in_dim
    size = module.weight.shape[dim]
    what = f"{name} ({role.name}, {'output' if which == 'out' else 'input'} features)"
    ranges = []
    for rank in range(tp_size):
        ctx = ShardContext(tp_size, rank, heads[rank] if heads else None, heads_error)
        ranges.append(layout.ranges(size, ctx, what))
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


# ----- apply: slice this rank's weights, install hooks --------------------------------------------

def take(tensor: torch.Tensor, dim: int, ranges: list[Range]) -> torch.Tensor:
    """The ``ranges`` of ``tensor`` along ``dim``, concatenated, in fresh storage (so the whole
    tensor can be freed)."""
    return torch.cat([tensor.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()


@torch.no_grad()
def slice_module(spec: ShardSpec, rank: int,
                 cache: dict[tuple, nn.Parameter] | None = None) -> None:
    """Replace ``spec.module``'s weight (and bias) with ``rank``'s slice and update its size
    attributes. ``cache`` maps already-sliced (weight, dim, ranges) to their new Parameter so
    tied modules end up sharing one Parameter again."""
    module, ranges = spec.module, spec.ranges[rank]
    cache = {} if cache is None else cache
    key = (id(module.weight), spec.dim, repr(ranges))
    if key not in cache:
        cache[key] = nn.Parameter(take(module.weight, spec.dim, ranges), requires_grad=False)
    module.weight = cache[key]
    _slice_bias(module, spec, ranges, rank)
    set_shard_sizes(spec, rank)


def set_shard_sizes(spec: ShardSpec, rank: int) -> None:
    """Update ``spec.module``'s size attributes (``out_features`` …, and ``padding_idx``) for
    ``rank``'s slice, once its weight holds that slice (sliced here or read from a checkpoint)."""
    module = spec.module
    size = sum(b - a for a, b in spec.ranges[rank])
    attr = spec.kind.out_attr if spec.dim == spec.kind.out_dim else spec.kind.in_attr
    if hasattr(module, attr):
        setattr(module, attr, size)
    if isinstance(spec.role, VocabParallelEmbedding):
        module.padding_idx = None  # only affects gradients; a global index means nothing here


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


def slice_all(prepared: "PreparedShards", rank: int) -> dict[str, tuple[tuple, tuple]]:
    """Slice every planned module for ``rank`` (tied weights stay one Parameter); returns
    module name → (weight shape before, after). No hooks: see :func:`install_hooks`."""
    cache: dict[tuple, nn.Parameter] = {}
    shapes = {}
    for spec in prepared.specs:
        before = tuple(spec.module.weight.shape)
        slice_module(spec, rank, cache)
        shapes[spec.name] = (before, tuple(spec.module.weight.shape))
    return shapes


def _slice_bias(module: nn.Module, spec: ShardSpec, ranges: list[Range], rank: int) -> None:
    bias = getattr(module, "bias", None)
    if not isinstance(bias, torch.Tensor):
        return
    if isinstance(spec.role, RowParallel):
        if rank != 0:  # the bias is added once: rank 0 keeps it, the all-reduce adds the rest
            module.bias = nn.Parameter(torch.zeros_like(bias), requires_grad=False)
        return
    module.bias = nn.Parameter(take(bias, 0, ranges), requires_grad=False)  # bias [out]


def install_hooks(spec: ShardSpec, rank: int, comm: Communicator) -> list:
    """Instance-scoped forward hooks that restore full results: all-reduce after a row-parallel
    module or a vocab-parallel embedding (after masking foreign ids), all-gather after a
    vocab-parallel head. Returns the hook handles."""
    module, role = spec.module, spec.role
    if isinstance(role, RowParallel):
        return [module.register_forward_hook(_all_reduce_hook(comm))]
    if isinstance(role, VocabParallelEmbedding):
        [(start, stop)] = spec.ranges[rank]
        mask = _VocabMask(start, stop, comm)
        return [module.register_forward_pre_hook(mask.before, with_kwargs=True),
                module.register_forward_hook(mask.after)]
    if isinstance(role, VocabParallelHead):
        sizes = [sum(b - a for a, b in r) for r in spec.ranges]
        return [module.register_forward_hook(_GatherLastDim(sizes, comm))]
    return []


def _all_reduce_hook(comm: Communicator) -> Callable:
    def all_reduce(_module, _args, output):
        return comm.all_reduce(output)  # partial sums [..., out] → full, in place
    return all_reduce


class _VocabMask:
    """Hooks of one vocab-parallel embedding holding rows [start, stop): ids outside → row 0 of
    the slice and a zero output, then the all-reduce sums the ranks' embeddings."""

    def __init__(self, start: int, stop: int, comm: Communicator) -> None:
        self.start, self.stop, self.comm = start, stop, comm
        self.outside: torch.Tensor | None = None

    def before(self, _module, args, kwargs):
        ids = args[0] if args else kwargs.pop("input")
        self.outside = (ids < self.start) | (ids >= self.stop)  # [batch, seq]
        local = (ids - self.start).masked_fill(self.outside, 0)
        return (local, *args[1:]), kwargs

    def after(self, _module, _args, output):
        output = output.masked_fill(self.outside.unsqueeze(-1), 0)  # [batch, seq, dim]
        self.outside = None
        return self.comm.all_reduce(output)


class _GatherLastDim:
    """All-gather of [..., local vocab] logits into [..., vocab]; uneven slices are padded to
    the largest one for the collective, and the padding is dropped afterwards."""

    def __init__(self, sizes: list[int], comm: Communicator) -> None:
        self.sizes, self.comm = sizes, comm
        self.width = max(sizes)
        self.keep: torch.Tensor | None = None  # indices of real columns in the padded gather

    def __call__(self, _module, _args, output):
        pad = self.width - output.shape[-1]
        if pad:
            output = nn.functional.pad(output, (0, pad))
        full = self.comm.all_gather(output, dim=-1)  # [..., tp_size * width]
        if all(s == self.width for s in self.sizes):
            return full
        if self.keep is None or self.keep.device != full.device:
            self.keep = torch.cat([torch.arange(r * self.width, r * self.width + s)
                                   for r, s in enumerate(self.sizes)]).to(full.device)
        return full.index_select(-1, self.keep)


class ConfigView:
    """One module's view of a shared model config: the attributes in ``overrides`` read this
    rank's values, every other attribute is read from (and written to) the shared config, live —
    so a later change to the model's config (``set_attn_implementation`` …) still reaches the
    module. It stands in for an attention module's ``config`` when its forward reads head counts
    from the config (Phi-3: ``query_pos = self.config.num_attention_heads * self.head_dim``)
    instead of from the module; see :attr:`Policy.attention_config_attrs
    <shardwise.policy.Policy.attention_config_attrs>`. The model's own ``config`` (saved by
    ``save_pretrained``) is untouched."""

    __slots__ = ("_shared", "_overrides")

    def __init__(self, shared: Any, overrides: Mapping[str, Any]) -> None:
        if isinstance(shared, ConfigView):  # a view of a view: one level, later overrides win
            overrides = {**shared._overrides, **overrides}
            shared = shared._shared
        object.__setattr__(self, "_shared", shared)
        object.__setattr__(self, "_overrides", dict(overrides))

    def __getattr__(self, name: str) -> Any:  # only names not found on the view itself
        if name in ConfigView.__slots__:  # slots not set yet (copy/unpickle): no recursion
            raise AttributeError(name)
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._shared, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._overrides:
            self._overrides[name] = value
        else:
            setattr(self._shared, name, value)

    def __reduce__(self):  # copy / deepcopy / pickle rebuild the view, not the shared config
        return ConfigView, (self._shared, self._overrides)

    def __repr__(self) -> str:
        return f"ConfigView({self._overrides} over {type(self._shared).__name__})"


def set_attention_attrs(prepared: PreparedShards, rank: int) -> dict[str, dict[str, int]]:
    """Set the policy's per-rank attributes (``num_heads`` …) on each attention instance, and give
    it a :class:`ConfigView` with the policy's ``attention_config_attrs`` overridden (reported
    as ``config.<attr>``)."""
    out = {}
    heads = prepared.heads[rank] if prepared.heads else None
    policy = prepared.policy
    for name, module in prepared.attention.items():
        values = {attr: heads.quantity(qty) for attr, qty in policy.attention_attrs.items()
                  if hasattr(module, attr)}
        for attr, value in values.items():
            setattr(module, attr, value)
        config = getattr(module, "config", None)
        overrides = {attr: heads.quantity(qty)
                     for attr, qty in policy.attention_config_attrs.items()
                     if hasattr(config, attr)}
        if overrides:
            module.config = ConfigView(config, overrides)
            values.update({f"config.{attr}": value for attr, value in overrides.items()})
        out[name] = values
    return out


def param_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (tied ones counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def apply_shards(prepared: PreparedShards, communicator: Communicator, *,
                 sliced: Mapping[str, tuple[tuple, tuple]] | None = None,
                 bytes_before: int | None = None) -> ShardReport:
    """Shard ``prepared.model`` in place for ``communicator.rank`` and return the report.
    ``sliced`` (module name → weight shape before, after) says the weights already hold this
    rank's slices (a checkpoint loader read them), so only hooks and attributes are set;
    ``bytes_before`` is then the whole model's parameter bytes."""
    model, rank = prepared.model, communicator.rank
    if communicator.world_size != prepared.tp_size:
        raise ShardingError(f"prepared for tp_size={prepared.tp_size} but the communicator has "
                            f"{communicator.world_size} ranks")
    before = param_bytes(model) if bytes_before is None else bytes_before
    report = ShardReport(prepared.tp_size, rank, prepared.plan.source, prepared.policy.name,
                         notes=prepared.notes, param_bytes_before=before)
    shapes = dict(sliced) if sliced is not None else slice_all(prepared, rank)
    for spec in prepared.specs:
        install_hooks(spec, rank, communicator)
        report.sharded[spec.name] = ShardedModule(spec.name, spec.role.name, spec.layout.describe(),
                                                  *shapes[spec.name])
    report.attention = set_attention_attrs(prepared, rank)
    install_head_slicers(prepared.head_sliced, prepared.heads[rank] if prepared.heads else None)
    if prepared.heads:
        report.heads = (prepared.heads[rank].q_heads, prepared.heads[rank].kv_heads)
    report.replicated = _replicated(model, report.sharded)
    report.param_bytes = param_bytes(model)
    mine = torch.tensor([report.param_bytes], dtype=torch.int64)
    report.rank_param_bytes = communicator.all_gather(mine, dim=0).tolist()
    setattr(model, SHARDED_ATTR, report)
    return report


def _replicated(model: nn.Module, sharded: Mapping[str, Any]) -> list[str]:
    return [n for n, m in model.named_modules()
            if n not in sharded and any(True for _ in m.parameters(recurse=False))]


def shard_model(model: nn.Module, plan: ShardingPlan | Mapping | None = None,
                communicator: Communicator | None = None, *,
                policy: Policy | None = None) -> ShardReport:
    """Split ``model`` in place across ``communicator``'s ranks (this process keeps its slice).

    Args:
        model: the model (HF or any ``nn.Module``) with real weights, identical on every rank.
        plan: a :class:`ShardingPlan`, a ``{pattern: role}`` dict, DeepSpeed's
            ``{BlockClass: ("row.linear", ...)}``, or None to choose one (:func:`choose_plan`:
            the model's HF plan, the policy's, then the heuristic).
        communicator: the tensor-parallel group (its ``world_size`` is the tp size); None means
            a single rank.
        policy: the family policy (layouts, attention attributes, head counts); None looks it up
            by ``model.config.model_type`` and falls back to
            :class:`~shardwise.policy.GenericPolicy`.

    Returns:
        the :class:`ShardReport` (also stored on the model).

    Raises:
        ShardingError: before any weight changes, when the plan cannot be applied.
    """
    communicator = communicator or LocalCommunicator()
    prepared = prepare_for(model, plan, communicator.world_size, policy)
    return apply_shards(prepared, communicator)


def prepare_for(model: nn.Module, plan: ShardingPlan | Mapping | None, tp_size: int,
                policy: Policy | None = None) -> PreparedShards:
    """:func:`prepare` after resolving ``plan`` (see :func:`shard_model`) and the policy."""
    from .plan import plan_from_injection_policy

    found = policy or _policy.policy_for(model)
    if isinstance(plan, Mapping):
        plan = plan_from_injection_policy(model, plan)
    elif plan is None:
        plan = choose_plan(model, policy=found)
    prepared = prepare(model, plan, tp_size, found)
    if found is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        prepared.notes.append(f"no policy registered for model_type {model_type!r}: generic "
                              f"layouts (HF-standard q/k/v/o names, else contiguous slices)")
    return prepared

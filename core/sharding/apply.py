"""Sharding, applying half: what :mod:`.specs` planned, done to this rank's model in place.

:func:`apply_shards` slices this rank's weights (:func:`slice_all`), installs forward hooks for
the collectives (through the engine's :class:`~shardwise.Communicator`), sets the policy's
per-rank attention attributes (and :class:`ConfigView` s) and the head slicers of
:mod:`.inputs`; :func:`shard_model` plans and applies in one call. Nothing is patched on a class:
hooks, attributes and parameters belong to module instances.

Every change is recorded in the active :mod:`ledger <shardwise.ledger>` (inside
``init_inference``) with its undo: hooks are removed, attributes and configs put back, and each
sliced weight is all-gathered back to the whole weight through the communicator (so the model
can be given back un-sharded without a second copy of it held meanwhile; every rank must undo,
as every rank runs ``engine.close()``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..communicator import Communicator, LocalCommunicator
from ..layout import (HeadPartition, HeadSlicedInput, Range, RowParallel, ShardingError,
                      VocabParallelEmbedding, VocabParallelHead)
from ..ledger import add_hook, record
from .inputs import install_head_slicers
from .plan import ShardingPlan
from .report import ShardedModule, ShardReport
from .specs import SHARDED_ATTR, ExpertShardSpec, PreparedShards, ShardSpec, prepare_for
from .specs import module_kind, param_ranges, prepare  # noqa: F401 (their old home)

if TYPE_CHECKING:
    from ..policy import Policy

log = logging.getLogger(__name__)


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
    ``rank``'s slice, once its weight holds that slice (sliced here or read from a checkpoint).
    Recorded: undoing puts the whole model's values back."""
    module = spec.module
    size = sum(b - a for a, b in spec.ranges[rank])
    attr = spec.kind.out_attr if spec.dim == spec.kind.out_dim else spec.kind.in_attr
    changes = {}
    if hasattr(module, attr):
        changes[attr] = size
    if isinstance(spec.role, VocabParallelEmbedding):
        changes["padding_idx"] = None  # only affects gradients; a global index means nothing here
    set_recorded(module, changes, f"shard sizes of {spec.name}")


def set_recorded(obj: Any, values: Mapping[str, Any], what: str) -> None:
    """``setattr(obj, name, value)`` for each of ``values``, recorded: undoing sets the previous
    values back (or deletes an attribute ``obj`` did not have)."""
    missing = object()
    previous = {name: getattr(obj, name, missing) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)

    def undo() -> None:
        for name, value in previous.items():
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
    if values:
        record(what, undo)


def slice_all(prepared: "PreparedShards", rank: int,
              communicator: Communicator | None = None) -> dict[str, tuple[tuple, tuple]]:
    """Slice every planned module for ``rank`` (tied weights stay one Parameter); returns
    module name → (weight shape before, after). No hooks: see :func:`install_hooks`.

    With ``communicator`` (this rank's tensor-parallel group) each slice is recorded in the
    active ledger with an undo that all-gathers the whole weight back (:func:`gather_whole`)."""
    cache: dict[tuple, nn.Parameter] = {}
    whole: dict[int, nn.Parameter] = {}  # undo: tied slices gathered once, tied again
    shapes = {}
    for spec in prepared.specs:
        before = tuple(spec.module.weight.shape)
        grad = (spec.module.weight.requires_grad,
                getattr(getattr(spec.module, "bias", None), "requires_grad", False))
        slice_module(spec, rank, cache)
        shapes[spec.name] = (before, tuple(spec.module.weight.shape))
        if communicator is not None:
            record(f"sharded weight of {spec.name} (all-gathered back)",
                   _unslice(spec, rank, communicator, whole, grad))
    return shapes


def gather_whole(local: torch.Tensor, dim: int, ranges: list[list[Range]], size: int,
                 comm: Communicator) -> torch.Tensor:
    """The whole tensor whose ``dim`` has ``size`` entries, from every rank's ``local`` slice
    (rank r holds the concatenation of ``ranges[r]`` along ``dim``): one all-gather, slices
    padded to the largest so uneven splits gather too. Ranks sharing entries (kv heads
    replicated over ranks) hold the same values, so either copy is kept."""
    widths = [sum(b - a for a, b in r) for r in ranges]
    width = max(widths)
    pad = width - local.shape[dim]
    if pad:
        shape = list(local.shape)
        shape[dim] = pad
        local = torch.cat([local, local.new_zeros(shape)], dim=dim)
    parts = comm.all_gather(local.contiguous(), dim=dim)  # [.., tp_size * width, ..]
    shape = list(local.shape)
    shape[dim] = size
    out = local.new_empty(shape)
    covered = torch.zeros(size, dtype=torch.bool)
    for r, rank_ranges in enumerate(ranges):
        offset = r * width
        for a, b in rank_ranges:
            out.narrow(dim, a, b - a).copy_(parts.narrow(dim, offset, b - a))
            covered[a:b] = True
            offset += b - a
    if not bool(covered.all()):
        raise ShardingError(f"the ranks' slices cover {int(covered.sum())} of {size} entries; "
                            f"the whole tensor cannot be gathered back")
    return out


# ----- expert parallelism ------------------------------------------------------------------------

def set_expert_sizes(spec: ExpertShardSpec, coord: int) -> None:
    """The experts module's expert count attribute (``num_experts``, when it has one) set to
    ep rank ``coord``'s, once its parameters hold that rank's experts (sliced here or read from
    a checkpoint): HF's own experts forward then skips the index ``E_local`` (another rank's
    expert), as the experts-module contract says. Recorded: undoing puts the whole count back."""
    if hasattr(spec.module, "num_experts"):
        set_recorded(spec.module, {"num_experts": spec.count(coord)},
                     f"expert count of {spec.name}")


@torch.no_grad()
def slice_experts(prepared: PreparedShards, rank: int, communicator: Communicator | None = None
                  ) -> dict[str, tuple[tuple, tuple]]:
    """Keep only ep rank ``rank``'s experts in every experts module: each of its parameters is
    replaced by its ``[start, stop)`` rows along dim 0 (fresh storage, so the whole tensor can
    be freed). A module whose parameters already hold the rank's experts (a loader read only
    them) is left as it is. Returns module name → (first parameter's shape whole, this rank's).

    With ``communicator`` (the ep group) each slice is recorded in the active ledger with an
    undo that all-gathers the whole parameters back (:func:`gather_whole`)."""
    coord = prepared.ep_coord(rank)
    shapes = {}
    for spec in prepared.experts:
        start, stop = spec.ranges[coord]
        local = stop - start
        first = getattr(spec.module, spec.params[0])
        whole_shape = (spec.total, *first.shape[1:])
        if first.shape[0] == spec.total and local != spec.total:
            grads = {}
            for pname in spec.params:
                param = getattr(spec.module, pname)
                grads[pname] = param.requires_grad
                setattr(spec.module, pname,
                        nn.Parameter(take(param, 0, [(start, stop)]), requires_grad=False))
            if communicator is not None:
                record(f"expert-parallel slice of {spec.name} (all-gathered back)",
                       _unslice_experts(spec, communicator, grads))
        elif first.shape[0] != local:
            raise ShardingError(f"experts module {spec.name!r} holds {first.shape[0]} experts; "
                                f"ep rank {coord} should hold {local} of {spec.total}")
        set_expert_sizes(spec, coord)
        shapes[spec.name] = (whole_shape, (local, *first.shape[1:]))
    return shapes


def _unslice_experts(spec: ExpertShardSpec, comm: Communicator,
                     grads: Mapping[str, bool]) -> Callable[[], None]:
    """The undo of one experts module's slice: each parameter gathered whole from every ep
    rank's experts (collectives: runs on every rank of ``comm``, which may hold several expert
    groups: rank r holds ep coordinate ``r mod ep``'s experts, the same values in every group).
    Parameters already whole are left."""
    ranges = [[spec.ranges[r % len(spec.ranges)]] for r in range(comm.world_size)]

    def undo() -> None:
        for pname in spec.params:
            param = getattr(spec.module, pname)
            if param.shape[0] == spec.total:
                continue
            full = gather_whole(param.detach(), 0, ranges, spec.total, comm)
            setattr(spec.module, pname, nn.Parameter(full, requires_grad=grads[pname]))
    return undo


def _unslice(spec: ShardSpec, rank: int, comm: Communicator, whole: dict[int, nn.Parameter],
             grad: tuple[bool, bool]) -> Callable[[], None]:
    """The undo of :func:`slice_module` for ``spec`` on ``rank``: rebuild the whole weight (and
    bias) from what every rank now holds. Runs on every rank (collectives); a weight already
    whole (the ledger's record put it back) is left alone, on every rank alike."""
    def undo() -> None:
        module = spec.module
        weight = module.weight
        if weight.shape[spec.dim] == spec.size:  # whole already: on every rank alike (each
            return  # keeps all of it, or the record put every rank's original back)
        if id(weight) not in whole:
            whole[id(weight)] = nn.Parameter(
                gather_whole(weight.detach(), spec.dim, spec.ranges, spec.size, comm),
                requires_grad=grad[0])
        module.weight = whole[id(weight)]
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            if isinstance(spec.role, RowParallel):  # whole on rank 0, zeros elsewhere
                full = comm.broadcast(bias.detach().clone(), src=0)
            else:  # bias [out], split like the weight's out dim
                full = gather_whole(bias.detach(), 0, spec.ranges, spec.size, comm)
            module.bias = nn.Parameter(full, requires_grad=grad[1])
    return undo


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
    what = f"{role.name} hook of {spec.name}"
    if isinstance(role, RowParallel):
        return [add_hook(module.register_forward_hook(_all_reduce_hook(comm)), what)]
    if isinstance(role, VocabParallelEmbedding):
        [(start, stop)] = spec.ranges[rank]
        mask = _VocabMask(start, stop, comm)
        return [add_hook(module.register_forward_pre_hook(mask.before, with_kwargs=True), what),
                add_hook(module.register_forward_hook(mask.after), what)]
    if isinstance(role, VocabParallelHead):
        sizes = [sum(b - a for a, b in r) for r in spec.ranges]
        return [add_hook(module.register_forward_hook(_GatherLastDim(sizes, comm)), what)]
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
    """Set the policy's per-rank attributes (``num_heads`` …) on each attention instance, give
    it a :class:`ConfigView` with the policy's ``attention_config_attrs`` overridden (reported
    as ``config.<attr>``) and narrow its ``attention_head_params`` to the rank's heads
    (reported as their local count). All recorded: undoing puts the whole model's values
    back."""
    out = {}
    heads = prepared.heads[rank] if prepared.heads else None
    policy = prepared.policy
    for name, module in prepared.attention.items():
        values = {attr: heads.quantity(qty) for attr, qty in policy.attention_attrs.items()
                  if hasattr(module, attr)}
        set_recorded(module, values, f"per-rank attention attributes of {name}")
        config = getattr(module, "config", None)
        overrides = {attr: heads.quantity(qty)
                     for attr, qty in policy.attention_config_attrs.items()
                     if hasattr(config, attr)}
        if overrides:
            set_recorded(module, {"config": ConfigView(config, overrides)},
                         f"per-rank config view of {name}")
            values.update({f"config.{attr}": value for attr, value in overrides.items()})
        values.update(_slice_head_params(module, name, policy, heads))
        out[name] = values
    return out


def _slice_head_params(module: nn.Module, name: str, policy: "Policy",
                       heads: HeadPartition | None) -> dict[str, int]:
    """The policy's ``attention_head_params`` of ``module`` ([heads, ...] along dim 0) replaced by
    the rank's heads' entries, a view of the whole parameter (small: one entry per head), which
    so stays in memory and which undoing puts back (recorded); attribute → the entries kept."""
    out = {}
    for attr, unit in getattr(policy, "attention_head_params", {}).items():
        param = getattr(module, attr, None)
        if heads is None or not isinstance(param, torch.Tensor):
            continue
        total, first, stop = HeadSlicedInput(attr, dim=0, unit=unit).head_range(heads)
        if param.dim() == 0 or param.shape[0] != total:
            raise ShardingError(f"{name}.{attr} has shape {tuple(param.shape)}; the policy's "
                                f"attention_head_params says dim 0 holds its {total} {unit}")
        local = nn.Parameter(param.detach()[first:stop], requires_grad=False)
        set_recorded(module, {attr: local}, f"per-rank {attr} of {name}")
        record(f"whole {attr} of {name} (a copy: one entry per head)",
               _refill(param, param.detach().clone()))
        out[attr] = stop - first
    return out


def _refill(param: torch.Tensor, whole: torch.Tensor) -> Callable[[], None]:
    """Undo: ``param`` holds ``whole`` again. A later step may have replaced the narrowed view's
    data (a cast), so the whole Parameter is no longer the model's and the ledger lets its data
    go (``Ledger.drop_replaced``); this copy (one entry per head) puts it back, exact."""
    def undo() -> None:
        if param.shape != whole.shape or param.dtype != whole.dtype:
            param.data = whole
    return undo


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
    _check_groups(prepared, communicator)
    before = param_bytes(model) if bytes_before is None else bytes_before
    report = ShardReport(prepared.tp_size, rank, prepared.plan.source, prepared.policy.name,
                         notes=prepared.notes, param_bytes_before=before,
                         ep_size=prepared.ep_size)
    shapes = dict(sliced) if sliced is not None else slice_all(prepared, rank, communicator)
    for spec in prepared.specs:
        install_hooks(spec, rank, communicator)
        report.sharded[spec.name] = ShardedModule(spec.name, spec.role.name, spec.layout.describe(),
                                                  *shapes[spec.name])
    coord = prepared.ep_coord(rank)
    for name, shape in slice_experts(prepared, rank, communicator).items():
        start, stop = prepared.experts[0].ranges[coord]
        report.sharded[name] = ShardedModule(name, "expert", f"experts [{start}, {stop})",
                                             *shape)
    report.attention = set_attention_attrs(prepared, rank)
    install_head_slicers(prepared.head_sliced, prepared.heads[rank] if prepared.heads else None)
    if prepared.heads:
        report.heads = (prepared.heads[rank].q_heads, prepared.heads[rank].kv_heads)
    report.replicated = _replicated(model, report.sharded)
    report.param_bytes = param_bytes(model)
    mine = torch.tensor([report.param_bytes], dtype=torch.int64)
    report.rank_param_bytes = communicator.all_gather(mine, dim=0).tolist()
    set_recorded(model, {SHARDED_ATTR: report}, "shard report")
    return report


def _check_groups(prepared: PreparedShards, communicator: Communicator) -> None:
    """The communicator is the group of every split: the tp group when modules are split by
    tensor parallelism, the ep group when experts are (this version: both the whole world)."""
    if prepared.specs and communicator.world_size != prepared.tp_size:
        raise ShardingError(f"prepared for tp_size={prepared.tp_size} but the communicator has "
                            f"{communicator.world_size} ranks")
    if prepared.experts and communicator.world_size % prepared.ep_size:
        raise ShardingError(f"prepared for ep_size={prepared.ep_size} but the communicator has "
                            f"{communicator.world_size} ranks (expert groups of ep_size ranks "
                            f"must split it)")


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



"""Materialise a model (on the meta device) from a checkpoint, each rank reading only its slices.

:func:`load_checkpoint` is step 3 of ``init_inference`` and usable alone::

    with torch.device("meta"):                       # or accelerate.init_empty_weights()
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    prepared = shardwise.sharding.prepare_for(model, None, tp_size)   # the slices, no weights
    loaded = load_checkpoint(model, path, prepared=prepared, rank=rank, dtype=torch.bfloat16)

Everything knowable from the files' headers (missing files, truncated headers, missing or
unexpected keys, shapes that do not fit the config, a tensor whose dtype kind — bool, integer,
floating, complex — differs from its parameter's) is checked before any data is read. If the
load fails at any point, the loader undoes what it did to the model: every module it swapped
(by an extension or a hook, e.g. QuantLinear shells) is put back, and every parameter and
buffer goes back to the meta device, so a half-loaded model can never run and the same model can
be loaded again. (What it changes only on success: module sizes under tensor parallelism.)

Other transforms plug in without the loader knowing them (:mod:`.extensions`):

* **tensor hooks** (``hooks=``): each is told every tensor the load will read before any data is
  read, then called with each tensor as this rank's slice of it is read; a tensor a hook takes is
  not assigned. Quantizing while reading is one (``shardwise.quant.Quantizer.reading_hook``): the
  float slice is quantized at once, so the full-precision model never sits in memory.
* **tensors another rank reads** (``skip_modules=``): a pipeline rank names the modules other
  stages run (their layers, the embedding off the first stage, the head off the last); their
  tensors are checked against the headers like every other but not read, and stay on meta (the
  pipeline step replaces those modules by stand-ins). A tensor tied across a skipped and a kept
  module (GPT-2's embedding and head) is read.
* **checkpoint extensions**: data the description's ``"extensions"`` section and the rank files
  carry for another transform (a quantized engine's packed layers) is handed to the extension of
  that name, which puts in the modules it loads into (empty QuantLinear shells) before the load
  plans its tensors; the tensors it names are read as stored, whole, from this rank's own file
  (such a checkpoint loads at its saved tp size only).
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from ..sharding.apply import PreparedShards, param_ranges, set_shard_sizes
from ..sharding.specs import expert_param_ranges
from .conversions import Composite, check_lists, expert_count_message, key_map, select
from .description import Description, describe
from .errors import CheckpointError, ExpertCountError
from .extensions import LoadContext, TensorHook, TensorRef, extension
from .progress import Progress
from .saver import split_ranks
from .sources import CheckpointIndex, Reader, build_index

log = logging.getLogger(__name__)

#: unexpected checkpoint keys HF itself ignores for every model (moved / non-persistent buffers)
_ALWAYS_IGNORED = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$", r"\.attn\.masked_bias$",
                   r"\.attn\.bias$")


@dataclass
class Target:
    """One model tensor to fill: every name it goes by (tied aliases), the checkpoint key it comes
    from (or the checkpoint tensors transformers builds it from: ``composite``), and what this
    rank keeps of it (``(dim, ranges)``, "whole" or "zeros")."""

    names: list[str]
    shape: tuple[int, ...]
    dtype: torch.dtype
    key: str | None = None
    keep: Any = "whole"
    is_buffer: bool = False
    raw: bool = False  # an extension's per-rank tensor: read in its stored dtype, never converted
    composite: Composite | None = None  # built from several keys (one tensor per expert)

    @property
    def found(self) -> bool:
        return self.key is not None or self.composite is not None


@dataclass
class LoadReport:
    """What a load did: the files, the bytes read by this rank, how long it took."""

    source: str
    files: int
    bytes_read: int
    seconds: float
    tensors: int
    rank: int = 0
    sliced: dict[str, tuple[tuple, tuple]] = field(default_factory=dict)
    bytes_before: int = 0  # the whole model's parameter bytes (for the shard report)
    #: hook / extension name → what it reported (e.g. ``"shardwise.quant"``: the QuantReport)
    results: dict[str, Any] = field(default_factory=dict)
    #: tensors left unread for other ranks (``skip_modules``: other pipeline stages'), each once
    skipped: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / max(self.seconds, 1e-9) / 1e9

    def summary(self) -> str:
        return (f"loaded {self.tensors} tensors from {self.files} file(s) of {self.source}: "
                f"{self.bytes_read / 1e9:.3f} GB read by rank {self.rank} in "
                f"{self.seconds:.2f} s ({self.gb_per_s:.2f} GB/s)"
                + (f"; {self.skipped} tensors left to other pipeline stages"
                   if self.skipped else ""))


def load_checkpoint(model: nn.Module, checkpoint: "str | os.PathLike | Mapping | Description", *,
                    prepared: PreparedShards | None = None, rank: int = 0,
                    device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                    base_dir: str | os.PathLike | None = None,
                    progress: bool | None = None,
                    hooks: "list[TensorHook] | tuple[TensorHook, ...]" = (),
                    experts: int | None = None,
                    skip_modules: "tuple[str, ...] | list[str]" = ()) -> LoadReport:
    """Fill ``model``'s parameters and buffers from ``checkpoint``, in place.

    Args:
        model: the model, normally on the meta device (real weights are replaced).
        checkpoint: a model directory, a description file or dict, or a :class:`Description`.
        prepared: the tensor-parallel slices (``shardwise.sharding.prepare_for``) and under
            expert parallelism the experts modules' (``plan.sharding``); with it, this rank
            reads and keeps only its slices and its experts, and module sizes follow the
            tensor-parallel split (the experts' counts are set by ``apply_shards``).
        rank: the rank whose slices to read.
        device: where the tensors are materialised.
        dtype: floating tensors are converted to it while read (None keeps the stored dtype).
            An extension's per-rank tensors are never converted.
        base_dir: the folder the description's file names are relative to.
        progress: show a progress bar (default: on a terminal, on rank 0).
        hooks: :class:`~shardwise.checkpoint.extensions.TensorHook` s called for each tensor
            read (module docstring), e.g. ``Quantizer.reading_hook()``; each one's result is in
            the report's ``results[hook.name]``.
        experts: a Mixture-of-Experts model's routed experts per MoE layer (the plan's
            ``experts.total``), named by the error for a checkpoint holding another count (else
            an experts module's own ``num_experts`` is).
        skip_modules: names of modules (as ``model.named_modules()`` gives them) whose tensors
            this rank does not read: another pipeline stage runs them (module docstring). Their
            keys are still checked against the headers; the tensors stay on meta, and hooks are
            not told of them. A tensor tied to a module outside them is read.

    Checkpoint keys become model tensors as transformers' ``from_pretrained`` renames and
    converts them (:mod:`.conversions`): a checkpoint in an older layout (one tensor per expert)
    loads into the stacked 3-D expert parameters, each rank reading only its experts' tensors.

    Raises:
        ExpertCountError: the checkpoint holds another number of experts per layer than the
            model, before any data is read.
        CheckpointError: a missing or corrupted file, missing or unexpected keys, a shape or a
            dtype kind that does not match the model (named), before any data is read; a file
            outside the checkpoint's folder (:mod:`.description`); an extension's own
            errors (subclasses) for its data (e.g. a quantized checkpoint at another tp size).
        ConfigError: a hook's refusal (e.g. quantization settings that do not fit a layer),
            before any read.
    """
    desc = checkpoint if isinstance(checkpoint, Description) else describe(checkpoint, base_dir)
    hooks = tuple(hooks)
    context = LoadContext(desc.source, desc.tp_size, split_ranks(prepared), rank, dtype, hooks)
    check_extensions(desc, context)
    index = build_index(desc, rank, _split_keep(prepared, rank))
    bytes_before = sum(p.numel() * p.element_size() for p in model.parameters())
    modules = _module_tree(model)  # to put back if the load fails (modules swapped in)
    try:
        states = _install_extensions(model, index, desc, prepared, context)
        targets = plan_targets(model, index, prepared, rank, experts)
        targets, skipped = _without_skipped(targets, tuple(skip_modules))
        for hook in hooks:
            hook.plan(model, _refs(model, targets))
        start = time.perf_counter()
        with Reader(index, rank) as reader, Progress(desc, targets, index, rank, progress) as bar:
            count = _materialise(model, targets, reader, torch.device(device), dtype, bar, hooks)
            _fill_meta_buffers(model, torch.device(device), tuple(skip_modules))
            bytes_read = reader.bytes_read
        results = {h.name: h.finish(model) for h in hooks}
    except BaseException:
        _restore_modules(modules)
        _back_to_meta(model)
        raise
    sliced = _set_sizes(prepared, rank) if prepared is not None else {}
    report = LoadReport(desc.source, len(desc.files), bytes_read, time.perf_counter() - start,
                        count, rank, sliced, bytes_before, skipped=skipped)
    for name, state in states.items():
        results[name] = extension(name, desc.source).finish(model, state, context,
                                                            torch.device(device))
    report.results = results
    if rank == 0:
        log.info("shardwise: %s", report.summary())
        Progress.summary(report.summary(), progress)
    return report


# ----- planning: every check before any data --------------------------------------------------

def plan_targets(model: nn.Module, index: CheckpointIndex, prepared: PreparedShards | None,
                 rank: int, experts: int | None = None) -> list[Target]:
    """Every persistent tensor of ``model`` with its checkpoint key (or the keys transformers
    builds it from) and this rank's slice. Raises :class:`CheckpointError` for missing /
    unexpected keys and wrong shapes (:class:`ExpertCountError` for another expert count)."""
    targets = _targets(model)
    keep = _rank_slices(prepared, rank) if prepared is not None else {}
    resolve = _key_resolver(model, index.keys())
    converted = key_map(model, index.keys())
    missing = []
    for t in targets:
        t.key = next((k for k in map(resolve, t.names) if k is not None), None)
        if t.key is None:  # renamed, or built from several keys, the way transformers loads it
            t.key = next((converted.direct[n] for n in t.names if n in converted.direct), None)
            t.composite = None if t.key is not None else next(
                (converted.composite[n] for n in t.names if n in converted.composite), None)
        t.keep = next((keep[n] for n in t.names if n in keep), "whole")
        if t.key in index.per_rank:  # this rank's own packed tensor, stored as it is
            t.keep, t.raw = "whole", True
        if not t.found and not _ignored(t.names[0], model, "missing"):
            missing.append(t.names[0])
    used = {t.key for t in targets} | {k for t in targets if t.composite for k in t.composite.keys}
    unexpected = [k for k in index.keys() if k not in used and not _ignored(k, model, "unexpected")]
    if missing or unexpected:
        raise CheckpointError(_keys_message(missing, unexpected, model))
    for t in targets:  # the expert count first: it explains the router's shape too
        if t.composite is not None:
            check_lists(t.composite, t.shape, experts)
        elif t.key is not None and tuple(index.shapes[t.key]) != t.shape:
            _check_expert_count(model, t, tuple(index.shapes[t.key]), experts)
    for t in targets:
        if t.composite is not None:
            _check_composite(t, index)
            continue
        if t.key is not None and tuple(index.shapes[t.key]) != t.shape:
            raise CheckpointError(
                f"tensor {t.key!r} has shape {list(index.shapes[t.key])} in the checkpoint but "
                f"{list(t.shape)} in the model built from the config ({t.names[0]}); the "
                f"checkpoint and the config do not belong together")
        if t.key is not None and not t.raw and _kind(index.dtypes[t.key]) != _kind(t.dtype):
            raise CheckpointError(
                f"tensor {t.key!r} is {_name(index.dtypes[t.key])} in the checkpoint but the "
                f"model's {'buffer' if t.is_buffer else 'parameter'} {t.names[0]!r} is "
                f"{_name(t.dtype)}: a {_kind(index.dtypes[t.key])} tensor is never converted to "
                f"{_kind(t.dtype)}; the checkpoint does not belong to this model (or was saved "
                f"with the wrong dtype): re-save it")
    return [t for t in targets if t.found]


def _without_skipped(targets: list[Target], skip: tuple[str, ...]) -> tuple[list[Target], int]:
    """(the targets to read, how many were left out): a target is left out when every name it
    goes by lies inside one of the ``skip`` modules (a tied alias outside them keeps it)."""
    if not skip:
        return targets, 0
    kept = [t for t in targets if not all(_inside(n, skip) for n in t.names)]
    return kept, len(targets) - len(kept)


def _check_composite(t: Target, index: CheckpointIndex) -> None:
    """A tensor built from several checkpoint tensors (its lists checked by ``check_lists``):
    dtype kinds that fit, and the shape the conversion builds (headers only)."""
    entry = t.composite
    for key in entry.keys:
        if _kind(index.dtypes[key]) != _kind(t.dtype):
            raise CheckpointError(
                f"tensor {key!r} is {_name(index.dtypes[key])} in the checkpoint but the model's "
                f"parameter {t.names[0]!r} it builds is {_name(t.dtype)}; the checkpoint does "
                f"not belong to this model")
    built = entry.meta_shape(index.shapes, index.dtypes)
    if built != t.shape:
        raise CheckpointError(
            f"the checkpoint tensors {', '.join(map(repr, entry.keys[:3]))}… build "
            f"{t.names[0]!r} as {list(built)} the way transformers converts them, but the model "
            f"built from the config has {list(t.shape)}; the checkpoint and the config do not "
            f"belong together")


def _check_expert_count(model: nn.Module, t: Target, stored: tuple[int, ...],
                        experts: int | None) -> None:
    """A tensor with one entry per expert along dim 0 — its module holds a 3-D parameter whose
    dim 0 is the expert count (the stacked experts), or says ``num_experts`` is (HF's experts
    and routers) — whose checkpoint shape differs in dim 0 alone: :class:`ExpertCountError`."""
    if len(stored) != len(t.shape) or not stored or stored[1:] != t.shape[1:]:
        return
    owner = model.get_submodule(t.names[0].rpartition(".")[0])
    count = experts if experts is not None else getattr(owner, "num_experts", None)
    if count != t.shape[0] or not (getattr(owner, "num_experts", None) == count or any(
            p.dim() == 3 and p.shape[0] == count for p in owner.parameters(recurse=False))):
        return
    raise ExpertCountError(expert_count_message(
        t.names[0], stored[0], t.shape[0], experts,
        f"{t.key!r} is {list(stored)} in the checkpoint, {list(t.shape)} in the model"))


def _kind(dtype: torch.dtype) -> str:
    """bool, integer, floating or complex: what a dtype conversion must never cross."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _targets(model: nn.Module) -> list[Target]:
    """Persistent parameters and buffers, tied aliases grouped (state_dict names, in order)."""
    by_id: dict[int, Target] = {}
    persistent = set(model.state_dict(keep_vars=True))
    named = [(n, t, False) for n, t in model.named_parameters(remove_duplicate=False)]
    named += [(n, t, True) for n, t in model.named_buffers(remove_duplicate=False)]
    for name, tensor, is_buffer in named:
        if name not in persistent or tensor is None:
            continue
        if id(tensor) in by_id:
            by_id[id(tensor)].names.append(name)
        else:
            by_id[id(tensor)] = Target([name], tuple(tensor.shape), tensor.dtype,
                                       is_buffer=is_buffer)
    return list(by_id.values())


def _rank_slices(prepared: PreparedShards, rank: int) -> dict[str, Any]:
    """Parameter name → what ``rank`` keeps, from the sharding plan's own range computation:
    its tensor-parallel slices and, under expert parallelism, its experts (dim 0 of every
    parameter of an experts module)."""
    out = {}
    for spec in prepared.specs:
        for pname, keep in param_ranges(spec, rank).items():
            out[f"{spec.name}.{pname}"] = keep
    coord = prepared.ep_coord(rank)
    for spec in prepared.experts:
        for pname, keep in expert_param_ranges(spec, coord).items():
            out[f"{spec.name}.{pname}"] = keep
    return out


def _split_keep(prepared: PreparedShards | None, rank: int) -> dict[str, tuple[int, int]]:
    """Experts module name → the experts ``[start, stop)`` ``rank`` keeps: what it reads of the
    tensors an extension stores split over the rank files (packed quantized experts)."""
    if prepared is None or not prepared.experts:
        return {}
    coord = prepared.ep_coord(rank)
    return {spec.name: tuple(spec.ranges[coord]) for spec in prepared.experts}


def _key_resolver(model: nn.Module, keys: list[str]):
    """model name → checkpoint key: exact, then with/without the base-model prefix, after the
    model's ``_checkpoint_conversion_mapping`` renames (regex → replacement) if it has any."""
    renames = getattr(model, "_checkpoint_conversion_mapping", None) or {}
    lookup = {}
    for key in keys:
        new = key
        for pattern, repl in renames.items():
            new = re.sub(pattern, repl, new)
        lookup.setdefault(new, key)
    prefix = getattr(model, "base_model_prefix", "") or ""

    def resolve(name: str) -> str | None:
        candidates = [name]
        if prefix and name.startswith(prefix + "."):
            candidates.append(name[len(prefix) + 1:])
        elif prefix:
            candidates.append(f"{prefix}.{name}")
        return next((lookup[c] for c in candidates if c in lookup), None)
    return resolve


def _ignored(name: str, model: nn.Module, which: str) -> bool:
    patterns = set(getattr(model, f"_keys_to_ignore_on_load_{which}", None) or ())
    if which == "unexpected":
        patterns |= set(_ALWAYS_IGNORED)
    return any(re.search(p, name) for p in patterns)


def _keys_message(missing: list[str], unexpected: list[str], model: nn.Module) -> str:
    parts = [f"the checkpoint does not fit {type(model).__name__}:"]
    if missing:
        parts.append(f"missing keys ({len(missing)}): {', '.join(missing[:20])}"
                     + (" …" if len(missing) > 20 else ""))
    if unexpected:
        parts.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:20])}"
                     + (" …" if len(unexpected) > 20 else ""))
    parts.append("check that the checkpoint was saved from this architecture and config")
    return " ".join(parts)


# ----- materialising --------------------------------------------------------------------------

@torch.no_grad()
def _materialise(model: nn.Module, targets: list[Target], reader: Reader, device: torch.device,
                 dtype: torch.dtype | None, bar: Progress, hooks: tuple[TensorHook, ...] = ()
                 ) -> int:
    for t in sorted(targets, key=lambda t: _first_file(reader.index, _first_key(t))):
        _fill(model, t, reader, device, dtype, hooks)
        bar.update(reader.bytes_read)
    return len(targets)


def _fill(model: nn.Module, t: Target, reader: Reader, device: torch.device,
          dtype: torch.dtype | None, hooks: tuple[TensorHook, ...] = ()) -> None:
    """Read ``t`` (this rank's part, converted to ``dtype`` unless raw), offer it to the hooks
    (in host memory), and assign it unless one took it."""
    value = _read_target(t, reader, None if t.raw else dtype)
    if hooks and not t.raw:
        owner_name, _, attr = t.names[0].rpartition(".")
        owner = model.get_submodule(owner_name)
        if any(h.on_tensor(owner_name, owner, attr, value) for h in hooks):
            return
    value = value.to(device)
    if not t.is_buffer:
        value = nn.Parameter(value, requires_grad=False)
    for name in t.names:
        _assign(model, name, value, t.is_buffer)


def _first_file(index: CheckpointIndex, key: str) -> str:
    return str(index.pieces[key][0].info.file)


def _first_key(t: Target) -> str:
    """The checkpoint key ``t`` is read from first (its first expert's, when built from many)."""
    return t.key if t.composite is None else t.composite.keys[0]


def _read_target(t: Target, reader: Reader, dtype: torch.dtype | None) -> torch.Tensor:
    if t.keep == "zeros":
        return torch.zeros(t.shape, dtype=dtype if t.dtype.is_floating_point and dtype else t.dtype)
    if t.composite is not None:
        return _read_composite(t, reader, dtype)
    if t.keep == "whole":
        return reader.read(t.key, None, None, dtype)
    dim, ranges = t.keep
    return reader.read(t.key, dim, ranges, dtype)


def _read_composite(t: Target, reader: Reader, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` built by transformers' converter from its checkpoint tensors (each read whole, in
    ``dtype``). A rank keeping a range of the stacked dim (its experts) reads only those list
    entries; any other slice is cut from the whole tensor."""
    entry, shapes = t.composite, reader.index.shapes
    stored = reader.index.dtypes[entry.keys[0]]
    into = (reader.read_into, dtype if dtype is not None and stored.is_floating_point else stored)

    def load(key: str) -> torch.Tensor:
        return reader.read(key, None, None, dtype)
    if t.keep == "whole":
        return entry.build(load, shapes=shapes, into=into)
    dim, ranges = t.keep
    if dim == entry.stack_dim:
        return entry.build(load, select(ranges), shapes, into)
    whole = entry.build(load, shapes=shapes, into=into)
    return torch.cat([whole.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()


def _assign(model: nn.Module, name: str, value: torch.Tensor, is_buffer: bool) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if is_buffer:
        owner._buffers[attr] = value
    else:
        owner._parameters[attr] = value


def _inside(name: str, modules: "tuple[str, ...] | list[str]") -> bool:
    """Whether the tensor or module ``name`` is one of ``modules`` or lies inside one."""
    return any(name == m or name.startswith(m + ".") for m in modules)


def _fill_meta_buffers(model: nn.Module, device: torch.device, skip: tuple[str, ...] = ()
                       ) -> None:
    """Non-persistent buffers still on the meta device (the model was built under
    ``torch.device("meta")``) are recomputed by the model's own initialiser (HF's
    ``_init_weights``, e.g. rotary ``inv_freq``); one it does not fill is an error, named.
    Buffers inside the ``skip`` modules (another pipeline stage's) stay on meta, as their
    parameters do."""
    owners = {}
    for name, buf in model.named_buffers():
        if _inside(name, skip):
            continue
        if buf is not None and buf.is_meta:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            fill = float("nan") if buf.is_floating_point() else 0
            owner._buffers[attr] = torch.full(buf.shape, fill, dtype=buf.dtype, device=device)
            owners.setdefault(owner_name, (owner, []))[1].append(name)
    init = getattr(model, "_init_weights", None)
    for owner_name, (owner, names) in owners.items():
        if callable(init):
            init(owner)
        bad = [n for n in names
               if (b := model.get_buffer(n)).is_floating_point() and b.isnan().any()]
        if bad or not callable(init):
            raise CheckpointError(
                f"buffer(s) {', '.join(bad or names)} are not in the checkpoint and the model "
                f"cannot recompute them after meta-device construction; build the model with "
                f"real buffers: `with accelerate.init_empty_weights(): model = ...` (parameters "
                f"on meta, buffers real), or pass model=None")


def _set_sizes(prepared: PreparedShards, rank: int) -> dict[str, tuple[tuple, tuple]]:
    """Module name → (whole weight shape, this rank's), after setting each module's sizes. The
    shapes come from the plan: a module quantized while loading no longer holds its weight."""
    out = {}
    for spec in prepared.specs:
        before = list(spec.module.weight.shape)
        before[spec.dim] = spec.size
        after = list(before)
        after[spec.dim] = sum(b - a for a, b in spec.ranges[rank])
        set_shard_sizes(spec, rank)
        out[spec.name] = (tuple(before), tuple(after))
    return out


def _module_tree(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Every (parent, attribute, child) of ``model``: what a failed load puts back."""
    return [(parent, name, child) for parent in model.modules()
            for name, child in parent._modules.items()]


def _restore_modules(tree: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Undo the module swaps of a load (extensions' shells, hooks' modules): each child back
    under its parent as before the load."""
    for parent, name, child in tree:
        if parent._modules.get(name) is not child:
            parent._modules[name] = child


def _back_to_meta(model: nn.Module) -> None:
    """After a failed load: every parameter and buffer back on meta, so nothing half-loaded
    can run (``check_materialized`` refuses it)."""
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for attr, t in store.items():
                if t is not None and not t.is_meta:
                    meta = torch.empty_like(t, device="meta")
                    store[attr] = nn.Parameter(meta, requires_grad=False) \
                        if isinstance(t, nn.Parameter) else meta


# ----- hooks and extensions ------------------------------------------------------------------

def check_extensions(desc: Description, context: LoadContext) -> None:
    """Each extension the checkpoint carries checks it can load as ``context`` asks (its tp
    size, dtype, hooks), raising its own named error. Reads no file."""
    for name, entry in desc.extensions.items():
        extension(name, desc.source).check_load(entry, context)


def _install_extensions(model: nn.Module, index: CheckpointIndex, desc: Description,
                        prepared: PreparedShards | None, context: LoadContext) -> dict[str, Any]:
    """Let each extension put in the modules its data loads into (before the targets are
    planned); name → its state for ``finish``."""
    if not index.extensions:
        return {}
    shapes = _local_shapes(model, prepared, context.rank)
    return {name: extension(name, desc.source).install(model, desc.extensions[name], entry,
                                                        shapes, context)
            for name, entry in index.extensions.items()}


def _local_shapes(model: nn.Module, prepared: PreparedShards | None,
                  rank: int) -> dict[str, tuple[int, ...]]:
    """Parameter name → the shape ``rank`` keeps of it under the sharding plan."""
    keep = _rank_slices(prepared, rank) if prepared is not None else {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shape = list(p.shape)
        if isinstance(keep.get(name), tuple):
            dim, ranges = keep[name]
            shape[dim] = sum(b - a for a, b in ranges)
        out[name] = tuple(shape)
    return out


def _refs(model: nn.Module, targets: list[Target]) -> list[TensorRef]:
    """What the hooks are told of each target: its names, owner, this rank's shape."""
    refs = []
    for t in targets:
        if t.raw:
            continue
        owner, _, attr = t.names[0].rpartition(".")
        refs.append(TensorRef(tuple(t.names), owner, attr, tuple(_local_shape(t)), t.dtype,
                              t.is_buffer))
    return refs


def _local_shape(t: Target) -> list[int]:
    """The shape of what this rank keeps of ``t``."""
    shape = list(t.shape)
    if isinstance(t.keep, tuple):
        dim, ranges = t.keep
        shape[dim] = sum(b - a for a, b in ranges)
    return shape


def default_dtype(index: CheckpointIndex) -> torch.dtype:
    """The checkpoint's floating dtype (its first floating tensor's), float32 if none."""
    return next((d for d in index.dtypes.values() if d.is_floating_point), torch.float32)

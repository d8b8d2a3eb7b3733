"""Pipeline stages: which decoder layers each stage runs (docs/architecture.md, "Pipeline
stages"). Planning only: nothing here touches the model.

The decoder layers are cut into P contiguous stages. By default the cut minimises the largest
stage's work per step: its layers' weight bytes, plus the output head's on the last stage (every
step reads them whole). The input embedding is held by the first stage but reads only the
looked-up rows, so it weighs nothing in the cut (counting its bytes, as an earlier version did,
gave GPT-2's first stage 6 layers of 12 against a compute-balanced 9: its stage 1 then did 1.8x
stage 0's work and the schedule's bubble was that imbalance). A user ``split`` (layers per
stage) is taken as given once checked; :func:`measured_split` computes one from the measured
seconds of a workload (a prefill-heavy ``generate`` balances otherwise than a decode step's
bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..sharding.apply import param_bytes
from .config import PipelineConfigError, PipelineSettings


@dataclass(frozen=True)
class StagePlan:
    """The pipeline part of the plan.

    Attributes:
        bounds: every stage's layers ``[start, end)``, first stage first.
        coord: this rank's stage.
        ranks: each stage's rank in this rank's pipeline group (the ranks of this tp
            coordinate, one per stage: stage s is group rank s).
        costs: every stage's weight bytes as planned (layers, plus embedding / head at the ends).
        source: ``"balanced"`` (by work per step: weight bytes read, the embedding's not
            counted) or ``"split"`` (the user's).
        embed_dim: the input embedding's output width (the hidden size), read from the whole
            model at planning time (a tensor-parallel split may narrow the weight later).
        head_features: the output head's output width (the vocabulary), likewise; None for a
            model without a head.
        embed_name / head_name: the input embedding's and the output head's module names in
            the whole model (None: the model has none).
        tied: whether the head's weight IS the embedding's (one table): the first stage keeps
            it as its embedding, the last as its head (each its own copy, on its own rank).
        layer_bytes: every decoder layer's weight bytes in the whole model, first layer first
            (what :func:`rebalanced_split` weighs the layers by).
    """

    bounds: tuple[tuple[int, int], ...]
    coord: int
    ranks: tuple[int, ...]
    costs: tuple[int, ...]
    source: str
    embed_dim: int | None = None
    head_features: int | None = None
    embed_name: str | None = None
    head_name: str | None = None
    tied: bool = False
    layer_bytes: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        return len(self.bounds)

    @property
    def layers(self) -> range:
        """This rank's layer indices."""
        return range(*self.bounds[self.coord])

    @property
    def first(self) -> bool:
        return self.coord == 0

    @property
    def last(self) -> bool:
        return self.coord == self.size - 1

    def owner(self, layer: int) -> int:
        """The stage that runs decoder layer ``layer``."""
        for stage, (start, end) in enumerate(self.bounds):
            if start <= layer < end:
                return stage
        raise IndexError(f"layer {layer} is in no stage of {self.bounds}")

    def __repr__(self) -> str:
        stages = ", ".join(f"[{a}, {b})" for a, b in self.bounds)
        return f"{self.size} stages ({self.source}): {stages}; this rank stage {self.coord}"


def _bytes(module: nn.Module | None) -> int:
    """:func:`shardwise.sharding.apply.param_bytes` of ``module`` (meta tensors too), 0 for
    None (a model without that part)."""
    return 0 if module is None else param_bytes(module)


def balanced_bounds(costs: list[float], stages: int, first_extra: float = 0,
                    last_extra: float = 0, extras: "Sequence[float]" = ()
                    ) -> tuple[tuple[int, int], ...]:
    """Contiguous ``[start, end)`` ranges over ``len(costs)`` layers, one per stage (each at
    least one layer), minimising the largest stage cost; ``first_extra`` / ``last_extra`` are
    added to the first / last stage (embedding, head), ``extras[s]`` (when given, one per
    stage) to stage ``s`` whatever layers it gets. Exact dynamic programme, O(P·L²)."""
    n = len(costs)
    if extras and len(extras) != stages:
        raise ValueError(f"extras gives {len(extras)} stages, not {stages}")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, a: int, b: int) -> float:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == stages - 1 else 0)
        return prefix[b] - prefix[a] + extra + (extras[stage] if extras else 0)

    inf = float("inf")
    # best[s][j]: the least largest cost of stages 0..s-1 over layers [0, j); cut[s][j] the start
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, end = [], n
    for s in range(stages, 0, -1):
        start = cut[s][end]
        bounds.append((start, end))
        end = start
    return tuple(reversed(bounds))


def plan_stages(model: nn.Module, layers: nn.ModuleList, settings: PipelineSettings,
                coord: int, ranks: tuple[int, ...]) -> StagePlan:
    """The :class:`StagePlan` for ``model`` whose decoder layers are ``layers``.

    Raises:
        PipelineConfigError: ``pp_size`` above the layer count, or a ``split`` that does not
            cover every layer exactly once (each naming what would).
    """
    n, pp = len(layers), settings.pp_size
    kind = type(model).__name__
    if pp > n:
        raise PipelineConfigError(f"pipeline_parallel pp_size={pp} is more than the {n} decoder "
                                  f"layers of {kind}: every stage needs at least one layer; use "
                                  f"pp_size <= {n}")
    costs = [_bytes(layer) for layer in layers]
    embed_module = _maybe(model, "get_input_embeddings")
    head_module = _maybe(model, "get_output_embeddings")
    embed, head = _bytes(embed_module), _bytes(head_module)
    if settings.split is not None:
        if sum(settings.split) != n:
            raise PipelineConfigError(
                f"pipeline_parallel split {list(settings.split)} covers {sum(settings.split)} "
                f"layers, but {kind} has {n}: the counts must add up to {n} (each layer in "
                f"exactly one stage), e.g. {list(balanced_sizes(n, pp))}")
        starts = [sum(settings.split[:s]) for s in range(pp + 1)]
        bounds = tuple((starts[s], starts[s + 1]) for s in range(pp))
        source = "split"
    else:
        bounds, source = balanced_bounds(costs, pp, last_extra=head), "balanced"
    stage_costs = tuple(sum(costs[a:b]) + (embed if s == 0 else 0) + (head if s == pp - 1 else 0)
                        for s, (a, b) in enumerate(bounds))
    names = {id(m): n for n, m in model.named_modules()}
    return StagePlan(bounds, coord, ranks, stage_costs, source, _width(embed_module, 1),
                     _width(head_module, 0), names.get(id(embed_module)),
                     names.get(id(head_module)), _tied(embed_module, head_module),
                     tuple(costs))


def measured_split(model: nn.Module, run, pp_size: int, *, warmup: int = 1,
                   repeats: int = 1) -> tuple[int, ...]:
    """A ``split`` for ``pipeline_parallel`` (decoder layers per stage, first stage first)
    balanced by measured seconds instead of weight bytes: ``run()`` exercises the whole model in
    this process (the workload to serve, e.g. ``lambda: model.generate(ids,
    max_new_tokens=64)``) ``warmup`` times untimed, then ``repeats`` times with every decoder
    layer, the input embedding and the output head timed (forward hooks, removed after); the
    cut minimises the largest stage's seconds, the embedding's counted on the first stage and
    the head's on the last (:func:`balanced_bounds`). Touches nothing else of the model.

    Why: the default cut balances the weight bytes each stage reads per step, which is a decode
    step's cost; a workload with long prompts and few new tokens is dominated by the prefill,
    whose layers compute every prompt token while ``generate``'s head computes one per row
    (GPT-2-small, 32-token prompts, 8 new tokens: the bytes cut 9/3 leaves the last stage idle
    a third of the prefill; the measured cut is 8/4). Measure once, on one process, and give
    every rank the same ``split`` (ranks that measured on their own could cut differently).

    Raises:
        PipelineConfigError: ``pp_size`` above the layer count, or a model whose decoder layers
            are not found.
    """
    from ..moe.block import MoEError, decoder_layers
    from ..policy import policy_for

    try:
        layers = decoder_layers(model, policy_for(model))
    except MoEError as exc:
        raise PipelineConfigError(f"measured_split times the decoder layers, but {exc}") from None
    if not 1 <= pp_size <= len(layers):
        raise PipelineConfigError(f"measured_split: pp_size={pp_size} must be between 1 and the "
                                  f"{len(layers)} decoder layers of {type(model).__name__}")
    for _ in range(warmup):
        run()
    parts = [*layers, _maybe(model, "get_input_embeddings"), _maybe(model, "get_output_embeddings")]
    seconds = [0.0] * len(parts)
    hooks = []
    for index, module in enumerate(parts):
        if module is not None:
            hooks += _timing_hooks(module, seconds, index)
    try:
        for _ in range(repeats):
            run()
    finally:
        for hook in hooks:
            hook.remove()
    *costs, embed, head = seconds
    bounds = balanced_bounds(costs, pp_size, first_extra=embed, last_extra=head)
    return tuple(b - a for a, b in bounds)


def rebalanced_split(stats, bounds: "Sequence[tuple[int, int]]",
                     layer_bytes: "Sequence[int]" = ()) -> tuple[int, ...]:
    """A ``split`` for ``pipeline_parallel`` balanced on a measured run of the pipeline itself:
    ``stats`` is the :class:`~shardwise.pipeline.schedule.PipelineStats` of a workload run with
    the stages ``bounds`` (``engine.pipeline_stats`` after an ``engine.generate`` or forward
    with micro-batches; :meth:`PipelineReport.rebalanced_split` passes both, and the layers'
    weight bytes). The layers cost the seconds all stages spent inside them, shared out by
    weight bytes (equally without ``layer_bytes``): pooled over the stages, so one rank's
    noise does not move layers. The rest of a stage's busy seconds (the embedding or the
    head, masks, its sends and receives: its work per micro-batch that no layer carries) stays
    with that stage wherever the cut moves. The cut then minimises the largest stage
    (:func:`balanced_bounds`).

    Why: the default cut (weight bytes, the head's included) and :func:`measured_split` (one
    process, layers and head timed by hooks) both leave out part of each stage's own work,
    which a run of the pipeline measures; on a deep model a layer is a small share of a stage,
    and a cut one layer off is then most of the imbalance left. Every rank gets the same
    stats (they are all-gathered), so every rank computes the same split.

    Raises:
        PipelineConfigError: ``stats`` without per-layer seconds, or not of these stages.
    """
    if len(stats.layers_s) != len(bounds) or len(stats.busy_s) != len(bounds):
        raise PipelineConfigError(
            f"rebalanced_split needs every stage's seconds in its layers from a run with these "
            f"{len(bounds)} stages; the stats have {len(stats.layers_s)}: run a micro-batched "
            f"forward or generate on the engine first")
    n = bounds[-1][1]
    weights = list(layer_bytes) if len(layer_bytes) == n and sum(layer_bytes) > 0 else [1] * n
    rate = sum(stats.layers_s) / sum(weights)  # seconds per byte (or per layer)
    extras = [max(busy - inside, 0.0) for busy, inside in zip(stats.busy_s, stats.layers_s)]
    bounds = balanced_bounds([w * rate for w in weights], len(bounds), extras=extras)
    return tuple(b - a for a, b in bounds)


def _timing_hooks(module: nn.Module, seconds: list[float], index: int) -> list:
    """Hooks adding ``module``'s forward seconds to ``seconds[index]`` (the handles)."""
    import time

    started: list[float] = []

    def begin(*_):
        started.append(time.perf_counter())

    def end(*_):
        seconds[index] += time.perf_counter() - started.pop()

    return [module.register_forward_pre_hook(begin), module.register_forward_hook(end)]


def _tied(embed: nn.Module | None, head: nn.Module | None) -> bool:
    """Whether ``head``'s weight is ``embed``'s (one Parameter)."""
    weight = getattr(embed, "weight", None)
    return weight is not None and getattr(head, "weight", None) is weight


def _width(module: nn.Module | None, dim: int) -> int | None:
    """Dim ``dim`` of ``module``'s weight (an embedding's ``[vocab, hidden]``: 1; a linear
    head's ``[out, in]``: 0), None without one."""
    weight = getattr(module, "weight", None)
    return int(weight.shape[dim]) if isinstance(weight, torch.Tensor) else None


def balanced_sizes(n: int, pp: int) -> tuple[int, ...]:
    """``n`` layers over ``pp`` stages by count, the first ``n % pp`` stages one more."""
    base, extra = divmod(n, pp)
    return tuple(base + (s < extra) for s in range(pp))


def _maybe(model: nn.Module, getter: str) -> nn.Module | None:
    fn = getattr(model, getter, None)
    try:
        out = fn() if callable(fn) else None
    except (NotImplementedError, AttributeError):
        return None
    return out if isinstance(out, nn.Module) else None


def stage_bytes(model: nn.Module, layers: nn.ModuleList, plan: StagePlan, stage: int,
                dtype: torch.dtype, device: torch.device, tp_size: int = 1) -> int:
    """Bytes stage ``stage`` must newly place on ``device``: its layers' parameters (and the
    embedding on the first stage, the head on the last; each tensor once) that are not there
    in ``dtype`` already — floating ones counted in ``dtype`` —, divided by ``tp_size`` (under
    tensor parallelism each rank keeps about 1/tp of them)."""
    start, end = plan.bounds[stage]
    modules = list(layers[start:end])
    if stage == 0:
        modules.append(_maybe(model, "get_input_embeddings"))
    if stage == plan.size - 1:
        modules.append(_maybe(model, "get_output_embeddings"))
    seen, total = set(), 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for module in filter(None, modules):
        for p in module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            target = dtype if p.is_floating_point() else p.dtype
            if _same_device(p.device, device) and p.dtype == target:
                continue  # already where and as it runs: nothing new to allocate
            total += p.numel() * (itemsize if p.is_floating_point() else p.element_size())
    return total // tp_size


def _same_device(where: torch.device, device: torch.device) -> bool:
    """``where`` is ``device``, an index-less ``device`` meaning the current one of its type
    (``cuda`` is the rank's ``cuda:0`` when it sees one GPU: ``torch.device`` equality would
    count weights already there as new bytes, twice against free memory)."""
    if where.type != device.type:
        return False
    return device.index is None or where.index is None or where.index == device.index


def check_stages_fit(model: nn.Module, layers: nn.ModuleList, plan: StagePlan,
                     dtype: torch.dtype, device: torch.device, free: int | None,
                     tp_size: int = 1) -> None:
    """Every stage's weights (:func:`stage_bytes`) against ``free`` bytes of ``device`` (this
    rank's; ranks of one kind of device check alike, so every rank fails before any weight
    moves). ``free`` None: the device cannot say, nothing to check.

    Raises:
        PipelineConfigError: naming the first stage that does not fit, its layers and bytes,
            the free bytes, and what would make it fit.
    """
    if free is None:
        return
    for stage, (start, end) in enumerate(plan.bounds):
        need = stage_bytes(model, layers, plan, stage, dtype, device, tp_size)
        if need > free:
            raise PipelineConfigError(
                f"pipeline stage {stage} (decoder layers [{start}, {end}) of {plan.size} "
                f"stages) needs {need} bytes of weights in {dtype} on {device}, but it has "
                f"{free} bytes free; use more stages (pp_size), a split that gives stage "
                f"{stage} fewer layers, tensor parallelism within the stages (tp_size), or a "
                f"narrower dtype")


def foreign_modules(model: nn.Module, layers: nn.ModuleList, plan: StagePlan) -> tuple[str, ...]:
    """Names (``model.named_modules()``'s) of the modules this rank's stage does not run, which
    the pipeline step replaces by stand-ins: the other stages' decoder layers, the input
    embedding off the first stage, the output head off the last. The checkpoint loader skips
    their tensors (``load_checkpoint(skip_modules=...)``), so a rank reads only its stage's; a
    weight tied between the embedding and the head is read by both end stages (each keeps one
    of the two modules) and by no middle stage. A head tied to the embedding is not skipped
    on the first stage: a float tie is one tensor (read once, as the embedding's), and a
    quantized checkpoint stores a tied table under the head's name alone, which the first
    stage's embedding reads its rows from (:mod:`shardwise.pipeline.quant`)."""
    names = {id(m): n for n, m in model.named_modules()}
    out = [names[id(layer)] for index, layer in enumerate(layers)
           if plan.owner(index) != plan.coord]
    embed = _maybe(model, "get_input_embeddings")
    head = _maybe(model, "get_output_embeddings")
    if embed is not None and not plan.first:
        out.append(names[id(embed)])
    if head is not None and not plan.last and not (plan.first and plan.tied):
        out.append(names[id(head)])
    return tuple(out)

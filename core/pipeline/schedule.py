"""Micro-batches through the pipeline stages (docs/architecture.md, "Pipeline stages").

A batch of B rows is split into M micro-batches (``tensor_split`` along dim 0 of every input
with B rows: sizes differ by at most one) that run one after the other through HF's forward on
every rank. The stages overlap because a stage hands micro-batch k to the next stage and goes on
with k + 1 while the next one computes k (its send runs in the background, and the next stage
receives k + 1 while it computes k: :class:`~shardwise.pipeline.transform.InFlight`);
the broadcast of the last stage's outputs, which would make every stage wait for the last one,
is deferred until every micro-batch ran (``StageClock.deferred``), and then made once for the
joined outputs (one broadcast per output tensor per forward, not per micro-batch). Each stage counts the
seconds it waits on another stage (a receive not yet arrived, its sends not yet taken:
:class:`~shardwise.pipeline.transform.StageClock`); the rest of its time is busy (its layers,
and the model's own work around them on that stage: embedding, masks, positions, head). The
bubble — the share of the wall time a stage idles, ``1 − busy / wall``, a stage that finished
early idling until the slowest one is done — can then be set against the GPipe-style
theoretical ``(P − 1) / (P − 1 + M)`` (:class:`PipelineStats`), which holds for stages of equal
cost. The seconds inside the stage's layers alone are reported too (``layers_s``): the model's
work around the layers is done once per micro-batch, so with M micro-batches it grows M-fold
and is what micro-batching costs beyond the bubble.

Two paths:

* a forward without a cache (``engine(...)``): :func:`run_micro_batches`, measured per call;
* a forward with a KV cache — every step of ``generate`` (the engine's or HF's own), or
  ``engine(..., use_cache=True)`` — goes through :class:`CachedMicroBatches`, the model's
  instance forward when ``micro_batches`` > 1: each micro-batch keeps its own
  ``DynamicCache`` (on every stage, holding that stage's layers only), kept on the whole
  batch's cache object, which itself only counts the tokens (a placeholder of one zero per
  token and row per layer, as the other stages' layers do), so HF's generate loop, positions
  and masks run unchanged. Prefill and every decode step flow through the stages as M
  micro-batches. ``engine.generate`` then reports the bubble over all its steps.
  A cache that is not a plain ``DynamicCache`` (a static or quantized one), or a batch of one
  row, runs as one batch.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PipelineStats:
    """One micro-batched forward, measured on every stage.

    Attributes:
        micro_batches: M, the micro-batches the batch was split into.
        stages: P.
        wall_s: seconds from the common start (a barrier) until the last stage finished its
            last micro-batch (the longest of the ranks' times; the outputs' broadcast excluded).
        busy_s: every stage's seconds not waiting on another stage, first stage first (its
            time in the forward less its waits on receives and on its sends).
        steps: forwards measured (1 for one forward; prefill + decode steps for a generate).
        layers_s: every stage's seconds inside its own decoder layers (part of ``busy_s``;
            empty when not measured).
    """

    micro_batches: int
    stages: int
    wall_s: float
    busy_s: tuple[float, ...]
    steps: int = 1
    layers_s: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain values (the bench's JSON): the fields, every stage's bubble, the theoretical."""
        return {"micro_batches": self.micro_batches, "stages": self.stages,
                "wall_s": self.wall_s, "busy_s": list(self.busy_s), "steps": self.steps,
                "layers_s": list(self.layers_s), "bubble": list(self.bubble),
                "theoretical_bubble": self.theoretical_bubble,
                "ideal_wall_s": self.ideal_wall_s}

    @property
    def bubble(self) -> tuple[float, ...]:
        """Every stage's idle share of the wall time, ``1 − busy / wall`` (its waits on the
        other stages, and its wait at the end for the slowest one)."""
        return tuple(1.0 - b / self.wall_s for b in self.busy_s)

    @property
    def ideal_wall_s(self) -> float:
        """The wall time a perfect schedule of these stages would take: per forward, every
        stage's time for one micro-batch (filling the pipeline) plus M − 1 more of the slowest
        stage's, a stage's time per micro-batch being its busy seconds over ``steps × M``.
        ``wall_s / ideal_wall_s`` is then what the schedule itself (its sends, receives and
        waits) adds; the measured bubble over the theoretical one adds the stages' unequal
        costs to that, as the theoretical bubble holds for equal stages only."""
        per = [b / (self.steps * self.micro_batches) for b in self.busy_s]
        return self.steps * (sum(per) + (self.micro_batches - 1) * max(per))

    @property
    def layer_share(self) -> tuple[float, ...]:
        """Every stage's share of the wall time inside its own layers (``layers / wall``;
        empty when not measured): below ``1 − bubble`` by the model's work around them."""
        return tuple(t / self.wall_s for t in self.layers_s)

    @property
    def theoretical_bubble(self) -> float:
        """``(P − 1) / (P − 1 + M)``: the idle share of equal stages under this schedule."""
        return (self.stages - 1) / (self.stages - 1 + self.micro_batches)

    def summary(self) -> str:
        bubbles = ", ".join(f"{b:.1%}" for b in self.bubble)
        steps = f" ({self.steps} forwards)" if self.steps > 1 else ""
        layers = (f"; in its layers {', '.join(f'{s:.1%}' for s in self.layer_share)}"
                  if self.layers_s else "")
        return (f"{self.micro_batches} micro-batches over {self.stages} stages in "
                f"{self.wall_s * 1e3:.1f} ms{steps}; bubble per stage {bubbles} (theoretical "
                f"{self.theoretical_bubble:.1%}){layers}")


#: keyword inputs that are not per row (a ``cache_position`` ``[seq]`` may equal the batch size)
_NOT_BATCHED = frozenset({"cache_position", "cache", "past_key_values", "logits_to_keep"})


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    for value in (*args, *(v for k, v in kwargs.items() if k not in _NOT_BATCHED)):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None


def split_inputs(args: tuple, kwargs: dict, micro_batches: int) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` of each micro-batch: every tensor with the batch's rows split along
    dim 0 (the batch: the first tensor's dim 0), everything else (and the inputs named in
    :data:`_NOT_BATCHED`) passed whole. At most one micro-batch per row."""
    batch = _batch_size(args, kwargs)
    if batch is None:
        return [(args, kwargs)]
    m = min(micro_batches, batch)

    def piece(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
            return value.tensor_split(m)[i]
        return value

    return [(tuple(piece(a, i) for a in args),
             {k: v if k in _NOT_BATCHED else piece(v, i) for k, v in kwargs.items()})
            for i in range(m)]


def _broadcast_output(out: Any, comm, src: int) -> Any:
    """``out`` with every tensor (of a tensor, a tuple, a dict / ``ModelOutput``) replaced by
    rank ``src``'s: the other stages hold tensors of the same shapes (stand-ins' outputs)."""
    if isinstance(out, torch.Tensor):
        if comm.rank == src:
            comm.broadcast(out.detach().contiguous(), src=src)
            return out
        buf = torch.empty_like(out, memory_format=torch.contiguous_format)
        return comm.broadcast(buf, src=src)
    if isinstance(out, dict):
        for key in list(out.keys()):
            out[key] = _broadcast_output(out[key], comm, src)
        return out
    if isinstance(out, (list, tuple)):
        return type(out)(_broadcast_output(v, comm, src) for v in out)
    return out


def _concat(outs: list[Any]) -> Any:
    """The micro-batches' outputs joined along dim 0, in the first one's structure."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs)
    if isinstance(first, dict):
        return type(first)(**{k: _concat([o[k] for o in outs]) for k in first.keys()})
    if isinstance(first, (list, tuple)):
        return type(first)(_concat(list(parts)) for parts in zip(*outs))
    return first


def run_parts(forward, parts: list[tuple[tuple, dict]],
              report) -> tuple[list, float, float, float]:
    """``forward(*a, **k)`` for every micro-batch ``(a, k)`` of ``parts``, one after the other,
    with the stage's point-to-point ops in flight (:class:`~shardwise.pipeline.transform.
    InFlight`) and the broadcast of the outputs deferred (the caller broadcasts). Returns the
    outputs, this rank's seconds, its busy seconds (not waiting on another stage) and its
    seconds inside its layers."""
    clock, links = report.clock, report.links
    layers_before, wait_before, was_deferred = clock.layers_s, clock.wait_s, clock.deferred
    clock.deferred = True
    if links is not None:
        links.arm([_batch_size(a, k) or 1 for a, k in parts])
    complete = False
    start = time.perf_counter()
    try:
        outs = [forward(*a, **k) for a, k in parts]
        complete = True
    finally:
        if links is not None:
            links.disarm(complete)
        clock.deferred = was_deferred
    elapsed = time.perf_counter() - start
    return outs, elapsed, elapsed - (clock.wait_s - wait_before), clock.layers_s - layers_before


def run_micro_batches(module, args: tuple, kwargs: dict, report) -> tuple[Any, PipelineStats]:
    """``module(*args, **kwargs)`` as ``report.micro_batches`` micro-batches through the stages
    (module docstring); every rank returns the last stage's outputs, joined. Returns
    ``(outputs, stats)``; every rank of the pipeline calls it."""
    comm, plan = report.communicator, report.plan
    parts = split_inputs(args, {**kwargs, "use_cache": False}, report.micro_batches)
    comm.barrier()  # a common start for the wall time
    outs, elapsed, busy, layers = run_parts(module, parts, report)
    out = _broadcast_output(_concat(outs), comm, plan.ranks[-1])  # once, joined
    stats = _gather(comm, len(parts), plan.size, 1, elapsed, busy, layers)
    return out, stats


def _gather(comm, micro_batches: int, stages: int, steps: int, elapsed_s: float, busy_s: float,
            layers_s: float) -> PipelineStats:
    """The :class:`PipelineStats` from every rank's seconds (one all-gather in the pp group)."""
    times = comm.all_gather(torch.tensor([[elapsed_s, busy_s, layers_s]],
                                         dtype=torch.float64))  # [P, 3]
    return PipelineStats(micro_batches, stages, float(times[:, 0].max()),
                         tuple(float(b) for b in times[:, 1]), steps,
                         tuple(float(t) for t in times[:, 2]))


#: not looked up yet
_UNSET = object()
#: where a whole batch's cache keeps its micro-batches' caches
_PARTS = "_shardwise_micro_batch_caches"
#: the keyword a model's forward takes its cache by (transformers 5: ``cache``; older names)
_CACHE_KEYS = ("cache", "past_key_values")


class CachedMicroBatches:
    """The model's forward with a KV cache as micro-batches in flight (module docstring): the
    instance forward :func:`~shardwise.pipeline.transform.apply_stages` installs when
    ``micro_batches`` > 1. ``forward``: the model's own (bound) forward; ``report``: the
    :class:`~shardwise.pipeline.transform.PipelineReport` (its clock, communicator, plan,
    ``micro_batches``, and the accumulators :meth:`measure` adds to)."""

    def __init__(self, model, forward, report) -> None:
        import inspect

        self.model, self.forward, self.report = model, forward, report
        # HF reads the forward's parameters (which inputs generate may pass, e.g.
        # logits_to_keep): show it the model's own
        self.__signature__ = inspect.signature(forward)
        params = self.__signature__.parameters
        self.cache_key = next((k for k in _CACHE_KEYS if k in params), None)
        self._stack: Any = _UNSET  # the injected decoder stack, looked up at the first call

    def stack(self) -> Any:
        """The model's injected decoder stack (``shardwise.inject``; injection runs after the
        pipeline step installed this forward, so it is looked up once, at the first call), or
        None."""
        if self._stack is _UNSET:
            from ..inject.injector import injected_stack

            self._stack = injected_stack(self.model)
        return self._stack

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key, cache = self._cache(kwargs)
        batch = _batch_size(args, kwargs)
        if cache is None or batch is None or batch < 2:
            return self.forward(*args, **kwargs)
        from transformers.cache_utils import DynamicCache

        split = getattr(cache, "micro_batch_caches", None)
        if split is not None:  # a cache that splits itself (a serving step over slots)
            return self._split_by_cache(args, kwargs, key, cache, split)
        if self.stack() is not None:  # injected: static caches, one per micro-batch
            return self._static(args, kwargs, key, cache, batch)
        if type(cache) is not DynamicCache:  # a static / quantized cache has its own layout
            return self.forward(*args, **kwargs)
        parts = split_inputs(args, kwargs, self.report.micro_batches)
        caches = vars(cache).get(_PARTS)
        if caches is None or len(caches) != len(parts):
            if cache.get_seq_length() > 0:  # filled as one batch: it cannot be split now
                return self.forward(*args, **kwargs)
            caches = [DynamicCache(config=getattr(self.model, "config", None))
                      for _ in parts]
            vars(cache)[_PARTS] = caches
            _follow(cache)
        out = self._run([(a, {**k, key: c}) for (a, k), c in zip(parts, caches)])
        _count_tokens(cache, out, caches, batch)
        for field in _CACHE_KEYS:  # HF's generate carries the batch's cache to the next step
            if field in out:
                out[field] = cache
        return out

    def _static(self, args: tuple, kwargs: dict, key: str, cache: Any, batch: int) -> Any:
        """The injected stack's forward with a cache, as micro-batches: at a new sequence (an
        empty cache of any kind) the stack's static cache for the whole batch is made, and one
        over each micro-batch's rows of its buffers (:meth:`~shardwise.inject.StaticKVCache.
        split_rows`: views, this stage's layers only); each micro-batch's forward writes its
        own, and the whole batch's cache (what HF's generate carries) follows their length and
        padding. A static cache filled as one batch runs whole."""
        from ..inject.cache import StaticKVCache

        parts = split_inputs(args, kwargs, self.report.micro_batches)
        caches = vars(cache).get(_PARTS) if isinstance(cache, StaticKVCache) else None
        if caches is None or len(caches) != len(parts):
            if cache.get_seq_length() > 0:  # filled as one batch: it cannot be split now
                return self.forward(*args, **kwargs)
            weight = self.stack().parts.final_norm.weight  # the stack's dtype and device
            cache = self.stack().new_cache(batch, weight.dtype, weight.device)
            caches = [_own_graph(part) for part in
                      cache.split_rows([_batch_size(a, k) for a, k in parts])]
            vars(cache)[_PARTS] = caches
            _follow_static(cache)
        out = self._run([(a, {**k, key: c}) for (a, k), c in zip(parts, caches)])
        cache.advance(caches[0].length - cache.length)
        if any(c.starts is not None for c in caches):  # left padding: each row's first token
            cache.starts = torch.cat([c.starts if c.starts is not None else
                                      torch.zeros(c.batch, dtype=torch.int64,
                                                  device=cache.buffers.device) for c in caches])
        for field in _CACHE_KEYS:  # HF's generate carries the batch's cache to the next step
            if field in out:
                out[field] = cache
        return out

    def _split_by_cache(self, args: tuple, kwargs: dict, key: str, cache: Any,
                        split) -> Any:
        """The forward as micro-batches over the caches ``split(rows per micro-batch)`` gives
        (e.g. :meth:`~shardwise.inject.slots.SlotStep.micro_batch_caches`: a serving step's
        rows are independent sequences, each group its own decode step); the outputs joined
        and broadcast once, the whole cache handed back. ``split`` returning None: the
        forward runs whole."""
        parts = split_inputs(args, kwargs, self.report.micro_batches)
        caches = split([_batch_size(a, k) for a, k in parts])
        if caches is None:  # the cache runs whole
            return self.forward(*args, **kwargs)
        out = self._run([(a, {**k, key: c}) for (a, k), c in zip(parts, caches)])
        for field in _CACHE_KEYS:
            if field in out:
                out[field] = cache
        return out

    def _cache(self, kwargs: dict) -> tuple[str | None, Any]:
        """(keyword, the whole batch's cache): the one passed, else a new ``DynamicCache``
        when ``use_cache=True`` asks for one (what the model would create itself)."""
        for key in _CACHE_KEYS:
            if kwargs.get(key) is not None:
                return key, kwargs[key]
        if kwargs.get("use_cache") and self.cache_key is not None:
            from transformers.cache_utils import DynamicCache

            cache = DynamicCache(config=getattr(self.model, "config", None))
            kwargs[self.cache_key] = cache
            return self.cache_key, cache
        return None, None

    def _run(self, parts: list[tuple[tuple, dict]]) -> Any:
        """Every micro-batch through the stages, then the last stage's outputs joined and
        broadcast once (one broadcast per output tensor per step, not per micro-batch); this
        rank's seconds and busy seconds added to the report. Returns the joined outputs."""
        report = self.report
        outs, elapsed, busy, layers = run_parts(self.forward, parts, report)
        report.add_step(elapsed, busy, layers)
        return _broadcast_output(_concat(outs), report.communicator, report.plan.ranks[-1])


@functools.cache
def _micro_batch_cache_type() -> type:
    """:class:`~shardwise.inject.StaticKVCache` of one micro-batch (made on first use: the
    inject package is imported only with injection)."""
    from ..inject.cache import StaticKVCache

    class MicroBatchKVCache(StaticKVCache):
        """A micro-batch's static cache: a view of some rows of its stage's buffers
        (:meth:`~shardwise.inject.StaticKVCache.split_rows`), with a decode graph of its own.

        A captured decode step reads and writes the buffers it was captured over, and the
        graph of a cache is looked up by its ``graph_key`` (a whole batch's: its row count).
        Micro-batches of equal rows are views of *different* rows of one set of buffers, so
        that key would replay micro-batch 0's graph — its rows of the cache — for every one of
        them. Here the key is the view itself (where its rows start in memory, and how many):
        each micro-batch captures once and replays its own graph in every later ``generate``
        over the same buffers (a graph keeps its view alive, so no other buffer can take that
        address while it exists)."""

        @property
        def graph_key(self) -> object | None:
            first = self.buffers.k[0] if self.buffers.k else None
            if first is None:
                return None
            return ("pipeline micro-batch", first.data_ptr(), self.buffers.batch)

    return MicroBatchKVCache


def _own_graph(part: Any) -> Any:
    """``part`` (a micro-batch's :class:`~shardwise.inject.StaticKVCache`, from ``split_rows``)
    keyed for a decode graph of its own (:func:`_micro_batch_cache_type`); instance-scoped."""
    part.__class__ = _micro_batch_cache_type()
    return part


#: cache methods that change rows (beam search reorders, contrastive search repeats) or length
#: (assisted decoding crops): the micro-batches' caches must follow the whole batch's
_ROW_METHODS = {
    "reorder_cache": lambda t, beam_idx: t.index_select(0, beam_idx.to(t.device)),
    "batch_select_indices": lambda t, indices: t[indices],
    "batch_repeat_interleave": lambda t, repeats: t.repeat_interleave(repeats, dim=0),
}


def _follow(cache) -> None:
    """Make the micro-batches' caches follow what HF's generate does to the whole batch's
    (instance-scoped, on this cache object only): a row operation is applied to every layer's
    keys and values joined over the micro-batches, then split again as the next forward will
    split its inputs (``tensor_split`` into as many micro-batches); ``crop`` crops each one."""
    def rows(name: str, op):
        own = getattr(cache, name)

        def method(arg):
            own(arg)
            _regroup(vars(cache)[_PARTS], lambda t: op(t, arg))
        return method

    for name, op in _ROW_METHODS.items():
        setattr(cache, name, rows(name, op))
    own_crop = cache.crop

    def crop(max_length: int) -> None:
        own_crop(max_length)
        for part in vars(cache)[_PARTS]:
            part.crop(max_length)
    cache.crop = crop


def _follow_static(cache) -> None:
    """Make the micro-batches' static caches follow the whole batch's (instance-scoped): beam
    search's ``reorder_cache`` permutes the shared buffers' rows in place (the micro-batches'
    caches are views of them), so only each one's padding starts are taken again from the
    whole's; ``crop`` crops each one."""
    own_reorder, own_crop = cache.reorder_cache, cache.crop

    def reorder_cache(beam_idx):
        own_reorder(beam_idx)
        if cache.starts is not None:
            parts = vars(cache)[_PARTS]
            for part, starts in zip(parts, cache.starts.split([p.batch for p in parts])):
                part.starts = starts

    def crop(max_length: int) -> None:
        own_crop(max_length)
        for part in vars(cache)[_PARTS]:
            part.crop(max_length)
    cache.reorder_cache, cache.crop = reorder_cache, crop


def _regroup(caches: list, op) -> None:
    """``op`` over the rows of every layer's keys and values joined over ``caches`` (the
    micro-batches, in order), split back into as many (sizes differing by at most one)."""
    for index in range(len(caches[0].layers)):
        layers = [c.layers[index] for c in caches]
        if any(getattr(layer, "keys", None) is None or layer.keys.numel() == 0
               for layer in layers):
            continue
        for attr in ("keys", "values"):
            whole = op(torch.cat([getattr(layer, attr) for layer in layers]))
            for layer, part in zip(layers, whole.tensor_split(len(layers))):
                setattr(layer, attr, part.contiguous())


def _count_tokens(cache, out: Any, caches: list, batch: int) -> None:
    """Grow the whole batch's cache by the tokens this forward added (one zero per token and
    row per layer, ``[batch, 1, new, 1]``), so its sequence length is the micro-batches'."""
    new = caches[0].get_seq_length() - cache.get_seq_length()
    if new <= 0:
        return
    like = next(v for v in out.values() if isinstance(v, torch.Tensor))  # the logits
    placeholder = like.new_zeros(batch, 1, new, 1)
    for layer in range(len(caches[0].layers)):
        cache.update(placeholder, placeholder, layer)


def gather_steps(report, steps: int, elapsed_s: float, busy_s: float,
                 layers_s: float = 0.0) -> PipelineStats:
    """The :class:`PipelineStats` of ``steps`` cached forwards (every rank calls it: one
    all-gather of this rank's seconds, busy seconds and seconds in its layers, pp group)."""
    return _gather(report.communicator, report.micro_batches, report.plan.size, steps,
                   elapsed_s, busy_s, layers_s)

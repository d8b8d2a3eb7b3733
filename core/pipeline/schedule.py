"""Micro-batches through the pipeline stages, for the engine's forward (docs/architecture.md,
"Pipeline stages").

A batch of B rows is split into M micro-batches (``tensor_split`` along dim 0 of every input
with B rows: sizes differ by at most one) that run one after the other through HF's forward on
every rank. The stages overlap because a stage hands micro-batch k to the next stage and goes on
with k + 1 while the next one computes k (its send completes once the next stage asks for k);
the broadcast of the last stage's outputs, which would make every stage wait for the last one,
is deferred until every micro-batch ran (``StageClock.deferred``). Each stage's busy time is
measured around its layers (:class:`~shardwise.pipeline.transform.StageClock`), so the bubble
— the share of the wall time a stage idles — can be set against the GPipe-style theoretical
``(P − 1) / (P − 1 + M)`` (:class:`PipelineStats`).

Not for cached calls: a forward with ``use_cache=True`` runs as one batch (the caches of
micro-batches are not merged), and so does ``generate`` (HF's loop decodes the whole batch).
"""

from __future__ import annotations

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
        busy_s: every stage's seconds inside its own layers, first stage first.
    """

    micro_batches: int
    stages: int
    wall_s: float
    busy_s: tuple[float, ...]

    @property
    def bubble(self) -> tuple[float, ...]:
        """Every stage's idle share of the wall time, ``1 − busy / wall``."""
        return tuple(1.0 - b / self.wall_s for b in self.busy_s)

    @property
    def theoretical_bubble(self) -> float:
        """``(P − 1) / (P − 1 + M)``: the idle share of equal stages under this schedule."""
        return (self.stages - 1) / (self.stages - 1 + self.micro_batches)

    def summary(self) -> str:
        bubbles = ", ".join(f"{b:.1%}" for b in self.bubble)
        return (f"{self.micro_batches} micro-batches over {self.stages} stages in "
                f"{self.wall_s * 1e3:.1f} ms; bubble per stage {bubbles} (theoretical "
                f"{self.theoretical_bubble:.1%})")


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None


def split_inputs(args: tuple, kwargs: dict, micro_batches: int) -> list[tuple[tuple, dict]]:
    """``(args, kwargs)`` of each micro-batch: every tensor with the batch's rows split along
    dim 0 (the batch: the first tensor's dim 0), everything else passed whole. At most one
    micro-batch per row."""
    batch = _batch_size(args, kwargs)
    if batch is None:
        return [(args, kwargs)]
    m = min(micro_batches, batch)

    def piece(value: Any, i: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
            return value.tensor_split(m)[i]
        return value

    return [(tuple(piece(a, i) for a in args), {k: piece(v, i) for k, v in kwargs.items()})
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


def run_micro_batches(module, args: tuple, kwargs: dict, report) -> tuple[Any, PipelineStats]:
    """``module(*args, **kwargs)`` as ``report.micro_batches`` micro-batches through the stages
    (module docstring); every rank returns the last stage's outputs, joined. Returns
    ``(outputs, stats)``; every rank of the pipeline calls it."""
    comm, clock, plan = report.communicator, report.clock, report.plan
    parts = split_inputs(args, {**kwargs, "use_cache": False}, report.micro_batches)
    comm.barrier()  # a common start for the wall time
    busy_before = clock.busy_s
    clock.deferred = True
    start = time.perf_counter()
    try:
        outs = [module(*a, **k) for a, k in parts]
    finally:
        clock.deferred = False
    elapsed, busy = time.perf_counter() - start, clock.busy_s - busy_before
    outs = [_broadcast_output(o, comm, plan.ranks[-1]) for o in outs]
    times = comm.all_gather(torch.tensor([[elapsed, busy]], dtype=torch.float64))  # [P, 2]
    stats = PipelineStats(len(parts), plan.size, float(times[:, 0].max()),
                          tuple(float(b) for b in times[:, 1]))
    return _concat(outs), stats

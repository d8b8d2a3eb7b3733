"""Graphs with offload: the injected decode step captured one *layer* at a time, so the ring's
per-layer waits sit between the captured pieces.

The whole-step capture (:mod:`shardwise.inject.capture`) cannot serve streamed weights: a graph
bound to fixed addresses would replay on whatever a ring slot holds by then, and the CPU's
compiled step reads every layer's weights as inputs of one call, with no place to wait for a
layer's read. Here each decode step runs as:

* token embedding (its unit acquired and released by its hooks, or its rows gathered),
  positions / rotary tables — eager, outside any graph;
* for each decoder layer, in order: wait for the layer's ring slot (``Ring.acquire``: the read
  done, the layer's tensors bound to the slot's views), replay the layer's captured step bound
  to that slot, release the slot (the reader refills it with the next layers);
* final norm (and projection) — eager; the output head runs as the HF shell calls it (streamed
  in row chunks, or from its ring slot, by its own hooks).

How many graphs a layer needs depends on how the accelerator's
:class:`~shardwise.GraphStrategy` binds the weights it reads (``weight_binding``): ``"inputs"``
(the CPU's compiled code, whose parameters are graph inputs read where they are at each call):
one per layer and batch bucket, whichever slot holds the layer; ``"addresses"`` (CUDA graphs:
the ring's K slots are static device buffers): one per layer, slot and batch bucket, captured
the first time the layer runs from that slot, so a replay always reads the slot it was
captured on; ``"copies"`` (frozen constants) is refused, at the config check
(:func:`~shardwise.offload.config.check_offload`), since every layer's weights would then stay
resident inside the graphs. The KV cache stays resident: its per-bucket buffers are the ones
the layer graphs were captured with, as in the whole-step capture.

The weights stay in the layout the blobs hold (the strategy's ``share_weights`` is not called:
its layout would have to be written into the blobs; the strategy is told with
``keep_weight_layout``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from ..accelerator import Accelerator, GraphStrategy
from ..errors import ConfigError
from ..graphs import progress
from ..inject.cache import DecodeRows, StaticKVCache
from ..inject.capture import DecodeGraphs, _step_args
from ..inject.layers import InjectedLayer, InjectedModel, StepContext
from .config import OffloadError, strategy_refusal

log = logging.getLogger(__name__)


class OffloadDecodeGraphs(DecodeGraphs):
    """The decode step of an offloaded injected model, each layer captured on its own (module
    docstring). Same contract as :class:`~shardwise.inject.capture.DecodeGraphs` (the stack
    calls :meth:`run`; ``graphs[cache.graph_key]`` holds what was captured for a cache — here a
    dict ``(layer index, ring slot or None) → graph``), with no captured head.

    Args:
        strategy: the accelerator's graph strategy (``weight_binding`` "inputs" or "addresses").
        ring: the offload ring (``engine.offload.ring``).
        pieces: layer index → its ring piece (a layer not in the ring — none in practice: the
            layers size the slots — runs from where it is, without waits).
    """

    def __init__(self, strategy: GraphStrategy, ring: Any, pieces: dict[int, int]) -> None:
        super().__init__(strategy, None)
        self.ring, self.pieces = ring, pieces
        self.per_slot = strategy.weight_binding == "addresses"
        #: layer graphs captured so far (all buckets; for tests and reports)
        self.captures = 0

    def run(self, stack: InjectedModel, cache: StaticKVCache, input_ids: torch.Tensor,
            rows: DecodeRows) -> torch.Tensor:
        """One decode step: hidden [batch, 1, hidden] after the final norm (module docstring).
        A batch smaller than the cache's bucket is padded as in the whole-step capture; the
        padding rows' results are dropped."""
        bucket, b = cache.buffers.batch, cache.batch
        ids, pos, write, lengths, starts = _step_args(input_ids.reshape(b, 1), rows, bucket)
        key = cache.graph_key
        layer_graphs = self.graphs.get(key)
        if layer_graphs is None:
            layer_graphs = self.graphs[key] = {}
            with progress(f"capturing the decode step's {len(stack.parts.layers)} layers for "
                          f"batch bucket {bucket} with {self.strategy.name} (per layer: "
                          f"offload)"):
                return self._step(stack, cache, layer_graphs, ids, pos, write, lengths,
                                  starts)[:b]
        return self._step(stack, cache, layer_graphs, ids, pos, write, lengths, starts)[:b]

    def _step(self, stack: InjectedModel, cache: StaticKVCache, layer_graphs: dict,
              ids: torch.Tensor, pos: torch.Tensor, write: torch.Tensor,
              lengths: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """ids, pos [bucket, 1] and write, lengths, starts [bucket] → hidden [bucket, 1,
        hidden]: embedding and positions eager, each layer's graph between its ring waits, the
        final norm eager."""
        every_row = StaticKVCache(cache.buffers, None, -1)  # the bucket's rows, padding included
        ctx = StepContext(every_row, past=-1, decode=True, graph_safe=True, write_index=write,
                          lengths=lengths, starts=starts)
        x = stack._embedded(ctx, stack.parts.embed(ids), pos)  # [bucket, 1, hidden]
        tables = () if ctx.cos is None else (ctx.cos, ctx.sin)  # rotary [bucket, 1, dim // 2]
        delta, residual = x, None
        for layer in stack.parts.layers:
            delta, residual = self._layer(layer, every_row, layer_graphs, delta, residual,
                                          (write, lengths, starts, *tables))
        hidden = stack._final_norm(delta, residual)
        return hidden if stack.parts.project_out is None else stack.parts.project_out(hidden)

    def _layer(self, layer: InjectedLayer, cache: StaticKVCache, layer_graphs: dict,
               delta: torch.Tensor, residual: torch.Tensor | None,
               step_args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer: wait for its slot, replay (capturing on first use) the graph of that
        slot — or of the layer, for weights read as inputs —, release the slot. ``delta``,
        ``residual`` [bucket, 1, hidden] (residual None before the first layer) → the layer's
        (delta, residual)."""
        piece = self.pieces.get(layer.index)
        slot = None if piece is None else self.ring.acquire(piece)
        try:
            key = (layer.index, slot if self.per_slot else None)
            args = (delta, *(() if residual is None else (residual,)), *step_args)
            graph = layer_graphs.get(key)
            if graph is None:
                if piece is not None:
                    self.ring.settle()  # no read in flight while capturing (CUDA: global mode)
                graph = layer_graphs[key] = self.strategy.capture(
                    layer_step(layer, cache, residual is not None, len(step_args) > 3), *args)
                self.captures += 1
            out_delta, out_residual = graph(*args)  # static outputs: the next layer copies them
            return out_delta, out_residual
        finally:
            if piece is not None:
                self.ring.release(piece)


def layer_step(layer: InjectedLayer, cache: StaticKVCache, has_residual: bool,
               rotary: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The function a strategy captures for ``layer``: (delta [rows, 1, hidden], residual
    [rows, 1, hidden] unless it is the first layer, write_index, lengths, starts [rows] int64,
    and with rotary positions cos, sin [rows, 1, rotary_dim // 2] float32) → the layer's (delta,
    residual). It calls the layer's ``forward`` itself, not the module: the offload hooks
    (acquire / release) stay outside the graph, with the caller."""
    forward = layer.forward

    def step(delta, *rest):
        residual, rest = (rest[0], rest[1:]) if has_residual else (None, rest)
        write_index, lengths, starts = rest[:3]
        ctx = StepContext(cache, past=-1, decode=True, graph_safe=True,
                          write_index=write_index, lengths=lengths, starts=starts)
        if rotary:
            ctx.cos, ctx.sin = rest[3], rest[4]
        return forward(delta, residual, ctx)
    step.__name__ = f"offload_layer_{layer.index}_step"
    return step


def _pieces_of_layers(model: nn.Module, stack: InjectedModel, report: Any) -> dict[int, int]:
    """layer index → its piece in the ring (the report's ``units`` are the pieces' names in
    ring order; a whole unit's piece is named as its module in the model)."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    position = {name: i for i, name in enumerate(report.units)}
    return {layer.index: position[names[id(layer)]] for layer in stack.parts.layers
            if names.get(id(layer)) in position}


def enable_offload_graphs(model: nn.Module, accelerator: Accelerator, report: Any) -> GraphStrategy:
    """``enable_graph`` with ``offload``: capture the injected decode step one layer at a time
    (module docstring) with the accelerator's graph strategy, trying it at once on a
    one-sequence step so a strategy that cannot capture fails at init with its reason.

    Args:
        model: the injected, offloaded model.
        accelerator: the engine's accelerator.
        report: the offload step's :class:`~shardwise.offload.transform.OffloadReport`.

    Returns:
        The strategy. A strategy that does not accelerate (the base eager one) is a documented
        no-op, as without offload.

    Raises:
        OffloadError: the strategy keeps copies of the weights (``weight_binding="copies"``);
        ConfigError: no injected decoder stack, pipeline stages, or the trial capture failed.
    """
    from ..inject.capture import stack_and_strategy

    stack, strategy = stack_and_strategy(model, accelerator)
    if not strategy.accelerates:
        return strategy
    refusal = strategy_refusal(strategy)
    if refusal:
        raise OffloadError(refusal)
    if stack.stage is not None:
        raise ConfigError("enable_graph with offload captures every layer of the decode step; "
                          "under pipeline stages run it with enable_graph=False")
    strategy.keep_weight_layout()
    graphs = OffloadDecodeGraphs(strategy, report.ring, _pieces_of_layers(model, stack, report))
    _trial(stack, graphs, accelerator, strategy)
    stack.graphs = graphs
    report.graphs = describe(graphs, len(stack.parts.layers))
    log.info("shardwise: %s", report.graphs)
    return strategy


def describe(graphs: OffloadDecodeGraphs, layers: int) -> str:
    """One line for the init log: what is captured, and what runs outside the graphs."""
    per = (f"one per layer and ring slot ({layers} layers x {graphs.ring.size} slots at most, "
           f"weights read at the slot's addresses)" if graphs.per_slot else
           f"one per layer ({layers}, weights read as inputs from whichever slot holds them)")
    return (f"decode step captured per layer with {graphs.strategy.name}, for each batch "
            f"bucket: {per}; the ring's waits between them; embedding, final norm and output "
            f"head run eagerly; KV cache resident")


def _trial(stack: InjectedModel, graphs: OffloadDecodeGraphs, accelerator: Accelerator,
           strategy: GraphStrategy) -> None:
    """The bucket-1 layer graphs captured by one trial step (:func:`~shardwise.inject.capture.
    trial_step`), its cache retired after; a strategy that cannot capture is named."""
    from ..inject.capture import trial_step

    try:
        trial_step(stack, graphs)
    except Exception as exc:
        graphs.clear()
        raise ConfigError(
            f"enable_graph with offload: the {accelerator.name!r} graph strategy "
            f"{strategy.name!r} cannot capture a layer of the decode step "
            f"({type(exc).__name__}: {exc}); run with enable_graph=False") from exc
    finally:
        stack.retire_cache()

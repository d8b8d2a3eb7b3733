"""Step 7 of ``init_inference``: the injected decode step — and the output head — captured by
the accelerator's graph strategy, one graph per batch bucket (``GraphStrategy.batch_bucket``:
1, 2, 4, 8, then multiples of 8; a smaller batch runs its bucket's graph, padded).

What one graph holds: token ids → embeddings → every layer (the capturable decode attention
reading each sequence's valid cache range, see ``KernelRegistry.register(capturable=)``) → final
norm → the output head's own forward. The head is in the graph because at decode it is the
largest single read (GPT-2-medium: 206 MB of 1.4 GB) and the strategy's kernels read it faster
than eager ones. The Hugging Face shell still calls its head module (``lm_head``), so that call
is answered from the graph: the head instance's ``forward`` is replaced, on that instance only,
by :class:`HeadFromGraph`, which returns the logits the graph computed for exactly the hidden
state it is given, and runs the original forward for anything else. The head's hooks (e.g. the
tensor-parallel vocab all-gather) stay outside the graph and run on those logits as before.

Before the first capture the strategy may lay the model's linear weights out for its captured
code (``GraphStrategy.share_weights``; the CPU's: blocks its C++ GEMM template reads in place),
so the graphs read the model's own parameters instead of keeping a copy of them beside it.
While a graph is captured, one progress line on stderr (a log line when stderr is not a
terminal) names the batch bucket being compiled (``shardwise.graphs.progress``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from ..accelerator import Accelerator, GraphStrategy
from ..errors import ConfigError
from ..graphs import progress
from ..ledger import set_forward
from .cache import DecodeRows, StaticKVCache
from .layers import InjectedModel

log = logging.getLogger(__name__)


class DecodeGraphs:
    """The decode step captured by a graph strategy, one graph per batch bucket (each with its
    own static cache buffers of that many rows, kept by the model while the graph exists, and
    reused by every later ``generate`` whose batch size falls in the bucket; the slots of
    :mod:`~shardwise.inject.slots` have their own graph per bucket, over their own buffers).
    Inputs of the captured step: input_ids and position_ids [rows, 1], the per-row write
    index, lengths and starts [rows].

    ``head_forward``: the output head's forward (hooks excluded), captured with the step; its
    logits are then kept for :meth:`take_logits` until the next step.
    """

    def __init__(self, strategy: GraphStrategy,
                 head_forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.strategy = strategy
        self.head_forward = head_forward
        self.graphs: dict[int, Any] = {}
        #: (hidden, its version counter, logits) of the last replay, until taken
        self._pending: tuple[torch.Tensor, int, torch.Tensor] | None = None

    def clear(self) -> None:
        """Drop every captured graph (and, at the next new cache, the buffers they held)."""
        self.graphs.clear()
        self._pending = None

    def drop(self, key: object) -> None:
        """Drop the graph captured for ``key`` (a cache's ``graph_key``), if any."""
        self.graphs.pop(key, None)
        self._pending = None

    def buckets(self) -> set[int]:
        """The captured batch buckets of ``generate``'s caches (rows of their graphs; the
        graphs of other caches, e.g. :mod:`~shardwise.inject.slots`, are keyed otherwise)."""
        return {key for key in self.graphs if isinstance(key, int)}

    def run(self, stack: InjectedModel, cache: StaticKVCache, input_ids: torch.Tensor,
            rows: DecodeRows) -> torch.Tensor:
        """One decode step (capturing the graph of the cache's ``graph_key`` — for generate's
        cache its row count, the batch bucket — on first use): hidden [batch, 1, hidden] after
        the final norm. A batch smaller than the bucket is padded with rows that attend to
        their own (unused) cache rows; their results are dropped."""
        bucket, b = cache.buffers.batch, cache.batch
        args = _step_args(input_ids.reshape(b, 1), rows, bucket)
        stage = stack.stage
        if stage is not None:  # the previous stage's output: received outside the graph
            args = (*args, _stage_input(stack, b, bucket, input_ids.device))
        key = cache.graph_key
        graph = self.graphs.get(key)
        if graph is None:
            with progress(f"capturing the decode step for batch bucket {bucket} with "
                          f"{self.strategy.name}"):
                graph = self.strategy.capture(self._step(stack, cache), *args)
            self.graphs[key] = graph
        out = graph(*args)  # static outputs, overwritten by the next replay: copied
        with torch.inference_mode(False):  # normal tensors: their version counter is tracked
            if self.head_forward is None:
                hidden = out[:b].clone()
                if stage is not None:  # to the next stage, outside the graph
                    stage.send(hidden)
                return hidden
            hidden, logits = out[0][:b].clone(), out[1][:b].clone()
        if stage is not None:  # the last stage (the head is captured there only)
            stage.send(hidden)
        self.offer_logits(hidden, logits)
        return hidden

    def offer_logits(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Hand ``logits`` [b, vocab] (computed with ``hidden`` [b, hidden] by a captured step)
        to the head's next call on ``hidden`` (:meth:`take_logits`), so the head is not run a
        second time eagerly."""
        self._pending = (hidden, hidden._version, logits)

    def _step(self, stack: InjectedModel, cache: StaticKVCache):
        head = self.head_forward
        every_row = StaticKVCache(cache.buffers, None, -1)  # the bucket's rows, padding included

        def step(ids, pos, write_index, lengths, starts, *incoming):
            hidden = stack.decode_step(every_row, ids, pos, write_index, lengths, starts,
                                       *incoming)
            return hidden if head is None else (hidden, head(hidden))
        return step

    def take_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The captured head's logits when ``hidden`` is (a full view of) the last step's
        hidden state, unchanged since (no in-place op bumped its version), else None; each
        step's logits are handed out once."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        last, version, logits = pending
        same = (hidden.data_ptr() == last.data_ptr() and hidden.shape == last.shape
                and hidden.stride() == last.stride() and hidden.dtype == last.dtype
                and hidden._version == version)
        return logits if same else None


def _step_args(ids: torch.Tensor, rows: DecodeRows, bucket: int) -> tuple[torch.Tensor, ...]:
    """The captured step's inputs for ``bucket`` rows: input_ids, position_ids [bucket, 1], the
    write index, lengths and starts [bucket] (int64) from ``ids`` [b, 1] and ``rows``; padding
    rows (b < bucket) repeat the last row's write position, length and position (their own
    cache rows are unused), token 0, no left padding."""
    b, device = ids.shape[0], ids.device
    pos, write, lengths = rows.position_ids.reshape(b, 1), rows.write_index, rows.lengths
    starts = (rows.starts.to(torch.int64) if rows.starts is not None
              else torch.zeros(b, dtype=torch.int64, device=device))
    pad = bucket - b
    if pad:
        ids = torch.cat([ids, ids.new_zeros(pad, 1)])
        pos = torch.cat([pos, pos[-1:].expand(pad, 1)])
        write = torch.cat([write, write[-1:].expand(pad)])
        lengths = torch.cat([lengths, lengths[-1:].expand(pad)])
        starts = torch.cat([starts, starts.new_zeros(pad)])
    return tuple(t.to(torch.int64).contiguous() for t in (ids, pos, write, lengths, starts))


def _stage_input(stack: InjectedModel, b: int, bucket: int,
                 device: torch.device) -> torch.Tensor:
    """The captured step's stage input [bucket, 1, hidden]: the previous stage's output for the
    ``b`` rows (zeros on the first stage, where the step embeds the tokens itself), received
    now — outside the graph — and padded with zero rows to the bucket."""
    weight = stack.parts.final_norm.weight  # the layers' width and dtype
    placeholder = torch.zeros(b, 1, weight.shape[-1], dtype=weight.dtype, device=device)
    incoming = stack.stage.receive(placeholder)
    if bucket > b:
        incoming = torch.cat([incoming, incoming.new_zeros(bucket - b, *incoming.shape[1:])])
    return incoming.contiguous()


class HeadFromGraph:
    """Instance-level ``forward`` of the output head while its forward is captured with the
    decode step (see the module docstring). ``original`` is the forward it replaced."""

    def __init__(self, original: Callable[..., torch.Tensor], graphs: DecodeGraphs) -> None:
        self.original, self.graphs = original, graphs

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        logits = None if args or kwargs else self.graphs.take_logits(hidden)
        return self.original(hidden, *args, **kwargs) if logits is None else logits

    def __repr__(self) -> str:
        return f"HeadFromGraph({self.original!r})"


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output head module (``get_output_embeddings``), or None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


def stack_and_strategy(model: nn.Module,
                       accelerator: Accelerator) -> tuple[InjectedModel, GraphStrategy]:
    """The model's injected decoder stack and the accelerator's graph strategy (errors named);
    a strategy that does not accelerate is logged as the documented no-op it is, and the
    caller captures nothing."""
    stack = _stack(model)
    strategy = _strategy(accelerator)
    if not strategy.accelerates:
        log.info("shardwise: enable_graph on %s: its graph strategy %r runs the decode step "
                 "eagerly (a documented no-op: nothing to capture on this device)",
                 accelerator.name, strategy.name)
    return stack, strategy


def _strategy(accelerator: Accelerator) -> GraphStrategy:
    strategy = accelerator.graph_strategy()
    if not isinstance(strategy, GraphStrategy):
        raise ConfigError(f"accelerator {accelerator.name!r} returned {strategy!r} as its graph "
                          f"strategy, not a shardwise GraphStrategy")
    return strategy


def _stack(model: nn.Module) -> InjectedModel:
    from .injector import injected_stack

    stack = injected_stack(model)
    if stack is not None:
        return stack
    from .encoder import injected_encoder

    if injected_encoder(model) is not None:
        raise ConfigError(f"enable_graph captures the injected decode step, and "
                          f"{type(model).__name__} is an encoder: it has no decode step "
                          f"(one forward per batch). Run it with enable_graph=False")
    raise ConfigError("enable_graph captures the injected decode step: it needs "
                      "replace_with_kernel_inject=True")


def enable_graphs(model: nn.Module, accelerator: Accelerator,
                  weight_dtype: torch.dtype | None = None) -> GraphStrategy:
    """Step 7: capture the injected decode step, with the output head, by the accelerator's
    graph strategy (see the module docstring).

    A strategy that does not accelerate (the base eager strategy: e.g. the CPU's with
    ``SHARDWISE_CPU_GRAPHS=eager``) is a documented no-op: the
    decode step runs eagerly and one line says so. An accelerating one is tried at once on a
    one-sequence step (that graph is kept for batch size 1), so a strategy that cannot capture
    fails here, at init, with its reason — not in the middle of a generate.

    ``weight_dtype``: a storage dtype for the linear weights under the (wider) compute dtype,
    one of the strategy's ``weight_dtypes`` (a ConfigError otherwise): its ``share_weights``
    lays them out in it (``init_inference(weight_dtype=...)``).
    """
    stack, strategy = stack_and_strategy(model, accelerator)
    if not strategy.accelerates:
        return strategy
    head = output_head(model)
    if stack.stage is not None and not stack.stage.plan.last:
        head = None  # another pipeline stage runs the head (this one holds a stand-in)
    _share_weights(model, head, strategy, stack, weight_dtype)
    original = None
    if head is not None:
        original = head.forward
        original = original.original if isinstance(original, HeadFromGraph) else original
    graphs = DecodeGraphs(strategy, original)
    _trial_capture(stack, graphs, accelerator, strategy)
    stack.graphs = graphs
    if head is not None:
        set_forward(head, HeadFromGraph(original, graphs), "graph capture's output head")
    log.info("shardwise: decode step%s captured with %s (one graph per batch bucket)",
             " and output head" if head is not None else "", strategy.name)
    return strategy


def _share_weights(model: nn.Module, head: nn.Module | None, strategy: GraphStrategy,
                   stack: InjectedModel | None = None,
                   weight_dtype: torch.dtype | None = None) -> None:
    """Let the strategy lay the model's linear weights out for its captured code (one copy
    shared by eager and captured code; see ``GraphStrategy.share_weights``): every leaf module
    holding tensors once (a quantized linear holds its weight packed, as a buffer, and the
    strategy must know it is there too), and the input embedding when the head shares its
    weight. The fused projections of ``stack`` (:mod:`shardwise.inject.fuse`) are laid out in
    place of their parts, which then view the new layout (``FusedProjection.follow_layout``)."""
    seen: set[int] = set()
    leaves = []
    for module in model.modules():
        if id(module) not in seen and not next(module.children(), None) and (
                next(module.parameters(recurse=False), None) is not None
                or next(module.buffers(recurse=False), None) is not None):
            seen.add(id(module))
            leaves.append(module)
    get = getattr(model, "get_input_embeddings", None)
    embed = get() if callable(get) else None
    tied = (embed if head is not None and isinstance(embed, nn.Module)
            and getattr(embed, "weight", None) is getattr(head, "weight", False) else None)
    from .fuse import layout_targets, stack_groups

    groups = list(stack_groups(stack)) if stack is not None else []
    # the captured step calls each fused group's module, not its parts (their tensors are views)
    targets = layout_targets([m for m in leaves if m is not embed], groups)
    if weight_dtype is not None:
        check_weight_dtype(strategy, weight_dtype)
    changed = _lay_out(strategy, targets, tied, weight_dtype)
    for group in groups:
        group.follow_layout()
    changed += _unfuse_where_slower(stack, groups, strategy, weight_dtype)
    if weight_dtype is not None:  # after the fused groups' parts follow their laid-out whole
        _say_what_stays_wide(model, weight_dtype)
    if changed:
        log.info("shardwise: %d linear weights laid out for %s (shared by eager and captured "
                 "code)", changed, strategy.name)


def _lay_out(strategy: GraphStrategy, modules: list, tied: nn.Module | None,
             weight_dtype: torch.dtype | None) -> int:
    """``strategy.share_weights(modules, tied)``, with ``weight_dtype=`` only when one was asked
    for (a strategy that declares no ``weight_dtypes`` keeps its two-argument method)."""
    if weight_dtype is None:
        return strategy.share_weights(modules, tied)
    return strategy.share_weights(modules, tied, weight_dtype=weight_dtype)


def _say_what_stays_wide(model: nn.Module, weight_dtype: torch.dtype) -> None:
    """One warning naming the weight matrices (2-D and up) the layout did not store in
    ``weight_dtype`` (e.g. MoE experts' stacked tensors, untied embeddings), so a user who asked
    for 16-bit weights knows which bytes stay at the compute dtype."""
    wide = [(n, p) for n, p in model.named_parameters()
            if p.dim() >= 2 and p.is_floating_point() and p.dtype != weight_dtype]
    if not wide:
        return
    nbytes = sum(p.numel() * p.element_size() for _, p in wide)
    log.warning("shardwise: weight_dtype=%s: %d weight tensors (%.1f MiB) stay %s, e.g. %s "
                "(the layout stores linear weights and a tied embedding only; MoE experts' "
                "stacked tensors and untied embeddings keep the compute dtype)",
                str(weight_dtype).removeprefix("torch."), len(wide), nbytes / 2**20,
                str(wide[0][1].dtype).removeprefix("torch."),
                ", ".join(n for n, _ in wide[:3]))


def check_weight_dtype(strategy: GraphStrategy, weight_dtype: torch.dtype) -> None:
    """Refuse a storage dtype the graph strategy cannot keep the weights in (its
    ``weight_dtypes``), naming what it can."""
    allowed = tuple(strategy.weight_dtypes)
    if weight_dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed) or "none"
        raise ConfigError(
            f"weight_dtype={str(weight_dtype).removeprefix('torch.')}: the graph strategy "
            f"{strategy.name!r} cannot keep the linear weights in it under a wider compute "
            f"dtype (it can: {names}); drop weight_dtype, or use dtype="
            f"{str(weight_dtype).removeprefix('torch.')} for the whole model")


def _unfuse_where_slower(stack: InjectedModel | None, groups: list, strategy: GraphStrategy,
                         weight_dtype: torch.dtype | None = None) -> int:
    """Put the fused groups whose module the strategy gave a forward that runs the parts faster
    one by one (its class says ``unfused_faster = True``, e.g. a product the compiled step
    streams per weight) back on their parts, and let the strategy lay those out instead.
    Returns what that ``share_weights`` call changed."""
    slower = [g for g in groups if getattr(g.module.__dict__.get("forward"), "unfused_faster",
                                           False)]
    if not slower:
        return 0
    slow = {id(g) for g in slower}
    for layer in stack._own:
        if any(id(g) in slow for g in layer.fused_groups):
            layer.unfuse_projections()
    log.info("shardwise: %d fused projections run unfused under %s (its product is faster per "
             "part)", len(slower), strategy.name)
    return _lay_out(strategy, [p for g in slower for p in g.parts], None, weight_dtype)


def trial_step(stack: InjectedModel, graphs: DecodeGraphs) -> None:
    """One decode step of one sequence on a fresh one-row cache, through ``graphs``: captures
    the batch-1 graph(s), kept with that bucket's buffers; the step's logits are dropped.
    Raises whatever the strategy raised (the callers name it)."""
    weight = stack.parts.final_norm.weight
    try:
        with torch.inference_mode():
            cache = stack.new_cache(1, weight.dtype, weight.device)
            ids = torch.zeros(1, 1, dtype=torch.int64, device=weight.device)
            graphs.run(stack, cache, ids, cache.decode_rows(ids))
    finally:
        graphs._pending = None


def _trial_capture(stack: InjectedModel, graphs: DecodeGraphs, accelerator: Accelerator,
                   strategy: GraphStrategy) -> None:
    try:
        trial_step(stack, graphs)
    except Exception as exc:
        raise ConfigError(
            f"enable_graph: the {accelerator.name!r} graph strategy {strategy.name!r} cannot "
            f"capture the decode step ({type(exc).__name__}: {exc}); run with "
            f"enable_graph=False") from exc
        stack.retire_cache()  # the trial cache (its buffers stay: the bucket-1 graph uses them)

"""The pipeline step: this rank keeps only its stage (docs/architecture.md, "Pipeline stages").

Applied in place on the HF model, whose own forward and ``generate`` keep running unchanged on
every rank; each change is recorded in the active ledger:

* the decoder layers of other stages are replaced by :class:`RemoteLayer` (no weights): it
  returns the hidden states it is given and, when the layer's call carries an HF ``Cache``,
  advances that layer's cache entry by a placeholder of one zero per token and row (keys and
  values ``[batch, 1, seq, 1]``), so the cache's sequence length (HF reads layer 0's for
  positions and masks) is right on every stage while the cache holds the K/V of this stage's
  layers only (the placeholders are 1 / (heads × head_dim) of a real layer's entry);
* the input embedding off the first stage becomes :class:`RemoteEmbedding` (zeros of the right
  shape: the real hidden states arrive at the stage's first layer); the output head off the last
  stage becomes :class:`RemoteHead` (an empty tensor of the logits' shape);
* hooks: the stage's last layer sends its output hidden states ``[batch, seq, hidden]`` to the
  next stage, its first layer's pre-hook receives them from the previous one (point-to-point,
  through the communicator, under its timeout); the head's output (the last layer's, for a model
  without a head: an encoder's hidden states) is broadcast from the last stage, so every rank
  returns the same outputs.
* under kernel injection the injected stack runs its own layer list, so these layer hooks do not
  fire there: the stand-ins carry this rank's :class:`StageLink`, through which the injected
  forward receives and sends itself (same point-to-point ops in flight, same clock).

Giving back (``engine.close()``, every rank): the replaced modules come back with their weights
broadcast from the stage that kept them (:func:`_rebuild`).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import ledger as _ledger
from .config import PipelineConfigError
from ..sharding.apply import param_bytes
from .stages import StagePlan

#: plain attributes of a decoder layer the base model may read (e.g. ``attention_type`` picks the
#: mask): copied onto its stand-in
_LAYER_ATTRS = ("attention_type", "layer_idx", "is_sliding")


def _find_cache(args: tuple, kwargs: dict):
    from transformers.cache_utils import Cache

    for value in (*args, *kwargs.values()):
        if isinstance(value, Cache):
            return value
    return None


def _hidden_of(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class RemoteLayer(nn.Module):
    """A decoder layer another stage runs: passes the hidden states through (see the module
    docstring for the cache). ``as_tuple``: the real layer returns ``(hidden, ...)``.
    ``link``: this rank's :class:`StageLink` (what kernel injection reads to run the stage:
    an injected stack over a layer list with stand-ins runs only this stage's layers)."""

    def __init__(self, index: int, stage: int, as_tuple: bool,
                 link: "StageLink | None" = None) -> None:
        super().__init__()
        self.index, self.stage, self.as_tuple = index, stage, as_tuple
        self.link = link

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = _hidden_of(args, kwargs)  # [batch, seq, hidden]
        cache = _find_cache(args, kwargs)
        if cache is not None:  # HF counts a layer empty when its keys have no element
            placeholder = hidden.new_zeros(hidden.shape[0], 1, hidden.shape[1], 1)  # [b,1,s,1]
            cache.update(placeholder, placeholder, self.index)
        return (hidden, None) if self.as_tuple else hidden

    def extra_repr(self) -> str:
        return f"layer {self.index}, run by stage {self.stage}"


class RemoteEmbedding(nn.Module):
    """The input embedding, run by the first stage: zeros ``[*ids.shape, dim]``."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)


class RemoteHead(nn.Module):
    """The output head, run by the last stage: an empty ``[..., vocab]`` (the broadcast hook
    fills it)."""

    def __init__(self, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.dtype = out_features, dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_empty(*hidden.shape[:-1], self.out_features, dtype=self.dtype)


@dataclass
class PipelineReport:
    """What the pipeline step did on this rank (``engine.stages``).

    Attributes:
        plan: the :class:`~shardwise.pipeline.StagePlan`.
        layers: this rank's decoder layers (indices).
        param_bytes: this rank's parameter bytes after the step, each tensor once.
        replaced: names of the modules replaced by stand-ins on this rank.
        micro_batches: micro-batches per engine forward (``pipeline_parallel``'s).
        clock: this stage's :class:`StageClock`.
        communicator: the pp group's communicator.
    """

    plan: StagePlan
    layers: tuple[int, ...]
    param_bytes: int
    replaced: tuple[str, ...]
    micro_batches: int = 1
    clock: "StageClock | None" = field(default=None, repr=False)
    communicator: Any = field(default=None, repr=False)
    #: this stage's :class:`InFlight` point-to-point ops (armed by the micro-batch schedule)
    links: "InFlight | None" = field(default=None, repr=False)
    #: the :class:`~shardwise.pipeline.schedule.PipelineStats` of the last micro-batched
    #: forward, or of the last ``engine.generate`` (all its steps)
    stats: Any = None
    #: this rank's cached micro-batched forwards since :meth:`generate` began: [steps, seconds,
    #: busy seconds, seconds inside its layers] (:meth:`add_step`)
    _steps: list = field(default_factory=lambda: [0, 0.0, 0.0, 0.0], repr=False)

    def add_step(self, elapsed_s: float, busy_s: float, layers_s: float = 0.0) -> None:
        """Count one cached micro-batched forward (a prefill or decode step) of this rank:
        its seconds, those not waiting on another stage, those inside its layers."""
        self._steps[0] += 1
        self._steps[1] += elapsed_s
        self._steps[2] += busy_s
        self._steps[3] += layers_s

    def start_steps(self) -> None:
        """Start counting this rank's cached micro-batched forwards (every rank of the pipeline
        calls it: a barrier gives the ranks a common start)."""
        self._steps[:] = [0, 0.0, 0.0, 0.0]
        self.communicator.barrier()

    def finish_steps(self) -> Any:
        """The :class:`~shardwise.pipeline.schedule.PipelineStats` of the cached forwards since
        :meth:`start_steps` (every rank calls it: one all-gather), also kept as :attr:`stats`;
        None when none was micro-batched (every rank ran the same forwards: none gathers)."""
        from .schedule import gather_steps

        counted = self.micro_batches > 1 and self._steps[0] > 0
        self.stats = gather_steps(self, *self._steps) if counted else None
        return self.stats

    def generate(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """``module.generate(*args, **kwargs)``; with micro-batches, :attr:`stats` then holds
        the bubble over all its steps (one all-gather after the generate, every rank)."""
        if self.micro_batches == 1:
            return module.generate(*args, **kwargs)
        self.start_steps()
        out = module.generate(*args, **kwargs)
        self.finish_steps()
        return out

    def call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """``module(*args, **kwargs)``, split into :attr:`micro_batches` micro-batches that
        flow through the stages one behind the other when that is more than one (see
        :func:`shardwise.pipeline.schedule.run_micro_batches`; the outputs then carry no
        cache). A call that uses a cache (``use_cache=True``, or a ``cache`` /
        ``past_key_values`` passed in) or has ``labels`` runs as one batch here."""
        from .schedule import run_micro_batches

        cached = kwargs.get("use_cache") or any(
            kwargs.get(name) is not None for name in ("cache", "past_key_values"))
        if self.micro_batches == 1 or cached or "labels" in kwargs:
            # a loss is for the batch whole; a cached call is micro-batched by the model's
            # instance forward (:class:`~shardwise.pipeline.schedule.CachedMicroBatches`)
            return module(*args, **kwargs)
        out, self.stats = run_micro_batches(module, args, kwargs, self)
        return out

    def rebalanced_split(self) -> tuple[int, ...]:
        """Layers per stage balanced on the last measured run (:attr:`stats`, every rank the
        same): :func:`~shardwise.pipeline.stages.rebalanced_split`. Give it as
        ``pipeline_parallel={"split": ...}`` to a new engine for the same workload.

        Raises:
            PipelineConfigError: nothing micro-batched has run on this engine yet.
        """
        from .config import PipelineConfigError
        from .stages import rebalanced_split

        if self.stats is None:
            raise PipelineConfigError(
                "rebalanced_split balances on a measured run, and none has happened: call "
                "engine.generate(...) or engine(...) with micro_batches > 1 first")
        return rebalanced_split(self.stats, self.plan.bounds, self.plan.layer_bytes)

    #: the checkpoint extensions whose per-stage entries :meth:`merge_entries` merges
    MERGED_EXTENSIONS = ("shardwise.quant",)

    def merge_entries(self, name: str, entries: list) -> tuple[Any, Any]:
        """(the rank entry, the description entry) of checkpoint extension ``name`` for the
        whole model, from every stage's rank entry (None: a stage without its data), first
        stage first: what :func:`shardwise.checkpoint.saver.save_extended_stages` writes
        (quantized stages: :func:`shardwise.pipeline.quant.merge_manifests`).

        Raises:
            PipelineConfigError: an extension not in :attr:`MERGED_EXTENSIONS`."""
        if name not in self.MERGED_EXTENSIONS:
            raise PipelineConfigError(f"pipeline stages cannot merge the checkpoint extension "
                                      f"{name!r}'s data (only {list(self.MERGED_EXTENSIONS)})")
        from .quant import merge_manifests

        return merge_manifests(entries, self.plan)

    def summary(self) -> str:
        a, b = self.plan.bounds[self.plan.coord]
        return (f"pipeline: stage {self.plan.coord} of {self.plan.size} runs layers [{a}, {b}) "
                f"({self.param_bytes} parameter bytes on this rank; {self.plan!r})")


def _returns_tuple(layer: nn.Module) -> bool:
    """Whether ``layer``'s forward returns a tuple whose first item is the hidden states (the
    base model then reads ``outputs[0]``) rather than the tensor alone. HF layers annotated
    ``-> torch.Tensor`` return the tensor (Llama, GPT-2, OPT, BERT, Mistral, Mixtral ... in
    transformers 5); unannotated ones are read from their source: a ``return a, b`` makes it
    a tuple (BLOOM, Falcon, GPT-Neo), a single value the tensor (GPT-NeoX)."""
    forward = type(layer).forward
    annotation = inspect.signature(forward).return_annotation
    if annotation in (torch.Tensor, "torch.Tensor"):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise PipelineConfigError(
            f"pipeline_parallel replaces the other stages' {type(layer).__name__} layers by "
            f"stand-ins that must return what the layer returns, but its forward has no return "
            f"annotation and no readable source ({exc}); annotate it (-> torch.Tensor) or run "
            f"without pipeline_parallel") from None
    return any(isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple)
               for node in ast.walk(tree))


def _output_hidden(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _with_hidden(out: Any, hidden: torch.Tensor) -> Any:
    return hidden if isinstance(out, torch.Tensor) else (hidden, *out[1:])


def apply_stages(model: nn.Module, layers: nn.ModuleList, plan: StagePlan, communicator,
                 dtype: torch.dtype, micro_batches: int = 1,
                 rebuild: bool = True) -> PipelineReport:
    """Keep this rank's stage of ``model`` (decoder layers ``layers``) and wire the stages
    together (module docstring). Recorded in the active ledger. ``micro_batches``: how many
    micro-batches the engine's forward splits a batch into (:meth:`PipelineReport.call`).
    ``rebuild``: record the undo that broadcasts the other stages' weights back at close;
    False when this rank never held them (loaded from a checkpoint, each rank its stage's
    tensors only: the others are still on meta, and the model goes back on meta anyway)."""
    names = {id(m): n for n, m in model.named_modules()}
    originals = list(layers)
    replaced: list[tuple[str, nn.Module, int]] = []  # (name, original module, owner rank)
    clock = StageClock()
    links = InFlight(clock)
    link = StageLink(plan, communicator, links, clock)
    for index, layer in enumerate(layers):
        owner = plan.owner(index)
        if owner == plan.coord:
            continue
        stand_in = RemoteLayer(index, owner, _returns_tuple(layer), link)
        for attr in _LAYER_ATTRS:
            if attr in vars(layer):
                setattr(stand_in, attr, vars(layer)[attr])
        replaced.append((names[id(layer)], layer, plan.ranks[owner]))
        _ledger.replace_module(layers, str(index), stand_in, what="pipeline stage: layer")
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    # widths as planned on the whole model (a tensor-parallel split narrowed the weights since)
    if not plan.first:
        _replace(model, names, embed,
                 RemoteEmbedding(plan.embed_dim or embed.weight.shape[1], dtype),
                 plan.ranks[0], replaced)
    if isinstance(head, nn.Module) and not plan.last:
        _replace(model, names, head,
                 RemoteHead(plan.head_features or _out_features(head), dtype),
                 plan.ranks[-1], replaced)
        from .quant import rehome_tied_table

        rehome_tied_table(model, plan, embed, head)  # a tied table quantized while loading
    _wire(model, layers, head, plan, communicator, clock, links)
    report = PipelineReport(plan, tuple(plan.layers), 0, tuple(name for name, _, _ in replaced),
                            micro_batches, clock, communicator, links=links)
    if micro_batches > 1:  # cached forwards (generate's steps) as micro-batches in flight
        from .schedule import CachedMicroBatches

        _ledger.set_forward(model, CachedMicroBatches(model, model.forward, report),
                            what="pipeline: micro-batches with their own KV caches")
    units = [(layer, plan.ranks[plan.owner(i)]) for i, layer in enumerate(originals)]
    units += [(embed, plan.ranks[0])]
    if isinstance(head, nn.Module):
        units.append((head, plan.ranks[-1]))
    if rebuild:
        _ledger.record(f"pipeline stage {plan.coord}: {len(replaced)} modules of other stages "
                       f"(their weights broadcast back from the stages that kept them)",
                       _rebuild_undo(units, communicator))
    _let_go(model, [module for _, module, _ in replaced])
    report.param_bytes = param_bytes(model)
    return report


def _out_features(head: nn.Module) -> int:
    """The output width of ``head``: a linear's weight rows, a quantized linear's
    ``out_features``."""
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else int(head.out_features)


def _let_go(model: nn.Module, modules: list[nn.Module]) -> None:
    """Free the data of the replaced modules' parameters the model no longer holds (the
    undo recorded their shapes and broadcasts them back). Under tensor parallelism these are
    the slices step 5 made, which the ledger's snapshot does not hold; the snapshot keeps its
    own reference to the originals, so a failed init still restores them."""
    live = {id(p) for p in model.parameters()}
    for module in modules:
        for p in module.parameters():
            if id(p) not in live:
                p.data = p.data.new_empty(0)


def _replace(model: nn.Module, names: dict, module: nn.Module, stand_in: nn.Module, owner: int,
             replaced: list) -> None:
    name = names[id(module)]
    parent_name, _, attr = name.rpartition(".")
    _ledger.replace_module(model.get_submodule(parent_name), attr, stand_in,
                           what="pipeline stage")
    replaced.append((name, module, owner))


class InFlight:
    """The point-to-point ops of a micro-batched forward in flight on this stage: armed by the
    schedule (:mod:`shardwise.pipeline.schedule`) with the rows of every micro-batch, used by
    the stage's hooks. Sends start in the background (``isend``; their tensors copied, so later
    in-place changes cannot reach them) and are waited for once every micro-batch ran; the
    receive hook of micro-batch k posts the ``irecv`` of micro-batch k + 1 (shape: its rows ×
    this one's other dims) before the stage computes k, so the transfer overlaps the compute.
    Unarmed (a forward of the batch whole), the hooks send and receive blocking."""

    def __init__(self, clock: "StageClock | None" = None) -> None:
        self.active = False
        #: where the seconds spent waiting on the other stages are counted (None: not counted)
        self.clock = clock
        self._rows: list[int] = []  # rows of the micro-batches still to receive, after the next
        self._recv: tuple[torch.Tensor, Any] | None = None  # (buffer, op) of the next one
        self._sends: list[tuple[torch.Tensor, Any]] = []
        #: why this stage's point-to-point messages are out of step (then every later use fails)
        self.broken: str | None = None

    def arm(self, rows: list[int]) -> None:
        """A micro-batched forward of micro-batches of ``rows`` rows begins."""
        self._check()
        self.active, self._rows, self._recv, self._sends = True, list(rows[1:]), None, []

    def disarm(self, complete: bool) -> None:
        """It ended: wait for the sends still in flight (``complete``; after an error they are
        dropped: the peer that failed will not take them). An error with a receive or sends
        still posted leaves them posted in the process group, where they would take the next
        forward's messages: the stage is then :attr:`broken`."""
        sends, recv = self._sends, self._recv
        self._sends, self._recv, self.active = [], None, False
        if complete:
            with self._waiting():
                for _, op in sends:
                    op.wait()
        elif recv is not None or sends:
            self.broken = ("a micro-batched forward failed on this rank with point-to-point "
                           "messages still in flight, so the stages' messages are out of step")

    def _waiting(self):
        """A context that counts its seconds as this stage waiting on another one."""
        return self.clock.waiting() if self.clock is not None else contextlib.nullcontext()

    def _check(self) -> None:
        if self.broken:
            raise PipelineConfigError(f"{self.broken}; close the engine and call "
                                      f"init_inference again (every rank)")

    def send(self, comm, hidden: torch.Tensor, dst: int) -> None:
        self._check()
        if not self.active:
            comm.send(hidden.detach().contiguous(), dst=dst)
            return
        data = hidden.detach().clone(memory_format=torch.contiguous_format)
        self._sends.append((data, comm.isend(data, dst=dst)))

    def receive(self, comm, hidden: torch.Tensor, src: int) -> torch.Tensor:
        """The hidden states of this micro-batch (``hidden``: the stand-ins' placeholder of the
        same shape), then the next one's receive posted."""
        self._check()
        if self._recv is not None:
            incoming, op = self._recv
            self._recv = None
            with self._waiting():
                op.wait()
            if incoming.shape != hidden.shape:
                raise PipelineConfigError(
                    f"pipeline stage received hidden states {tuple(incoming.shape)} for a "
                    f"micro-batch whose inputs are {tuple(hidden.shape)}: the micro-batches "
                    f"must keep every non-batch dimension; run with micro_batches=1")
        else:
            incoming = torch.empty_like(hidden, memory_format=torch.contiguous_format)
            with self._waiting():
                comm.recv(incoming, src=src)
        if self.active and self._rows:
            shape = (self._rows.pop(0), *hidden.shape[1:])
            buf = hidden.new_empty(shape)
            self._recv = (buf, comm.irecv(buf, src=src))
        return incoming


class StageClock:
    """This stage's clocks, summed over forwards:

    * ``layers_s``: the seconds inside its own layers, between its first layer starting (after
      the hidden states arrived) and its last layer ending (before they are sent);
    * ``wait_s``: the seconds it waited on another stage (a receive not yet arrived, a send
      not yet taken at the end of a micro-batched forward).

    The schedule counts a stage busy whenever it is not waiting (its layers, and the model's
    own work around them on this stage: embedding, masks, head), so the bubble is the share of
    the wall time it waited (:class:`~shardwise.pipeline.schedule.PipelineStats`).
    ``deferred``: the micro-batch schedule broadcasts the outputs itself after every
    micro-batch ran (:mod:`shardwise.pipeline.schedule`), so the in-forward broadcast is
    skipped."""

    def __init__(self) -> None:
        self.layers_s = 0.0
        self.wait_s = 0.0
        self.deferred = False
        self._start: float | None = None

    @contextlib.contextmanager
    def waiting(self):
        """Count the seconds inside as waiting on another stage."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - start

    def begin(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def end(self, *_: Any) -> None:
        if self._start is not None:
            self.layers_s += time.perf_counter() - self._start
            self._start = None


@dataclass
class StageLink:
    """This rank's stage as an injected decoder stack runs it (``shardwise.inject``): the
    stack's own forward calls :meth:`receive` before the stage's first layer and :meth:`send`
    after its last (the HF-layer hooks of :func:`_wire` do not fire there: the injected layers
    are other modules); the head's broadcast hook still runs, as the HF shell calls the head.
    Shares the point-to-point ops in flight and the clock with those hooks, so the micro-batch
    schedule drives both alike.

    Attributes:
        plan: the :class:`~shardwise.pipeline.StagePlan` (this rank's stage: ``plan.coord``).
        communicator: the pp group's communicator.
        links: this stage's :class:`InFlight` point-to-point ops.
        clock: this stage's :class:`StageClock`.
    """

    plan: StagePlan
    communicator: Any = field(repr=False)
    links: "InFlight" = field(repr=False)
    clock: "StageClock" = field(repr=False)

    @property
    def layers(self) -> range:
        """This stage's decoder layer indices."""
        return self.plan.layers

    def receive(self, hidden: torch.Tensor) -> torch.Tensor:
        """The stage's input hidden states ``[batch, seq, hidden]``: ``hidden`` on the first
        stage (its embedding's), else the previous stage's (``hidden`` gives the shape); the
        clock starts."""
        plan = self.plan
        if not plan.first:
            hidden = self.links.receive(self.communicator, hidden, plan.ranks[plan.coord - 1])
        self.clock.begin()
        return hidden

    def send(self, hidden: torch.Tensor) -> None:
        """The stage's output hidden states ``[batch, seq, hidden]`` to the next stage (none
        from the last: the head's hook broadcasts its logits); the clock stops."""
        self.clock.end()
        plan = self.plan
        if not plan.last:
            self.links.send(self.communicator, hidden, plan.ranks[plan.coord + 1])


    def output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's output hidden states ``[batch, seq, hidden]`` on every rank, for a stack
        that runs its own layer loop and has no head after it (an injected encoder): the last
        stage's, broadcast to every stage (what :func:`_wire`'s hook on the last HF layer does,
        which such a stack never calls). Returned as given where that is done elsewhere: a model
        with a head (the head's hook broadcasts its logits), or under the micro-batch schedule
        (``clock.deferred``: it broadcasts every micro-batch's outputs once all ran)."""
        if self.plan.head_features is not None or self.clock.deferred:
            return hidden
        src = self.plan.ranks[-1]
        if self.plan.last:
            self.communicator.broadcast(hidden.detach().contiguous(), src=src)
            return hidden
        buf = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        return self.communicator.broadcast(buf, src=src)


def _wire(model: nn.Module, layers: nn.ModuleList, head: nn.Module | None, plan: StagePlan,
          comm, clock: StageClock, links: InFlight) -> None:
    """The hooks that move activations: receive before the stage's first layer, send after its
    last, broadcast the last stage's output to every rank; and the clock's, around the stage's
    layers (after the receive, before the send: hooks run in the order registered)."""
    start, end = plan.bounds[plan.coord]
    if not plan.first:
        src = plan.ranks[plan.coord - 1]

        def receive(module, args, kwargs):
            incoming = links.receive(comm, _hidden_of(args, kwargs), src)
            if args:
                return (incoming, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": incoming}

        _ledger.add_hook(layers[start].register_forward_pre_hook(receive, with_kwargs=True),
                         "pipeline: receive hidden states")
    _ledger.add_hook(layers[start].register_forward_pre_hook(clock.begin), "pipeline: clock")
    _ledger.add_hook(layers[end - 1].register_forward_hook(clock.end), "pipeline: clock")
    if not plan.last:
        dst = plan.ranks[plan.coord + 1]

        def send(module, args, out):
            links.send(comm, _output_hidden(out), dst)

        _ledger.add_hook(layers[end - 1].register_forward_hook(send), "pipeline: send hidden")
    src_last = plan.ranks[-1]
    last = plan.last

    def broadcast(module, args, out):
        if clock.deferred:
            return out
        value = _output_hidden(out)
        if last:
            comm.broadcast(value.detach().contiguous(), src=src_last)
            return out
        buf = torch.empty_like(value, memory_format=torch.contiguous_format)
        comm.broadcast(buf, src=src_last)
        return _with_hidden(out, buf)

    current = model.get_output_embeddings() if isinstance(head, nn.Module) else layers[-1]
    _ledger.add_hook(current.register_forward_hook(broadcast),
                     "pipeline: broadcast the last stage's output")


def _rebuild_undo(units: list, comm):
    """The undo of the step, at ``engine.close()`` on every rank: the parameters of every unit
    (each decoder layer, the embedding, the head: ``(module, owner rank)``, the same list on every
    rank) broadcast from the rank that kept them, each parameter once; the other ranks take the
    data into the Parameter they let go of (a tied one they still hold gets the same values)."""
    params, seen = [], set()  # (parameter, shape, dtype, device, owner rank), as handed in
    for module, owner in units:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append((p, p.shape, p.dtype, p.device, owner))

    def rebuild() -> None:
        for p, shape, dtype, device, owner in params:
            if comm.rank == owner:
                comm.broadcast(p.data.contiguous(), src=owner)
            else:
                buf = torch.empty(shape, dtype=dtype, device=device)
                comm.broadcast(buf, src=owner)
                p.data = buf
    return rebuild

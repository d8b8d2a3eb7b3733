"""The CPU accelerator's decode-step graphs: :class:`CpuCompileStrategy` (the step compiled by
``torch.compile``/inductor to C++), its FX packing pass for frozen graphs
(:class:`PackLinearWeights`) and where inductor keeps its caches (:func:`inductor_cache_folder`).

The fp32 linear weights the compiled step reads in place are laid out by
:mod:`shardwise.accelerators.cpu_blocked_layout`; every private torch API used here goes through
:mod:`shardwise._torch_private`. Chosen by :meth:`CpuAccelerator.graph_strategy
<shardwise.accelerators.cpu.CpuAccelerator.graph_strategy>`, which imports this module when a
graph strategy is asked for (``import shardwise`` imports none of inductor).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from contextlib import contextmanager, nullcontext

import torch

from shardwise import _torch_private as private
from shardwise.accelerator import GraphStrategy
from shardwise.accelerators import cpu_precompile as precompile
from shardwise.accelerators.cpu_blocked_layout import (HALF_DTYPES, block_linear_weights,
                                                        gemm_like)
from shardwise.accelerators.cpu_gemv import use_row_products
from shardwise.graphs import StaticGraph, cache_dir, fresh_code, static_copies, static_outputs

log = logging.getLogger(__name__)


#: How the CPU captures the decode step (``enable_graph=True``): ``SHARDWISE_CPU_GRAPHS`` is one of
#: :data:`LINEAR_PACKINGS` (a :class:`CpuCompileStrategy` with that ``linear``; ``compile`` is
#: the default ``cpp``) or ``eager`` (no capture: the documented no-op).
CPU_GRAPHS_ENV = "SHARDWISE_CPU_GRAPHS"
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
#: How the step's linear weights reach their GEMMs: ``cpp`` (inductor's C++ template; unfrozen on
#: weights laid out by ``share_weights``, or frozen on its own packed copy), ``onednn`` and
#: ``inductor`` (frozen packings only). See :class:`CpuCompileStrategy`.
LINEAR_PACKINGS = ("cpp", "onednn", "inductor")
#: When a captured CPU step's replays evaluate dynamo's guards: ``first`` (default: the first
#: replay only) or ``every`` (a debugging aid; about 1.5 ms a step more on a 30-layer model)
GUARDS_ENV = "SHARDWISE_CPU_GRAPH_GUARDS"


def strategy_from_env() -> GraphStrategy:
    """The CPU's graph strategy as ``SHARDWISE_CPU_GRAPHS`` (:data:`CPU_GRAPHS_ENV`) asks:
    ``compile``/``cpp`` (the default), ``onednn``, ``inductor``, ``frozen`` (``cpp`` on its own
    prepacked copy) or ``eager`` (the base strategy: no capture). Anything else is a
    ``ConfigError`` naming the choices."""
    choice = os.environ.get(CPU_GRAPHS_ENV, "").strip().lower() or "compile"
    if choice == "compile":
        choice = "cpp"
    if choice not in ("eager", "frozen", *LINEAR_PACKINGS):
        from shardwise.errors import ConfigError

        raise ConfigError(f"{CPU_GRAPHS_ENV}={choice!r}: expected compile (= cpp), "
                          f"{', '.join(LINEAR_PACKINGS)}, frozen or eager")
    if choice == "eager":
        return GraphStrategy()
    if choice == "frozen":  # the C++ template on its own prepacked copy: faster, weights twice
        return CpuCompileStrategy(linear="cpp", freezing=True)
    return CpuCompileStrategy(linear=choice)


class CpuCompileStrategy(GraphStrategy):
    """Decode-step "graphs" on CPU: the step compiled once per shape by ``torch.compile``
    (inductor: C++ built with the system compiler) with static shapes (``dynamic=False``).

    Why it helps: a decode step at small batch is a chain of matrix-vector products bound by
    reading the weights. Inductor's C++ GEMM template streams a weight laid out in blocks of
    :data:`~shardwise.accelerators.cpu_blocked_layout.BLOCK_N` columns at about the copy
    bandwidth, about twice what eager ``F.linear`` reads (benchmarks/README.md, "Kernel
    injection and CPU graphs", *What the linears reach*), and the elementwise work (norms, residual
    adds, activations, rotary, the cache write) is fused into a few C++ loops instead of one
    eager dispatch each.

    ``linear`` picks how the linear weights are read:

    * ``"cpp"`` (default, unfrozen): :meth:`share_weights` lays every fp32 linear weight out
      once, in place, in the template's blocks (:func:`block_linear_weights`); the weights stay
      graph *inputs*, and the linears are batched GEMMs over the blocks (:func:`blocked_matmul`)
      that the template reads where they are. **One copy of the weights**, read by the compiled
      step and by the eager prompt forward alike; with nothing frozen, inductor's FX-graph cache
      (kept per user: :func:`inductor_cache_folder`) serves the next start of the same model.
      Products the template cannot take (quantized linears, weights not laid out) use ATen's
      GEMMs (inductor then benchmarks both per shape at capture). bf16/fp16 linear weights
      take the same blocks, read by the native 16-bit op at every row count (one row at about
      the copy bandwidth:
      :func:`~shardwise.accelerators.cpu_blocked_layout.half_blocked_linear`); where the
      native kernels do not build (or are opted out) they keep their layout and, at one row,
      are row products inductor streams (:mod:`~shardwise.accelerators.cpu_gemv`), from two
      rows on ATen's GEMMs.
      A step a little slower than the frozen one, far faster than HF's, for about half the
      frozen mode's peak memory (about that of injection without graphs). The prompt's forward
      reassembles each weight transiently (one at a time), so prefill is somewhat slower than
      with plain weights. Figures: benchmarks/README.md, *The default layout (cpp) in detail*.
    * ``freezing=True`` (``linear="cpp"``, the default before): the parameters become graph
      constants and inductor prepacks its own copy of each linear weight. **That copy lives
      beside the parameters** (the prompt's eager forward still reads them): about the linear
      weights' bytes more for as long as the graph exists, more while capturing (its freezing
      pass packs each fp32 weight for MKL first: benchmarks/README.md, *Costs*), and frozen
      graphs are not served by the FX-graph cache (their packed constants would be hashed by
      value). Kept for comparison
      (``benchmarks/cpu_graphs.py --variants frozen``).
    * ``"onednn"`` (frozen): :class:`PackLinearWeights`, oneDNN's packed GEMV
      (``mkldnn._linear_pointwise``: faster than eager, slower than the template), a copy as
      above.
    * ``"inductor"`` (frozen): inductor's own choice (MKL's packed sgemm for fp32, oneDNN for
      bf16): no faster than eager for an fp32 GEMV on the CPU it was measured on; kept for
      comparison. (Both: benchmarks/README.md, *What the linears reach* and *Choices measured
      and kept*.)

    Frozen graphs do not see a weight changed in place after capture (capture again: drop the
    graphs with ``engine.module.base_model.graphs.clear()``). Each captured shape (batch
    bucket) is its own compilation; capture takes tens of seconds for a real model the first
    time (C++ builds), and the next process loads it from the cache folder.

    Numerics: the compiled step computes what the eager step does, in the same dtype (nothing
    is downcast: fp32 stays fp32), summing in another order (blocked GEMMs, vectorized
    reductions), so results differ by rounding only (tests/test_cpu_graphs.py: fp32 logits
    within 1e-5 of eager, identical greedy tokens).

    Other options: ``mode`` ``"max-autotune-no-cudagraphs"`` benchmarks GEMM candidates at
    capture (noisy on a shared machine); ``fullgraph`` (default True) makes a graph break (an
    op dynamo cannot trace) an error at capture instead of a silently slower step.

    Replays evaluate dynamo's guards on the first replay only (:class:`_ReplayGuards`: the
    inputs are the same static tensors every time; ``SHARDWISE_CPU_GRAPH_GUARDS=every`` checks
    every replay).

    Inductor settings are scoped to this strategy's compilations (patched around its traces and
    calls, and passed to ``compile_fx``), never set globally. Each capture compiles a fresh copy
    of the function's code, so it gets dynamo's full recompile budget, and its compiled code and
    constants are released with the captured callable (inductor would otherwise keep every
    compiled module, and its constants, for the process's life). Compile errors are raised by
    :meth:`capture`, so ``enable_graph`` fails at init with them.
    """

    name = "cpu_compile"
    accelerates = True
    #: the compiled step calls the opaque custom ops it holds (inductor's extern calls) at
    #: every replay, so an op may read host values from its tensor inputs at run time (a CUDA
    #: graph replays the kernels recorded at capture instead): serving's mixed steps are
    #: captured here, their prompt chunks attended by such an op (the CPU backend's
    #: ``attention_chunks``, or ``shardwise::chunks_by_prefill``)
    replays_host_code = True

    def __init__(self, linear: str = "cpp", mode: str = "default", freezing: bool = False,
                 fullgraph: bool = True) -> None:
        if linear not in LINEAR_PACKINGS:
            raise ValueError(f"CpuCompileStrategy linear {linear!r} is not one of "
                             f"{', '.join(LINEAR_PACKINGS)}")
        if mode not in COMPILE_MODES:
            raise ValueError(f"CpuCompileStrategy mode {mode!r} is not one of "
                             f"{', '.join(COMPILE_MODES)}")
        # only "cpp" runs unfrozen (on weights laid out by share_weights); oneDNN's and
        # inductor's own packings exist only for frozen weights
        freezing = freezing or linear != "cpp"
        self.linear, self.mode, self.freezing, self.fullgraph = linear, mode, freezing, fullgraph
        #: replays evaluate dynamo's guards every time (else the first only: _ReplayGuards)
        self.check_guards = guards_from_env()
        self.pack_pass = PackLinearWeights() if freezing and linear == "onednn" else None
        #: graphs inductor compiled for this strategy (a replay that recompiles adds one)
        self.compiles = 0
        #: graphs loaded from the per-user store of precompiled steps instead of compiled
        #: (:mod:`~shardwise.accelerators.cpu_precompile`)
        self.loaded = 0
        #: a step of this strategy could not be saved (e.g. it reaches unpicklable state):
        #: later captures compile for this process without trying again
        self._unsavable = False
        self._options: dict | None = None
        self._cache_folder: str | None = None  # inductor's cache folder, chosen at first capture
        #: inductor's GEMM backends with ``linear="cpp"`` (see :meth:`_aten_gemms`)
        self.gemm_backends = "CPP"

    def __repr__(self) -> str:
        return (f"CpuCompileStrategy(linear={self.linear!r}, mode={self.mode!r}, "
                f"freezing={self.freezing})")

    @property
    def weight_binding(self) -> str:  # type: ignore[override]
        """``"inputs"`` unfrozen (the parameters are graph inputs, read where they are at each
        call), ``"copies"`` frozen (constants baked into the compiled code); see
        :attr:`GraphStrategy.weight_binding <shardwise.GraphStrategy.weight_binding>`."""
        return "copies" if self.freezing else "inputs"

    def keep_weight_layout(self) -> None:
        """The weights stay in the model's layout (offload's ring slots): unfrozen ``"cpp"``
        gives its products ATen's GEMMs beside the C++ template from the first capture on
        (the template takes only weights :meth:`share_weights` laid out), instead of finding
        out by a failed compilation."""
        if not self.freezing and self.linear == "cpp":
            self._aten_gemms()

    def inductor_options(self) -> dict:
        """The inductor config patches of this strategy's compilations."""
        if self._options is None:
            # our packing replaces inductor's (MKL for fp32); "cpp": the C++ GEMM template
            # (alone unless told otherwise)
            self._options = private.inductor_options(
                self.mode, freezing=self.freezing, post_grad_pass=self.pack_pass,
                gemm_backends=self.gemm_backends if self.pack_pass is None
                and self.linear == "cpp" else None)
        return self._options

    @property
    def weight_dtypes(self) -> tuple[torch.dtype, ...]:  # type: ignore[override]
        """bf16 and fp16 unfrozen ``"cpp"`` (the default): fp32 linear weights laid out in 16
        bits, multiplied by fp32 activations by the native op (``init_inference(weight_dtype=
        ...)``; :func:`block_linear_weights`); none for a frozen strategy (its prepacked
        copies are fp32)."""
        return HALF_DTYPES if self._shares_weights else ()

    @property
    def _shares_weights(self) -> bool:
        """Whether captured code reads the model's own (laid-out) weights: unfrozen "cpp"."""
        return not self.freezing and self.linear == "cpp"

    def share_weights(self, linears: list, embedding=None,
                      weight_dtype: torch.dtype | None = None) -> int:
        """Unfrozen ``linear="cpp"`` (the default): lay the fp32 linear weights out in blocks
        for the C++ GEMM template (:func:`block_linear_weights`), so the compiled step reads the
        model's own parameters; bf16/fp16 linear weights take the same blocks, read by the
        native kernel (:func:`~shardwise.accelerators.cpu_blocked_layout.half_blocked_linear`)
        where it builds, and otherwise keep their layout with a forward whose one-row product
        the compiled step streams (:func:`~shardwise.accelerators.cpu_gemv.use_row_products`:
        ATen's and the template's bf16 GEMVs read far slower, which made bf16 slower than fp32).
        A frozen strategy keeps its own prepacked copies instead (the
        parameters stay as they are: the prompt's eager forward reads them). ``weight_dtype``
        (one of :attr:`weight_dtypes`): the fp32 linear weights are laid out in it."""
        if not self._shares_weights:
            return 0
        blocked = block_linear_weights(linears, embedding, weight_dtype)
        gemms = sum(1 for m in linears if gemm_like(m))
        if blocked < gemms:  # e.g. quantized or plain-layout 16-bit linears: ATen's GEMMs too
            self._aten_gemms()
        return blocked + use_row_products(linears)

    def _aten_gemms(self) -> None:
        """Let inductor use ATen's GEMMs beside the C++ template from now on (a product the
        template cannot take: a weight not laid out by :meth:`share_weights`); inductor then
        benchmarks the two per GEMM shape at capture."""
        self.gemm_backends = "CPP,ATEN"
        self._options = None

    @contextmanager
    def _scope(self, options: dict):
        """Where this strategy's code is traced and run: inference mode (grad off, as freezing
        requires) with the inductor options patched. Dynamo reads ``freezing`` while *tracing*
        (to make parameters graph constants), so patching inside the backend is not enough."""
        if self._cache_folder is None:
            self._cache_folder = inductor_cache_folder()
        with (torch.inference_mode(), private.inductor_config_patch(options),
              inductor_cache_scope(self._cache_folder)):
            yield

    def _store(self) -> precompile.PrecompiledSteps | None:
        """The per-user store of precompiled steps, or None when they are off
        (``SHARDWISE_CPU_PRECOMPILE=0``) or the step is frozen (its weights would be baked into
        the artifact by value)."""
        if self.freezing or not self.fullgraph or not precompile.enabled() or self._unsavable:
            return None
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            return None  # the step calls the communicator (shared memory): it cannot be saved
        return precompile.PrecompiledSteps()

    def _backend(self, options: dict):
        def backend(gm: torch.fx.GraphModule, example_inputs):
            self.compiles += 1
            _VecIsaProbe.wait()  # probed while dynamo traced; lowering needs the result
            return private.compile_fx(gm, example_inputs, options)
        return backend

    def _aot_compile(self, fn, inputs: tuple[torch.Tensor, ...], options: dict, name: str):
        """``fn`` compiled ahead of time (savable), or None when torch's precompile refuses a
        step that ``torch.compile`` may still take (logged). Errors of the step itself (a graph
        break, a product no GEMM backend takes) are raised as they are."""
        before = self.compiles
        try:
            return private.aot_compile(fn, self._backend(options), inputs)
        except Exception as exc:
            if private.is_graph_break_error(exc) or private.no_valid_gemm_choice(exc):
                raise
            self.compiles = before  # what it compiled is not kept
            self._unsavable = True  # the other buckets' steps hold the same state: no retry
            log.info("shardwise: %r cannot be precompiled (%s: %s); compiling it for this "
                     "process only", name, type(exc).__name__, _first_line(exc))
            return None

    def _about(self, name: str, inputs: tuple[torch.Tensor, ...]) -> dict:
        """What a saved step was made from, for a person reading the store."""
        return {"step": name, "strategy": repr(self), "gemm_backends": self.gemm_backends,
                "inputs": [f"{tuple(t.shape)} {t.dtype}" for t in inputs],
                "torch": torch.__version__}

    def capture(self, fn, *example_args: torch.Tensor) -> StaticGraph:
        """Compile ``fn`` for arguments shaped like ``example_args`` and run it once on copies
        of them; returns a :class:`StaticGraph` (see the class docstring).

        With ``linear="cpp"`` every matrix product must fit the C++ GEMM template (a constant
        weight: all of a decode step's linears). A function with another product (e.g. of two
        inputs) is compiled again with ATen's GEMMs as candidates too, which inductor then
        benchmarks against the template at capture."""
        from shardwise.kernels.cpu import native

        native.load(respect_choice=False)  # its ops are traced in where it builds: built first
        inputs = static_copies(example_args, "cpu")
        options = self.inductor_options()
        try:
            return self._capture(fn, inputs, options)
        except _NoGemmChoice:
            self._aten_gemms()  # and for every later capture: no failed attempt each time
            return self._capture(fn, inputs, self.inductor_options())

    def _capture(self, fn, inputs: tuple[torch.Tensor, ...], options: dict) -> StaticGraph:
        name = getattr(fn, "__name__", repr(fn))
        before, loaded = self.compiles, private.inductor_module_count()
        store, key, fresh, from_store = self._store(), None, None, False
        try:
            with self._scope(options):
                compiled = None
                if store is not None:  # a later start: load what an earlier one compiled
                    key = precompile.step_key(fn, inputs, options)
                    compiled = store.load(key, fn, inputs)
                    from_store = compiled is not None
                    if compiled is None:
                        _VecIsaProbe.start()
                        compiled = self._aot_compile(fn, inputs, options, name)
                        if compiled is not None:
                            store.save(key, compiled, fn, self._about(name, inputs))
                if compiled is None:  # precompile off or refused: dynamo's usual way
                    _VecIsaProbe.start()
                    fresh = fresh_code(fn)
                    compiled = torch.compile(fresh, backend=self._backend(options),
                                             dynamic=False, fullgraph=self.fullgraph)
                outputs = static_outputs(compiled(*inputs))
        except Exception as exc:
            _VecIsaProbe.wait()  # it builds into this capture's cache folder: done first
            self.compiles = before  # a failed attempt compiled nothing that is kept
            private.forget_compiled(fresh.__code__ if fresh is not None else None,
                                    private.inductor_modules_since(loaded))
            if private.no_valid_gemm_choice(exc) and "CPP" == options.get(
                    private.GEMM_BACKENDS_OPTION):
                raise _NoGemmChoice from exc
            # what failed: dynamo's own message for a graph break, else the innermost error
            # under torch's wrappers (BackendCompilerFailed names only the backend)
            cause = exc if private.is_graph_break_error(exc) else private.causes(exc)[-1]
            raise RuntimeError(
                f"torch.compile of {name!r} on CPU failed: {type(cause).__name__}: "
                f"{_first_line(cause)}{_where(exc)}. {_hint(exc)}; fix that, or run the step "
                f"eagerly ({CPU_GRAPHS_ENV}=eager, or enable_graph=False)") from exc
        if from_store:
            self.loaded += 1
        elif self.compiles == before:
            raise RuntimeError(f"torch.compile ran {name!r} without compiling it (dynamo "
                               f"skipped the frame); run the step eagerly ({CPU_GRAPHS_ENV}="
                               f"eager, or enable_graph=False)")
        single = isinstance(outputs, torch.Tensor)
        # static outputs made outside inference mode (the caller's), written inside it on replay
        outputs = outputs.clone() if single else tuple(o.clone() for o in outputs)

        def copy_out(new) -> None:
            if single:
                outputs.copy_(new)
            else:
                for static, value in zip(outputs, new):
                    static.copy_(value)

        guards = _ReplayGuards(compiled, aot=fresh is None, every=self.check_guards)

        def replay() -> None:
            if guards.skipped:  # the step ran once checked on these very inputs
                with torch.inference_mode(), guards.unchecked():
                    copy_out(compiled(*inputs))
                return
            # counted around this call only: captures of other buckets also add to the count
            compiled_before = self.compiles
            with self._scope(options):  # a recompile (some guard failed) compiles the same way
                copy_out(compiled(*inputs))
            if self.compiles != compiled_before:  # correct, but a capture's time spent again
                log.warning("shardwise: the compiled CPU decode step %r was recompiled on "
                            "replay (a dynamo guard failed); results are right, but each "
                            "recompile costs a capture's time", name)
            else:
                guards.passed()

        graph = StaticGraph(replay, inputs, outputs, compiled)
        graph.guards = guards  # whether its replays still check dynamo's guards
        # inductor's generated modules, freed with the graph
        graph.modules = tuple(private.inductor_modules_since(loaded))
        weakref.finalize(graph, private.forget_compiled,
                         fresh.__code__ if fresh is not None else None, graph.modules)
        return graph

    @staticmethod
    def constants(graph: StaticGraph) -> list[torch.Tensor]:
        """The tensors a captured graph holds of its own: the constants bound in the modules
        inductor generated for it (frozen and prepacked weights when ``freezing``; with the
        weights as graph inputs, only small ones such as the rotary tables)."""
        seen, out = set(), []
        for module in getattr(graph, "modules", ()):
            for value in vars(module).values():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    out.append(value)
        return out



#: Inductor's own cache-folder variable: where it keeps generated C++, built libraries and its
#: FX-graph / AOT-autograd caches (its default is the shared ``/tmp/torchinductor_$USER``).
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


class _ReplayGuards:
    """Whether a captured step's replays still evaluate dynamo's guards.

    A replay calls the compiled step on the same static input tensors every time, and the step
    reads the same modules and cache buffers: what the guards check (every tensor's shape,
    stride and dtype, grad mode, the objects traced) does not change between replays unless
    the model itself is changed, which drops the graphs (as a CUDA graph's replay, which checks
    nothing either). Evaluating them costs about 1.5 ms a step on a 30-layer model (548 tensors,
    more than its attention), so they are evaluated on the first replay only (the capture ran
    on copies of the inputs, this checks the replay's context too) and skipped after it; with
    ``every`` (:data:`GUARDS_ENV` ``=every``) on every replay. A precompiled step stops checking
    through its own switch; a ``torch.compile``'d one under dynamo's unsafe-skip stance, which
    still raises if a replay would need another compilation."""

    def __init__(self, compiled, aot: bool, every: bool) -> None:
        self.compiled, self.aot, self.every = compiled, aot, every
        self.skipped = False

    def passed(self) -> None:
        """A replay with guards evaluated compiled nothing: skip them from the next one on."""
        if self.every or self.skipped:
            return
        self.skipped = private.aot_skip_guards(self.compiled) if self.aot else True

    def unchecked(self):
        """The context of an unchecked replay."""
        return nullcontext() if self.aot else private.skip_guard_evaluation()


def guards_from_env() -> bool:
    """Whether :data:`GUARDS_ENV` asks for dynamo's guards on every replay (``every``) rather
    than on the first only (``first``, the default); ConfigError for another value."""
    value = os.environ.get(GUARDS_ENV, "").strip().lower() or "first"
    if value not in ("first", "every"):
        from shardwise.errors import ConfigError

        raise ConfigError(f"{GUARDS_ENV}={value!r}: expected first (dynamo's guards checked on "
                          f"a captured step's first replay only, the default) or every")
    return value == "every"


def user_inductor_cache() -> str | None:
    """The inductor cache folder the user chose (``TORCHINDUCTOR_CACHE_DIR``), or None. Inductor
    writes its default into that variable the first time it compiles, so a value equal to the
    default is inductor's, not the user's."""
    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if not chosen or os.path.abspath(chosen) == os.path.abspath(
            private.inductor_default_cache_dir()):
        return None
    return chosen


def inductor_cache_folder() -> str:
    """Where this process's CPU captures keep inductor's caches: the user's
    ``TORCHINDUCTOR_CACHE_DIR`` if set, else shardwise's per-user folder
    (:func:`shardwise.graphs.cache_dir` ``/ "inductor"``, created here)."""
    return user_inductor_cache() or str(cache_dir("inductor"))


@contextmanager
def inductor_cache_scope(ours: str):
    """While a capture compiles (or a replay recompiles): inductor's caches in ``ours`` (see
    :func:`inductor_cache_folder`), so the second start of the same model loads its compiled
    step from there instead of compiling it again. Inductor reads the variable each time it
    needs the folder; it is set back afterwards (a folder the user chose wins)."""
    if user_inductor_cache() is not None:
        yield
        return
    before = os.environ.get(INDUCTOR_CACHE_ENV)
    os.environ[INDUCTOR_CACHE_ENV] = ours
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(INDUCTOR_CACHE_ENV, None)
        else:
            os.environ[INDUCTOR_CACHE_ENV] = before


class _VecIsaProbe:
    """Inductor's SIMD probe (:func:`shardwise._torch_private.probe_vec_isa_concurrently`) run
    on a daemon thread while dynamo traces a step (single-threaded Python: a core is idle), and
    waited for before inductor lowers it, which needs the result. Started by a capture that
    compiles, inside its cache scope (the probe's builds go to that capture's cache folder), at
    most once per process. Where an earlier start recorded every ISA working
    (:func:`~shardwise.accelerators.cpu_precompile.known_vec_isa`) nothing is built or loaded:
    the record is taken at once. A failed probe is logged at debug level: inductor probes again
    at lowering and reports what fails."""

    _lock = threading.Lock()
    _thread: threading.Thread | None = None

    @classmethod
    def start(cls) -> None:
        with cls._lock:
            if cls._thread is not None or private.vec_isa_probed() is not None:
                return
            folder = precompile.precompiled_folder() if precompile.enabled() else None
            if folder is not None and precompile.vec_isa_known(folder):
                with precompile.known_vec_isa(folder):  # no builds: taken as recorded
                    private.probe_vec_isa_concurrently()
                return
            cls._thread = threading.Thread(target=cls._run, daemon=True,
                                           name="shardwise-vec-isa-probe")
            cls._thread.start()

    @staticmethod
    def _run() -> None:
        began = time.perf_counter()
        try:
            isa = private.probe_vec_isa_concurrently()
            log.info("shardwise: inductor's SIMD probe (beside dynamo's trace): %s in %.1f s",
                     isa, time.perf_counter() - began)
        except Exception as exc:  # noqa: BLE001 - inductor meets it again and reports it
            log.debug("shardwise: SIMD probe failed (%s: %s)", type(exc).__name__, exc)

    @classmethod
    def wait(cls) -> None:
        thread = cls._thread
        if thread is not None:
            thread.join()


class _NoGemmChoice(Exception):
    """A matrix product the C++ GEMM template cannot take (internal: capture retries)."""


class PackLinearWeights:
    """An inductor post-grad pass over a *frozen* graph (``linear="onednn"``): every matrix
    product by a constant 2-d weight — inductor's MKL-packed fp32 linear
    (``torch.ops.mkl._mkl_linear``, which its freezing pass makes of ``F.linear`` and
    transformers' ``Conv1D``), or a plain ``mm(x, W)`` / ``addmm(b, x, W)`` it left alone —
    becomes ``torch.ops.mkldnn._linear_pointwise`` on a copy of ``W`` reordered once
    (``torch.ops.mkldnn._reorder_linear_weight``) into oneDNN's layout for the step's row count
    (bf16/fp16 weights inductor already gives to oneDNN). MKL's packed sgemm is not reliably
    faster than eager ``F.linear`` for a GEMV (faster at one shape, slower at the other:
    benchmarks/README.md, *What the linears reach*). Same product in the same dtype, summed in
    another order. ``packed`` counts the products rewritten,
    ``packed_bytes`` the bytes of the weights packed.

    (Inductor's packing is left on, not disabled with ``cpp.weight_prepack=False``: its freezing
    patterns are registered once per process with the setting of the first compilation, so
    turning it off here would change what every later compilation in the process does. The pass
    is deliberately a plain callable, not an inductor ``CustomGraphPass`` with a ``uuid``: it
    adds constants to the graph module, which a hit in inductor's FX graph cache would skip, and
    inductor bypasses that cache for plain-callable passes.)"""

    def __init__(self) -> None:
        self.packed = 0
        self.packed_bytes = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        mkl_linear = private.mkl_linear_targets()
        gm = graph.owning_module
        dropped: set[str] = set()
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in mkl_linear:  # inductor's own packing (fp32): (x, packed, w, b, rows)
                x, mkl_packed, w, bias = node.args[:4]
                weight = _constant(gm, w)  # [out, in]
                weight = None if weight is None else weight.t()
            elif node.target is aten.addmm.default:
                if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                    continue
                bias, x, w = node.args[:3]
                weight = _constant(gm, w)  # [in, out]
            elif node.target is aten.mm.default:
                bias, (x, w) = None, node.args[:2]
                weight = _constant(gm, w)
            else:
                continue
            if weight is None or not _packable(x, weight, bias):
                continue
            if node.target in mkl_linear and getattr(mkl_packed, "op", None) == "get_attr":
                dropped.add(mkl_packed.target)
            rows = x.meta["val"].shape[0]
            packed = private.mkldnn_pack_linear_weight(weight.t().contiguous(), rows)
            name = _free_name(gm, "_shardwise_packed_w")
            gm.register_buffer(name, packed)
            with graph.inserting_before(node):
                w_node = graph.get_attr(name)
                new = graph.call_function(private.mkldnn_linear_target(),
                                          (x, w_node, bias, "none", [], ""))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            self.packed += 1
            self.packed_bytes += weight.numel() * weight.element_size()
        graph.eliminate_dead_code()
        used = {n.target for n in graph.nodes if n.op == "get_attr"}
        for name in dropped - used:  # inductor's MKL-packed copies, now unused: free them
            if hasattr(gm, name):
                delattr(gm, name)


def _constant(gm: torch.fx.GraphModule, node) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = getattr(gm, node.target, None)
    return value if isinstance(value, torch.Tensor) and not value.is_mkldnn else None


def _packable(x, weight: torch.Tensor, bias) -> bool:
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if val is None or val.dim() != 2 or weight.dim() != 2 or val.dtype != weight.dtype:
        return False
    if val.device.type != "cpu" or weight.device.type != "cpu":
        return False
    if bias is not None:
        b = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
        if b is None or b.dim() != 1 or b.shape[0] != weight.shape[1] or b.dtype != val.dtype:
            return False
    return private.mkldnn_supports(weight.dtype)


def _free_name(gm: torch.fx.GraphModule, prefix: str) -> str:
    i = 0
    while hasattr(gm, f"{prefix}{i}"):
        i += 1
    return f"{prefix}{i}"


def _hint(exc: BaseException) -> str:
    """What a failed capture's error tells the user to look at: dynamo's graph break, the C++
    compiler, or else inductor itself (a failure in its passes or lowering: not the compiler's)."""
    if private.is_graph_break_error(exc):
        return ("dynamo cannot trace that op into one graph (a graph break): the step's code "
                "must avoid it under torch.compiler.is_compiling()")
    if private.is_cxx_build_error(exc):
        return ("inductor could not build the step: it needs a working C++ compiler (g++ on "
                "PATH, or $CXX)")
    return (f"inductor failed compiling the step (torch {torch.__version__}; not a C++ compiler "
            f"problem): a limitation or bug of torch for this step")


def _where(exc: BaseException) -> str:
    """`` (at FILE:LINE)`` of the innermost user-code frame dynamo names in its message."""
    frames = [line.strip() for line in str(exc).splitlines() if line.strip().startswith("File \"")]
    if not frames:
        return ""
    parts = frames[-1].split('"')  # File "PATH", line N, in FUNC
    line = frames[-1].split("line ")[-1].split(",")[0] if "line " in frames[-1] else "?"
    return f" (at {parts[1]}:{line})" if len(parts) > 1 else ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


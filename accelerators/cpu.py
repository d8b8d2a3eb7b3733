"""The CPU accelerator: always available, gloo collectives, threads split between local ranks,
decode-step graphs through ``torch.compile`` (:class:`CpuCompileStrategy`)."""

from __future__ import annotations

import builtins
import logging
import os
import platform
import sys
import types
import weakref
from contextlib import contextmanager
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.accelerator import Accelerator, Availability, GraphStrategy
from shardwise.graphs import StaticGraph, cache_dir, static_copies, static_outputs

log = logging.getLogger(__name__)


@cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _proc_status() -> dict[str, int]:
    """Memory fields of /proc/self/status in bytes (empty where that file does not exist)."""
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key.startswith("Vm") and rest.strip().endswith("kB"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def native_bf16() -> bool:
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX)."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ----- graphs: torch.compile ----------------------------------------------------------------------

#: How the CPU captures the decode step (``enable_graph=True``): ``SHARDWISE_CPU_GRAPHS`` is one of
#: :data:`LINEAR_PACKINGS` (a :class:`CpuCompileStrategy` with that ``linear``; ``compile`` is
#: the default ``cpp``) or ``eager`` (no capture: the documented no-op).
CPU_GRAPHS_ENV = "SHARDWISE_CPU_GRAPHS"
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
#: How the step's linear weights reach their GEMMs: ``cpp`` (inductor's C++ template; unfrozen on
#: weights laid out by ``share_weights``, or frozen on its own packed copy), ``onednn`` and
#: ``inductor`` (frozen packings only). See :class:`CpuCompileStrategy`.
LINEAR_PACKINGS = ("cpp", "onednn", "inductor")


class CpuCompileStrategy(GraphStrategy):
    """Decode-step "graphs" on CPU: the step compiled once per shape by ``torch.compile``
    (inductor: C++ built with the system compiler) with static shapes (``dynamic=False``).

    Why it helps: a decode step at small batch is a chain of matrix-vector products bound by
    reading the weights. Inductor's C++ GEMM template streams a weight laid out in blocks of
    :data:`BLOCK_N` columns at about the copy bandwidth (eager ``F.linear`` of fp32 reads
    ~16-17 GB/s on the development VM, the template 20-33 GB/s: benchmarks/README.md, "CPU
    graphs"), and the elementwise work (norms, residual adds, activations, rotary, the cache
    write) is fused into a few C++ loops instead of one eager dispatch each.

    ``linear`` picks how the linear weights are read:

    * ``"cpp"`` (default, unfrozen): :meth:`share_weights` lays every fp32 linear weight out
      once, in place, in the template's blocks (:func:`block_linear_weights`); the weights stay
      graph *inputs*, and the linears are batched GEMMs over the blocks (:func:`blocked_matmul`)
      that the template reads where they are. **One copy of the weights**, read by the compiled
      step and by the eager prompt forward alike; with nothing frozen, inductor's FX-graph cache
      (kept per user: :func:`inductor_cache_folder`) serves the next start of the same model.
      Products the template cannot take (quantized or bf16 linears, weights not laid out) use
      ATen's GEMMs (inductor then benchmarks both per shape at capture).
      Measured (gpt2-24l-1024h fp32, 1 thread, on a loaded 2-core VM): 48-49 ms/token against
      43-44 with ``freezing=True`` and 76-78 for HF; peak RSS 2152 MiB against 4506 frozen and
      2046 for injection without graphs. The prompt's forward reassembles each weight
      transiently (one at a time): prefill measured ~12% slower than with plain weights.
    * ``freezing=True`` (``linear="cpp"``, the default before): the parameters become graph
      constants and inductor prepacks its own copy of each linear weight. **That copy lives
      beside the parameters** (the prompt's eager forward still reads them): about the linear
      weights' bytes more for as long as the graph exists, up to ~2.5x while capturing (its
      freezing pass packs each fp32 weight for MKL first), and frozen graphs are not served by
      the FX-graph cache (their packed constants would be hashed by value). Kept for comparison
      (``benchmarks/cpu_graphs.py --variants frozen``).
    * ``"onednn"`` (frozen): :class:`PackLinearWeights`, oneDNN's packed GEMV
      (``mkldnn._linear_pointwise``, ~26-28 GB/s), a copy as above.
    * ``"inductor"`` (frozen): inductor's own choice (MKL's packed sgemm for fp32, oneDNN for
      bf16): measured no faster than eager for fp32 GEMV on AMD EPYC; kept for comparison.

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

    Inductor settings are scoped to this strategy's compilations (patched around its traces and
    calls, and passed to ``compile_fx``), never set globally. Each capture compiles a fresh copy
    of the function's code, so it gets dynamo's full recompile budget, and its compiled code and
    constants are released with the captured callable (inductor would otherwise keep every
    compiled module, and its constants, for the process's life). Compile errors are raised by
    :meth:`capture`, so ``enable_graph`` fails at init with them.
    """

    name = "cpu_compile"
    accelerates = True

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
        self.pack_pass = PackLinearWeights() if freezing and linear == "onednn" else None
        #: graphs inductor compiled for this strategy (a replay that recompiles adds one)
        self.compiles = 0
        self._options: dict | None = None
        self._cache_folder: str | None = None  # inductor's cache folder, chosen at first capture
        #: inductor's GEMM backends with ``linear="cpp"`` (see :meth:`_aten_gemms`)
        self.gemm_backends = "CPP"

    def __repr__(self) -> str:
        return (f"CpuCompileStrategy(linear={self.linear!r}, mode={self.mode!r}, "
                f"freezing={self.freezing})")

    def inductor_options(self) -> dict:
        """The inductor config patches of this strategy's compilations."""
        if self._options is None:
            from torch._inductor import list_mode_options

            options = {**list_mode_options(self.mode), "freezing": self.freezing}
            if self.pack_pass is not None:  # our packing replaces inductor's (MKL for fp32)
                options["post_grad_custom_pre_pass"] = self.pack_pass
            elif self.linear == "cpp":  # the C++ GEMM template (alone unless told otherwise)
                options.update({"max_autotune_gemm": True,
                                "max_autotune_gemm_backends": self.gemm_backends})
            self._options = options
        return self._options

    def share_weights(self, linears: list, embedding=None) -> int:
        """Unfrozen ``linear="cpp"`` (the default): lay the fp32 linear weights out in blocks
        for the C++ GEMM template (:func:`block_linear_weights`), so the compiled step reads the
        model's own parameters. A frozen strategy keeps its own prepacked copies instead (the
        parameters stay as they are: the prompt's eager forward reads them)."""
        if self.freezing or self.linear != "cpp":
            return 0
        blocked = block_linear_weights(linears, embedding)
        gemms = sum(1 for m in linears if _gemm_like(m))
        if blocked < gemms:  # e.g. quantized or bf16 linears: ATen's GEMMs are needed too
            self._aten_gemms()
        return blocked

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
        import torch._inductor.config as inductor_config

        if self._cache_folder is None:
            self._cache_folder = inductor_cache_folder()
        with (torch.inference_mode(), inductor_config.patch(options),
              inductor_cache_scope(self._cache_folder)):
            yield

    def capture(self, fn, *example_args: torch.Tensor) -> StaticGraph:
        """Compile ``fn`` for arguments shaped like ``example_args`` and run it once on copies
        of them; returns a :class:`StaticGraph` (see the class docstring).

        With ``linear="cpp"`` every matrix product must fit the C++ GEMM template (a constant
        weight: all of a decode step's linears). A function with another product (e.g. of two
        inputs) is compiled again with ATen's GEMMs as candidates too, which inductor then
        benchmarks against the template at capture."""
        inputs = static_copies(example_args, "cpu")
        options = self.inductor_options()
        try:
            return self._capture(fn, inputs, options)
        except _NoGemmChoice:
            self._aten_gemms()  # and for every later capture: no failed attempt each time
            return self._capture(fn, inputs, self.inductor_options())

    def _capture(self, fn, inputs: tuple[torch.Tensor, ...], options: dict) -> StaticGraph:
        from torch._inductor.codecache import PyCodeCache
        from torch._inductor.compile_fx import compile_fx

        name = getattr(fn, "__name__", repr(fn))

        def backend(gm: torch.fx.GraphModule, example_inputs):
            self.compiles += 1
            return compile_fx(gm, example_inputs, config_patches=options)

        fresh = _fresh_code(fn)
        compiled = torch.compile(fresh, backend=backend, dynamic=False, fullgraph=self.fullgraph)
        before, loaded = self.compiles, len(PyCodeCache.modules)
        try:
            with self._scope(options):
                outputs = static_outputs(compiled(*inputs))
        except Exception as exc:
            self.compiles = before  # a failed attempt compiled nothing that is kept
            _release(fresh.__code__, PyCodeCache.modules[loaded:])
            if "NoValidChoicesError" in str(exc) and "CPP" == options.get(
                    "max_autotune_gemm_backends"):
                raise _NoGemmChoice from exc
            raise RuntimeError(
                f"torch.compile of {name!r} on CPU failed: {type(exc).__name__}: "
                f"{_first_line(exc)}{_where(exc)}. {_hint(exc)}; fix that, or run the step "
                f"eagerly ({CPU_GRAPHS_ENV}=eager, or enable_graph=False)") from exc
        if self.compiles == before:
            raise RuntimeError(f"torch.compile ran {name!r} without compiling it (dynamo "
                               f"skipped the frame); run the step eagerly ({CPU_GRAPHS_ENV}="
                               f"eager, or enable_graph=False)")
        compiled_at = self.compiles
        single = isinstance(outputs, torch.Tensor)
        # static outputs made outside inference mode (the caller's), written inside it on replay
        outputs = outputs.clone() if single else tuple(o.clone() for o in outputs)

        def replay() -> None:
            nonlocal compiled_at
            with self._scope(options):  # a recompile (some guard failed) compiles the same way
                new = compiled(*inputs)
                if single:
                    outputs.copy_(new)
                else:
                    for static, value in zip(outputs, new):
                        static.copy_(value)
            if self.compiles != compiled_at:  # correct, but a capture's time spent again
                compiled_at = self.compiles
                log.warning("shardwise: the compiled CPU decode step %r was recompiled on "
                            "replay (a dynamo guard failed); results are right, but each "
                            "recompile costs a capture's time", name)

        graph = StaticGraph(replay, inputs, outputs, compiled)
        graph.modules = tuple(PyCodeCache.modules[loaded:])  # inductor's, freed with the graph
        weakref.finalize(graph, _release, fresh.__code__, graph.modules)
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


# ----- one copy of the linear weights, laid out for the C++ GEMM template ------------------------

#: Output columns per block of a weight laid out by :func:`block_weight` (two AVX-512 vectors of
#: fp32: the C++ GEMM template's own ``block_n``, so its batched GEMM reads the blocks as they are).
BLOCK_N = 32


def block_weight(mat2: torch.Tensor, block: int = BLOCK_N) -> torch.Tensor:
    """``mat2`` [K, N] (the right operand of ``x @ mat2``) as contiguous blocks of ``block``
    columns, [ceil(N / block), K, block] (the last block zero-padded): block ``j`` is
    ``mat2[:, j*block:(j+1)*block]``. A new tensor; ``mat2`` is left as it is."""
    k, n = mat2.shape
    pad = -n % block
    if pad:
        mat2 = F.pad(mat2, (0, pad))
    return mat2.reshape(k, (n + pad) // block, block).transpose(0, 1).contiguous()


@cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library)."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Give the heap memory freed tensors left behind back to the system. glibc keeps freed
    chunks below its (adaptive, up to 32 MiB) mmap threshold in the heap: the CPU graphs'
    re-laid-out weights left the freed old layout — the size of the model — in the process's
    RSS (SmolLM2 fp32: 1574 MiB after init with graphs, 1162 MiB
    after a trim, 1067 MiB injected without graphs)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def unblock_weight(blocked: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`block_weight`'s inverse: ``mat2`` [K, n] from its blocks [ceil(n / block), K,
    block] (a new tensor)."""
    nb, k, block = blocked.shape
    return blocked.detach().transpose(0, 1).reshape(k, nb * block)[:, :n].contiguous()


class PlainLayoutInStateDict:
    """``state_dict`` post-hook of a module whose weight holds :func:`block_weight`'s layout
    (instance-scoped, registered by :func:`block_linear_weights`): the ``weight`` entry is
    given in the module's usual layout — [N, K] for ``nn.Linear``/``nn.Embedding``, [K, N] for
    ``Conv1D`` — so ``save_pretrained`` and ``engine.save_checkpoint`` write what they would
    without graphs. A weight tied between a head and an embedding is unblocked once per
    ``state_dict`` call and both entries get the same tensor (the tie stays visible)."""

    def __init__(self, n: int, transpose: bool) -> None:
        self.n, self.transpose = n, transpose

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, _meta: object) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            return
        done = _unblocked_so_far(state_dict)  # id(Parameter) -> plain tensor
        plain = done.get(id(module.weight))
        if plain is None:
            mat2 = unblock_weight(module.weight, self.n)  # [K, N]
            plain = done[id(module.weight)] = mat2.t().contiguous() if self.transpose else mat2
        state_dict[key] = plain


def _unblocked_so_far(state_dict: dict) -> dict[int, torch.Tensor]:
    """The weights this ``state_dict`` call already put back in their usual layout, kept on
    the dict being built (torch's is an ``OrderedDict``, which takes attributes as it takes
    ``_metadata``); a destination that takes none shares nothing."""
    done = getattr(state_dict, "_shardwise_unblocked", None)
    if done is None:
        done = {}
        try:
            state_dict._shardwise_unblocked = done
        except AttributeError:
            pass
    return done


def blocked_matmul(x: torch.Tensor, blocked: torch.Tensor, n: int) -> torch.Tensor:
    """``x @ mat2`` for ``blocked = block_weight(mat2)``: x [..., K] → [..., n].

    Compiled, one batched GEMM over the blocks (inductor's C++ template reads ``blocked`` in
    place: the weight is a graph input, not a frozen copy). Eager, the same batched GEMM when
    the row count is at most the block width (the rows repeated per block are then at most
    the weight's size), else one GEMM on the weight put back together (a transient copy of
    this one weight: prefill)."""
    *lead, k = x.shape
    rows = x.reshape(-1, k)  # [M, K]
    nb, _, block = blocked.shape
    m = rows.shape[0]
    if torch.compiler.is_compiling() and m == 1:
        # inductor lowers a one-row bmm to a plain reduction loop, not the C++ GEMM template
        # (measured ~30% slower for a whole GPT-2 step): a second, discarded row keeps the
        # template, which still reads each weight once
        rows = F.pad(rows, (0, 0, 0, 1))
    if torch.compiler.is_compiling() or m <= block:
        out = torch.bmm(rows.unsqueeze(0).expand(nb, rows.shape[0], k), blocked)  # [Nb, M', b]
        out = out[:, :m].transpose(0, 1).reshape(m, nb * block)
    else:
        out = rows @ blocked.transpose(0, 1).reshape(k, nb * block)
    return out[:, :n].reshape(*lead, n)


class BlockedLinear:
    """Instance-level ``forward`` of a linear layer (``nn.Linear``, or transformers' ``Conv1D``)
    whose weight Parameter holds :func:`block_weight`'s layout: ``x @ W.T + b`` (``x @ W + b``
    for ``Conv1D``), read from those blocks by eager and compiled code alike."""

    def __init__(self, module: nn.Module, out_features: int) -> None:
        self.module, self.out_features = module, out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        out = blocked_matmul(x, module.weight, self.out_features)
        return out if module.bias is None else out + module.bias

    def __repr__(self) -> str:
        return f"BlockedLinear(out_features={self.out_features})"


class BlockedEmbedding:
    """Instance-level ``forward`` of an ``nn.Embedding`` whose weight (tied to an output head
    laid out by :func:`block_weight`) holds those blocks: row ``v`` is column ``v`` of the
    head's ``mat2``, i.e. ``blocks[v // BLOCK_N, :, v % BLOCK_N]``."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        blocks = self.module.weight  # [Nb, K, block]
        block = blocks.shape[-1]
        return blocks[ids // block, :, ids % block]  # [..., K]

    def __repr__(self) -> str:
        return "BlockedEmbedding()"


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


def _gemm_like(module: nn.Module) -> bool:
    """A module whose forward is a matrix product: a 2-d weight that is not an embedding table,
    or a linear of another kind (e.g. a quantized one: ``in_features``/``out_features`` and a
    packed weight, lowered by inductor through its GEMM selection like any ``mm``)."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return False
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return True
    return (isinstance(getattr(module, "in_features", None), int)
            and isinstance(getattr(module, "out_features", None), int))


def _blockable(module: nn.Module) -> bool:
    """A plain fp32 linear on the CPU, with no forward of its own (not already patched)."""
    if "forward" in module.__dict__ or not (type(module) is nn.Linear or _is_conv1d(module)):
        return False
    w = getattr(module, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32
            and w.device.type == "cpu")


def block_linear_weights(linears: list[nn.Module], embedding: nn.Module | None = None) -> int:
    """Lay out the weights of ``linears`` (the modules the decode step calls) for the C++ GEMM
    template, in place and instance-scoped: each weight Parameter's data becomes
    :func:`block_weight` of it and the module gets a :class:`BlockedLinear` forward. The old
    layout is freed (unless something else holds it), so eager and compiled code read one copy.
    ``embedding``: an ``nn.Embedding`` sharing its weight with one of ``linears`` (a tied output
    head); it gets a :class:`BlockedEmbedding` forward, or, when it cannot, that linear is left
    as it is. Modules that are not plain fp32 ``nn.Linear``/``Conv1D`` are left as they are.
    Each laid-out module gets a :class:`PlainLayoutInStateDict` hook, so its ``state_dict``
    (and ``save_pretrained``) still holds the usual layout. Returns the number of linears laid
    out."""
    tied = embedding.weight if embedding is not None else None
    done = 0
    for module in linears:
        if not _blockable(module):
            continue
        w = module.weight
        if tied is not None and w is tied and not _embedding_blockable(embedding, module):
            continue
        conv = _is_conv1d(module)
        mat2 = w.detach() if conv else w.detach().t()  # [K, N]
        n = mat2.shape[1]
        with torch.no_grad():
            w.data = block_weight(mat2)
        module.forward = BlockedLinear(module, n)
        module.register_state_dict_post_hook(PlainLayoutInStateDict(n, transpose=not conv))
        if tied is not None and w is tied:
            embedding.forward = BlockedEmbedding(embedding)
            embedding.register_state_dict_post_hook(PlainLayoutInStateDict(n, transpose=True))
        done += 1
    return done


def _embedding_blockable(embedding: nn.Module, head: nn.Module) -> bool:
    return (type(embedding) is nn.Embedding and "forward" not in embedding.__dict__
            and type(head) is nn.Linear and embedding.max_norm is None)


#: Inductor's own cache-folder variable: where it keeps generated C++, built libraries and its
#: FX-graph / AOT-autograd caches (its default is the shared ``/tmp/torchinductor_$USER``).
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def user_inductor_cache() -> str | None:
    """The inductor cache folder the user chose (``TORCHINDUCTOR_CACHE_DIR``), or None. Inductor
    writes its default into that variable the first time it compiles, so a value equal to the
    default is inductor's, not the user's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if not chosen or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
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


class _NoGemmChoice(Exception):
    """A matrix product the C++ GEMM template cannot take (internal: capture retries)."""


class PackLinearWeights:
    """An inductor post-grad pass over a *frozen* graph (``linear="onednn"``): every matrix
    product by a constant 2-d weight — inductor's MKL-packed fp32 linear
    (``torch.ops.mkl._mkl_linear``, which its freezing pass makes of ``F.linear`` and
    transformers' ``Conv1D``), or a plain ``mm(x, W)`` / ``addmm(b, x, W)`` it left alone —
    becomes ``torch.ops.mkldnn._linear_pointwise`` on a copy of ``W`` reordered once
    (``torch.ops.mkldnn._reorder_linear_weight``) into oneDNN's layout for the step's row count
    (bf16/fp16 weights inductor already gives to oneDNN). MKL's packed sgemm measured no faster
    than eager ``F.linear`` for a GEMV here (``benchmarks/cpu_linear.py``). Same product in the
    same dtype, summed in another order. ``packed`` counts the products rewritten,
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
        mkl_linear = ((torch.ops.mkl._mkl_linear, torch.ops.mkl._mkl_linear.default)
                      if torch._C.has_mkl else ())
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
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.t().contiguous(), rows)
            name = _free_name(gm, "_shardwise_packed_w")
            gm.register_buffer(name, packed)
            with graph.inserting_before(node):
                w_node = graph.get_attr(name)
                new = graph.call_function(torch.ops.mkldnn._linear_pointwise.default,
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
    from torch._inductor.utils import is_mkldnn_bf16_supported, is_mkldnn_fp16_supported

    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if val is None or val.dim() != 2 or weight.dim() != 2 or val.dtype != weight.dtype:
        return False
    if val.device.type != "cpu" or weight.device.type != "cpu":
        return False
    if bias is not None:
        b = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
        if b is None or b.dim() != 1 or b.shape[0] != weight.shape[1] or b.dtype != val.dtype:
            return False
    if weight.dtype == torch.float32:
        return True
    if weight.dtype == torch.bfloat16:
        return is_mkldnn_bf16_supported("cpu")
    if weight.dtype == torch.float16:
        return is_mkldnn_fp16_supported("cpu")
    return False


def _free_name(gm: torch.fx.GraphModule, prefix: str) -> str:
    i = 0
    while hasattr(gm, f"{prefix}{i}"):
        i += 1
    return f"{prefix}{i}"


def _fresh_code(fn):
    """``fn`` behind a wrapper with its own code object and its own globals: dynamo keeps
    compiled code and its recompile count per code object, and installs the compiled graph
    (``__compiled_fn_*``) in the globals of the frame it compiles, so this gives each capture
    its own of each, freed with the wrapper instead of living in this module for good."""

    def call(*args):
        return fn(*args)

    scope = {"__builtins__": builtins, "__name__": f"{__name__}.<capture>"}
    return types.FunctionType(call.__code__.replace(), scope, call.__name__, None,
                              call.__closure__)


def _release(code: types.CodeType, modules: list) -> None:
    """Free what a released capture compiled: dynamo's cache entries on its code object (they
    hold the compiled graph, its guards and cleanup hooks) and inductor's generated modules
    (``PyCodeCache.modules`` and ``sys.modules`` would keep them, and the frozen constants —
    packed weights — bound in their globals, alive for the process's life). Files on disk stay
    (inductor's cache)."""
    from torch._dynamo.eval_frame import reset_code
    from torch._inductor.codecache import PyCodeCache

    reset_code(code)
    ids = {id(m) for m in modules}
    PyCodeCache.modules[:] = [m for m in PyCodeCache.modules if id(m) not in ids]
    for mod in modules:
        if sys.modules.get(mod.__name__) is mod:
            del sys.modules[mod.__name__]


def _hint(exc: BaseException) -> str:
    if isinstance(exc, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        return ("dynamo cannot trace that op into one graph (a graph break): the step's code "
                "must avoid it under torch.compiler.is_compiling()")
    return ("inductor could not build the step: it needs a working C++ compiler (g++ on PATH, "
            "or $CXX)")


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


class CpuAccelerator(Accelerator):
    """Runs on the host CPU. fp32 and bf16; bf16 is preferred only with native bf16 support."""

    name = "cpu"
    device_type = "cpu"
    communication_backend = "gloo"
    priority = 0
    supported_dtypes = (torch.float32, torch.bfloat16)
    kernel_backends = ("cpu",)
    bandwidth_probe_bytes = 512 << 20  # well past the last-level cache, quick on a small host

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    @property
    def preferred_dtype(self) -> torch.dtype:
        return torch.bfloat16 if native_bf16() else torch.float32

    def device_name(self, index: int = 0) -> str:
        """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
        try:
            with open("/proc/cpuinfo") as fh:
                for line in fh:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine()

    def dtype_notes(self) -> str:
        if native_bf16():
            return "bf16 native (AVX512-BF16/AMX): matmuls fast in bf16; fp32 exact"
        return "no native bf16: bf16 is emulated and slower than fp32 here; prefer fp32"

    def total_memory(self, index: int = 0) -> int:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def free_memory(self, index: int = 0) -> int:
        """MemAvailable from /proc/meminfo (free pages where that file does not exist)."""
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def release_cached_memory(self) -> None:
        """glibc's heap keeps freed tensors' chunks: see :func:`return_freed_memory`."""
        return_freed_memory()

    def peak_memory(self, index: int = 0) -> int:
        """Peak resident set size of this process in bytes (VmHWM since the last
        :meth:`reset_peak_memory`); the CPU has no device allocator to ask."""
        status = _proc_status()
        if "VmHWM" in status:
            return status["VmHWM"]
        import resource  # POSIX only; imported here so other systems can still import the plugin

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # ru_maxrss is KiB

    def reset_peak_memory(self, index: int = 0) -> None:
        """Reset VmHWM to the current RSS (Linux: writing 5 to /proc/self/clear_refs)."""
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:
            pass  # not Linux, or not permitted: the peak then covers the process lifetime

    def max_ranks_per_node(self) -> int:
        """Ranks on one node share its cores: at most one rank per usable core."""
        return usable_cores()

    def threads_per_rank(self, local_world_size: int) -> int:
        return max(1, usable_cores() // max(1, local_world_size))

    def launch_env(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """Split the cores so ``local_world_size`` ranks don't oversubscribe them."""
        return {"OMP_NUM_THREADS": str(self.threads_per_rank(local_world_size))}

    def configure_process(self, local_rank: int, local_world_size: int) -> None:
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(self.threads_per_rank(local_world_size))

    def graph_strategy(self) -> GraphStrategy:
        """:class:`CpuCompileStrategy`, chosen by ``SHARDWISE_CPU_GRAPHS`` (:data:`CPU_GRAPHS_ENV`):
        ``cpp``/``compile`` (default: weights shared with the model, laid out for the C++ GEMM
        template), ``frozen`` (the template on its own prepacked copy of the weights: a faster
        step for about the linear weights' bytes more memory and a slower start), ``onednn`` or
        ``inductor`` (frozen, prepacked copies), or ``eager`` for the documented no-op. Under tensor
        parallelism the step's all-reduces are compiled as the opaque op
        ``shardwise::cpu_all_reduce`` (see :class:`~shardwise.accelerators.cpu_comm.
        CpuCommunicator`), so every rank compiles and replays its own step."""
        choice = os.environ.get(CPU_GRAPHS_ENV, "").strip().lower() or "compile"
        if choice == "compile":
            choice = "cpp"
        if choice not in ("eager", "frozen", *LINEAR_PACKINGS):
            from shardwise.errors import ConfigError

            raise ConfigError(f"{CPU_GRAPHS_ENV}={choice!r}: expected compile (= cpp), "
                              f"{', '.join(LINEAR_PACKINGS)}, frozen or eager")
        if choice == "eager":
            return GraphStrategy()
        if choice == "frozen":  # the C++ template on its own prepacked copy: faster, 2x memory
            return CpuCompileStrategy(linear="cpp", freezing=True)
        return CpuCompileStrategy(linear=choice)

    def communicator_class(self):
        """gloo plus a shared-memory all_reduce for ranks on one node (small tensors, chosen
        automatically; ``SHARDWISE_CPU_SHM_ALLREDUCE=0`` disables it). See
        :mod:`shardwise.accelerators.cpu_comm`."""
        from shardwise.accelerators.cpu_comm import CpuCommunicator

        return CpuCommunicator

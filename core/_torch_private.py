"""Every private torch API shardwise uses, in one place, behind a version check.

Torch's underscore names (``torch._inductor``, ``torch._dynamo`` internals, ``torch._C``,
``aten._*`` and ``mkldnn._*`` ops, inductor's config keys) carry no compatibility promise: any
torch release may move, rename or drop them. The rest of the package calls the small named
functions below and never spells a private name itself, so a torch upgrade is checked (and, if
need be, fixed) here alone.

* :data:`CHECKED_TORCH` names the torch releases (major, minor; first and last, inclusive) these
  functions were checked against. Importing this module on another torch warns once per process
  (:class:`UntestedTorchWarning`, naming this module): the CPU decode-step graphs and the CPU
  quantized kernels may then fail or misbehave.
* A private name that this torch does not have is a :class:`TorchInternalsError` (naming it, the
  torch version and the way out) at the call that needs it, not an ``AttributeError`` deep in a
  capture.

Nothing here imports ``torch._inductor`` or ``torch._dynamo`` at import time (``import shardwise``
stays free of them); each function imports what it needs when called.

Users: :mod:`shardwise.accelerators.cpu_graphs` (the CPU graph strategy and its FX packing pass),
the CPU kernels' int8/int4 matrix products and the CPU attention with sinks (flash attention's
log-sum-exp).
"""

from __future__ import annotations

import functools
import importlib
import re
import sys
import warnings
from typing import Any, Callable, Sequence

import torch

from .errors import ShardwiseError

#: The torch releases (major, minor), first and last inclusive, whose private APIs this module
#: was checked against (2.13.0 installed when it was written).
CHECKED_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 13), (2, 13))


class UntestedTorchWarning(UserWarning):
    """The installed torch is outside :data:`CHECKED_TORCH` (warned once per process)."""


class TorchInternalsError(ShardwiseError, RuntimeError):
    """A private torch API shardwise needs is not in the installed torch."""


# ----- the version check --------------------------------------------------------------------------

def torch_version(text: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``text`` (default: ``torch.__version__``; ``"2.13.0+cpu"`` → (2, 13)).
    A version string without them (a source build's odd tag) gives (0, 0): outside any range."""
    m = re.match(r"\s*(\d+)\.(\d+)", str(torch.__version__ if text is None else text))
    return (int(m[1]), int(m[2])) if m else (0, 0)


def checked_range_text() -> str:
    first, last = CHECKED_TORCH
    if first == last:
        return f"torch {first[0]}.{first[1]}"
    return f"torch {first[0]}.{first[1]} to {last[0]}.{last[1]}"


def version_checked(text: str | None = None) -> bool:
    """Whether torch ``text`` (default: the installed one) is within :data:`CHECKED_TORCH`."""
    first, last = CHECKED_TORCH
    return first <= torch_version(text) <= last


_warned = False


def check_torch_version() -> bool:
    """Warn once per process (:class:`UntestedTorchWarning`) when the installed torch is outside
    :data:`CHECKED_TORCH`. Returns whether it is within. Run when this module is imported."""
    global _warned
    if version_checked():
        return True
    if not _warned:
        _warned = True
        warnings.warn(
            f"{__name__}: torch {torch.__version__} is outside the releases shardwise's use of "
            f"private torch APIs was checked against ({checked_range_text()}). The CPU "
            f"decode-step graphs (enable_graph=True on CPU) and the CPU int8/int4 kernels may "
            f"fail or misbehave: install {checked_range_text()}, or run the decode step eagerly "
            f"(SHARDWISE_CPU_GRAPHS=eager) if they do.", UntestedTorchWarning, stacklevel=2)
    return False


def _missing(what: str, exc: BaseException) -> TorchInternalsError:
    return TorchInternalsError(
        f"torch {torch.__version__} has no {what} ({type(exc).__name__}: {exc}); shardwise uses "
        f"it through {__name__}, checked against {checked_range_text()}. Install that torch, "
        f"or run the decode step eagerly (SHARDWISE_CPU_GRAPHS=eager, or enable_graph=False)")


def _lookup(module: str, name: str) -> Any:
    """``module.name`` (importing ``module``), or a :class:`TorchInternalsError` naming it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise _missing(f"{module}.{name}", exc) from exc


# ----- inductor: options and compilation ----------------------------------------------------------

#: inductor's config key naming the GEMM backends it may choose from (e.g. ``"CPP"``,
#: ``"CPP,ATEN"``)
GEMM_BACKENDS_OPTION = "max_autotune_gemm_backends"


def inductor_options(mode: str, *, freezing: bool, post_grad_pass: Callable | None = None,
                     gemm_backends: str | None = None) -> dict:
    """Inductor config patches for a compilation in ``mode`` (``torch.compile``'s mode names):
    ``freezing`` (parameters become constants), an optional custom post-grad pass over the FX
    graph (run before inductor's own), and the GEMM backends max-autotune picks from (None:
    inductor's choice)."""
    options = {**_lookup("torch._inductor", "list_mode_options")(mode), "freezing": freezing}
    if post_grad_pass is not None:
        options["post_grad_custom_pre_pass"] = post_grad_pass
    if gemm_backends is not None:
        options.update({"max_autotune_gemm": True, GEMM_BACKENDS_OPTION: gemm_backends})
    return options


def inductor_config_patch(options: dict):
    """A context manager with inductor's config patched by ``options`` (set back afterwards)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(options)


def compile_fx(gm: torch.fx.GraphModule, example_inputs: Sequence, options: dict) -> Callable:
    """Inductor's compiler as a ``torch.compile`` backend body, with ``options`` patched in."""
    return _lookup("torch._inductor.compile_fx", "compile_fx")(gm, example_inputs,
                                                               config_patches=options)


@functools.cache
def inductor_default_cache_dir() -> str:
    """The cache folder inductor uses when ``TORCHINDUCTOR_CACHE_DIR`` is not set (asked once
    per process: it looks the user up in the password database, and the CPU decode step's
    scope asks on every replay)."""
    return _lookup("torch._inductor.runtime.cache_dir_utils", "default_cache_dir")()


def no_valid_gemm_choice(exc: BaseException) -> bool:
    """Whether ``exc`` is inductor's "no GEMM backend could take this product" failure
    (``NoValidChoicesError``, which reaches the caller wrapped, so it is matched by name)."""
    return "NoValidChoicesError" in str(exc)


def is_graph_break_error(exc: BaseException) -> bool:
    """Whether ``exc`` is dynamo refusing to trace the code into one graph (a graph break under
    ``fullgraph=True``, or code it does not support)."""
    dynamo_exc = sys.modules.get("torch._dynamo.exc")
    if dynamo_exc is None:  # dynamo never ran: the error cannot be one of its
        return False
    kinds = tuple(k for k in (getattr(dynamo_exc, "Unsupported", None),
                              getattr(dynamo_exc, "UserError", None)) if k is not None)
    return bool(kinds) and isinstance(exc, kinds)


def causes(exc: BaseException, limit: int = 16) -> list[BaseException]:
    """``exc`` and what it wraps, outermost first: the exception a compiler backend raised
    (``BackendCompilerFailed.inner_exception``), then each ``__cause__`` (else ``__context__``)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(chain) < limit and all(current is not c for c in chain):
        chain.append(current)
        inner = getattr(current, "inner_exception", None)
        current = inner if isinstance(inner, BaseException) else (
            current.__cause__ or current.__context__)
    return chain


def is_cxx_build_error(exc: BaseException) -> bool:
    """Whether ``exc`` is, or wraps, inductor failing to build C++: no usable compiler
    (``InvalidCxxCompiler``) or a failed build (``CppCompileError``)."""
    inductor_exc = sys.modules.get("torch._inductor.exc")
    if inductor_exc is None:  # inductor never ran: it cannot have failed a build
        return False
    kinds = tuple(k for k in (getattr(inductor_exc, "InvalidCxxCompiler", None),
                              getattr(inductor_exc, "CppCompileError", None)) if k is not None)
    return bool(kinds) and any(isinstance(e, kinds) for e in causes(exc))


# ----- ahead-of-time compiled functions (dynamo's precompile: saved, loaded without tracing) ---

def aot_compile(fn: Callable, backend: Callable, example_args: Sequence[torch.Tensor]) -> Any:
    """``fn`` traced by dynamo (one graph, static shapes) and compiled by ``backend`` for
    ``example_args``, as a callable that can be saved (:func:`save_aot_compiled`) and loaded by a
    later process without tracing again (:func:`load_aot_compiled`): torch's
    ``torch.compile(...).aot_compile``. Calling it checks dynamo's guards (the tensors ``fn``
    reads keep the shapes, dtypes and strides they were traced with) and raises if one fails;
    nothing is installed on ``fn``'s code (no dynamo cache entry)."""
    compiled = torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)
    aot = getattr(compiled, "aot_compile", None)
    if aot is None:
        raise _missing("torch.compile(...).aot_compile", AttributeError("aot_compile"))
    return aot((tuple(example_args), {}))


def save_aot_compiled(compiled: Any, path: str, external: dict[str, Any]) -> None:
    """Write ``compiled`` (of :func:`aot_compile`) to ``path`` (atomically); ``external`` names
    the objects its closure holds that are not saved but handed over again at load (modules,
    caches: keyed by name)."""
    compiled.save_compiled_function(path, external_data=external)


def load_aot_compiled(path: str, external: dict[str, Any], f_globals: dict[str, Any]) -> Any:
    """The function :func:`save_aot_compiled` wrote to ``path``, bound to this process's
    ``external`` objects (the same names) and ``f_globals`` (the traced function's module
    globals); raises when the file is not one this torch and Python can load."""
    load = _lookup("torch.compiler", "load_compiled_function")
    with open(path, "rb") as f:
        return load(f, f_globals=f_globals, external_data=external)


def aot_guards_hold(compiled: Any, *args: Any) -> bool:
    """Whether dynamo's guards of ``compiled`` (of :func:`aot_compile`) hold for ``args`` (and
    the objects its closure reads)."""
    return bool(compiled.guard_check(*args))


def aot_skip_guards(compiled: Any) -> bool:
    """Stop checking dynamo's guards when ``compiled`` (of :func:`aot_compile` or
    :func:`load_aot_compiled`) is called (``AOTCompiledFunction.disable_guard_check``); False
    when this torch's compiled function has no such switch (its guards stay on)."""
    disable = getattr(compiled, "disable_guard_check", None)
    if disable is None:
        return False
    disable()
    return True


def skip_guard_evaluation():
    """A context manager under which dynamo runs a compiled function's only cache entry without
    evaluating its guards (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``)."""
    return _lookup("torch.compiler", "set_stance")("default", skip_guard_eval_unsafe=True)


def aot_traced_modules(compiled: Any) -> list[str]:
    """The Python modules whose code dynamo traced into ``compiled`` (sorted names)."""
    return sorted({s.module for s in compiled.source_info().inlined_sources})


def skip_vec_isa_probe():
    """A context manager telling inductor that every SIMD ISA this CPU reports works with the
    C++ compiler (``cpp.vec_isa_ok``) instead of probing each with a build and a child process
    (about 0.5 s each, once per process). Only for a process where an earlier one's probe on the
    same CPU, compiler and torch found them all working (:func:`vec_isa_probed` equal to
    :func:`vec_isa_candidates`)."""
    return inductor_config_patch({"cpp.vec_isa_ok": True})


def probe_vec_isa_concurrently() -> str:
    """Inductor's SIMD ISA for this CPU's C++ kernels (its ``pick_vec_isa``), with the probe of
    each candidate ISA the CPU reports (a C++ build and a child process that loads it, 0.4-2 s
    each) run on a thread of its own: inductor checks them one after another (5-7 s on a first
    start on 2 cores). Each result is cached by inductor for the process's life, as its own
    probe caches it; the builds go to inductor's cache folder of the moment. The candidates
    are filtered here by the CPU's flags as inductor's list does: :func:`vec_isa_candidates`
    lists them under ``cpp.vec_isa_ok``, which would cache a "works" for the avx512 ISAs
    (their ``__bool__`` caches without the setting) before they were ever built."""
    import threading

    module = importlib.import_module("torch._inductor.cpu_vec_isa")
    try:
        flags = set(module.x86_isa_checker())
        isas = [isa for isa in module.supported_vec_isa_list
                if all(flag in flags for flag in str(isa).split())]
    except AttributeError as exc:
        raise _missing("torch._inductor.cpu_vec_isa's ISA list", exc) from exc
    threads = [threading.Thread(target=bool, args=(isa,), daemon=True) for isa in isas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return str(module.pick_vec_isa())


def _valid_vec_isa_list():
    return _lookup("torch._inductor.cpu_vec_isa", "valid_vec_isa_list")


def vec_isa_probed() -> list[str] | None:
    """The SIMD ISAs inductor's probe found usable in this process, or None if it has not
    probed yet (nothing is probed here)."""
    probe = _valid_vec_isa_list()
    if probe.cache_info().currsize == 0:
        return None
    return [str(isa) for isa in probe()]


def vec_isa_candidates() -> list[str]:
    """The SIMD ISAs inductor would try on this CPU (its list filtered by the CPU's flags),
    without probing them."""
    with skip_vec_isa_probe():
        return [str(isa) for isa in _valid_vec_isa_list().__wrapped__()]


def cpu_isa_flags() -> list[str]:
    """The SIMD ISAs this CPU reports (inductor's x86 check; no probe build), sorted."""
    try:
        checker = _lookup("torch._inductor.cpu_vec_isa", "x86_isa_checker")
    except TorchInternalsError:
        return []
    return sorted(checker())


# ----- inductor's generated modules and dynamo's per-code caches ----------------------------------

def _py_code_cache():
    return _lookup("torch._inductor.codecache", "PyCodeCache")


def inductor_module_count() -> int:
    """How many generated Python modules inductor has loaded so far in this process (a mark:
    :func:`inductor_modules_since` gives the ones loaded after it)."""
    return len(_py_code_cache().modules)


def inductor_modules_since(mark: int) -> list:
    """The generated modules inductor loaded since :func:`inductor_module_count` returned
    ``mark``."""
    return list(_py_code_cache().modules[mark:])


def forget_compiled(code, modules: Sequence) -> None:
    """Free what dynamo and inductor keep of a compiled function: dynamo's cache entries on its
    ``code`` object (compiled graph, guards, cleanup hooks) and inductor's generated ``modules``
    (kept in its module cache and ``sys.modules``, with the constants bound in their globals,
    for the process's life otherwise). Files on disk stay (inductor's cache)."""
    if code is not None:  # None: nothing was installed on a code object (a precompiled step)
        _lookup("torch._dynamo.eval_frame", "reset_code")(code)
    cache = _py_code_cache()
    ids = {id(m) for m in modules}
    cache.modules[:] = [m for m in cache.modules if id(m) not in ids]
    for mod in modules:
        if sys.modules.get(mod.__name__) is mod:
            del sys.modules[mod.__name__]


# ----- MKL and oneDNN (mkldnn) ops of the frozen-graph packing pass -------------------------------

def mkl_linear_targets() -> tuple:
    """The FX targets of inductor's MKL-packed fp32 linear (``mkl._mkl_linear``, the packet and
    its default overload; args ``(x, packed, weight [out, in], bias, rows)``), or () when torch
    was built without MKL."""
    if not torch._C.has_mkl:
        return ()
    op = torch.ops.mkl._mkl_linear
    return (op, op.default)


def mkldnn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN computes ``dtype`` matrix products on this CPU (fp32 always)."""
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return _lookup("torch._inductor.utils", "is_mkldnn_bf16_supported")("cpu")
    if dtype == torch.float16:
        return _lookup("torch._inductor.utils", "is_mkldnn_fp16_supported")("cpu")
    return False


def mkldnn_pack_linear_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` [out, in] reordered once into oneDNN's layout for products of ``rows`` rows
    (an opaque tensor for :func:`mkldnn_linear_target`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def mkldnn_linear_target():
    """The FX target of oneDNN's linear on a packed weight: args ``(x [M, in], packed, bias,
    "none", [], "")`` → [M, out]."""
    return torch.ops.mkldnn._linear_pointwise.default


# ----- ATen's packed int8 / int4 matrix products on CPU -------------------------------------------

_ATEN = torch.ops.aten


def has_int8_mm() -> bool:
    """Whether this torch has ``aten._weight_int8pack_mm``."""
    return hasattr(_ATEN, "_weight_int8pack_mm")


def has_int4_mm() -> bool:
    """Whether this torch has the CPU int4 pair (``aten._convert_weight_to_int4pack_for_cpu``
    and ``aten._weight_int4pack_mm_for_cpu``)."""
    return (hasattr(_ATEN, "_weight_int4pack_mm_for_cpu")
            and hasattr(_ATEN, "_convert_weight_to_int4pack_for_cpu"))


def int8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q int8 [N, K] * scales [N] per row)ᵀ → [M, N]
    (``aten._weight_int8pack_mm``)."""
    return _ATEN._weight_int8pack_mm(x, q, scales)


def int4_pack(u: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """int32 [N, K] of values 0..15 → uint8, ATen's opaque CPU int4 layout
    (``aten._convert_weight_to_int4pack_for_cpu``)."""
    return _ATEN._convert_weight_to_int4pack_for_cpu(u, inner_k_tiles)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, group: int,
            scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ the int4 weight of :func:`int4_pack` (groups of ``group`` along K, scale and
    zero point per group and row) → [M, N] (``aten._weight_int4pack_mm_for_cpu``)."""
    return _ATEN._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)


# ----- ATen's CPU flash attention with its log-sum-exp --------------------------------------------

def sdpa_cpu_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      bias: torch.Tensor | None, scale: float | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """ATen's CPU flash attention (the kernel ``F.scaled_dot_product_attention`` runs on CPU)
    with each row's log-sum-exp: q [b, h, L, d], k and v [b, h, n, d] (the same heads), ``bias``
    an additive float mask broadcastable to [b, h, L, n] or None → (out [b, h, L, d] in q's
    dtype, lse [b, h, L] float32: the natural log of the sum of exp of the scaled, biased
    scores) (``aten._scaled_dot_product_flash_attention_for_cpu``; attention sinks need the
    lse)."""
    try:
        op = _ATEN._scaled_dot_product_flash_attention_for_cpu
    except AttributeError as exc:
        raise _missing("aten._scaled_dot_product_flash_attention_for_cpu", exc) from exc
    return op(q, k, v, 0.0, False, attn_mask=bias, scale=scale)


check_torch_version()

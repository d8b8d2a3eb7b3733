"""The CPU decode step compiled ahead of time and kept per user, so a later start skips dynamo's
tracing and AOT-autograd (8-13 s for a 30-layer step) as well as inductor's C++ build.

:class:`CpuCompileStrategy <shardwise.accelerators.cpu_graphs.CpuCompileStrategy>` compiles a
step with torch's precompile (``torch.compile(...).aot_compile``: one dynamo trace, one inductor
compilation) and writes the result to :func:`precompiled_folder` (``<cache root>/cpu-steps``,
private to the user) under a key (:func:`step_key`) of everything the compiled code depends on
that dynamo's own guards do not check:

* the software: torch, Python, transformers and shardwise versions, and every Python module
  the trace went through: its source and its global functions' code and scalars (checked again
  at load, from the artifact's side file: an edited or monkeypatched module is a new step);
* the machine: the CPU's SIMD flags and ATen's CPU capability;
* the compilation: the strategy's inductor options (mode, freezing, GEMM backends);
* the step: its code, the shapes and dtypes of its example inputs, and a structural description
  of everything its closure reaches (module types and their non-tensor attributes: model
  config, head counts, eps, quantization bits and group sizes, kernel choices; every tensor's
  shape, dtype, stride and device).

Weight *values* are not in the key: with the default unfrozen strategy the weights are graph
inputs, read where they are on every call (a frozen strategy bakes them in, so it is never
precompiled). Dynamo's guards, saved with the artifact, check again at load that every tensor
the step reads still has the traced shape, dtype and stride; an artifact whose key, sources or
guards do not match is never used (the step is compiled again and the artifact replaced).

``SHARDWISE_CPU_PRECOMPILE=0`` turns this off (the step is compiled with ``torch.compile`` on
every start, served by inductor's FX-graph cache where it can).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import platform
import shutil
import sys
import threading
import types
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from shardwise import _torch_private as private
from shardwise.graphs import cache_dir

log = logging.getLogger(__name__)

#: ``0``/``off``/``false``/``no`` turns the precompiled CPU step off (see the module docstring).
PRECOMPILE_ENV = "SHARDWISE_CPU_PRECOMPILE"
#: Bump when what this module writes changes incompatibly.
FORMAT = 2
#: How deep :func:`describe` follows attributes (a model's tensors sit about 6 deep, its
#: config and kernels' settings deeper along some paths).
_MAX_DEPTH = 24


def enabled() -> bool:
    """Whether precompiled steps are used (:data:`PRECOMPILE_ENV` not set to off)."""
    return os.environ.get(PRECOMPILE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def precompiled_folder() -> Path:
    """Where precompiled steps are kept: ``<shardwise cache root>/cpu-steps`` (created, mode
    0700; see :func:`shardwise.graphs.cache_dir`)."""
    return cache_dir("cpu-steps")


# ----- the key ------------------------------------------------------------------------------------

def _tensor_text(t: torch.Tensor) -> str:
    return (f"T{tuple(t.shape)}{tuple(t.stride())}{t.dtype}{t.device.type}"
            f"{int(t.requires_grad)}{int(t.is_inference())}")


def _code_text(code: types.CodeType) -> str:
    """A code object's behaviour: its bytecode, constants (nested code too) and names."""
    consts = tuple(_code_text(c) if isinstance(c, types.CodeType) else repr(c)
                   for c in code.co_consts)
    return f"C{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}" \
           f"{code.co_code.hex()}{consts}{code.co_names}{code.co_freevars}"


def _thread_idents() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def _opaque_types() -> tuple[type, ...]:
    """Objects described by their type alone: the graph machinery (a strategy's counters, the
    graphs already captured) is reachable from a step's modules but is not what it computes.
    A class may say so itself with a true ``describe_opaque`` class attribute (e.g. the undo
    bookkeeping of fused projections: storage addresses, the ledger)."""
    from shardwise.accelerator import GraphStrategy
    from shardwise.graphs import StaticGraph

    return (GraphStrategy, StaticGraph)


_SCALARS = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device,
            torch.Size)


#: a Hugging Face config's fields that record where and how it was saved, not the model: a model
#: handed in and the same model loaded from its checkpoint differ in them (``model_type`` is the
#: class's own, copied onto a loaded instance; a model read from a GGUF file carries its
#: ``GgufConfig`` object and ``_is_quantized``, the same model reloaded from shardwise's
#: checkpoint a dict of it: how the weights were read, while the modules and tensors the step
#: runs are described themselves)
_CONFIG_PROVENANCE = frozenset({"transformers_version", "_name_or_path", "_commit_hash",
                                "architectures", "model_type", "quantization_config",
                                "_is_quantized"})


def _is_hf_config(obj: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(obj, PretrainedConfig)


def describe(obj: Any, depth: int = 0, seen: dict[int, tuple[int, Any]] | None = None,
             out: list[str] | None = None) -> list[str]:
    """A structural description of ``obj`` and everything it reaches, as text (deterministic
    across processes: no addresses, no tensor values): scalars by value, tensors by shape,
    stride, dtype and device, functions by their code, objects by type and attributes
    (``vars``), containers by their items. An object met again is named by when it was first
    met (so a tied weight differs from two equal ones)."""
    seen = {} if seen is None else seen
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(_tensor_text(obj))
        return out
    if type(obj) is int and obj in _thread_idents():  # which thread holds a lock: not the step
        out.append("<thread>")
        return out
    if isinstance(obj, _SCALARS):
        out.append(repr(obj))
        return out
    if id(obj) in seen:
        out.append(f"@{seen[id(obj)][0]}")
        return out
    if depth >= _MAX_DEPTH or isinstance(obj, (types.ModuleType, *_opaque_types())) or getattr(
            type(obj), "describe_opaque", False):
        # not marked as seen: met again nearer the root, it is described in full there
        out.append(f"<{type(obj).__qualname__}:{getattr(obj, '__name__', '')}>")
        return out
    seen[id(obj)] = (len(seen), obj)  # the object kept alive: a freed one's id is reused
    if isinstance(obj, types.CodeType):
        out.append(_code_text(obj))
        return out
    if isinstance(obj, types.MethodType):
        out.append("M")
        describe(obj.__func__, depth + 1, seen, out)
        describe(obj.__self__, depth + 1, seen, out)
        return out
    if isinstance(obj, types.FunctionType):
        out.append(f"F{obj.__module__}.{obj.__qualname__}")
        describe(obj.__code__, depth + 1, seen, out)
        describe(obj.__defaults__, depth + 1, seen, out)
        cells = obj.__closure__ or ()
        for name, cell in zip(obj.__code__.co_freevars, cells):
            out.append(name)
            try:
                describe(cell.cell_contents, depth + 1, seen, out)
            except ValueError:  # an empty cell
                out.append("<empty>")
        return out
    if isinstance(obj, functools.partial):  # its function and bound arguments are slots
        out.append("P")
        describe((obj.func, obj.args, obj.keywords), depth + 1, seen, out)
        return out
    if isinstance(obj, (list, tuple)):
        out.append(f"{type(obj).__name__}[{len(obj)}")
        for item in obj:
            describe(item, depth + 1, seen, out)
        out.append("]")
        return out
    if isinstance(obj, (set, frozenset)):
        out.append(f"set{sorted(repr(x) for x in obj)}")
        return out
    if isinstance(obj, dict):
        out.append(f"{{{len(obj)}")
        for key, value in obj.items():
            out.append(repr(key) if isinstance(key, _SCALARS) else type(key).__qualname__)
            describe(value, depth + 1, seen, out)
        out.append("}")
        return out
    kind = type(obj)
    out.append(f"<{kind.__module__}.{kind.__qualname__}")
    state = getattr(obj, "__dict__", None)
    if state is None:  # builtins, slotted objects: their slots, else the type alone
        for slot in getattr(kind, "__slots__", ()):
            if hasattr(obj, slot):
                out.append(slot)
                describe(getattr(obj, slot), depth + 1, seen, out)
    else:
        if isinstance(obj, torch.nn.Module):  # hooks are keyed by a process-wide counter
            state = {k: list(v.values()) if "hook" in k and isinstance(v, dict) else v
                     for k, v in state.items()}
        elif _is_hf_config(obj):  # where it was read from is not what the step computes,
            # nor the order its fields were set in (a loaded config sets them in another)
            state = {k: v for k, v in sorted(state.items()) if k not in _CONFIG_PROVENANCE}
        describe(state, depth + 1, seen, out)
    out.append(">")
    return out


def _software() -> dict[str, str]:
    import transformers

    import shardwise

    return {"torch": torch.__version__, "python": platform.python_version(),
            "transformers": transformers.__version__,
            "shardwise": getattr(shardwise, "__version__", "?"), "format": str(FORMAT)}


def _machine() -> dict[str, str]:
    return {"machine": platform.machine(), "isa": ",".join(private.cpu_isa_flags()),
            "capability": str(torch.backends.cpu.get_cpu_capability()),
            "compiler": os.environ.get("CXX", "")}


def step_key(fn: Callable, example_args: Sequence[torch.Tensor], options: dict) -> str:
    """The key of a compiled ``fn`` (see the module docstring): a SHA-256, hex."""
    from shardwise.kernels.cpu import native  # its ops are constants of a compiled step

    parts = {"software": _software(), "machine": _machine(), "native": native.key_text(),
             "options": sorted((k, repr(v)) for k, v in options.items()),
             "args": [_tensor_text(a) for a in example_args],
             "step": describe(fn)}
    return hashlib.sha256(json.dumps(parts, default=repr).encode()).hexdigest()


# ----- inductor's SIMD probe, remembered ----------------------------------------------------------

def _compiler_text() -> str:
    """The C++ compilers inductor may run (``$CXX``, ``g++``, ``c++``): path, size, mtime."""
    found = []
    for name in (os.environ.get("CXX", ""), "g++", "c++"):
        path = shutil.which(name) if name else None
        if path:
            stat = os.stat(path)
            found.append(f"{name}={os.path.realpath(path)}:{stat.st_size}:{int(stat.st_mtime)}")
    return ";".join(found)


def _isa_record(folder: Path) -> Path:
    text = json.dumps([_software(), _machine(), _compiler_text()])
    return folder / f"vec-isa-{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


def note_vec_isa(folder: Path) -> None:
    """After inductor probed the CPU's SIMD ISAs in this process (a compilation): remember
    whether every one the CPU reports worked, for this torch, CPU and compiler, so a later
    start that only loads precompiled steps can skip the probe (:func:`known_vec_isa`)."""
    record = _isa_record(folder)
    probed = private.vec_isa_probed()
    if probed is None or record.exists():
        return
    candidates = private.vec_isa_candidates()
    tmp = record.with_suffix(f".json.{os.getpid()}")
    tmp.write_text(json.dumps({"probed": probed, "candidates": candidates,
                               "all_ok": probed == candidates}))
    os.chmod(tmp, 0o600)
    os.replace(tmp, record)


def known_vec_isa(folder: Path):
    """A context manager: inductor's SIMD probe skipped when an earlier start on this torch,
    CPU and compiler found every ISA the CPU reports working (:func:`note_vec_isa`), else
    nothing changed."""
    return private.skip_vec_isa_probe() if vec_isa_known(folder) else contextlib.nullcontext()


def vec_isa_known(folder: Path) -> bool:
    """Whether an earlier start on this torch, CPU and compiler recorded in ``folder`` that
    every SIMD ISA the CPU reports works (:func:`note_vec_isa`)."""
    try:
        return json.loads(_isa_record(folder).read_text()).get("all_ok") is True
    except (OSError, ValueError):
        return False


# ----- the traced sources, checked at load --------------------------------------------------------

def _globals_text(module: types.ModuleType) -> list[str]:
    """What of ``module``'s globals a trace may have baked in: its functions by their code (a
    function replaced at run time, e.g. monkeypatched, reads differently), its classes by name,
    its scalars by value. Torch's own modules are covered by the torch version instead."""
    if module.__name__.split(".")[0] == "torch":
        return []
    out = []
    for name, value in sorted(vars(module).items()):
        if isinstance(value, types.FunctionType):
            out.append(f"{name}={value.__module__}.{_code_text(value.__code__)}")
        elif isinstance(value, type):
            out.append(f"{name}={value.__module__}.{value.__qualname__}")
        elif isinstance(value, _SCALARS) and not name.startswith("__"):
            out.append(f"{name}={value!r}")
    return out


def _module_digest(name: str) -> str | None:
    """SHA-256 of module ``name`` as this process has it (its source, and its globals: see
    :func:`_globals_text`), or None if unreadable."""
    module = sys.modules.get(name)
    if module is None:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that no longer imports: a stale artifact
            return None
    try:
        text = "\n".join([inspect.getsource(module), *_globals_text(module)])
    except (OSError, TypeError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _sources(modules: Sequence[str]) -> dict[str, str | None]:
    return {name: _module_digest(name) for name in modules}


# ----- saving and loading -------------------------------------------------------------------------

def closure_objects(fn: Callable) -> dict[str, Any]:
    """What ``fn``'s closure holds, by variable name: handed to the saved function again at
    load instead of being saved with it (modules, the static cache)."""
    cells = getattr(fn, "__closure__", None) or ()
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, cells)}


class PrecompiledSteps:
    """The per-user store of precompiled steps: ``<key>.bin`` (torch's saved compiled function)
    and ``<key>.json`` (what it was made from, and the digest of every module it traced)."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else precompiled_folder()

    def paths(self, key: str) -> tuple[Path, Path]:
        return self.folder / f"{key}.bin", self.folder / f"{key}.json"

    def load(self, key: str, fn: Callable, args: Sequence[torch.Tensor]) -> Any | None:
        """The step saved under ``key``, bound to ``fn``'s closure objects, or None when there
        is none or it must not be used (a traced module changed, torch cannot load it, or its
        guards fail on ``args``: each logged with the reason)."""
        binary, meta = self.paths(key)
        if not (binary.is_file() and meta.is_file()):
            return None
        try:
            recorded = json.loads(meta.read_text())
        except (OSError, ValueError) as exc:
            log.info("shardwise: precompiled CPU step %s unreadable (%s): compiling", key[:12],
                     exc)
            return None
        changed = [name for name, digest in recorded.get("sources", {}).items()
                   if _module_digest(name) != digest]
        if changed:
            log.info("shardwise: precompiled CPU step %s is stale (%s changed since): "
                     "compiling again", key[:12], ", ".join(changed[:3]))
            return None
        try:
            with known_vec_isa(self.folder):
                compiled = private.load_aot_compiled(str(binary), closure_objects(fn),
                                                     fn.__globals__)
            if not private.aot_guards_hold(compiled, *args):
                log.info("shardwise: precompiled CPU step %s: its guards fail here: "
                         "compiling again", key[:12])
                return None
        except Exception as exc:  # noqa: BLE001 - any failure to load: compile instead
            log.warning("shardwise: precompiled CPU step %s could not be loaded (%s: %s): "
                        "compiling again", key[:12], type(exc).__name__, exc)
            return None
        return compiled

    def save(self, key: str, compiled: Any, fn: Callable, about: dict) -> bool:
        """Write ``compiled`` under ``key`` (the side file last, so a reader never sees a side
        file without its binary). A failure is logged (the step still runs: only the next
        start compiles again); returns whether it was written."""
        binary, meta = self.paths(key)
        try:
            note_vec_isa(self.folder)
            private.save_aot_compiled(compiled, str(binary), closure_objects(fn))
            record = {**about, "key": key,
                      "sources": _sources(private.aot_traced_modules(compiled))}
            tmp = meta.with_suffix(f".json.{os.getpid()}")
            tmp.write_text(json.dumps(record, indent=1))
            os.chmod(tmp, 0o600)
            os.replace(tmp, meta)
        except Exception as exc:  # noqa: BLE001 - not saved: the next start compiles again
            log.warning("shardwise: the compiled CPU step could not be saved for later starts "
                        "(%s: %s); it will be compiled again next time", type(exc).__name__,
                        exc)
            for path in (binary, meta):
                path.unlink(missing_ok=True)
            return False
        return True

"""The HPU accelerator: Intel Gaudi through the Intel Gaudi PyTorch bridge (``habana_frameworks.torch``).

The bridge is imported only by :meth:`HpuAccelerator.availability` and later calls, never at
import of this module. Every rule below follows the bridge's public sources
(HabanaAI/gaudi-pytorch-bridge, ``python_packages/habana_frameworks/torch/``, read at commit
5a56187e) and the projects that run on it (DeepSpeed's ``accelerator/hpu_accelerator.py``, upstream
and the HabanaAI fork; vllm-gaudi's ``vllm_gaudi/platform.py``; optimum-habana's
``examples/text-generation/utils.py``); each rule names its file. The test stand-in
(tests/fake_habana/) mirrors the same files. docs/gaudi.md is the user's guide.

* **One device per process.** The bridge drives one Gaudi per process: importing
  ``distributed/hccl/__init__.py`` maps ``LOCAL_RANK`` to a module (``HLS_MODULE_ID``) through
  ``HABANA_VISIBLE_MODULES`` and the process acquires that module. Tensors go to
  ``torch.device("hpu")`` (DeepSpeed's HabanaAI-fork accelerator ignores the index; vllm-gaudi and
  optimum-habana use ``torch.device("hpu")``); nothing calls ``set_device``.
* **Every rank starts.** ``HABANA_VISIBLE_MODULES`` is the node's list and stays as the user set
  it (or unset): narrowing it to one module per rank makes hccl's ``assert local_rank <
  len(list)`` fail on every rank but 0 (DeepSpeed's fork opts out of narrowing for this reason,
  ``visible_devices_envs``). A list shorter than the ranks per node is
  :class:`VisibleModulesError` before any rank starts.
* **Lazy or eager, as the runtime says.** Lazy is ``PT_HPU_LAZY_MODE`` anything but "0"
  (``utils/internal.py: is_lazy``), else what the runtime reports. HPU graphs exist only in lazy
  mode (``hpu/__init__.py``: ``if is_lazy(): from .graphs import *``); in eager mode the step is
  compiled by ``torch.compile(backend="hpu_backend")`` (``dynamo/compile_backend/backends.py``).
* **Collectives.** The bridge picks its process group when hccl is imported
  (``distributed/hccl/__init__.py``): with several ranks in lazy mode,
  ``PT_HPU_ENABLE_LAZY_COLLECTIVES=true`` must be set before that import or an HPU graph holding
  an all-reduce asserts in ``ProcessGroupHCCL.cpp`` (vllm-gaudi's ``set_torch_compile`` and
  optimum-habana set it too). The process group marks the step itself: no ``mark_step()`` before a
  collective.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from typing import Any, Callable

import torch

from shardwise.accelerator import Accelerator, Availability, DeviceDtypes, GraphStrategy
from shardwise.errors import ConfigError, UnsupportedDtypeError
from shardwise.graphs import StaticGraph, fresh_code, static_copies, static_outputs

log = logging.getLogger(__name__)

LAZY_MODE_ENV = "PT_HPU_LAZY_MODE"
#: Read by ``distributed/hccl/__init__.py`` at import: the lazy-collectives process group.
LAZY_COLLECTIVES_ENV = "PT_HPU_ENABLE_LAZY_COLLECTIVES"
#: The node's Gaudi modules (``hpu/_utils.py: HABANA_VISIBLE_MODULES_VAR``).
VISIBLE_MODULES_ENV = "HABANA_VISIBLE_MODULES"
#: The module this process drives, set by hccl from LOCAL_RANK (``hpu/_utils.py``).
MODULE_ID_ENV = "HLS_MODULE_ID"
#: Set where unset at start-up, as DeepSpeed's HabanaAI-fork accelerator does
#: (``apply_hpu_workarounds``); the bridge's C++ still reads both (its device set-up reads
#: ``PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES``, its start-up report lists ``PT_HPU_LAZY_ACC_PAR_MODE``).
STARTUP_DEFAULTS = {"PT_HPU_LAZY_ACC_PAR_MODE": "0", "PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES": "0"}
#: The dynamo backend the bridge registers (``dynamo/compile_backend/backends.py``).
COMPILE_BACKEND = "hpu_backend"
#: The module whose import registers :data:`COMPILE_BACKEND` where importing the bridge did not.
_COMPILE_BACKEND_MODULE = "habana_frameworks.torch.dynamo.compile_backend.backends"
_INSTALL_HINT = "install the Gaudi software stack / habana-torch-plugin"


class VisibleModulesError(ConfigError):
    """``HABANA_VISIBLE_MODULES`` lists fewer Gaudi modules than there are ranks on the node."""


class HpuGraphUnavailableError(ConfigError):
    """``enable_graph`` in a mode where the bridge has neither HPU graphs nor ``hpu_backend``."""


def _hthpu():
    """``habana_frameworks.torch.hpu`` (imports the Gaudi runtime on first call)."""
    return importlib.import_module("habana_frameworks.torch.hpu")


def _htcore():
    """``habana_frameworks.torch.core``: ``mark_step()`` lives here."""
    return importlib.import_module("habana_frameworks.torch.core")


def lazy_mode() -> bool:
    """True when the Gaudi bridge runs in lazy mode.

    ``$PT_HPU_LAZY_MODE``, when set, decides as the bridge does: anything but "0" is lazy
    (``utils/internal.py: is_lazy``). Unset, the runtime is asked (recent releases default to
    eager); if no runtime can say, lazy is assumed (a needless ``mark_step()`` in eager mode is a
    no-op, a missing one in lazy mode is a bug).
    """
    value = os.environ.get(LAZY_MODE_ENV)
    if value is not None:
        return value.strip() != "0"
    try:
        return bool(importlib.import_module("habana_frameworks.torch.utils.internal").is_lazy())
    except (ImportError, AttributeError):
        return True


def eager_by_env() -> bool:
    """True when ``PT_HPU_LAZY_MODE=0`` says eager without asking (importing) the bridge."""
    return os.environ.get(LAZY_MODE_ENV, "").strip() == "0"


def mark_step_if_lazy() -> None:
    """Run the ops accumulated so far (``htcore.mark_step()``) when in lazy mode."""
    if lazy_mode():
        _htcore().mark_step()


def fp16_supported() -> bool:
    """True on Gaudi2 and newer; Gaudi1 has no fp16 (``utils/experimental``
    ``_is_fp16_supported``, as DeepSpeed's accelerator asks). Assumed True if it cannot say."""
    try:
        experimental = importlib.import_module("habana_frameworks.torch.utils.experimental")
        return bool(experimental._is_fp16_supported())
    except (ImportError, AttributeError):
        return True


def _hpu_can_run(dtype: torch.dtype) -> bool:
    # Probe only where a runtime is installed; otherwise report what the device kind can run.
    if dtype is torch.float16 and importlib.util.find_spec("habana_frameworks") is not None:
        return fp16_supported()
    return True


def check_lazy_mode_env() -> None:
    """Refuse a ``PT_HPU_LAZY_MODE`` that is not a whole number: the bridge's hccl reads it with
    ``int()`` at import (``distributed/hccl/__init__.py``) and would fail there."""
    value = os.environ.get(LAZY_MODE_ENV)
    if value is not None and not value.strip().lstrip("-").isdigit():
        raise ConfigError(f"{LAZY_MODE_ENV}={value!r}: the Gaudi bridge reads it as a number; "
                          f"set 1 (lazy mode) or 0 (eager mode), or unset it")


def visible_modules() -> list[str] | None:
    """The node's modules as ``HABANA_VISIBLE_MODULES`` lists them, or None when unset."""
    value = os.environ.get(VISIBLE_MODULES_ENV)
    if value is None:
        return None
    return [m.strip() for m in value.split(",") if m.strip()]


def check_visible_modules(local_world_size: int) -> None:
    """Refuse a ``HABANA_VISIBLE_MODULES`` list shorter than the ranks per node, which the
    bridge's hccl import would meet with ``assert local_rank < len(list)`` on the later ranks."""
    modules = visible_modules()
    if modules is not None and len(modules) < local_world_size:
        raise VisibleModulesError(
            f"{local_world_size} ranks per node need one Gaudi module each, but "
            f"{VISIBLE_MODULES_ENV}={os.environ[VISIBLE_MODULES_ENV]!r} lists {len(modules)}: "
            f"list at least {local_world_size} modules (the node's list; each rank takes the "
            f"entry at its LOCAL_RANK), unset it, or launch fewer ranks per node")


def _world_size(local_world_size: int) -> int:
    """The world size: ``$WORLD_SIZE`` in a rank, else at least this node's ranks."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "0")), local_world_size)
    except ValueError:
        return local_world_size


def startup_env(local_world_size: int) -> dict[str, str]:
    """The bridge's start-up variables a process of this world needs, among those unset.

    :data:`STARTUP_DEFAULTS` always; ``PT_HPU_ENABLE_LAZY_COLLECTIVES=true`` when the world has
    several ranks (on one node or across nodes) unless ``PT_HPU_LAZY_MODE=0`` says eager. With
    the mode left to the runtime it is set too: the bridge's hccl takes its eager process group
    whenever the mode is eager and never reads the variable then."""
    env = dict(STARTUP_DEFAULTS)
    if _world_size(local_world_size) > 1 and not eager_by_env():
        env[LAZY_COLLECTIVES_ENV] = "true"
    return {k: v for k, v in env.items() if k not in os.environ}


def lazy_collectives_on() -> bool:
    """Whether ``PT_HPU_ENABLE_LAZY_COLLECTIVES`` enables them (hccl's own test)."""
    return os.environ.get(LAZY_COLLECTIVES_ENV, "False").lower() in ("true", "1")


def _bridge_imported() -> bool:
    return "habana_frameworks.torch" in sys.modules


def _local_world_size() -> int:
    """``$LOCAL_WORLD_SIZE`` as torchrun sets it (1 without it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def prepare_bridge_import(local_world_size: int) -> None:
    """Before the bridge's first import in this process: set the :func:`startup_env` variables
    still unset (a script started by torchrun directly gets what ``shardwise launch`` sets). After
    it: warn when several ranks run in lazy mode without lazy collectives, which hccl read at its
    import (HPU graphs holding a collective then fail)."""
    if not _bridge_imported():
        os.environ.update(startup_env(local_world_size))
    elif _world_size(local_world_size) > 1 and lazy_mode() and not lazy_collectives_on():
        log.warning("shardwise: the Gaudi bridge was imported before %s=true was set, so its "
                    "process group cannot run collectives inside HPU graphs; set it in the "
                    "environment (or start with `shardwise launch`)", LAZY_COLLECTIVES_ENV)


def compile_backend_available() -> bool:
    """Whether ``torch.compile`` knows :data:`COMPILE_BACKEND` (after importing the bridge, and
    the module that registers it when importing the bridge did not)."""
    from torch.compiler import list_backends

    _htcore()
    if COMPILE_BACKEND in list_backends(exclude_tags=()):
        return True
    try:
        importlib.import_module(_COMPILE_BACKEND_MODULE)
    except ImportError:
        return False
    return COMPILE_BACKEND in list_backends(exclude_tags=())


class HpuGraphStrategy(GraphStrategy):
    """HPU graphs (``habana_frameworks.torch.hpu.HPUGraph``, lazy mode only): capture once,
    replay with no host overhead. Same contract as
    :class:`~shardwise.accelerators.cuda.CudaGraphStrategy`: static input buffers, results equal
    to eager, outputs overwritten by the next replay.

    ``fn`` must return a tensor or a tuple of tensors, run only HPU ops, and have static shapes
    and no data-dependent control flow (HPU-graph limitations). ``device_type`` is where example
    tensors must live ("hpu"; a test against the stand-in passes "cpu").
    """

    name = "hpu_graph"
    accelerates = True

    def __init__(self, device_type: str = "hpu") -> None:
        self.device_type = device_type

    def capture(self, fn: Callable[..., Any], *example_args: torch.Tensor) -> StaticGraph:
        """Capture ``fn`` for arguments shaped like ``example_args``; see the class docstring."""
        hthpu = _hthpu()
        inputs = static_copies(example_args, self.device_type)
        fn(*inputs)  # warm-up: compiles the recipes outside the graph
        mark_step_if_lazy()  # run the clones and warm-up now, not inside the capture
        hthpu.synchronize()
        graph = hthpu.HPUGraph()
        try:
            with hthpu.stream(hthpu.Stream()):
                graph.capture_begin()
                try:
                    outputs = fn(*inputs)
                finally:
                    graph.capture_end()
        except Exception as exc:
            raise RuntimeError(self._capture_error(fn, exc)) from exc
        return StaticGraph(lambda: self._replay(graph), inputs, static_outputs(outputs), graph)

    @staticmethod
    def _replay(graph: Any) -> None:
        # Flush the copies into the static inputs first (recent bridges also do this implicitly).
        mark_step_if_lazy()
        graph.replay()

    @staticmethod
    def _capture_error(fn: Callable[..., Any], exc: Exception) -> str:
        hint = ""
        if "ProcessGroupHCCL" in str(exc) or LAZY_COLLECTIVES_ENV in str(exc):
            hint = (f"; a graph holding a collective needs {LAZY_COLLECTIVES_ENV}=true before "
                    f"the bridge is imported (`shardwise launch` sets it)")
        return (f"HPU graph capture of {getattr(fn, '__name__', fn)!r} failed: "
                f"{type(exc).__name__}: {exc}. HPU graphs need HPU-only ops with static "
                f"shapes{hint}; fix the function or disable graphs (enable_graph=False)")


class HpuCompileStrategy(GraphStrategy):
    """Eager-mode "graphs" on Gaudi: the step compiled once per shape by
    ``torch.compile(backend="hpu_backend", dynamic=False)``, the backend vllm-gaudi and
    transformers' Trainer use on Gaudi. Batch buckets are the base class's, as on the CPU; the
    contract is :class:`HpuGraphStrategy`'s (static inputs, outputs overwritten by each replay,
    results equal to eager)."""

    name = "hpu_compile"
    accelerates = True

    def __init__(self, device_type: str = "hpu") -> None:
        self.device_type = device_type

    def capture(self, fn: Callable[..., Any], *example_args: torch.Tensor) -> StaticGraph:
        """Compile ``fn`` for arguments shaped like ``example_args`` and run it once on copies."""

        inputs = static_copies(example_args, self.device_type)
        compiled = torch.compile(fresh_code(fn), backend=COMPILE_BACKEND, dynamic=False)
        try:
            outputs = static_outputs(compiled(*inputs))
        except Exception as exc:
            raise RuntimeError(
                f"torch.compile(backend={COMPILE_BACKEND!r}) of {getattr(fn, '__name__', fn)!r} "
                f"failed: {type(exc).__name__}: {_first_line(exc)}; fix the function or disable "
                f"graphs (enable_graph=False)") from exc
        single = isinstance(outputs, torch.Tensor)
        outputs = outputs.clone() if single else tuple(o.clone() for o in outputs)

        def replay() -> None:
            new = compiled(*inputs)
            for static, value in zip((outputs,) if single else outputs,
                                     (new,) if single else new):
                static.copy_(value)

        return StaticGraph(replay, inputs, outputs, compiled)


class HpuAccelerator(Accelerator):
    """Intel Gaudi (HPU). bf16 (preferred), fp32, and fp16 on Gaudi2 and newer; HCCL; HPU graphs
    in lazy mode, ``torch.compile(backend="hpu_backend")`` in eager mode.

    Preferred dtype: **bf16**, native on the matrix engine of every Gaudi generation and the
    format Gaudi's kernels are tuned for; fp16 runs on Gaudi2+ but has less range for no speed gain.
    Kernel backends: the bridge's fused ``hpex`` ops (``shardwise.kernels.hpu``: RMSNorm, rotary,
    prefill SDPA), then the torch reference for everything else (which the Gaudi graph compiler
    fuses).
    """

    name = "hpu"
    device_type = "hpu"
    communication_backend = "hccl"
    visible_devices_env = VISIBLE_MODULES_ENV
    priority = 10
    supported_dtypes = DeviceDtypes(torch.bfloat16, torch.float32, torch.float16,
                                    usable=_hpu_can_run)
    #: the bridge's fused ``hpex`` ops (registers nothing where the bridge is not installed);
    #: checked against the reference on the stand-in by tests/test_kernel_parity.py's hpu target
    kernel_backends = ("hpu",)

    @classmethod
    def availability(cls) -> Availability:
        """Unavailable, with the reason, without the Gaudi runtime or a visible Gaudi device, or
        with a module list too short for ``$LOCAL_WORLD_SIZE``. Imports the bridge, after
        :func:`prepare_bridge_import`."""
        if importlib.util.find_spec("habana_frameworks") is None:
            return Availability(False, "the Intel Gaudi runtime (habana_frameworks.torch) is not "
                                       f"installed: {_INSTALL_HINT}")
        local_world = _local_world_size()
        try:
            check_lazy_mode_env()
            check_visible_modules(local_world)
        except ConfigError as exc:
            return Availability(False, str(exc))
        prepare_bridge_import(local_world)
        try:
            hthpu = _hthpu()
        except Exception as exc:
            return Availability(False, f"the Intel Gaudi runtime is installed but failed to import "
                                       f"({type(exc).__name__}: {_first_line(exc)}): it needs the "
                                       f"torch build that ships with it (this is torch "
                                       f"{torch.__version__}); reinstall matching versions")
        if not hthpu.is_available():
            return Availability(False, f"no Gaudi device is visible ({_visible_modules_note()})")
        return Availability(True)

    @property
    def module(self):
        """``torch.hpu`` once the runtime registered it, else ``habana_frameworks.torch.hpu``."""
        hthpu = _hthpu()
        try:
            return torch.get_device_module(self.device_type)
        except RuntimeError:
            return hthpu

    def device_count(self) -> int:
        """Gaudi modules the node offers this job (after HABANA_VISIBLE_MODULES)."""
        return int(_hthpu().device_count())

    def device(self, index: int | None = None) -> torch.device:
        """``torch.device("hpu")`` whatever ``index``: the bridge drives one Gaudi per process,
        the module hccl chose from LOCAL_RANK (DeepSpeed's HabanaAI-fork ``device_name`` ignores
        the index the same way)."""
        return torch.device(self.device_type)

    # ----- memory ------------------------------------------------------------------------------

    def _memory_stats(self, index: int) -> dict[str, int]:
        return _hthpu().memory_stats(index)

    def total_memory(self, index: int = 0) -> int:
        """The allocator's limit ("Limit"): device HBM less what the runtime reserves."""
        return int(self._memory_stats(index)["Limit"])

    def free_memory(self, index: int = 0) -> int:
        """Limit less what this process's tensors hold ("InUse")."""
        stats = self._memory_stats(index)
        return max(0, int(stats["Limit"]) - int(stats["InUse"]))

    def peak_memory(self, index: int = 0) -> int:
        """Peak bytes held by this process's tensors since the last reset ("MaxInUse")."""
        return int(self._memory_stats(index)["MaxInUse"])

    def reset_peak_memory(self, index: int = 0) -> None:
        """Start a new :meth:`peak_memory` window (``hthpu.reset_peak_memory_stats``)."""
        _hthpu().reset_peak_memory_stats(index)

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in page-locked host memory for fast copies to the Gaudi, pinned for the
        HPU (``tensor.pin_memory(torch.device("hpu"))``, as DeepSpeed's accelerator does)."""
        return tensor.pin_memory(self.device())

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in page-locked host memory (``tensor.is_pinned()``)."""
        return bool(tensor.is_pinned())

    def pinned_host_buffer(self, nbytes: int) -> torch.Tensor:
        """Offload's host buffers pinned the bridge's way (:meth:`pin_memory`), not through
        torch's generic pinned allocator."""
        return self.pin_memory(torch.empty(nbytes, dtype=torch.uint8))

    # ----- dtypes ------------------------------------------------------------------------------

    @property
    def preferred_dtype(self) -> torch.dtype:
        """bf16 (see the class docstring for why)."""
        return torch.bfloat16

    def check_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Refuse fp16 on Gaudi1 (no fp16 there), and dtypes Gaudi cannot run."""
        if dtype is torch.float16 and dtype not in self.supported_dtypes:
            raise UnsupportedDtypeError("this Gaudi (first generation) has no float16 support: "
                                        "pass dtype=torch.bfloat16 (preferred) or torch.float32")
        return super().check_dtype(dtype)

    def dtype_notes(self) -> str:
        """What runs fast on this Gaudi, and the execution mode."""
        fp16 = "fp16 also fast" if torch.float16 in self.supported_dtypes else "no fp16 (Gaudi1)"
        return (f"bf16 native on the matrix engine, preferred; {fp16}; fp32 much slower; "
                f"{'lazy' if lazy_mode() else 'eager'} mode")

    # ----- processes, communication, graphs ----------------------------------------------------

    def launch_env(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """The bridge's start-up variables this rank needs among those unset
        (:func:`startup_env`). ``HABANA_VISIBLE_MODULES`` is never narrowed (module docstring);
        a list shorter than ``local_world_size`` is :class:`VisibleModulesError`, which
        ``shardwise launch`` reports before any rank starts."""
        check_lazy_mode_env()
        check_visible_modules(local_world_size)
        return startup_env(local_world_size)

    def configure_process(self, local_rank: int, local_world_size: int) -> None:
        """Check the module list, set the start-up variables if the bridge is not imported yet
        (:func:`prepare_bridge_import`), then import ``distributed.hccl``: it registers "hccl"
        and picks this process's module from LOCAL_RANK. No ``set_device``."""
        check_lazy_mode_env()
        check_visible_modules(local_world_size)
        prepare_bridge_import(local_world_size)
        importlib.import_module("habana_frameworks.torch.distributed.hccl")

    def graph_strategy(self) -> GraphStrategy:
        """Lazy mode: HPU graphs where the bridge exports ``HPUGraph``; eager mode:
        ``torch.compile(backend="hpu_backend")`` where torch knows that backend. Neither is
        :class:`HpuGraphUnavailableError`, one line saying what to do."""
        hthpu = _hthpu()
        if lazy_mode():
            if hasattr(hthpu, "HPUGraph"):
                return HpuGraphStrategy(self.device_type)
            missing = "lazy mode, but this bridge exports no hpu.HPUGraph"
        else:
            if compile_backend_available():
                return HpuCompileStrategy(self.device_type)
            missing = f"eager mode, but torch.compile has no {COMPILE_BACKEND!r} backend"
        raise HpuGraphUnavailableError(
            f"enable_graph on Gaudi needs HPU graphs (lazy mode) or torch.compile's "
            f"{COMPILE_BACKEND!r} (eager mode); this runtime is in {missing}: install a Gaudi "
            f"software stack that has it, switch {LAZY_MODE_ENV}, or pass enable_graph=False")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _visible_modules_note() -> str:
    value = os.environ.get(VISIBLE_MODULES_ENV)
    if value is None:
        return (f"{VISIBLE_MODULES_ENV} is unset; check `hl-smi` and that no other process holds "
                f"the devices")
    return (f"{VISIBLE_MODULES_ENV}={value!r}; check that it names existing modules (`hl-smi`) "
            f"and that no other process holds them")

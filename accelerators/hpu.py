"""The HPU accelerator: Intel Gaudi via ``habana_frameworks.torch``, HCCL collectives, HPU graphs.

The Gaudi runtime is imported only by :meth:`HpuAccelerator.availability` and later calls, never
at import of this module. Execution mode follows the Gaudi bridge's ``PT_HPU_LAZY_MODE`` ("1":
lazy, ops accumulate until ``htcore.mark_step()``; "0": eager / torch.compile). In lazy mode a
step is marked before every collective and around graph capture/replay.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any, Callable

import torch

from shardwise.accelerator import (Accelerator, Availability, DeviceDtypes, GraphStrategy,
                                   bind_device_per_rank, visible_device_for_rank)
from shardwise.communicator import TorchDistCommunicator
from shardwise.errors import UnsupportedDtypeError
from shardwise.graphs import StaticGraph, static_copies, static_outputs

LAZY_MODE_ENV = "PT_HPU_LAZY_MODE"
#: Multi-card HPU graphs need collectives inside the lazy graph (Gaudi inference guide).
LAZY_COLLECTIVES_ENV = "PT_HPU_ENABLE_LAZY_COLLECTIVES"
VISIBLE_MODULES_ENV = "HABANA_VISIBLE_MODULES"
_INSTALL_HINT = "install the Gaudi software stack / habana-torch-plugin"


def _hthpu():
    """``habana_frameworks.torch.hpu`` (imports the Gaudi runtime on first call)."""
    return importlib.import_module("habana_frameworks.torch.hpu")


def _htcore():
    """``habana_frameworks.torch.core``: ``mark_step()`` lives here."""
    return importlib.import_module("habana_frameworks.torch.core")


def lazy_mode() -> bool:
    """True when the Gaudi bridge runs in lazy mode.

    ``$PT_HPU_LAZY_MODE`` decides when set ("1" lazy, anything else eager); otherwise the runtime
    is asked. If it cannot say, lazy is assumed: a needless ``mark_step()`` in eager mode is a
    no-op, a missing one in lazy mode is a bug.
    """
    value = os.environ.get(LAZY_MODE_ENV, "").strip()
    if value:
        return value == "1"
    try:
        return bool(importlib.import_module("habana_frameworks.torch.utils.internal").is_lazy())
    except (ImportError, AttributeError):
        return True


def mark_step_if_lazy() -> None:
    """Run the ops accumulated so far (``htcore.mark_step()``) when in lazy mode."""
    if lazy_mode():
        _htcore().mark_step()


def fp16_supported() -> bool:
    """True on Gaudi2 and newer; Gaudi1 has no fp16. Assumed True if the runtime cannot say."""
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


class HpuCommunicator(TorchDistCommunicator):
    """HCCL collectives; in lazy mode, marks a step first so the collective sees computed inputs."""

    def before_collective(self) -> None:
        """``htcore.mark_step()`` in lazy mode; nothing in eager mode."""
        mark_step_if_lazy()


class HpuGraphStrategy(GraphStrategy):
    """HPU graphs (``habana_frameworks.torch.hpu.HPUGraph``): capture once, replay with no host
    overhead. Same contract as :class:`~shardwise.accelerators.cuda.CudaGraphStrategy`: static
    input buffers, results equal to eager, outputs overwritten by the next replay.

    ``fn`` must return a tensor or a tuple of tensors, run only HPU ops, and have static shapes
    and no data-dependent control flow (HPU-graph limitations). ``device_type`` is where example
    tensors must live ("hpu"; a test against a fake runtime passes "cpu").
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
        mode = "lazy" if lazy_mode() else f"eager ({LAZY_MODE_ENV}=0)"
        return (f"HPU graph capture of {getattr(fn, '__name__', fn)!r} failed in {mode} mode: "
                f"{type(exc).__name__}: {exc}. HPU graphs need HPU-only ops with static shapes "
                f"and are best supported in lazy mode ({LAZY_MODE_ENV}=1); fix the function or "
                f"disable graphs (enable_graph=False)")


class HpuAccelerator(Accelerator):
    """Intel Gaudi (HPU). bf16 (preferred), fp32, and fp16 on Gaudi2 and newer; HCCL; HPU graphs.

    Preferred dtype: **bf16**, native on the matrix engine of every Gaudi generation and the
    format Gaudi's kernels are tuned for; fp16 runs on Gaudi2+ but has less range for no speed gain.
    Kernel backends: none built in, so ops run as the torch reference (which the Gaudi graph
    compiler fuses); a plugin can register better HPU kernels.
    """

    name = "hpu"
    device_type = "hpu"
    communication_backend = "hccl"
    visible_devices_env = VISIBLE_MODULES_ENV
    priority = 10
    supported_dtypes = DeviceDtypes(torch.bfloat16, torch.float32, torch.float16,
                                    usable=_hpu_can_run)
    kernel_backends = ()

    @classmethod
    def availability(cls) -> Availability:
        """Unavailable, with the reason, without the Gaudi runtime or a visible Gaudi device."""
        if importlib.util.find_spec("habana_frameworks") is None:
            return Availability(False, "the Intel Gaudi runtime (habana_frameworks.torch) is not "
                                       f"installed: {_INSTALL_HINT}")
        try:
            hthpu = _hthpu()
        except Exception as exc:
            return Availability(False, f"the Intel Gaudi runtime is installed but failed to import "
                                       f"({type(exc).__name__}: {exc}): it needs the torch build "
                                       f"that ships with it (this is torch {torch.__version__}); "
                                       f"reinstall matching versions")
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
        """Gaudi devices this process sees (after HABANA_VISIBLE_MODULES)."""
        return int(_hthpu().device_count())

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
        """One Gaudi per rank via HABANA_VISIBLE_MODULES (an existing list is respected); with
        several ranks, lazy collectives on (needed for multi-card HPU graphs) unless set."""
        env = {VISIBLE_MODULES_ENV: visible_device_for_rank(VISIBLE_MODULES_ENV, local_rank,
                                                             local_world_size)}
        if local_world_size > 1 and LAZY_COLLECTIVES_ENV not in os.environ:
            env[LAZY_COLLECTIVES_ENV] = "true"
        return env

    def configure_process(self, local_rank: int, local_world_size: int) -> None:
        """Register the "hccl" backend and select device ``local_rank`` when several are visible."""
        importlib.import_module("habana_frameworks.torch.distributed.hccl")  # registers "hccl"
        hthpu = _hthpu()
        bind_device_per_rank(int(hthpu.device_count()), local_rank, local_world_size,
                             hthpu.set_device, "Gaudi device", _visible_modules_note())

    def communicator_class(self) -> type[HpuCommunicator]:
        """:class:`HpuCommunicator` (marks a lazy-mode step before each collective)."""
        return HpuCommunicator

    def graph_strategy(self) -> HpuGraphStrategy:
        """HPU graphs (:class:`HpuGraphStrategy`)."""
        return HpuGraphStrategy(self.device_type)


def _visible_modules_note() -> str:
    value = os.environ.get(VISIBLE_MODULES_ENV)
    if value is None:
        return (f"{VISIBLE_MODULES_ENV} is unset; check `hl-smi` and that no other process holds "
                f"the devices")
    return (f"{VISIBLE_MODULES_ENV}={value!r}; check that it names existing modules (`hl-smi`) "
            f"and that no other process holds them")

"""The CPU accelerator: the host's device facts — always available, fp32 and bf16 (preferred only
with native bf16), memory from /proc, cores split between local ranks, gloo collectives plus a
shared-memory all_reduce (:mod:`shardwise.accelerators.cpu_comm`).

Its decode-step graphs (``torch.compile``) live beside it in
:mod:`shardwise.accelerators.cpu_graphs`, imported only when :meth:`CpuAccelerator.graph_strategy`
is asked for.
"""

from __future__ import annotations

import os
import platform
from functools import cache

import torch

from shardwise.accelerator import Accelerator, Availability, GraphStrategy


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
    RSS, and the trim brings it back near that of injection without graphs (figures:
    benchmarks/README.md, "The default layout (cpp) in detail")."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


#: OpenMP 5.0's ``omp_pause_hard``: a thread's pause frees its worker pool (threads and all)
_OMP_PAUSE_HARD = 2


@cache
def _openmp_pause():
    """``omp_pause_resource_all`` of the OpenMP runtime torch has loaded, or None (torch's
    parallel backend is not OpenMP, or its runtime is not GNU libgomp ≥ 9, which has it)."""
    import ctypes

    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:  # libgomp.so.1 is the soname of the runtime torch ships: RTLD_NOLOAD gets that one
        pause = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD).omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (its threads exit; the next parallel region
    this thread runs makes a new one). Returns whether there was a runtime to ask.

    Why: libgomp keeps one pool per thread that ever ran a parallel region, and once its
    threads outnumber the cores it stops spinning between regions (``GOMP_SPINCOUNT``'s
    throttled count), so every region of every thread pays a futex wake-up. A model built on
    the main thread and served from another (a server's scheduler) ran its decode step 1.9x
    slower for it (SmolLM2-135M bf16 on 2 cores, batch 1: 25.1 vs 13.1 ms; ``python
    benchmarks/serve_step.py --thread``)."""
    pause = _openmp_pause()
    if pause is None:
        return False
    pause(_OMP_PAUSE_HARD)
    return True


class CpuAccelerator(Accelerator):
    """Runs on the host CPU. fp32 and bf16; bf16 is preferred only with native bf16 support."""

    name = "cpu"
    device_type = "cpu"
    communication_backend = "gloo"
    priority = 0
    supported_dtypes = (torch.float32, torch.bfloat16)
    kernel_backends = ("cpu",)
    bandwidth_probe_bytes = 512 << 20  # well past the last-level cache, quick on a small host
    computes_in_host_memory = True  # tensors on "cpu" are host memory: no device copy to make

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

    def release_thread_pool(self) -> None:
        """torch's OpenMP pool of the calling thread: see :func:`release_openmp_pool`."""
        release_openmp_pool()

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
        """:class:`~shardwise.accelerators.cpu_graphs.CpuCompileStrategy`, chosen by
        ``SHARDWISE_CPU_GRAPHS`` (:func:`~shardwise.accelerators.cpu_graphs.strategy_from_env`):
        ``cpp``/``compile`` (default: weights shared with the model, laid out for the C++ GEMM
        template), ``frozen`` (the template on its own prepacked copy of the weights: a faster
        step for about the linear weights' bytes more memory and a slower start), ``onednn`` or
        ``inductor`` (frozen, prepacked copies), or ``eager`` for the documented no-op. Under tensor
        parallelism the step's all-reduces are compiled as the opaque op
        ``shardwise::cpu_all_reduce`` (see :class:`~shardwise.accelerators.cpu_comm.
        CpuCommunicator`), so every rank compiles and replays its own step."""
        from shardwise.accelerators.cpu_graphs import strategy_from_env

        return strategy_from_env()

    def communicator_class(self):
        """gloo plus a shared-memory all_reduce for ranks on one node (small tensors, chosen
        automatically; ``SHARDWISE_CPU_SHM_ALLREDUCE=0`` disables it). See
        :mod:`shardwise.accelerators.cpu_comm`."""
        from shardwise.accelerators.cpu_comm import CpuCommunicator

        return CpuCommunicator

"""The CUDA accelerator: NVIDIA GPUs through a CUDA build of torch, NCCL collectives, CUDA graphs.

Nothing here initialises CUDA at import: torch.cuda calls happen in the methods.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch

from shardwise.accelerator import (Accelerator, Availability, DeviceDtypes, GraphStrategy,
                                   bind_device_per_rank, visible_device_for_rank)
from shardwise.errors import UnsupportedDtypeError
from shardwise.graphs import StaticGraph, static_copies, static_outputs

# ----- CUDA ------------------------------------------------------------------------------------


class CudaGraphStrategy(GraphStrategy):
    """CUDA graphs: capture once, replay with one launch (no per-kernel CPU overhead).

    ``capture(fn, *example_args)`` clones the examples into static input buffers, runs ``fn``
    ``warmup_iters`` times on a side stream (lazy initialisation, cuBLAS workspaces and autotuning
    must happen outside the capture), captures one ``torch.cuda.CUDAGraph`` and returns a
    :class:`StaticGraph`. ``fn`` must return a tensor or a tuple of tensors, take only CUDA
    tensors, and do nothing that syncs with the host (``.item()``, printing, data-dependent
    shapes). Outputs are overwritten by the next replay (see :class:`StaticGraph`).
    """

    name = "cuda_graph"
    accelerates = True

    #: a captured graph replays on the addresses it was captured with: offload's per-layer
    #: graphs are captured once per layer and ring slot (shardwise.offload.graphs)
    weight_binding = "addresses"

    def __init__(self, warmup_iters: int = 3) -> None:
        self.warmup_iters = warmup_iters

    def capture(self, fn: Callable[..., Any], *example_args: torch.Tensor) -> StaticGraph:
        """Capture ``fn`` for arguments shaped like ``example_args``; see the class docstring."""
        inputs = static_copies(example_args, "cuda")
        self._warm_up(fn, inputs)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                outputs = fn(*inputs)
        except Exception as exc:
            raise RuntimeError(
                f"CUDA graph capture of {getattr(fn, '__name__', fn)!r} failed: "
                f"{type(exc).__name__}: {exc}. The function must run only CUDA ops with no host "
                f"sync (.item(), .cpu(), data-dependent shapes); fix it or disable graphs "
                f"(enable_graph=False)") from exc
        return StaticGraph(graph.replay, inputs, static_outputs(outputs), graph)

    def _warm_up(self, fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...]) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_iters):
                fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)


def native_bf16() -> bool:
    """True when the current GPU computes bf16 natively (compute capability 8.0+, Ampere on)."""
    return torch.cuda.is_bf16_supported(including_emulation=False)


def _cuda_can_run(dtype: torch.dtype) -> bool:
    # Without a visible GPU there is nothing to probe: report what the device kind can run.
    if dtype is torch.bfloat16 and torch.cuda.is_available():
        return native_bf16()
    return True


def _visible_devices_note() -> str:
    value = os.environ.get(CudaAccelerator.visible_devices_env)
    if value is None:
        return "CUDA_VISIBLE_DEVICES is unset; check `nvidia-smi` and the NVIDIA driver"
    return (f"CUDA_VISIBLE_DEVICES={value!r}; check that it names existing GPUs "
            f"(`nvidia-smi -L`) and that the NVIDIA driver works")


class CudaAccelerator(Accelerator):
    """NVIDIA GPUs. fp16, bf16 (Ampere and newer only) and fp32; NCCL; CUDA graphs; Triton.

    Preferred dtype: **bf16** where the GPU runs it natively (sm_80+), because it has the same
    tensor-core throughput as fp16 with fp32's exponent range, so activations of models trained in
    bf16 do not overflow; **fp16** on older GPUs, which have no native bf16.
    """

    name = "cuda"
    device_type = "cuda"
    communication_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    priority = 10
    supported_dtypes = DeviceDtypes(torch.float16, torch.bfloat16, torch.float32,
                                    usable=_cuda_can_run)
    kernel_backends = ("triton",)

    @classmethod
    def availability(cls) -> Availability:
        """Unavailable, with the reason, on CPU-only/ROCm torch builds or without a visible GPU."""
        if torch.version.cuda is None:
            hip = getattr(torch.version, "hip", None)
            if hip:
                return Availability(False, f"this torch build targets ROCm (torch.version.hip="
                                           f"{hip}), not CUDA: the built-in 'cuda' plugin supports "
                                           f"NVIDIA CUDA builds of torch only")
            return Availability(False, "this torch build has no CUDA support (torch.version.cuda "
                                       "is None): install a CUDA build of torch")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            available = torch.cuda.is_available()
        if available:
            return Availability(True)
        detail = "; ".join(str(w.message).strip() for w in caught)  # e.g. "driver too old"
        reason = f"no CUDA device is visible ({_visible_devices_note()})"
        return Availability(False, f"{reason}: {detail}" if detail else reason)

    def device_count(self) -> int:
        """GPUs this process sees (after CUDA_VISIBLE_DEVICES)."""
        return torch.cuda.device_count()

    # ----- memory ------------------------------------------------------------------------------

    def total_memory(self, index: int = 0) -> int:
        """Total bytes of GPU ``index`` as the driver reports them (``torch.cuda.mem_get_info``)."""
        return int(torch.cuda.mem_get_info(index)[1])

    def free_memory(self, index: int = 0) -> int:
        """Free bytes on the device as the driver sees them (other processes included)."""
        return int(torch.cuda.mem_get_info(index)[0])

    def pinned_host_buffer(self, nbytes: int) -> torch.Tensor:
        """Exactly ``nbytes`` of page-locked host memory: an anonymous mmap registered with
        ``cudaHostRegister`` (unregistered when the tensor is freed), not torch's pinned
        allocator, which rounds each block up to a power of two and so could pin up to twice
        an offloaded model's bytes."""
        from shardwise.offload.store import registered_host_buffer

        return registered_host_buffer(nbytes, torch.cuda.cudart())

    def peak_memory(self, index: int = 0) -> int:
        """Peak bytes allocated by this process's caching allocator since the last reset."""
        return int(torch.cuda.max_memory_allocated(index))

    def reset_peak_memory(self, index: int = 0) -> None:
        """Start a new :meth:`peak_memory` window (``torch.cuda.reset_peak_memory_stats``)."""
        torch.cuda.reset_peak_memory_stats(index)

    # ----- dtypes ------------------------------------------------------------------------------

    @property
    def preferred_dtype(self) -> torch.dtype:
        """bf16 where native (sm_80+), else fp16 (see the class docstring for why)."""
        return torch.bfloat16 if torch.bfloat16 in self.supported_dtypes else torch.float16

    def check_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Refuse bf16 on GPUs without native bf16 (pre-Ampere), and dtypes CUDA cannot run."""
        if dtype is torch.bfloat16 and dtype not in self.supported_dtypes:
            major, minor = torch.cuda.get_device_capability()
            raise UnsupportedDtypeError(
                f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no "
                f"native bfloat16 (it needs 8.0+, Ampere or newer): pass dtype=torch.float16 "
                f"(fast on this GPU) or torch.float32")
        return super().check_dtype(dtype)

    def dtype_notes(self) -> str:
        """What runs fast on the current GPU, by compute capability."""
        major, minor = torch.cuda.get_device_capability()
        gpu = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
        if major >= 8:
            return (f"{gpu}: fp16 and bf16 on tensor cores at the same rate, bf16 preferred "
                    f"(no fp16 overflow); fp32 several times slower")
        if major >= 7:
            return f"{gpu}: no native bf16 (refused); fp16 on tensor cores, preferred; fp32 slow"
        return f"{gpu}: no tensor cores and no native bf16; fp16 speed depends on the chip"

    # ----- processes, graphs -------------------------------------------------------------------

    def launch_env(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """One GPU per rank through CUDA_VISIBLE_DEVICES (an existing list is respected)."""
        env = self.visible_devices_env
        return {env: visible_device_for_rank(env, local_rank, local_world_size)}

    def configure_process(self, local_rank: int, local_world_size: int) -> None:
        """Make GPU ``local_rank`` current, unless the process already sees exactly one GPU."""
        bind_device_per_rank(torch.cuda.device_count(), local_rank, local_world_size,
                             torch.cuda.set_device, "CUDA device", _visible_devices_note())

    def graph_strategy(self) -> CudaGraphStrategy:
        """CUDA graphs (:class:`CudaGraphStrategy`)."""
        return CudaGraphStrategy()

"""The example accelerator: every fact and decision a real device plugin provides.

A real plugin replaces the CPU-specific bodies below with calls into its runtime (imported lazily,
inside the methods: discovery imports this module on machines without your hardware).
"""

from __future__ import annotations

import os

import torch

from shardwise.accelerator import Accelerator, Availability, env_flag

#: Setting this to 1 makes the demonstration device available (it is off by default, or every
#: auto-detecting user with this package installed would get it instead of their real device).
ENABLE_ENV = "SHARDWISE_EXAMPLE_ENABLE"


class ExampleAccelerator(Accelerator):
    """A demonstration device that runs on CPU tensors with gloo collectives."""

    # The plugin-API version this plugin was written for (a literal, not shardwise's constant, so
    # that a shardwise with an incompatible API refuses the plugin instead of misrunning it).
    plugin_api_version = 1
    name = "example"  # same as the entry-point name: what users pass as device=
    device_type = "cpu"  # the torch.device type tensors live on ("cuda", "hpu", "xpu", ...)
    communication_backend = "gloo"  # the torch.distributed backend ("nccl", "hccl", ...)
    visible_devices_env = None  # e.g. "MYDEV_VISIBLE_DEVICES" if the runtime has one
    priority = 0  # among available third-party plugins, higher wins auto-detection
    supported_dtypes = (torch.float32, torch.bfloat16)  # each one is exercised by conformance
    kernel_backends = ("example",)  # our own backend first; the torch reference is always last

    @classmethod
    def availability(cls) -> Availability:
        """Available only on request; a real device probes its runtime and says what is missing."""
        if env_flag(ENABLE_ENV):
            return Availability(True)
        return Availability(False, f"demonstration device: set {ENABLE_ENV}=1 to enable it")

    def device_count(self) -> int:
        return 1

    def max_ranks_per_node(self) -> int:
        """Ranks share the host's cores (a real device: one rank per device, the default)."""
        return os.cpu_count() or 1

    def total_memory(self, index: int = 0) -> int:
        """Host RAM stands in for device memory (a real plugin asks its runtime)."""
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def free_memory(self, index: int = 0) -> int:
        return min(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                   self.total_memory(index))

    def dtype_notes(self) -> str:
        return "demonstration device on CPU tensors: fp32 exact, bf16 emulated"

    def launch_env(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """Per-rank environment for launchers: split the host's cores between local ranks."""
        threads = max(1, (os.cpu_count() or 1) // max(1, local_world_size))
        return {"OMP_NUM_THREADS": str(threads)}

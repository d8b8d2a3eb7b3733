"""The accelerator interface: one subclass per device kind, discovered as an entry-point plugin.

Device *facts* are class attributes; device *decisions* are small methods with safe defaults.
Streams, events, RNG and memory accounting come from torch itself (``torch.accelerator`` and
:attr:`Accelerator.module`, i.e. ``torch.get_device_module(device_type)``); this class adds only
what torch lacks. Core code never tests a device name: it asks the accelerator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

import torch

from .errors import ConfigError, UnsupportedDtypeError

if TYPE_CHECKING:
    from .communicator import Communicator

#: Version of the plugin API this shardwise implements. A plugin declares the version it was
#: written for in ``plugin_api_version``; a mismatch is refused with an error naming both.
PLUGIN_API_VERSION = 1


@dataclass(frozen=True)
class Availability:
    """Whether an accelerator can run here, and if not, why (and what to do)."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


#: The values of :attr:`GraphStrategy.weight_binding`.
WEIGHT_BINDINGS = ("inputs", "addresses", "copies")


class GraphStrategy:
    """How a device turns a repeated step into a replayable graph.

    :meth:`capture` takes a function of tensors and example arguments of the shapes it will be
    called with, and returns a callable with the same signature whose results equal the eager
    function's. The base strategy is eager execution: a documented no-op.
    """

    name: ClassVar[str] = "none"
    #: True when captured callables avoid per-op launch overhead (eager returns False).
    accelerates: ClassVar[bool] = False
    #: How a captured callable reads the tensors it reaches other than its arguments (the
    #: weights), one of :data:`WEIGHT_BINDINGS`: ``"inputs"`` — read where they are at each call
    #: (a weight rebound to other memory is seen by the next call: compiled code taking the
    #: parameters as inputs); ``"addresses"`` — read at the addresses they had at capture (a
    #: CUDA graph: the memory must hold the weights at replay); ``"copies"`` — a copy kept by the
    #: captured code (frozen constants). Offload's per-layer graphs
    #: (:mod:`shardwise.offload.graphs`) capture one graph per layer for ``"inputs"``, one per
    #: layer and ring slot for ``"addresses"``, and refuse ``"copies"`` (every layer's weights
    #: would stay resident inside the graphs). The default is the safe one for a strategy that
    #: does not say: ``"addresses"``.
    weight_binding: ClassVar[str] = "addresses"
    #: Whether the captured code runs an opaque op's Python at every replay (compiled code
    #: calling the op) rather than replaying what it recorded (a CUDA graph): serving's mixed
    #: steps (:mod:`shardwise.inject.slots`) whose chunk attention reads each chunk's place on
    #: the host inside such an op (a backend without a capturable ``attention_chunks``) are
    #: captured only where this is True.
    replays_host_code: ClassVar[bool] = False
    #: Storage dtypes the strategy can keep the linear weights in under a wider compute dtype
    #: (``init_inference(dtype=torch.float32, weight_dtype=...)``): its captured and eager code
    #: multiply the compute dtype's activations by the narrower weights as they are stored
    #: (:meth:`share_weights` lays them out so). Empty: none (the option is refused by name).
    weight_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()

    def capture(self, fn: Callable[..., torch.Tensor], *example_args: torch.Tensor) -> Callable:
        """Return ``fn`` itself: eager execution needs no capture."""
        return fn

    def share_weights(self, linears: list, embedding: Any = None) -> int:
        """Called once before the first capture with the model's leaf layers that hold tensors
        (linears of every kind, quantized ones included, norms; and its input
        embedding when an output head among them shares its weight): a strategy whose captured
        code would otherwise keep its own copy of the weights (e.g. prepacked for its kernels)
        lays them out here, in place and instance-scoped, the way its captured code reads them,
        so captured and eager code share one copy. Returns the number of layers changed; the
        base strategy changes none. Called with ``weight_dtype=`` (one of
        :attr:`weight_dtypes`) only when the user asked for a storage dtype; a strategy that
        declares none is never called with it."""
        return 0

    def keep_weight_layout(self) -> None:
        """Called instead of :meth:`share_weights` when the weights the captured code will read
        stay in the model's own layout, laid out by someone else (offload streams them through
        its ring slots as the blobs hold them): a strategy whose captured code would rely on
        its own layout switches to kernels that read the usual one. Default: nothing."""

    def batch_bucket(self, batch: int) -> int:
        """The captured batch size that serves ``batch`` sequences (padded up to it), so a few
        graphs serve every batch size: 1, 2, 4, 8, then multiples of 8. A device whose capture
        is cheap, or whose step cost grows fast with the batch, may override it (returning
        ``batch`` gives one graph per exact size)."""
        if batch <= 8:
            return 1 << max(0, batch - 1).bit_length()
        return -(-batch // 8) * 8


class Accelerator:
    """Base class of accelerator plugins.

    Subclasses set the class attributes below and override the methods whose defaults do not fit
    their device. Instances are cheap; constructing one must not initialise the device runtime.
    """

    #: Plugin-API version the plugin was written for (see :data:`PLUGIN_API_VERSION`).
    plugin_api_version: ClassVar[int] = PLUGIN_API_VERSION
    #: Name users pass as ``device=`` (also the entry-point name).
    name: ClassVar[str] = ""
    #: ``torch.device`` type tensors live on ("cpu", "cuda", "hpu", ...).
    device_type: ClassVar[str] = ""
    #: ``torch.distributed`` backend for collectives ("gloo", "nccl", "hccl", ...).
    communication_backend: ClassVar[str] = "gloo"
    #: Environment variable that restricts which devices a process sees, if the device has one.
    visible_devices_env: ClassVar[str | None] = None
    #: Detection priority among available plugins of the same origin (higher wins).
    priority: ClassVar[int] = 0
    #: Dtypes this device computes with (every one must really work: the conformance suite runs it).
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)
    #: Kernel backends to try, best first; the torch reference is always the implicit last one.
    kernel_backends: ClassVar[tuple[str, ...]] = ()
    #: Buffer size the benchmark's bandwidth probe copies (large enough to defeat caches).
    bandwidth_probe_bytes: ClassVar[int] = 2 << 30
    #: True when the device computes on tensors in the process's own host memory (the CPU), so
    #: there is no separate device memory to copy weights into: offload's ``"cpu"`` tier (host
    #: memory streamed to the device) has nothing to do there, and the ``"nvme"`` tier reads
    #: straight into the memory the layers compute from. False for devices with their own
    #: memory (CUDA, HPU), including ones that share physical memory but need an explicit copy.
    computes_in_host_memory: ClassVar[bool] = False

    # ----- availability and devices -------------------------------------------------------------

    @classmethod
    def availability(cls) -> Availability:
        """Whether this device can run here; the reason says what is missing when it cannot."""
        return Availability(True)

    def device_count(self) -> int:
        """Number of devices of this kind visible to the process."""
        return 1

    def max_ranks_per_node(self) -> int:
        """How many ranks one node can host (one per device by default; the CPU splits cores)."""
        return self.device_count()

    def device(self, index: int | None = None) -> torch.device:
        """The ``torch.device`` for device ``index`` (default: the current one)."""
        if index is None:
            return torch.device(self.device_type)
        return torch.device(self.device_type, index)

    def device_name(self, index: int = 0) -> str:
        """Product name of device ``index``, for reports (torch's device module when it knows)."""
        getter = getattr(self.module, "get_device_name", None)
        if callable(getter):
            try:
                return str(getter(index))
            except Exception:  # the module has the function but no device behind it
                pass
        return self.name

    @property
    def module(self):
        """torch's device module (``torch.cuda``, ``torch.cpu``, ...): streams, events, RNG."""
        return torch.get_device_module(self.device_type)

    def synchronize(self) -> None:
        """Wait for all queued work on the current device (for timing)."""
        self.module.synchronize()

    # ----- memory ------------------------------------------------------------------------------

    def total_memory(self, index: int = 0) -> int:
        """Total memory of device ``index`` in bytes."""
        raise NotImplementedError

    def free_memory(self, index: int = 0) -> int:
        """Free memory of device ``index`` in bytes."""
        raise NotImplementedError

    def peak_memory(self, index: int = 0) -> int:
        """Peak memory used by this process on device ``index`` since the last reset, in bytes."""
        return 0

    def reset_peak_memory(self, index: int = 0) -> None:
        """Start a new peak-memory window."""

    def pinned_host_buffer(self, nbytes: int) -> torch.Tensor | None:
        """A page-locked uint8 ``[nbytes]`` host tensor, from which copies to this device run
        asynchronously at full speed (offload's host tier and its read staging), or None where
        pinning gains nothing: a device that computes in host memory. Default: torch's pinned
        allocator for the current accelerator (it rounds blocks up to a power of two); an
        accelerator with an exact-size way overrides this. Raises RuntimeError when the
        runtime refuses (locked-memory limit)."""
        if self.computes_in_host_memory:
            return None
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def release_cached_memory(self) -> None:
        """Give memory that freed tensors left cached in this process back to the system
        (called once ``init_inference`` has dropped the weights it replaced). Default: none."""

    def release_thread_pool(self) -> None:
        """The calling thread stops running model work for a while — another thread takes
        over (a server builds the model on one thread and steps it on another) or it goes
        idle: give back the host worker threads it holds for parallel ops, so that they do
        not compete with the next thread's (called by ``shardwise serve``'s scheduler and its
        HF baseline). Harmless at any time outside a parallel op: the thread's next parallel
        op makes what it needs again. Default: nothing held."""

    # ----- dtypes -------------------------------------------------------------------------------

    @property
    def preferred_dtype(self) -> torch.dtype:
        """The dtype this device runs fastest among those it supports."""
        return self.supported_dtypes[0]

    def dtype_notes(self) -> str:
        """One honest line on what runs fast here (shown by ``shardwise accelerators``)."""
        return ""

    def check_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Return ``dtype`` if this device can run it, else raise :class:`UnsupportedDtypeError`."""
        if dtype not in self.supported_dtypes:
            names = ", ".join(dtype_name(d) for d in self.supported_dtypes)
            raise UnsupportedDtypeError(
                f"device {self.name!r} cannot run dtype {dtype_name(dtype)}; "
                f"it supports: {names}. Pass one of those as dtype=."
            )
        return dtype

    # ----- processes, communication, graphs, kernels -------------------------------------------

    def launch_env(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """Environment variables a launcher sets for rank ``local_rank`` of one node."""
        return {}

    def configure_process(self, local_rank: int, local_world_size: int) -> None:
        """Bind the calling process to its device (called once per rank before any work)."""

    def communicator_class(self) -> type["Communicator"]:
        """The communicator class for this device (override to add hooks around collectives)."""
        from .communicator import TorchDistCommunicator

        return TorchDistCommunicator

    def graph_strategy(self) -> GraphStrategy:
        """The graph-capture strategy of this device (default: eager, a no-op)."""
        return GraphStrategy()

    def ordered_kernel_backends(self) -> Sequence[str]:
        """Kernel backends to try in order; ``reference`` is always appended last."""
        return (*self.kernel_backends, "reference")

    # ----- helpers -----------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} device_type={self.device_type!r}>"


def env_flag(name: str) -> bool:
    """True when environment variable ``name`` is set to a truthy value (1/true/yes/on)."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


class DeviceDtypes:
    """A ``supported_dtypes`` class attribute that is honest per device.

    Read on the class, it lists every dtype the device *kind* can run (what ``shardwise
    accelerators`` shows without touching a device). Read on an instance, it keeps only the
    dtypes ``usable(dtype)`` accepts on the visible device, so e.g. a pre-Ampere GPU does not
    claim bf16 and the conformance suite tests exactly what the device runs.
    """

    def __init__(self, *dtypes: torch.dtype, usable: Callable[[torch.dtype], bool]) -> None:
        self.dtypes = dtypes
        self.usable = usable

    def __get__(self, obj: Any, owner: type | None = None) -> tuple[torch.dtype, ...]:
        if obj is None:
            return self.dtypes
        return tuple(d for d in self.dtypes if self.usable(d))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def visible_device_for_rank(env_name: str, local_rank: int, local_world_size: int) -> str:
    """The device id local rank ``local_rank`` should see, one device per rank.

    An existing list in ``$env_name`` is respected ("2,3" gives rank 1 device "3"); without one,
    rank r gets device "r".
    """
    user_list = os.environ.get(env_name)
    if user_list is None:
        return str(local_rank)
    devices = [d.strip() for d in user_list.split(",") if d.strip()]
    if len(devices) < local_world_size:
        raise ConfigError(
            f"{local_world_size} ranks per node need one device each, but {env_name}="
            f"{user_list!r} lists {len(devices)}: list at least {local_world_size} devices in "
            f"{env_name}, unset it, or launch fewer ranks per node")
    return devices[local_rank]


def bind_device_per_rank(count: int, local_rank: int, local_world_size: int,
                         set_device: Callable[[int], None], what: str, visible_note: str) -> None:
    """Make device ``local_rank`` current for accelerators that run one rank per device.

    ``count`` devices are visible; none is an error, one means the launcher already narrowed
    visibility to this rank's device, and more ranks than devices on a node is refused.
    ``what`` names the device in messages ("CUDA device"); ``visible_note`` says how to check.
    """
    from .errors import AcceleratorUnavailableError

    if count == 0:
        raise AcceleratorUnavailableError(f"rank {local_rank} sees no {what} ({visible_note})")
    if count == 1:
        return
    if local_world_size > count:
        raise ConfigError(f"{local_world_size} ranks on this node but only {count} {what}s are "
                          f"visible: each rank needs its own; launch at most {count} ranks")
    set_device(local_rank % count)

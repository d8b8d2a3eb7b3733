"""The CPU communicator: a shared-memory ``all_reduce`` among the ranks of one node, gloo otherwise.

Why: under tensor parallelism every decode step all-reduces two small tensors per layer
(batch x hidden, e.g. 1 x 1024 fp32 = 4 KiB). A gloo all-reduce over TCP loopback pays a fixed
cost per call whatever the size, which is more than the layer's compute on a CPU. When all
ranks of the group live on one node, they can instead exchange the data through a shared-memory
segment and synchronise with flags in it: a small fraction of that cost plus the copies
(benchmarks/README.md, "Shared-memory all-reduce").

Selection (automatic, decided once at set-up, identically on every rank):

* the shared-memory path is used when every rank of the group is on the same node (same hostname
  and kernel boot id, gathered through gloo once), the CPU is x86-64 (see *Memory ordering* in
  the protocol's module), ``/dev/shm`` exists, every rank could map the segment rank 0 created, and
  ``$SHARDWISE_CPU_SHM_ALLREDUCE`` is not ``0`` (``0``/``false``/``no``/``off`` disables it;
  ``1``/``true``/``yes``/``on`` or unset: automatic);
* per call, a CPU tensor of a supported dtype (float32/64, bfloat16, float16, int8..int64, uint8)
  whose size is at most the slot size goes through shared memory; anything else goes to gloo.
  Ops: sum, avg (floating dtypes), max, min, product. The slot size is
  ``$SHARDWISE_CPU_SHM_SLOT_BYTES`` (rounded up to 4 KiB), by default 4 MiB, shrunk (down to
  64 KiB) so the segment, 2 x ranks x slot, takes at most a quarter of the free space of /dev/shm
  (containers often get only 64 MiB there). The shared-memory path beat gloo at every size
  measured (benchmarks/README.md, "Shared-memory all-reduce"), so the limit only bounds memory.

:attr:`CpuCommunicator.shm_reason` says why the shared-memory path is off ("" when on);
:attr:`CpuCommunicator.path_counts` counts the calls each path served and
:attr:`CpuCommunicator.last_path` names the last one (for tests and benchmarks).

How the ranks exchange the data (segment layout, the flag protocol, memory ordering, cleanup) is
:mod:`shardwise.accelerators.cpu_shm_protocol`.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from shardwise.accelerators.cpu_shm_protocol import setup_shm_allreduce
from shardwise.communicator import TorchDistCommunicator, _reduce_op
from shardwise.errors import CollectiveError


# ----- the communicator ---------------------------------------------------------------------------

class CpuCommunicator(TorchDistCommunicator):
    """gloo collectives, plus a shared-memory ``all_reduce`` when all ranks share one node.

    Attributes for tests and benchmarks: ``shm_enabled``; ``shm_reason`` (why the shared-memory
    path is off, "" when on); ``shm_max_bytes`` (largest tensor it takes, 0 when off);
    ``path_counts`` ({"shm": calls, "gloo": calls} of ``all_reduce``) and ``last_path``.
    """

    def __init__(self, accelerator, timeout_s: float, owns_group: bool) -> None:
        super().__init__(accelerator, timeout_s, owns_group)
        self.path_counts = {"shm": 0, "gloo": 0}
        self.last_path = ""
        self._shm, self.shm_reason = setup_shm_allreduce(self.rank, self.world_size,
                                                          self.timeout_s, self._run)
        self.handle = _register(self)  # how the compiled-step op finds this communicator

    @property
    def shm_enabled(self) -> bool:
        return self._shm is not None

    @property
    def shm_max_bytes(self) -> int:
        return self._shm.slot_bytes if self._shm is not None else 0

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place; through shared memory when the tensor fits (see the module notes).

        Traced by ``torch.compile`` (the CPU graph strategy under tensor parallelism) it is the
        opaque op ``shardwise::cpu_all_reduce``, which returns the reduced tensor instead (use
        the return value, as the row-parallel hooks do)."""
        if torch.compiler.is_compiling():
            return torch.ops.shardwise.cpu_all_reduce(tensor, op, self.handle)
        _reduce_op(op)  # an unknown op is a ConfigError on either path
        shm = self._shm
        if shm is not None and shm.fits(tensor, op):
            self.before_collective()
            shm.all_reduce(tensor, op)
            self.path_counts["shm"] += 1
            self.last_path = "shm"
            return tensor
        return self.gloo_all_reduce(tensor, op)

    def gloo_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """The plain gloo all_reduce, whatever the size (benchmarks compare the two paths)."""
        self.path_counts["gloo"] += 1
        self.last_path = "gloo"
        return super().all_reduce(tensor, op)

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """gloo's all-to-all; traced by ``torch.compile`` (an expert-parallel decode step with
        ``dispatch="all_to_all"``) the opaque op ``shardwise::cpu_all_to_all``."""
        if torch.compiler.is_compiling():
            return torch.ops.shardwise.cpu_all_to_all(tensor, self.handle)
        return super().all_to_all(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """gloo's all-gather; traced by ``torch.compile`` the opaque op
        ``shardwise::cpu_all_gather``."""
        if torch.compiler.is_compiling():
            return torch.ops.shardwise.cpu_all_gather(tensor, dim, self.world_size, self.handle)
        return super().all_gather(tensor, dim)

    def release_buffers(self) -> None:
        """Unmap this rank's shared-memory segment (its creator also unlinks it); later
        all-reduces take gloo. The process group stays."""
        if self._shm is not None:
            self._shm.close()
            self._shm = None
            self.shm_reason = "released (engine.close())"

    def close(self) -> None:
        self.release_buffers()
        _COMMUNICATORS.pop(self.handle, None)
        super().close()


# ----- the all-reduce inside a compiled step ---------------------------------------------------

#: handle → live communicator, for the op below (an op's arguments cannot be Python objects)
_COMMUNICATORS: "weakref.WeakValueDictionary[int, CpuCommunicator]" = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)


def _register(comm: CpuCommunicator) -> int:
    handle = next(_next_handle)
    _COMMUNICATORS[handle] = comm
    return handle


@torch.library.custom_op("shardwise::cpu_all_reduce", mutates_args=(), device_types="cpu")
def _all_reduce_op(tensor: torch.Tensor, op: str, handle: int) -> torch.Tensor:
    """:meth:`CpuCommunicator.all_reduce` of a copy of ``tensor`` (the op is functional, so the
    compiler may order and fuse around it; the copy is batch x hidden per call)."""
    comm = _COMMUNICATORS.get(handle)
    if comm is None:
        raise CollectiveError(f"the compiled step's all-reduce uses communicator {handle}, which "
                              f"is closed; capture the step again after init_inference")
    out = tensor.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, op)
    return out


@_all_reduce_op.register_fake
def _(tensor, op, handle):
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


def _live(handle: int) -> CpuCommunicator:
    comm = _COMMUNICATORS.get(handle)
    if comm is None:
        raise CollectiveError(f"the compiled step's collective uses communicator {handle}, which "
                              f"is closed; capture the step again after init_inference")
    return comm


@torch.library.custom_op("shardwise::cpu_all_to_all", mutates_args=(), device_types="cpu")
def _all_to_all_op(tensor: torch.Tensor, handle: int) -> torch.Tensor:
    """:meth:`CpuCommunicator.all_to_all` inside a compiled step (same shape out as in)."""
    return _live(handle).all_to_all(tensor)


@_all_to_all_op.register_fake
def _(tensor, handle):
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


@torch.library.custom_op("shardwise::cpu_all_gather", mutates_args=(), device_types="cpu")
def _all_gather_op(tensor: torch.Tensor, dim: int, world: int, handle: int) -> torch.Tensor:
    """:meth:`CpuCommunicator.all_gather` inside a compiled step (``dim`` grows ``world``
    times)."""
    return _live(handle).all_gather(tensor, dim)


@_all_gather_op.register_fake
def _(tensor, dim, world, handle):
    shape = list(tensor.shape)
    shape[dim] *= world
    return torch.empty(shape, dtype=tensor.dtype, device=tensor.device)

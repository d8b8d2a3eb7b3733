"""The communicator interface: the collectives the engine needs, over torch.distributed.

The accelerator chooses the class (``Accelerator.communicator_class``) so a device can add hooks
around collectives (HPU marks a lazy-mode step first). World size 1 needs no process group:
:class:`LocalCommunicator` answers every collective locally. Every process group is created with a
timeout, so a dead rank makes the others fail with :class:`CollectiveError` instead of hanging.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch
import torch.distributed as dist

from .errors import CollectiveError, ConfigError

if TYPE_CHECKING:
    from .accelerator import Accelerator

#: Default collective timeout in seconds (override with ``comm_timeout=`` or this variable).
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "SHARDWISE_COMM_TIMEOUT"

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT}


class Communicator:
    """Collectives over a group of ``world_size`` ranks. Tensors are modified in place where the
    collective is in place (``all_reduce``, ``broadcast``); others return new tensors."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` (same shape on all ranks) along ``dim``."""
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Split ``tensor`` into ``world_size`` chunks along dim 0; chunk i goes to rank i, and
        the result stacks the chunks received, in rank order (same shape as the input)."""
        raise NotImplementedError

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Point-to-point: send ``tensor`` (contiguous) to rank ``dst``, which must call
        :meth:`recv` with a tensor of the same shape and dtype (pipeline stages)."""
        raise NotImplementedError

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Point-to-point: receive into ``tensor`` (contiguous, in place) from rank ``src``;
        returns it."""
        raise NotImplementedError

    def isend(self, tensor: torch.Tensor, dst: int) -> "PendingOp":
        """:meth:`send` started in the background: the returned op's ``wait()`` completes it
        (keep ``tensor`` unchanged until then). Default: a blocking :meth:`send`."""
        self.send(tensor, dst)
        return PendingOp()

    def irecv(self, tensor: torch.Tensor, src: int) -> "PendingOp":
        """:meth:`recv` started in the background into ``tensor``, which holds the data once
        the returned op's ``wait()`` returns. Default: a blocking :meth:`recv`."""
        self.recv(tensor, src)
        return PendingOp()

    def release_buffers(self) -> None:
        """Free what this communicator holds for its collectives beyond the process group (the
        CPU one's shared-memory segment); the group stays, and collectives still work, by the
        default path. ``engine.close()`` calls it. Default: nothing to free."""

    def close(self) -> None:
        """Release the process group if this communicator created it."""


class PendingOp:
    """A point-to-point op in flight (:meth:`Communicator.isend` / :meth:`~Communicator.irecv`).
    ``wait()`` blocks until it completed, under the communicator's timeout and error naming
    (:class:`CollectiveError`); an op made without ``work`` is already complete."""

    def __init__(self, run=None, name: str = "", work=None) -> None:
        self._run, self._name, self._work = run, name, work

    def wait(self) -> None:
        if self._work is not None:
            work, self._work = self._work, None
            self._run(self._name, work.wait)


class LocalCommunicator(Communicator):
    """World size 1: every collective is the identity, no process group exists."""

    def all_reduce(self, tensor, op="sum"):
        _reduce_op(op)
        return tensor

    def all_gather(self, tensor, dim=0):
        return tensor.clone()

    def broadcast(self, tensor, src=0):
        if src != 0:
            raise CollectiveError(f"broadcast from rank {src} in a world of size 1")
        return tensor

    def barrier(self):
        return None

    def all_to_all(self, tensor):
        return tensor.clone()

    def send(self, tensor, dst):
        raise CollectiveError(f"send to rank {dst} in a world of size 1")

    def recv(self, tensor, src):
        raise CollectiveError(f"recv from rank {src} in a world of size 1")


def _reduce_op(op: str):
    try:
        return _REDUCE_OPS[op]
    except KeyError:
        raise ConfigError(f"unknown reduce op {op!r}; use one of {', '.join(_REDUCE_OPS)}") from None


class TorchDistCommunicator(Communicator):
    """Collectives over the default ``torch.distributed`` process group."""

    def __init__(self, accelerator: "Accelerator", timeout_s: float, owns_group: bool) -> None:
        self.accelerator = accelerator
        self.timeout_s = timeout_s
        self.owns_group = owns_group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = _env_int("LOCAL_RANK", os.environ, default=self.rank)
        self.local_world_size = _env_int("LOCAL_WORLD_SIZE", os.environ, default=self.world_size,
                                         minimum=1)

    def before_collective(self) -> None:
        """Hook run before every collective (devices override; default: nothing)."""

    def _run(self, name: str, fn, *args, **kwargs):
        self.before_collective()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise CollectiveError(
                f"{name} failed on rank {self.rank}/{self.world_size} "
                f"(backend {dist.get_backend()}, timeout {self.timeout_s:g}s): {exc}. Another rank "
                f"probably died or stopped calling collectives; check its log.") from exc

    def all_reduce(self, tensor, op="sum"):
        self._run("all_reduce", dist.all_reduce, tensor, op=_reduce_op(op))
        return tensor

    def all_gather(self, tensor, dim=0):
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._run("all_gather", dist.all_gather, parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

    # src / dst are ranks of this communicator's group (group_src / group_dst: for the default
    # group, the world ranks themselves)
    def broadcast(self, tensor, src=0):
        self._run("broadcast", dist.broadcast, tensor, group_src=src)
        return tensor

    def barrier(self):
        self._run("barrier", dist.barrier)

    def all_to_all(self, tensor):
        if tensor.shape[0] % self.world_size:
            raise CollectiveError(f"all_to_all needs dim 0 ({tensor.shape[0]}) divisible by the "
                                  f"number of ranks, {self.world_size}")
        inputs = list(tensor.contiguous().chunk(self.world_size))
        outputs = [torch.empty_like(c) for c in inputs]
        self._run("all_to_all", dist.all_to_all, outputs, inputs)
        return torch.cat(outputs)

    def send(self, tensor, dst):
        # gloo and nccl time a point-to-point op out like a collective (the group's timeout)
        self._run("send", dist.send, tensor, group_dst=dst)

    def recv(self, tensor, src):
        self._run("recv", dist.recv, tensor, group_src=src)
        return tensor

    def isend(self, tensor, dst):
        return PendingOp(self._wait, "isend", self._run("isend", dist.isend, tensor,
                                                        group_dst=dst))

    def irecv(self, tensor, src):
        return PendingOp(self._wait, "irecv", self._run("irecv", dist.irecv, tensor,
                                                        group_src=src))

    def _wait(self, name: str, wait):
        """A pending op's ``wait`` under this communicator's timeout and error naming."""
        return self._run(name, wait)

    def close(self):
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


class GroupCommunicator(TorchDistCommunicator):
    """Collectives over a subset of the world's ranks (a tensor-parallel group inside one
    pipeline stage, or the pipeline group of one tp coordinate: :meth:`shardwise.plan.Plan.bind`).

    Ranks are the group's: :attr:`rank` is this process's index in :attr:`ranks` (the world
    ranks of the group, in order), and ``src`` / ``dst`` arguments are group ranks. Every call
    goes through the world communicator's ``_run`` (its device hook, its timeout, its
    :class:`CollectiveError` naming the rank), on the group's own process group: plain
    ``torch.distributed`` collectives, not a device's special paths (the CPU shared-memory
    all-reduce spans the world's ranks). Built by :func:`subgroups`; closing it leaves the
    world's process group alone.
    """

    def __init__(self, world: TorchDistCommunicator, ranks: tuple[int, ...], group) -> None:
        self.world, self.ranks, self.group = world, ranks, group
        self.accelerator, self.timeout_s, self.owns_group = world.accelerator, world.timeout_s, False
        self.rank = ranks.index(world.rank)
        self.world_size = len(ranks)
        self.local_rank, self.local_world_size = world.local_rank, world.local_world_size

    def _run(self, name: str, fn, *args, **kwargs):
        return self.world._run(f"{name} in the group of ranks {list(self.ranks)}", fn, *args,
                               group=self.group, **kwargs)

    def _wait(self, name: str, wait):
        return self.world._run(f"{name} in the group of ranks {list(self.ranks)}", wait)


def subgroups(world: Communicator, groups: list[tuple[int, ...]]) -> Communicator:
    """This rank's :class:`GroupCommunicator` among ``groups`` (world ranks; together they
    partition the world). Every rank must call it with the same ``groups`` in the same order
    (``torch.distributed.new_group`` is collective over the world). A group that is the whole
    world is ``world`` itself."""
    if len(groups) == 1 and len(groups[0]) == world.world_size:
        return world
    mine = None
    for ranks in groups:
        group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=world.timeout_s))
        if world.rank in ranks:
            mine = GroupCommunicator(world, tuple(ranks), group)
    if mine is None:
        raise ConfigError(f"rank {world.rank} is in none of the groups {groups}")
    return mine


def check_timeout(value, name: str = "comm_timeout") -> float:
    """``value`` as seconds if it is a finite number > 0 (not a bool), else ConfigError."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ConfigError(f"{name} must be a positive, finite number of seconds (e.g. 300), got "
                          f"{value!r}")
    return float(value)


def resolve_timeout(timeout_s: float | None) -> float:
    """The collective timeout: the argument, else ``$SHARDWISE_COMM_TIMEOUT``, else the default.
    A bad argument or variable is a :class:`ConfigError` naming it and what is accepted."""
    if timeout_s is not None:
        return check_timeout(timeout_s)
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]!r} must be a positive, finite "
                          f"number of seconds (e.g. 300); set it so, or unset it for the "
                          f"default of {DEFAULT_TIMEOUT_S:g}s")
    return value


@dataclass(frozen=True)
class EnvWorld:
    """The ranks torchrun's variables describe (``None`` where a variable is unset)."""

    world_size: int
    rank: int | None
    local_rank: int | None
    local_world_size: int | None


def _env_int(name: str, environ: Mapping[str, str], default: int | None = None,
             minimum: int = 0) -> int | None:
    """Integer variable ``name`` (``default`` when unset); ConfigError if not an integer >=
    ``minimum``."""
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(f"{name}={raw!r} must be an integer >= {minimum} (torchrun and "
                          f"`shardwise launch` set it for every rank); fix or unset it")
    return value


def env_world(environ: Mapping[str, str] | None = None) -> EnvWorld:
    """WORLD_SIZE, RANK, LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun sets them, checked against
    each other (ConfigError naming the variable, its value and what is accepted). Without
    WORLD_SIZE the process runs alone (world 1) and the rank variables are not read."""
    environ = os.environ if environ is None else environ
    world = _env_int("WORLD_SIZE", environ, minimum=1)
    if world is None:
        return EnvWorld(1, None, None, None)
    rank = _env_int("RANK", environ)
    local_rank = _env_int("LOCAL_RANK", environ)
    local_world = _env_int("LOCAL_WORLD_SIZE", environ, minimum=1)
    if rank is not None and rank >= world:
        raise ConfigError(f"RANK={rank} is not a rank of WORLD_SIZE={world}: ranks are 0 .. "
                          f"{world - 1}; start the ranks with torchrun or `shardwise launch`, "
                          f"which set both")
    if local_world is not None and local_world > world:
        raise ConfigError(f"LOCAL_WORLD_SIZE={local_world} is more than WORLD_SIZE={world}: "
                          f"a node cannot hold more ranks than the world")
    if local_rank is not None and local_rank >= (local_world or world):
        which = (f"LOCAL_WORLD_SIZE={local_world}" if local_world is not None
                 else f"WORLD_SIZE={world}")
        raise ConfigError(f"LOCAL_RANK={local_rank} is not a local rank of {which}: local "
                          f"ranks are 0 .. {(local_world or world) - 1}")
    return EnvWorld(world, rank, local_rank, local_world)


def world_size_from_env() -> int:
    """WORLD_SIZE as torchrun sets it (1 when absent); the rank variables are checked too."""
    return env_world().world_size


def create_communicator(accelerator: "Accelerator", timeout_s: float | None = None) -> Communicator:
    """A communicator for this process: local at world size 1, else a process group set up from
    torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) with the accelerator's backend.
    An already-initialised default group is reused (and not destroyed by ``close``)."""
    timeout = resolve_timeout(timeout_s)
    if world_size_from_env() <= 1 and not dist.is_initialized():
        return LocalCommunicator()
    owns = not dist.is_initialized()
    if owns:
        env = env_world()
        local_rank = env.local_rank if env.local_rank is not None else 0
        local_world = env.local_world_size or env.world_size
        accelerator.configure_process(local_rank, local_world)
        dist.init_process_group(backend=accelerator.communication_backend,
                                timeout=datetime.timedelta(seconds=timeout))
    return accelerator.communicator_class()(accelerator, timeout, owns)

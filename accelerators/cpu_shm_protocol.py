"""The shared-memory all-reduce protocol of the CPU communicator
(:class:`~shardwise.accelerators.cpu_comm.CpuCommunicator`): the segment in /dev/shm, its layout
and naming, the flag protocol of one call, waiting on peers, sweeping segments of dead creators,
and the set-up handshake. The communicator decides when to use it and falls back to gloo.

Segment layout (one file in /dev/shm, all int64 words little-endian; ``n`` ranks):

====================  ==========================================================================
bytes 0..63           header: magic, layout version, n, slot bytes, random token
64 + 128 r            rank r's line (128 bytes, so no two writers share a cache line or the
                      adjacent-line prefetch pair): word 0 = flag (sequence number of the last
                      call whose data rank r has published; only ever grows), words 1-2 = the
                      call's metadata (numel, dtype, op) for parity 0 and 1, word 3 = state
                      (0 running, 1 closed, 2 aborted after a failed call), word 4 = 1 once
                      rank r has mapped the segment (set-up's handshake)
data (4 KiB aligned)  two buffers (parity 0/1) x n slots of ``slot bytes``; slot (p, r) is written
                      only by rank r, in calls whose sequence number has parity p
====================  ==========================================================================

Protocol of call number ``k`` (k = 1, 2, ...; parity p = k mod 2) on rank r:

1. copy the input into slot (p, r), write metadata (p, r), then bump flag r to k;
2. wait until every flag is >= k (spin, then yield, then short sleeps; liveness checks and the
   communicator's timeout bound the wait, so a dead rank raises :class:`CollectiveError`);
3. check every rank's metadata agrees, then reduce slots (p, 0), (p, 1), ..., (p, n-1) in rank
   order into the caller's tensor (float16/bfloat16 accumulate in float32 when n > 2 or for avg).
   Every rank runs the same elementwise ops on the same bytes, so results are bit-identical.

Why one flag round suffices: rank r reaches call k+2 (which overwrites buffer p again) only after
finishing call k+1, which needed every flag >= k+1, i.e. every rank had *finished* call k, reads of
buffer p included. Flags therefore never differ by more than one, and parity double-buffering
replaces a second "done reading" round.

Memory ordering (the non-obvious part): the protocol needs (a) the data and metadata stores of
step 1 to become visible to other cores before the flag store, and (b) a reader's loads of the
slots to happen after its load of the flag, and (c) its slot loads of call k to complete before its
flag store of call k+1 (the writer reuses the buffer after seeing it). On x86-64 (TSO) stores
become visible in program order, loads are not reordered with older loads and stores are not
reordered with older loads, so (a)-(c) hold for ordinary stores. The one exception is
non-temporal (streaming) stores, which a large memcpy may use; before bumping the flag we
therefore execute a LOCK-prefixed read-modify-write (the atomic compare-and-swap / add CPython uses
to acquire and release a ``threading.Lock``, see :func:`_store_fence`), which on x86 is a full
fence that also drains write-combining buffers. Python cannot emit a fence otherwise. Aligned
8-byte stores/loads (a ``memoryview`` of format ``q``) are single, untorn ``mov`` instructions on
x86-64. On weakly ordered CPUs (ARM, POWER, RISC-V) none of this holds: a store may become visible
before an earlier one and a lock's acquire/release are one-way barriers, not the ``dmb`` the
protocol would need, so the shared-memory path is disabled there (gloo is used) until a native
fence is available.

Cleanup: rank 0 creates ``/dev/shm/shardwise-allreduce-<MASTER_PORT>-n<pid namespace>-p<pid>-
s<start time>-<random token>`` (exclusive create, so concurrent jobs never collide; the creator's
pid, its start time and its PID namespace are in the name) and unlinks it as soon as every rank
has mapped it: the memory then lives exactly as long as the mappings, and nothing is left in
/dev/shm even if a rank is killed with SIGKILL later. The name is visible only during a bounded
handshake: each rank marks its line once it has mapped the segment, and rank 0 unlinks when
every mark is there, when every rank has reported (through gloo) that it could not map it, or
after ``min(timeout, 30 s)``, whichever comes first (a late rank then finds no file and every
rank falls back to gloo). If set-up fails, rank 0 unlinks at once; an ``atexit`` hook covers an
exception in between. What neither covers is rank 0 killed (SIGKILL, OOM killer) inside that
window: the file would stay until reboot. So every creation first sweeps /dev/shm: a segment
whose creator (same PID namespace) is gone, or whose pid now belongs to a process with another
start time, is unlinked (:func:`sweep_dead_segments`). Segments of other PID namespaces
(containers sharing /dev/shm) are left alone: their pids mean nothing here.
:meth:`CpuCommunicator.close` unmaps the segment.
"""

from __future__ import annotations

import atexit
import mmap
import os
import platform
import re
import secrets
import socket
import threading
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from shardwise.errors import CollectiveError, ConfigError

#: ``0``/``false``/``no``/``off`` disables the shared-memory all_reduce (``1`` or unset: automatic).
ENABLE_ENV = "SHARDWISE_CPU_SHM_ALLREDUCE"
#: Largest tensor (bytes) the shared-memory path takes; larger ones go to gloo.
SLOT_BYTES_ENV = "SHARDWISE_CPU_SHM_SLOT_BYTES"
#: Slot size without the variable, if /dev/shm has room (see :func:`default_slot_bytes`).
DEFAULT_SLOT_BYTES = 4 << 20
MIN_DEFAULT_SLOT_BYTES = 64 << 10
SHM_DIR = "/dev/shm"

#: dtypes the shared-memory path reduces; their index is the dtype code in the metadata word.
SHM_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
#: reduce ops the shared-memory path implements; index = op code in the metadata word.
SHM_OPS: tuple[str, ...] = ("sum", "avg", "max", "min", "product")
_LOW_PRECISION = (torch.bfloat16, torch.float16)

_MAGIC = 0x5357_4152_5348_4D31  # "SWARSHM1"
_LAYOUT_VERSION = 1
_HEADER_BYTES = 64
_LINE_BYTES = 128  # one rank's flag + metadata; two cache lines (adjacent-line prefetch)
_PAGE = 4096
_STATE = 3  # word of a rank's line holding its state (the flag never goes backwards: a peer
# still spinning on it after the rank finished and closed must see the final value)
_CLOSED = 1
_ABORTED = 2
_ATTACHED = 4  # word of a rank's line set to 1 once it has mapped the segment

#: Name prefix of every segment in /dev/shm.
SEGMENT_PREFIX = "shardwise-allreduce-"
#: ``<prefix><tag>-n<pid namespace>-p<creator pid>-s<creator start time>-<token>``
_SEGMENT_NAME = re.compile(re.escape(SEGMENT_PREFIX)
                           + r"(?P<tag>.*)-n(?P<ns>\d+)-p(?P<pid>\d+)-s(?P<start>\d+)"
                             r"-(?P<token>[0-9a-f]{16})$")
#: Longest time the segment's name stays in /dev/shm while the ranks map it (see Cleanup).
_ATTACH_WAIT_S = 30.0

# Waiting policy: pure spinning for the first _SPIN_S (the peer is usually microseconds away),
# then sched_yield (free when nothing else wants the core; lets an oversubscribed peer run), then
# sleeps growing with the wait (a peer still computing, e.g. an uneven prefill), capped.
_SPIN_BATCH = 64  # flag reads between two clock reads
_SPIN_S = 100e-6
_YIELD_S = 2e-3
_MAX_SLEEP_S = 1e-3
_LIVENESS_EVERY_S = 0.05

_FENCE_LOCK = threading.Lock()


# ----- small helpers ------------------------------------------------------------------------------

def _store_fence() -> None:
    """Full memory fence on x86: CPython acquires/releases a ``threading.Lock`` with atomic
    read-modify-write instructions (``lock cmpxchg`` / ``lock xadd``: sem_trywait/sem_post, or
    PyMutex on 3.13+), and a LOCK-prefixed instruction orders every earlier store, non-temporal
    ones included, before every later one. (Only x86 reaches this code; see the module notes.)"""
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


def env_setting() -> bool:
    """Whether ``$SHARDWISE_CPU_SHM_ALLREDUCE`` allows the shared-memory path (unset: yes)."""
    raw = os.environ.get(ENABLE_ENV, "").strip().lower()
    if raw in ("", "1", "true", "yes", "on", "auto"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{ENABLE_ENV}={os.environ[ENABLE_ENV]!r} is not understood: set it to 0 to "
                      f"use gloo for every all_reduce, or 1 (or leave it unset) for the "
                      f"automatic choice")


def slot_bytes_setting() -> int | None:
    """The slot size ``$SHARDWISE_CPU_SHM_SLOT_BYTES`` asks for, rounded up to 4 KiB (None:
    unset, use :func:`default_slot_bytes`)."""
    raw = os.environ.get(SLOT_BYTES_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 < value <= 1 << 30:
        raise ConfigError(f"{SLOT_BYTES_ENV}={raw!r} must be a byte count between 1 and 2**30 "
                          f"(the largest tensor the shared-memory all_reduce takes)")
    return -(-value // _PAGE) * _PAGE


def default_slot_bytes(world: int, shm_free_bytes: int) -> int:
    """4 MiB, or less (a power of two, at least 64 KiB) so that the segment's 2 x ``world`` slots
    fill at most a quarter of ``shm_free_bytes``."""
    slot = DEFAULT_SLOT_BYTES
    while slot > MIN_DEFAULT_SLOT_BYTES and 2 * world * slot > shm_free_bytes // 4:
        slot //= 2
    return slot


def shm_free_bytes() -> int:
    """Free bytes in /dev/shm (for unprivileged users)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def memory_order_ok() -> tuple[bool, str]:
    """Whether this CPU's memory ordering lets the flag protocol run without a native fence."""
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        return True, ""
    return False, (f"CPU architecture {machine or 'unknown'} is not x86-64: its weak memory "
                   f"ordering needs a fence Python cannot emit")


def local_refusal() -> str:
    """Why this rank cannot use the shared-memory path ("" when it can)."""
    if not env_setting():
        return f"disabled by {ENABLE_ENV}={os.environ[ENABLE_ENV]}"
    ok, why = memory_order_ok()
    if not ok:
        return why
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist on this system"
    return ""


def node_identity() -> str:
    """Hostname and kernel boot id: equal on two processes only if they share a kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first); None if no such
    process. Other errors (no /proc, no permission) propagate as OSError."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rfind(")") + 2:].split()


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (None where /proc can't say)."""
    try:
        fields = _proc_stat(pid)
    except OSError:
        return None
    return int(fields[19]) if fields and len(fields) > 19 else None


def process_alive(pid: int, start_time: int) -> bool:
    """False when process ``pid`` has exited (gone, zombie, or a new process reusing the pid);
    True when /proc cannot tell (the timeout then decides)."""
    try:
        fields = _proc_stat(pid)
    except OSError:
        return True
    if fields is None:
        return False
    return fields[0] not in ("Z", "X") and int(fields[19]) == start_time


def pid_namespace() -> int:
    """Inode of this process's PID namespace (0 when /proc cannot say): equal pids mean the same
    process only within one namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_name(tag: str, token: int, pid: int | None = None) -> str:
    """The file name of a new segment: ``tag``, the creator's PID namespace, pid and start time
    (0 where unknown), and the random ``token``."""
    pid = os.getpid() if pid is None else pid
    start = process_start_time(pid) or 0
    return f"{SEGMENT_PREFIX}{tag}-n{pid_namespace()}-p{pid}-s{start}-{token:016x}"


def sweep_dead_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink the segments in ``directory`` whose creator has exited: same PID namespace as this
    process, and its pid is gone, a zombie, or a new process (another start time). Segments of
    live creators, of other namespaces, with an unknown start time or another naming scheme are
    kept. Returns the paths removed."""
    namespace = pid_namespace()
    removed = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith(SEGMENT_PREFIX)]
    except OSError:
        return removed
    for name in names:
        m = _SEGMENT_NAME.match(name)
        if m is None or namespace == 0 or int(m["ns"]) != namespace or m["start"] == "0":
            continue
        if process_alive(int(m["pid"]), int(m["start"])):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
        except OSError:  # gone already, or another user's (sticky /dev/shm)
            continue
        removed.append(path)
    return removed


# ----- the segment --------------------------------------------------------------------------------

class ShmSegment:
    """The mapped /dev/shm file: header, one line per rank, and 2 x ``world`` data slots.

    ``words`` is an int64 ``memoryview`` over header and lines (flags and metadata);
    :meth:`slot` returns tensor views onto the data slots.
    """

    def __init__(self, path: str, mm: mmap.mmap, world: int, slot_bytes: int, creator: bool):
        self.path = path
        self.world = world
        self.slot_bytes = slot_bytes
        self.creator = creator
        self._mm = mm
        self.data_offset = self.data_offset_for(world)
        self.words = memoryview(mm)[:self.data_offset].cast("q")
        # uint8 view of every data slot: [2 * world * slot_bytes] bytes, parity-major
        self._data = torch.frombuffer(mm, dtype=torch.uint8, offset=self.data_offset,
                                      count=2 * world * slot_bytes)
        self._linked = creator
        if creator:
            atexit.register(self.unlink)

    @staticmethod
    def data_offset_for(world: int) -> int:
        return -(-(_HEADER_BYTES + _LINE_BYTES * world) // _PAGE) * _PAGE

    @classmethod
    def size_for(cls, world: int, slot_bytes: int) -> int:
        return cls.data_offset_for(world) + 2 * world * slot_bytes

    @staticmethod
    def flag_index(rank: int) -> int:
        """Index into ``words`` of rank ``rank``'s flag (metadata at +1 + parity, state at +3,
        the attached mark at +4)."""
        return (_HEADER_BYTES + _LINE_BYTES * rank) // 8

    def mark_attached(self, rank: int) -> None:
        """Tell the creator that ``rank`` has mapped the segment (set-up's handshake)."""
        self.words[self.flag_index(rank) + _ATTACHED] = 1

    def attached(self, rank: int) -> bool:
        return self.words[self.flag_index(rank) + _ATTACHED] == 1

    @classmethod
    def create(cls, tag: str, world: int, slot_bytes: int) -> tuple["ShmSegment", int]:
        """Create, size and map a new segment; returns it and its random token. Segments left by
        creators that died before unlinking theirs are swept first (:func:`sweep_dead_segments`)."""
        sweep_dead_segments()
        token = secrets.randbits(62)
        path = os.path.join(SHM_DIR, segment_name(tag, token))
        size = cls.size_for(world, slot_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # reserve the pages now: on a full tmpfs this fails cleanly (ENOSPC) instead of a
            # SIGBUS at the first touch of an unbacked page in the middle of a collective
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        seg = cls(path, mm, world, slot_bytes, creator=True)
        header = (_MAGIC, _LAYOUT_VERSION, world, slot_bytes, token)
        for i, value in enumerate(header):
            seg.words[i] = value
        return seg, token

    @classmethod
    def open(cls, path: str, world: int, slot_bytes: int, token: int) -> "ShmSegment":
        """Map an existing segment and check it is the one rank 0 announced."""
        size = cls.size_for(world, slot_bytes)
        fd = os.open(path, os.O_RDWR)
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ValueError(f"{path} has {actual} bytes, expected {size}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        seg = cls(path, mm, world, slot_bytes, creator=False)
        expected = [_MAGIC, _LAYOUT_VERSION, world, slot_bytes, token]
        header = list(seg.words[:5])
        if header != expected:
            seg.close()
            raise ValueError(f"{path} holds another segment (header {header}, expected "
                             f"{expected})")
        return seg

    def slot(self, parity: int, rank: int, dtype: torch.dtype,
             shape: Sequence[int]) -> torch.Tensor:
        """A tensor of ``shape``/``dtype`` over the start of slot (parity, rank)."""
        start = (parity * self.world + rank) * self.slot_bytes
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        return self._data[start:start + nbytes].view(dtype).view(shape)

    def unlink(self) -> None:
        """Remove the file (creator only; idempotent). Existing mappings stay valid."""
        if self._linked:
            self._linked = False
            atexit.unregister(self.unlink)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap (after dropping our views of it). The creator also unlinks."""
        self.unlink()
        if self._mm is None:
            return
        self.words.release()
        self.words = None
        self._data = None
        try:
            self._mm.close()
        except BufferError:
            # a tensor view survives somewhere (e.g. a traceback frame): the mapping goes when
            # it does; the file is already unlinked, so nothing leaks past the process
            pass
        self._mm = None


# ----- the protocol -------------------------------------------------------------------------------

class ShmAllReduce:
    """One rank's side of the flag protocol over a :class:`ShmSegment` (see the module notes).

    ``liveness`` maps each peer rank to ``(pid, start_time)`` when this process can watch it
    through /proc (same PID namespace), so a dead peer fails a wait at once rather than at the
    timeout.
    """

    def __init__(self, segment: ShmSegment, rank: int, timeout_s: float,
                 liveness: dict[int, tuple[int, int]]):
        self.segment = segment
        self.rank = rank
        self.world = segment.world
        self.slot_bytes = segment.slot_bytes
        self.timeout_s = timeout_s
        self.seq = 0
        self._liveness = liveness
        self._peers = [r for r in range(self.world) if r != rank]
        self._flag_idx = [ShmSegment.flag_index(r) for r in range(self.world)]
        self._views: dict = {}
        self._failure: str | None = None
        self._dtype_codes = {d: i for i, d in enumerate(SHM_DTYPES)}
        self._op_codes = {o: i for i, o in enumerate(SHM_OPS)}

    # -- selection

    def fits(self, tensor: torch.Tensor, op: str) -> bool:
        """Whether this call can go through shared memory (same answer on every rank for the
        same call, since ranks pass tensors of equal shape and dtype)."""
        return (tensor.dtype in self._dtype_codes and op in self._op_codes
                and tensor.nbytes <= self.slot_bytes and tensor.device.type == "cpu"
                and tensor.layout == torch.strided
                and (op != "avg" or tensor.is_floating_point()))

    # -- one call

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        """Reduce ``tensor`` in place across the node's ranks (any shape; must :meth:`fit`)."""
        if self._failure is not None:
            raise CollectiveError(f"all_reduce failed on rank {self.rank}/{self.world}: the "
                                  f"shared-memory path already failed ({self._failure}); recreate "
                                  f"the communicator on every rank")
        if tensor.requires_grad:
            tensor = tensor.detach()  # same storage; in-place ops below must not see autograd
        if tensor.is_inference() and not torch.is_inference_mode_enabled():
            # an inference tensor (made under torch.inference_mode) may only be written in that
            # mode; gloo writes it from C++ and never notices, so we must not refuse it either
            with torch.inference_mode():
                return self.all_reduce(tensor, op)
        key = (tensor.dtype, tensor.shape)
        views = self._views.get(key) or self._make_views(key)
        seq = self.seq + 1
        parity = seq & 1
        slots = views[parity]  # n tensors shaped like `tensor`, slot (parity, r) for rank r
        words = self.segment.words
        meta = self._meta(tensor, op)
        flag = self._flag_idx[self.rank]
        # 1. publish: data and metadata first, fence, then the flag (readers trust the flag)
        slots[self.rank].copy_(tensor)
        words[flag + 1 + parity] = meta
        _store_fence()
        words[flag] = seq
        self.seq = seq
        # 2. wait for every rank's flag >= seq (loads: flag before data, TSO keeps that order)
        for r in self._peers:
            if words[self._flag_idx[r]] < seq:
                self._wait_for(r, seq)
        # 3. check agreement, reduce in rank order (identical on every rank). These slot loads
        # complete before our next flag store (x86 does not reorder stores before older loads),
        # which is what lets a peer reuse this buffer two calls from now
        self._check_meta(parity, meta)
        reduce_into(tensor, slots, op)

    def _make_views(self, key) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dtype, shape = key
        if len(self._views) >= 64:  # shapes seen in decode repeat; don't grow without bound
            self._views.clear()
        # normal tensors even when the first call comes under torch.inference_mode: an inference
        # view could not be written by later calls outside that mode
        with torch.inference_mode(False):
            views = tuple([self.segment.slot(p, r, dtype, shape) for r in range(self.world)]
                          for p in (0, 1))
        self._views[key] = views
        return views

    def _meta(self, tensor: torch.Tensor, op: str) -> int:
        """One int64 naming the call: numel << 16 | dtype code << 8 | op code."""
        return (tensor.numel() << 16) | (self._dtype_codes[tensor.dtype] << 8) | self._op_codes[op]

    @staticmethod
    def _describe(meta: int) -> str:
        dtype = SHM_DTYPES[(meta >> 8) & 0xFF] if ((meta >> 8) & 0xFF) < len(SHM_DTYPES) else "?"
        op = SHM_OPS[meta & 0xFF] if (meta & 0xFF) < len(SHM_OPS) else "?"
        return f"{meta >> 16} x {str(dtype).removeprefix('torch.')} ({op})"

    def _check_meta(self, parity: int, meta: int) -> None:
        """Raise if a rank passed another tensor/op, or gave up on this call after publishing
        its data (it raised to its caller, so this rank must not succeed silently)."""
        words = self.segment.words
        for r in self._peers:
            if words[self._flag_idx[r] + _STATE] == _ABORTED:
                self._fail(self.seq, f"rank {r} aborted after its own collective failed")
        metas = [words[i + 1 + parity] for i in self._flag_idx]
        if any(m != meta for m in metas):
            # every rank sees the same metadata, so every rank raises here: the protocol state
            # stays consistent and later calls can go on
            calls = ", ".join(f"rank {r}: {self._describe(m)}" for r, m in enumerate(metas))
            raise CollectiveError(
                f"all_reduce failed on rank {self.rank}/{self.world}: ranks passed different "
                f"tensors or ops ({calls}). Every rank must all_reduce tensors of the same shape "
                f"and dtype with the same op, in the same order.")

    # -- waiting

    def _wait_for(self, rank: int, seq: int) -> None:
        """Spin until ``rank``'s flag reaches ``seq``; back off, watch liveness, time out."""
        words = self.segment.words
        idx = self._flag_idx[rank]
        start = time.perf_counter()
        next_liveness = start + _LIVENESS_EVERY_S
        while True:
            for _ in range(_SPIN_BATCH):
                if words[idx] >= seq:
                    return
            now = time.perf_counter()
            waited = now - start
            if waited < _SPIN_S:
                continue
            if waited > self.timeout_s:
                self._fail(seq, f"timed out after {self.timeout_s:g}s")
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_EVERY_S
                self._check_peers(seq)
            if waited < _YIELD_S:
                os.sched_yield()
            else:
                time.sleep(min(_MAX_SLEEP_S, waited / 20))

    def _missing(self, seq: int) -> list[int]:
        words = self.segment.words
        return [r for r in self._peers if words[self._flag_idx[r]] < seq]

    def _check_peers(self, seq: int) -> None:
        """Raise at once if a rank we wait for has exited, closed, or aborted."""
        words = self.segment.words
        for r in self._missing(seq):
            state = words[self._flag_idx[r] + _STATE]
            if state == _CLOSED:
                self._fail(seq, f"rank {r} closed its communicator")
            if state == _ABORTED:
                self._fail(seq, f"rank {r} aborted after its own collective failed")
            if r in self._liveness and not process_alive(*self._liveness[r]):
                self._fail(seq, f"rank {r} (pid {self._liveness[r][0]}) has exited")

    def _fail(self, seq: int, what: str) -> None:
        """Mark this rank aborted (so peers fail fast too) and raise CollectiveError."""
        missing = self._missing(seq)
        self._failure = f"call {seq}: {what}"
        self.segment.words[self._flag_idx[self.rank] + _STATE] = _ABORTED
        waited = f"waited for rank(s) {missing} in call {seq} and" if missing else \
            f"finished call {seq}, but"
        raise CollectiveError(
            f"all_reduce failed on rank {self.rank}/{self.world} (shared-memory path, timeout "
            f"{self.timeout_s:g}s): rank {self.rank} {waited} {what}. Another rank probably died "
            f"or stopped calling collectives; check its log.")

    def close(self) -> None:
        """Tell peers we are gone, drop our views, unmap the segment."""
        if self.segment.words is not None and self._failure is None:
            self.segment.words[self._flag_idx[self.rank] + _STATE] = _CLOSED
        self._views.clear()
        self.segment.close()


def reduce_into(out: torch.Tensor, slots: list[torch.Tensor], op: str) -> None:
    """``out`` = slots[0] op slots[1] op ... in rank order (all shaped like ``out``).

    float16/bfloat16 accumulate in float32 beyond two operands and for avg (with two operands
    torch already computes each element in float32 and rounds once, the same thing)."""
    n = len(slots)
    if op in ("sum", "avg"):
        if out.dtype in _LOW_PRECISION and (n > 2 or op == "avg"):
            acc = slots[0].float()
            for s in slots[1:]:
                acc.add_(s)
            if op == "avg":
                acc.div_(n)
            out.copy_(acc)
            return
        torch.add(slots[0], slots[1], out=out)
        for s in slots[2:]:
            out.add_(s)
        if op == "avg":
            out.div_(n)
        return
    if op == "product" and out.dtype in _LOW_PRECISION and n > 2:
        acc = slots[0].float()
        for s in slots[1:]:
            acc.mul_(s)
        out.copy_(acc)
        return
    fn = {"max": torch.maximum, "min": torch.minimum, "product": torch.mul}[op]
    fn(slots[0], slots[1], out=out)
    for s in slots[2:]:
        fn(out, s, out=out)


# ----- set-up (collective, through gloo, once) ----------------------------------------------------

def setup_shm_allreduce(rank: int, world: int, timeout_s: float,
                        run: Callable) -> tuple[ShmAllReduce | None, str]:
    """Decide (identically on every rank) whether the shared-memory path runs; set it up if so.

    ``run(what, fn, *args, **kwargs)`` runs one collective of the group (``torch.distributed``
    ``fn``) as the communicator runs its own (its failures named ``what``); ``timeout_s`` bounds
    every wait of the protocol. Returns the protocol object and "" on success, else None and the
    reason. Uses three gloo collectives; every rank takes the same branches because each
    decision follows a gather.
    """
    if world < 2:
        return None, "a single rank has nothing to exchange"
    slot_bytes = slot_bytes_setting()  # parsed on every rank: a bad value fails all alike
    me = {"refusal": local_refusal(), "node": node_identity(), "pid": os.getpid(),
          "start": process_start_time(os.getpid())}
    infos: list = [None] * world
    run("all_reduce set-up", dist.all_gather_object, infos, me)
    for r, info in enumerate(infos):
        if info["refusal"]:
            return None, f"rank {r}: {info['refusal']}"
    nodes = {info["node"] for info in infos}
    if len(nodes) > 1:
        return None, f"the {world} ranks span {len(nodes)} nodes (shared memory needs one node)"

    # rank 0 creates the segment and announces it
    segment = None
    if rank == 0:
        try:
            if slot_bytes is None:
                slot_bytes = default_slot_bytes(world, shm_free_bytes())
            segment, token = ShmSegment.create(os.environ.get("MASTER_PORT", "0"), world,
                                               slot_bytes)
            offer = {"path": segment.path, "token": token, "slot_bytes": slot_bytes, "error": ""}
        except OSError as exc:
            offer = {"path": None, "error": f"rank 0 could not create a segment in {SHM_DIR}: "
                                            f"{exc}"}
    else:
        offer = None
    box = [offer]
    run("all_reduce set-up", dist.broadcast_object_list, box, src=0)
    offer = box[0]
    if offer["path"] is None:
        return None, offer["error"]

    # the others map it and mark their line; rank 0 unlinks the name as soon as every rank has
    # mapped it or reported that it could not (bounded: see the module's Cleanup notes)
    error = ""
    if rank != 0:
        try:
            segment = ShmSegment.open(offer["path"], world, offer["slot_bytes"], offer["token"])
            segment.mark_attached(rank)
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    # peers this process can watch through /proc (same PID namespace, same start time)
    liveness = {r: (info["pid"], info["start"]) for r, info in enumerate(infos)
                if r != rank and info["start"] is not None
                and process_start_time(info["pid"]) == info["start"]}
    failed_flags = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]  # [1] per rank
    work = run("all_reduce set-up", dist.all_gather, failed_flags,
                     torch.tensor([int(bool(error))], dtype=torch.int32), async_op=True)
    if rank == 0:
        _unlink_when_attached(segment, work, liveness, min(timeout_s, _ATTACH_WAIT_S))
    run("all_reduce set-up", work.wait)
    if any(int(f.item()) for f in failed_flags):
        errors: list = [None] * world
        run("all_reduce set-up", dist.all_gather_object, errors, error)
        if segment is not None:
            segment.close()  # the creator also unlinks
        r, e = next((r, e) for r, e in enumerate(errors) if e)
        return None, f"rank {r} could not map {offer['path']}: {e}"
    return ShmAllReduce(segment, rank, timeout_s, liveness), ""


def _unlink_when_attached(segment: ShmSegment, work, liveness: dict[int, tuple[int, int]],
                          wait_s: float) -> None:
    """Rank 0's side of the handshake: unlink the segment's name once every peer has marked its
    line, every rank has reported through gloo (``work`` done: some peer could not map it), a
    watched peer (``liveness``: rank → (pid, start time)) has exited, or ``wait_s`` has passed,
    whichever comes first. Unlinks even if this is interrupted."""
    peers = range(1, segment.world)
    start = time.monotonic()
    next_liveness = start + _LIVENESS_EVERY_S
    try:
        while (now := time.monotonic()) < start + wait_s:
            if all(segment.attached(r) for r in peers) or work.is_completed():
                return
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_EVERY_S
                if not all(process_alive(*liveness[r]) for r in liveness):
                    return
            time.sleep(0 if now - start < _YIELD_S else 1e-3)
    finally:
        segment.unlink()

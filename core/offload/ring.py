"""The ring: ``buffer_count`` slots the streamed units are read into, ahead of their compute.

A unit (a decoder layer, an embedding, a row chunk of a head: the *pieces* of
:mod:`shardwise.offload.transform` and :mod:`shardwise.offload.chunks`) runs from one slot; the
slots are the size of the largest decoder layer.
:meth:`Ring.acquire` (the unit's pre-forward hook) waits until the unit is in a slot — loading it
then if it is not, so out-of-order use still works — and :meth:`Ring.release` (its post-forward
hook) frees the slot and starts loading the next units in cyclic execution order into the free
slots: while unit ``i`` computes, units ``i+1 … i+K-1`` are being read. How a unit gets into a
slot is a :class:`Loader`:

* :class:`HostLoader` — a device that computes in host memory (CPU): the slots are aligned host
  buffers and the store's :class:`~shardwise.offload.store.BlobReader` reads each blob straight
  into one (direct I/O, reader threads): no copy at all.
* :class:`DeviceLoader` — an accelerator: the blob comes from host memory (the ``"cpu"`` tier's
  pinned buffers, or an aligned host staging slot the reader fills for ``"nvme"``) and is copied
  into the device slot on a copy stream (torch's device-generic ``torch.Stream``); an event
  recorded after the compute that last used the slot makes the copy wait for it.

Every change of state happens in a thread that runs the model (hooks), under the ring's lock
(forwards from several threads are served one hook at a time; a slot in use is never reloaded);
loads complete in worker threads and are collected from their futures. :class:`RingStats`
counts what was read, how long reading took and how long compute waited for it, per pass over
the units, and keeps a short log of the ring's events (submit / acquire / release) so the
overlap can be checked from what happened, not from timing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import ShardwiseError

#: events the ring keeps in its log (oldest dropped first)
EVENT_LOG = 4096
#: passes over the units whose stats the ring keeps (oldest dropped first)
PASS_LOG = 64


class RingError(ShardwiseError, RuntimeError):
    """The ring cannot serve a unit (every slot is held by a unit still running)."""


# ----- loaders ------------------------------------------------------------------------------------


class Loader:
    """How a unit's blob gets into a slot. ``slots`` are the memory the model computes from
    (uint8 [slot_bytes] each); :meth:`start` begins loading ``entry`` into slot ``s`` and returns
    a future whose result is the seconds the load took."""

    slots: list[torch.Tensor]

    def start(self, entry: Any, s: int) -> concurrent.futures.Future:
        raise NotImplementedError

    def released(self, s: int) -> None:
        """Compute has been issued for the last time on slot ``s`` (before it is reloaded)."""

    def close(self) -> None:
        """Stop the worker threads (pending loads finish first)."""


class HostLoader(Loader):
    """The ``"nvme"`` tier on a device that computes in host memory: the reader fills the
    aligned host slot the model computes from (``reader``: a BlobReader)."""

    def __init__(self, reader: Any, slots: list[torch.Tensor]) -> None:
        self.reader, self.slots = reader, slots

    def start(self, entry: Any, s: int) -> concurrent.futures.Future:
        return self.reader.submit(entry, self.slots[s])

    def close(self) -> None:
        self.reader.close()


def device_event(device: torch.device) -> Any:
    """A ``torch.Event`` of ``device`` (record / wait / synchronize)."""
    return torch.Event(device=device)


class DeviceLoader(Loader):
    """An accelerator: host bytes → device slot on a copy stream.

    ``source(entry, s)`` returns the host uint8 tensor holding ``entry``'s blob, blocking until
    it is there (the ``"cpu"`` tier: its pinned buffer; ``"nvme"``: the reader's read into host
    staging slot ``s``). A worker thread then makes the copy stream wait (on the device, not the
    host) for the compute that last used the device slot, copies on that stream and waits for
    the copy, so a finished future means the slot holds the unit. Streams and events are torch's
    device-generic ones (``torch.Stream`` / ``torch.Event`` of ``device``); the compute stream
    is the device module's current stream."""

    def __init__(self, device: torch.device, slots: list[torch.Tensor],
                 source: Callable[[Any, int], torch.Tensor], workers: int,
                 on_close: Callable[[], None] | None = None) -> None:
        self.device, self.slots, self.source = device, slots, source
        self.runtime = torch.get_device_module(device.type)
        self.stream = torch.Stream(device=device)  # the copy stream
        self.free = [device_event(device) for _ in slots]  # compute done with the slot
        self.copied = [device_event(device) for _ in slots]  # the copy into it done
        self.pool = concurrent.futures.ThreadPoolExecutor(max(1, workers),
                                                          thread_name_prefix="shardwise-offload")
        self.on_close = on_close
        self.copies = 0  # copies made (for tests and reports)

    def start(self, entry: Any, s: int) -> concurrent.futures.Future:
        return self.pool.submit(self._load, entry, s)

    def _load(self, entry: Any, s: int) -> float:
        start = time.perf_counter()
        host = self.source(entry, s)  # uint8 [>= entry.nbytes] in host memory
        with self.stream:
            self.free[s].wait(self.stream)  # the device waits, not this thread
            self.slots[s][:entry.nbytes].copy_(host[:entry.nbytes], non_blocking=True)
            self.copied[s].record(self.stream)
        self.copied[s].synchronize()
        self.copies += 1
        return time.perf_counter() - start

    def released(self, s: int) -> None:
        self.free[s].record(self.runtime.current_stream(self.device))

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.on_close is not None:
            self.on_close()


# ----- stats --------------------------------------------------------------------------------------


@dataclass
class RingStats:
    """What the ring streamed. ``bytes_read``, ``read_s`` (summed over loads: parallel reads
    add up) and ``wait_s`` (seconds a unit's forward waited for its load) since the last
    :meth:`reset` (``gathered_bytes``: the part of ``bytes_read`` read outside the ring, rows
    of a gathered embedding); ``passes``: passes over the units begun; ``units_read``: indices
    of the units loaded; ``per_pass``: the same counts for each recent pass; ``events``: the log
    ``(kind, unit, slot)`` with kind ``"submit"``, ``"acquire"`` or ``"release"``."""

    bytes_read: int = 0
    read_s: float = 0.0
    wait_s: float = 0.0
    passes: int = 0
    gathered_bytes: int = 0
    units_read: set[int] = field(default_factory=set)
    per_pass: collections.deque = field(default_factory=lambda: collections.deque(
        maxlen=PASS_LOG))
    events: collections.deque = field(default_factory=lambda: collections.deque(
        maxlen=EVENT_LOG))

    def new_pass(self) -> None:
        self.passes += 1
        self.per_pass.append({"bytes_read": 0, "read_s": 0.0, "wait_s": 0.0})

    def loaded(self, unit: int | None, nbytes: int, seconds: float) -> None:
        """Count a read of ``nbytes``; ``unit``: the ring position loaded (None: rows read
        outside the ring, counted in ``gathered_bytes`` too)."""
        self.bytes_read += nbytes
        self.read_s += seconds
        if unit is None:
            self.gathered_bytes += nbytes
        else:
            self.units_read.add(unit)
        if self.per_pass:
            self.per_pass[-1]["bytes_read"] += nbytes
            self.per_pass[-1]["read_s"] += seconds

    def waited(self, seconds: float) -> None:
        self.wait_s += seconds
        if self.per_pass:
            self.per_pass[-1]["wait_s"] += seconds

    def as_dict(self) -> dict:
        """``bytes_read``, ``read_s``, ``wait_s``, ``overlap`` (1 - wait / read: the share of
        reading hidden behind compute; None before any read), ``passes``, ``bytes_per_pass``,
        ``units_read`` (how many distinct units), ``gathered_bytes`` (rows a gathered embedding
        read outside the ring; in ``bytes_read`` too) and ``per_pass`` (recent passes, oldest
        first)."""
        overlap = None if self.read_s <= 0 else max(0.0, min(1.0, 1 - self.wait_s / self.read_s))
        return {"bytes_read": self.bytes_read, "read_s": self.read_s, "wait_s": self.wait_s,
                "overlap": overlap, "passes": self.passes,
                "bytes_per_pass": self.bytes_read / self.passes if self.passes else 0,
                "units_read": len(self.units_read), "gathered_bytes": self.gathered_bytes,
                "per_pass": [dict(p) for p in self.per_pass]}

    def reset(self) -> None:
        self.bytes_read, self.read_s, self.wait_s, self.passes = 0, 0.0, 0.0, 0
        self.gathered_bytes = 0
        self.units_read.clear()
        self.per_pass.clear()
        self.events.clear()


# ----- the ring -----------------------------------------------------------------------------------


@dataclass
class _Slot:
    unit: int | None = None  # the unit it holds or is loading
    future: concurrent.futures.Future | None = None  # the load in flight (None: done)
    users: int = 0  # forwards running from it now


class Ring:
    """``len(loader.slots)`` slots serving ``entries`` (the units' layouts, in cyclic execution
    order). ``bind(unit, slot)`` points the unit's tensors at the slot's views (the transform
    provides it). Thread-safe: acquire and release hold the ring's lock."""

    def __init__(self, entries: Sequence[Any], loader: Loader,
                 bind: Callable[[int, int], None]) -> None:
        self.entries, self.loader, self.bind = list(entries), loader, bind
        self.slots = [_Slot() for _ in loader.slots]
        self.where: dict[int, int] = {}  # unit → slot holding or loading it
        self.stats = RingStats()
        self._last: int | None = None
        self._lock = threading.Lock()
        self.closed = False

    @property
    def size(self) -> int:
        return len(self.slots)

    def start(self) -> None:
        """Begin loading the first units of a pass (before the first forward)."""
        self._prefetch(list(range(min(self.size, len(self.entries)))))

    def acquire(self, unit: int) -> int:
        """The unit's pre-forward: wait for it to be in a slot (loading it now if it is not),
        then bind its tensors there. Returns the slot's index (the slot stays the unit's until
        the matching :meth:`release`)."""
        with self._lock:
            return self._acquire(unit)

    def count_read(self, nbytes: int, seconds: float) -> None:
        """Count a read made outside the ring by the compute thread (a gathered embedding's
        rows): its bytes and seconds, also as seconds the compute waited."""
        with self._lock:
            self.stats.loaded(None, nbytes, seconds)
            self.stats.waited(seconds)

    def _acquire(self, unit: int) -> int:
        if self.closed:
            raise RingError("the offload ring is closed (engine.close() gave the model back)")
        if self._last is None or unit < self._last:
            self.stats.new_pass()
        self._last = unit
        start = time.perf_counter()
        s = self.where.get(unit)
        waited = s is None or self.slots[s].future is not None
        if s is None:  # out of order: load it now, into the slot needed last
            s = self._load(unit, self._victim(unit, ()))
        slot = self.slots[s]
        if slot.future is not None:
            self._collect(s)
        if waited:
            self.stats.waited(time.perf_counter() - start)
        slot.users += 1
        self.stats.events.append(("acquire", unit, s))
        self.bind(unit, s)
        return s

    def release(self, unit: int) -> None:
        """The unit's post-forward: free its slot and load the units that come next into the free
        slots (units ``unit+1 … unit+K`` in cyclic order stay or come in)."""
        with self._lock:
            self._release(unit)

    def _release(self, unit: int) -> None:
        s = self.where.get(unit)
        if s is None or self.slots[s].users == 0:
            return
        slot = self.slots[s]
        slot.users -= 1
        self.stats.events.append(("release", unit, s))
        if slot.users == 0:
            self.loader.released(s)
        n = len(self.entries)
        self._prefetch([(unit + k) % n for k in range(1, min(self.size, n) + 1)])

    def _prefetch(self, wanted: list[int]) -> None:
        """Load each unit of ``wanted`` (nearest first) that is in no slot into a free slot
        holding none of them."""
        for unit in wanted:
            if unit in self.where:
                continue
            s = self._victim(unit, wanted, required=False)
            if s is None:
                return
            self._load(unit, s)

    def _victim(self, unit: int, keep: Sequence[int], required: bool = True) -> int | None:
        """A slot to load ``unit`` into: an empty one, else one holding no unit of ``keep`` whose
        unit comes furthest after ``unit`` in cyclic order; never one in use."""
        n = len(self.entries)
        best, best_distance = None, -1
        for s, slot in enumerate(self.slots):
            if slot.users:
                continue
            if slot.unit is None:
                return s
            if slot.unit in keep:
                continue
            distance = (slot.unit - unit) % n
            if distance > best_distance:
                best, best_distance = s, distance
        if best is None and required:
            raise RingError(f"unit {unit} ({self.entries[unit].name}) needs a ring slot but all "
                            f"{self.size} are held by units still running (units nested deeper "
                            f"than buffer_count); raise buffer_count")
        return best

    def _load(self, unit: int, s: int) -> int:
        """Start loading ``unit`` into slot ``s`` (after the load in flight there ends)."""
        slot = self.slots[s]
        if slot.future is not None:  # cannot take a buffer back from a read in flight
            self._collect(s)
        if slot.unit is not None:
            self.where.pop(slot.unit, None)
        slot.unit, slot.future = unit, self.loader.start(self.entries[unit], s)
        self.where[unit] = s
        self.stats.events.append(("submit", unit, s))
        return s

    def _collect(self, s: int) -> None:
        """Wait for slot ``s``'s load and count it; a failed load empties the slot and raises."""
        slot = self.slots[s]
        future, slot.future = slot.future, None
        try:
            seconds = future.result()
        except BaseException:
            self.where.pop(slot.unit, None)
            slot.unit = None
            raise
        self.stats.loaded(slot.unit, self.entries[slot.unit].nbytes, seconds)

    def settle(self) -> None:
        """Wait for every load in flight and count it (the ring stays usable): after it, the
        stats and the loader's counters describe every load started so far (tests read them
        while prefetches started by the last release may still be running)."""
        with self._lock:
            for s, slot in enumerate(self.slots):
                if slot.future is not None:
                    self._collect(s)

    def close(self) -> None:
        """Wait for loads in flight, then stop the loader. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._drain()
        self.loader.close()

    def _drain(self) -> None:
        """Wait for every load in flight (closing: a failed one no longer matters)."""
        for s, slot in enumerate(self.slots):
            if slot.future is not None:
                try:
                    self._collect(s)
                except Exception:
                    pass

"""``shardwise bench --offload nvme|cpu``: what streaming the weights achieves, against what the
tier they stream from can deliver.

Before the rows (and again after them, like the copy probe: the higher is the bar), the tier is
probed with the method the engine reads it by (:class:`TierProbe`):

* ``nvme``: :func:`shardwise.offload.store.read_probe` of the ``--nvme-path`` directory — a
  temporary file dropped from the page cache and read back with ``O_DIRECT`` by as many
  reader threads as the engine's (``READ_THREADS``; ``"buffered read"`` where the filesystem
  refuses direct I/O).
* ``cpu`` (an accelerator's): :func:`host_to_device_probe`, copies of a pinned host buffer
  into device memory, one direction (what the ring's copy stream does).

During each cell (:class:`OffloadMeter`) the engine's :class:`~shardwise.offload.OffloadReport`
counts what it streamed over the timed repeats, and the process's peak resident set is read
over the whole cell. The figures (:func:`offload_figures`, over the timed repeats):

* ``step_bytes``: weight bytes streamed per forward pass (``bytes_read ÷ passes``): a decode
  step streams every unit once, whatever the batch.
* ``stream_gbps``: ``step_bytes ÷ median decode step`` — the rate the weights arrived at as
  the model ran; ``probe_pct`` that as a percentage of the tier's probe.
* ``overlap``: the engine's ``1 − wait ÷ read`` (1: every read hidden behind compute);
  ``wait_ms_per_step``: the compute's wait for weights per pass.
* ``peak_rss_bytes``: the process's peak resident set during the cell;
  ``rss_growth_bytes``: that minus the resident set before the model was loaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..accelerator import Accelerator
from .stats import median

#: Bytes of the host-to-device copy probe (the read probe's default is the store's own).
COPY_PROBE_BYTES = 256 << 20
#: How each tier is probed (the read probe's method without direct I/O is "buffered read").
PROBE_METHODS = {"nvme": "O_DIRECT read", "cpu": "pinned host-to-device copy"}


# ----- the tier's probe ---------------------------------------------------------------------------

@dataclass
class TierProbe:
    """The read bandwidth of an offload tier: one GB/s figure per probe (before and after the
    runs); :attr:`gbps` is the highest, so a row's % of it is never flattered by a probe that
    ran while the machine was busy."""

    tier: str
    method: str
    nbytes: int
    path: str | None = None
    direct_io: bool | None = None
    probes_gbps: list[float] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        """The highest probe's GB/s."""
        return max(self.probes_gbps)

    def add(self, other: "TierProbe") -> "TierProbe":
        """This probe with ``other``'s figures appended (the same tier and method)."""
        if (other.tier, other.method) != (self.tier, self.method):
            raise ValueError(f"probes of {self.tier}/{self.method} and "
                             f"{other.tier}/{other.method}")
        return TierProbe(self.tier, self.method, self.nbytes, self.path, self.direct_io,
                         self.probes_gbps + other.probes_gbps)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for the JSON report (the document's ``offload_probe``)."""
        return {"tier": self.tier, "method": self.method, "bytes": self.nbytes,
                "path": self.path, "direct_io": self.direct_io,
                "probes_gbps": self.probes_gbps, "gbps": self.gbps}


def probe_tier(tier: str, accelerator: Accelerator, nvme_path: str | None = None,
               nbytes: int | None = None) -> TierProbe:
    """Probe ``tier`` once (see the module docstring); ``nbytes``: the probe's size (None: the
    store's default for a read, :data:`COPY_PROBE_BYTES` for a copy)."""
    if tier == "nvme":
        from ..offload.store import read_probe
        from ..offload.transform import READ_THREADS

        kwargs = {"nbytes": nbytes} if nbytes else {}
        result = read_probe(nvme_path, direct=True, threads=READ_THREADS, **kwargs)
        method = PROBE_METHODS["nvme"] if result["direct_io"] else "buffered read"
        return TierProbe(tier, method, result["nbytes"], str(nvme_path), result["direct_io"],
                         [result["gbps"]])
    nbytes = nbytes or COPY_PROBE_BYTES
    return TierProbe(tier, PROBE_METHODS["cpu"], nbytes,
                     probes_gbps=[host_to_device_probe(accelerator, nbytes)])


def host_to_device_probe(accelerator: Accelerator, nbytes: int = COPY_PROBE_BYTES,
                         repeats: int = 5, pin: bool = True) -> float:
    """GB/s of copying ``nbytes`` from (``pin``: page-locked) host memory into the device's
    memory, one direction: the median of ``repeats`` timed copies after a warm-up copy, each
    between two of the accelerator's synchronizations (the copy is asynchronous from pinned
    memory). Pinned memory is what the engine streams from: the accelerator's
    ``pinned_host_buffer`` (pageable where it pins nothing)."""
    pinned = accelerator.pinned_host_buffer(nbytes) if pin else None
    pin = pinned is not None
    src = pinned if pin else torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)  # touch every page before it is timed
    dst = torch.empty(nbytes, dtype=torch.uint8, device=accelerator.device())
    dst.copy_(src, non_blocking=pin)  # warm-up: the device's first touch, the copy engine
    samples = []
    for _ in range(repeats):
        accelerator.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=pin)
        accelerator.synchronize()
        samples.append(time.perf_counter() - start)
    del src, dst
    return nbytes / median(samples) / 1e9


# ----- the process's memory -----------------------------------------------------------------------

def process_memory() -> dict[str, int]:
    """``{"rss", "peak_rss"}`` of this process in bytes (VmRSS and VmHWM of
    /proc/self/status; empty where that file does not exist)."""
    names = {"VmRSS": "rss", "VmHWM": "peak_rss"}
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in names:
                    out[names[key]] = int(rest.split()[0]) * 1024  # the file says kB
    except OSError:
        pass
    return out


def reset_process_peak() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to /proc/self/clear_refs sets VmHWM to the
    current RSS); elsewhere the peak covers the process's life."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


# ----- one cell -----------------------------------------------------------------------------------

#: The engine's report facts a record keeps (``rec["offload"]``), as the engine says them.
REPORT_FACTS = ("tier", "path", "buffer_count", "ring_bytes", "slot_bytes", "resident_bytes",
                "streamed_bytes_per_pass", "chunked", "gathered", "resident_units", "direct_io",
                "fallback_reason", "reused")


def report_facts(report: Any) -> dict[str, Any]:
    """What an engine's offload report says of the run as a whole (:data:`REPORT_FACTS`, the
    unit count, the stale store directories it found), as plain JSON values."""
    facts = {key: _plain(getattr(report, key, None)) for key in REPORT_FACTS}
    facts["units"] = len(getattr(report, "units", None) or ())
    facts["stale"] = [str(p) for p in getattr(report, "stale", None) or ()]
    return facts


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


class OffloadMeter:
    """The offload facts of one cell: ``start_cell()`` before its warm-up, ``start_timed()``
    before its timed repeats (the engine's counters restart there), ``finish()`` after them
    returns ``rec["offload"]``: the report's facts, its counters over the timed repeats
    (``stats``: bytes_read, read_s, wait_s, overlap, passes), the process's resident set at the
    cell's start and its peak over the cell."""

    def __init__(self, report: Any, rss_before_load: int | None = None) -> None:
        self.report = report
        self.rss_before_load = rss_before_load
        self.rss_start: int | None = None

    def start_cell(self) -> None:
        """A cell starts: a new peak-RSS window."""
        reset_process_peak()
        self.rss_start = process_memory().get("rss")

    def start_timed(self) -> None:
        """The timed repeats start: the engine's counters restart."""
        self.report.reset_stats()

    def finish(self) -> dict[str, Any]:
        """The cell's offload facts (see the class docstring)."""
        stats = {k: v for k, v in self.report.stats().items()  # the counters, not the logs
                 if v is None or isinstance(v, (bool, int, float))}
        return {**report_facts(self.report), "stats": stats,
                "rss_before_load_bytes": self.rss_before_load,
                "rss_start_bytes": self.rss_start,
                "peak_rss_bytes": process_memory().get("peak_rss")}


# ----- figures ------------------------------------------------------------------------------------

def offload_figures(rec: dict[str, Any], step_s: float | None,
                    probe_gbps: float | None) -> dict[str, Any] | None:
    """The offload figures of a record (see the module docstring) whose median decode step is
    ``step_s``; None for a record that did not offload."""
    facts = rec.get("offload")
    if not facts:
        return None
    stats = facts.get("stats") or {}
    passes = stats.get("passes") or 0
    step_bytes = stats["bytes_read"] / passes if passes else None
    gbps = step_bytes / step_s / 1e9 if step_bytes and step_s else None
    peak, before = facts.get("peak_rss_bytes"), facts.get("rss_before_load_bytes")
    return {"step_bytes": step_bytes, "stream_gbps": gbps,
            "probe_pct": 100 * gbps / probe_gbps if gbps and probe_gbps else None,
            "overlap": stats.get("overlap"),
            "wait_ms_per_step": 1e3 * stats["wait_s"] / passes if passes else None,
            "peak_rss_bytes": peak,
            "rss_growth_bytes": peak - before if peak is not None and before is not None
            else None}


# ----- the table ----------------------------------------------------------------------------------

OFFLOAD_COLUMNS = ("model", "variant", "batch", "MiB/step", "ms/tok", "GB/s", "% probe",
                   "overlap", "wait ms", "tok/s", "vs hf", "ring MiB", "peak RSS MiB",
                   "RSS growth MiB")


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mib(nbytes: float | None) -> str:
    """MiB, 3 significant digits under 100 (a tiny model's 0.422), whole ones above."""
    if nbytes is None:
        return "-"
    mib = nbytes / 2**20
    return f"{mib:.3g}" if mib < 100 else f"{mib:.0f}"


def offload_row(rec: dict[str, Any]) -> list[str]:
    """One row of the offload table."""
    f = rec.get("figures") or {}
    o = f.get("offload") or {}
    vs = (f.get("speedup") or {}).get("decode")
    return [rec["model"][-28:], rec["variant"], str(rec["batch"]), _mib(o.get("step_bytes")),
            _num((f.get("decode_ms") or {}).get("median"), ".1f"),
            _num(o.get("stream_gbps"), ".3g"), _num(o.get("probe_pct"), ".1f"),
            _num(o.get("overlap"), ".2f"), _num(o.get("wait_ms_per_step"), ".1f"),
            _num(f.get("tokens_per_s"), ".1f"), "-" if vs is None else f"{vs:.2f}x",
            _mib((rec.get("offload") or {}).get("ring_bytes")),
            _mib(o.get("peak_rss_bytes")), _mib(o.get("rss_growth_bytes"))]


def format_offload(doc: dict[str, Any]) -> str:
    """The offload section of the printed results: the tier's probe, one row per offloading
    run (the batch sizes of a model one under the other: throughput by batch size), and why a
    run read through the page cache; empty for a run without ``--offload``."""
    from .report import format_grid

    probe = doc.get("offload_probe")
    runs = [r for r in doc["runs"] if r.get("offload") and r["status"] == "ok"]
    if not probe and not runs:
        return ""
    text = []
    if probe:
        where = f" of {probe['path']}" if probe.get("path") else ""
        probes = ", ".join(f"{g:.2f}" for g in probe["probes_gbps"])
        text.append(f"offload ({probe['tier']}): {probe['method']}{where}, "
                    f"{probe['bytes'] / 2**20:.0f} MiB: {probe['gbps']:.2f} GB/s (highest of "
                    f"{probes})")
    if runs:
        text.append(format_grid(list(OFFLOAD_COLUMNS), [offload_row(r) for r in runs]))
    reasons = {r["offload"].get("fallback_reason") for r in runs} - {None}
    text += [f"note: the engine read through the page cache: {reason}" for reason in reasons]
    return "\n".join(text)

"""The result document (JSON schema and provenance) and the terminal table.

A result file is one JSON object::

    {"schema": "shardwise-bench/1",
     "command": "shardwise bench ...",          # the command that made it
     "provenance": {...},                       # see provenance()
     "plan": {...},                             # models, cells, variant options
     "bandwidth": {"method": "copy", "bytes", "bytes_moved_per_copy", "samples_s",
                   "probes_gbps" (each probe's GB/s: before and after the runs), "gbps" (their
                   highest)},
     "runs": [{"model", "variant", "baseline", "batch", "prompt_len", "new_tokens",
               "status", "error", "dtype", "kernel_dtype" (the quantized layers' activation
               dtype, when the engine reports one), "world_size", "weight_bytes",
               "nonembedding_params", "active_params" (what prefill TFLOP/s counts: for an
               MoE model the dense parameters and the top-k share of the experts held),
               "decode_bytes" (what one decode step reads: every
               weight but the input embedding rows not looked up, and for an MoE model
               only the experts routed to), "decode_bytes_method" (which: "weights read
               (input embeddings: the rows looked up)", "dense + routed experts (measured)"
               or "(expected)"; records before 2026-11-26 say "all weights": every input
               embedding table counted whole), "experts_implementation" (rows of an MoE model:
               what its experts ran, HF's implementation such as "grouped_mm", "shardwise moe
               kernels", or "shardwise QuantExperts"), "peak_memory_bytes",
               "ranks" (runs on several ranks: each rank's own status, weight_bytes,
               decode_bytes, decode_bytes_method, peak_memory_bytes and median step
               decode_s; figures.ranks has each rank's GB/s, figures.all_ranks theirs
               together),
               "offload" (rows of an offloading variant, --offload: the engine's report
               "tier", "path", "units", "ring_bytes", "resident_bytes",
               "streamed_bytes_per_pass", "direct_io", "fallback_reason", "reused", "stale";
               "stats" over the timed repeats: "bytes_read", "read_s", "wait_s", "overlap",
               "passes"; and the process's "rss_before_load_bytes", "rss_start_bytes" (at
               the cell's start), "peak_rss_bytes" (over the cell); figures.offload has
               "step_bytes", "stream_gbps", "probe_pct", "overlap", "wait_ms_per_step",
               "peak_rss_bytes", "rss_growth_bytes": see offload.py),
               "pipeline" (rows of a --pp variant, over the timed repeats: "micro_batches",
               "stages", "steps" (forwards), "wall_s", "busy_s" and "bubble" per stage,
               "theoretical_bubble": see pipeline.py),
               "samples": {"warmup": [...], "repeats": [{"prefill_s", "per_token_s"}]},
               "figures": {...}}],             # see figures.py
     "offload_probe": {"tier", "method" ("O_DIRECT read", "buffered read" where the
                       filesystem refuses direct I/O, or "pinned host-to-device copy"),
                       "bytes", "path", "direct_io", "probes_gbps" (before and after the
                       runs), "gbps" (their highest)},   # only with --offload
     "notes": [...]}                           # optional: e.g. why a default row is left out
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .offload import format_offload
from .pipeline import format_pipeline

SCHEMA = "shardwise-bench/1"
DOCUMENT_KEYS = ("schema", "command", "provenance", "plan", "bandwidth", "runs")
PROVENANCE_KEYS = ("date", "device", "device_type", "device_name", "device_count", "threads",
                   "versions", "git_revision", "git_dirty", "platform", "options")
RUN_KEYS = ("model", "variant", "baseline", "batch", "prompt_len", "new_tokens", "status",
            "error", "dtype", "world_size", "weight_bytes", "nonembedding_params",
            "peak_memory_bytes", "samples", "figures")


# ----- provenance ---------------------------------------------------------------------------------

def git_state(path: str | os.PathLike | None = None) -> tuple[str | None, bool | None]:
    """``(revision, dirty)`` of the git checkout holding ``path`` (default: shardwise's source);
    ``(None, None)`` outside a checkout. Read-only git commands."""
    where = str(path or Path(__file__).resolve().parent)
    try:
        rev = subprocess.run(["git", "-C", where, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if rev.returncode:
            return None, None
        status = subprocess.run(["git", "-C", where, "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True, text=True,
                                timeout=10)
        return rev.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def versions() -> dict[str, str]:
    """Versions of shardwise, torch, transformers and Python."""
    import torch
    import transformers

    from .. import __version__

    return {"shardwise": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def provenance(accelerator, options: dict[str, Any]) -> dict[str, Any]:
    """Where and how a run was made: date, device, versions, git revision, options."""
    import torch

    revision, dirty = git_state()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": accelerator.name, "device_type": accelerator.device_type,
            "device_name": accelerator.device_name(), "device_count": accelerator.device_count(),
            "threads": torch.get_num_threads(), "versions": versions(),
            "git_revision": revision, "git_dirty": dirty, "platform": platform.platform(),
            "options": options}


# ----- the document -------------------------------------------------------------------------------

def build_document(command: str, prov: dict, plan: dict, bandwidth: dict,
                   runs: list[dict], notes: list[str] | None = None,
                   offload_probe: dict | None = None) -> dict[str, Any]:
    """The result document (see the module docstring)."""
    doc = {"schema": SCHEMA, "command": command, "provenance": prov, "plan": plan,
           "bandwidth": bandwidth, "runs": runs}
    if offload_probe is not None:
        doc["offload_probe"] = offload_probe
    if notes:
        doc["notes"] = list(notes)
    return doc


def check_document(doc: Any, source: str = "document") -> dict[str, Any]:
    """Return ``doc`` if it has the result schema's keys, else a ConfigError naming what lacks."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise ConfigError(f"{source} is not a shardwise bench result (schema {found!r}, "
                          f"expected {SCHEMA!r}); pass files written by `shardwise bench`")
    missing = [k for k in DOCUMENT_KEYS if k not in doc]
    missing += [f"provenance.{k}" for k in PROVENANCE_KEYS if k not in doc["provenance"]]
    missing += [f"runs[{i}].{k}" for i, r in enumerate(doc["runs"]) for k in RUN_KEYS
                if k not in r]
    if missing:
        raise ConfigError(f"{source} lacks {', '.join(missing[:8])}; was it edited by hand?")
    return doc


def write_json(doc: dict, path: str | os.PathLike) -> Path:
    """Write ``doc`` to ``path`` (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def check_writable(path: str | os.PathLike, what: str = "output") -> Path:
    """Raise ConfigError unless a file can be written at ``path``: its folder exists and takes
    a new file (tried for real: permission bits do not tell for root or read-only mounts), and
    an existing ``path`` is a writable file. Leaves nothing behind."""
    import tempfile

    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ConfigError(f"{what} {str(path)!r}: folder {str(folder)!r} does not exist (or is "
                          f"not a folder); create it first or write elsewhere")
    if path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a folder; name a file")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".shardwise-write-check-"):
            pass
        if path.exists():
            with open(path, "r+b"):
                pass
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r} cannot be written ({exc.strerror or exc}); "
                          f"choose a writable folder") from None
    return path


def read_json(path: str | os.PathLike) -> dict:
    """A result document read from ``path`` and checked against the schema."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"result file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"result file {str(path)!r} is not valid JSON: {exc}") from None
    return check_document(doc, repr(str(path)))


# ----- the table ----------------------------------------------------------------------------------

COLUMNS = ("model", "variant", "dtype", "batch", "prompt", "new", "prefill ms", "TFLOP/s",
           "ms/tok", "p90", "tok/s", "speed-up", "GB/s", "% BW", "peak MiB", "status")
#: Short dtype names for the table.
SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _short(name: str, width: int = 28) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1):]


def dtype_text(rec: dict) -> str:
    """The dtype a run computed in (``bf16``), with its quantized kernels' activation dtype
    when that differs (``fp32 (kernels bf16)``); ``-`` when unknown (a run that failed early)."""
    dtype = rec.get("dtype")
    if dtype is None:
        return "-"
    text = SHORT_DTYPES.get(dtype, dtype)
    kernels = rec.get("kernel_dtype")
    if kernels and kernels != dtype:
        text += f" (kernels {'/'.join(SHORT_DTYPES.get(k, k) for k in kernels.split('/'))})"
    return text


def table_row(rec: dict, note: int | None = None) -> list[str]:
    """One table row of a record (``note``: footnote number of a failure)."""
    f = rec.get("figures") or {}
    prefill, decode = f.get("prefill_ms", {}), f.get("decode_ms", {})
    peak = rec.get("peak_memory_bytes")
    status = "ok" if rec["status"] == "ok" else f"FAILED [{note}]"
    return [_short(rec["model"]), rec["variant"], dtype_text(rec), str(rec["batch"]),
            str(rec["prompt_len"]),
            str(rec["new_tokens"]), _num(prefill.get("median"), ".1f"),
            _num(f.get("prefill_tflops"), ".3g"), _num(decode.get("median"), ".2f"),
            _num(decode.get("p90"), ".2f"), _num(f.get("tokens_per_s"), ".1f"),
            _times((f.get("speedup") or {}).get("decode")),
            _num(f.get("decode_gbps"), ".3g"), _num(f.get("bandwidth_pct"), ".1f"),
            _num(peak / 2**20 if peak else None, ".0f"), status]


def format_grid(header: list[str], rows: list[list[str]], text_columns: int = 2,
                last_is_text: bool = True) -> str:
    """Columns padded to their widest cell: the first ``text_columns`` (and the last when
    ``last_is_text``) left-aligned, the others (figures) right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    last = len(widths) - 1 if last_is_text else -1

    def line(cells):
        return "  ".join(c.ljust(w) if i < text_columns or i == last else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_table(doc: dict) -> str:
    """The runs as a table, failures' errors as footnotes (one per distinct error), and the
    measured bandwidth."""
    rows, notes = [], {}
    for rec in doc["runs"]:
        if rec["status"] != "ok":
            notes.setdefault(rec["error"], len(notes) + 1)
        rows.append(table_row(rec, notes.get(rec["error"])))
    bw = doc["bandwidth"]
    prov = doc["provenance"]
    text = [f"device: {prov['device']} ({prov['device_name']}), {prov['threads']} threads; "
            f"measured bandwidth {bw['gbps']:.1f} GB/s (copy of {bw['bytes'] / 2**20:.0f} MiB"
            f"{_probes(bw)})",
            format_grid(list(COLUMNS), rows, text_columns=3)]
    text += [f"[{i}] {note}" for note, i in notes.items()]
    text += [f"note: {line}" for line in decode_bytes_notes(doc["runs"])]
    text += [f"note: {line}" for line in rank_notes(doc["runs"])]
    text += [f"note: {line}" for line in doc.get("notes") or []]
    offload = format_offload(doc)
    pipeline = format_pipeline(doc)
    return "\n".join(text + [section for section in (offload, pipeline) if section])


def decode_bytes_notes(runs: list[dict]) -> list[str]:
    """One line per model whose GB/s is not over every weight (an MoE model): the bytes a
    decode step read at each batch size (the first row's of that batch) and how they were
    counted."""
    read: dict[str, dict[int, int]] = {}
    for rec in runs:
        f = rec.get("figures") or {}
        if "experts" in f.get("decode_bytes_method", ""):
            read.setdefault(rec["model"], {}).setdefault(rec["batch"], f["decode_bytes"])
    return [f"GB/s of {model} is over the dense weights and the experts routed to per decode "
            f"step ({method_words(runs, model)}), of {_weights_mib(runs, model)} MiB in all: "
            + ", ".join(f"batch {b} {_mib(n)} MiB" for b, n in by_batch.items())
            for model, by_batch in read.items()]


def rank_notes(runs: list[dict]) -> list[str]:
    """One line per run of several ranks whose ranks read different bytes per decode step
    (expert parallelism: each its own experts routed to): each rank's GB/s and % of the
    bandwidth (the table's columns are rank 0's)."""
    lines = []
    for rec in runs:
        ranks = (rec.get("figures") or {}).get("ranks") or []
        if len({r["decode_bytes"] for r in ranks}) < 2:
            continue
        each = ", ".join(f"rank {r['rank']} {_gbps_text(r)}" for r in ranks)
        together = rec["figures"].get("all_ranks")
        lines.append(f"GB/s per rank of {rec['variant']} on {rec['model']} batch "
                     f"{rec['batch']} (over the bytes each rank read: its dense parts and its "
                     f"own experts routed to): {each}"
                     + (f"; all ranks together {_gbps_text(together)}" if together else ""))
    return lines


def _gbps_text(figures: dict) -> str:
    """``12.3 (45.6%)``: GB/s and, when known, the share of the bandwidth."""
    pct = figures.get("bandwidth_pct")
    return _num(figures.get("decode_gbps"), ".3g") + (f" ({pct:.1f}%)" if pct else "")


def method_words(runs: list[dict], model: str) -> str:
    """How a model's routed experts were counted: measured, expected, or both."""
    methods = {(r.get("figures") or {}).get("decode_bytes_method", "") for r in runs
               if r["model"] == model}
    found = [m for m in ("measured", "expected") if any(m in x for x in methods)]
    return "counted by a hook on the experts" if found == ["measured"] else \
        "expected for uniform routing" if found == ["expected"] else \
        "counted where the experts module ran, else expected for uniform routing"


def _weights_mib(runs: list[dict], model: str) -> str:
    sizes = {r["weight_bytes"] for r in runs if r["model"] == model and r.get("weight_bytes")}
    return "/".join(_mib(s) for s in sorted(sizes))


def _mib(nbytes: int) -> str:
    """MiB with 3 significant digits under 100, whole MiB above (``0.597``, ``3891``)."""
    mib = nbytes / 2**20
    return f"{mib:.3g}" if mib < 100 else f"{mib:.0f}"


def _probes(bw: dict) -> str:
    """'; the higher of probes before and after the runs: a, b GB/s' (old documents: '')."""
    probes = bw.get("probes_gbps") or []
    if len(probes) < 2:
        return ""
    return f"; highest of the probes before and after the runs: " \
           f"{', '.join(f'{g:.1f}' for g in probes)} GB/s"


def command_line(argv: list[str]) -> str:
    """The command as a user would type it again."""
    return shlex.join(["shardwise", "bench", *argv])

"""``shardwise bench --compare a.json b.json``: the ratio b ÷ a of every figure of the runs the
two files share (same model, variant, shape and dtype)."""

from __future__ import annotations

from typing import Any

from .report import SHORT_DTYPES, format_grid
from .stats import ratio

#: (column, path into a record) of the figures compared.
FIGURES = (("prefill ms", ("figures", "prefill_ms", "median")),
           ("ms/tok", ("figures", "decode_ms", "median")),
           ("tok/s", ("figures", "tokens_per_s",)),
           ("GB/s", ("figures", "decode_gbps")),
           ("peak MiB", ("peak_memory_bytes",)))
#: Provenance entries worth a warning when they differ between the two files.
CONTEXT = ("device", "device_name", "threads", "versions", "git_revision")


def run_key(rec: dict) -> tuple:
    """What identifies a run across files: model, variant, shape and dtype (an fp32 and a bf16
    run of the same variant are different runs, not one to compare)."""
    return (rec["model"], rec["variant"], rec["batch"], rec["prompt_len"], rec["new_tokens"],
            rec.get("dtype"))


def _value(rec: dict, path: tuple[str, ...]) -> float | None:
    value: Any = rec
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    if value is not None and path == ("peak_memory_bytes",):
        value = value / 2**20
    return value


def compare(a: dict, b: dict) -> list[dict[str, Any]]:
    """One row per run key in either document: ``{"key", "a", "b", "ratio"}`` (figure name →
    value; ratio is b ÷ a, None where either is missing), or ``{"key", "only_in"}``."""
    runs_a = {run_key(r): r for r in a["runs"]}
    runs_b = {run_key(r): r for r in b["runs"]}
    rows = []
    for key in dict.fromkeys([*runs_a, *runs_b]):
        if key not in runs_a or key not in runs_b:
            rows.append({"key": key, "only_in": "a" if key in runs_a else "b"})
            continue
        va = {name: _value(runs_a[key], path) for name, path in FIGURES}
        vb = {name: _value(runs_b[key], path) for name, path in FIGURES}
        rows.append({"key": key, "a": va, "b": vb,
                     "ratio": {name: ratio(vb[name], va[name]) for name, _ in FIGURES}})
    return rows


def context_differences(a: dict, b: dict) -> list[str]:
    """Lines naming provenance entries that differ (device, threads, versions, revision)."""
    pa, pb = a["provenance"], b["provenance"]
    return [f"{k}: a={pa.get(k)!r} b={pb.get(k)!r}" for k in CONTEXT if pa.get(k) != pb.get(k)]


def format_compare(a: dict, b: dict, name_a: str = "a", name_b: str = "b") -> str:
    """The comparison as text: each figure as ``a → b (b/a)``, then what differs between runs."""
    header = ["model", "variant", "dtype", "batch", "prompt", "new", *(n for n, _ in FIGURES)]
    rows = []
    for row in compare(a, b):
        model, variant, *shape, dtype = row["key"]
        if "only_in" in row:
            cells = [f"only in {name_a if row['only_in'] == 'a' else name_b}"] * len(FIGURES)
        else:
            cells = [_cell(row["a"][n], row["b"][n], row["ratio"][n]) for n, _ in FIGURES]
        rows.append([model[-28:], variant, SHORT_DTYPES.get(dtype, str(dtype or "-")),
                     *map(str, shape), *cells])
    lines = [f"a = {name_a}\nb = {name_b}\nfigures as a → b (b/a):", format_grid(header, rows, text_columns=3, last_is_text=False)]
    diffs = context_differences(a, b)
    lines.append("measured bandwidth, GB/s: " + _cell(
        a["bandwidth"]["gbps"], b["bandwidth"]["gbps"],
        ratio(b["bandwidth"]["gbps"], a["bandwidth"]["gbps"])))
    if diffs:
        lines.append("the runs differ in: " + "; ".join(diffs))
    return "\n".join(lines)


def _cell(va: float | None, vb: float | None, r: float | None) -> str:
    text = f"{_fmt(va)} → {_fmt(vb)}"
    return text if r is None else f"{text} ({r:.2f}x)"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"

"""Figures of a run record, from its raw samples: latency statistics, throughput, roofline and
speed-up over the baseline. Pure functions over plain dicts (the JSON's own shapes).

Definitions (all over the timed repeats; warm-up samples are kept in the JSON but not used):

* ``prefill_ms``: time to first token, median and p90 over repeats.
* ``decode_ms``: latency of one decode step (every token after the first), median and p90 over
  the steps of all repeats pooled.
* ``tokens_per_s``: decode throughput, ``batch / median step``.
* ``e2e_tokens_per_s``: ``batch × new tokens / median whole-generate time`` (prefill included).
* ``decode_gbps`` / ``bandwidth_pct`` and ``prefill_tflops``: see :mod:`.roofline`
  (``prefill_tflops`` over the record's ``active_params``, for an MoE model the dense ones and
  the top-k share of the experts, where a record has them; else ``nonembedding_params``).
  Decode GB/s is over the record's ``decode_bytes`` (for an MoE model: the dense parts and the
  experts routed to, not every expert), or its ``weight_bytes`` where a record has none;
  ``decode_bytes_method`` says which.
* ``speedup``: baseline latency ÷ this variant's latency, per phase (> 1 is faster).
* ``ranks`` (records of several ranks, ``--tp``/``--ep``): each rank's ``decode_gbps`` and
  ``bandwidth_pct`` over the bytes *its* decode step read (under expert parallelism: its dense
  parts and the experts it holds that were routed to) and its own median step. The record's
  own figures are rank 0's. ``all_ranks``: the bytes all ranks read per step together, over
  the slowest rank's median step (the step the group completes), as GB/s and % of the
  bandwidth: what ranks sharing one memory (a CPU socket) draw from it together.
* ``offload`` (records of an offloading variant, ``--offload``): the bytes streamed per step,
  their GB/s against the tier's read probe, the read/compute overlap and the peak RSS; see
  :mod:`.offload`.
"""

from __future__ import annotations

from typing import Any

from . import roofline
from .offload import offload_figures
from .stats import median, ratio, summarize


def _ms(summary: dict) -> dict:
    return {k: (v * 1e3 if k != "n" else v) for k, v in summary.items()}


def figures(rec: dict[str, Any], device_gbps: float | None,
            probe_gbps: float | None = None) -> dict[str, Any]:
    """The figures of one record (empty when it failed or has no timed repeats);
    ``probe_gbps``: the offload tier's probe (``--offload``)."""
    repeats = rec["samples"]["repeats"]
    if rec["status"] != "ok" or not repeats:
        return {}
    prefill = [r["prefill_s"] for r in repeats]
    steps = [t for r in repeats for t in r["per_token_s"]]
    whole = [r["prefill_s"] + sum(r["per_token_s"]) for r in repeats]
    out: dict[str, Any] = {
        "prefill_ms": _ms(summarize(prefill)),
        "decode_ms": _ms(summarize(steps)),
        "e2e_s": median(whole),
        "e2e_tokens_per_s": rec["batch"] * rec["new_tokens"] / median(whole),
        "tokens_per_s": None, "decode_gbps": None, "bandwidth_pct": None,
        "prefill_tflops": roofline.prefill_tflops(
            rec.get("active_params") or rec["nonembedding_params"], rec["prompt_len"],
            rec["batch"], median(prefill)),
    }
    if steps:
        step = median(steps)
        out["tokens_per_s"] = rec["batch"] / step
        read, method = decode_bytes(rec)
        out["decode_bytes"], out["decode_bytes_method"] = read, method
        out["decode_gbps"] = roofline.decode_gbps(read, step)
        if device_gbps:
            out["bandwidth_pct"] = roofline.bandwidth_pct(out["decode_gbps"], device_gbps)
    if rec.get("offload"):
        out["offload"] = offload_figures(rec, median(steps) if steps else None, probe_gbps)
    if rec.get("ranks"):
        out["ranks"] = [rank_figures(r, device_gbps) for r in rec["ranks"]]
        out["all_ranks"] = all_ranks_figures(rec["ranks"], device_gbps)
    return out


def all_ranks_figures(ranks: list[dict[str, Any]], device_gbps: float | None) -> dict | None:
    """The ranks' bytes per step together over the slowest rank's median step (see the module
    docstring); None when a rank has no decode steps or bytes."""
    reads = [decode_bytes(r)[0] for r in ranks]
    steps = [r.get("decode_s") for r in ranks]
    if not all(reads) or not all(steps):
        return None
    gbps = roofline.decode_gbps(sum(reads), max(steps))
    return {"decode_bytes": sum(reads), "decode_gbps": gbps,
            "bandwidth_pct": roofline.bandwidth_pct(gbps, device_gbps) if device_gbps else None}


def rank_figures(facts: dict[str, Any], device_gbps: float | None) -> dict[str, Any]:
    """One rank's roofline (see the module docstring) from its facts in a record's ``ranks``
    (:func:`~.launch.rank_facts`)."""
    read, method = decode_bytes(facts)
    step = facts.get("decode_s")
    gbps = roofline.decode_gbps(read, step) if read and step else None
    return {"rank": facts["rank"], "decode_bytes": read, "decode_bytes_method": method,
            "decode_gbps": gbps, "bandwidth_pct": roofline.bandwidth_pct(gbps, device_gbps)
            if gbps and device_gbps else None}


def decode_bytes(rec: dict[str, Any]) -> tuple[int, str]:
    """``(bytes a decode step reads, how they were counted)`` of a record: its
    ``decode_bytes`` when it has them (records before MoE support do not), else every weight."""
    if rec.get("decode_bytes"):
        return rec["decode_bytes"], rec.get("decode_bytes_method") or "all weights"
    return rec["weight_bytes"], "all weights"


def cell_key(rec: dict[str, Any]) -> tuple:
    """What identifies a cell across variants: model and shape."""
    return rec["model"], rec["batch"], rec["prompt_len"], rec["new_tokens"]


def speedup(rec: dict[str, Any], base: dict[str, Any] | None) -> dict[str, float | None]:
    """Baseline latency ÷ ``rec``'s latency for decode, prefill and the whole generate."""
    f, b = rec.get("figures") or {}, (base or {}).get("figures") or {}
    if not f or not b:
        return {"decode": None, "prefill": None, "e2e": None}
    return {"decode": ratio(b["decode_ms"].get("median"), f["decode_ms"].get("median")),
            "prefill": ratio(b["prefill_ms"]["median"], f["prefill_ms"]["median"]),
            "e2e": ratio(b["e2e_s"], f["e2e_s"])}


def add_figures(records: list[dict[str, Any]], device_gbps: float | None,
                probe_gbps: float | None = None) -> list[dict]:
    """Set ``figures`` (with ``speedup`` over the same cell's baseline) on every record
    (``probe_gbps``: the offload tier's probe, for the offloading records)."""
    for rec in records:
        rec["figures"] = figures(rec, device_gbps, probe_gbps)
    baselines = {cell_key(r): r for r in records if r["baseline"] and r["status"] == "ok"}
    for rec in records:
        if rec["figures"]:
            rec["figures"]["speedup"] = speedup(rec, baselines.get(cell_key(rec)))
    return records

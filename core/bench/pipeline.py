"""``--pp P``: the pipeline section of the printed results (issue 18).

A row per run of a pipeline variant (``rec["pipeline"]``, filled by
:func:`~.runner.measure_cell` from the engine's
:meth:`~shardwise.pipeline.PipelineReport.finish_steps` over the timed repeats): the forwards it
counted (prefill and decode steps, each split into M micro-batches), their wall time (the
slowest rank's, from a common start, the broadcast of the outputs excluded), every stage's busy
time (not waiting on another stage), every stage's bubble ``1 − busy / wall``, the theoretical
bubble ``(P − 1) / (P − 1 + M)``, the worst stage's bubble over it, and every stage's share of
the wall inside its own layers. On a tiny model each step's point-to-point and Python overheads
are large against a stage's compute, so the bubble is far above the theoretical one: it measures
the schedule where a stage's compute dominates (``benchmarks/pipeline_bubble.py --delay-ms``
shows it with an injected per-layer delay).
"""

from __future__ import annotations

from typing import Any

PIPELINE_COLUMNS = ("model", "variant", "batch", "new", "M", "forwards", "wall ms",
                    "busy ms per stage", "bubble per stage", "theory", "x theory",
                    "in layers")


def pipeline_row(rec: dict[str, Any]) -> list[str]:
    """One row of the pipeline table."""
    p = rec["pipeline"]
    worst = max(p["bubble"])
    ratio = worst / p["theoretical_bubble"] if p["theoretical_bubble"] else None
    return [rec["model"][-28:], rec["variant"], str(rec["batch"]), str(rec["new_tokens"]),
            str(p["micro_batches"]), str(p["steps"]), f"{p['wall_s'] * 1e3:.1f}",
            ", ".join(f"{b * 1e3:.1f}" for b in p["busy_s"]),
            ", ".join(f"{b:.1%}" for b in p["bubble"]), f"{p['theoretical_bubble']:.1%}",
            "-" if ratio is None else f"{ratio:.2f}",
            ", ".join(f"{t / p['wall_s']:.0%}" for t in p.get("layers_s", [])) or "-"]


def format_pipeline(doc: dict[str, Any]) -> str:
    """The pipeline section: one row per run with ``pipeline`` figures; empty without any."""
    from .report import format_grid

    runs = [r for r in doc["runs"] if r.get("pipeline") and r["status"] == "ok"]
    if not runs:
        return ""
    return "\n".join([
        "pipeline stages (timed repeats; bubble = 1 - busy / wall, theory (P-1)/(P-1+M)):",
        format_grid(list(PIPELINE_COLUMNS), [pipeline_row(r) for r in runs])])

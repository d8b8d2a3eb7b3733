"""One benchmark run end to end: measure the device's bandwidth, run the variants (in this
process, or the shardwise one on launched ranks under ``--tp``), compute the figures, and build
the result document."""

from __future__ import annotations

import sys
from typing import Any

from ..accelerator import Accelerator
from .figures import add_figures
from .launch import run_ranks
from .plan import BASELINE, Plan
from .report import build_document, provenance
from .roofline import measure_bandwidth
from .runner import release, run_local


def progress_bar(total: int, enabled: bool = True):
    """A tqdm bar over ``total`` generate calls, on stderr."""
    from tqdm import tqdm

    return tqdm(total=total, unit="gen", file=sys.stderr, disable=not enabled, leave=False)


def run_bench(plan: Plan, accelerator: Accelerator, *, command: str, options: dict[str, Any],
              nproc_per_node: int = 1, rendezvous: dict[str, Any] | None = None,
              bandwidth_bytes: int | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Run ``plan`` and return the result document (see :mod:`.report`).

    The bandwidth probe runs first and again last, on an otherwise idle device (the higher
    is the bar for the % of bandwidth figures). With ``plan.tp > 1`` the
    baseline runs here on one device and the shardwise variant on ``plan.tp`` launched ranks.
    """
    bandwidth = measure_bandwidth(accelerator, bandwidth_bytes)
    release(accelerator)
    local_variants = [BASELINE] if plan.tp > 1 else [BASELINE, plan.variant]
    total = len(plan.models) * len(plan.cells) * len(local_variants) * (plan.warmup + plan.repeats)
    with progress_bar(total, show_progress) as progress:
        runs = run_local(plan, accelerator, local_variants, progress)
    if plan.tp > 1:
        runs += run_ranks(plan, accelerator, nproc_per_node, rendezvous, show_progress)
    release(accelerator)
    bandwidth = bandwidth.add(measure_bandwidth(accelerator, bandwidth.nbytes))
    runs = add_figures(_ordered(runs, plan), bandwidth.gbps)
    return build_document(command, provenance(accelerator, options), plan.to_dict(),
                          bandwidth.to_dict(), runs)


def _ordered(runs: list[dict], plan: Plan) -> list[dict]:
    """Runs grouped by model and cell, baseline first (the table reads variant against variant)."""
    models = [m.name for m in plan.models]
    return sorted(runs, key=lambda r: (models.index(r["model"]), r["batch"], r["prompt_len"],
                                       r["new_tokens"], not r["baseline"]))

"""One benchmark run end to end: measure the device's bandwidth, run the variants (in this
process, or the shardwise one on launched ranks under ``--tp``), compute the figures, and build
the result document."""

from __future__ import annotations

import contextlib
import logging
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


@contextlib.contextmanager
def one_display(total: int, enabled: bool = True):
    """The run's single progress display: a bar over ``total`` generate calls, with log
    records and Python warnings written above it (through the bar) instead of through it."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with progress_bar(total, enabled) as progress:
        if not enabled:
            yield progress
            return
        captured = logging.captureWarnings(True)
        try:
            with logging_redirect_tqdm():
                yield progress
        finally:
            logging.captureWarnings(captured)


def run_bench(plan: Plan, accelerator: Accelerator, *, command: str, options: dict[str, Any],
              nproc_per_node: int = 1, rendezvous: dict[str, Any] | None = None,
              bandwidth_bytes: int | None = None, show_progress: bool = True,
              notes: list[str] | None = None) -> dict[str, Any]:
    """Run ``plan`` and return the result document (see :mod:`.report`; ``notes`` are lines
    it keeps and the table prints, e.g. why a default row is left out).

    The bandwidth probe runs first and again last, on an otherwise idle device (the higher
    is the bar for the % of bandwidth figures). With ``plan.tp > 1`` the
    baseline runs here on one device and the shardwise variants on ``plan.tp`` launched ranks.
    """
    bandwidth = measure_bandwidth(accelerator, bandwidth_bytes)
    release(accelerator)
    local_variants = [] if plan.tp > 1 else plan.variants
    total = (len(plan.models) * len(plan.cells) * (1 + len(local_variants))
             * (plan.warmup + plan.repeats))
    with one_display(total, show_progress) as progress:
        runs = run_local(plan, accelerator, True, local_variants, progress)
    if plan.tp > 1:
        runs += run_ranks(plan, accelerator, nproc_per_node, rendezvous, show_progress)
    release(accelerator)
    bandwidth = bandwidth.add(measure_bandwidth(accelerator, bandwidth.nbytes))
    runs = add_figures(_ordered(runs, plan), bandwidth.gbps)
    return build_document(command, provenance(accelerator, options), plan.to_dict(),
                          bandwidth.to_dict(), runs, notes)


def _ordered(runs: list[dict], plan: Plan) -> list[dict]:
    """Runs grouped by model and cell, baseline first, then the variants in the plan's order
    (the table reads variant against variant)."""
    models = [m.name for m in plan.models]
    order = [BASELINE, *plan.variant_names]
    return sorted(runs, key=lambda r: (models.index(r["model"]), r["batch"], r["prompt_len"],
                                       r["new_tokens"], order.index(r["variant"])
                                       if r["variant"] in order else len(order)))

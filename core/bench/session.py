"""One benchmark run end to end: measure the device's bandwidth, run the variants (in this
process, or the shardwise one on launched ranks under ``--tp``), compute the figures, and build
the result document."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from typing import Any

from ..accelerator import Accelerator
from .figures import add_figures
from .launch import run_ranks
from .offload import probe_tier
from .plan import Plan
from .report import build_document, provenance
from .roofline import measure_bandwidth
from .runner import release, run_local


def progress_bar(total: int, enabled: bool = True):
    """A tqdm bar over ``total`` generate calls, on stderr."""
    from tqdm import tqdm

    return tqdm(total=total, unit="gen", file=sys.stderr, disable=not enabled, leave=False)


class AboveTheBar(io.TextIOBase):
    """``sys.stderr`` while the bench's bar runs: each whole line written to it is printed above
    the bar (``tqdm.write``), a line rewritten with carriage returns by its last state. It is not
    a terminal, so other progress lines (the graph capture's, transformers') take their quiet,
    logged form instead of drawing a second display."""

    def __init__(self, real) -> None:
        super().__init__()
        self.real = real
        self.pending = ""

    def isatty(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        from tqdm import tqdm

        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            tqdm.write(line.rsplit("\r", 1)[-1], file=self.real)
        return len(text)

    def flush(self) -> None:
        self.real.flush()

    def finish(self) -> None:
        """Print what is left of an unfinished line."""
        if self.pending.strip():
            self.write("\n")


@contextlib.contextmanager
def one_display(total: int, enabled: bool = True):
    """The run's single progress display: a bar over ``total`` generate calls, with log
    records, Python warnings and anything else written to ``sys.stderr`` printed above it
    (:class:`AboveTheBar`) instead of through it."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with progress_bar(total, enabled) as progress:
        if not enabled:
            yield progress
            return
        captured = logging.captureWarnings(True)
        above = AboveTheBar(sys.stderr)
        try:
            with logging_redirect_tqdm(), contextlib.redirect_stderr(above), \
                    _steps_in_the_bar(progress):
                yield progress
        finally:
            above.finish()
            logging.captureWarnings(captured)


#: Loggers whose INFO lines say which long step is under way (the graph capture's progress).
STEP_LOGGERS = ("shardwise.graphs",)


@contextlib.contextmanager
def _steps_in_the_bar(progress):
    """Show the INFO lines of :data:`STEP_LOGGERS` in the bar instead of printing them: a step
    that starts ("capturing the decode step for batch bucket 1 ...") is the bar's postfix
    until the line that ends it (": 41.3 s") clears it; their warnings pass."""
    def into_the_bar(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        text = record.getMessage().removeprefix("shardwise: ")
        progress.set_postfix_str(text.removesuffix(" ...")[:60] if text.endswith("...") else "")
        return False  # shown in the bar: not printed

    loggers = [logging.getLogger(name) for name in STEP_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addFilter(into_the_bar)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeFilter(into_the_bar)
            logger.setLevel(level)


def run_bench(plan: Plan, accelerator: Accelerator, *, command: str, options: dict[str, Any],
              rendezvous: dict[str, Any] | None = None,
              bandwidth_bytes: int | None = None, show_progress: bool = True,
              notes: list[str] | None = None) -> dict[str, Any]:
    """Run ``plan`` and return the result document (see :mod:`.report`; ``notes`` are lines
    it keeps and the table prints, e.g. why a default row is left out).

    The bandwidth probe runs first and again last, on an otherwise idle device (the higher
    is the bar for the % of bandwidth figures). The baseline and the variants of one rank
    run here on one device; the variants on several ranks (``--tp``, ``--ep``) on launched
    ranks, one launch per rank count (:meth:`~.plan.Plan.by_world`), that count ÷
    ``plan.nnodes`` per node.

    With offloading variants (``--offload``) the tier they stream from is probed as well,
    also before and after the runs (:func:`~.offload.probe_tier`, ``bandwidth_bytes`` its size
    when given): the document's ``offload_probe``.
    """
    bandwidth = measure_bandwidth(accelerator, bandwidth_bytes)
    tier = _probe_tier(plan, accelerator, bandwidth_bytes)
    release(accelerator)
    groups = plan.by_world()
    local_variants = groups[1].variants if 1 in groups else []
    total = (len(plan.models) * len(plan.cells) * (1 + len(local_variants))
             * (plan.warmup + plan.repeats))
    with one_display(total, show_progress) as progress:
        runs = run_local(plan, accelerator, True, local_variants, progress)
    for world, group in groups.items():
        if world > 1:
            runs += run_ranks(group, accelerator, world // plan.nnodes, rendezvous,
                              show_progress)
    release(accelerator)
    bandwidth = bandwidth.add(measure_bandwidth(accelerator, bandwidth.nbytes))
    if tier is not None:
        tier = tier.add(_probe_tier(plan, accelerator, tier.nbytes))
    runs = add_figures(_ordered(runs, plan), bandwidth.gbps, tier.gbps if tier else None)
    return build_document(command, provenance(accelerator, options), plan.to_dict(),
                          bandwidth.to_dict(), runs, notes,
                          offload_probe=tier.to_dict() if tier is not None else None)


def _probe_tier(plan: Plan, accelerator: Accelerator, nbytes: int | None):
    """The offload tier's probe (:class:`~.offload.TierProbe`), or None without offloading
    variants."""
    if plan.offload_tier is None:
        return None
    return probe_tier(plan.offload_tier, accelerator, plan.nvme_path, nbytes)


def _ordered(runs: list[dict], plan: Plan) -> list[dict]:
    """Runs grouped by model and cell, baseline first, then the variants in the plan's order
    (the table reads variant against variant)."""
    models = [m.name for m in plan.models]
    order = [plan.baseline_name, *plan.variant_names]
    return sorted(runs, key=lambda r: (models.index(r["model"]), r["batch"], r["prompt_len"],
                                       r["new_tokens"], order.index(r["variant"])
                                       if r["variant"] in order else len(order)))

"""Summary statistics of timing samples and ratios between runs. Pure functions, no torch."""

from __future__ import annotations

import math
from typing import Sequence


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0–100) of ``samples`` with linear interpolation between order
    statistics (numpy's default): rank ``q/100 × (n−1)`` in the sorted samples."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(samples)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(samples: Sequence[float]) -> float:
    """The median (the 50th percentile) of ``samples``."""
    return percentile(samples, 50)


def summarize(samples: Sequence[float]) -> dict[str, float | int]:
    """``{"median", "p90", "min", "max", "n"}`` of ``samples`` (empty → ``{"n": 0}``)."""
    if not samples:
        return {"n": 0}
    return {"median": median(samples), "p90": percentile(samples, 90),
            "min": min(samples), "max": max(samples), "n": len(samples)}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator

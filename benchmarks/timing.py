"""Timing shared by the kernel benchmarks (run as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import statistics
import time


def median_us(fns, repeats: int, warmup: int = 5) -> list[float]:
    """Median microseconds per call of each function; calls are interleaved so that machine
    noise hits every function alike."""
    for _ in range(warmup):
        for f in fns:
            f()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, f in enumerate(fns):
            start = time.perf_counter()
            f()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e6 for t in times]

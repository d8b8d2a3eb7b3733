"""Timing shared by the kernel benchmarks (run as ``python benchmarks/NAME.py``)."""

from __future__ import annotations

import statistics
import time


#: ``--clock`` choices: wall time, or the process's CPU time (which leaves out the time spent
#: waiting for a core on a shared machine)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def median_us(fns, repeats: int, warmup: int = 5, clock=time.perf_counter) -> list[float]:
    """Median microseconds per call of each function on ``clock``; calls are interleaved so that
    machine noise hits every function alike."""
    for _ in range(warmup):
        for f in fns:
            f()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, f in enumerate(fns):
            start = clock()
            f()
            times[i].append(clock() - start)
    return [statistics.median(t) * 1e6 for t in times]

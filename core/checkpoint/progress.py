"""The loading progress bar (rank 0, a terminal only) and the one-line summary."""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    """A tqdm bar over the bytes this rank will read (files in the description), shown on rank 0
    when stderr is a terminal (``enabled=None``) or when forced (``enabled=True``)."""

    def __init__(self, desc, targets, index, rank: int, enabled: bool | None = None) -> None:
        self.bar = None
        if rank != 0 or not _wanted(enabled):
            return
        from tqdm.auto import tqdm

        total = sum(_target_bytes(t, index) for t in targets)
        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                        desc=f"loading {len(desc.files)} file(s)", file=sys.stderr, leave=False)
        self._done = 0

    def update(self, bytes_read: int) -> None:
        if self.bar is not None:
            self.bar.update(max(0, bytes_read - self._done))
            self._done = bytes_read

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()

    @staticmethod
    def summary(line: str, enabled: bool | None = None) -> None:
        """Print the summary line on a terminal (it is always logged at INFO too)."""
        if _wanted(enabled):
            print(f"shardwise: {line}", file=sys.stderr)


def _wanted(enabled: bool | None) -> bool:
    return enabled if enabled is not None else sys.stderr.isatty()


def _target_bytes(target, index) -> int:
    """Bytes this rank reads for ``target``, in the stored dtype."""
    if target.keep == "zeros":
        return 0
    if getattr(target, "composite", None) is not None:  # built from several keys (per expert)
        return _composite_bytes(target, index)
    numel = 1
    for d in index.shapes[target.key]:
        numel *= d
    if target.keep != "whole":
        dim, ranges = target.keep
        numel = numel // max(index.shapes[target.key][dim], 1) * sum(b - a for a, b in ranges)
    return numel * index.dtypes[target.key].itemsize


def _composite_bytes(target, index) -> int:
    """Bytes of the checkpoint tensors this rank reads to build ``target``: its list entries
    only when it keeps a range of the stacked dim, else every one."""
    from .conversions import select

    entry = target.composite
    chosen = None
    if target.keep != "whole" and target.keep[0] == entry.stack_dim:
        chosen = set(select(target.keep[1]))
    total = 0
    for keys in entry.sources.values():
        for i, key in enumerate(keys):
            if chosen is None or i in chosen:
                numel = 1
                for d in index.shapes[key]:
                    numel *= d
                total += numel * index.dtypes[key].itemsize
    return total

"""Offloaded inference (ZeRO-Inference): weights streamed layer by layer from host memory or
disk through a ring of ``buffer_count`` slots, the next layers read while one computes.

* :mod:`shardwise.offload.config` — the ``offload=`` settings and their checks.
* :mod:`shardwise.offload.store` — the per-unit blobs (aligned, in the kernels' layout), the
  disk store, the direct-I/O reader and the read-bandwidth probe.
* :mod:`shardwise.offload.ring` — the ring of slots, its loaders and its stats.
* :mod:`shardwise.offload.transform` — the engine step: units, repack, free, hooks
  (:func:`offload_model`, whose :class:`OffloadReport` is ``engine.offload``).
* :mod:`shardwise.offload.graphs` — ``enable_graph`` with offload: the decode step captured one
  layer at a time, the ring's waits between the graphs (:func:`enable_offload_graphs`).

The machinery is imported on first use of those names, so ``shardwise.config`` can read the
settings without loading it.
"""

from __future__ import annotations

from typing import Any

from .config import OffloadConfig, OffloadError, parse_offload

__all__ = ["OffloadConfig", "OffloadError", "parse_offload", "OffloadReport", "Ring",
           "RingStats", "Unit", "enable_offload_graphs", "offload_model", "offload_units"]

#: name → submodule for the names loaded on first use
_LAZY = {"OffloadReport": "transform", "Unit": "transform", "offload_model": "transform",
         "offload_units": "transform", "Ring": "ring", "RingStats": "ring",
         "enable_offload_graphs": "graphs"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)

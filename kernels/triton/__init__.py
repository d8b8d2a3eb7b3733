"""The ``triton`` kernel backend: fused norms as Triton kernels, for CUDA devices.

Loaded through the ``shardwise.kernels`` entry point. Plugin discovery imports every module of
that group as soon as any backend is needed, so this module stays light: triton is imported by
:func:`register` (and by attribute access to the launchers), never by ``import shardwise`` nor by
a CPU-only run. Kernels compile on first launch per (dtype, block size), never at import.
"""

from __future__ import annotations

import importlib

import torch

BACKEND = "triton"
PLUGIN_API_VERSION = 1
#: The device types these kernels are run on; Triton targets others, which we do not claim.
DEVICE_TYPES = frozenset({"cuda"})
DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
#: Largest row one program holds: 64 KiB of input (16384 fp32 / 32768 fp16 elements); beyond
#: it a single block spills registers and a multi-block kernel would be needed.
MAX_ROW_BYTES = 65536

_LAUNCHERS = ("rms_norm", "layer_norm")
#: Further op families, each a submodule with ``register(registry)`` (importing triton inside).
FAMILIES = ("attention", "quant")

__all__ = ["rms_norm", "layer_norm", "max_hidden", "supports_hidden", "register"]


def max_hidden(dtype: torch.dtype) -> int:
    """Largest hidden size the single-block kernels accept for ``dtype``."""
    return MAX_ROW_BYTES // dtype.itemsize


def supports_hidden(*, device_type: str, dtype: torch.dtype, hidden: int | None = None,
                    **_shape) -> bool:
    """Shape predicate: a row of ``hidden`` elements must fit one block.

    Callers pass ``hidden=`` to ``resolve``; without it the kernel is chosen and checks the size
    itself at launch (raising KernelError).
    """
    return hidden is None or 0 < hidden <= max_hidden(dtype)


def __getattr__(name: str):
    """``rms_norm`` / ``layer_norm``: the launchers, imported (with triton) on first access."""
    if name in _LAUNCHERS:
        return getattr(importlib.import_module(".norms", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(registry) -> None:
    """Register the Triton kernels of every family for CUDA (imports triton)."""
    norms = importlib.import_module(".norms", __name__)
    for op in _LAUNCHERS:
        registry.register(op, BACKEND, getattr(norms, op), dtypes=DTYPES,
                          device_types=DEVICE_TYPES, supports=supports_hidden)
    for family in FAMILIES:
        importlib.import_module(f".{family}", __name__).register(registry)

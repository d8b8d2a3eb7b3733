"""The ``triton`` kernel backend: Triton kernels for CUDA devices.

Loaded through the ``shardwise.kernels`` entry point. Plugin discovery imports every module of
that group as soon as any backend is needed, so this module stays light: triton is imported by
:func:`register` (and by attribute access to the norm launchers), never by ``import shardwise``
nor by a CPU-only run. Kernels compile on first launch per (dtype, block size), never at import.

One module per op family, each with ``register(registry)`` (importing triton): ``rotary``,
``activations``, ``attention`` (prefill and decode), ``kv_cache``, ``norms``, ``quant``
(weight-only ``quant_linear``, fp16/bf16), ``moe`` (``moe_grouped_mlp``; the router and the
permutation stay the reference's). Every family of the reference has kernels here.
``common`` holds launch helpers the families share; it is not a family.
"""

from __future__ import annotations

import importlib

import torch

BACKEND = "triton"
PLUGIN_API_VERSION = 1
#: The device types these kernels are run on; Triton targets others, which we do not claim.
DEVICE_TYPES = frozenset({"cuda"})
#: The dtypes the families claim (quant: fp16/bf16 only).
DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
#: Op families, each a submodule with ``register(registry)`` (importing triton inside).
FAMILIES = ("rotary", "activations", "attention", "kv_cache", "norms", "quant", "moe")
#: Names of the norms module served from here on first access (importing triton then).
_NORMS = ("rms_norm", "layer_norm", "max_hidden", "supports_hidden", "MAX_ROW_BYTES")

__all__ = ["DEVICE_TYPES", "DTYPES", "FAMILIES", "register", *_NORMS]


def __getattr__(name: str):
    """The norms module's launchers and row limit, imported (with triton) on first access."""
    if name in _NORMS:
        return getattr(importlib.import_module(".norms", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(registry) -> None:
    """Register the Triton kernels of every family for CUDA (imports triton)."""
    for family in FAMILIES:
        importlib.import_module(f".{family}", __name__).register(registry)

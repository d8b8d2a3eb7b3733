"""The ``cpu`` kernel backend: implementations that beat the reference on CPU tensors.

One module per op family, each with ``register(registry)`` registering only what measured faster
than the reference, for the dtypes it won (each module's ``REGISTERED`` and docstring say what
and why; by how much, measured where: benchmarks/README.md, "CPU kernels against the
reference"). Families: ``rotary``, ``activations``, ``attention`` (prefill and decode),
``kv_cache``, ``norms``, ``quant`` (weight-only ``quant_linear``, bf16, when torch has its
packed kernels), ``moe`` (router and grouped expert MLP, fp32/bf16). Every family of the reference has an implementation here.
"""

from __future__ import annotations

import importlib

import torch

BACKEND = "cpu"
PLUGIN_API_VERSION = 1
DEVICE_TYPES = frozenset({"cpu"})
#: The dtypes the families may claim (each registers the subset it won; quant: bf16 only).
DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
#: Op families, each a submodule with ``register(registry)``.
FAMILIES = ("rotary", "activations", "attention", "kv_cache", "norms", "quant", "moe")
_NORMS = ("rms_norm", "layer_norm")

__all__ = ["DEVICE_TYPES", "DTYPES", "FAMILIES", "layer_norm", "rms_norm", "register"]


def __getattr__(name: str):
    """``rms_norm`` / ``layer_norm``: the norms module's, imported on first access."""
    if name in _NORMS:
        return getattr(importlib.import_module(".norms", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(registry) -> None:
    """Register every family's CPU implementations."""
    for family in FAMILIES:
        importlib.import_module(f".{family}", __name__).register(registry)

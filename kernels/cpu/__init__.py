"""The ``cpu`` kernel backend: per-family modules of implementations that beat the reference on
CPU tensors (each module's docstring gives what it measured)."""

from __future__ import annotations

import importlib

from .norms import DEVICE_TYPES, DTYPES, layer_norm, rms_norm

BACKEND = "cpu"
PLUGIN_API_VERSION = 1
FAMILIES = ("norms", "attention", "quant")

__all__ = ["DEVICE_TYPES", "DTYPES", "layer_norm", "rms_norm", "register"]


def register(registry) -> None:
    """Register every family's CPU implementations."""
    for family in FAMILIES:
        importlib.import_module(f".{family}", __name__).register(registry)

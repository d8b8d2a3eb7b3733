"""Pure-torch reference implementations: always present, run on every device, test oracles.

One module per op family; :func:`register` defines every op with its reference. A backend may
only register ops defined here.
"""

from __future__ import annotations

import importlib

from .norms import layer_norm, rms_norm

BACKEND = "reference"
PLUGIN_API_VERSION = 1
#: Op families, each a submodule with ``register(registry)``.
FAMILIES = ("norms", "attention", "quant")

__all__ = ["layer_norm", "rms_norm", "register", "examples"]


def register(registry) -> None:
    """Define every op of every family with its reference implementation."""
    for family in FAMILIES:
        importlib.import_module(f".{family}", __name__).register(registry)


def examples() -> dict:
    """Example inputs of every op, for the conformance suite: op -> builder(dtype, device) ->
    (args, kwargs). Each family module keeps its ops' builders in ``EXAMPLES``."""
    out: dict = {}
    for family in FAMILIES:
        out.update(getattr(importlib.import_module(f".{family}", __name__), "EXAMPLES", {}))
    return out

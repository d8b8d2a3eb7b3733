"""Pure-torch reference implementations: always present, run on every device, test oracles.

One module per op family, each with ``OPS`` (op -> reference), ``register(registry)`` and
``EXAMPLES`` (the conformance suite's inputs); :func:`register` defines every op with its
reference. A backend may only register ops defined here. The families and their ops:

* ``rotary``: rotary; ``activations``: bias_gelu, bias_relu, silu_and_mul;
* ``attention``: attention_prefill, attention_decode, attention_chunks; ``kv_cache``:
  kv_cache_write;
* ``norms``: rms_norm, layer_norm; ``quant``: quant_linear, quant_moe_mlp (quantized experts)
  (and the weight format);
* ``moe``: moe_route, moe_permute, moe_grouped_mlp.

``example`` is not a family: it holds :class:`~.example.Example`, the shape of example inputs.
"""

from __future__ import annotations

import importlib

from .norms import layer_norm, rms_norm

BACKEND = "reference"
PLUGIN_API_VERSION = 1
#: Op families, each a submodule with ``OPS`` and ``register(registry)``.
FAMILIES = ("rotary", "activations", "attention", "kv_cache", "norms", "quant", "moe")

__all__ = ["layer_norm", "rms_norm", "register", "examples", "FAMILIES"]


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

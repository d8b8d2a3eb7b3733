"""The ``hpu`` kernel backend: the Intel Gaudi bridge's fused ops (``hpex``) for Gaudi devices.

These are the fused ops optimum-habana puts into the models it runs on Gaudi:
``habana_frameworks.torch.hpex.kernels.FusedSDPA`` (attention), the rotary helper
``hpex.kernels.apply_rotary_pos_emb`` and ``hpex.normalization.FusedRMSNorm``
(HabanaAI/gaudi-pytorch-bridge, ``python_packages/habana_frameworks/torch/hpex/``). Each wraps
one under the contract of the torch reference (``shardwise.kernels.reference``), which stays the
oracle and the fallback: what a fused op cannot express (ALiBi, sliding windows, sinks) runs the
reference.

Loaded through the ``shardwise.kernels`` entry point; nothing of the bridge is imported until
:func:`register`. Without the bridge installed there is no Gaudi to run on and nothing is
registered; an installed bridge whose ``hpex`` fails to import is an error the registry reports
(and resolution falls back to the reference). One module per op family, each with
``register(registry, hpex)``.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace

import torch

BACKEND = "hpu"
PLUGIN_API_VERSION = 1
#: The device type these kernels run on.
DEVICE_TYPES = frozenset({"hpu"})
#: bf16 (Gaudi's native type), fp32, fp16 (Gaudi2 and newer; the accelerator refuses it on Gaudi1).
DTYPES = frozenset({torch.bfloat16, torch.float32, torch.float16})
#: Op families, each a submodule with ``register(registry, hpex)``.
FAMILIES = ("norms", "rotary", "attention")

__all__ = ["BACKEND", "DEVICE_TYPES", "DTYPES", "FAMILIES", "hpex_ops", "register"]


def hpex_ops() -> SimpleNamespace:
    """The bridge's fused ops this backend wraps (imports ``habana_frameworks.torch.hpex``)."""
    kernels = importlib.import_module("habana_frameworks.torch.hpex.kernels")
    normalization = importlib.import_module("habana_frameworks.torch.hpex.normalization")
    return SimpleNamespace(FusedSDPA=kernels.FusedSDPA,
                           apply_rotary_pos_emb=kernels.apply_rotary_pos_emb,
                           RotaryPosEmbeddingMode=kernels.RotaryPosEmbeddingMode,
                           FusedRMSNorm=normalization.FusedRMSNorm)


def register(registry) -> None:
    """Register every family's kernels for HPU devices (imports the bridge's ``hpex``); without
    the bridge installed, nothing (there is no Gaudi here)."""
    if importlib.util.find_spec("habana_frameworks") is None:
        return
    ops = hpex_ops()
    for family in FAMILIES:
        importlib.import_module(f".{family}", __name__).register(registry, ops)

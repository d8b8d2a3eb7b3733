"""The ``hpu`` backend's norms: ``rms_norm`` on the bridge's ``FusedRMSNorm``
(``hpex/normalization/FusedRMSNorm.py``: ``FusedRMSNorm.apply(data_in, gamma, eps)``, one fused
TPC kernel). ``layer_norm`` stays the reference (the graph compiler fuses it)."""

from __future__ import annotations

from functools import partial

import torch

from . import DEVICE_TYPES, DTYPES

BACKEND = "hpu"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, hpex) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual-add + RMSNorm; contract of ``shardwise.kernels.reference.rms_norm``.

    x, residual: [..., hidden]; weight: [hidden]. Returns ``(out, h)`` in x.dtype, ``h = x +
    residual`` (x without one). The fused op normalises and scales in one pass, so bf16/fp16
    results round once where the reference rounds before the weight too (within the dtype's
    tolerance)."""
    h = x if residual is None else x + residual
    out = hpex.FusedRMSNorm.apply(h, weight.to(h.dtype), eps)
    return out.to(x.dtype), h


def register(registry, hpex) -> None:
    """Register ``rms_norm`` for HPU in bf16/fp32/fp16."""
    fn = partial(rms_norm, hpex=hpex)
    fn.__module__ = __name__
    registry.register("rms_norm", BACKEND, fn, dtypes=DTYPES, device_types=DEVICE_TYPES)

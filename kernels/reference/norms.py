"""Norms (reference): residual-add + ``rms_norm`` / ``layer_norm``.

They favour clarity and accuracy over speed: statistics are computed in float32 and the result is
cast back to the input dtype, which is what the fused backends must match.
"""

from __future__ import annotations

import torch

from .example import randn

BACKEND = "reference"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual-add then RMSNorm.

    x, residual: [..., hidden]; weight: [hidden].
    Returns ``(out, h)`` where ``h = x + residual`` (or ``x`` when no residual) is the new residual
    stream and ``out = h / sqrt(mean(h**2) + eps) * weight``, both in ``x.dtype``.
    """
    h = x if residual is None else x + residual
    hf = h.float()
    inv = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    out = (hf * inv).to(x.dtype) * weight.to(x.dtype)
    return out, h


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual-add then LayerNorm.

    x, residual: [..., hidden]; weight, bias: [hidden] (bias may be None).
    Returns ``(out, h)`` with ``h = x + residual`` and ``out = (h - mean) / sqrt(var + eps) * weight
    + bias`` (biased variance, as ``torch.nn.LayerNorm``), both in ``x.dtype``.
    """
    h = x if residual is None else x + residual
    hf = h.float()
    mean = hf.mean(-1, keepdim=True)
    var = (hf - mean).pow(2).mean(-1, keepdim=True)
    out = (hf - mean) * torch.rsqrt(var + eps) * weight.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype), h


OPS = {"rms_norm": rms_norm, "layer_norm": layer_norm}


def register(registry) -> None:
    """Define the norm ops with their references."""
    for op, fn in OPS.items():
        registry.register(op, BACKEND, fn)


# ----- example inputs (conformance suite): op -> (dtype, device) -> (args, kwargs) ---------------

def _rms_norm_example(dtype: torch.dtype, device: torch.device) -> tuple[tuple, dict]:
    x, res, w = randn(3, 64, seed=4), randn(3, 64, seed=5), 1 + 0.1 * randn(64, seed=6)
    return (x.to(device, dtype), w.to(device, dtype), 1e-6), {"residual": res.to(device, dtype)}


def _layer_norm_example(dtype: torch.dtype, device: torch.device) -> tuple[tuple, dict]:
    x, res = randn(3, 64, seed=7), randn(3, 64, seed=8)
    w, b = 1 + 0.1 * randn(64, seed=9), 0.1 * randn(64, seed=10)
    args = (x.to(device, dtype), w.to(device, dtype), b.to(device, dtype), 1e-5)
    return args, {"residual": res.to(device, dtype)}


EXAMPLES = {"rms_norm": _rms_norm_example, "layer_norm": _layer_norm_example}

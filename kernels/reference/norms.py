"""Pure-torch reference implementations: always present, run on every device, test oracles.

They favour clarity and accuracy over speed: statistics are computed in float32 and the result is
cast back to the input dtype, which is what the fused backends must match.
"""

from __future__ import annotations

import torch

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


def register(registry) -> None:
    """Define every op with its reference implementation."""
    registry.register("rms_norm", BACKEND, rms_norm)
    registry.register("layer_norm", BACKEND, layer_norm)


# ----- example inputs (conformance suite): op -> (dtype, device) -> (args, kwargs) ---------------

def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rms_norm_example(dtype: torch.dtype, device: torch.device) -> tuple[tuple, dict]:
    x, res, w = _randn(3, 64, seed=4), _randn(3, 64, seed=5), 1 + 0.1 * _randn(64, seed=6)
    return (x.to(device, dtype), w.to(device, dtype), 1e-6), {"residual": res.to(device, dtype)}


def _layer_norm_example(dtype: torch.dtype, device: torch.device) -> tuple[tuple, dict]:
    x, res = _randn(3, 64, seed=7), _randn(3, 64, seed=8)
    w, b = 1 + 0.1 * _randn(64, seed=9), 0.1 * _randn(64, seed=10)
    args = (x.to(device, dtype), w.to(device, dtype), b.to(device, dtype), 1e-5)
    return args, {"residual": res.to(device, dtype)}


EXAMPLES = {"rms_norm": _rms_norm_example, "layer_norm": _layer_norm_example}

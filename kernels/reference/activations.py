"""Activations (reference): ``bias_gelu``, ``bias_relu``, ``silu_and_mul``.

Pure torch, clear over fast: the oracles every backend is tested against. Math in float32, each
result rounded to the input dtype once, at the end. x ``[..., n]``; a bias is ``[n]`` or None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.errors import KernelError

from .example import randn

BACKEND = "reference"
GELU_APPROXIMATIONS = ("none", "tanh")


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None,
              approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)``: x [..., n], bias [n] or None; approximate "none" (erf) or "tanh"
    (as ``torch.nn.functional.gelu``). Returns [..., n] in x.dtype."""
    if approximate not in GELU_APPROXIMATIONS:
        raise KernelError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    h = x.float() if bias is None else x.float() + bias.float()
    return F.gelu(h, approximate=approximate).to(x.dtype)


def bias_relu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``relu(x + bias)`` (OPT's fc1 activation): x [..., n], bias [n] or None. Returns [..., n]
    in x.dtype."""
    h = x.float() if bias is None else x.float() + bias.float()
    return F.relu(h).to(x.dtype)


def silu_and_mul(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``.

    One tensor: x [..., 2 * inter] holds gate then up (a fused gate_up projection); two tensors:
    x is the gate [..., inter] and ``up`` [..., inter]. Returns [..., inter] in x.dtype.
    """
    if up is None:
        if x.shape[-1] % 2:
            raise KernelError(f"silu_and_mul needs an even last dim [.., 2 * inter], got "
                              f"{tuple(x.shape)}")
        x, up = x.chunk(2, dim=-1)
    elif up.shape != x.shape:
        raise KernelError(f"gate and up must have one shape, got {tuple(x.shape)}, "
                          f"{tuple(up.shape)}")
    return (F.silu(x.float()) * up.float()).to(x.dtype)


OPS = {"bias_gelu": bias_gelu, "bias_relu": bias_relu, "silu_and_mul": silu_and_mul}


def register(registry) -> None:
    """Define the activation ops with their references."""
    for op, fn in OPS.items():
        registry.register(op, BACKEND, fn)


# ----- example inputs (conformance suite): op -> (dtype, device) -> (args, kwargs) ---------------

def _bias_gelu_example(dtype, device):
    x, b = randn(3, 40, seed=13), randn(40, seed=14)
    return (x.to(device, dtype), b.to(device, dtype)), {"approximate": "tanh"}


def _bias_relu_example(dtype, device):
    x, b = randn(3, 40, seed=24), randn(40, seed=25)
    return (x.to(device, dtype), b.to(device, dtype)), {}


def _silu_and_mul_example(dtype, device):
    return (randn(3, 2 * 24, seed=15).to(device, dtype),), {}


EXAMPLES = {"bias_gelu": _bias_gelu_example, "bias_relu": _bias_relu_example,
            "silu_and_mul": _silu_and_mul_example}

"""Activations as fused elementwise Triton kernels (CUDA): bias_gelu, bias_relu, silu_and_mul.

Contracts are those of ``shardwise.kernels.reference.activations``. Math is float32 inside the
kernels; results are rounded to the input dtype once. Importing this module imports triton; it
is imported by ``register`` of the triton backend only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardwise.errors import KernelError
from shardwise.kernels.reference import activations as ref

from . import DEVICE_TYPES, DTYPES
from .common import as_rows

BACKEND = "triton"

_ACT_BLOCK = 1024  # elements per program of the elementwise kernels
#: ``ACT`` of :func:`_bias_act_kernel`: the activation applied after the bias add.
_GELU, _GELU_TANH, _RELU = 0, 1, 2


@triton.jit
def _bias_act_kernel(X, B, O, n_cols, stride_x, stride_o, HAS_BIAS: tl.constexpr,
                     ACT: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, column block): ``act(x + bias)`` of BLOCK columns of one row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 2:  # relu (NaN stays NaN, as torch's)
        y = tl.where(h < 0.0, 0.0, h)
    elif ACT == 1:  # gelu tanh: 0.5 (1 + tanh(z)) == sigmoid(2z), z = sqrt(2/pi) (h + 0.044715 h³)
        y = h * tl.sigmoid(1.5957691216057308 * (h + 0.044715 * h * h * h))
    else:  # gelu erf
        y = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
    tl.store(O + row * stride_o + cols, y.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(G, U, O, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(O + row * stride_o + cols, (g * tl.sigmoid(g) * u).to(O.dtype.element_ty),
             mask=mask)

def _act_grid(rows: int, cols: int) -> tuple[int, int]:
    return rows, triton.cdiv(cols, _ACT_BLOCK)


def _bias_act(x: torch.Tensor, bias: torch.Tensor | None, act: int) -> torch.Tensor:
    """``act(x + bias)`` in one launch: x [..., n], bias [n] or None. Returns [..., n]."""
    n = x.shape[-1]
    x2 = as_rows(x, n)  # [rows, n]
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.numel():
        b = bias.contiguous() if bias is not None else x2
        _bias_act_kernel[_act_grid(*x2.shape)](
            x2, b, out, n, x2.stride(0), out.stride(0), HAS_BIAS=bias is not None, ACT=act,
            BLOCK=_ACT_BLOCK)
    return out.view(x.shape)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None,
              approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)`` fused; contract of the reference: x [..., n], bias [n] or None."""
    if approximate not in ref.GELU_APPROXIMATIONS:
        raise KernelError(f"approximate must be one of {ref.GELU_APPROXIMATIONS}, got "
                          f"{approximate!r}")
    return _bias_act(x, bias, _GELU_TANH if approximate == "tanh" else _GELU)


def bias_relu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``relu(x + bias)`` fused; contract of the reference: x [..., n], bias [n] or None."""
    return _bias_act(x, bias, _RELU)


def silu_and_mul(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` fused; contract of the reference: x [..., 2*inter] (gate, up) or the
    gate [..., inter] with ``up`` [..., inter]. Returns [..., inter]."""
    if up is None:
        if x.shape[-1] % 2:
            raise KernelError(f"silu_and_mul needs an even last dim [.., 2 * inter], got "
                              f"{tuple(x.shape)}")
        inter = x.shape[-1] // 2
        rows = as_rows(x, 2 * inter)
        gate, up2 = rows[:, :inter], rows[:, inter:]  # views: row stride 2 * inter
    else:
        if up.shape != x.shape:
            raise KernelError(f"gate and up must have one shape, got {tuple(x.shape)}, "
                              f"{tuple(up.shape)}")
        inter = x.shape[-1]
        gate, up2 = as_rows(x, inter), as_rows(up, inter)
    out = torch.empty(gate.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        _silu_mul_kernel[_act_grid(*out.shape)](
            gate, up2, out, inter, gate.stride(0), up2.stride(0), out.stride(0),
            BLOCK=_ACT_BLOCK)
    return out.view(*x.shape[:-1], inter)


OPS = {"bias_gelu": bias_gelu, "bias_relu": bias_relu, "silu_and_mul": silu_and_mul}


def register(registry) -> None:
    """Register the activation kernels for CUDA in fp32/fp16/bf16."""
    for op, fn in OPS.items():
        registry.register(op, BACKEND, fn, dtypes=DTYPES, device_types=DEVICE_TYPES)

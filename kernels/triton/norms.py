"""Triton kernels for fused residual-add + RMSNorm / LayerNorm.

One program normalizes one row: the whole row sits in one block of ``BLOCK`` (the next power of
two of the hidden size) lanes, statistics accumulate in float32, and the results are written in
the input dtype. Numerics follow ``shardwise.kernels.reference.norms`` in order of operations:

* rms_norm:   ``out = (h * rsqrt(mean(h²) + eps)).to(x.dtype) * weight.to(x.dtype)``
* layer_norm: ``out = ((h - mean) * rsqrt(var + eps) * weight + bias).to(x.dtype)`` in float32

where ``h = x + residual`` is rounded to ``x.dtype`` (as torch does) and written back as the new
residual stream. Importing this module imports triton; ``import shardwise`` never does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardwise.errors import KernelError

from . import DEVICE_TYPES, DTYPES
from .common import as_rows

BACKEND = "triton"
#: Largest row one program holds: 64 KiB of input (16384 fp32 / 32768 fp16 elements); beyond
#: it a single block spills registers and a multi-block kernel would be needed.
MAX_ROW_BYTES = 65536


def max_hidden(dtype: torch.dtype) -> int:
    """Largest hidden size the single-block kernels accept for ``dtype``."""
    return MAX_ROW_BYTES // dtype.itemsize


def supports_hidden(*, device_type: str, dtype: torch.dtype, hidden: int | None = None,
                    **_shape) -> bool:
    """Shape predicate: a row of ``hidden`` elements must fit one block.

    Callers pass ``hidden=`` to ``resolve``; without it the kernel is chosen and checks the size
    itself at launch (raising KernelError).
    """
    return hidden is None or 0 < hidden <= max_hidden(dtype)


@triton.jit
def _load_h(X, R, H, row, cols, mask, stride_x, stride_r, stride_h, HAS_RES: tl.constexpr):
    """Row ``row`` of ``h = x + residual`` rounded to x's dtype, returned as float32; stored to
    ``H`` when a residual is given. Arithmetic is done in float32 and rounded once, which equals
    torch's half-precision add and also runs under the interpreter (which has no bf16 math)."""
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(H + row * stride_h + cols, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, H, stride_x, stride_r, stride_o, stride_h, n_cols, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: rows * stride may exceed 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    hf = _load_h(X, R, H, row, cols, mask, stride_x, stride_r, stride_h, HAS_RES)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / n_cols + eps)  # masked lanes are 0
    dtype = OUT.dtype.element_ty
    # Round the normalized row and the weight to x's dtype before multiplying, as the reference
    # (HF Llama) does; their product is exact in float32, so one rounding equals a bf16/fp16 mul.
    normed = (hf * inv).to(dtype).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(dtype).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (normed * w).to(dtype), mask=mask)


@triton.jit
def _layer_norm_kernel(X, R, W, B, OUT, H, stride_x, stride_r, stride_o, stride_h, n_cols, eps,
                       HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    hf = _load_h(X, R, H, row, cols, mask, stride_x, stride_r, stride_h, HAS_RES)
    mean = tl.sum(hf, axis=0) / n_cols
    centered = tl.where(mask, hf - mean, 0.0)  # padding lanes must not add to the variance
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    out = centered * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out = out + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, out.to(OUT.dtype.element_ty), mask=mask)


def _prepare(x: torch.Tensor, residual: torch.Tensor | None):
    """Check inputs; return x and residual as rows, the outputs (out, h) and launch settings."""
    hidden = x.shape[-1]
    if hidden > max_hidden(x.dtype):
        raise KernelError(f"triton norm kernels hold one row per block: hidden size {hidden} "
                          f"exceeds {max_hidden(x.dtype)} for {x.dtype}; use the reference")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise KernelError(f"residual must match x: got {tuple(residual.shape)} {residual.dtype} "
                          f"for x {tuple(x.shape)} {x.dtype}")
    x2 = as_rows(x, hidden)
    r2 = as_rows(residual, hidden) if residual is not None else x2  # x2: unused placeholder
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)  # [rows, hidden]
    h2 = torch.empty_like(out) if residual is not None else out  # out: unused placeholder
    block = triton.next_power_of_2(hidden)
    warps = min(max(block * x.element_size() // 256, 1), 16)
    return x2, r2, out, h2, block, warps


def _result(x, residual, out, h2):
    """(out, h) in x's shape; h is x itself when there was no residual (as the reference)."""
    h = x if residual is None else h2.view(x.shape)
    return out.view(x.shape), h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual-add + RMSNorm; same contract as ``shardwise.kernels.reference.rms_norm``.

    x, residual: [..., hidden] (same dtype); weight: [hidden]. Returns ``(out, h)``.
    """
    x2, r2, out, h2, block, warps = _prepare(x, residual)
    if x2.numel():
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out, h2, x2.stride(0), r2.stride(0), out.stride(0),
            h2.stride(0), x2.shape[1], eps, HAS_RES=residual is not None, BLOCK=block,
            num_warps=warps)
    return _result(x, residual, out, h2)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual-add + LayerNorm; same contract as ``shardwise.kernels.reference.layer_norm``.

    x, residual: [..., hidden] (same dtype); weight, bias: [hidden] (bias may be None).
    """
    x2, r2, out, h2, block, warps = _prepare(x, residual)
    w = weight.contiguous()
    if x2.numel():
        _layer_norm_kernel[(x2.shape[0],)](
            x2, r2, w, bias.contiguous() if bias is not None else w, out, h2, x2.stride(0),
            r2.stride(0), out.stride(0), h2.stride(0), x2.shape[1], eps,
            HAS_RES=residual is not None, HAS_BIAS=bias is not None, BLOCK=block,
            num_warps=warps)
    return _result(x, residual, out, h2)


OPS = {"rms_norm": rms_norm, "layer_norm": layer_norm}


def register(registry) -> None:
    """Register both norms for CUDA in fp32/fp16/bf16, for rows that fit one block."""
    for op, fn in OPS.items():
        registry.register(op, BACKEND, fn, dtypes=DTYPES, device_types=DEVICE_TYPES,
                          supports=supports_hidden)

"""The ``cpu`` backend's norms: residual-add + norms with fewer passes than the reference.

* layer_norm: ``F.layer_norm``, one fused ATen kernel (float32 statistics, also with a float32
  weight on bf16/fp16 input) instead of the reference's separate steps.
* rms_norm: torch 2.13 has no fused CPU kernel (``F.rms_norm`` decomposes into the reference's
  own pow/mean/rsqrt/mul steps and measured no faster), so this computes ``sum(h²)`` with
  ``vector_norm`` (no temporary) and scales in place, keeping the reference's cast order (round
  to x.dtype, then multiply by the weight): a little faster.

Both measured faster than the reference in fp32, bf16 and fp16, so all are registered
(benchmarks/README.md, "CPU kernels against the reference"). float64 is not registered: the
reference computes in float32, which these would not reproduce.

Inside a compiled CPU step of a wide enough model
(:func:`~shardwise.kernels.cpu.native.in_compiled_step`), rms_norm is
the native op ``cpu_rms_norm`` / ``cpu_add_rms_norm`` (``native/elementwise.cpp``: the same
roundings, two passes over the row): one opaque call where the torch form made inductor generate
and build a fused kernel per layer and fusion pattern, most of a first start's compile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import DEVICE_TYPES, DTYPES, native

BACKEND = "cpu"


def _residual_add(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """The new residual stream ``h`` (x itself when there is no residual), as the reference."""
    return x if residual is None else x + residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual-add + RMSNorm; contract of ``shardwise.kernels.reference.rms_norm``.

    x, residual: [..., hidden]; weight: [hidden]. Returns ``(out, h)`` in x.dtype.
    """
    if native.in_compiled_step("rms_norm", x.shape[-1]):
        return _native_rms_norm(x, weight.to(x.dtype), eps, residual)
    h = _residual_add(x, residual)
    hf = h.float()  # [..., hidden]; h itself for fp32, else a float32 copy we may overwrite
    # sum(h²) as a norm: one read pass and no [..., hidden] temporary. inv: [..., 1].
    inv = torch.linalg.vector_norm(hf, 2, -1, keepdim=True).square_()
    inv = inv.mul_(1.0 / h.shape[-1]).add_(eps).rsqrt_()
    normed = torch.mul(hf, inv) if hf is h else hf.mul_(inv)
    # Round to x.dtype before the weight, as the reference (HF Llama) does.
    out = normed.to(x.dtype).mul_(weight.to(x.dtype))
    return out, h


def _native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm` as one native call (the op cannot return x itself as ``h``)."""
    if residual is None:
        return torch.ops.shardwise_native.cpu_rms_norm(x, weight, eps), x
    return torch.ops.shardwise_native.cpu_add_rms_norm(x, residual, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual-add + LayerNorm; contract of ``shardwise.kernels.reference.layer_norm``.

    x, residual: [..., hidden]; weight, bias: [hidden] (bias may be None). The native kernel
    accepts a float32 weight/bias with bf16/fp16 input (as the reference's ``weight.float()``).
    """
    h = _residual_add(x, residual)
    weight, bias = _norm_params(h.dtype, weight, bias)
    out = F.layer_norm(h, (h.shape[-1],), weight, bias, eps)
    return out.to(x.dtype), h


def _norm_params(dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None):
    """Weight and bias as F.layer_norm takes them with ``dtype`` input: all in ``dtype``, else
    both in float32 (its mixed-precision path; exact, like the reference's ``.float()``)."""
    if weight.dtype == dtype and (bias is None or bias.dtype == dtype):
        return weight, bias
    return weight.float(), (bias.float() if bias is not None else None)


#: op → (implementation, dtypes it is registered for): both won in fp32, bf16 and fp16.
REGISTERED = {"rms_norm": (rms_norm, DTYPES), "layer_norm": (layer_norm, DTYPES)}


def register(registry) -> None:
    """Register both norms for CPU tensors in fp32/bf16/fp16."""
    for op, (fn, dtypes) in REGISTERED.items():
        registry.register(op, BACKEND, fn, dtypes=dtypes, device_types=DEVICE_TYPES)

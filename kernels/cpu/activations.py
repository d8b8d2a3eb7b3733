"""The ``cpu`` backend's activations: in the input dtype, fewer passes and buffers.

Contracts are those of ``shardwise.kernels.reference.activations`` (shapes, bias, fused or split
gate/up). Only what measured faster than the reference is registered (``REGISTERED``), per dtype.
Speed-ups: ``python benchmarks/kernel_attention.py --threads 1 --dtypes float32 bfloat16 float16``
(median of interleaved calls; 1 thread of a shared 2-core AMD EPYC VM with AVX-512, torch 2.13;
~1B-Llama shapes: 32/4 heads of 64, 128-token prompts, decode over ~1-2k of a 2048-token cache;
ranges over repeated runs on a noisy machine):

* bias_gelu (bf16): ``F.gelu(x + bias)`` in the input dtype (the bias add is rounded before the
  gelu, as an HF ``Linear`` + ``gelu``; within 1 ulp): 1.25-1.4x for "none". "tanh" measured
  no faster (0.99-1.06x), nor did fp32 (1.0x, the reference's own ops) or fp16 (0.9-0.97x):
  those run the reference's code, registered as the backend's choice for every dtype so that
  injection does not report a fallback where there is nothing faster to fall back from.
* bias_relu (fp32, bf16, fp16): ``torch.add(x, bias).relu_()`` in the input dtype, one pass
  and one buffer fewer (a bias of x's dtype gives exactly the reference's numbers: one rounded
  add, and relu commutes with rounding): with a
  bias 1.3-1.6x fp32, 1.15-1.7x bf16, 1.4-1.9x fp16 (OPT 8192-wide and 3072-wide MLPs, 8 and
  128 rows); without one ``F.relu`` 1.0-1.3x fp32 (the same op), 1.7-1.9x bf16, 2.1-2.6x fp16.
* silu_and_mul (fp32, bf16, fp16): ``F.silu(gate).mul_(up)`` in the input dtype (bf16/fp16
  round silu once before the multiply, as HF's MLP does): 1.14-1.5x fp32, 1.25-1.85x bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.kernels.reference import activations as ref

from . import DEVICE_TYPES, DTYPES

BACKEND = "cpu"


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None,
              approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)`` in x's dtype; contract of the reference ``bias_gelu``. Only bf16
    "none" takes the fused path; the rest measured no faster than the reference's code, which
    they run (bad values raise the reference's error)."""
    if approximate != "none" or x.dtype != torch.bfloat16:
        return ref.bias_gelu(x, bias, approximate)
    h = x if bias is None else x + bias.to(x.dtype)
    return F.gelu(h, approximate=approximate)


def bias_relu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``relu(x + bias)`` in x's dtype, the add's buffer reused; contract of the reference
    ``bias_relu``: x [..., n], bias [n] or None."""
    if bias is None:
        return F.relu(x)
    return torch.add(x, bias.to(x.dtype)).relu_()


def silu_and_mul(x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` in x's dtype; contract of the reference ``silu_and_mul``."""
    if up is None:
        if x.shape[-1] % 2:
            return ref.silu_and_mul(x)  # raises the reference's error
        x, up = x.chunk(2, dim=-1)
    elif up.shape != x.shape:
        return ref.silu_and_mul(x, up)
    return F.silu(x).mul_(up)


#: op → (implementation, dtypes it is registered for): only what measured faster.
REGISTERED = {
    "bias_gelu": (bias_gelu, DTYPES),
    "bias_relu": (bias_relu, DTYPES),
    "silu_and_mul": (silu_and_mul, DTYPES),
}
#: ops whose implementation may run inside the CPU graph strategy's compiled step
CAPTURABLE: frozenset[str] = frozenset()


def register(registry) -> None:
    """Register the CPU activations for the dtypes they won."""
    for op, (fn, dtypes) in REGISTERED.items():
        registry.register(op, BACKEND, fn, dtypes=dtypes, device_types=DEVICE_TYPES,
                          capturable=op in CAPTURABLE)

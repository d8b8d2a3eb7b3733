"""The ``cpu`` backend's activations: in the input dtype, fewer passes and buffers.

Contracts are those of ``shardwise.kernels.reference.activations`` (shapes, bias, fused or split
gate/up). Only what measured faster than the reference is registered (``REGISTERED``), per dtype;
the speed-ups, their command and machine are in benchmarks/README.md, "CPU kernels against the
reference":

* bias_gelu (bf16): ``F.gelu(x + bias)`` in the input dtype (the bias add is rounded before the
  gelu, as an HF ``Linear`` + ``gelu``; within 1 ulp): faster for ``approximate="none"``.
  "tanh" measured no faster, nor did fp32 (the reference's own ops) or fp16: those run the
  reference's code, registered as the backend's choice for every dtype so that
  injection does not report a fallback where there is nothing faster to fall back from.
* bias_relu (fp32, bf16, fp16): ``torch.add(x, bias).relu_()`` in the input dtype, one pass
  and one buffer fewer (a bias of x's dtype gives exactly the reference's numbers: one rounded
  add, and relu commutes with rounding): faster in every dtype with a bias; without one
  ``F.relu``, the same op as the reference's in fp32 and faster in bf16/fp16.
* silu_and_mul (fp32, bf16, fp16): ``F.silu(gate).mul_(up)`` in the input dtype (bf16/fp16
  round silu once before the multiply, as HF's MLP does): one buffer and pass fewer, faster
  than the reference. Inside a compiled CPU step of a wide enough model
  (:func:`~shardwise.kernels.cpu.native.in_compiled_step`) the native op ``cpu_silu_and_mul``
  (``native/elementwise.cpp``: the same two roundings, bit for bit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.kernels.reference import activations as ref

from . import DEVICE_TYPES, DTYPES, native

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
        if native.in_compiled_step("silu_and_mul", x.shape[-1] // 2):  # x [.., gate | up]
            return torch.ops.shardwise_native.cpu_silu_and_mul(x, None)
        x, up = x.chunk(2, dim=-1)
    elif up.shape != x.shape:
        return ref.silu_and_mul(x, up)
    elif native.in_compiled_step("silu_and_mul", x.shape[-1]):
        return torch.ops.shardwise_native.cpu_silu_and_mul(x, up)
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

"""The shape of an op's example inputs, which the conformance suite runs on every backend.

Each family module of the reference keeps its ops' builders in ``EXAMPLES`` (op -> builder(dtype,
device) -> :class:`Example` or ``(args, kwargs)``); :func:`randn` gives them seeded inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


def randn(*shape: int, seed: int) -> torch.Tensor:
    """A float32 standard-normal tensor of ``shape`` on the CPU, the same for the same seed."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@dataclass
class Example:
    """Inputs for one call of an op.

    ``resolve`` are the shape keywords passed to ``registry.resolve`` (e.g. a quantized weight's
    spec, without which backends leave the op to the reference). ``bind(impl, args) -> args``
    adapts the arguments to the resolved implementation (e.g. prepacks a weight in its layout);
    it is applied to the backend's and to the reference's copy alike. ``expect(impl, args)``
    (after ``bind``) may give the result a backend must match instead of the reference's, for a
    kernel that declares other numerics (e.g. activations rounded to 8 bits), or None.
    """

    args: tuple
    kwargs: dict = field(default_factory=dict)
    resolve: dict = field(default_factory=dict)
    bind: Callable[[Any, tuple], tuple] | None = None
    expect: Callable[[Any, tuple], Any] | None = None

    @classmethod
    def of(cls, built: "Example | tuple") -> "Example":
        """An Example from a builder's result (a plain ``(args, kwargs)`` pair is accepted)."""
        return built if isinstance(built, cls) else cls(*built)

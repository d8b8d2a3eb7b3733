"""The shape of an op's example inputs, which the conformance suite runs on every backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Example:
    """Inputs for one call of an op.

    ``resolve`` are the shape keywords passed to ``registry.resolve`` (e.g. a quantized weight's
    spec, without which backends leave the op to the reference). ``bind(impl, args) -> args``
    adapts the arguments to the resolved implementation (e.g. prepacks a weight in its layout);
    it is applied to the backend's and to the reference's copy alike.
    """

    args: tuple
    kwargs: dict = field(default_factory=dict)
    resolve: dict = field(default_factory=dict)
    bind: Callable[[Any, tuple], tuple] | None = None

    @classmethod
    def of(cls, built: "Example | tuple") -> "Example":
        """An Example from a builder's result (a plain ``(args, kwargs)`` pair is accepted)."""
        return built if isinstance(built, cls) else cls(*built)

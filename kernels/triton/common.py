"""Launch helpers the Triton families share (pure torch: no triton import, not a family)."""

from __future__ import annotations

import math

import torch

from shardwise.errors import KernelError


def same_device(first: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise KernelError naming any tensor that is not on ``first``'s device (a kernel would
    read a host pointer otherwise)."""
    wrong = {name: str(t.device) for name, t in others.items()
             if t is not None and t.device != first.device}
    if wrong:
        raise KernelError(f"triton kernels need every tensor on {first.device}; got {wrong}")


def strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides as a tuple, to splat into a launch's arguments."""
    return tuple(t.stride())


def as_rows(t: torch.Tensor, cols: int) -> torch.Tensor:
    """[..., cols] → [rows, cols] with a unit stride along cols (copies only if needed)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(math.prod(t.shape[:-1]), cols)  # not -1: ambiguous for empty tensors

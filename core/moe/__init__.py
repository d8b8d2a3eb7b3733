"""Mixture-of-Experts: the policies' data (:class:`MoESpec`) and the one generic mechanism that
runs every family's MoE blocks through the ``moe`` kernels, this rank's experts only."""

from .spec import EXPERT_LAYOUTS, MoESpec

__all__ = ["EXPERT_LAYOUTS", "MoESpec"]

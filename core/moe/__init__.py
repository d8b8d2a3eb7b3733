"""Mixture-of-Experts: the policies' data (:class:`MoESpec`) and the one generic mechanism that
runs every family's MoE blocks through the ``moe`` kernels, this rank's experts only
(:func:`install_moe`, :mod:`shardwise.moe.block`)."""

from .block import (MoEBlockForward, MoEError, MoEReport, check_moe, install_moe,
                    to_stacked_layout)
from .spec import EXPERT_LAYOUTS, MoESpec

__all__ = ["EXPERT_LAYOUTS", "MoEBlockForward", "MoEError", "MoEReport", "MoESpec", "check_moe",
           "install_moe", "to_stacked_layout"]

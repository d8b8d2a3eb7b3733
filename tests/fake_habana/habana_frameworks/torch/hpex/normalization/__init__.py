"""Stand-in for ``habana_frameworks/torch/hpex/normalization/__init__.py``."""

from .FusedRMSNorm import FusedRMSNorm, RmsNormBwdMode  # noqa: F401

"""Stand-in for ``habana_frameworks/torch/hpex/kernels/__init__.py``: the fused attention and
rotary helpers optimum-habana puts into the models it runs (names as the bridge exports them)."""

from .FusedSDPA import FusedSDPA  # noqa: F401
from .RotaryPosEmbeddingHelper import (RotaryPosEmbeddingHelperV1,  # noqa: F401
                                       RotaryPosEmbeddingHelperV2, RotaryPosEmbeddingMode,
                                       apply_rotary_pos_emb)

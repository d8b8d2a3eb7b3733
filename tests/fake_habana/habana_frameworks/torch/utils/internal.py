"""Stand-in for ``habana_frameworks/torch/utils/internal.py`` (as the bridge, word for word):
lazy unless ``PT_HPU_LAZY_MODE`` is "0", read once per process and cached."""

import os


def is_lazy():
    if is_lazy._is_lazy is None:
        is_lazy._is_lazy = os.getenv("PT_HPU_LAZY_MODE", "1") != "0"
    return is_lazy._is_lazy


is_lazy._is_lazy = None

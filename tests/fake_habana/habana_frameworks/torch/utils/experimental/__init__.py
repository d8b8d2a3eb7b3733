"""Stand-in for ``habana_frameworks/torch/utils/experimental/__init__.py``: the device-generation
probe DeepSpeed's HPU accelerator calls (``_is_fp16_supported``: False on first-generation
Gaudi). The stand-in is a Gaudi2: fp16 supported."""


def _is_fp16_supported():
    return True

"""Stand-in for ``habana_frameworks/torch/hpu/__init__.py`` (gaudi-pytorch-bridge): device
queries, memory, streams, and ``HPUGraph`` exported only in lazy mode (``if is_lazy(): from
.graphs import *``). Registers itself as ``torch.hpu`` (the bridge's ``torch.hpu`` module).

One device per process: a process drives the module ``HLS_MODULE_ID`` names (set by
``distributed.hccl`` from ``LOCAL_RANK``), else the first free one, so ``current_device()`` is
always 0 and tensors go to ``torch.device("hpu")``."""

import os
import sys

import torch
from habana_frameworks.torch.utils.internal import is_lazy

from ._utils import (HABANA_VISIBLE_MODULES_VAR, HLS_MODULE_ID_VAR,  # noqa: F401
                     _get_available_modules_from_environ, _get_device_index,
                     _get_module_id_from_environ)
from .memory import *  # noqa: F401,F403
from .streams import *  # noqa: F401,F403

if is_lazy():
    from .graphs import *  # noqa: F401,F403


def is_available():
    return device_count() > 0


def device_count():
    return len(_get_available_modules_from_environ())


def current_device():
    return 0


def get_device_name(device=None):
    return "GAUDI2"


def synchronize():
    pass


def set_device(device):
    """As the bridge: without HABANA_VISIBLE_MODULES and HLS_MODULE_ID only index 0 exists."""
    device_idx = _get_device_index(device, optional=True)
    available = _get_available_modules_from_environ()
    if (_get_module_id_from_environ() == -1 and HABANA_VISIBLE_MODULES_VAR not in os.environ
            and device_count() < 8):
        assert device_idx == 0, (f"As {HABANA_VISIBLE_MODULES_VAR} is not provided, the only "
                                 f"supported device idx is 0.")
    else:
        os.environ[HLS_MODULE_ID_VAR] = str(available[device_idx])


torch._register_device_module("hpu", sys.modules[__name__])

"""Stand-in for ``habana_frameworks/torch/hpu/_utils.py``: the two variables that choose the
module a process drives, and the node's list of modules."""

import os

HABANA_VISIBLE_MODULES_VAR = "HABANA_VISIBLE_MODULES"
HLS_MODULE_ID_VAR = "HLS_MODULE_ID"
#: the stand-in node has eight Gaudi modules, 0..7 (as an HLS-Gaudi2 box)
_NODE_MODULES = tuple(range(8))


def _get_available_modules_from_environ():
    value = os.environ.get(HABANA_VISIBLE_MODULES_VAR)
    if value is None:
        return list(_NODE_MODULES)
    return [int(m) for m in value.split(",") if m.strip()]


def _get_module_id_from_environ():
    return int(os.environ.get(HLS_MODULE_ID_VAR, -1))


def _get_device_index(device, optional=False):
    import torch

    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "hpu":
            raise ValueError(f"Expected a hpu device, but got: {device}")
        return 0 if device.index is None else device.index
    return 0 if device is None else int(device)

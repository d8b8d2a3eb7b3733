"""Stand-in for ``habana_frameworks/torch/distributed/hccl/__init__.py`` (gaudi-pytorch-bridge,
commit 5a56187e), which runs at import:

* picks the process group flavour from ``PT_HPU_LAZY_MODE`` (default "1") and
  ``PT_HPU_ENABLE_LAZY_COLLECTIVES``: eager, lazy with lazy collectives, or lazy without;
* maps ``LOCAL_RANK`` to the module this process drives (``_setup_module_id``): with
  ``HABANA_VISIBLE_MODULES`` set it asserts ``local_rank < len(list)`` and takes
  ``list[local_rank]``, else the module numbered ``local_rank`` (skipped at world size 1 or
  without LOCAL_RANK, or when ``HLS_MODULE_ID`` is already set);
* registers the ``hccl`` torch.distributed backend.

The process group here is gloo over the CPU tensors the stand-in computes on, so the backend also
serves ``cpu`` (README.md)."""

import os
from typing import Tuple

import torch
from habana_frameworks.torch.hpu import HABANA_VISIBLE_MODULES_VAR, HLS_MODULE_ID_VAR
from habana_frameworks.torch.utils.experimental.distributed_emulation import (
    distributed_emulation_apply_if_enabled,
    is_distributed_emulation_enabled,
)

_lazy_mode = int(os.environ.get("PT_HPU_LAZY_MODE", "1"))
_lazy_collectives_enabled = os.environ.get("PT_HPU_ENABLE_LAZY_COLLECTIVES",
                                           "False").lower() in ["true", "1"]

distributed_emulation_apply_if_enabled()


def _setup_module_id(local_rank=-1, world_size=1):
    if HLS_MODULE_ID_VAR in os.environ.keys():
        return
    if local_rank == -1 or world_size == 1 or is_distributed_emulation_enabled():
        return
    if HABANA_VISIBLE_MODULES_VAR in os.environ.keys():
        visible_modules = os.environ[HABANA_VISIBLE_MODULES_VAR].split(",")
        assert local_rank < len(visible_modules), f"""There is not enough devices
        available for training. Please verify if {HABANA_VISIBLE_MODULES_VAR}
        is set correctly."""
        os.environ[HLS_MODULE_ID_VAR] = visible_modules[local_rank]
        return
    os.environ[HLS_MODULE_ID_VAR] = str(local_rank)


def _read_values_from_env():
    world_size = int(os.getenv("WORLD_SIZE", 1))
    rank = int(os.getenv("RANK", -1))
    local_rank = int(os.environ.get("LOCAL_RANK", -1))
    return world_size, rank, local_rank


def initialize_distributed_hpu(world_size=None, rank=None,
                               local_rank=None) -> Tuple[int, int, int]:
    if all(v is not None for v in [world_size, rank, local_rank]):
        os.environ["WORLD_SIZE"] = str(world_size)
        os.environ["RANK"] = str(rank)
        os.environ["LOCAL_RANK"] = str(local_rank)
    world_size, rank, local_rank = _read_values_from_env()
    _setup_module_id(local_rank=local_rank, world_size=world_size)
    if rank != -1:
        os.environ["ID"] = str(rank)
    return world_size, rank, local_rank


initialize_distributed_hpu()


def _create_process_group_hccl(backend_opts, pg_opts):
    return torch.distributed.ProcessGroupGloo(backend_opts.store, backend_opts.group_rank,
                                              backend_opts.group_size, backend_opts.timeout)


torch.distributed.Backend.register_backend("hccl", _create_process_group_hccl,
                                           devices=["hpu", "cpu"], extended_api=True)

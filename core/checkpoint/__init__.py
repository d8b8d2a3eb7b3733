"""Checkpoint loading shard by shard, and sharded checkpoint saving: ``shardwise.checkpoint``.

A model larger than one machine's memory loads as: build it on the meta device (no memory), let
the sharding plan compute every rank's slices, and have each rank read only its slices from disk,
converting the dtype on the way and materialising straight on its device::

    engine = shardwise.init_inference(None, checkpoint="path/to/hf_model_dir",
                                      tensor_parallel={"tp_size": 2}, dtype=torch.bfloat16)
    engine.save_checkpoint("ckpt_tp2")          # one file per rank + shardwise_checkpoint.json
    # later, at any tp size: init_inference(None, checkpoint="ckpt_tp2", ...)

Other transforms plug in through :mod:`.extensions` without this package knowing them: a
tensor hook the loader calls for each tensor it reads (``quant=`` quantizes each weight as soon as
its slice is read, so the full-precision model never sits in memory), and extension data the
checkpoint carries opaquely (a quantized engine's packed weights, loaded back as saved at the same
tp size).

Modules: :mod:`.description` (what a checkpoint consists of), :mod:`.sources` (headers, the key
→ pieces index, the slice reader), :mod:`.build` (the meta skeleton from config.json),
:mod:`.conversions` (checkpoint keys → model tensors, as transformers converts them: the
older one-tensor-per-expert layouts), :mod:`.loader`, :mod:`.saver`, :mod:`.progress`,
:mod:`.extensions`.
"""

from .build import build_meta_model, skeleton
from .description import DESCRIPTION_NAME, Description, describe
from .errors import CheckpointError, ExpertCountError
from .extensions import (CHECKPOINT_VIEW, CheckpointExtension, TensorHook, TensorRef,
                         register_extension)
from .loader import LoadReport, check_extensions, default_dtype, load_checkpoint
from .saver import save_checkpoint
from .sources import build_index

__all__ = ["CHECKPOINT_VIEW", "build_meta_model", "skeleton", "DESCRIPTION_NAME", "Description", "describe",
           "CheckpointError", "ExpertCountError", "CheckpointExtension", "TensorHook", "TensorRef",
           "register_extension", "LoadReport", "check_extensions", "default_dtype",
           "load_checkpoint", "save_checkpoint", "build_index"]

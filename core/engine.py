"""``init_inference`` and the engine it returns."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .accelerator import Accelerator
from .communicator import Communicator, create_communicator
from .config import InferenceConfig
from .errors import ConfigError
from .plugins import get_accelerator
from . import transforms

log = logging.getLogger(__name__)


class InferenceEngine:
    """A model prepared for inference on one accelerator.

    Attributes:
        module: the user's model, transformed in place (HF ``generate``/``pipeline`` still work).
        config: the validated :class:`InferenceConfig`.
        accelerator: the resolved :class:`~shardwise.Accelerator`.
        communicator: the :class:`~shardwise.Communicator` (local at world size 1).
        device: the ``torch.device`` the module runs on.
        dtype: the compute dtype.
    """

    def __init__(self, module: nn.Module, config: InferenceConfig, accelerator: Accelerator,
                 communicator: Communicator, device: torch.device, dtype: torch.dtype) -> None:
        self.module = module
        self.config = config
        self.accelerator = accelerator
        self.communicator = communicator
        self.device = device
        self.dtype = dtype

    @torch.inference_mode()
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward on inputs moved to the engine's device."""
        return self.module(*self._to_device(args), **self._to_device(kwargs))

    @torch.inference_mode()
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``module.generate`` with tensor inputs moved to the engine's device."""
        return self.module.generate(*self._to_device(args), **self._to_device(kwargs))

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.device)
        if isinstance(value, dict):
            return type(value)({k: self._to_device(v) for k, v in value.items()})
        if isinstance(value, (list, tuple)):
            return type(value)(self._to_device(v) for v in value)
        if hasattr(value, "to") and hasattr(value, "keys"):  # transformers BatchEncoding
            return value.to(self.device)
        return value

    def __repr__(self) -> str:
        return (f"InferenceEngine({type(self.module).__name__} on {self.device}, "
                f"dtype={str(self.dtype).removeprefix('torch.')}, "
                f"world={self.communicator.world_size})")


def init_inference(model: nn.Module, config: InferenceConfig | dict | str | None = None,
                   **kwargs: Any) -> InferenceEngine:
    """Prepare ``model`` for inference and return an :class:`InferenceEngine`.

    Args:
        model: a Hugging Face ``PreTrainedModel`` (or any ``nn.Module``) with real weights. It is
            transformed in place and available as ``engine.module``.
        config: an :class:`InferenceConfig`, a dict of its fields, or a JSON file path.
        **kwargs: config fields, DeepSpeed names included (``mp_size``, ``tensor_parallel``,
            ``enable_cuda_graph``, ``max_out_tokens``). A field given both here and in
            ``config`` must agree.

    Raises:
        ConfigError: an unknown or malformed field, or a feature not supported yet (named).
        PluginError: an unknown, broken or unavailable device (with the reason).
        UnsupportedDtypeError: a dtype the device cannot run.
    """
    cfg = InferenceConfig.build(config, **kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module (e.g. from "
                          f"AutoModelForCausalLM.from_pretrained), got {type(model).__name__}")
    accelerator = get_accelerator(cfg.device)  # 1. resolve; it vetoes the dtype below
    dtype = transforms.resolve_dtype(accelerator, cfg.dtype, model)
    transforms.check_materialized(model)
    communicator = create_communicator(accelerator, cfg.comm_timeout)  # 2.
    device = accelerator.device(communicator.local_rank if accelerator.device_count() > 1 else None)
    # 3.–5. (checkpoint loading, sharding, injection) are rejected by the config until they land.
    transforms.cast_and_move(model, device, dtype)  # 6.
    log.info("shardwise: %s on %s (%s)", type(model).__name__, device, dtype)
    return InferenceEngine(model, cfg, accelerator, communicator, device, dtype)

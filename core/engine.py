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
from . import sharding, transforms

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
        sharding: the :class:`~shardwise.sharding.ShardReport` under tensor parallelism (what
            was sharded and how, what stayed replicated, each rank's parameter bytes), else None.
    """

    def __init__(self, module: nn.Module, config: InferenceConfig, accelerator: Accelerator,
                 communicator: Communicator, device: torch.device, dtype: torch.dtype,
                 sharding: "sharding.ShardReport | None" = None) -> None:
        self.module = module
        self.config = config
        self.accelerator = accelerator
        self.communicator = communicator
        self.device = device
        self.dtype = dtype
        self.sharding = sharding

    @torch.inference_mode()
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward on inputs moved to the engine's device (under tensor
        parallelism, rank 0's tensor inputs are broadcast so every rank computes the same)."""
        return self.module(*self._inputs(args), **self._inputs(kwargs))

    @torch.inference_mode()
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``module.generate`` with tensor inputs moved to the engine's device (and broadcast
        from rank 0 under tensor parallelism)."""
        return self.module.generate(*self._inputs(args), **self._inputs(kwargs))

    def _inputs(self, value: Any) -> Any:
        value = self._to_device(value)
        if self.sharding is not None and self.communicator.world_size > 1:
            value = _broadcast_tensors(value, self.communicator)
        return value

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


#: Most tensor dims ``_broadcast_tensors`` sends (the shape travels in a fixed-size tensor).
_MAX_DIMS = 8


def _broadcast_tensors(value: Any, comm: Communicator) -> Any:
    """``value`` with every tensor replaced by rank 0's (shape, then data). Every rank must pass
    the same structure with the same dtypes; only contents and shapes may differ."""
    if isinstance(value, torch.Tensor):
        if value.dim() > _MAX_DIMS:
            raise ConfigError(f"engine inputs have at most {_MAX_DIMS} dims under tensor "
                              f"parallelism, got {value.dim()}")
        shape = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64, device=value.device)
        shape[0] = value.dim()
        shape[1:1 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
        comm.broadcast(shape, src=0)
        dims = shape[1:1 + int(shape[0])].tolist()
        out = value.contiguous() if comm.rank == 0 else value.new_empty(dims)  # never in place
        return comm.broadcast(out, src=0)
    if isinstance(value, dict):
        return type(value)({k: _broadcast_tensors(v, comm) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_broadcast_tensors(v, comm) for v in value)
    if hasattr(value, "keys") and hasattr(value, "data") and isinstance(value.data, dict):
        value.data = _broadcast_tensors(value.data, comm)  # transformers BatchEncoding
    return value


def _shard_step(model: nn.Module, cfg: InferenceConfig) -> "sharding.PreparedShards | None":
    """Step 4, the part before any process group exists: check the world fits ``tp_size``,
    choose the plan and compute every rank's slices (all errors surface here)."""
    sharding.check_tp_world(cfg.tp_size)
    if cfg.tp_size == 1 and not cfg.injection_policy:
        return None
    return sharding.prepare_for(model, cfg.injection_policy, cfg.tp_size)


def _seed(cfg: InferenceConfig) -> None:
    seed = cfg.seed if cfg.seed is not None else (0 if cfg.tp_size > 1 else None)
    if seed is not None:
        torch.manual_seed(seed)  # every device's default generator


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

    With ``tp_size=N`` (run under torchrun with N ranks) the model is split in place from a plan
    (``injection_policy``, else the model's HF tp_plan, a family policy, a heuristic; see
    :mod:`shardwise.sharding`); ``engine.sharding`` reports what was split.

    Raises:
        ConfigError: an unknown or malformed field, or a feature not supported yet (named).
        ShardingError: tp_size does not fit the world, or the model cannot be split as planned
            (a ConfigError, raised before any process group or weight work).
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
    prepared = _shard_step(model, cfg)  # 4. validated before any process group or weight work
    communicator = create_communicator(accelerator, cfg.comm_timeout)  # 2.
    device = accelerator.device(communicator.local_rank if accelerator.device_count() > 1 else None)
    _seed(cfg)
    # 3. and 5. (checkpoint loading, injection) are rejected by the config until they land.
    report = None
    if prepared is not None and cfg.tp_size > 1:
        report = sharding.apply_shards(prepared, communicator)  # 4.
        if communicator.rank == 0:
            log.info("shardwise: %s", report.summary())
    transforms.cast_and_move(model, device, dtype)  # 6.
    log.info("shardwise: %s on %s (%s)", type(model).__name__, device, dtype)
    return InferenceEngine(model, cfg, accelerator, communicator, device, dtype, report)

"""``init_inference`` and the engine it returns."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from .accelerator import Accelerator
from .communicator import Communicator, create_communicator
from .config import InferenceConfig
from .errors import ConfigError
from .plugins import get_accelerator
from . import checkpoint as _checkpoint, sharding, transforms

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
        quantization: the :class:`~shardwise.quant.QuantReport` with ``quant=`` / ``dtype=int8``
            (model bytes before/after, layers quantized, backend per layer kind), else None.
    """

    quantization = None

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

    def save_checkpoint(self, path: str | os.PathLike) -> str:
        """Write the loaded model as a sharded checkpoint (every rank calls it): one safetensors
        file per rank plus ``shardwise_checkpoint.json``, loadable at any tp size with
        ``init_inference(None, checkpoint=path, ...)``. Returns the description's path.

        A quantized engine (``quant=`` / ``dtype=torch.int8``) saves its weights as they run:
        each rank file holds that rank's packed weights, scales and zero points bit for bit plus
        its layer manifest, and the description records the quant settings and compute dtype.
        Such a checkpoint loads without re-quantizing, bit-identically, at the same tp size
        only (packed layouts cannot be merged or split: to change the tp size, save an engine
        built without ``quant=`` and quantize while loading)."""
        prepared = getattr(self, "_prepared", None) if self.sharding is not None else None
        return str(_checkpoint.save_checkpoint(self.module, path, prepared=prepared,
                                               communicator=self.communicator))

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
            transformed in place and available as ``engine.module``. With ``checkpoint=...`` it
            may be on the meta device (``with torch.device("meta"):`` or accelerate's
            ``init_empty_weights()`` around ``from_config``) or None (built from the
            checkpoint's config.json); each rank then reads only its slices of the checkpoint.
        config: an :class:`InferenceConfig`, a dict of its fields, or a JSON file path.
        **kwargs: config fields, DeepSpeed names included (``mp_size``, ``tensor_parallel``,
            ``enable_cuda_graph``, ``max_out_tokens``). A field given both here and in
            ``config`` must agree.

    With ``tp_size=N`` (run under torchrun with N ranks) the model is split in place from a plan
    (``injection_policy``, else the model's HF tp_plan, a family policy, a heuristic; see
    :mod:`shardwise.sharding`); ``engine.sharding`` reports what was split.

    Quantization and checkpoints (``engine.quantization`` reports either way):

    * ``checkpoint=`` a full-precision checkpoint with ``quant=``: each quantized weight is
      quantized as soon as this rank's slice of it is read, so the full-precision model never
      sits in memory; the result is bit-identical to loading, then quantizing (kernel injection
      then runs on the quantized linears).
    * ``checkpoint=`` a quantized checkpoint (``engine.save_checkpoint`` of a quantized engine):
      its packed weights are loaded as saved, never re-quantized. Without ``quant=`` the saved
      settings are adopted (one log line); ``quant=`` equal to them is accepted; ``quant=`` with
      other settings is a :class:`~shardwise.checkpoint.CheckpointError` (re-quantizing would
      compound the rounding: quantize from the full-precision checkpoint instead). The tp size
      and the compute dtype must be the saved ones (``dtype`` unset takes the saved one).

    Raises:
        ConfigError: an unknown or malformed field, or a feature not supported yet (named).
        ShardingError: tp_size does not fit the world, or the model cannot be split as planned
            (a ConfigError, raised before any process group or weight work).
        PluginError: an unknown, broken or unavailable device (with the reason).
        UnsupportedDtypeError: a dtype the device cannot run.
        CheckpointError: a missing, corrupt or mismatched checkpoint, or a quantized one loaded
            otherwise than saved (above); named, before any weight is read.
    """
    cfg = InferenceConfig.build(config, **kwargs)
    desc = _checkpoint.describe(cfg.checkpoint, cfg.base_dir) if cfg.checkpoint else None
    if desc is not None and desc.quant is not None:
        _saved_quant_settings(cfg, desc)  # before any model, process group or weight work
    if desc is not None:  # 3. (skeleton): the user's meta model or the checkpoint's config
        model = _checkpoint.skeleton(model, desc, _build_dtype(cfg.dtype))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module (e.g. from "
                          f"AutoModelForCausalLM.from_pretrained), got {type(model).__name__}")
    accelerator = get_accelerator(cfg.device)  # 1. resolve; it vetoes the dtype below
    dtype = transforms.resolve_dtype(accelerator, cfg.dtype, model)
    if desc is None:
        transforms.check_materialized(model)
    prepared = _shard_step(model, cfg)  # 4. validated before any process group or weight work
    communicator = create_communicator(accelerator, cfg.comm_timeout)  # 2.
    device = accelerator.device(communicator.local_rank if accelerator.device_count() > 1 else None)
    _seed(cfg)
    loaded = None
    if desc is not None:  # 3. each rank reads only its slices, straight onto its device
        loaded = _checkpoint.load_checkpoint(
            model, desc, prepared=prepared if cfg.tp_size > 1 else None,
            rank=communicator.rank, device=device, dtype=dtype,
            quantizer=_reading_quantizer(model, cfg, accelerator, dtype, device, prepared, desc))
    report = None
    if prepared is not None and cfg.tp_size > 1:
        report = sharding.apply_shards(  # 4. (the loader already sliced the weights)
            prepared, communicator, sliced=loaded.sliced if loaded else None,
            bytes_before=loaded.bytes_before if loaded else None)
        if communicator.rank == 0:
            log.info("shardwise: %s", report.summary())
    injected = None
    if cfg.replace_with_kernel_inject:  # 5. on the sharded weights (their hooks stay in use)
        from .inject import inject_model

        tp = (communicator.rank, communicator.world_size) if report is not None else (0, 1)
        max_tokens = None if cfg.max_tokens == InferenceConfig.max_tokens else cfg.max_tokens
        injected = inject_model(model, accelerator, dtype, max_tokens, tp=tp)
    quant_report = _quantize_and_cast(model, cfg, accelerator, dtype, device, prepared,
                                      loaded)  # 6.
    if injected is not None:
        injected.rebind()  # step 6 may have swapped linears (quantized) under the layers
    if cfg.enable_graph:  # 7. (the config requires injection for it)
        from .inject import enable_graphs

        enable_graphs(model, accelerator)
    log.info("shardwise: %s on %s (%s)", type(model).__name__, device, dtype)
    engine = InferenceEngine(model, cfg, accelerator, communicator, device, dtype, report)
    engine.quantization = quant_report
    engine._prepared, engine.checkpoint_load = prepared, loaded
    if cfg.save_mp_checkpoint_path:
        engine.save_checkpoint(cfg.save_mp_checkpoint_path)
    return engine


def _saved_quant_settings(cfg: InferenceConfig, desc: "_checkpoint.Description") -> None:
    """A quantized checkpoint: refuse another tp size, and set ``cfg.quant`` to the saved
    settings (adopted when ``quant=`` is not given; ``quant=`` with other settings is an error:
    see :func:`shardwise.quant.checkpoint.adopt_saved_quant`)."""
    from .quant.checkpoint import adopt_saved_quant

    _checkpoint.check_quantized_load(desc, cfg.tp_size)
    cfg.quant = adopt_saved_quant(desc.quant, cfg.quant, desc.source, _checkpoint.CheckpointError)


def _reading_quantizer(model: nn.Module, cfg: InferenceConfig, accelerator: Accelerator,
                       dtype: torch.dtype, device: torch.device,
                       prepared: "sharding.PreparedShards | None",
                       desc: "_checkpoint.Description"):
    """Step 6 folded into step 3: with ``quant`` and a full-precision checkpoint, the
    :class:`~shardwise.quant.Quantizer` the loader calls as each weight slice is read (the same
    layers and settings step 6 would quantize). None when there is nothing to quantize while
    reading. Kernel injection (step 5) then adopts the quantized linears as it adopts float
    ones."""
    if cfg.quant is None or desc.quant is not None:
        return None
    from .quant import Quantizer

    roles = prepared.roles if prepared is not None else None
    return Quantizer.for_model(model, cfg.quant, accelerator, dtype, device=device, roles=roles,
                               injection_policy=cfg.injection_policy)


def _quantize_and_cast(model: nn.Module, cfg: InferenceConfig, accelerator: Accelerator,
                       dtype: torch.dtype, device: torch.device,
                       prepared: "sharding.PreparedShards | None", loaded):
    """Step 6: the loader's QuantReport when it quantized (or loaded quantized weights), else
    :func:`_quantize_step`; the rest of the model is cast and moved either way."""
    report = loaded.quantization if loaded is not None else None
    if report is None:
        report = _quantize_step(model, cfg, accelerator, dtype, device, prepared)
        if report is not None:
            return report  # quantize_model cast and moved the rest
    else:
        log.info("shardwise: %s", report.summary())
    transforms.cast_and_move(model, device, dtype)
    return report


def _quantize_step(model: nn.Module, cfg: InferenceConfig, accelerator: Accelerator,
                   dtype: torch.dtype, device: torch.device,
                   prepared: "sharding.PreparedShards | None"):
    """Step 6 with ``quant``: quantize the plan's linears (each rank its own shards, after
    sharding, so scales follow their rows) and cast/move the rest; None without ``quant``."""
    if cfg.quant is None:
        return None
    from .quant import quantize_model

    roles = prepared.roles if prepared is not None else None
    report = quantize_model(model, cfg.quant, accelerator, dtype, device=device, roles=roles,
                            injection_policy=cfg.injection_policy)
    log.info("shardwise: %s", report.summary())
    return report


def _build_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The dtype a skeleton is built in: the requested one (``None``/``"auto"``: the
    checkpoint's own, from its config)."""
    return dtype if isinstance(dtype, torch.dtype) else None

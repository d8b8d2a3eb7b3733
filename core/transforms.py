"""The engine's transforms, each a function over a module that a user may also call alone.

They run in DESIGN.md's fixed order (accelerator → communicator → weights → shard → inject →
quantize/cast → graphs) and all keep the Hugging Face model as the outer shell, so
``generate()``, ``pipeline()`` and ``save_pretrained`` keep working.
"""

from __future__ import annotations

import torch
from torch import nn

from .accelerator import Accelerator
from .errors import ConfigError


def resolve_dtype(accelerator: Accelerator, requested: torch.dtype | str | None,
                  model: nn.Module) -> torch.dtype:
    """The compute dtype: ``requested`` (``"auto"`` = the accelerator's preferred) or the model's
    own floating dtype, vetoed by the accelerator when it cannot run it."""
    if requested == "auto":
        dtype = accelerator.preferred_dtype
    elif requested is None:
        dtype = model_dtype(model)
    else:
        dtype = requested
    return accelerator.check_dtype(dtype)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 if it has none)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def check_materialized(model: nn.Module) -> None:
    """Refuse a model whose weights are still on the meta device (nothing to compute with)."""
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ConfigError(
            f"the model has {len(meta)} parameters on the meta device (e.g. {meta[0]!r}); load "
            f"real weights first (from_pretrained), or pass checkpoint=... (a model directory "
            f"or description) to have init_inference load them into the meta model")


def cast_and_move(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Move ``model`` to ``device`` and cast its floating-point tensors to ``dtype``, in place.
    Integer buffers (position ids, masks) keep their dtype."""
    model.to(device=device, dtype=dtype)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "dtype"):
        config.dtype = dtype  # so generate()/save_pretrained see the dtype the weights have
    return model.eval()

"""The engine's transforms, each a function over a module that a user may also call alone.

They run in one fixed order (accelerator → plan → communicator → weights → shard →
quantize/cast → inject → graphs: docs/architecture.md) and all keep the Hugging Face model as
the outer shell, so ``generate()``, ``pipeline()`` and ``save_pretrained`` keep working.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .accelerator import Accelerator
from .errors import ConfigError
from .ledger import record


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


def cast_and_move(model: nn.Module, device: torch.device, dtype: torch.dtype, *,
                  keep_meta: bool = False) -> nn.Module:
    """Move ``model`` to ``device`` and cast its floating-point tensors to ``dtype``, in place.
    Integer buffers (position ids, masks) keep their dtype.

    Recorded in the active ledger (inside ``init_inference``) with an undo that casts each
    tensor back to the dtype and device it had, from what the model then holds (no copy is
    kept; a cast to a narrower dtype is lossy, and the record says so).

    ``keep_meta``: tensors on the meta device stay there (see :func:`move_and_cast`)."""
    before = [p for p in _tensor_placements(model) if not (keep_meta and p[4].type == "meta")]
    move_and_cast(model, device, dtype, keep_meta=keep_meta)
    config = getattr(model, "config", None)
    had_dtype = config is not None and hasattr(config, "dtype")
    old_dtype = getattr(config, "dtype", None)
    if had_dtype:
        config.dtype = dtype  # so generate()/save_pretrained see the dtype the weights have
    changed = [p for p in before if p[3] != dtype or p[4] != torch.device(device)]
    if changed or (had_dtype and old_dtype != dtype):
        record(_cast_what(changed, dtype, device), _cast_back(changed, config if had_dtype
                                                              else None, old_dtype))
    return model.eval()


def move_and_cast(module: nn.Module, device: torch.device, dtype: torch.dtype, *,
                  keep_meta: bool = False) -> nn.Module:
    """``module.to(device=device, dtype=dtype)``; with ``keep_meta`` the tensors on the meta
    device stay there: an offloaded model's units loaded straight into their blobs
    (:func:`shardwise.offload.checkpoint.to_resident`), which the offload step binds to ring
    slots (a plain ``.to`` cannot copy out of meta)."""
    if not keep_meta:
        return module.to(device=device, dtype=dtype)
    from .offload.checkpoint import to_resident

    return to_resident(module, device, dtype)


#: (module, name, is_parameter, dtype, device) of one tensor the cast may change
_Placement = tuple[nn.Module, str, bool, torch.dtype, torch.device]


def _tensor_placements(model: nn.Module) -> list[_Placement]:
    """Every floating parameter and buffer (the tensors ``Module.to(dtype=...)`` casts) with the
    dtype and device it has now."""
    out = []
    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in table.items():
                if t is not None and (t.is_floating_point() or t.is_complex()):
                    out.append((module, name, is_param, t.dtype, t.device))
    return out


def _cast_what(changed: list[_Placement], dtype: torch.dtype, device: torch.device) -> str:
    narrower = sorted({str(d).removeprefix("torch.") for _, _, _, d, _ in changed
                       if d != dtype and d.itemsize >= dtype.itemsize})  # not a widening
    lossy = (f" (lossy: {', '.join(narrower)} -> {str(dtype).removeprefix('torch.')} rounds; "
             f"cast back, not the original values)" if narrower else "")
    return f"cast to {str(dtype).removeprefix('torch.')} on {device}{lossy}"


def _cast_back(changed: list[_Placement], config, old_dtype) -> Callable[[], None]:
    """The undo of :func:`cast_and_move`: each tensor back to its dtype and device (a parameter
    keeps its object, as ``Module.to`` did; a buffer is replaced, as it was)."""
    def undo() -> None:
        for module, name, is_param, dtype, device in changed:
            table = module._parameters if is_param else module._buffers
            t = table.get(name)
            if t is None or (t.dtype == dtype and t.device == device):
                continue
            if not (t.is_floating_point() or t.is_complex()):
                continue  # replaced since by a tensor of another kind (e.g. quantized)
            if is_param:
                t.data = t.data.to(device=device, dtype=dtype)
            else:
                table[name] = t.to(device=device, dtype=dtype)
        if config is not None:
            config.dtype = old_dtype
    return undo

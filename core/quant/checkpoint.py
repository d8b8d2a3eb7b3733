"""Saving a quantized model and loading it back without re-quantizing.

``save_quantized(model, path)`` writes one file (``torch.save``) holding the model's
``state_dict`` — packed quantized buffers included, bit for bit — and a manifest of every
:class:`QuantLinear` (its spec, the backend whose layout the buffers are in, the compute dtype,
the buffers' shapes and dtypes). ``load_quantized(model, path)`` takes a fresh model of the same
architecture (under tensor parallelism: sharded the same way, on the same rank), puts empty
QuantLinear shells where the manifest says and loads the state dict into them: no
quantization happens, so the weights are bit-identical to the saved ones.

The packed layouts belong to a backend (torch's CPU int4 layout is opaque), so a file loads where
that backend runs (e.g. a CPU-packed file on a CPU); elsewhere the error says to re-quantize from
the full-precision checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..accelerator import Accelerator
from ..errors import ConfigError
from shardwise.kernels.reference.quant import QuantSpec
from .config import parse_quant
from .modules import QuantLinear, carry_hooks, set_submodule
from .transform import QUANT_ATTR, QuantizedLayer, QuantReport, _refuse_twice, model_bytes

FORMAT = "shardwise-quantized-v1"


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def manifest(model: nn.Module) -> dict[str, Any]:
    """The description :func:`save_quantized` stores next to the state dict."""
    report: QuantReport | None = getattr(model, QUANT_ATTR, None)
    layers = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            s = m.spec
            layers[name] = {
                "spec": [s.bits, s.group_size, s.symmetric, s.in_features, s.out_features],
                "backend": m.backend, "compute_dtype": _dtype_name(m.compute_dtype),
                "meta": m.meta, "tensors": m.describe_tensors(), "source": m.source,
                "bias": list(m.bias.shape) if m.bias is not None else None,
                "kind": report.layers[name].kind if report and name in report.layers else None}
    if not layers:
        raise ConfigError(f"{type(model).__name__} holds no quantized layer; quantize it first "
                          "(shardwise.quant.quantize_model or init_inference(quant=...))")
    return {"format": FORMAT, "layers": layers,
            "config": report.config.to_dict() if report else None,
            "dtype": _dtype_name(report.dtype) if report else None}


def save_quantized(model: nn.Module, path: str | os.PathLike) -> str:
    """Write ``model``'s quantized state (module docstring) to ``path``; returns the path."""
    torch.save({"manifest": manifest(model), "state_dict": model.state_dict()}, path)
    return os.fspath(path)


@torch.no_grad()
def load_quantized(model: nn.Module, path: str | os.PathLike,
                   accelerator: Accelerator | None = None,
                   device: torch.device | str | None = None) -> QuantReport:
    """Load a :func:`save_quantized` file into ``model`` (same architecture, full precision or
    on the meta device) in place, on ``device`` (default: the accelerator's, else the CPU).
    Returns a :class:`QuantReport` (bytes before = the saved model unquantized in its dtype)."""
    _refuse_twice(model)
    blob = torch.load(path, map_location="cpu", weights_only=False)
    info, state = blob.get("manifest", {}), blob.get("state_dict")
    if info.get("format") != FORMAT or state is None:
        raise ConfigError(f"{os.fspath(path)!r} is not a shardwise quantized file "
                          f"(format {info.get('format')!r})")
    if device is None:
        device = accelerator.device() if accelerator is not None else torch.device("cpu")
    device = torch.device(device)
    modules = dict(model.named_modules())
    missing = [n for n in info["layers"] if n not in modules]
    if missing:
        raise ConfigError(f"the saved quantized layers {missing[:3]} are not in "
                          f"{type(model).__name__}; load into the model architecture it was "
                          "saved from")
    dtype = getattr(torch, info["dtype"]) if info.get("dtype") else None
    layers = {}
    for name, entry in info["layers"].items():
        spec = QuantSpec(*entry["spec"])
        compute = getattr(torch, entry["compute_dtype"]) if entry["compute_dtype"] else None
        try:
            shell = QuantLinear.empty_like(spec, entry["backend"], compute, entry["meta"],
                                           entry["tensors"], entry["bias"], entry["source"],
                                           device=device)
        except KeyError as exc:
            raise ConfigError(f"{os.fspath(path)!r} holds weights packed for the "
                              f"{entry['backend']!r} kernel backend, which cannot run here "
                              f"({exc.args[0]}); re-quantize from the full-precision "
                              "checkpoint on this device") from None
        carry_hooks(modules[name], shell)
        set_submodule(model, name, shell)
        layers[name] = QuantizedLayer(name, entry.get("kind") or "attention", entry["backend"],
                                      spec.bits, spec.group_size,
                                      (spec.out_features, spec.in_features), shell.weight_nbytes)
    meta_model = any(p.is_meta for p in model.parameters())
    if not meta_model:
        model.to(device)
    model.load_state_dict(state, strict=True, assign=meta_model)
    if dtype is not None:
        from ..transforms import cast_and_move

        cast_and_move(model, device, dtype)
    config = parse_quant(info["config"]) if info.get("config") else None
    report = QuantReport(config, dtype, str(device), layers=layers, source=f"loaded {path}")
    size = torch.empty((), dtype=dtype or torch.float32).element_size()
    report.bytes_after = model_bytes(model)
    report.bytes_before = sum(p.numel() * (size if p.is_floating_point() else p.element_size())
                              for p in model.parameters()) + sum(
        size * l.shape[0] * l.shape[1] for l in layers.values())
    setattr(model, QUANT_ATTR, report)
    return report

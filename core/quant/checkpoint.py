"""Saving a quantized model and loading it back without re-quantizing.

``save_quantized(model, path)`` writes one file (``torch.save``) holding the model's
``state_dict`` — packed quantized buffers included, bit for bit — and a manifest of every
:class:`QuantLinear` (its spec, the backend whose layout the buffers are in, the compute dtype,
the buffers' shapes and dtypes). ``load_quantized(model, path)`` takes a fresh model of the same
architecture (under tensor parallelism: sharded the same way, on the same rank), puts empty
QuantLinear shells where the manifest says and loads the state dict into them: no
quantization happens, so the weights are bit-identical to the saved ones.

The sharded checkpoint (``engine.save_checkpoint``, :mod:`shardwise.checkpoint`) is built from
the same pieces: each rank file carries its rank's :func:`manifest` in its metadata, the
description carries :func:`description_entry` (the settings), and the loader puts the shells in
with :func:`install_shells` and reports with :func:`loaded_report`; :func:`adopt_saved_quant`
decides what happens when ``quant=`` differs from the saved settings.

The packed layouts belong to a backend (torch's CPU int4 layout is opaque), so a file loads where
that backend runs (e.g. a CPU-packed file on a CPU); elsewhere the error says to re-quantize from
the full-precision checkpoint.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import torch
from torch import nn

from ..accelerator import Accelerator
from ..errors import ConfigError
from shardwise.kernels.reference.quant import QuantSpec
from .config import parse_quant
from .modules import QuantLinear, carry_hooks, set_submodule
from .transform import QUANT_ATTR, QuantizedLayer, QuantReport, _refuse_twice, model_bytes

log = logging.getLogger(__name__)

FORMAT = "shardwise-quantized-v1"
_LAYER_KEYS = {"spec", "backend", "compute_dtype", "meta", "tensors", "source", "bias", "kind"}


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _torch_dtype(name: str | None) -> torch.dtype | None:
    """``"bfloat16"`` → ``torch.bfloat16`` (None stays None); KeyError for a non-dtype name."""
    if name is None:
        return None
    found = getattr(torch, str(name), None)
    if not isinstance(found, torch.dtype):
        raise KeyError(name)
    return found


def manifest(model: nn.Module) -> dict[str, Any]:
    """The description :func:`save_quantized` stores next to the state dict (JSON-serialisable:
    the sharded checkpoint stores it in each rank file's metadata)."""
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


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds a :class:`QuantLinear`."""
    return any(isinstance(m, QuantLinear) for m in model.modules())


def tensor_names(info: Mapping[str, Any]) -> dict[str, tuple[list[int], str | None]]:
    """State-dict key → (shape, dtype name) of every tensor the manifest's layers own: the packed
    buffers and the bias (its dtype None: any floating dtype, it is cast with the model)."""
    out: dict[str, tuple[list[int], str | None]] = {}
    for layer, entry in info["layers"].items():
        for tname, (shape, dtype) in entry["tensors"].items():
            out[f"{layer}.{tname}"] = (list(shape), dtype)
        if entry.get("bias") is not None:
            out[f"{layer}.bias"] = (list(entry["bias"]), None)
    return out


def check_manifest(info: Any, where: str, error: type[Exception] = ConfigError) -> None:
    """Raise ``error`` naming ``where`` unless ``info`` is a well-formed :func:`manifest`."""
    if not isinstance(info, Mapping) or info.get("format") != FORMAT:
        got = info.get("format") if isinstance(info, Mapping) else type(info).__name__
        raise error(f"{where} is not a shardwise quantization manifest (format {got!r}, "
                    f"expected {FORMAT!r}); re-save it with this shardwise")
    layers = info.get("layers")
    if not isinstance(layers, Mapping) or not layers:
        raise error(f"{where}: the quantization manifest lists no layers")
    for name, entry in layers.items():
        problem = _entry_problem(entry)
        if problem:
            raise error(f"{where}: the quantization manifest entry of layer {name!r} is "
                        f"malformed ({problem}); the checkpoint is corrupted: re-save it")


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with one manifest layer entry (None when it is well-formed)."""
    if not isinstance(entry, Mapping) or set(entry) != _LAYER_KEYS:
        return f"keys {sorted(entry) if isinstance(entry, Mapping) else entry!r}"
    spec = entry["spec"]
    if not (isinstance(spec, list) and len(spec) == 5 and spec[0] in (4, 8)
            and all(isinstance(v, int) and v > 0 for v in (spec[1], spec[3], spec[4]))):
        return f"spec {spec!r}"
    tensors = entry["tensors"]
    if not isinstance(tensors, Mapping) or not tensors:
        return f"tensors {tensors!r}"
    try:
        _torch_dtype(entry["compute_dtype"])
        for shape, dtype in tensors.values():
            _torch_dtype(dtype)
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                return f"tensor shape {shape!r}"
    except (KeyError, TypeError, ValueError) as exc:
        return f"dtype or tensor entry {exc}"
    return None


def save_quantized(model: nn.Module, path: str | os.PathLike) -> str:
    """Write ``model``'s quantized state (module docstring) to ``path``; returns the path."""
    torch.save({"manifest": manifest(model), "state_dict": model.state_dict()}, path)
    return os.fspath(path)


def install_shells(model: nn.Module, info: Mapping[str, Any], device: torch.device | str,
                   source: str, error: type[Exception] = ConfigError
                   ) -> dict[str, QuantizedLayer]:
    """Put an empty :class:`QuantLinear` (buffers uninitialised, on ``device``: "meta" for a
    loader that assigns them) wherever the manifest ``info`` says, carrying each replaced
    module's hooks. Returns layer name → :class:`QuantizedLayer`. Raises ``error`` for a layer
    the model lacks or a backend that cannot run here."""
    modules = dict(model.named_modules())
    missing = [n for n in info["layers"] if n not in modules]
    if missing:
        raise error(f"the saved quantized layers {missing[:3]} are not in "
                    f"{type(model).__name__}; load into the model architecture {source} was "
                    "saved from")
    layers = {}
    for name, entry in info["layers"].items():
        spec = QuantSpec(*entry["spec"])
        compute = _torch_dtype(entry["compute_dtype"])
        try:
            shell = QuantLinear.empty_like(spec, entry["backend"], compute, entry["meta"],
                                           entry["tensors"], entry["bias"], entry["source"],
                                           device=device)
        except KeyError as exc:
            raise error(f"{source} holds weights packed for the {entry['backend']!r} kernel "
                        f"backend, which cannot run here ({exc.args[0]}); re-quantize from the "
                        "full-precision checkpoint on this device") from None
        carry_hooks(modules[name], shell)
        set_submodule(model, name, shell)
        layers[name] = QuantizedLayer(name, entry.get("kind") or "attention", entry["backend"],
                                      spec.bits, spec.group_size,
                                      (spec.out_features, spec.in_features), shell.weight_nbytes)
    return layers


def loaded_report(model: nn.Module, info: Mapping[str, Any], layers: dict[str, QuantizedLayer],
                  device: torch.device | str, source: str) -> QuantReport:
    """The :class:`QuantReport` of a model whose quantized layers were loaded as saved (bytes
    before = the model unquantized in the saved dtype); also stored on the model."""
    dtype = _torch_dtype(info.get("dtype"))
    config = parse_quant(info["config"]) if info.get("config") else None
    report = QuantReport(config, dtype, str(device), layers=dict(layers), source=source)
    size = torch.empty((), dtype=dtype or torch.float32).element_size()
    report.bytes_after = model_bytes(model)
    report.bytes_before = sum(p.numel() * (size if p.is_floating_point() else p.element_size())
                              for p in model.parameters()) + sum(
        size * l.shape[0] * l.shape[1] for l in layers.values())
    setattr(model, QUANT_ATTR, report)
    return report


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
    layers = install_shells(model, info, device, repr(os.fspath(path)))
    meta_model = any(p.is_meta for p in model.parameters())
    if not meta_model:
        model.to(device)
    model.load_state_dict(state, strict=True, assign=meta_model)
    dtype = _torch_dtype(info.get("dtype"))
    if dtype is not None:
        from ..transforms import cast_and_move

        cast_and_move(model, device, dtype)
    return loaded_report(model, info, layers, device, f"loaded {path}")


# ----- the sharded checkpoint's quant settings ----------------------------------------------------

def description_entry(info: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint description records of a quantized model (rank 0's :func:`manifest`):
    the format, the ``quant=`` settings, the compute dtype and the quantized layers' names."""
    return {"format": FORMAT, "config": info.get("config"), "dtype": info.get("dtype"),
            "layers": sorted(info["layers"])}


def check_description_entry(entry: Any, where: str, error: type[Exception] = ConfigError) -> None:
    """Raise ``error`` unless ``entry`` (a description's ``"quant"``) is well-formed."""
    if not isinstance(entry, Mapping) or entry.get("format") != FORMAT:
        got = entry.get("format") if isinstance(entry, Mapping) else entry
        raise error(f"{where}: its 'quant' entry has format {got!r}; this shardwise reads "
                    f"{FORMAT!r} (re-save the checkpoint with this shardwise)")
    try:
        if entry.get("config") is not None:
            parse_quant(entry["config"])
        _torch_dtype(entry.get("dtype"))
    except (ConfigError, KeyError) as exc:
        raise error(f"{where}: its 'quant' settings are invalid ({exc}); the checkpoint "
                    "description is corrupted: re-save it") from None
    names = entry.get("layers")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise error(f"{where}: its 'quant' entry must list the quantized layers, got {names!r}")


def adopt_saved_quant(entry: Mapping[str, Any], asked: Mapping | None, where: str,
                      error: type[Exception] = ConfigError) -> dict[str, Any] | None:
    """The ``quant=`` dict to run with when loading a checkpoint saved quantized with the
    description ``entry``: the saved settings. ``asked`` None (no ``quant=``): they are adopted
    with one log line. ``asked`` equal to them: fine. Different: ``error``, because quantized
    weights cannot be re-quantized to other settings without compounding the rounding error."""
    saved = parse_quant(entry["config"]) if entry.get("config") is not None else None
    if asked is None:
        what = saved.describe() if saved is not None else "quantized"
        log.info("shardwise: %s holds %s weights; loading them as saved (quant= was not given)",
                 where, what)
        return saved.to_dict() if saved is not None else None
    wanted = parse_quant(asked)
    if saved is not None and wanted != saved:
        raise error(f"{where} holds weights quantized as {saved.describe()} "
                    f"({saved.to_dict()}), but quant= asks for {wanted.describe()} "
                    f"({wanted.to_dict()}); saved quantized weights load only as they are: omit "
                    f"quant= (or pass the saved settings) to load them, or load the "
                    f"full-precision checkpoint to quantize with other settings")
    return saved.to_dict() if saved is not None else wanted.to_dict()


def saved_dtype(entry: Mapping[str, Any]) -> torch.dtype | None:
    """The compute dtype the saved layers were packed for (None when not recorded)."""
    return _torch_dtype(entry.get("dtype"))

"""Saving a quantized model and loading it back without re-quantizing.

``save_quantized(model, path)`` writes one **safetensors** file: every tensor of the model's
``state_dict`` (packed quantized buffers included, bit for bit; a tensor tied to another, e.g. an
output head tied to the embeddings, is stored once) and, in the file's JSON header, a manifest of
every :class:`QuantLinear` (its spec, the backend whose layout the buffers are in, the compute
dtype, the buffers' shapes and dtypes) with the ``quant=`` settings. Nothing is pickled: reading
the file parses JSON and copies raw tensor bytes, so a crafted file cannot run code (a
``torch.save`` file, e.g. from an older shardwise, is refused without being unpickled).
``load_quantized(model, path)`` validates the header (a named :class:`ConfigError` for a missing
key or a wrong type), takes a fresh model of the same architecture (under tensor parallelism:
sharded the same way, on the same rank), puts empty QuantLinear shells where the manifest says,
checks every stored tensor against them, and loads them: no quantization happens, so the
weights are bit-identical to the saved ones.

Quantized Mixture-of-Experts experts (:class:`~shardwise.quant.experts.QuantExperts`) are saved
the same way: their packed per-expert buffers (each ``[E_held, ...]``: the experts this rank
holds) and biases in the state dict, and in the manifest's ``"experts"`` section (format
:data:`FORMAT_EXPERTS`) each module's per-expert specs, backend, layout settings, buffer shapes
and :class:`~shardwise.quant.experts.ExpertsShape`. Loading puts empty ``QuantExperts`` shells
in place of the float experts modules. Under expert parallelism each rank's file holds its own
experts, and each entry records which (``"range"`` of ``"total"``): the packed buffers hold
one independent entry per expert along dim 0, so such a checkpoint loads at another ep size (or
on one process), each rank reading only its experts' rows from whichever rank files hold them
(:meth:`QuantCheckpointExtension.split_tensors`), as float experts reshard. The quantized dense
layers are stored whole per rank and load only at the tensor-parallel split they were saved
with (packed weights are never merged or split along a matrix): replicated ones (tp 1) from a
one-file save at any ep size, from a save over several rank files on at most that many ranks
(a rank past them has no file holding its dense layers); tp-split ones at their tp size; any
other split is named before a weight is read.

File layout (safetensors metadata, every value a JSON string): ``"format"``: :data:`FILE_FORMAT`;
``"manifest"``: :func:`manifest`; ``"aliases"``: state-dict key → the stored key it shares its
tensor with.

The sharded checkpoint (``engine.save_checkpoint``, :mod:`shardwise.checkpoint`) carries the
same pieces through :class:`QuantCheckpointExtension` (the ``"shardwise.quant"`` checkpoint
extension, registered when this module is imported; the checkpoint package only carries its
entries): each rank file's metadata holds its rank's :func:`manifest`, the description's
``extensions`` section :func:`description_entry` (the settings); loading, the extension checks
them, puts the shells in with :func:`install_shells` and reports with :func:`loaded_report`;
:func:`adopt_saved_quant` decides what happens when ``quant=`` differs from the saved settings.
Errors are :class:`QuantizedCheckpointError` (a ``CheckpointError``).

The packed layouts belong to a backend (torch's CPU int4 layout is opaque), so a file loads where
that backend runs (e.g. a CPU-packed file on a CPU); elsewhere the error says to re-quantize from
the full-precision checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Mapping

import torch
from torch import nn

from ..accelerator import Accelerator
from ..checkpoint.errors import CheckpointError
from ..checkpoint.extensions import (CheckpointExtension, LoadContext, SavedEntries,
                                     register_extension)
from ..checkpoint.sources import SAFETENSORS_DTYPES
from ..errors import ConfigError
from shardwise.kernels.reference.moe import ACTIVATIONS
from shardwise.kernels.reference.quant import QuantSpec
from .config import parse_quant
from .experts import (EXPERTS_KIND, LAYOUTS, MATRICES, ExpertsShape, QuantExperts,
                      experts_shape, is_experts_module, swap_in_experts)
from .modules import QuantLinear
from .tied import QuantEmbedding, tie_embedding
from .transform import (QUANT_ATTR, QuantizedLayer, QuantReport, _refuse_twice, model_bytes,
                        regrouped_notes, swap_in)

log = logging.getLogger(__name__)

FORMAT = "shardwise-quantized-v1"
#: The manifest format of a model holding quantized MoE experts (:class:`QuantExperts`): v1 plus
#: an ``"experts"`` section. A shardwise that reads v1 only refuses it by its format, naming it.
FORMAT_EXPERTS = "shardwise-quantized-v2"
_FORMATS = (FORMAT, FORMAT_EXPERTS)
#: The ``"format"`` of a :func:`save_quantized` file's safetensors metadata.
FILE_FORMAT = "shardwise-quantized-file-v2"
_LAYER_KEYS = {"spec", "backend", "compute_dtype", "meta", "tensors", "source", "bias", "kind"}
#: Optional layer keys: ``"tied"``, the input embedding (module name) that reads a tied head's
#: table (:mod:`.tied`: stored once, under the head's name).
_OPTIONAL_LAYER_KEYS = {"tied"}
_FILE_KEYS = {"format", "manifest", "aliases"}
#: The keys of one ``"experts"`` manifest entry (:func:`_experts_entry`).
_EXPERTS_KEYS = {"specs", "backend", "compute_dtype", "meta", "tensors", "bias", "shape"}
#: Its optional keys: ``"range"`` (the experts ``[start, stop)`` of ``"total"`` this entry holds;
#: absent in files saved before resharding existed: such experts load at their saved split).
_OPTIONAL_EXPERTS_KEYS = {"range", "total"}
#: The bias parameters a quantized experts module may hold (GPT-OSS's), kernels' layout.
_EXPERTS_BIASES = ("gate_up_proj_bias", "down_proj_bias")
#: The first bytes of the files torch.save writes (a zip archive, or a legacy raw pickle).
_TORCH_SAVE_MAGIC = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")


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
    from ..moe.block import expert_ranges

    report: QuantReport | None = getattr(model, QUANT_ATTR, None)
    ranges = expert_ranges(model)
    experts = {name: _experts_entry(m, ranges.get(id(m))) for name, m in model.named_modules()
               if isinstance(m, QuantExperts)}
    layers = {}
    tied_embeddings = {id(m.head): n for n, m in model.named_modules()
                       if isinstance(m, QuantEmbedding)}  # head → the embedding reading it
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            s = m.spec
            layers[name] = {
                "spec": [s.bits, s.group_size, s.symmetric, s.in_features, s.out_features],
                "backend": m.backend, "compute_dtype": _dtype_name(m.compute_dtype),
                "meta": m.meta, "tensors": m.describe_tensors(), "source": m.source,
                "bias": list(m.bias.shape) if m.bias is not None else None,
                "kind": report.layers[name].kind if report and name in report.layers else None}
            tied = tied_embeddings.get(id(m))
            if tied is not None:
                layers[name]["tied"] = tied
    if not layers and not experts:
        raise ConfigError(f"{type(model).__name__} holds no quantized layer; quantize it first "
                          "(shardwise.quant.quantize_model or init_inference(quant=...))")
    info = {"format": FORMAT_EXPERTS if experts else FORMAT, "layers": layers,
            "config": report.config.to_dict() if report else None,
            "dtype": _dtype_name(report.dtype) if report else None}
    if experts:
        info["experts"] = experts
    return info


def _experts_entry(module: QuantExperts,
                   held: tuple[int, int, int] | None = None) -> dict[str, Any]:
    """One quantized experts module's manifest entry: (gate_up, down) per-expert specs, the
    backend and compute dtype, each matrix's layout settings, the packed buffers (each
    ``[E_held, ...]``), the biases' shapes (GPT-OSS's, kernels' layout; None: none), the
    :class:`~shardwise.quant.experts.ExpertsShape` (``experts`` = E held by this rank) and
    which experts they are: ``range`` ``[start, stop)`` of ``total`` (``held``: the MoE
    block's ``(start, stop, total)``; None: it holds every expert)."""
    def spec(s: QuantSpec) -> list:
        return [s.bits, s.group_size, s.symmetric, s.in_features, s.out_features]
    start, stop, total = held if held is not None else (0, module.num_experts,
                                                         module.num_experts)
    return {"specs": [spec(module.spec), spec(module.down_spec)], "backend": module.backend,
            "compute_dtype": _dtype_name(module.compute_dtype), "meta": module.packed_meta(),
            "tensors": module.describe_tensors(),
            "bias": {b: list(getattr(module, b).shape) if getattr(module, b) is not None
                     else None for b in _EXPERTS_BIASES},
            "shape": dataclasses.asdict(module.shape), "range": [start, stop], "total": total}


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds a :class:`QuantLinear` or quantized MoE experts
    (:class:`QuantExperts`)."""
    return any(isinstance(m, (QuantLinear, QuantExperts)) for m in model.modules())


def tensor_names(info: Mapping[str, Any]) -> dict[str, tuple[list[int], str | None]]:
    """State-dict key → (shape, dtype name) of every tensor the manifest's layers own: the packed
    buffers and the bias (its dtype None: any floating dtype, it is cast with the model)."""
    out: dict[str, tuple[list[int], str | None]] = {}
    for layer, entry in info["layers"].items():
        for tname, (shape, dtype) in entry["tensors"].items():
            out[f"{layer}.{tname}"] = (list(shape), dtype)
        if entry.get("bias") is not None:
            out[f"{layer}.bias"] = (list(entry["bias"]), None)
    for name, entry in info.get("experts", {}).items():
        for tname, (shape, dtype) in entry["tensors"].items():
            out[f"{name}.{tname}"] = (list(shape), dtype)
        for bias, shape in entry["bias"].items():
            if shape is not None:
                out[f"{name}.{bias}"] = (list(shape), None)
    return out


class QuantizedCheckpointError(CheckpointError):
    """A quantized checkpoint or file is malformed, does not fit the model, or cannot load as
    asked (another tp size, dtype or quant settings). A :class:`CheckpointError` (and so a
    ``ConfigError``), raised before any weight is read."""


def check_manifest(info: Any, where: str) -> None:
    """Raise :class:`QuantizedCheckpointError` naming ``where`` unless ``info`` is a
    well-formed :func:`manifest`."""
    if not isinstance(info, Mapping) or info.get("format") not in _FORMATS:
        got = info.get("format") if isinstance(info, Mapping) else type(info).__name__
        raise QuantizedCheckpointError(
            f"{where} is not a shardwise quantization manifest (format {got!r}, expected one "
            f"of {list(_FORMATS)}); re-save it with this shardwise")
    layers = info.get("layers")
    experts = info.get("experts", {}) if info["format"] == FORMAT_EXPERTS else {}
    if (("experts" in info and info["format"] != FORMAT_EXPERTS)
            or not isinstance(experts, Mapping)
            or (info["format"] == FORMAT_EXPERTS and not experts)):
        raise QuantizedCheckpointError(
            f"{where}: the quantization manifest's 'experts' section does not fit its format "
            f"{info['format']!r} ({FORMAT_EXPERTS!r} and only it lists quantized experts); the "
            f"checkpoint is corrupted: re-save it")
    if not isinstance(layers, Mapping) or not (layers or experts):
        raise QuantizedCheckpointError(f"{where}: the quantization manifest lists no layers")
    for kind, entries, problem_of in (("layer", layers, _entry_problem),
                                      ("experts module", experts, _experts_problem)):
        for name, entry in entries.items():
            problem = problem_of(entry)
            if problem:
                raise QuantizedCheckpointError(
                    f"{where}: the quantization manifest entry of {kind} {name!r} is malformed "
                    f"({problem}); the checkpoint is corrupted: re-save it")


def _entry_problem(entry: Any) -> str | None:
    """What is wrong with one manifest layer entry (None when it is well-formed): every key
    present with its type, so nothing malformed reaches a kernel."""
    if not isinstance(entry, Mapping) or not (
            _LAYER_KEYS <= set(entry) <= _LAYER_KEYS | _OPTIONAL_LAYER_KEYS):
        return f"keys {sorted(entry) if isinstance(entry, Mapping) else entry!r}"
    if not isinstance(entry.get("tied", ""), str) or entry.get("tied", "x") == "":
        return f"tied {entry.get('tied')!r}"
    spec = entry["spec"]
    if not _spec_ok(spec):
        return f"spec {spec!r}"
    if not isinstance(entry["backend"], str) or not entry["backend"]:
        return f"backend {entry['backend']!r}"
    if entry["source"] not in ("linear", "conv1d"):
        return f"source {entry['source']!r}"
    if entry["kind"] is not None and not isinstance(entry["kind"], str):
        return f"kind {entry['kind']!r}"
    bias = entry["bias"]
    if bias is not None and not (isinstance(bias, list) and all(_int(d) and d >= 0
                                                                for d in bias)):
        return f"bias shape {bias!r}"
    meta = entry["meta"]
    if not _flat_ok(meta):
        return f"meta {meta!r}"
    tensors = entry["tensors"]
    if not isinstance(tensors, Mapping) or not tensors:
        return f"tensors {tensors!r}"
    try:
        _torch_dtype(entry["compute_dtype"])
        for tname, value in tensors.items():
            if not (isinstance(tname, str) and isinstance(value, (list, tuple))
                    and len(value) == 2 and isinstance(value[0], list)):
                return f"tensor entry {tname!r}: {value!r}"
            shape, dtype = value
            if not isinstance(dtype, str):
                return f"tensor {tname!r} dtype {dtype!r}"
            _torch_dtype(dtype)
            if not all(_int(d) and d >= 0 for d in shape):
                return f"tensor shape {shape!r}"
    except (KeyError, TypeError, ValueError) as exc:
        return f"dtype or tensor entry {exc}"
    return None


def _int(value: Any) -> bool:
    """A JSON integer (not a bool, not a float)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _spec_ok(spec: Any) -> bool:
    """A :class:`QuantSpec` as a manifest stores it: [bits 4|8, group, symmetric, in, out]."""
    return (isinstance(spec, list) and len(spec) == 5 and _int(spec[0]) and spec[0] in (4, 8)
            and isinstance(spec[2], bool)
            and all(_int(v) and v > 0 for v in (spec[1], spec[3], spec[4])))


def _flat_ok(meta: Any) -> bool:
    """A layout's settings: string keys, JSON scalar values."""
    return isinstance(meta, Mapping) and all(
        isinstance(k, str) and (v is None or isinstance(v, (str, int, float, bool)))
        for k, v in meta.items())


def _shape_ok(shape: Any, leading: int | None = None) -> bool:
    """A list of non-negative ints (its first ``leading`` when given)."""
    return (isinstance(shape, list) and all(_int(d) and d >= 0 for d in shape)
            and (leading is None or (bool(shape) and shape[0] == leading)))


#: ExpertsShape field → whether a manifest value is valid for it
_EXPERTS_SHAPE_FIELDS = {
    "layout": lambda v: v in LAYOUTS,
    "experts": lambda v: _int(v) and v > 0, "hidden": lambda v: _int(v) and v > 0,
    "inter": lambda v: _int(v) and v > 0, "activation": lambda v: v in ACTIVATIONS,
    "clamp": lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)),
    "alpha": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}


def _experts_problem(entry: Any) -> str | None:
    """What is wrong with one ``"experts"`` manifest entry (None when it is well-formed): every
    key with its type, the specs agreeing with the shape (gate_up [2I, H], down [H, I] per
    expert) and every packed tensor and bias holding one entry per expert."""
    if not isinstance(entry, Mapping) or not (
            _EXPERTS_KEYS <= set(entry) <= _EXPERTS_KEYS | _OPTIONAL_EXPERTS_KEYS):
        return f"keys {sorted(entry) if isinstance(entry, Mapping) else entry!r}"
    shape = entry["shape"]
    if not isinstance(shape, Mapping) or set(shape) != set(_EXPERTS_SHAPE_FIELDS) or not all(
            ok(shape[k]) for k, ok in _EXPERTS_SHAPE_FIELDS.items()):
        return f"shape {shape!r}"
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    held, total = entry.get("range"), entry.get("total")
    if ("range" in entry) != ("total" in entry) or ("range" in entry and not (
            _int(total) and isinstance(held, list) and len(held) == 2 and all(map(_int, held))
            and 0 <= held[0] and held[1] - held[0] == e and held[1] <= total)):
        return f"range {held!r} of {total!r} for {e} experts held"
    specs = entry["specs"]
    if not (isinstance(specs, list) and len(specs) == 2 and all(map(_spec_ok, specs))
            and specs[0][3:] == [h, 2 * i] and specs[1][3:] == [i, h]
            and specs[0][0] == specs[1][0]):
        return f"specs {specs!r} for hidden {h}, intermediate {i}"
    if not isinstance(entry["backend"], str) or not entry["backend"]:
        return f"backend {entry['backend']!r}"
    meta = entry["meta"]
    if not (isinstance(meta, Mapping) and set(meta) == {"gate_up", "down"}
            and all(_flat_ok(m) for m in meta.values())):
        return f"meta {meta!r}"
    bias = entry["bias"]
    if not (isinstance(bias, Mapping) and set(bias) == set(_EXPERTS_BIASES) and all(
            b is None or _shape_ok(b, e) for b in bias.values())):
        return f"bias {bias!r}"
    tensors = entry["tensors"]
    if not isinstance(tensors, Mapping) or not all(
            any(isinstance(n, str) and n.startswith(f"{part}_") for n in tensors)
            for part in ("gate_up", "down")):
        return f"tensors {tensors!r}"
    try:
        _torch_dtype(entry["compute_dtype"])
        for tname, value in tensors.items():
            if not (isinstance(value, (list, tuple)) and len(value) == 2
                    and isinstance(value[1], str) and _shape_ok(value[0], e)
                    and tname.startswith(("gate_up_", "down_"))):
                return f"tensor entry {tname!r}: {value!r} (each [{e} experts, ...])"
            _torch_dtype(value[1])
    except (KeyError, TypeError, ValueError) as exc:
        return f"dtype or tensor entry {exc}"
    return None


def save_quantized(model: nn.Module, path: str | os.PathLike) -> str:
    """Write ``model``'s quantized state to the safetensors file ``path`` (module docstring;
    ``.safetensors`` is the usual suffix); returns the path."""
    from safetensors.torch import save_file

    info = manifest(model)
    tensors, aliases = _unshared(model.state_dict())
    metadata = {"format": FILE_FORMAT, "manifest": json.dumps(info),
                "aliases": json.dumps(aliases)}
    save_file(tensors, os.fspath(path), metadata=metadata)
    return os.fspath(path)


def _unshared(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                           dict[str, str]]:
    """(tensors to store, key → stored key it is tied to): safetensors stores no two tensors
    sharing memory, so a tensor tied to an earlier one (same storage, offset, shape, strides
    and dtype) is recorded as an alias; any other overlap is stored as a copy."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for key, tensor in state.items():
        tensor = tensor.detach()
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                 tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if ident in seen and tensor.numel():
            aliases[key] = seen[ident]
            continue
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in storages or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        storages.add(ptr)
        seen[ident] = key
        tensors[key] = tensor.contiguous()
    return tensors, aliases


def _refuse_torch_save(path: str) -> None:
    """A ``torch.save`` file (zip or raw pickle) is refused before anything parses it."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head.startswith(_TORCH_SAVE_MAGIC):
        raise ConfigError(
            f"{path!r} is a torch.save (pickle) file, e.g. written by an older shardwise; it is "
            f"not loaded, because unpickling a file can run arbitrary code. Quantize the "
            f"full-precision model again and save it with this shardwise's save_quantized "
            f"(a safetensors file with a JSON manifest)")


def read_quantized(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, str], Any]:
    """(manifest, aliases, open safetensors handle) of a :func:`save_quantized` file, every
    header value validated (a named :class:`ConfigError` otherwise); parses JSON only."""
    from safetensors import SafetensorError, safe_open

    where = repr(os.fspath(path))
    if not os.path.isfile(path):
        raise ConfigError(f"{where} is not a file; pass the path save_quantized wrote")
    _refuse_torch_save(os.fspath(path))
    try:
        handle = safe_open(os.fspath(path), "pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise ConfigError(f"{where} is not a safetensors file ({exc}); save_quantized writes "
                          "one") from None
    meta = handle.metadata() or {}
    if meta.get("format") != FILE_FORMAT or set(meta) != _FILE_KEYS:
        raise ConfigError(f"{where} is not a shardwise quantized file (format "
                          f"{meta.get('format')!r}, keys {sorted(meta)}; expected format "
                          f"{FILE_FORMAT!r} with {sorted(_FILE_KEYS)}); re-save it with "
                          f"save_quantized")
    info, aliases = (_json(meta, key, where) for key in ("manifest", "aliases"))
    check_manifest(info, where)
    _check_settings(info, where)
    keys = set(handle.keys())
    if not isinstance(aliases, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v in keys and k not in keys
            for k, v in aliases.items()):
        raise ConfigError(f"{where}: 'aliases' must map state-dict keys to stored tensors, got "
                          f"{aliases!r}; the file is corrupted: re-save it")
    return info, aliases, handle


def _json(meta: Mapping[str, str], key: str, where: str) -> Any:
    try:
        return json.loads(meta[key])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: its {key!r} header is not valid JSON ({exc}); the file is "
                          "corrupted: re-save it") from None


def _check_settings(info: Mapping[str, Any], where: str) -> None:
    """The manifest's ``config`` (a ``quant=`` dict or None) and ``dtype`` (a dtype name or
    None) are valid."""
    extra = set(info) - {"format", "layers", "config", "dtype", "experts"}
    if extra:
        raise ConfigError(f"{where}: unknown quantization manifest keys {sorted(extra)}")
    try:
        if info.get("config") is not None:
            parse_quant(info["config"])
        dtype = info.get("dtype")
        if dtype is not None and not isinstance(dtype, str):
            raise KeyError(dtype)
        _torch_dtype(dtype)
    except (ConfigError, KeyError) as exc:
        raise ConfigError(f"{where}: its quantization settings are invalid ({exc}); the file is "
                          "corrupted: re-save it") from None


def _check_stored(info: Mapping[str, Any], handle: Any, model: nn.Module,
                  aliases: Mapping[str, str], where: str) -> None:
    """The stored tensors (and aliases) are exactly the state dict the model will have once the
    manifest's shells are in, each with its shape (and, for packed tensors, the manifest's
    dtype) — checked from the header alone, before the model is changed."""
    expected = {key: (list(t.shape), None) for key, t in model.state_dict().items()}
    for layer, entry in info["layers"].items():
        for key in (f"{layer}.weight", f"{layer}.bias"):
            expected.pop(key, None)
        if entry.get("tied"):  # the embedding reads the head's table: no state of its own
            expected.pop(f"{entry['tied']}.weight", None)
    for name in info.get("experts", {}):  # the float experts module's own tensors
        for key in [k for k in expected if k.rpartition(".")[0] == name]:
            expected.pop(key)
    expected.update(tensor_names(info))
    names = set(handle.keys()) | set(aliases)
    missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or unexpected:
        raise ConfigError(f"{where} does not match the model's state dict (missing "
                          f"{missing[:5]}, unexpected {unexpected[:5]}); load it into the "
                          "architecture (and tensor-parallel rank) it was saved from")
    for key, (shape, dtype) in expected.items():
        stored = handle.get_slice(aliases.get(key, key))
        got_shape, got_dtype = list(stored.get_shape()), stored.get_dtype()
        if got_shape != list(shape) or (
                dtype is not None and SAFETENSORS_DTYPES.get(got_dtype) != _torch_dtype(dtype)):
            want = f"{dtype} {list(shape)}" if dtype is not None else f"{list(shape)}"
            raise ConfigError(f"{where}: tensor {key!r} is {got_dtype} {got_shape}, the model "
                              f"(or the file's manifest) needs {want}; load it into the model it "
                              "was saved from")


def install_shells(model: nn.Module, info: Mapping[str, Any], device: torch.device | str,
                   source: str, bias_dtype: torch.dtype | None = None) -> dict[str, QuantizedLayer]:
    """Put an empty :class:`QuantLinear` (buffers uninitialised, on ``device``: "meta" for a
    loader that assigns them) wherever the manifest ``info`` says, carrying each replaced
    module's hooks; biases are made in ``bias_dtype`` (the model's; default each layer's
    compute dtype). Returns layer name → :class:`QuantizedLayer`. Raises
    :class:`QuantizedCheckpointError` for a layer
    the model lacks or a backend that cannot run here."""
    modules = dict(model.named_modules())
    missing = [n for n in (*info["layers"], *info.get("experts", {})) if n not in modules]
    if missing:
        raise QuantizedCheckpointError(f"the saved quantized layers {missing[:3]} are not in "
                    f"{type(model).__name__}; load into the model architecture {source} was "
                    "saved from")
    layers = {}
    for name, entry in info["layers"].items():
        spec = QuantSpec(*entry["spec"])
        compute = _torch_dtype(entry["compute_dtype"])
        try:
            shell = QuantLinear.empty_like(spec, entry["backend"], compute, entry["meta"],
                                           entry["tensors"], entry["bias"], entry["source"],
                                           device=device, bias_dtype=bias_dtype)
        except KeyError as exc:
            raise _backend_missing(source, "weights", entry["backend"], exc) from None
        swap_in(model, name, shell)
        if entry.get("tied"):
            _tie_shell(model, entry["tied"], name, shell, bias_dtype or compute or torch.float32,
                       source)
        layers[name] = QuantizedLayer(name, entry.get("kind") or "attention", entry["backend"],
                                      spec.bits, spec.group_size,
                                      (spec.out_features, spec.in_features), shell.weight_nbytes,
                                      compute)
    for name, entry in info.get("experts", {}).items():
        layers.update(_install_experts_shell(model, name, entry, device, source, bias_dtype,
                                             _torch_dtype(info.get("dtype"))))
    return layers


def _backend_missing(source: str, what: str, backend: str,
                     exc: KeyError) -> QuantizedCheckpointError:
    """The error for ``what`` (weights, experts) packed for a backend that cannot run here."""
    return QuantizedCheckpointError(
        f"{source} holds {what} packed for the {backend!r} kernel backend, which cannot run "
        f"here ({exc.args[0]}); re-quantize from the full-precision checkpoint on this device")


def _install_experts_shell(model: nn.Module, name: str, entry: Mapping[str, Any],
                           device: torch.device | str, source: str,
                           bias_dtype: torch.dtype | None, saved_dtype: torch.dtype | None
                           ) -> dict[str, QuantizedLayer]:
    """Put an empty :class:`QuantExperts` (buffers uninitialised on ``device``) in place of the
    experts module ``name`` (recorded like quantizing it: the undo dequantizes back into the
    original). Returns the report's two layers (``<name>.gate_up_proj``, ``<name>.down_proj``,
    each ``[E * out, in]``), as quantizing reports them."""
    if not is_experts_module(model.get_submodule(name)):
        raise QuantizedCheckpointError(
            f"{source} holds quantized experts {name!r}, but in {type(model).__name__} that "
            f"module holds no stacked expert weights (gate_up_proj, down_proj); load it into "
            f"the architecture it was saved from")
    specs = tuple(QuantSpec(*s) for s in entry["specs"])
    compute = _torch_dtype(entry["compute_dtype"])
    shape = ExpertsShape(**entry["shape"])
    try:
        shell = QuantExperts.empty_like(specs, entry["backend"], compute, entry["meta"],
                                        entry["tensors"], shape, entry["bias"], device=device,
                                        bias_dtype=bias_dtype)
    except KeyError as exc:
        raise _backend_missing(source, "experts", entry["backend"], exc) from None
    swap_in_experts(model, name, shell)
    packed = shell.packed
    return {f"{name}.{matrix}": QuantizedLayer(
        f"{name}.{matrix}", EXPERTS_KIND, entry["backend"], spec.bits, spec.group_size,
        (shape.experts * spec.out_features, spec.in_features), packed[part].nbytes,
        compute or bias_dtype or saved_dtype or torch.float32)
        for matrix, part, spec in zip(MATRICES, ("gate_up", "down"), specs)}


def _tie_shell(model: nn.Module, embed_name: str, head_name: str, shell: QuantLinear,
               dtype: torch.dtype, source: str) -> None:
    """Put the :class:`~shardwise.quant.tied.QuantEmbedding` reading ``shell``'s table in place
    of the input embedding ``embed_name`` (as quantizing put it)."""
    from .tied import embedding_problem

    embed = dict(model.named_modules()).get(embed_name)
    problem = "it is missing" if embed is None else embedding_problem(embed_name, embed)
    if problem:
        raise QuantizedCheckpointError(
            f"{source} stores {head_name!r} once for the tied input embedding {embed_name!r}, "
            f"but in {type(model).__name__} {problem}; load it into the architecture it was "
            f"saved from")
    tie_embedding(model, embed_name, shell, head_name, dtype)


def loaded_report(model: nn.Module, info: Mapping[str, Any], layers: dict[str, QuantizedLayer],
                  device: torch.device | str, source: str) -> QuantReport:
    """The :class:`QuantReport` of a model whose quantized layers were loaded as saved (bytes
    before = the model unquantized in the saved dtype); also stored on the model."""
    dtype = _torch_dtype(info.get("dtype"))
    config = parse_quant(info["config"]) if info.get("config") else None
    report = QuantReport(config, dtype, str(device), layers=dict(layers), source=source)
    if config is not None:  # the groups chosen at quantization, as the saved specs hold them
        report.notes.extend(regrouped_notes(config, layers))
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
    Returns a :class:`QuantReport` (bytes before = the saved model unquantized in its dtype).

    Nothing is unpickled (module docstring). Raises :class:`ConfigError` for a file that is not
    one save_quantized wrote (a ``torch.save`` file included), a malformed header (naming the
    key), or tensors that do not match the model — all before the model is changed."""
    _refuse_twice(model)
    where = repr(os.fspath(path))
    info, aliases, handle = read_quantized(path)
    if device is None:
        device = accelerator.device() if accelerator is not None else torch.device("cpu")
    device = torch.device(device)
    _check_fits_model(model, info, where)
    _check_stored(info, handle, model, aliases, where)
    layers = install_shells(model, info, device, where, bias_dtype=_torch_dtype(info.get("dtype")))
    state = {key: handle.get_tensor(key) for key in handle.keys()}
    for key, target in aliases.items():
        state[key] = state[target]
    meta_model = any(p.is_meta for p in model.parameters())
    if not meta_model:
        model.to(device)
    model.load_state_dict(state, strict=True, assign=meta_model)
    if meta_model:  # non-persistent buffers (rotary inv_freq) recomputed, as the loader does
        from ..checkpoint.loader import _fill_meta_buffers

        _fill_meta_buffers(model, device)
    dtype = _torch_dtype(info.get("dtype"))
    if dtype is not None:
        from ..transforms import cast_and_move

        cast_and_move(model, device, dtype)
    return loaded_report(model, info, layers, device, f"loaded {os.fspath(path)}")


def _check_fits_model(model: nn.Module, info: Mapping[str, Any], where: str) -> None:
    """Each saved layer is a Linear/Conv1D of the model with the saved [out, in] (before any
    shell is installed, so a mismatch leaves the model as it was)."""
    from .transform import _weight_shape, is_quantizable

    modules = dict(model.named_modules())
    for name, entry in info["layers"].items():
        module = modules.get(name)
        if module is None or not is_quantizable(module):
            raise ConfigError(f"{where}: saved quantized layer {name!r} is not a Linear/Conv1D of "
                              f"{type(model).__name__}; load it into the architecture it was "
                              "saved from")
        want = list(_weight_shape(module))
        if want != [entry["spec"][4], entry["spec"][3]]:
            raise ConfigError(f"{where}: saved layer {name!r} is [out, in] = "
                              f"{[entry['spec'][4], entry['spec'][3]]}, the model's is {want}; "
                              "load it into the model (and tensor-parallel rank) it was saved "
                              "from")
    for name, entry in info.get("experts", {}).items():
        problem = _experts_misfit(modules.get(name), name, entry, None)
        if problem:
            raise ConfigError(f"{where}: saved quantized experts {name!r}: {problem}; load it "
                              f"into the architecture (and expert-parallel rank) it was saved "
                              f"from")


def _experts_misfit(module: nn.Module | None, name: str, entry: Mapping[str, Any],
                    held: int | None) -> str | None:
    """Why the saved experts ``entry`` does not fit ``module`` (None when it does): an experts
    module of the same layout, hidden and intermediate sizes, holding ``held`` experts (default
    the module's own count: under expert parallelism, this rank's), with biases exactly where
    the module has them."""
    if module is None or not is_experts_module(module):
        return f"{type(module).__name__ if module is not None else 'no module'} is there, not " \
               f"an experts module holding stacked expert weights"
    try:
        have = experts_shape(name, module)
    except ConfigError as exc:
        return str(exc)
    held = have.experts if held is None else held
    saved = entry["shape"]
    want = (have.layout, held, have.hidden, have.inter)
    got = (saved["layout"], saved["experts"], saved["hidden"], saved["inter"])
    biases = {b: isinstance(getattr(module, b, None), torch.Tensor) for b in _EXPERTS_BIASES}
    if got != want or biases != {b: s is not None for b, s in entry["bias"].items()}:
        return (f"saved as (layout, experts, hidden, intermediate) {got} with biases "
                f"{sorted(b for b, s in entry['bias'].items() if s is not None)}, the model's "
                f"is {want} with {sorted(b for b, has in biases.items() if has)}")
    return None


# ----- the sharded checkpoint's quant settings ----------------------------------------------------

def description_entry(info: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint description records of a quantized model (rank 0's :func:`manifest`):
    the format, the ``quant=`` settings, the compute dtype and the quantized layers' names."""
    entry = {"format": info["format"], "config": info.get("config"), "dtype": info.get("dtype"),
             "layers": sorted(info["layers"])}
    if info.get("experts"):
        entry["experts"] = sorted(info["experts"])
    return entry


def check_description_entry(entry: Any, where: str) -> None:
    """Raise :class:`QuantizedCheckpointError` unless ``entry`` (a description's
    ``"shardwise.quant"`` extension entry) is well-formed."""
    if not isinstance(entry, Mapping) or entry.get("format") not in _FORMATS:
        got = entry.get("format") if isinstance(entry, Mapping) else entry
        raise QuantizedCheckpointError(
            f"{where}: its 'shardwise.quant' entry has format {got!r}; this shardwise reads "
            f"{list(_FORMATS)} (re-save the checkpoint with this shardwise)")
    try:
        if entry.get("config") is not None:
            parse_quant(entry["config"])
        _torch_dtype(entry.get("dtype"))
    except (ConfigError, KeyError) as exc:
        raise QuantizedCheckpointError(
            f"{where}: its 'shardwise.quant' settings are invalid ({exc}); the checkpoint "
            "description is corrupted: re-save it") from None
    names, experts = entry.get("layers"), entry.get("experts", [])
    v2 = entry["format"] == FORMAT_EXPERTS
    if not all(isinstance(v, list) and all(isinstance(n, str) for n in v)
               for v in (names, experts)) or not (names or experts) or v2 != bool(experts):
        raise QuantizedCheckpointError(f"{where}: its 'shardwise.quant' entry must list the "
                                       f"quantized layers (and, format {FORMAT_EXPERTS!r} only, "
                                       f"the quantized experts modules), got layers {names!r}, "
                                       f"experts {entry.get('experts')!r}")


def adopt_saved_quant(entry: Mapping[str, Any], asked: Mapping | None,
                      where: str) -> dict[str, Any] | None:
    """The ``quant=`` dict to run with when loading a checkpoint saved quantized with the
    description ``entry``: the saved settings. ``asked`` None (no ``quant=``): they are adopted
    with one log line. ``asked`` equal to them: fine. Different: a
    :class:`QuantizedCheckpointError`, because quantized
    weights cannot be re-quantized to other settings without compounding the rounding error."""
    saved = parse_quant(entry["config"]) if entry.get("config") is not None else None
    if asked is None:
        what = saved.describe() if saved is not None else "quantized"
        log.info("shardwise: %s holds %s weights; loading them as saved (quant= was not given)",
                 where, what)
        return saved.to_dict() if saved is not None else None
    wanted = parse_quant(asked)
    if saved is not None and wanted != saved:
        raise QuantizedCheckpointError(f"{where} holds weights quantized as {saved.describe()} "
                    f"({saved.to_dict()}), but quant= asks for {wanted.describe()} "
                    f"({wanted.to_dict()}); saved quantized weights load only as they are: omit "
                    f"quant= (or pass the saved settings) to load them, or load the "
                    f"full-precision checkpoint to quantize with other settings")
    return saved.to_dict() if saved is not None else wanted.to_dict()


def saved_dtype(entry: Mapping[str, Any]) -> torch.dtype | None:
    """The compute dtype the saved layers were packed for (None when not recorded)."""
    return _torch_dtype(entry.get("dtype"))


# ----- the checkpoint extension: quantized engines' sharded checkpoints ---------------------------

#: the name of the quantized layers' entries in a sharded checkpoint (:mod:`shardwise.checkpoint.
#: extensions`): the description's ``extensions`` section holds :func:`description_entry`, each
#: rank file's metadata that rank's :func:`manifest`
EXTENSION = "shardwise.quant"


def settings_for_checkpoint(desc: Any, asked: Mapping | None, tp_size: int,
                            ep_size: int | None = None) -> Mapping | None:
    """The ``quant=`` settings to run with when loading the checkpoint ``desc`` (a
    :class:`~shardwise.checkpoint.Description`): ``asked`` for a full-precision one; for a
    quantized one its saved settings (:func:`adopt_saved_quant`), after refusing another split
    (one holding quantized experts reshards where the loader reads split tensors,
    :func:`_experts_reshard`: only its dense layers' split is checked, by the loader). Reads no
    file.

    The split is the ranks the model is split over, ``max(tp_size, ep_size)``; with
    ``ep_size`` None (not known to the caller) a checkpoint holding quantized experts, whose
    rank files may be an expert-parallel split, is left to the loader's check
    (:meth:`QuantCheckpointExtension.check_load`, also before any weight is read)."""
    entry = desc.extensions.get(EXTENSION)
    if entry is None:
        return asked
    experts = bool(isinstance(entry, Mapping) and entry.get("experts"))
    if not _experts_reshard(entry) and (ep_size is not None or not experts):
        _check_tp(desc.source, desc.tp_size, max(tp_size, ep_size or 1), experts)
    return adopt_saved_quant(entry, asked, desc.source)


def _experts_reshard(entry: Any) -> bool:
    """Whether a checkpoint with the description ``entry`` may load at another split: it holds
    quantized experts (resharded by expert, :meth:`QuantCheckpointExtension.split_tensors`)
    and the loader reads split extension tensors. Its dense quantized layers are then checked
    against this rank's modules (:func:`_check_shell_shapes`), before any read."""
    return bool(isinstance(entry, Mapping) and entry.get("experts")) and _SPLIT_LOADING


#: the checkpoint loader reads an extension's tensors split over the rank files (a loader
#: without :meth:`CheckpointExtension.split_tensors` reads each rank's own file only)
_SPLIT_LOADING = "split_tensors" in vars(CheckpointExtension)


def _check_tp(source: str, saved: int | None, ranks: int, experts: bool = False) -> None:
    """The model is split over the ``saved`` ranks it was saved from (packed weights are stored
    whole per rank: never merged or split). ``experts``: the checkpoint holds quantized experts
    (named in the message; with a loader reading split tensors they reshard instead:
    :func:`_experts_reshard`)."""
    if ranks == saved:
        return
    if not experts:
        raise QuantizedCheckpointError(
            f"{source} holds quantized weights saved at tp_size={saved}; packed "
            f"quantized weights cannot be merged or split for tp_size={ranks}: load it at "
            f"tp_size={saved}, or save the model unquantized (init_inference without "
            f"quant=) and quantize while loading at the new tp size")
    raise QuantizedCheckpointError(
        f"{source} holds quantized weights and MoE experts saved split over {saved} rank(s) "
        f"(max(tp_size, ep_size) = {saved}); packed quantized weights cannot be merged or split "
        f"for {ranks} rank(s): load it with the tp_size and moe ep_size it was saved with, or "
        f"save the model unquantized (init_inference without quant=) and quantize while "
        f"loading at the new sizes")


class QuantCheckpointExtension(CheckpointExtension):
    """The sharded checkpoint's quantized layers (module docstring): saved as packed, loaded
    into empty :class:`QuantLinear` shells as saved, never re-quantized."""

    name = EXTENSION

    def save_entries(self, model: nn.Module) -> SavedEntries | None:
        if not is_quantized(model):
            return None
        info = manifest(model)
        return SavedEntries(description_entry(info), info, frozenset(tensor_names(info)))

    def check_description(self, entry: Any, where: str) -> None:
        check_description_entry(entry, where)

    def check_load(self, entry: Any, context: LoadContext) -> None:
        """At its tp size, without being quantized again, in its compute dtype."""
        from .transform import QuantizeOnRead

        if not _experts_reshard(entry):
            _check_tp(context.source, context.saved_tp, context.tp_size,
                      bool(isinstance(entry, Mapping) and entry.get("experts")))
        if any(isinstance(h, QuantizeOnRead) for h in context.hooks):
            raise QuantizedCheckpointError(
                f"{context.source} holds weights that are already quantized; load it without "
                f"a quantizer (quantizing twice compounds the rounding)")
        saved, dtype = saved_dtype(entry), context.dtype
        if saved is not None and dtype is not None and dtype != saved:
            raise QuantizedCheckpointError(
                f"{context.source} holds weights packed for "
                f"{str(saved).removeprefix('torch.')} compute, not "
                f"{str(dtype).removeprefix('torch.')}; load it with dtype={saved} (or leave "
                f"dtype unset), or load the full-precision checkpoint to quantize for another "
                f"dtype")

    def rank_tensors(self, entry: Any, rank_entry: Any, where: str) -> dict:
        """A rank file's manifest: well-formed and agreeing with the description's settings
        and layers; its packed tensors (and biases) are what the file must hold."""
        check_manifest(rank_entry, where)
        if (sorted(rank_entry["layers"]), sorted(rank_entry.get("experts", {})),
                rank_entry.get("config"), rank_entry.get("dtype")) \
                != (entry["layers"], entry.get("experts", []), entry.get("config"),
                    entry.get("dtype")):
            raise QuantizedCheckpointError(
                f"{where} disagrees with the description's 'shardwise.quant' entry (other "
                f"quantized layers, settings or dtype): the rank files do not belong to this "
                f"description; re-save the checkpoint")
        return tensor_names(rank_entry)

    def split_tensors(self, entry: Any, rank_entries: list[Any]) -> dict:
        """Every experts module's packed buffers and biases whose rank files' ``range`` s tile
        its ``total`` experts (each expert in one file, or the same range in several: expert
        groups): they load at another ep size (module docstring)."""
        out = {}
        for name in entry.get("experts", []) if _SPLIT_LOADING else ():
            parts = _expert_parts([e["experts"][name] for e in rank_entries])
            if parts is not None:
                saved = rank_entries[0]["experts"][name]
                keys = [*saved["tensors"], *(b for b, s in saved["bias"].items() if s)]
                out.update({f"{name}.{key}": parts for key in keys})
        return out

    def install(self, model: nn.Module, entry: Any, rank_entry: Any,
                shapes: Mapping[str, tuple[int, ...]], context: LoadContext) -> Any:
        """Each saved layer checked against this rank's slice of the model's module, then an
        empty shell (buffers on meta) put in its place. Returns (manifest, layer name →
        QuantizedLayer).

        An experts module is checked against this rank's experts (``shapes``: its stacked
        parameters' dim 0 under expert parallelism); the float module it replaces keeps meta
        parameters of that shape, so the expert-parallel split (which slices float experts the
        loader did not) finds it already holding this rank's experts."""
        if _experts_reshard(entry):
            rank_entry = _for_this_rank(model, rank_entry, shapes)
        _check_shell_shapes(model, rank_entry, shapes, context)
        for name in rank_entry.get("experts", {}):
            _local_meta(model.get_submodule(name), name, shapes)
        return rank_entry, install_shells(model, rank_entry, "meta", context.source)

    def finish(self, model: nn.Module, state: Any, context: LoadContext,
               device: torch.device) -> QuantReport:
        info, layers = state
        return loaded_report(model, info, layers, device, f"loaded {context.source}")


def _expert_parts(entries: list[Mapping[str, Any]]) -> tuple[int, list] | None:
    """(total, [(file, (start, stop)), ...] tiling ``[0, total)``) of one experts module's
    entries in the rank files (file order), each expert from the first file holding it; None
    when they do not tile it (saved before ranges were recorded, by more than one file; or
    disagreeing on anything but their range: another split, e.g. tp-sliced experts)."""
    def same(e: Mapping[str, Any]) -> tuple:
        shape = {k: v for k, v in e["shape"].items() if k != "experts"}
        tensors = {k: (v[0][1:], v[1]) for k, v in e["tensors"].items()}
        bias = {k: v and v[1:] for k, v in e["bias"].items()}
        return (e["specs"], e["backend"], e["compute_dtype"], e["meta"], shape, tensors, bias,
                e.get("total"))
    first = entries[0]
    if "range" not in first:
        return (first["shape"]["experts"], [(0, (0, first["shape"]["experts"]))]) \
            if len(entries) == 1 else None
    if any(same(e) != same(first) or "range" not in e for e in entries):
        return None
    parts, cursor = [], 0
    for file, e in enumerate(entries):
        start, stop = e["range"]
        if start == cursor:
            parts.append((file, (start, stop)))
            cursor = stop
        elif (start, stop) not in [r for _, r in parts]:
            return None
    return (first["total"], parts) if cursor == first["total"] else None


def _for_this_rank(model: nn.Module, info: Mapping[str, Any],
                   shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The rank file's manifest ``info`` with each experts module that reshards (its ``total``
    the model's expert count) describing the experts this rank keeps (``shapes``: its
    ``gate_up_proj`` rows) instead of those the saving rank held: what the loader reads for it
    from the rank files. Another count is left as saved (named by :func:`_check_shell_shapes`)."""
    experts = {}
    for name, entry in info.get("experts", {}).items():
        module = dict(model.named_modules()).get(name)
        whole = getattr(module, "gate_up_proj", None)
        held = shapes.get(f"{name}.gate_up_proj", (None,))[0]
        if "total" not in entry or not isinstance(whole, torch.Tensor) or held is None \
                or whole.shape[0] != entry["total"]:
            experts[name] = entry
            continue
        experts[name] = {
            **{k: v for k, v in entry.items() if k != "range"},
            "shape": {**entry["shape"], "experts": held},
            "tensors": {k: [[held, *shape[1:]], dtype]
                        for k, (shape, dtype) in entry["tensors"].items()},
            "bias": {k: v and [held, *v[1:]] for k, v in entry["bias"].items()}}
    return {**info, "experts": experts} if experts else dict(info)


def _local_meta(module: nn.Module, name: str, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """``module``'s parameters still on meta take the shape this rank keeps of them."""
    for pname, param in list(module.named_parameters(recurse=False)):
        shape = tuple(shapes.get(f"{name}.{pname}", param.shape))
        if param.is_meta and tuple(param.shape) != shape:
            setattr(module, pname, nn.Parameter(torch.empty(shape, dtype=param.dtype,
                                                            device="meta"),
                                                requires_grad=False))


def _check_shell_shapes(model: nn.Module, info: Mapping[str, Any],
                        shapes: Mapping[str, tuple[int, ...]], context: LoadContext) -> None:
    """Each saved layer's [out, in] (and bias or none) equals this rank's slice of the model's
    module of that name, each saved experts module this rank's experts; else the checkpoint
    was saved from another config or plan."""
    modules = dict(model.named_modules())
    for name, entry in info.get("experts", {}).items():
        module = modules.get(name)
        held = shapes.get(f"{name}.gate_up_proj", (None,))[0]
        problem = _experts_misfit(module, name, entry, held)
        if problem:
            raise QuantizedCheckpointError(
                f"quantized experts {name!r} on rank {context.rank} of {context.source}: "
                f"{problem} (this rank's experts, in the model built from the config); the "
                f"checkpoint and the config (or the tensor/expert-parallel plan) do not belong "
                f"together")
    for name, entry in info["layers"].items():
        module = modules.get(name)
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 2:
            continue  # a missing layer is named by install_shells
        shape = list(shapes.get(f"{name}.weight", weight.shape))  # [out, in]; Conv1D [in, out]
        want = shape if isinstance(module, nn.Linear) else shape[::-1]
        saved = [entry["spec"][4], entry["spec"][3]]
        has_bias = isinstance(getattr(module, "bias", None), torch.Tensor)
        if saved != want or has_bias != (entry["bias"] is not None):
            raise QuantizedCheckpointError(
                f"quantized layer {name!r} is [out, in] = {saved} "
                f"({'with' if entry['bias'] is not None else 'without'} bias) on rank "
                f"{context.rank} of {context.source}, but {want} "
                f"({'with' if has_bias else 'without'} bias) in the model built from the "
                f"config; the checkpoint and the config (or tensor-parallel plan) do not belong "
                f"together (packed quantized layers load only at the tensor-parallel split "
                f"they were saved with: {context.saved_tp} rank file(s); the experts alone "
                f"reshard across ep sizes)")


register_extension(QuantCheckpointExtension())

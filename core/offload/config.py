"""The ``offload=`` setting (ZeRO-Inference): where the weights live and how they stream in.

``offload={"device": "cpu" | "nvme", "nvme_path": DIR, "buffer_count": K, "pin_memory": bool}``
takes DeepSpeed's ``offload_param`` names. :func:`parse_offload` turns it into an
:class:`OffloadConfig` (every key used or refused by name); the checks below run before the
engine changes anything, in the order the engine can make them:

* :func:`check_offload` — the settings against the machine and the model, before any change:
  ``nvme_path`` exists, is a directory and is writable; the ``"cpu"`` tier only where the compute
  device has memory of its own; graphs only captured per layer, by a strategy that does not
  copy the weights; the model not already wholly on the device.
* :func:`check_space` — once the repacked size is known, before anything is written: the disk
  under ``nvme_path`` holds it.
* :func:`check_ring_fits` — once the largest unit is known: ``buffer_count`` slots of it fit the
  device's free memory.

Every error is an :class:`OffloadError` (a :class:`~shardwise.errors.ConfigError`) that says what
is wrong and what to do. This module imports no other part of :mod:`shardwise.offload`, so
:mod:`shardwise.config` can use it without importing the streaming machinery.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..accelerator import Accelerator


class OffloadError(ConfigError):
    """An ``offload=`` setting that is malformed, or does not fit this machine or model (the
    message says what to do)."""


#: The tiers: where the weights live between uses (DeepSpeed ``offload_param.device`` names).
OFFLOAD_DEVICES = ("cpu", "nvme")
#: DeepSpeed's ``device`` value for "no offload".
_NO_OFFLOAD = "none"
#: The fewest ring slots that let the next unit be read while one computes.
MIN_BUFFER_COUNT = 2
#: DeepSpeed ``offload_param`` keys shardwise does not take, and why (a value other than None is
#: refused with this reason).
_REFUSED_KEYS: dict[str, str] = {
    "buffer_size": "shardwise sizes each ring slot from the largest unit (a decoder layer or an "
                   "embedding), so every unit fits one slot; set buffer_count for the number "
                   "of slots",
    "max_in_cpu": "shardwise keeps everything it does not stream (norms, rotary tables, the KV "
                  "cache) resident, and streams every layer and embedding; there is no "
                  "partial host cache to size",
}


@dataclass(frozen=True)
class OffloadConfig:
    """The ``offload=`` config field, validated (the machine and model checks are
    :func:`check_offload`'s).

    Attributes:
        device: the tier the weights live in between uses. ``"cpu"``: (pinned) host memory,
            copied to an accelerator's memory layer by layer; only for a device with memory of
            its own. ``"nvme"``: files under ``nvme_path``, read with direct I/O into the ring
            (on a device that computes in host memory the ring IS the compute memory, so a model
            larger than RAM runs from disk).
        nvme_path: the directory the ``"nvme"`` tier keeps its files in (a subdirectory per
            model and settings); required for ``"nvme"``, refused for ``"cpu"``.
        buffer_count: ring slots K >= 2, each the size of the largest unit; units i+1..i+K-1
            are read while unit i computes. Peak resident weight memory is K slots.
        pin_memory: page-lock the host buffers that feed copies to an accelerator (the ``"cpu"``
            tier's blobs, the ``"nvme"`` tier's staging slots) for fast, asynchronous copies.
            A device that computes in host memory copies nothing, so it pins nothing.
    """

    device: str
    nvme_path: str | None = None
    buffer_count: int = 4
    pin_memory: bool = True

    def to_dict(self) -> dict[str, Any]:
        """DeepSpeed ``offload_param``-style dict (what :func:`parse_offload` reads back)."""
        return dataclasses.asdict(self)


_FIELDS = tuple(f.name for f in dataclasses.fields(OffloadConfig))


def parse_offload(value: Any) -> OffloadConfig | None:
    """``offload=`` as an :class:`OffloadConfig`: ``None`` or ``{"device": "none"}`` → None (off);
    a dict of DeepSpeed's ``offload_param`` names (``device``, ``nvme_path``, ``buffer_count``,
    ``pin_memory``) or an :class:`OffloadConfig` → the validated settings. ``buffer_size`` and
    ``max_in_cpu`` (DeepSpeed's) are refused by name with the reason, unless None.

    Raises:
        OffloadError: not a dict, an unknown or refused key, a malformed value, ``"nvme"``
            without ``nvme_path``, ``nvme_path`` with ``"cpu"``, ``buffer_count`` < 2, or
            ``device="none"`` together with other settings.
    """
    if value is None:
        return None
    if isinstance(value, OffloadConfig):
        value = value.to_dict()
    if not isinstance(value, Mapping):
        raise OffloadError(f"offload must be None or a dict like {{'device': 'nvme', "
                           f"'nvme_path': '/local_nvme'}} (DeepSpeed's offload_param), got "
                           f"{type(value).__name__} {value!r}")
    _refuse_keys(value)
    fields = {k: v for k, v in value.items() if k in _FIELDS}
    device = _offload_device(fields.get("device"))
    if device == _NO_OFFLOAD:
        _check_nothing_else(value, fields)
        return None
    settings = OffloadConfig(device=device,
                             nvme_path=_nvme_path(fields.get("nvme_path")),
                             buffer_count=_buffer_count(fields.get("buffer_count",
                                                                      OffloadConfig.buffer_count)),
                             pin_memory=_pin_memory(fields.get("pin_memory",
                                                               OffloadConfig.pin_memory)))
    _check_path_for_tier(settings)
    return settings


def _refuse_keys(value: Mapping) -> None:
    """Unknown keys (listing the known ones), and DeepSpeed's keys shardwise does not take."""
    for key in value:
        if key in _REFUSED_KEYS:
            if value[key] is not None:
                raise OffloadError(f"offload {key}={value[key]!r} is DeepSpeed's, and shardwise "
                                   f"does not take it: {_REFUSED_KEYS[key]}. Remove {key}")
        elif key not in _FIELDS:
            close = difflib.get_close_matches(str(key), _FIELDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise OffloadError(f"unknown offload field {key!r}{hint} (valid: "
                               f"{', '.join(_FIELDS)}: DeepSpeed's offload_param names)")


def _offload_device(value: Any) -> str:
    name = getattr(value, "value", value)  # DeepSpeed's OffloadDeviceEnum is a str enum
    if value is None:
        raise OffloadError(f"offload needs a device: {{'device': 'cpu'}} (weights in host memory, "
                           f"streamed to an accelerator) or {{'device': 'nvme', 'nvme_path': "
                           f"DIR}} (weights in files under DIR); valid devices: "
                           f"{', '.join(OFFLOAD_DEVICES)}, {_NO_OFFLOAD}")
    if name not in (*OFFLOAD_DEVICES, _NO_OFFLOAD):
        raise OffloadError(f"offload device must be one of {', '.join(OFFLOAD_DEVICES)} or "
                           f"{_NO_OFFLOAD!r} (no offload), got {value!r}")
    return str(name)


def _check_nothing_else(value: Mapping, fields: Mapping[str, Any]) -> None:
    """``device="none"`` turns offload off: other settings would be ignored, so they are refused."""
    defaults = OffloadConfig(device=_NO_OFFLOAD)
    extra = [k for k, v in fields.items()
             if k != "device" and v is not None and v != getattr(defaults, k)]
    if extra:
        raise OffloadError(f"offload={dict(value)!r} says device='none' (no offload) but sets "
                           f"{', '.join(extra)}; drop offload, or pick device 'cpu' or 'nvme'")


def _nvme_path(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise OffloadError(f"offload nvme_path must be a directory path (a non-empty string), "
                           f"got {value!r}")
    return os.path.expanduser(os.fspath(value))


def _buffer_count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < MIN_BUFFER_COUNT:
        raise OffloadError(f"offload buffer_count must be an integer >= {MIN_BUFFER_COUNT} (ring "
                           f"slots: one unit computes while the next ones are read), got "
                           f"{value!r}")
    return value


def _pin_memory(value: Any) -> bool:
    if not isinstance(value, bool):
        raise OffloadError(f"offload pin_memory must be True or False, got "
                           f"{type(value).__name__} {value!r}")
    return value


def _check_path_for_tier(settings: OffloadConfig) -> None:
    if settings.device == "nvme" and settings.nvme_path is None:
        raise OffloadError("offload device 'nvme' keeps the weights in files under nvme_path: "
                           "give nvme_path=DIR, a directory on a fast local disk")
    if settings.device != "nvme" and settings.nvme_path is not None:
        raise OffloadError(f"offload nvme_path={settings.nvme_path!r} is used only by device "
                           f"'nvme'; device {settings.device!r} keeps the weights in host memory. "
                           f"Drop nvme_path, or set device='nvme'")


# ----- the checks against the machine and the model -----------------------------------------------

def strategy_refusal(strategy: Any) -> str | None:
    """Why ``strategy`` (a :class:`~shardwise.GraphStrategy`) cannot capture an offloaded
    model's layers, or None when it can: its captured code must read the weights where they
    are (``weight_binding`` ``"inputs"``) or at the addresses it was captured with
    (``"addresses"``: one graph per ring slot); a strategy that keeps ``"copies"`` would hold
    every layer's weights resident inside its graphs. A strategy that captures nothing
    (``accelerates`` False) always can."""
    if not strategy.accelerates or strategy.weight_binding != "copies":
        return None
    return (f"enable_graph with offload: the graph strategy {strategy.name!r} ({strategy!r}) "
            f"keeps its own copy of the weights in its captured code (weight_binding="
            f"'copies'), so every layer's weights would stay resident inside the graphs and "
            f"offload would save nothing; use the accelerator's default graph strategy (it reads "
            f"the weights as inputs or at their addresses), or pass enable_graph=False")


def check_offload(settings: "OffloadConfig | Mapping | None", accelerator: "Accelerator",
                  model: "nn.Module | None", device: "torch.device", *,
                  enable_graph: bool) -> None:
    """Check ``offload=`` against this machine and ``model`` before anything is changed.

    Args:
        settings: the config's ``offload`` (re-validated here, so an :class:`OffloadConfig`
            built by hand is held to the same rules; None or ``device="none"``: nothing to
            check).
        accelerator: the accelerator the engine runs on.
        model: the model as handed to ``init_inference`` (real weights, on the meta device, or
            None when it is built from a checkpoint).
        device: the ``torch.device`` the layers compute on.
        enable_graph: the config's ``enable_graph`` (offloaded models capture it one layer at a
            time, :func:`shardwise.offload.graphs.enable_offload_graphs`: checked against the
            accelerator's strategy, :func:`strategy_refusal`).

    Raises:
        OffloadError: graphs asked for with a strategy that keeps copies of the weights; ``nvme_path`` missing, not a directory or not writable;
            the ``"cpu"`` tier on a device that computes in host memory; a model whose
            parameters are all on ``device`` already (nothing to stream from).
    """
    settings = parse_offload(settings)
    if settings is None:
        return
    refusal = strategy_refusal(accelerator.graph_strategy()) if enable_graph else None
    if refusal:
        raise OffloadError(refusal)
    if settings.nvme_path is not None:
        check_directory(settings.nvme_path)
    _check_tier(settings, accelerator)
    _check_model_not_on_device(model, accelerator, device)


def check_directory(path: str | os.PathLike) -> None:
    """``path`` exists, is a directory, and a file can be created in it (tried, then removed).

    Raises:
        OffloadError: naming the path, what is wrong and what to do.
    """
    shown = os.fspath(path)
    if not os.path.exists(shown):
        raise OffloadError(f"offload nvme_path {shown!r} does not exist; create the directory "
                           f"(on a fast local disk) or give an existing one")
    if not os.path.isdir(shown):
        raise OffloadError(f"offload nvme_path {shown!r} is not a directory; give the directory "
                           f"the weight files should go in")
    try:
        with tempfile.NamedTemporaryFile(dir=shown, prefix=".shardwise-write-test-"):
            pass
    except OSError as exc:
        raise OffloadError(f"offload nvme_path {shown!r} is not writable ({exc.strerror}); "
                           f"give a directory this process can create files in, or change its "
                           f"permissions") from None


def _check_tier(settings: OffloadConfig, accelerator: "Accelerator") -> None:
    """The ``"cpu"`` tier moves weights from host memory to a device's own memory: on a device
    that computes in host memory there is no such move to make."""
    if settings.device == "cpu" and accelerator.computes_in_host_memory:
        raise OffloadError(
            f"offload device 'cpu' keeps the weights in host memory and streams them to an "
            f"accelerator's memory, but the {accelerator.name!r} accelerator computes in host "
            f"memory: the weights are already there. Use offload={{'device': 'nvme', "
            f"'nvme_path': DIR}} to run a model larger than memory from disk, or drop offload")


def _check_model_not_on_device(model: "nn.Module | None", accelerator: "Accelerator",
                               device: "torch.device") -> None:
    """A model wholly in the device's own memory already fits it: offload would only stream it
    back out. (On a host-memory device the model being in host memory is the normal start.)"""
    if model is None or accelerator.computes_in_host_memory:
        return
    params = list(model.parameters())
    if params and all(p.device.type == device.type for p in params):
        nbytes = sum(p.numel() * p.element_size() for p in params)
        raise OffloadError(
            f"offload streams the weights to {device} from host memory or disk, but every "
            f"parameter of the model is on {device} already ({_size(nbytes)}); load the model on "
            f"the CPU (from_pretrained's default) or on the meta device with checkpoint=..., "
            f"and shardwise streams it from there")


def check_space(settings: OffloadConfig, nbytes: int) -> None:
    """The disk under ``nvme_path`` has ``nbytes`` free for the repacked weights; call it before
    writing anything. The ``"cpu"`` tier writes no files: nothing to check.

    Raises:
        OffloadError: with both sizes in GiB; also when ``nvme_path`` is missing.
    """
    if settings.nvme_path is None:
        return
    check_directory(settings.nvme_path)
    free = shutil.disk_usage(settings.nvme_path).free
    if free < nbytes:
        raise OffloadError(
            f"offload nvme_path {settings.nvme_path!r} has {_gib(free)} free, but the repacked "
            f"weights need {_gib(nbytes)} ({nbytes} bytes): free space there or pick another "
            f"nvme_path")


def check_ring_fits(accelerator: "Accelerator", device: "torch.device", largest_unit: str,
                    unit_bytes: int, buffer_count: int) -> None:
    """``buffer_count`` ring slots of ``unit_bytes`` (the largest unit's blob) fit the free memory
    of ``device``.

    Skipped on a device that computes in host memory (its ring is host memory, as small as the
    ring always is next to a model that needs offloading) and on an accelerator that does not
    report its free memory (``free_memory`` raises ``NotImplementedError``).

    Raises:
        OffloadError: naming the largest unit, the bytes the ring needs and what is free.
    """
    if accelerator.computes_in_host_memory:
        return
    try:
        free = accelerator.free_memory(device.index or 0)
    except NotImplementedError:
        return
    need = buffer_count * unit_bytes
    if need > free:
        raise OffloadError(
            f"the offload ring does not fit {device}: {buffer_count} slots of the largest unit "
            f"{largest_unit!r} ({_gib(unit_bytes)}, {unit_bytes} bytes each) need {_gib(need)} "
            f"({need} bytes) but {_gib(free)} ({free} bytes) is free; lower buffer_count (at least "
            f"{MIN_BUFFER_COUNT}), quantize the weights (quant=) or split them (tensor_parallel) "
            f"to shrink the layers")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _size(nbytes: int) -> str:
    """GiB from 1 GiB on, MiB below (a small model's size is not "0.00 GiB")."""
    return _gib(nbytes) if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"

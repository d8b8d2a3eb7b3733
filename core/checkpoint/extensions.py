"""What other transforms plug into the checkpoint loader and saver, without it knowing them.

Two seams, both opaque to :mod:`shardwise.checkpoint`:

* a **tensor hook** (:class:`TensorHook`), passed to ``load_checkpoint(..., hooks=[...])``: told
  before any data is read which tensors the load will read (:meth:`TensorHook.plan`, where it
  checks what it will take), then called with each tensor as this rank's slice of it is read
  (:meth:`TensorHook.on_tensor`); a tensor it takes is not assigned by the loader. Quantizing
  while reading (:mod:`shardwise.quant`) is one.
* a **checkpoint extension** (:class:`CheckpointExtension`), registered by name
  (:func:`register_extension`): the data it stores rides in the description's ``"extensions"``
  section (``{"extensions": {name: entry}}``) and in each rank file's metadata (key
  :data:`RANK_METADATA`: a JSON object ``{name: rank entry}``), together with tensors each rank
  stores whole in its own file (never merged or split, so such a checkpoint loads at its saved
  tp size). The checkpoint package only carries these entries and checks the tensors they name
  against the files' headers; the extension validates them and puts in the modules they load
  into. A quantized model's packed layers are one (``"shardwise.quant"``).

An extension named ``shardwise.<module>`` that is not registered yet is imported by that name
on first use (the module registers it); other names must be registered before loading.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .errors import CheckpointError

#: safetensors metadata key of a rank file's extension entries (JSON ``{name: entry}``)
RANK_METADATA = "shardwise_extensions"
#: description keys and rank-file metadata keys of files saved before the extensions section
#: existed → the extension their entry belongs to
#: a module attribute for a transform that holds the module's parameters in another layout (the
#: MoE kernels' stacked experts, converted in place from GPT-OSS's): a callable returning
#: {parameter name: the tensor in the module's own layout}, which save_checkpoint writes instead,
#: so the checkpoint loads into the model as built (the transform removes it when undone)
CHECKPOINT_VIEW = "_shardwise_checkpoint_view"
LEGACY_DESCRIPTION_KEYS = {"quant": "shardwise.quant"}
LEGACY_RANK_KEYS = {"shardwise_quant": "shardwise.quant"}
_IMPORTABLE = re.compile(r"shardwise(\.[a-z_][a-z0-9_]*)+")


@dataclass(frozen=True)
class TensorRef:
    """One tensor a load will read, as a hook sees it in :meth:`TensorHook.plan`.

    names: every state-dict name it goes by (more than one: tied); module: the name of the
    module owning ``names[0]``; param: its attribute there; shape: what this rank keeps of it;
    dtype: the model's dtype of it; is_buffer: a buffer, not a parameter.
    """

    names: tuple[str, ...]
    module: str
    param: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_buffer: bool


class TensorHook:
    """Called by the loader for the tensors it reads (module docstring). Subclass it."""

    #: the key of :meth:`finish`'s result in ``LoadReport.results``
    name: str = "hook"

    def plan(self, model: nn.Module, tensors: list[TensorRef]) -> None:
        """Before any data is read: every tensor the load reads. Raise to refuse the load."""

    def on_tensor(self, module_name: str, module: nn.Module, param: str,
                  tensor: torch.Tensor) -> bool:
        """``tensor``: this rank's slice of ``module_name.param`` just read (host memory,
        converted to the load dtype). Return True when the hook took it (the loader then does
        not assign it)."""
        return False

    def finish(self, model: nn.Module) -> Any:
        """After every tensor was read: what the hook reports (``LoadReport.results[name]``)."""
        return None


@dataclass(frozen=True)
class SavedEntries:
    """What an extension stores for one model: ``description`` (the description's entry, the
    same on every rank), ``rank`` (this rank's entry) and ``tensors`` (state-dict keys this rank
    stores whole in its own file). All JSON-serialisable."""

    description: Any
    rank: Any
    tensors: frozenset[str]


@dataclass(frozen=True)
class LoadContext:
    """What an extension is told when a checkpoint carrying it loads: ``source`` (the
    checkpoint, for messages), ``saved_tp`` (the ranks it was saved from: its rank files),
    ``tp_size`` (the ranks this load splits the model over: the tp size, or the ep size where
    experts are split over more) and ``rank`` (this load's), ``dtype`` (the compute dtype asked, None: not known yet) and
    ``hooks`` (the tensor hooks of this load)."""

    source: str
    saved_tp: int | None
    tp_size: int
    rank: int = 0
    dtype: torch.dtype | None = None
    hooks: tuple[TensorHook, ...] = ()


class CheckpointExtension:
    """Data a checkpoint carries for another transform (module docstring). Subclass it and
    :func:`register_extension` an instance. Every check raises the extension's own error
    (a :class:`CheckpointError` subclass, so callers' ``except CheckpointError`` still work)."""

    name: str = ""

    # ----- saving
    def save_entries(self, model: nn.Module) -> SavedEntries | None:
        """What this extension stores for ``model`` (None: nothing)."""
        return None

    # ----- loading, before any data is read
    def check_description(self, entry: Any, where: str) -> None:
        """Raise unless ``entry`` (the description's) is well-formed."""

    def check_load(self, entry: Any, context: LoadContext) -> None:
        """Raise unless the checkpoint can load as ``context`` asks (e.g. at its tp size)."""

    def rank_tensors(self, entry: Any, rank_entry: Any,
                     where: str) -> dict[str, tuple[list[int], str | None]]:
        """Check one rank file's entry against the description's; return the tensors that rank
        file must hold whole: key → (shape, dtype name; None: any floating dtype)."""
        return {}

    def split_tensors(self, entry: Any, rank_entries: list[Any]
                      ) -> dict[str, tuple[int, list[tuple[int, tuple[int, int]]]]]:
        """Of the tensors the rank files hold whole (:meth:`rank_tensors`), those that are dim-0
        slices of one whole tensor, e.g. the experts an expert-parallel save gave each rank:
        key → (the whole tensor's dim-0 size, [(file index, (start, stop)), ...] covering
        ``[0, size)``). ``rank_entries``: every rank file's entry, in file order. The loader then
        reads what each rank keeps of them (its experts: the sharding plan's range of the module
        owning the key; the whole tensor without a plan) from whichever files hold it, so they
        load at another split; the rest of the extension's tensors are read from the rank's own
        file (by a rank past the files of a one-file checkpoint: from that file; past the files
        of a split one: refused, they may be another rank's slices).
        Default: none (every tensor loads at the split it was saved with)."""
        return {}

    def install(self, model: nn.Module, entry: Any, rank_entry: Any,
                shapes: Mapping[str, tuple[int, ...]], context: LoadContext) -> Any:
        """Before the load plans its tensors: change ``model`` so its state dict holds this
        rank's tensors (e.g. put in modules on the meta device). ``shapes``: parameter name →
        the shape this rank keeps of it. Returns a state passed to :meth:`finish`. A failed load
        puts the model's modules back itself."""
        return None

    def finish(self, model: nn.Module, state: Any, context: LoadContext,
               device: torch.device) -> Any:
        """After every tensor was read: what the extension reports
        (``LoadReport.results[name]``)."""
        return None


_REGISTRY: dict[str, CheckpointExtension] = {}


def register_extension(extension: CheckpointExtension) -> CheckpointExtension:
    """Make ``extension`` known under ``extension.name`` (a later one replaces it)."""
    if not isinstance(extension, CheckpointExtension) or not extension.name:
        raise TypeError(f"register a named CheckpointExtension, got {extension!r}")
    _REGISTRY[extension.name] = extension
    return extension


def registered() -> list[CheckpointExtension]:
    """The extensions registered now (what :func:`save_checkpoint` asks for entries)."""
    return list(_REGISTRY.values())


def extension(name: Any, where: str) -> CheckpointExtension:
    """The extension called ``name`` (importing ``shardwise.<module>`` names on first use);
    :class:`CheckpointError` naming ``where`` when none is known."""
    if isinstance(name, str) and name not in _REGISTRY and _IMPORTABLE.fullmatch(name):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    found = _REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        raise CheckpointError(f"{where} carries data of the extension {name!r}, which no "
                              f"installed package provides (known: {sorted(_REGISTRY)}); "
                              f"install or import the package that saved it")
    return found


def rank_entries(metadata: Mapping[str, str], where: str,
                 parse: Callable[[str, str], Any]) -> dict[str, Any]:
    """A rank file's extension entries from its metadata (``parse(text, what)`` decodes one
    JSON value), legacy keys included."""
    out: dict[str, Any] = {}
    if RANK_METADATA in metadata:
        value = parse(metadata[RANK_METADATA], RANK_METADATA)
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: its {RANK_METADATA!r} metadata must be a JSON "
                                  f"object (extension name → entry); the file is corrupted")
        out.update(value)
    for key, name in LEGACY_RANK_KEYS.items():
        if key in metadata and name not in out:
            out[name] = parse(metadata[key], key)
    return out

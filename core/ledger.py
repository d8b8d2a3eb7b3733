"""A ledger of in-place changes to a module tree, so they can be undone exactly.

``init_inference`` transforms the user's model in place (load, shard, inject, quantize, cast,
capture: DESIGN.md "Reversibility"). It opens a :class:`Ledger` on the model before the first
change; if any step fails, :meth:`Ledger.restore` puts the model back as it was handed in and the
error is re-raised, so a retry starts from the same model. On success the engine keeps the
ledger when that costs no memory, and ``engine.close()`` restores it.

What the ledger records (a snapshot when it is opened, not a log of each call, so a transform
needs no bookkeeping of its own and nothing escapes the record by being forgotten):

* every submodule's instance ``__dict__``, shallow: attributes (``training``, an instance-level
  ``forward``, ``num_heads`` and other per-rank values, a replaced ``config``, markers such as
  ``_shardwise_quant_report``), and the contents of its containers (``_modules``,
  ``_parameters``, ``_buffers``, every forward/pre-hook dict …), which are restored *in place*
  so hook handles the user holds stay valid. Replaced or added modules, parameters, buffers and
  hooks therefore all come back as they were; modules a transform created simply drop out;
* every parameter's and buffer's tensor (its ``.data``: a cast or move that re-points an
  existing Parameter is undone) and each parameter's ``requires_grad``;
* the ``config`` / ``generation_config`` objects of the modules (``__dict__``, shallow), and any
  object passed to :meth:`Ledger.track`;
* undo callbacks for changes outside these objects (:meth:`Ledger.on_restore`).

Not recorded: writes into the storage of an existing tensor (``weight.copy_(...)``); no
transform does that. Holding the record keeps the original tensors alive:
:meth:`Ledger.held_bytes` says how many bytes the live model no longer shares with it.

Usage::

    ledger = Ledger(model)
    with ledger.rollback_on_error():   # restore, then re-raise
        transform(model)
    ...
    ledger.restore()                   # later: give the model back
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .errors import ShardwiseError

#: attributes of a module holding a plain (non-module) object the ledger also snapshots
CONFIG_ATTRS = ("config", "generation_config")


#: the ledger the transforms running now record into (``Ledger.recording``); None: a transform
#: called alone by a user, with nothing to record into
_ACTIVE: contextvars.ContextVar["Ledger | None"] = contextvars.ContextVar("shardwise_ledger",
                                                                         default=None)


def active() -> "Ledger | None":
    """The ledger recording the transforms that run now (None outside ``init_inference``)."""
    return _ACTIVE.get()


def record(what: str, undo: Callable[[], None]) -> None:
    """Record a change just made, with the call that undoes it, in the active ledger (a no-op
    when none is active: a transform called alone leaves undoing to its caller). ``what`` names
    the change in a :class:`RestoreError`. Undo calls run newest first."""
    ledger = _ACTIVE.get()
    if ledger is not None:
        ledger.on_restore(what, undo)


def set_forward(module: nn.Module, forward: Callable, what: str = "forward") -> None:
    """Give ``module`` an instance-level ``forward`` (instance-scoped: its class is untouched),
    recorded so that undoing removes it again (or puts back the instance forward it had)."""
    had = "forward" in vars(module)
    previous = vars(module).get("forward")
    module.forward = forward

    def undo() -> None:
        if had:
            module.forward = previous
        else:
            vars(module).pop("forward", None)
    record(f"{what} of {type(module).__name__}", undo)


def add_hook(handle: Any, what: str = "hook") -> Any:
    """Record a hook just registered (``handle`` as ``register_forward_hook`` and its kin
    return it): undoing removes it. Returns ``handle``."""
    record(what, handle.remove)
    return handle


def replace_module(parent: nn.Module, name: str, new: nn.Module, what: str = "module") -> None:
    """Put ``new`` at ``parent.<name>``, recorded: undoing puts the old module back."""
    old = parent._modules[name]
    parent._modules[name] = new

    def undo() -> None:
        parent._modules[name] = old
    record(f"{what} {name!r} ({type(old).__name__} -> {type(new).__name__})", undo)


class RestoreError(ShardwiseError, RuntimeError):
    """Part of a recorded state could not be put back (each failure is named)."""


def _copy_container(value: Any) -> Any:
    """A shallow copy of a dict / list / set (restored into the original object later)."""
    if isinstance(value, dict):
        return list(value.items())  # order kept; OrderedDict subclasses restored in place
    if isinstance(value, list):
        return list(value)
    return set(value)


def _refill(container: Any, saved: Any) -> None:
    """Put ``saved`` (from :func:`_copy_container`) back into ``container``, in place."""
    if isinstance(container, dict):
        container.clear()
        container.update(saved)
    elif isinstance(container, list):
        container[:] = saved
    else:
        container.clear()
        container.update(saved)


@dataclass
class _ObjectState:
    """One object's ``__dict__`` (shallow) and the contents of its containers."""

    obj: Any
    attrs: dict[str, Any]
    contents: dict[str, Any]

    @classmethod
    def of(cls, obj: Any) -> "_ObjectState":
        attrs = dict(vars(obj))
        contents = {k: _copy_container(v) for k, v in attrs.items()
                    if isinstance(v, (dict, list, set))}
        return cls(obj, attrs, contents)

    def restore(self) -> None:
        current = vars(self.obj)
        for key in [k for k in current if k not in self.attrs]:
            del current[key]
        current.update(self.attrs)  # raw: no Module.__setattr__ bookkeeping
        for key, saved in self.contents.items():
            _refill(self.attrs[key], saved)


@dataclass
class _TensorState:
    """A parameter or buffer and the tensor (``.data``) it held."""

    tensor: torch.Tensor
    data: torch.Tensor
    requires_grad: bool
    parameter: bool

    @classmethod
    def of(cls, tensor: torch.Tensor, parameter: bool) -> "_TensorState":
        return cls(tensor, tensor.data, tensor.requires_grad, parameter)

    def restore(self) -> None:
        t = self.tensor
        if not _same_tensor(t.data, self.data):
            try:
                t.data = self.data
            except RuntimeError:  # another tensor type (meta <-> a device): swap the impls
                fresh = (nn.Parameter(self.data, requires_grad=self.requires_grad)
                         if isinstance(t, nn.Parameter) else self.data.detach())
                torch.utils.swap_tensors(t, fresh)
        if self.parameter and t.requires_grad != self.requires_grad:
            t.requires_grad_(self.requires_grad)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same memory the same way (meta: same metadata)."""
    if a.device != b.device or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_meta:
        return a.stride() == b.stride()
    try:
        return (a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
                and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    except RuntimeError:  # a tensor without plain storage: re-point it anyway
        return False


def _storage_key(t: torch.Tensor) -> tuple | None:
    """(device, storage address) of a tensor holding memory; None for meta / empty ones (and
    tensors without plain storage)."""
    if t.is_meta:
        return None
    try:
        storage = t.untyped_storage()
    except RuntimeError:
        return None
    if storage.nbytes() == 0:
        return None
    return (str(t.device), storage.data_ptr())


def _has_dict(obj: Any) -> bool:
    """Whether ``obj`` has its own instance ``__dict__`` (not one a ``__getattr__`` forwards,
    as sharding's slotted ``ConfigView`` does)."""
    return type(obj).__dictoffset__ != 0


def _module_tensors(module: nn.Module) -> Iterator[tuple[torch.Tensor, bool]]:
    """(tensor, is_parameter) of the module's own parameters, buffers and tensor attributes."""
    for p in module._parameters.values():
        if p is not None:
            yield p, True
    for b in module._buffers.values():
        if b is not None:
            yield b, False
    for v in vars(module).values():
        if isinstance(v, torch.Tensor):
            yield v, False


class Ledger:
    """The recorded state of ``root`` and everything under it (module docstring).

    Opening one takes a snapshot; :meth:`restore` puts it back (it may be called more than
    once); :meth:`release` forgets it. Instance-scoped: nothing global is touched.
    """

    def __init__(self, root: nn.Module) -> None:
        if not isinstance(root, nn.Module):
            raise TypeError(f"a Ledger records an nn.Module, got {type(root).__name__}")
        self.root = root
        self._objects: list[_ObjectState] = []
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self._seen: set[int] = set()
        tensors: dict[int, _TensorState] = {}
        for module in root.modules():
            self._record(module)
            for t, is_param in _module_tensors(module):
                if id(t) not in tensors:
                    tensors[id(t)] = _TensorState.of(t, is_param)
            for attr in CONFIG_ATTRS:
                value = vars(module).get(attr)
                if value is not None and not isinstance(value, nn.Module) and _has_dict(value):
                    self.track(value)
        self._tensors: list[_TensorState] = list(tensors.values())

    def _record(self, obj: Any) -> None:
        if id(obj) not in self._seen:
            self._seen.add(id(obj))
            self._objects.append(_ObjectState.of(obj))

    @property
    def released(self) -> bool:
        return not self._objects

    def track(self, obj: Any) -> None:
        """Also record ``obj``'s ``__dict__`` (shallow), e.g. a config shared outside the tree."""
        if not _has_dict(obj):
            raise TypeError(f"cannot record a {type(obj).__name__}: it has no __dict__")
        self._record(obj)

    def on_restore(self, what: str, undo: Callable[[], None]) -> None:
        """Run ``undo`` at :meth:`restore` (after the recorded state is back; newest first), for
        a change the snapshot cannot see. ``what`` names it in a :class:`RestoreError`."""
        self._undo.append((what, undo))

    def restore(self) -> None:
        """Put every recorded object and tensor back, then run the undo callbacks.

        Raises:
            RestoreError: naming each piece that could not be restored (the others are).
        """
        failures = []
        for state in self._objects:
            try:
                state.restore()
            except Exception as exc:  # keep going: restore as much as possible
                failures.append(f"{type(state.obj).__name__}: {exc}")
        for state in self._tensors:
            try:
                state.restore()
            except Exception as exc:
                failures.append(f"tensor {tuple(state.data.shape)}: {exc}")
        for what, undo in reversed(self._undo):
            try:
                undo()
            except Exception as exc:
                failures.append(f"{what}: {exc}")
        if failures:
            raise RestoreError(f"{len(failures)} recorded change(s) could not be undone: "
                               + "; ".join(failures))

    def held_bytes(self) -> dict[str, int]:
        """Bytes the record keeps alive that the live model no longer holds: ``{"parameters":
        n, "buffers": m}`` (e.g. weights a transform sharded, quantized or cast)."""
        live = {key for module in self.root.modules()
                for t, _ in _module_tensors(module) if (key := _storage_key(t)) is not None}
        held: dict[tuple, tuple[str, int]] = {}
        for state in self._tensors:
            key = _storage_key(state.data)
            if key is not None and key not in live and key not in held:
                kind = "parameters" if state.parameter else "buffers"
                held[key] = (kind, state.data.untyped_storage().nbytes())
        out = {"parameters": 0, "buffers": 0}
        for kind, nbytes in held.values():
            out[kind] += nbytes
        return out

    def release(self) -> None:
        """Forget the record (and the references it holds); :meth:`restore` then does nothing."""
        self._objects, self._tensors, self._undo, self._seen = [], [], [], set()

    @contextlib.contextmanager
    def recording(self) -> Iterator["Ledger"]:
        """Within the block, :func:`record`, :func:`set_forward`, :func:`add_hook` and
        :func:`replace_module` record into this ledger (this thread and context only)."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @contextlib.contextmanager
    def rollback_on_error(self) -> Iterator["Ledger"]:
        """Within the block, any exception restores the record before it propagates (a failed
        restore is added to the exception as a note)."""
        try:
            yield self
        except BaseException as exc:
            try:
                self.restore()
            except RestoreError as failed:
                exc.add_note(f"shardwise could not fully restore the model: {failed}")
            raise

"""A ledger of in-place changes to a module tree, so they can be undone.

``init_inference`` transforms the user's model in place (load, shard, quantize, cast, inject,
capture; the transforms: docs/architecture.md). It opens a :class:`Ledger` on the model before the
first change and runs every transform inside :meth:`Ledger.recording`. The ledger has two parts:

**The snapshot**, taken when it is opened (so nothing escapes it by being forgotten):

* every submodule's instance ``__dict__``, shallow: attributes (``training``, an instance-level
  ``forward``, ``num_heads`` and other per-rank values, a replaced ``config``, markers such as
  ``_shardwise_quant_report``), and the contents of its containers (``_modules``,
  ``_parameters``, ``_buffers``, every forward/pre-hook dict …), which are restored *in place*
  so hook handles the user holds stay valid. Replaced or added modules, parameters, buffers and
  hooks therefore all come back as they were; modules a transform created simply drop out;
* every parameter's and buffer's tensor (its ``.data``: a cast or move that re-points an
  existing Parameter is undone) and each parameter's ``requires_grad``;
* the ``config`` / ``generation_config`` objects of the modules (``__dict__``, shallow), and any
  object passed to :meth:`Ledger.track`.

**The log**: each patch a transform makes, recorded as it is made with the call that undoes it
(:func:`record`, :func:`set_forward`, :func:`add_hook`, :func:`replace_module`): every hook,
instance-level forward and replaced module, and every weight replaced (sharded, quantized, cast,
laid out for a kernel) with an undo that rebuilds the original layout *from what the model then
holds* (all-gather the shards, dequantize, cast back, unblock), so no second copy of the weights
is needed to undo it.

The two serve the two ways a model is given back:

* a **failed** ``init_inference``: :meth:`Ledger.restore` puts the snapshot back, which still
  holds every original tensor, so the model comes back exactly, bit for bit, with no
  collective and nothing recomputed (the log's undos are not run: they may be collectives one
  failed rank would wait on forever, or lossy). :meth:`Ledger.rollback_on_error` does this.
* a **successful** one: at the end of init :meth:`Ledger.drop_replaced` lets go of the
  snapshot's parameters the live model no longer holds (memory then holds one copy of the
  model); ``engine.close()`` calls :meth:`Ledger.give_back`, which runs the log's undos newest
  first (they rebuild those weights), then puts the snapshot back for structure, then checks
  every weight it let go of was rebuilt: one that was not (a change with no recorded undo) is
  a :class:`NotRestorableError` naming it — never a wrong weight given back silently.

An undo that rebuilds a weight should re-point the original Parameter (``param.data =
rebuilt``): older undos (and the user's references) see the objects they know. One that puts a
new tensor at the weight's place is accepted too: :meth:`give_back` moves its data into the
original Parameter, since the snapshot puts the original objects back.

Not recorded by the snapshot: writes into the storage of an existing tensor
(``weight.copy_(...)``); no transform does that. Buffers and plain tensor attributes (small:
rotary tables, position ids) stay in the snapshot and come back exactly.

Usage::

    ledger = Ledger(model)
    with ledger.rollback_on_error(), ledger.recording():   # failure: restore, then re-raise
        transform(model)                                  # records its patches as it goes
    ledger.drop_replaced()                                # keep one copy of the weights
    ...
    ledger.give_back()                                    # later: undo, rebuild, check
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

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
    """Record a change to the module tree just made, with the call that undoes it, in the
    active ledger (a no-op when none is active: a transform called alone leaves undoing to its
    caller). ``what`` names the change in errors and in ``engine.close()``'s log; say there
    when the undo is lossy (e.g. "dequantized from int8"). Undos run newest first, at
    ``engine.close()`` only (a failed init restores from the snapshot instead: module
    docstring); a weight's undo should rebuild it into the original Parameter
    (``param.data = rebuilt``)."""
    ledger = _ACTIVE.get()
    if ledger is not None:
        ledger.log(what, undo)


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


class NotRestorableError(RestoreError):
    """The model cannot be given back as handed in: the named weights were changed by a step
    that recorded no undo for them (or whose undo did not rebuild them)."""


# ----- the snapshot -------------------------------------------------------------------------------


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


def _point(t: torch.Tensor, data: torch.Tensor, requires_grad: bool) -> None:
    """Re-point ``t`` (the same Python object) at ``data``."""
    try:
        t.data = data
    except RuntimeError:  # another tensor type (meta <-> a device): swap the impls
        fresh = (nn.Parameter(data, requires_grad=requires_grad)
                 if isinstance(t, nn.Parameter) else data.detach())
        torch.utils.swap_tensors(t, fresh)


@dataclass(eq=False)
class _TensorState:
    """A parameter or buffer and the tensor (``.data``) it held; after
    :meth:`Ledger.drop_replaced`, for a parameter the model no longer holds, only what it was
    (``data`` None; see :class:`_Dropped`)."""

    tensor: torch.Tensor
    data: torch.Tensor | None
    requires_grad: bool
    parameter: bool
    #: where the tensor sat in the tree when recorded: (module path, name) of each place
    places: list[tuple[str, str]] = field(default_factory=list)
    dropped: "_Dropped | None" = None

    @classmethod
    def of(cls, tensor: torch.Tensor, parameter: bool) -> "_TensorState":
        return cls(tensor, tensor.data, tensor.requires_grad, parameter)

    def restore(self) -> None:
        t = self.tensor
        if self.data is not None and not _same_tensor(t.data, self.data):
            _point(t, self.data, self.requires_grad)
        if self.parameter and t.requires_grad != self.requires_grad:
            t.requires_grad_(self.requires_grad)

    @property
    def name(self) -> str:
        return ".".join(p for p in self.places[0] if p) if self.places else "<unnamed tensor>"


@dataclass
class _Dropped:
    """What a parameter let go of by :meth:`Ledger.drop_replaced` was, to check it is rebuilt:
    its dtype, shape and device, and the tensors the model held in its place at the end of init
    (weak: a storage, its view), which an undo must have replaced."""

    dtype: torch.dtype
    shape: torch.Size
    device: torch.device
    left: list[tuple[StorageWeakRef, tuple]]

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} {list(self.shape)} on {self.device}"

    def rebuilt(self, t: torch.Tensor) -> str | None:
        """None when ``t`` looks like the original rebuilt, else why not."""
        if t.is_meta or (t.dtype, t.shape, t.device) != (self.dtype, self.shape, self.device):
            return (f"it holds {str(t.dtype).removeprefix('torch.')} {list(t.shape)} on "
                    f"{t.device}")
        view = _view_of(t)
        if view is not None and any(ref.cdata == view[0].cdata and shape == view[1]
                                    for ref, shape in self.left):
            return "it still holds what init_inference left there (no undo rebuilt it)"
        return None


def _view_of(t: torch.Tensor) -> tuple[StorageWeakRef, tuple] | None:
    """(weak reference to ``t``'s storage, (shape, stride, offset)); None without storage."""
    if t.is_meta:
        return None
    try:
        ref = StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None
    return ref, (tuple(t.shape), t.stride(), t.storage_offset())


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


def _module_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) of the module's own parameters, buffers and tensor
    attributes."""
    for name, p in module._parameters.items():
        if p is not None:
            yield name, p, True
    for name, b in module._buffers.items():
        if b is not None:
            yield name, b, False
    for name, v in vars(module).items():
        if isinstance(v, torch.Tensor):
            yield name, v, False


def _tensor_at(root: nn.Module, place: tuple[str, str]) -> torch.Tensor | None:
    """The parameter, buffer or tensor attribute at ``place`` (module path, name) of the tree as
    it is now; None when there is none."""
    path, name = place
    try:
        module = root.get_submodule(path)
    except AttributeError:
        return None
    for key, t, _ in _module_tensors(module):
        if key == name:
            return t
    return None


@dataclass
class _Undo:
    what: str
    fn: Callable[[], None]
    #: also run by :meth:`Ledger.restore` (a change outside the tree, which the snapshot
    #: cannot put back); else only by :meth:`Ledger.give_back`
    outside: bool


class Ledger:
    """The snapshot of ``root`` and everything under it, and the log of its patches (module
    docstring). Instance-scoped: nothing global is touched."""

    def __init__(self, root: nn.Module) -> None:
        if not isinstance(root, nn.Module):
            raise TypeError(f"a Ledger records an nn.Module, got {type(root).__name__}")
        self.root = root
        self._objects: list[_ObjectState] = []
        self._undo: list[_Undo] = []
        self._seen: set[int] = set()
        self._given_back = False
        tensors: dict[int, _TensorState] = {}
        for path, module in root.named_modules(remove_duplicate=False):
            self._record(module)
            for name, t, is_param in _module_tensors(module):
                state = tensors.get(id(t))
                if state is None:
                    state = tensors[id(t)] = _TensorState.of(t, is_param)
                state.places.append((path, name))
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

    @property
    def undos(self) -> list[str]:
        """What each recorded undo undoes, oldest first."""
        return [u.what for u in self._undo]

    def track(self, obj: Any) -> None:
        """Also record ``obj``'s ``__dict__`` (shallow), e.g. a config shared outside the tree."""
        if not _has_dict(obj):
            raise TypeError(f"cannot record a {type(obj).__name__}: it has no __dict__")
        self._record(obj)

    def log(self, what: str, undo: Callable[[], None]) -> None:
        """Record a patch of the tree and its undo (what :func:`record` does on the active
        ledger): run by :meth:`give_back`, newest first, before the snapshot is put back."""
        self._undo.append(_Undo(what, undo, outside=False))

    def on_restore(self, what: str, undo: Callable[[], None]) -> None:
        """Run ``undo`` whenever the model is given back — a failed init's :meth:`restore` and
        :meth:`give_back` — after the snapshot is back, newest first: for a change *outside*
        the module tree, which the snapshot cannot see. ``what`` names it in a
        :class:`RestoreError`."""
        self._undo.append(_Undo(what, undo, outside=True))

    # ----- a failed init --------------------------------------------------------------------------

    def restore(self) -> None:
        """Put the snapshot back (a failed init: every original tensor is still in it), then run
        the :meth:`on_restore` undos. The log's undos are not run: the snapshot already puts
        back everything they would, exactly, with no collective.

        Raises:
            RestoreError: naming each piece that could not be restored (the others are); also
                when :meth:`drop_replaced` let go of weights (use :meth:`give_back`).
        """
        dropped = [s.name for s in self._tensors if s.dropped is not None]
        if dropped:
            raise RestoreError(f"this record let go of {len(dropped)} replaced weights "
                               f"(drop_replaced); give_back() rebuilds them")
        failures = self._put_snapshot_back()
        failures += self._run(reversed([u for u in self._undo if u.outside]))
        if failures:
            raise RestoreError(f"{len(failures)} recorded change(s) could not be undone: "
                               + "; ".join(failures))

    def _put_snapshot_back(self) -> list[str]:
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
                failures.append(f"tensor {state.name}: {exc}")
        return failures

    @staticmethod
    def _run(undos) -> list[str]:
        failures = []
        for undo in undos:
            try:
                undo.fn()
            except Exception as exc:  # keep going: undo as much as possible
                failures.append(f"{undo.what}: {type(exc).__name__}: {exc}")
        return failures

    # ----- a successful init, and its close -------------------------------------------------------

    def drop_replaced(self) -> int:
        """Let go of the snapshot's parameters the live model no longer holds (sharded,
        quantized, cast, laid out anew: their recorded undos rebuild them), so memory holds
        one copy of the weights. An original Parameter the model no longer holds at all (a
        replaced module's, or one a new Parameter took the place of) is re-pointed at an empty
        tensor, which frees its data; :meth:`give_back` puts it back, rebuilt. Returns the
        bytes let go of. Buffers and meta tensors stay recorded (small, or nothing to free)."""
        live: dict[tuple, None] = {}
        in_tree: set[int] = set()
        for module in self.root.modules():
            for _, t, _ in _module_tensors(module):
                in_tree.add(id(t))
                if (key := _storage_key(t)) is not None:
                    live[key] = None
        freed: dict[tuple, int] = {}
        for state in self._tensors:
            key = _storage_key(state.data) if state.data is not None else None
            if not state.parameter or key is None or key in live:
                continue
            left = [v for place in state.places
                    if (now := _tensor_at(self.root, place)) is not None
                    and (v := _view_of(now)) is not None]
            data = state.data
            state.dropped = _Dropped(data.dtype, data.shape, data.device, left)
            state.data = None
            t = state.tensor
            if id(t) not in in_tree and _storage_key(t.data) not in live:
                t.data = data.new_empty(0)  # the model no longer uses it: let its data go
            freed[key] = data.untyped_storage().nbytes()
        return sum(freed.values())

    def give_back(self) -> None:
        """Give the model back (``engine.close()``): the log's undos newest first (they rebuild
        the weights :meth:`drop_replaced` let go of: all-gather, dequantize, cast back,
        unblock), then the snapshot for structure (the original module, parameter and buffer
        objects, hooks, attributes, configs), then the :meth:`on_restore` undos. Every weight
        let go of is checked: rebuilt in its original Parameter with its original dtype, shape
        and device. Under tensor parallelism the undos are collectives: every rank calls it.
        Calling it again does nothing.

        Raises:
            NotRestorableError: naming each weight no undo rebuilt (a step changed it without
                recording how to undo it); the rest of the model is back.
            RestoreError: naming each undo that failed (the others ran).
        """
        if self._given_back:
            return
        self._given_back = True
        # rebuilt weights are normal tensors, even when close() is called in inference mode
        with torch.inference_mode(False), torch.no_grad():
            failures = self._run(reversed([u for u in self._undo if not u.outside]))
            self._adopt_rebuilt()
            failures += self._put_snapshot_back()
            failures += self._run(reversed([u for u in self._undo if u.outside]))
        lost = self._not_rebuilt()
        if lost:
            raise NotRestorableError(
                f"{len(lost)} weight(s) cannot be given back as handed in: " + "; ".join(lost)
                + ". They were changed in place by a step that recorded no undo for them; the "
                "rest of the model is back. Reload the model to get them"
                + (f" (also failed: {'; '.join(failures)})" if failures else ""))
        if failures:
            raise RestoreError(f"{len(failures)} recorded change(s) could not be undone: "
                               + "; ".join(failures))

    def _adopt_rebuilt(self) -> None:
        """For each weight let go of: when an undo put a new tensor at its place instead of
        re-pointing the original Parameter, move that tensor's data into the original (the
        snapshot is about to put the original objects back)."""
        for state in self._tensors:
            if state.dropped is None:
                continue
            for place in state.places:
                now = _tensor_at(self.root, place)
                if now is None or now is state.tensor:
                    continue
                if state.dropped.rebuilt(now) is None:
                    _point(state.tensor, now.data, state.requires_grad)
                    break

    def _not_rebuilt(self) -> list[str]:
        """Each weight let go of that is not back as it was: its name, what it was, why."""
        lost = []
        for state in self._tensors:
            if state.dropped is not None:
                why = state.dropped.rebuilt(state.tensor)
                if why is not None:
                    lost.append(f"{state.name} (was {state.dropped.describe()}; {why})")
        return lost

    def holds_original(self, param: torch.Tensor) -> bool:
        """Whether ``param`` still holds the tensor recorded for it when this ledger opened."""
        return any(state.tensor is param and state.data is not None
                   and _same_tensor(param.data, state.data) for state in self._tensors)

    def original(self, param: torch.Tensor) -> torch.Tensor | None:
        """The tensor ``param`` held when this ledger opened, while the record still keeps it
        (until :meth:`drop_replaced`); None otherwise."""
        for state in self._tensors:
            if state.tensor is param and state.data is not None:
                return state.data
        return None

    def relocated(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """An undo moved ``old`` (what init left in the model) to ``new``, the same values,
        rebuilding nothing: ``new`` counts as what init left there, so :meth:`give_back` still
        names a weight no undo rebuilt (fused projections: :mod:`shardwise.inject.fuse`)."""
        before, after = _view_of(old), _view_of(new)
        if before is None or after is None:
            return
        for state in self._tensors:
            dropped = state.dropped
            if dropped is not None and any(ref.cdata == before[0].cdata and shape == before[1]
                                           for ref, shape in dropped.left):
                dropped.left.append(after)

    def held_bytes(self) -> dict[str, int]:
        """Bytes the record keeps alive that the live model no longer holds: ``{"parameters":
        n, "buffers": m}`` (e.g. weights a transform sharded, quantized or cast, until
        :meth:`drop_replaced`)."""
        live = {key for module in self.root.modules()
                for _, t, _ in _module_tensors(module) if (key := _storage_key(t)) is not None}
        held: dict[tuple, tuple[str, int]] = {}
        for state in self._tensors:
            if state.data is None:
                continue
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
        """Within the block, any exception restores the snapshot (:meth:`restore`) before it
        propagates (a failed restore is added to the exception as a note)."""
        try:
            yield self
        except BaseException as exc:
            try:
                self.restore()
            except RestoreError as failed:
                exc.add_note(f"shardwise could not fully restore the model: {failed}")
            raise

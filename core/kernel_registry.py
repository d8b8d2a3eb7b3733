"""The kernel interface: named ops, a torch reference for each, backends resolved per device.

An op (``rms_norm``, ``layer_norm``, ...) has a pure-torch reference in
``shardwise.kernels.reference`` (one module per op family) that is always present and is the
oracle in tests (tests/test_kernel_parity.py holds every backend to it). Backends
(``triton``, ``cpu``, a plugin's own) are modules in the ``shardwise.kernels`` entry-point group
with a ``register(registry)`` function; they are imported the first time an op is resolved for an
accelerator that lists them, never at ``import shardwise``. Resolution walks the accelerator's
ordered backends and takes the first implementation that accepts the device type, dtype and
shape.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from .errors import KernelError

if TYPE_CHECKING:
    from .accelerator import Accelerator

log = logging.getLogger(__name__)

REFERENCE = "reference"


@dataclass(frozen=True)
class KernelImpl:
    """One backend's implementation of one op, with the inputs it accepts."""

    op: str
    backend: str
    fn: Callable[..., Any]
    dtypes: frozenset[torch.dtype] | None = None  # None: any dtype
    device_types: frozenset[str] | None = None  # None: any device type
    supports: Callable[..., bool] | None = None  # extra shape/argument predicate
    #: may run inside the accelerator's graph capture although its contract takes per-sequence
    #: tensors (decode ``lengths``/``starts``): it reads them on the device (no host sync) or is
    #: an op the graph strategy treats as opaque; see :meth:`KernelRegistry.register`
    capturable: bool = False

    def accepts(self, device_type: str, dtype: torch.dtype, **shape: Any) -> bool:
        if self.device_types is not None and device_type not in self.device_types:
            return False
        if self.dtypes is not None and dtype not in self.dtypes:
            return False
        return self.supports is None or bool(self.supports(device_type=device_type, dtype=dtype,
                                                           **shape))

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class KernelRegistry:
    """Ops, their implementations by backend, and the resolution rule (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        """Forget every backend (references are re-registered on next use)."""
        with getattr(self, "_lock", threading.RLock()):
            self._impls: dict[str, dict[str, KernelImpl]] = {}
            self._loaded: dict[str, str] = {}  # backend -> "" when loaded, else its error
            self._warned: set[str] = set()

    # ----- registration ------------------------------------------------------------------------

    def register(self, op: str, backend: str, fn: Callable[..., Any], *,
                 dtypes: Iterable[torch.dtype] | None = None,
                 device_types: Iterable[str] | None = None,
                 supports: Callable[..., bool] | None = None,
                 capturable: bool = False) -> None:
        """Register ``fn`` as ``backend``'s implementation of ``op``.

        ``op`` must be one of the ops the reference defines. ``dtypes``/``device_types`` limit
        what the implementation accepts; ``supports(device_type=, dtype=, **shape)`` can refuse
        further (e.g. a hidden size too large for one block). ``capturable=True`` declares that
        ``fn`` may be called inside the device's graph capture with device-side ``lengths`` /
        ``starts`` (no host sync, no shape that depends on their values outside an opaque op):
        the injected decode step then calls it in its captured form, and otherwise falls back
        to a masked attention over the whole static cache.
        """
        self._ensure_reference()
        if backend != REFERENCE and op not in self._impls:
            raise KernelError(f"backend {backend!r} registers unknown op {op!r}; known ops: "
                              f"{', '.join(self.ops())}")
        impl = KernelImpl(op, backend, fn,
                          frozenset(dtypes) if dtypes is not None else None,
                          frozenset(device_types) if device_types is not None else None,
                          supports, capturable)
        self._impls.setdefault(op, {})[backend] = impl

    def ops(self) -> list[str]:
        """Names of all defined ops."""
        self._ensure_reference()
        return sorted(self._impls)

    def implementations(self, op: str) -> dict[str, KernelImpl]:
        """Backend name → implementation of ``op`` among the backends loaded so far."""
        self._ensure_reference()
        if op not in self._impls:
            raise KernelError(f"unknown kernel op {op!r}; known ops: {', '.join(self.ops())}")
        return dict(self._impls[op])

    # ----- loading backends --------------------------------------------------------------------

    def _ensure_reference(self) -> None:
        if REFERENCE not in self._loaded:
            self._loaded[REFERENCE] = ""
            importlib.import_module("shardwise.kernels.reference").register(self)

    def load_backend(self, backend: str) -> str:
        """Import backend ``backend`` from its entry point once; returns its error or ""."""
        with self._lock:
            self._ensure_reference()
            if backend in self._loaded:
                return self._loaded[backend]
            from .plugins import kernel_plugins

            record = kernel_plugins().get(backend)
            if record is None:
                error = f"no kernel backend {backend!r} is installed"
            elif not record.loaded:
                error = record.error
            else:
                try:
                    record.obj.register(self)
                    error = ""
                except Exception as exc:
                    error = f"register() raised {type(exc).__name__}: {exc}"
            self._loaded[backend] = error
            return error

    # ----- resolution --------------------------------------------------------------------------

    def resolve(self, op: str, accelerator: "Accelerator", dtype: torch.dtype,
                device_type: str | None = None, **shape: Any) -> KernelImpl:
        """First implementation of ``op`` in the accelerator's backend order that accepts the
        inputs. The reference accepts everything, so this fails only for an unknown op."""
        device_type = device_type or accelerator.device_type
        impls = self.implementations(op)
        for backend in accelerator.ordered_kernel_backends():
            error = self.load_backend(backend)
            if error:
                self._warn_once(backend, f"kernel backend {backend!r} unavailable, skipped: {error}")
                continue
            impl = self._impls[op].get(backend, impls.get(backend))
            if impl is not None and impl.accepts(device_type, dtype, **shape):
                return impl
        return self._impls[op][REFERENCE]

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


#: The process-wide registry.
registry = KernelRegistry()


def resolve(op: str, accelerator: "Accelerator", dtype: torch.dtype, **shape: Any) -> KernelImpl:
    """Shorthand for ``registry.resolve``."""
    return registry.resolve(op, accelerator, dtype, **shape)

"""Plugin discovery through entry points, loaded with stevedore.

Three groups exist (see DESIGN.md): ``shardwise.accelerators`` (Accelerator classes),
``shardwise.kernels`` (modules with a ``register(registry)`` function) and ``shardwise.policies``.
Built-ins register through the same groups as third parties. A plugin that fails to import never
breaks the others: its error is recorded and shown by ``shardwise accelerators``.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import os
from dataclasses import dataclass, field
from typing import Any

from stevedore import ExtensionManager

from .accelerator import PLUGIN_API_VERSION, Accelerator, Availability
from .errors import AcceleratorUnavailableError, PluginError

ACCELERATOR_GROUP = "shardwise.accelerators"
KERNEL_GROUP = "shardwise.kernels"
POLICY_GROUP = "shardwise.policies"
#: Environment variable naming the accelerator when ``device=`` is not given.
ACCELERATOR_ENV = "SHARDWISE_ACCELERATOR"
#: Distribution that ships the built-in plugins; every other distribution is a third party.
BUILTIN_DISTRIBUTION = "shardwise"


@dataclass
class PluginRecord:
    """One entry point of a plugin group: what it is, who ships it, and whether it loaded."""

    name: str
    group: str
    target: str  # "module:attr" as written in the entry point
    package: str  # distribution name and version, e.g. "shardwise 0.1.0"
    obj: Any = None  # the loaded class or module; None when loading failed
    error: str = ""  # why loading failed (import error, bad type, API mismatch)

    @property
    def loaded(self) -> bool:
        return self.obj is not None and not self.error

    @property
    def builtin(self) -> bool:
        return self.package.split(" ")[0] == BUILTIN_DISTRIBUTION


@dataclass
class PluginSet:
    """All entry points of one group, loaded or not."""

    group: str
    records: dict[str, PluginRecord] = field(default_factory=dict)

    def get(self, name: str) -> PluginRecord | None:
        return self.records.get(name)


@functools.cache
def _distributions(group: str) -> dict[tuple[str, str], str]:
    """(entry-point name, target) → "distribution version" for every entry point of ``group``."""
    owners = {}
    for dist in importlib.metadata.distributions():
        for ep in dist.entry_points.select(group=group):
            owners[(ep.name, ep.value)] = f"{dist.metadata['Name']} {dist.version}"
    return owners


def _package_of(entry_point) -> str:
    dist = getattr(entry_point, "dist", None)
    if dist is not None:
        return f"{dist.name} {dist.version}"
    return _distributions(entry_point.group).get((entry_point.name, entry_point.value), "unknown")


def _check_api_version(obj: Any, name: str, package: str) -> str:
    declared = getattr(obj, "plugin_api_version", getattr(obj, "PLUGIN_API_VERSION", None))
    if declared is None:
        return (f"plugin {name!r} ({package}) does not declare plugin_api_version; "
                f"add plugin_api_version = {PLUGIN_API_VERSION} for this shardwise")
    if declared != PLUGIN_API_VERSION:
        return (f"plugin {name!r} ({package}) was written for shardwise plugin API {declared}, "
                f"but this shardwise implements API {PLUGIN_API_VERSION}: install a version of "
                f"{package.split(' ')[0]} built for API {PLUGIN_API_VERSION}, or a shardwise "
                f"that implements API {declared}")
    return ""


class _IsolatingManager(ExtensionManager):
    """stevedore re-raises AssertionError from a plugin's import, which would break every other
    plugin; here it is recorded as that plugin's failure like any other exception."""

    def _load_one_plugin(self, ep, *args, **kwargs):
        try:
            return super()._load_one_plugin(ep, *args, **kwargs)
        except AssertionError as exc:
            self._on_load_failure_callback(self, ep, exc)
            return None


def load_group(group: str) -> PluginSet:
    """Load every entry point of ``group``; failures are recorded, never raised."""
    plugins = PluginSet(group)

    def on_failure(_manager, entry_point, exc) -> None:
        plugins.records[entry_point.name] = PluginRecord(
            entry_point.name, group, entry_point.value, _package_of(entry_point),
            error=f"{type(exc).__name__}: {exc}")

    manager = _IsolatingManager(namespace=group, invoke_on_load=False,
                                on_load_failure_callback=on_failure)
    for ext in manager.extensions:
        package = _package_of(ext.entry_point)
        record = PluginRecord(ext.name, group, ext.entry_point.value, package, obj=ext.plugin)
        record.error = _check_api_version(ext.plugin, ext.name, package)
        if not record.error and group == ACCELERATOR_GROUP:
            if not (isinstance(ext.plugin, type) and issubclass(ext.plugin, Accelerator)):
                record.error = f"{ext.entry_point.value} is not a shardwise.Accelerator subclass"
        plugins.records[ext.name] = record
    return plugins


@functools.cache
def accelerator_plugins() -> PluginSet:
    """The ``shardwise.accelerators`` group (cached; :func:`refresh_plugins` reloads)."""
    return load_group(ACCELERATOR_GROUP)


@functools.cache
def kernel_plugins() -> PluginSet:
    """The ``shardwise.kernels`` group (cached; :func:`refresh_plugins` reloads)."""
    return load_group(KERNEL_GROUP)


@functools.cache
def policy_plugins() -> PluginSet:
    """The ``shardwise.policies`` group (cached; :func:`refresh_plugins` reloads)."""
    return load_group(POLICY_GROUP)


def refresh_plugins() -> None:
    """Forget loaded plugins so the next lookup re-reads the installed entry points."""
    from .kernel_registry import registry

    for group in (ACCELERATOR_GROUP, KERNEL_GROUP, POLICY_GROUP):
        ExtensionManager.ENTRY_POINT_CACHE.pop(group, None)  # stevedore memoises per process
    importlib.invalidate_caches()
    for cached in (accelerator_plugins, kernel_plugins, policy_plugins, _availability,
                   _distributions):
        cached.cache_clear()
    registry.reset()


@functools.cache
def _availability(name: str) -> Availability:
    record = accelerator_plugins().get(name)
    try:
        return record.obj.availability()
    except Exception as exc:  # a plugin's probe must not break discovery
        return Availability(False, f"availability check raised {type(exc).__name__}: {exc}")


def _installed_names() -> str:
    return ", ".join(sorted(accelerator_plugins().records)) or "none"


def _unknown_device_error(name: str) -> PluginError:
    close = difflib.get_close_matches(name, accelerator_plugins().records, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return PluginError(f"unknown device {name!r}; installed accelerator plugins: "
                       f"{_installed_names()}.{hint} Run `shardwise accelerators` for details.")


def get_accelerator_class(name: str) -> type[Accelerator]:
    """The loaded Accelerator class named ``name``; raises if unknown, broken or unavailable."""
    record = accelerator_plugins().get(name)
    if record is None:
        raise _unknown_device_error(name)
    if not record.loaded:
        raise PluginError(f"accelerator plugin {name!r} ({record.package}) failed to load: "
                          f"{record.error}")
    status = _availability(name)
    if not status:
        raise AcceleratorUnavailableError(
            f"accelerator {name!r} ({record.package}) is installed but unavailable: {status.reason}")
    return record.obj


def _detect() -> str:
    """Pick the available plugin with the best (third-party, priority) rank."""
    ranked = []
    for name, record in accelerator_plugins().records.items():
        if record.loaded and _availability(name):
            ranked.append(((not record.builtin, record.obj.priority), name))
    if not ranked:
        raise PluginError("no accelerator plugin is available; run `shardwise accelerators` "
                          "to see each plugin's reason")
    ranked.sort(reverse=True)
    if len(ranked) > 1 and ranked[0][0] == ranked[1][0]:
        raise PluginError(
            f"accelerators {ranked[0][1]!r} and {ranked[1][1]!r} are both available with the "
            f"same priority; choose one with device= or {ACCELERATOR_ENV}")
    return ranked[0][1]


def resolve_accelerator_name(device: str | None = None) -> str:
    """The accelerator to use: ``device``, else ``$SHARDWISE_ACCELERATOR``, else detection."""
    if device:
        return device
    return os.environ.get(ACCELERATOR_ENV, "").strip() or _detect()


def get_accelerator(device: str | Accelerator | None = None) -> Accelerator:
    """An instance of the chosen accelerator (see :func:`resolve_accelerator_name`).

    ``device`` may be a plugin name (``"cuda"``), a torch-style string with an index
    (``"cuda:1"``: the index is dropped, rank binding chooses the device), or an instance.
    """
    if isinstance(device, Accelerator):
        return device
    name = resolve_accelerator_name(device).split(":")[0]
    return get_accelerator_class(name)()


def describe_accelerators() -> list[dict[str, Any]]:
    """One row per installed accelerator plugin, for ``shardwise accelerators`` and tests."""
    rows = []
    for name, record in sorted(accelerator_plugins().records.items()):
        row: dict[str, Any] = {"name": name, "package": record.package, "target": record.target,
                               "available": False, "reason": record.error, "devices": 0,
                               "backend": "", "dtypes": "", "kernel_backends": "", "notes": ""}
        if record.loaded:
            cls = record.obj
            status = _availability(name)
            row.update(available=status.ok, reason=status.reason,
                       backend=cls.communication_backend,
                       dtypes=",".join(str(d).removeprefix("torch.") for d in cls.supported_dtypes),
                       kernel_backends=",".join(cls().ordered_kernel_backends()))
            if status:
                acc = cls()
                row.update(devices=acc.device_count(), notes=acc.dtype_notes())
        rows.append(row)
    return rows

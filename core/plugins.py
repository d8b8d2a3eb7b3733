"""Plugin discovery through entry points, loaded with stevedore.

Three groups exist (docs/architecture.md, "How to add …"): ``shardwise.accelerators``
(Accelerator classes), ``shardwise.kernels`` (modules with a ``register(registry)`` function) and ``shardwise.policies``.
Built-ins register through the same groups as third parties. A plugin that fails to import never
breaks the others: its error (any exception, ``SystemExit`` included) is recorded and shown by
``shardwise accelerators``.

Two entry points of one group with the same name: the built-in one is kept, else the first found
(``sys.path`` order); the others are not imported, and each is reported (a warning in the log, a
``duplicates`` line under the kept plugin in ``shardwise accelerators``), so a third-party
package can never silently replace a built-in such as ``cpu``.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import logging
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

log = logging.getLogger(__name__)


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
        return _is_builtin_package(self.package)


@dataclass
class PluginSet:
    """All entry points of one group, loaded or not."""

    group: str
    records: dict[str, PluginRecord] = field(default_factory=dict)
    #: name → entry points of that name that were ignored because another one was kept (not
    #: imported; ``error`` says why each was ignored)
    duplicates: dict[str, list[PluginRecord]] = field(default_factory=dict)

    def get(self, name: str) -> PluginRecord | None:
        return self.records.get(name)

    def duplicate_notes(self, name: str) -> list[str]:
        """One line per ignored entry point named ``name`` (empty when the name is unique)."""
        return [dup.error for dup in self.duplicates.get(name, [])]


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


def _is_builtin_package(package: str) -> bool:
    return package.split(" ")[0] == BUILTIN_DISTRIBUTION


def _split_duplicates(entry_points: list, group: str) -> tuple[list, dict[str, list[PluginRecord]]]:
    """(entry points to load: one per name, the built-in where there is one, else the first
    found), and name → records of the ignored others, each with its reason in ``error``."""
    by_name: dict[str, list] = {}
    for ep in entry_points:
        by_name.setdefault(ep.name, []).append(ep)
    kept, ignored = [], {}
    for name, eps in by_name.items():
        packages = [_package_of(ep) for ep in eps]
        winner = next((i for i, p in enumerate(packages) if _is_builtin_package(p)), 0)
        kept.append(eps[winner])
        for i, ep in enumerate(eps):
            if i == winner:
                continue
            why = (f"{packages[i]} also declares {group} entry point {name!r} ({ep.value}); it "
                   f"is ignored and {packages[winner]}'s ({eps[winner].value}) is used"
                   + (" (the built-in is always kept)" if _is_builtin_package(packages[winner])
                      else " (first found on sys.path)")
                   + f": uninstall {packages[i].split(' ')[0]} or have it register under "
                     f"another name")
            ignored.setdefault(name, []).append(
                PluginRecord(name, group, ep.value, packages[i], error=why))
    return kept, ignored


class _IsolatingManager(ExtensionManager):
    """stevedore re-raises AssertionError from a plugin's import and lets SystemExit through,
    either of which would break every other plugin (a plugin calling ``sys.exit()`` at import
    would end every shardwise command); here each is recorded as that plugin's failure like any
    other exception. Entry points sharing a name are narrowed to one (:func:`_split_duplicates`)
    before anything is imported; the ignored ones are in ``duplicates``."""

    def __init__(self, namespace: str, **kwargs) -> None:
        self.duplicates: dict[str, list[PluginRecord]] = {}
        super().__init__(namespace=namespace, **kwargs)

    def list_entry_points(self):
        kept, self.duplicates = _split_duplicates(super().list_entry_points(), self.namespace)
        return kept

    def _load_one_plugin(self, ep, *args, **kwargs):
        try:
            return super()._load_one_plugin(ep, *args, **kwargs)
        except (AssertionError, SystemExit) as exc:
            self._on_load_failure_callback(self, ep, exc)
            return None


def load_group(group: str) -> PluginSet:
    """Load every entry point of ``group``; failures are recorded, never raised."""
    plugins = PluginSet(group)

    def on_failure(_manager, entry_point, exc) -> None:
        plugins.records[entry_point.name] = PluginRecord(
            entry_point.name, group, entry_point.value, _package_of(entry_point),
            error=_load_error_text(exc))

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
    plugins.duplicates = manager.duplicates
    for dups in plugins.duplicates.values():
        for dup in dups:
            log.warning("shardwise: %s", dup.error)
    return plugins


def _load_error_text(exc: BaseException, during: str = "while being imported") -> str:
    """What a failed import (or ``during`` another call) says, e.g. ``ImportError: libfoo.so:
    cannot open ...``."""
    if isinstance(exc, SystemExit):
        return (f"SystemExit({exc.code!r}): the plugin called sys.exit() {during}; "
                f"it is skipped (report this to its authors)")
    return f"{type(exc).__name__}: {exc}"


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
    except (Exception, SystemExit) as exc:  # a plugin's probe must not break discovery
        return Availability(False, f"availability check raised "
                                   f"{_load_error_text(exc, 'in its availability check')}")


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
                               "backend": "", "dtypes": "", "kernel_backends": "", "notes": "",
                               "duplicates": accelerator_plugins().duplicate_notes(name)}
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

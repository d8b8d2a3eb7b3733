"""Plugin discovery rules (docs/architecture.md, "How to add …"): choice of accelerator, unknown
names, broken plugins, API-version mismatches, third-party plugins from their own package, lazy runtimes.

Fake third-party plugins are real distributions: a ``*.dist-info`` folder (METADATA and
entry_points.txt) plus modules, written to a temporary folder put on ``sys.path``.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import stevedore._cache

from shardwise import (PLUGIN_API_VERSION, AcceleratorUnavailableError, PluginError,
                       describe_accelerators, get_accelerator, refresh_plugins)
from shardwise.cli import main as cli_main
from shardwise.kernel_registry import registry
from shardwise.plugins import (ACCELERATOR_ENV, ACCELERATOR_GROUP, KERNEL_GROUP,
                               accelerator_plugins, kernel_plugins)

EXAMPLE_ENV = "SHARDWISE_EXAMPLE_ENABLE"


@pytest.fixture
def plugin_env(monkeypatch, fresh_plugins):
    """No SHARDWISE_ACCELERATOR, example device disabled, plugins re-read; returns monkeypatch."""
    monkeypatch.delenv(ACCELERATOR_ENV, raising=False)
    monkeypatch.delenv(EXAMPLE_ENV, raising=False)
    refresh_plugins()
    return monkeypatch


@pytest.fixture
def example(plugin_env):
    """The installed example plugin's record; fails (never skips) when it is not installed."""
    record = accelerator_plugins().get("example")
    if record is None:
        pytest.fail("the example plugin is not installed; install it with "
                    "`pip install -e plugins/shardwise-example` (CI does)")
    return record


def enable_example(monkeypatch) -> None:
    monkeypatch.setenv(EXAMPLE_ENV, "1")
    refresh_plugins()  # availability is probed once per process; re-probe with the new env


@pytest.fixture
def install_fake(tmp_path, plugin_env):
    """A function installing a fake distribution: install(dist, {group: {name: target}},
    {module: source}, last=False). Each install gets its own folder, put first on sys.path
    (``last=True``: last, so it is found after the installed shardwise)."""
    monkeypatch = plugin_env
    # stevedore also caches entry points per sys.path in a file cache under ~/.cache; give this
    # test its own so nothing is written there. (refresh_plugins clears the in-process cache.)
    cache = stevedore._cache.Cache(cache_dir=str(tmp_path / "entry-point-cache"))
    monkeypatch.setattr(stevedore._cache, "get_group_all", cache.get_group_all)
    modules_added: list[str] = []

    def install(dist: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str],
                last: bool = False):
        root = tmp_path / dist
        root.mkdir()
        for module, source in modules.items():
            (root / f"{module}.py").write_text(textwrap.dedent(source))
            modules_added.append(module)
        _write_dist_info(root, dist, entry_points)
        if last:
            monkeypatch.setattr(sys, "path", [*sys.path, str(root)])
        else:
            monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()
        refresh_plugins()

    yield install
    for module in modules_added:
        sys.modules.pop(module, None)


def _write_dist_info(root: Path, dist: str, entry_points: dict[str, dict[str, str]]) -> None:
    info = root / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    sections = [f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in eps.items())
                for group, eps in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(sections))


def accelerator_source(*classes: tuple[str, str]) -> str:
    """Module source defining Accelerator subclasses: (class name, extra class-body line)."""
    lines = ["import torch", "from shardwise import Accelerator", ""]
    for cls, body in classes:
        lines += [f"class {cls}(Accelerator):", f"    name = {cls.lower()!r}",
                  "    device_type = 'cpu'", f"    {body or 'pass'}", ""]
    return "\n".join(lines)


def rows_by_name() -> dict[str, dict]:
    return {row["name"]: row for row in describe_accelerators()}


# ----- names ------------------------------------------------------------------------------------

def test_unknown_device_lists_installed_plugins_and_suggests(example):
    with pytest.raises(PluginError) as info:
        get_accelerator("exampel")
    message = str(info.value)
    assert "unknown device 'exampel'" in message
    installed = message.split("installed accelerator plugins: ")[1].split(".")[0].split(", ")
    assert {"cpu", "example"} <= set(installed), message
    assert "Did you mean 'example'?" in message


def test_unknown_device_without_close_name_gives_no_guess(plugin_env):
    with pytest.raises(PluginError) as info:
        get_accelerator("quantum-annealer")
    assert "Did you mean" not in str(info.value) and "cpu" in str(info.value)


# ----- the example plugin, from its own package --------------------------------------------------

def test_example_is_discovered_from_its_own_package(example, capsys):
    assert example.package.startswith("shardwise-example ") and not example.builtin
    assert example.target == "shardwise_example.accelerator:ExampleAccelerator"
    assert rows_by_name()["example"]["package"] == example.package
    assert cli_main(["accelerators"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("example "))
    assert "shardwise-example" in line


def test_example_unavailable_with_reason_by_default(example):
    with pytest.raises(AcceleratorUnavailableError, match=f"set {EXAMPLE_ENV}=1 to enable it"):
        get_accelerator("example")
    row = rows_by_name()["example"]
    assert not row["available"] and f"set {EXAMPLE_ENV}=1" in row["reason"]


def test_example_selectable_when_enabled(example, plugin_env):
    enable_example(plugin_env)
    accelerator = get_accelerator("example")
    assert type(accelerator) is example.obj and accelerator.device_type == "cpu"
    impl = registry.resolve("rms_norm", accelerator, accelerator.preferred_dtype)
    assert impl.backend == "example"  # its own kernel backend, loaded from its own entry point
    assert kernel_plugins().get("example").package.startswith("shardwise-example ")


# ----- choosing an accelerator -------------------------------------------------------------------

def test_detection_prefers_available_third_party_over_cpu(example, plugin_env):
    assert get_accelerator().name == "cpu"  # example disabled: the built-in
    enable_example(plugin_env)
    assert get_accelerator().name == "example"


def test_env_variable_selects_and_device_argument_wins(example, plugin_env):
    enable_example(plugin_env)
    plugin_env.setenv(ACCELERATOR_ENV, "cpu")
    assert get_accelerator().name == "cpu"  # beats detection, which would pick example
    assert get_accelerator("example").name == "example"  # device= beats the variable
    plugin_env.setenv(ACCELERATOR_ENV, "cpux")
    with pytest.raises(PluginError, match="Did you mean 'cpu'"):
        get_accelerator()


def test_two_available_third_parties_of_equal_priority_is_an_error(install_fake):
    install_fake("twin-vendor", {ACCELERATOR_GROUP: {"alpha": "twin_plugin:Alpha",
                                                     "beta": "twin_plugin:Beta"}},
                 {"twin_plugin": accelerator_source(("Alpha", ""), ("Beta", ""))})
    with pytest.raises(PluginError) as info:
        get_accelerator()
    message = str(info.value)
    assert "'alpha'" in message and "'beta'" in message and ACCELERATOR_ENV in message
    assert get_accelerator("beta").name == "beta"  # naming one still works


def test_higher_priority_third_party_wins(install_fake):
    install_fake("ranked-vendor", {ACCELERATOR_GROUP: {"low": "ranked_plugin:Low",
                                                       "high": "ranked_plugin:High"}},
                 {"ranked_plugin": accelerator_source(("Low", ""), ("High", "priority = 5"))})
    assert get_accelerator().name == "high"


# ----- broken plugins ---------------------------------------------------------------------------

BROKEN_MODULE = 'raise ImportError("libbroken.so: cannot open shared object file")\n'


def test_broken_plugin_is_isolated_and_reported(install_fake, capsys):
    install_fake("broken-vendor",
                 {ACCELERATOR_GROUP: {"broken": "broken_plugin:BrokenAccelerator"}},
                 {"broken_plugin": BROKEN_MODULE})
    records = accelerator_plugins().records
    assert not records["broken"].loaded and "libbroken.so" in records["broken"].error
    assert records["cpu"].loaded and get_accelerator("cpu").name == "cpu"
    assert get_accelerator().name == "cpu"  # detection skips the broken plugin

    row = rows_by_name()["broken"]
    assert row["package"] == "broken-vendor 1.0" and not row["available"]
    assert "ImportError: libbroken.so" in row["reason"]

    assert cli_main(["accelerators"]) == 0
    out = capsys.readouterr().out
    assert "broken-vendor 1.0" in out and "reason: ImportError: libbroken.so" in out

    with pytest.raises(PluginError, match="'broken' .* failed to load: ImportError: libbroken.so"):
        get_accelerator("broken")


def test_plugin_raising_assertion_error_on_import_is_isolated_too(install_fake):
    # stevedore re-raises AssertionError from an import; shardwise records it like any failure
    install_fake("assert-vendor", {ACCELERATOR_GROUP: {"asserts": "assert_plugin:Acc"}},
                 {"assert_plugin": "assert False, 'firmware table missing'\n"})
    records = accelerator_plugins().records
    assert "firmware table missing" in records["asserts"].error
    assert get_accelerator("cpu").name == "cpu"


def test_plugin_calling_sys_exit_on_import_is_isolated(install_fake, capsys):
    # SystemExit is no Exception: uncaught, it would end every shardwise command
    install_fake("quitting-vendor", {ACCELERATOR_GROUP: {"quitter": "quit_plugin:Acc"},
                                     KERNEL_GROUP: {"quitter": "quit_plugin"}},
                 {"quit_plugin": "import sys\nsys.exit('no licence server')\n"})
    records = accelerator_plugins().records
    assert not records["quitter"].loaded
    assert "SystemExit('no licence server')" in records["quitter"].error
    assert "sys.exit()" in records["quitter"].error
    assert "SystemExit" in kernel_plugins().get("quitter").error
    assert get_accelerator().name == "cpu"
    assert cli_main(["accelerators"]) == 0
    assert "reason: SystemExit('no licence server')" in capsys.readouterr().out


def test_plugin_calling_sys_exit_in_its_availability_probe_is_isolated(install_fake):
    install_fake("probe-vendor", {ACCELERATOR_GROUP: {"prober": "probe_plugin:Prober"}},
                 {"probe_plugin": accelerator_source(
                     ("Prober", "availability = classmethod(lambda cls: __import__('sys')"
                                ".exit(4))"))})
    row = rows_by_name()["prober"]
    assert not row["available"] and "availability check raised SystemExit(4)" in row["reason"]
    assert get_accelerator().name == "cpu"


# ----- two entry points with one name -----------------------------------------------------------

IMPOSTOR = ("class Impostor(Accelerator):\n    name = 'cpu'\n    device_type = 'cpu'\n"
            "    priority = 100\n")


@pytest.mark.parametrize("last", [False, True], ids=["first-on-path", "last-on-path"])
def test_third_party_cpu_never_replaces_the_builtin(install_fake, caplog, capsys, last):
    """A third party's ``cpu`` entry point, before or after shardwise on sys.path: the built-in
    is kept, the other is reported (log, ``shardwise accelerators``) and never imported."""
    install_fake("impostor-vendor", {ACCELERATOR_GROUP: {"cpu": "impostor_plugin:Impostor"}},
                 {"impostor_plugin": accelerator_source() + IMPOSTOR}, last=last)
    with caplog.at_level("WARNING", logger="shardwise.plugins"):
        plugins = accelerator_plugins()
    record = plugins.get("cpu")
    assert record.builtin and record.target == "shardwise.accelerators.cpu:CpuAccelerator"
    assert type(get_accelerator("cpu")).__module__ == "shardwise.accelerators.cpu"
    assert get_accelerator().name == "cpu" and "impostor_plugin" not in sys.modules
    (note,) = plugins.duplicate_notes("cpu")
    assert ("impostor-vendor 1.0 also declares shardwise.accelerators entry point 'cpu' "
            "(impostor_plugin:Impostor); it is ignored") in note
    assert "the built-in is always kept" in note and "uninstall impostor-vendor" in note
    assert note in caplog.text
    assert rows_by_name()["cpu"]["duplicates"] == [note]
    assert cli_main(["accelerators"]) == 0
    assert f"    duplicate: {note}" in capsys.readouterr().out


def test_two_third_parties_with_one_name_keep_the_first_and_report_the_other(install_fake):
    for vendor in ("first-vendor", "second-vendor"):
        module = vendor.replace("-", "_")
        install_fake(vendor, {ACCELERATOR_GROUP: {"npu": f"{module}:Npu"}},
                     {module: accelerator_source(("Npu", f"vendor = {vendor!r}"))}, last=True)
    record = accelerator_plugins().get("npu")
    assert record.package == "first-vendor 1.0" and record.obj.vendor == "first-vendor"
    (note,) = accelerator_plugins().duplicate_notes("npu")
    assert note.startswith("second-vendor 1.0 also declares") and "first found on sys.path" in note
    assert "second_vendor" not in sys.modules


def test_entry_point_to_a_non_accelerator_is_refused(install_fake):
    install_fake("odd-vendor", {ACCELERATOR_GROUP: {"odd": "odd_plugin:NotAnAccelerator"}},
                 {"odd_plugin": "class NotAnAccelerator:\n    plugin_api_version = 1\n"})
    with pytest.raises(PluginError, match="not a shardwise.Accelerator subclass"):
        get_accelerator("odd")


def test_plugin_api_version_mismatch_names_both_versions(install_fake):
    install_fake("future-vendor",
                 {ACCELERATOR_GROUP: {"future": "future_plugin:Future"},
                  KERNEL_GROUP: {"future": "future_kernels"}},
                 {"future_plugin": accelerator_source(("Future", "plugin_api_version = 99")),
                  "future_kernels": "PLUGIN_API_VERSION = 99\ndef register(registry):\n    pass\n"})
    with pytest.raises(PluginError) as info:
        get_accelerator("future")
    message = str(info.value)
    assert "written for shardwise plugin API 99" in message
    assert f"implements API {PLUGIN_API_VERSION}" in message and "future-vendor" in message
    assert "plugin API 99" in kernel_plugins().get("future").error
    assert "plugin API 99" in registry.load_backend("future")


# ----- lazy device runtimes ----------------------------------------------------------------------

def test_import_loads_no_device_runtime():
    code = ("import sys, shardwise\n"
            "shardwise.get_accelerator('cpu')\n"
            "loaded = sorted(m for m in sys.modules\n"
            "                if m.split('.')[0] in ('triton', 'habana_frameworks'))\n"
            "assert not loaded, f'device runtimes imported: {loaded}'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]

"""The accelerator conformance suite: built-ins and the example plugin pass it, and it catches
accelerators that are broken in each way it claims to check."""

from __future__ import annotations

import os

import pytest
import torch

from shardwise import (Accelerator, AcceleratorUnavailableError, Availability, GraphStrategy,
                       PluginError)
from shardwise.accelerators.cpu import CpuAccelerator
from shardwise.cli import main as cli_main
from shardwise.kernel_registry import registry
from shardwise.kernels import reference
from shardwise.plugins import accelerator_plugins
from shardwise.kernels.reference import examples
from shardwise.testing import (CHECKS, AcceleratorConformance, check_metadata,
                               run_conformance)

EXAMPLE_ENV = "SHARDWISE_EXAMPLE_ENABLE"
NOT_INSTALLED = ("the example plugin is not installed; install it with "
                 "`pip install -e plugins/shardwise-example` (CI does)")


# ----- the suite passes on real plugins --------------------------------------------------------

class TestCpuConformance(AcceleratorConformance):
    accelerator_name = "cpu"
    require_available = True  # the CPU is always there: never skip


class TestExampleConformance(AcceleratorConformance):
    accelerator_name = "example"
    accelerator_env = {EXAMPLE_ENV: "1"}
    require_available = True

    def setup_method(self, method=None):
        if accelerator_plugins().get("example") is None:
            pytest.fail(NOT_INSTALLED)
        super().setup_method(method)


def test_every_kernel_op_has_example_inputs():
    assert set(registry.ops()) <= set(examples()), (
        f"ops without conformance inputs: {set(registry.ops()) - set(examples())}")


# ----- the suite fails on broken accelerators ---------------------------------------------------

class ScaledGraph(GraphStrategy):
    """Returns wrong numbers."""

    name = "scaled"

    def capture(self, fn, *example_args):
        return lambda *args: fn(*args) * 1.5


class StaleGraph(GraphStrategy):
    """Replays the example call's result whatever the inputs (a graph not reading its inputs)."""

    name = "stale"

    def capture(self, fn, *example_args):
        result = fn(*example_args)
        return lambda *args: result


class WrongGraphCpu(CpuAccelerator):
    def graph_strategy(self):
        return ScaledGraph()


class StaleGraphCpu(CpuAccelerator):
    def graph_strategy(self):
        return StaleGraph()


class FutureApiCpu(CpuAccelerator):
    plugin_api_version = 2


class Fp8ClaimingCpu(CpuAccelerator):
    supported_dtypes = (torch.float32, torch.float8_e4m3fn)

    @property
    def preferred_dtype(self):
        return torch.float32


class FreeExceedsTotalCpu(CpuAccelerator):
    def free_memory(self, index=0):
        return self.total_memory(index) + 1


class NoMemoryQueriesCpu(CpuAccelerator):
    total_memory = Accelerator.total_memory  # the base class's: raises NotImplementedError
    free_memory = Accelerator.free_memory


class IntLaunchEnvCpu(CpuAccelerator):
    def launch_env(self, local_rank, local_world_size):
        return {"OMP_NUM_THREADS": 4}


# accelerator class -> {check expected to fail: fragment of its message}; every other check passes
BROKEN = {
    WrongGraphCpu: {"graph_strategy": "graph strategy 'scaled' result for new inputs"},
    StaleGraphCpu: {"graph_strategy": "graph strategy 'stale' result for new inputs"},
    FutureApiCpu: {"metadata": "plugin_api_version is 2"},
    Fp8ClaimingCpu: {"dtypes_compute": "supported dtype float8_e4m3fn cannot compute",
                     "kernel_parity": "in float8_e4m3fn"},
    FreeExceedsTotalCpu: {"memory": "is not within [0, total_memory(0)="},
    NoMemoryQueriesCpu: {"memory": "not implemented"},
    IntLaunchEnvCpu: {"launch_env": "non-string entries"},
}


@pytest.mark.parametrize("cls", BROKEN, ids=lambda cls: cls.__name__)
def test_run_conformance_reports_broken_accelerator(cls):
    results = run_conformance(cls())
    assert [r.name for r in results] == list(CHECKS)
    failed = {r.name: r.message for r in results if not r.passed}
    assert set(failed) == set(BROKEN[cls]), f"expected exactly {set(BROKEN[cls])} to fail: {failed}"
    for check, fragment in BROKEN[cls].items():
        assert fragment in failed[check], f"{check}: {failed[check]}"


def test_kernel_parity_catches_a_wrong_backend(monkeypatch, fresh_plugins):
    """A backend whose rms_norm drops the weight is caught, and named, by the parity check."""

    def rms_norm_without_weight(x, weight, eps, residual=None):
        return reference.rms_norm(x, torch.ones_like(weight), eps, residual)

    registry.register("rms_norm", "sloppy", rms_norm_without_weight)
    load_backend = registry.load_backend
    monkeypatch.setattr(registry, "load_backend",
                        lambda backend: "" if backend == "sloppy" else load_backend(backend))

    class SloppyKernelsCpu(CpuAccelerator):
        kernel_backends = ("sloppy",)

    failed = {r.name: r.message for r in run_conformance(SloppyKernelsCpu()) if not r.passed}
    assert set(failed) == {"kernel_parity"}, failed
    assert "rms_norm via backend 'sloppy'" in failed["kernel_parity"]


def test_unavailable_without_reason_fails_metadata():
    class Mute(CpuAccelerator):
        @classmethod
        def availability(cls):
            return Availability(False)

    with pytest.raises(AssertionError, match="without a reason"):
        check_metadata(Mute())


def test_run_conformance_refuses_what_it_cannot_test():
    with pytest.raises(PluginError, match="unknown device 'no-such-device'"):
        run_conformance("no-such-device")

    class Absent(CpuAccelerator):
        @classmethod
        def availability(cls):
            return Availability(False, "the absent runtime is missing")

    with pytest.raises(AcceleratorUnavailableError, match="the absent runtime is missing"):
        run_conformance(Absent)


# ----- the pytest base class --------------------------------------------------------------------

def test_base_class_skips_unavailable_and_restores_env(monkeypatch, fresh_plugins):
    monkeypatch.delenv(EXAMPLE_ENV, raising=False)
    monkeypatch.setenv("SHARDWISE_CONFORMANCE_PROBE", "before")

    class Disabled(AcceleratorConformance):
        accelerator_name = "example"
        accelerator_env = {"SHARDWISE_CONFORMANCE_PROBE": "during"}

    if accelerator_plugins().get("example") is None:
        pytest.fail(NOT_INSTALLED)
    with pytest.raises(pytest.skip.Exception, match=f"set {EXAMPLE_ENV}=1"):
        Disabled().setup_method()
    assert os.environ["SHARDWISE_CONFORMANCE_PROBE"] == "before"

    Disabled.require_available = True
    with pytest.raises(pytest.fail.Exception, match="require_available"):
        Disabled().setup_method()


def test_base_class_fails_for_unknown_or_unnamed_accelerator():
    class Unknown(AcceleratorConformance):
        accelerator_name = "no-such-device"

    class Unnamed(AcceleratorConformance):
        pass

    with pytest.raises(PluginError, match="unknown device"):
        Unknown().setup_method()
    with pytest.raises(pytest.fail.Exception, match="must set accelerator_name"):
        Unnamed().setup_method()


# ----- the CLI ----------------------------------------------------------------------------------

def test_cli_passes_for_cpu(capsys):
    assert cli_main(["conformance", "cpu"]) == 0
    out = capsys.readouterr().out
    assert all(f"PASS  {name}" in out for name in CHECKS), out
    assert f"{len(CHECKS)}/{len(CHECKS)} conformance checks passed for accelerator 'cpu'" in out


def test_cli_exits_1_on_a_failing_check(monkeypatch, capsys):
    monkeypatch.setattr(CpuAccelerator, "graph_strategy", lambda self: ScaledGraph())
    assert cli_main(["conformance", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  graph_strategy: graph strategy 'scaled'" in out
    assert "PASS  metadata" in out


def test_cli_reports_unavailable_accelerator(monkeypatch, fresh_plugins, capsys):
    monkeypatch.delenv(EXAMPLE_ENV, raising=False)
    if accelerator_plugins().get("example") is None:
        pytest.fail(NOT_INSTALLED)
    assert cli_main(["conformance", "example"]) == 2
    assert f"set {EXAMPLE_ENV}=1" in capsys.readouterr().err

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
from shardwise.communicator import TorchDistCommunicator
from shardwise.testing import (CHECKS, AcceleratorConformance, check_metadata, run_check,
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


#: every check but the 2-rank one (a process launch each time): the broken accelerators below
#: break nothing it looks at, and the real plugins above run it
IN_PROCESS = [name for name in CHECKS if name != "communicator_2_ranks"]


@pytest.mark.parametrize("cls", BROKEN, ids=lambda cls: cls.__name__)
def test_run_conformance_reports_broken_accelerator(cls):
    instance = cls()
    results = [run_check(name, instance) for name in IN_PROCESS]
    failed = {r.name: r.message for r in results if not r.passed}
    assert set(failed) == set(BROKEN[cls]), f"expected exactly {set(BROKEN[cls])} to fail: {failed}"
    for check, fragment in BROKEN[cls].items():
        assert fragment in failed[check], f"{check}: {failed[check]}"


class MixedUpCommunicator(TorchDistCommunicator):
    """gloo collectives with three mistakes a plugin's communicator could make."""

    def all_gather(self, tensor, dim=0):  # the ranks' parts in reverse order
        return super().all_gather(tensor, dim).flip(dim)

    def broadcast(self, tensor, src=0):  # always from rank 0
        return super().broadcast(tensor, 0)

    def all_reduce(self, tensor, op="sum"):  # returns a new tensor, leaving the input as it was
        return super().all_reduce(tensor.clone(), op)


class MixedUpCommCpu(CpuAccelerator):
    def communicator_class(self):
        return MixedUpCommunicator


def test_two_rank_check_catches_a_wrong_communicator():
    """Only on 2 ranks do these mistakes show (at world size 1 every collective is the
    identity): the 2-rank check names each broken collective, and only those."""
    assert run_check("communicator", MixedUpCommCpu()).passed  # world size 1 sees nothing
    result = run_check("communicator_2_ranks", MixedUpCommCpu())
    assert not result.passed
    broken = {"all_gather(dim=0)", "all_gather(dim=1)", "broadcast(src=1)",
              "all_reduce('sum') float32: the input tensor", "all_reduce('max') float32: the input"}
    for fragment in broken:
        assert fragment in result.message, (fragment, result.message)
    for fine in ("broadcast(src=0)", "barrier", "all_to_all", "setting up"):
        assert fine not in result.message, (fine, result.message)


def test_two_rank_check_is_skipped_where_a_node_hosts_one_rank():
    class OneRankCpu(CpuAccelerator):
        def max_ranks_per_node(self):
            return 1

    result = run_check("communicator_2_ranks", OneRankCpu())
    assert result.passed and result.message.startswith("skipped: one node hosts 1 rank")


def test_two_rank_check_needs_an_accelerator_it_can_send_to_the_ranks():
    class LocalCpu(CpuAccelerator):  # a class inside a function cannot be pickled
        pass

    result = run_check("communicator_2_ranks", LocalCpu())
    assert not result.passed and "define its class at module level" in result.message


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

    sloppy = SloppyKernelsCpu()
    results = [run_check(name, sloppy) for name in IN_PROCESS]
    failed = {r.name: r.message for r in results if not r.passed}
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
    monkeypatch.delitem(CHECKS, "communicator_2_ranks")  # test_cli_passes_for_cpu runs it
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

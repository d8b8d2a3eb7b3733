"""The built-in ``hpu`` accelerator against the Intel Gaudi bridge stand-in (tests/fake_habana/).

Each behaviour tested here is the bridge's (HabanaAI/gaudi-pytorch-bridge, read at commit
5a56187e; the file is named next to the test): the stand-in reproduces it, and the accelerator
must work with it. Calls are recorded by wrapping the stand-in's functions (monkeypatch).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.accelerators import hpu as hpu_mod
from shardwise.accelerators.hpu import (HpuAccelerator, HpuCompileStrategy, HpuGraphStrategy,
                                        HpuGraphUnavailableError, VisibleModulesError, lazy_mode)
from shardwise.communicator import TorchDistCommunicator
from shardwise.errors import ConfigError, UnsupportedDtypeError
from hpu_standin import standin  # noqa: F401  (fixture)

GiB = 1 << 30


def _gelu_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ w)


def _two_outputs(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x @ w
    return torch.nn.functional.gelu(y), y.sum(-1)


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 16, generator=g), torch.randn(16, 8, generator=g)


def _count_calls(monkeypatch, module, name: str) -> list:
    """Wrap ``module.name`` so each call appends its arguments to the returned list."""
    calls, original = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


# ----- availability, devices, memory, dtypes ---------------------------------------------------

def test_available_and_torch_hpu_registered(standin):
    assert HpuAccelerator.availability().ok
    acc = shardwise.get_accelerator("hpu")
    assert isinstance(acc, HpuAccelerator) and acc.device_count() == 8
    assert acc.module is torch.hpu is standin.bridge("habana_frameworks.torch.hpu")


def test_reports_no_device(standin, monkeypatch):
    hthpu = standin.bridge("habana_frameworks.torch.hpu")
    monkeypatch.setattr(hthpu, "is_available", lambda: False)
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "3")
    status = HpuAccelerator.availability()
    assert not status.ok and "no Gaudi device" in status.reason and "'3'" in status.reason


def test_bridge_built_for_another_torch_is_named(standin):
    # habana_frameworks/torch/__init__.py: major/minor of required_version.txt must match torch
    standin.set_required_torch("1.13.1")
    status = HpuAccelerator.availability()
    assert not status.ok
    assert "failed to import" in status.reason and "1.13.1" in status.reason
    assert "reinstall matching versions" in status.reason and "\n" not in status.reason


def test_one_device_per_process(standin):
    acc = HpuAccelerator()
    assert [acc.device(i) for i in (None, 0, 3)] == [torch.device("hpu")] * 3


def test_memory(standin, monkeypatch):
    acc = HpuAccelerator()
    assert (acc.total_memory(0), acc.free_memory(0), acc.peak_memory(0)) == (
        96 * GiB, 86 * GiB, 12 * GiB)
    resets = _count_calls(monkeypatch, standin.bridge("habana_frameworks.torch.hpu"),
                          "reset_peak_memory_stats")
    acc.reset_peak_memory(1)
    assert resets == [((1,), {})]


def test_pin_memory_pins_for_the_hpu(standin, monkeypatch):
    # DeepSpeed's hpu_accelerator.py: tensor.pin_memory(self.device())
    pinned_for = []

    def pin_memory(self, device=None):
        pinned_for.append(device)
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    acc, x = HpuAccelerator(), torch.ones(3)
    assert acc.pin_memory(x) is x and pinned_for == [torch.device("hpu")]
    assert acc.is_pinned(torch.ones(3)) is False
    # offload's host buffers are pinned the same way, at the size asked
    buf = acc.pinned_host_buffer(4096 + 5)
    assert buf.dtype == torch.uint8 and buf.numel() == 4096 + 5
    assert pinned_for == [torch.device("hpu")] * 2


def test_dtypes_and_gaudi1(standin, monkeypatch):
    acc = HpuAccelerator()
    assert acc.preferred_dtype is torch.bfloat16
    assert acc.supported_dtypes == (torch.bfloat16, torch.float32, torch.float16)
    monkeypatch.setattr(standin.bridge("habana_frameworks.torch.utils.experimental"),
                        "_is_fp16_supported", lambda: False)
    assert acc.supported_dtypes == (torch.bfloat16, torch.float32)
    with pytest.raises(UnsupportedDtypeError, match="no float16"):
        acc.check_dtype(torch.float16)
    assert "no fp16" in acc.dtype_notes()


# ----- lazy vs eager -----------------------------------------------------------------------------

@pytest.mark.parametrize("value, lazy", [("1", True), ("2", True), ("0", False)])
def test_lazy_mode_from_env_as_the_bridge(standin, monkeypatch, value, lazy):
    # utils/internal.py: is_lazy() is PT_HPU_LAZY_MODE != "0"
    monkeypatch.setenv("PT_HPU_LAZY_MODE", value)
    assert lazy_mode() is lazy
    assert standin.bridge("habana_frameworks.torch.utils.internal").is_lazy() is lazy


def test_lazy_mode_that_is_no_number_is_named(standin, monkeypatch):
    # distributed/hccl/__init__.py: int(os.environ.get("PT_HPU_LAZY_MODE", "1"))
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "true")
    with pytest.raises(ConfigError, match=r"PT_HPU_LAZY_MODE='true'.*set 1 .* or 0"):
        HpuAccelerator().launch_env(0, 1)
    status = HpuAccelerator.availability()
    assert not status.ok and "PT_HPU_LAZY_MODE='true'" in status.reason
    assert "habana_frameworks.torch" not in sys.modules  # refused before importing the bridge


def test_lazy_mode_unset_asks_the_runtime(standin, monkeypatch):
    monkeypatch.delenv("PT_HPU_LAZY_MODE")
    internal = standin.bridge("habana_frameworks.torch.utils.internal")
    assert lazy_mode() is True  # this bridge's default
    monkeypatch.setattr(internal, "is_lazy", lambda: False)  # a release that defaults to eager
    assert lazy_mode() is False


@pytest.mark.parametrize("lazy, strategy", [("1", HpuGraphStrategy), ("0", HpuCompileStrategy)])
def test_graph_strategy_follows_the_mode(standin, monkeypatch, lazy, strategy):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", lazy)
    hthpu = standin.bridge("habana_frameworks.torch.hpu")
    assert hasattr(hthpu, "HPUGraph") is (lazy == "1")  # hpu/__init__.py: lazy mode only
    assert type(HpuAccelerator().graph_strategy()) is strategy


def test_no_graphs_in_either_mode_is_one_named_line(standin, monkeypatch):
    hthpu = standin.bridge("habana_frameworks.torch.hpu")
    monkeypatch.delattr(hthpu, "HPUGraph")
    with pytest.raises(HpuGraphUnavailableError, match=r"lazy mode, but .* no hpu\.HPUGraph"):
        HpuAccelerator().graph_strategy()
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    from torch._dynamo.backends import registry

    # unregistered, and its module unimportable (the fixture's teardown forgets both)
    registry._COMPILER_FNS.pop("hpu_backend")
    registry._BACKENDS.pop("hpu_backend")
    sys.modules[hpu_mod._COMPILE_BACKEND_MODULE] = None
    with pytest.raises(HpuGraphUnavailableError) as info:
        HpuAccelerator().graph_strategy()
    assert "eager mode" in str(info.value) and "enable_graph=False" in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("lazy", ["1", "0"])
@pytest.mark.parametrize("fn", [_gelu_matmul, _two_outputs])
def test_graph_equals_eager_in_both_modes(standin, monkeypatch, lazy, fn):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", lazy)
    steps = _count_calls(monkeypatch, standin.bridge("habana_frameworks.torch.core"),
                         "mark_step")
    compiles = _count_calls(monkeypatch, torch, "compile")
    streams = _count_calls(monkeypatch, standin.bridge("habana_frameworks.torch.hpu"), "stream")
    strategy = HpuAccelerator().graph_strategy()
    strategy.device_type = "cpu"  # the stand-in computes on CPU tensors
    captured = strategy.capture(fn, *_inputs(0))
    first = None
    for seed in (1, 2):
        args = _inputs(seed)
        got = captured(*args)
        torch.testing.assert_close(got, fn(*args), rtol=0, atol=0)
        first = got if first is None else first
    assert first is got  # static outputs: overwritten by each replay
    if lazy == "1":  # HPU graph: a step before capture and before each replay, no compile
        assert len(steps) == 3 and compiles == []
        assert len(streams) == 1  # captured on a side stream
    else:  # eager: torch.compile with the bridge's backend, no mark_step
        assert steps == [] and [kw["backend"] for _, kw in compiles] == ["hpu_backend"]


def test_graph_rejects_new_shapes(standin):
    captured = HpuGraphStrategy(device_type="cpu").capture(_gelu_matmul, *_inputs(0))
    with pytest.raises(ValueError, match=r"expected shape \(16, 8\).*got shape \(16, 9\)"):
        captured(torch.zeros(4, 16), torch.zeros(16, 9))


# ----- start-up: launch variables, visible modules, hccl -----------------------------------------

def test_launch_env_leaves_the_module_list_alone(standin, monkeypatch):
    acc = HpuAccelerator()
    defaults = {"PT_HPU_LAZY_ACC_PAR_MODE": "0", "PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES": "0"}
    assert acc.launch_env(0, 1) == defaults
    both = [acc.launch_env(r, 2) for r in (0, 1)]
    assert both == [{**defaults, "PT_HPU_ENABLE_LAZY_COLLECTIVES": "true"}] * 2
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "4,5,6,7")
    assert "HABANA_VISIBLE_MODULES" not in acc.launch_env(3, 4)


def test_launch_env_lazy_collectives_rules(standin, monkeypatch):
    acc = HpuAccelerator()
    monkeypatch.setenv("WORLD_SIZE", "2")  # one rank per node on two nodes
    assert acc.launch_env(0, 1)["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "true"
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")  # eager: hccl takes its eager process group
    assert "PT_HPU_ENABLE_LAZY_COLLECTIVES" not in acc.launch_env(0, 1)
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    monkeypatch.setenv("PT_HPU_ENABLE_LAZY_COLLECTIVES", "false")  # the user's choice stands
    monkeypatch.setenv("PT_HPU_LAZY_ACC_PAR_MODE", "1")
    assert acc.launch_env(0, 2) == {"PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES": "0"}


def test_short_module_list_is_named(standin, monkeypatch):
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "2,3")
    with pytest.raises(VisibleModulesError, match=r"4 ranks per node .*'2,3' lists 2"):
        HpuAccelerator().launch_env(0, 4)
    with pytest.raises(VisibleModulesError):
        HpuAccelerator().configure_process(3, 4)
    assert "habana_frameworks.torch.distributed.hccl" not in sys.modules  # refused before


def test_narrowed_list_is_what_kills_later_ranks(standin, monkeypatch):
    # distributed/hccl/__init__.py: assert local_rank < len(HABANA_VISIBLE_MODULES list)
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "1")  # what narrowing gave rank 1
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(AssertionError, match="not enough devices"):
        standin.bridge("habana_frameworks.torch.distributed.hccl")


def test_configure_process_lets_hccl_choose_the_module(standin, monkeypatch):
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "4,5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    HpuAccelerator().configure_process(1, 2)
    hccl = sys.modules["habana_frameworks.torch.distributed.hccl"]
    assert os.environ["HLS_MODULE_ID"] == "5"  # LOCAL_RANK 1 -> second entry of the list
    assert os.environ["HABANA_VISIBLE_MODULES"] == "4,5"  # left as the user set it
    assert hccl._lazy_collectives_enabled  # set before the bridge was imported
    assert "hccl" in dist.Backend.backend_list


def test_configure_process_calls_no_set_device(standin, monkeypatch):
    hthpu = standin.bridge("habana_frameworks.torch.hpu")
    calls = _count_calls(monkeypatch, hthpu, "set_device")
    HpuAccelerator().configure_process(0, 1)
    assert calls == []


def test_bridge_imported_too_early_is_warned(standin, monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "2")
    standin.bridge()  # the script imported habana_frameworks before lazy collectives were set
    with caplog.at_level(logging.WARNING, logger="shardwise.accelerators.hpu"):
        HpuAccelerator().configure_process(0, 2)
    assert "PT_HPU_ENABLE_LAZY_COLLECTIVES=true" in caplog.text


# ----- collectives -------------------------------------------------------------------------------

@pytest.fixture
def hccl_world(tmp_path):
    """A one-rank process group on the stand-in's "hccl" backend (import hccl first)."""
    yield lambda: dist.init_process_group("hccl", init_method=f"file://{tmp_path / 'pg'}",
                                          rank=0, world_size=1)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_collectives_mark_no_step(standin, monkeypatch, hccl_world):
    acc = HpuAccelerator()
    acc.configure_process(0, 1)
    hccl_world()
    steps = _count_calls(monkeypatch, standin.bridge("habana_frameworks.torch.core"),
                         "mark_step")
    comm = acc.communicator_class()(acc, timeout_s=30, owns_group=False)
    assert type(comm) is TorchDistCommunicator
    assert torch.equal(comm.all_reduce(torch.ones(3)), torch.ones(3))
    comm.barrier()
    assert steps == []


def _all_reduce_twice(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    dist.all_reduce(y)
    return y


@pytest.mark.parametrize("lazy_collectives", [False, True])
def test_collective_in_hpu_graph_needs_lazy_collectives(standin, monkeypatch, hccl_world,
                                                        lazy_collectives):
    # ProcessGroupHCCL.cpp asserts on a collective captured without lazy collectives
    if lazy_collectives:
        monkeypatch.setenv("PT_HPU_ENABLE_LAZY_COLLECTIVES", "true")
    HpuAccelerator().configure_process(0, 1)
    hccl_world()
    strategy = HpuGraphStrategy(device_type="cpu")
    if not lazy_collectives:
        with pytest.raises(RuntimeError, match="PT_HPU_ENABLE_LAZY_COLLECTIVES=true before"):
            strategy.capture(_all_reduce_twice, torch.ones(2))
        return
    captured = strategy.capture(_all_reduce_twice, torch.ones(2))
    assert torch.equal(captured(torch.full((2,), 3.0)), torch.full((2,), 6.0))


# ----- two ranks through `shardwise launch` ------------------------------------------------------

RANK_SCRIPT = textwrap.dedent("""\
    import json, os, sys
    import torch
    import shardwise
    from shardwise.communicator import create_communicator

    acc = shardwise.get_accelerator()
    comm = create_communicator(acc)
    total = comm.all_reduce(torch.tensor([float(comm.rank + 1)])).item()
    hccl = sys.modules["habana_frameworks.torch.distributed.hccl"]
    names = ("HABANA_VISIBLE_MODULES", "HLS_MODULE_ID", "PT_HPU_ENABLE_LAZY_COLLECTIVES")
    record = {name: os.environ.get(name) for name in names}
    record.update(sum=total, backend=torch.distributed.get_backend(),
                  lazy_collectives=hccl._lazy_collectives_enabled, device=str(acc.device(1)))
    with open(os.path.join(sys.argv[1], f"rank{comm.rank}.json"), "w") as fh:
        json.dump(record, fh)
    comm.close()
""")


def _launch(standin, tmp_path, *extra: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "script.py").write_text(RANK_SCRIPT)
    base = {k: v for k, v in os.environ.items()
            if k not in ("SHARDWISE_ACCELERATOR", "SHARDWISE_LAUNCH_USER_ENV")}
    base["PYTHONPATH"] = os.pathsep.join([str(standin.root), base.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "shardwise.launch", "--nproc-per-node", "2", "--standalone",
           "--device", "hpu", *extra, "script.py", str(tmp_path)]
    return subprocess.run(cmd, cwd=tmp_path, env={**base, **env}, text=True, timeout=120,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_two_ranks_start_and_all_reduce(standin, tmp_path):
    import json

    run = _launch(standin, tmp_path)
    assert run.returncode == 0, run.stdout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["sum"] for r in ranks] == [3.0, 3.0]
    assert [r["HLS_MODULE_ID"] for r in ranks] == ["0", "1"]  # hccl: LOCAL_RANK -> module
    assert all(r["HABANA_VISIBLE_MODULES"] is None for r in ranks)  # never narrowed
    assert all(r["lazy_collectives"] and r["backend"] == "hccl" for r in ranks)
    assert all(r["device"] == "hpu" for r in ranks)


def test_launch_refuses_a_short_module_list_before_any_rank(standin, tmp_path):
    run = _launch(standin, tmp_path, HABANA_VISIBLE_MODULES="3")
    assert run.returncode == 2, run.stdout
    assert "HABANA_VISIBLE_MODULES='3'" in run.stdout and "Traceback" not in run.stdout
    assert not list(tmp_path.glob("rank*.json"))


def test_enable_graph_without_graphs_fails_before_the_model_is_touched(standin, monkeypatch):
    """init_inference asks the accelerator for its graph strategy with the other checks, so
    a mode with no HPU graphs is refused before any weight moves (the engine's ledger would
    undo it, but nothing should need undoing)."""
    import shardwise
    from models import tiny_causal_lm

    monkeypatch.delattr(standin.bridge("habana_frameworks.torch.hpu"), "HPUGraph")
    model = tiny_causal_lm("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moved = _count_calls(monkeypatch, torch.nn.Module, "to")
    with pytest.raises(HpuGraphUnavailableError, match="no hpu.HPUGraph"):
        shardwise.init_inference(model, device="hpu", dtype=torch.bfloat16,
                                 replace_with_kernel_inject=True, enable_graph=True)
    assert not moved
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

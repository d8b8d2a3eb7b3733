"""The built-in ``cuda`` and ``hpu`` accelerator plugins.

On a CPU-only machine: both report unavailable with a reason, importing them loads no device
runtime, and the CUDA decision logic runs against a patched ``torch.cuda``. Every HPU code path
runs against the Gaudi bridge stand-in (tests/fake_habana/) in tests/test_hpu_accelerator.py.
GPU tests (marked ``gpu``) exercise the real CUDA paths where a GPU exists.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch

import shardwise
from shardwise.accelerator import visible_device_for_rank
from shardwise.accelerators.cuda import CudaAccelerator, CudaGraphStrategy
from shardwise.graphs import StaticGraph
from shardwise.accelerators.hpu import HpuAccelerator
from shardwise.errors import ConfigError, UnsupportedDtypeError

HAS_CUDA = torch.cuda.is_available()
HAS_GAUDI_RUNTIME = importlib.util.find_spec("habana_frameworks") is not None


def _gelu_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ w)


def _two_outputs(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x @ w
    return torch.nn.functional.gelu(y), y.sum(-1)


def _inputs(seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(4, 16, generator=g).to(device),
            torch.randn(16, 8, generator=g).to(device))


# ----- (a), (b): unavailable here, with the reason ---------------------------------------------

@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is available here")
def test_cuda_unavailable_with_reason(fresh_plugins):
    status = CudaAccelerator.availability()
    assert not status.ok
    assert "CUDA" in status.reason
    with pytest.raises(shardwise.AcceleratorUnavailableError) as info:
        shardwise.get_accelerator("cuda")
    assert status.reason in str(info.value)


def test_cuda_reason_cpu_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    reason = CudaAccelerator.availability().reason
    assert "torch.version.cuda is None" in reason and "install a CUDA build" in reason


def test_cuda_reason_rocm_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    status = CudaAccelerator.availability()
    assert not status.ok and "ROCm" in status.reason and "6.2" in status.reason


def test_cuda_reason_no_visible_device(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    status = CudaAccelerator.availability()
    assert not status.ok
    assert "no CUDA device is visible" in status.reason
    assert "CUDA_VISIBLE_DEVICES='7'" in status.reason


@pytest.mark.skipif(HAS_GAUDI_RUNTIME, reason="the Intel Gaudi runtime is installed here")
def test_hpu_unavailable_without_runtime(fresh_plugins):
    status = HpuAccelerator.availability()
    assert not status.ok
    assert "habana_frameworks.torch" in status.reason and "habana-torch-plugin" in status.reason
    with pytest.raises(shardwise.AcceleratorUnavailableError) as info:
        shardwise.get_accelerator("hpu")
    assert status.reason in str(info.value)


# ----- (c): importing loads no device runtime --------------------------------------------------

def test_import_loads_no_device_runtime():
    code = textwrap.dedent("""
        import sys, torch
        import shardwise, shardwise.accelerators.cuda, shardwise.accelerators.hpu
        from shardwise.plugins import accelerator_plugins
        records = accelerator_plugins().records
        assert records["cuda"].loaded and records["hpu"].loaded, records
        records["cuda"].obj(), records["hpu"].obj()  # constructing must not touch a device
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("habana_frameworks", "triton"))
        print("LOADED", bad, torch.cuda.is_initialized())
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "LOADED [] False" in run.stdout, run.stdout


# ----- CUDA decisions, on a patched torch.cuda -------------------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch):
    """torch.cuda patched to report a visible GPU; set ``bf16`` / ``count`` / ``capability``."""
    state = {"bf16": True, "count": 2, "capability": (8, 0), "set_device": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: state["bf16"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: state["capability"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "set_device", state["set_device"].append)
    return state


def test_cuda_dtypes_ampere(fake_gpu):
    acc = CudaAccelerator()
    assert acc.supported_dtypes == (torch.float16, torch.bfloat16, torch.float32)
    assert acc.preferred_dtype is torch.bfloat16
    assert acc.check_dtype(torch.bfloat16) is torch.bfloat16
    assert "bf16 preferred" in acc.dtype_notes()


def test_cuda_refuses_bf16_before_ampere(fake_gpu):
    fake_gpu.update(bf16=False, capability=(7, 5))
    acc = CudaAccelerator()
    assert acc.supported_dtypes == (torch.float16, torch.float32)
    assert type(acc).supported_dtypes == (torch.float16, torch.bfloat16, torch.float32)
    assert acc.preferred_dtype is torch.float16
    with pytest.raises(UnsupportedDtypeError, match=r"compute capability 7\.5.*float16"):
        acc.check_dtype(torch.bfloat16)
    with pytest.raises(UnsupportedDtypeError, match="float64"):
        acc.check_dtype(torch.float64)


def test_visible_device_for_rank(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert CudaAccelerator().launch_env(1, 2) == {"CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3")
    assert [visible_device_for_rank("CUDA_VISIBLE_DEVICES", r, 2) for r in (0, 1)] == ["2", "3"]
    with pytest.raises(ConfigError, match=r"4 ranks per node.*lists 2"):
        CudaAccelerator().launch_env(0, 4)


def test_cuda_configure_process(fake_gpu):
    acc = CudaAccelerator()
    acc.configure_process(1, 2)
    assert fake_gpu["set_device"] == [1]
    with pytest.raises(ConfigError, match="only 2 CUDA devices are visible: each rank needs its own"):
        acc.configure_process(0, 4)
    fake_gpu["count"] = 1
    acc.configure_process(3, 4)  # already restricted to one GPU by the launcher
    assert fake_gpu["set_device"] == [1]


def test_cuda_graph_refuses_cpu_inputs():
    with pytest.raises(ValueError, match="not on a cuda device"):
        CudaGraphStrategy().capture(_gelu_matmul, *_inputs(0))


def test_static_graph_checks_arguments():
    inputs, calls = _inputs(0), []
    graph = StaticGraph(lambda: calls.append(1), inputs, torch.zeros(1))
    with pytest.raises(ValueError, match=r"expected shape \(4, 16\).*got shape \(5, 16\)"):
        graph(torch.zeros(5, 16), inputs[1])
    with pytest.raises(ValueError, match="got shape .*float64"):
        graph(inputs[0].double(), inputs[1])
    with pytest.raises(TypeError, match="captured with 2 arguments, called with 1"):
        graph(inputs[0])
    assert calls == []


# ----- (d): HPU paths run against the bridge stand-in: tests/test_hpu_accelerator.py ---------


# ----- (e): real CUDA ---------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_available_and_memory(fresh_plugins):
    assert CudaAccelerator.availability().ok
    acc = shardwise.get_accelerator("cuda")
    assert acc.device_count() >= 1
    total, free = acc.total_memory(0), acc.free_memory(0)
    assert 0 < free <= total
    acc.reset_peak_memory(0)
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    assert acc.peak_memory(0) >= x.numel()
    assert acc.preferred_dtype in acc.supported_dtypes
    assert acc.dtype_notes()


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [_gelu_matmul, _two_outputs])
def test_cuda_graph_equals_eager(fn):
    strategy = CudaAccelerator().graph_strategy()
    assert strategy.name == "cuda_graph" and strategy.accelerates
    captured = strategy.capture(fn, *_inputs(0, "cuda"))
    for seed in (1, 2):
        args = _inputs(seed, "cuda")
        got = captured(*args)
        got = got.clone() if isinstance(got, torch.Tensor) else tuple(t.clone() for t in got)
        torch.testing.assert_close(got, fn(*args))
    with pytest.raises(ValueError, match=r"expected shape \(4, 16\).*got shape \(8, 16\)"):
        captured(torch.zeros(8, 16, device="cuda"), _inputs(0, "cuda")[1])


@pytest.mark.gpu
def test_cuda_launch_env_and_conformance(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert CudaAccelerator().launch_env(0, 1) == {"CUDA_VISIBLE_DEVICES": "0"}
    from shardwise.testing.conformance import run_conformance

    failed = [r for r in run_conformance("cuda") if not r.passed]
    assert not failed, failed


def test_cpu_release_thread_pool_frees_the_calling_threads_openmp_workers():
    """After a 2-thread parallel op the calling thread holds one OpenMP worker; the release
    ends it (the process has one thread fewer) and the next parallel op makes it again. Run in
    a fresh interpreter: the test process's thread count is other tests' business."""
    script = textwrap.dedent("""
        import os, time, torch
        from shardwise.accelerators.cpu import CpuAccelerator
        torch.set_num_threads(2)
        count = lambda: len(os.listdir("/proc/self/task"))
        ints = torch.arange(1 << 22) % 7
        x = ints.float()  # every partial sum is an integer below 2**24: exact in any order
        x.sum()
        held = count()
        CpuAccelerator().release_thread_pool()
        deadline = time.monotonic() + 10
        while count() != held - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        released = count()
        assert x.sum().item() == ints.sum().item()  # a new pool computes
        print(held, released, count())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    held, released, again = map(int, out.stdout.split())
    assert released == held - 1, (held, released)
    assert again == held, (held, again)

"""The built-in ``cuda`` and ``hpu`` accelerator plugins.

On a CPU-only machine: both report unavailable with a reason, importing them loads no device
runtime, the CUDA decision logic runs against a patched ``torch.cuda``, and every HPU code path
runs against a fake ``habana_frameworks`` package written into ``tmp_path``. GPU tests (marked
``gpu``) exercise the real CUDA paths where a GPU exists.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.accelerator import visible_device_for_rank
from shardwise.accelerators.cuda import CudaAccelerator, CudaGraphStrategy
from shardwise.graphs import StaticGraph
from shardwise.accelerators.hpu import HpuAccelerator, HpuCommunicator, HpuGraphStrategy
from shardwise.errors import ConfigError, UnsupportedDtypeError

HAS_CUDA = torch.cuda.is_available()
#: A real Gaudi runtime must not be replaced by the fake (its C extension cannot be re-imported).
HAS_GAUDI_RUNTIME = importlib.util.find_spec("habana_frameworks") is not None
GiB = 1 << 30


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


# ----- (d): HPU paths against a fake habana_frameworks -----------------------------------------

FAKE_HPU = {
    "__init__.py": "",
    "torch/__init__.py": "from . import core, hpu, utils\n",
    "torch/core.py": """
        calls = []
        def mark_step():
            calls.append("mark_step")
    """,
    "torch/hpu/__init__.py": """
        import contextlib
        from torch.utils._python_dispatch import TorchDispatchMode
        from .. import core

        STATS = {"Limit": 96 * 2**30, "InUse": 10 * 2**30, "MaxInUse": 12 * 2**30}
        set_device_calls, reset_calls, graphs = [], [], []

        def is_available(): return True
        def device_count(): return 2
        def memory_stats(device=None): return dict(STATS)
        def reset_peak_memory_stats(device=None): reset_calls.append(device)
        def set_device(index): set_device_calls.append(index)
        def synchronize(): pass

        class Stream: pass
        current = []

        @contextlib.contextmanager
        def stream(s):
            current.append(s)
            try:
                yield
            finally:
                current.pop()

        class _Recorder(TorchDispatchMode):
            def __init__(self, ops):
                super().__init__()
                self.ops = ops
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                self.ops.append((func, args, kwargs or {}, out))
                return out

        class HPUGraph:
            '''Runs eagerly while capturing and records each op; replay re-runs them into the
            recorded output tensors, so stale inputs give stale results as on a device.'''
            def __init__(self):
                self.ops, self.log, self._mode = [], [], None
                graphs.append(self)
            def capture_begin(self, dry_run=False):
                self.log.append(("capture_begin", bool(current)))
                self._mode = _Recorder(self.ops)
                self._mode.__enter__()
            def capture_end(self):
                self._mode.__exit__(None, None, None)
                self.log.append(("capture_end", len(core.calls)))
            def replay(self, asynchronous=False):
                self.log.append(("replay", len(core.calls)))
                for func, args, kwargs, out in self.ops:
                    fresh = func(*args, **kwargs)
                    if isinstance(out, tuple):
                        for o, f in zip(out, fresh): o.copy_(f)
                    else:
                        out.copy_(fresh)
    """,
    "torch/utils/__init__.py": "from . import internal\n",
    "torch/utils/internal.py": """
        LAZY = True
        def is_lazy(): return LAZY
    """,
    "torch/utils/experimental.py": """
        FP16 = True
        def _is_fp16_supported(): return FP16
    """,
    "torch/distributed/__init__.py": "",
    "torch/distributed/hccl.py": "REGISTERED = True  # the real one registers 'hccl'\n",
}


def _forget_fake_modules() -> None:
    for name in [m for m in sys.modules if m.split(".")[0] == "habana_frameworks"]:
        del sys.modules[name]


@pytest.fixture
def fake_habana(tmp_path, monkeypatch, fresh_plugins):
    """A fake Gaudi runtime on sys.path; yields ``habana_frameworks.torch`` (as the fake)."""
    if HAS_GAUDI_RUNTIME:
        pytest.skip("the real Intel Gaudi runtime is installed; the fake would shadow it")
    for rel, text in FAKE_HPU.items():
        path = tmp_path / "habana_frameworks" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    _forget_fake_modules()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    for name in ("HABANA_VISIBLE_MODULES", "PT_HPU_ENABLE_LAZY_COLLECTIVES"):
        monkeypatch.delenv(name, raising=False)
    import habana_frameworks.torch as htorch

    yield htorch
    _forget_fake_modules()


def _mark_steps(htorch) -> int:
    return htorch.core.calls.count("mark_step")


def test_hpu_available_with_runtime(fake_habana):
    assert HpuAccelerator.availability().ok
    acc = shardwise.get_accelerator("hpu")
    assert isinstance(acc, HpuAccelerator) and acc.device_count() == 2
    assert acc.module is fake_habana.hpu  # torch.hpu is not registered by the fake


def test_hpu_reports_no_device(fake_habana, monkeypatch):
    monkeypatch.setattr(fake_habana.hpu, "is_available", lambda: False)
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "3")
    status = HpuAccelerator.availability()
    assert not status.ok and "no Gaudi device" in status.reason and "'3'" in status.reason


def test_hpu_memory(fake_habana):
    acc = HpuAccelerator()
    assert acc.total_memory(0) == 96 * GiB
    assert acc.free_memory(0) == 86 * GiB
    assert acc.peak_memory(0) == 12 * GiB
    acc.reset_peak_memory(1)
    assert fake_habana.hpu.reset_calls == [1]


def test_hpu_dtypes(fake_habana, monkeypatch):
    acc = HpuAccelerator()
    assert acc.preferred_dtype is torch.bfloat16
    assert acc.supported_dtypes == (torch.bfloat16, torch.float32, torch.float16)
    assert acc.check_dtype(torch.float16) is torch.float16
    import habana_frameworks.torch.utils.experimental as htexp

    monkeypatch.setattr(htexp, "FP16", False)
    assert acc.supported_dtypes == (torch.bfloat16, torch.float32)
    with pytest.raises(UnsupportedDtypeError, match="no float16"):
        acc.check_dtype(torch.float16)
    assert "no fp16" in acc.dtype_notes()


def test_hpu_launch_env(fake_habana, monkeypatch):
    acc = HpuAccelerator()
    assert acc.launch_env(0, 1) == {"HABANA_VISIBLE_MODULES": "0"}
    assert acc.launch_env(1, 2) == {"HABANA_VISIBLE_MODULES": "1",
                                    "PT_HPU_ENABLE_LAZY_COLLECTIVES": "true"}
    monkeypatch.setenv("HABANA_VISIBLE_MODULES", "4,5,6,7")
    monkeypatch.setenv("PT_HPU_ENABLE_LAZY_COLLECTIVES", "false")  # the user's choice stands
    assert [acc.launch_env(r, 4) for r in (0, 3)] == [{"HABANA_VISIBLE_MODULES": "4"},
                                                      {"HABANA_VISIBLE_MODULES": "7"}]


def test_hpu_configure_process(fake_habana):
    acc = HpuAccelerator()
    acc.configure_process(1, 2)
    assert "habana_frameworks.torch.distributed.hccl" in sys.modules
    assert fake_habana.hpu.set_device_calls == [1]
    with pytest.raises(ConfigError, match="only 2 Gaudi devices are visible: each rank needs its own"):
        acc.configure_process(0, 3)


def test_hpu_lazy_mode_from_runtime(fake_habana, monkeypatch):
    from shardwise.accelerators.hpu import lazy_mode

    monkeypatch.delenv("PT_HPU_LAZY_MODE")
    assert lazy_mode() is True
    monkeypatch.setattr(fake_habana.utils.internal, "LAZY", False)
    assert lazy_mode() is False
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    assert lazy_mode() is True


@pytest.fixture
def gloo_world(tmp_path):
    """A one-rank gloo process group, so a communicator runs real collectives."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("lazy, steps", [("1", 2), ("0", 0)])
def test_hpu_communicator_marks_step_in_lazy_mode(fake_habana, gloo_world, monkeypatch,
                                                  lazy, steps):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", lazy)
    acc = HpuAccelerator()
    assert acc.communicator_class() is HpuCommunicator
    comm = HpuCommunicator(acc, timeout_s=30, owns_group=False)
    x = torch.ones(3)
    assert torch.equal(comm.all_reduce(x), torch.ones(3))
    comm.barrier()
    assert _mark_steps(fake_habana) == steps


@pytest.mark.parametrize("lazy", ["1", "0"])
@pytest.mark.parametrize("fn", [_gelu_matmul, _two_outputs])
def test_hpu_graph_equals_eager(fake_habana, monkeypatch, lazy, fn):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", lazy)
    strategy = HpuAccelerator().graph_strategy()
    assert isinstance(strategy, HpuGraphStrategy) and strategy.accelerates
    strategy.device_type = "cpu"  # the fake runtime computes on CPU tensors
    captured = strategy.capture(fn, *_inputs(0))
    graph = fake_habana.hpu.graphs[-1]
    assert graph.log[0] == ("capture_begin", True)  # captured on a side stream
    first = None
    for seed in (1, 2):
        args = _inputs(seed)
        got = captured(*args)
        torch.testing.assert_close(got, fn(*args), rtol=0, atol=0)
        first = got if first is None else first
    assert first is got  # static outputs: overwritten by each replay
    assert [e[0] for e in graph.log].count("replay") == 2
    if lazy == "1":  # a step before capture and before each replay
        assert _mark_steps(fake_habana) == 3
    else:
        assert _mark_steps(fake_habana) == 0


def test_hpu_graph_rejects_new_shapes(fake_habana):
    strategy = HpuGraphStrategy(device_type="cpu")
    captured = strategy.capture(_gelu_matmul, *_inputs(0))
    with pytest.raises(ValueError, match=r"expected shape \(16, 8\).*got shape \(16, 9\)"):
        captured(torch.zeros(4, 16), torch.zeros(16, 9))


def test_hpu_graph_capture_error_is_explained(fake_habana, monkeypatch):
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "0")
    state = {"calls": 0}

    def breaks_in_capture(x):
        state["calls"] += 1
        if state["calls"] > 1:
            raise RuntimeError("op not supported during HPU Graph capturing")
        return x * 2

    with pytest.raises(RuntimeError, match=r"eager \(PT_HPU_LAZY_MODE=0\).*enable_graph=False"):
        HpuGraphStrategy(device_type="cpu").capture(breaks_in_capture, torch.ones(2))


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

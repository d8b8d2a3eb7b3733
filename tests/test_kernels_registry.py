"""The kernel registry: ops, dispatch order, dtype/device/shape support, errors, lazy imports.

Fresh ``KernelRegistry`` instances resolve each op for the CPU accelerator, a stand-in that
claims the cuda device type (resolution only, no launches) and accelerators whose backends are
missing. What the resolved kernels compute is tests/test_kernel_parity.py's business.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import subprocess
import sys

import pytest
import torch

from kernel_inputs import FakeCuda, quant_shape
from shardwise import Accelerator, KernelError
from shardwise.accelerators.cpu import CpuAccelerator
from shardwise.kernel_registry import KernelRegistry
from shardwise.kernels import cpu as cpu_backend
from shardwise.kernels import reference
from shardwise.kernels.cpu import norms as cpu_norms, quant as cpu_quant

NORMS = ("rms_norm", "layer_norm")
ATTENTION_OPS = ("rotary", "bias_gelu", "bias_relu", "silu_and_mul", "attention_prefill",
                 "attention_decode", "kv_cache_write")
DTYPES = [torch.float32, torch.bfloat16]


def _family_tables(package, table: str) -> dict:
    """op -> entry of every family module's ``table`` (``OPS`` or ``REGISTERED``)."""
    out = {}
    for family in package.FAMILIES:
        out.update(getattr(importlib.import_module(f"{package.__name__}.{family}"), table, {}))
    return out


REFERENCE_OPS = _family_tables(reference, "OPS")
CPU_REGISTERED = _family_tables(cpu_backend, "REGISTERED")


def test_every_backend_has_the_same_family_files():
    """One module per op family in every backend: the reference defines each family's ops in
    ``kernels/reference/<family>.py`` and each built-in backend registers its implementation of
    them from ``kernels/<backend>/<family>.py``."""
    reg = KernelRegistry()
    assert reg.load_backend("cpu") == ""
    if importlib.util.find_spec("triton") is not None:
        assert reg.load_backend("triton") == ""
    assert set(REFERENCE_OPS) == set(reg.ops())
    for family in reference.FAMILIES:
        for op in importlib.import_module(f"shardwise.kernels.reference.{family}").OPS:
            for backend, impl in reg.implementations(op).items():
                module = impl.fn.__module__  # a function's, or a kernel object's class's
                assert module == f"shardwise.kernels.{backend}.{family}", (op, backend, module)


class _FakeAccelerator(Accelerator):
    """A CPU device whose first kernel backend is not installed."""

    name = "fake-kernels"
    device_type = "cpu"
    kernel_backends = ("nope", "cpu")


def test_ops_lists_both_norms():
    assert set(NORMS) <= set(KernelRegistry().ops())


@pytest.mark.parametrize("op", NORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_accelerator_resolves_cpu_backend(op, dtype):
    impl = KernelRegistry().resolve(op, CpuAccelerator(), dtype)
    assert impl.backend == "cpu"
    assert impl.fn is getattr(cpu_norms, op)


@pytest.mark.parametrize("op", NORMS)
def test_unsupported_dtype_or_device_falls_back_to_reference(op):
    reg = KernelRegistry()
    # float64: the cpu backend does not claim it (the reference computes in float32).
    assert reg.resolve(op, CpuAccelerator(), torch.float64).backend == "reference"
    assert reg.resolve(op, CpuAccelerator(), torch.float32, device_type="meta").backend == \
        "reference"


def test_unknown_op_raises_kernel_error():
    reg = KernelRegistry()
    with pytest.raises(KernelError, match="no_such_op"):
        reg.resolve("no_such_op", CpuAccelerator(), torch.float32)
    with pytest.raises(KernelError, match="no_such_op"):
        reg.register("no_such_op", "mine", lambda x: x)


def test_missing_backend_is_skipped_with_one_warning(caplog):
    reg = KernelRegistry()
    with caplog.at_level(logging.WARNING, logger="shardwise.kernel_registry"):
        assert reg.resolve("rms_norm", _FakeAccelerator(), torch.float64).backend == "reference"
        assert reg.resolve("rms_norm", _FakeAccelerator(), torch.float32).backend == "cpu"
    warnings = [r for r in caplog.records if "'nope'" in r.getMessage()]
    assert len(warnings) == 1, caplog.text  # warned once, not per resolution


def test_supports_predicate_is_honoured():
    reg = KernelRegistry()
    assert reg.load_backend("cpu") == ""
    seen = []

    def small_rows_only(**kwargs):
        seen.append(kwargs)
        return kwargs["hidden"] <= 64

    # Replace the cpu backend's rms_norm (in this private registry only) by a guarded one.
    reg.register("rms_norm", "cpu", cpu_norms.rms_norm, supports=small_rows_only)
    assert reg.resolve("rms_norm", CpuAccelerator(), torch.float32, hidden=64).backend == "cpu"
    assert reg.resolve("rms_norm", CpuAccelerator(), torch.float32,
                       hidden=65).backend == "reference"
    assert seen[0] == dict(device_type="cpu", dtype=torch.float32, hidden=64)


@pytest.mark.parametrize("op", NORMS)
def test_triton_backend_registers_for_cuda_with_hidden_limit(op):
    pytest.importorskip("triton")
    from shardwise.kernels import triton as tri

    reg = KernelRegistry()
    acc = FakeCuda()
    assert reg.resolve(op, acc, torch.bfloat16, hidden=8192).backend == "triton"
    assert reg.resolve(op, acc, torch.bfloat16, hidden=32768).backend == "triton"
    assert reg.resolve(op, acc, torch.float32, hidden=32768).backend == "reference"
    assert reg.resolve(op, acc, torch.float64, hidden=64).backend == "reference"
    assert reg.resolve(op, CpuAccelerator(), torch.float32).backend == "cpu"  # not on cpu
    assert tri.max_hidden(torch.float32) == 16384


def test_every_attention_op_is_defined():
    reg = KernelRegistry()
    assert set(ATTENTION_OPS) <= set(reg.ops())
    for op in ATTENTION_OPS:
        assert reg.implementations(op)["reference"].fn is REFERENCE_OPS[op]


@pytest.mark.parametrize("op", ATTENTION_OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_resolution_follows_what_won(op, dtype):
    impl = KernelRegistry().resolve(op, CpuAccelerator(), dtype)
    fn, dtypes = CPU_REGISTERED.get(op, (None, frozenset()))
    assert impl.backend == ("cpu" if dtype in dtypes else "reference")
    assert impl.fn is (fn if dtype in dtypes else REFERENCE_OPS[op])
    assert KernelRegistry().resolve(op, CpuAccelerator(), torch.float64).backend == "reference"


def test_only_decode_and_chunk_attention_are_capturable():
    """The injected step calls attention_decode (and a served mixed step attention_chunks)
    inside graphs only where it says it may."""
    reg = KernelRegistry()
    for op in (*ATTENTION_OPS, "attention_chunks"):
        cpu_impl = reg.resolve(op, CpuAccelerator(), torch.float32)
        assert cpu_impl.capturable == (op in ("attention_decode", "attention_chunks"))
        assert not reg.implementations(op)["reference"].capturable  # host-side lengths


@pytest.mark.parametrize("op", (*ATTENTION_OPS, "attention_chunks"))
def test_cuda_resolves_triton(op):
    pytest.importorskip("triton")
    reg = KernelRegistry()
    impl = reg.resolve(op, FakeCuda(), torch.bfloat16, head_dim=128)
    assert impl.backend == "triton"
    # decode reads lengths, chunks their spans, on the device: a CUDA graph replays them
    assert impl.capturable == (op in ("attention_decode", "attention_chunks"))
    assert reg.resolve(op, FakeCuda(), torch.float64).backend == "reference"
    big = reg.resolve(op, FakeCuda(), torch.float16, head_dim=512).backend
    assert big == ("reference" if op.startswith("attention") else "triton")


def test_quant_linear_is_an_op():
    assert "quant_linear" in KernelRegistry().ops()


@pytest.mark.parametrize("shape,dtype,backend", [
    (quant_shape(8, 128), torch.bfloat16, "cpu"),  # per channel
    (quant_shape(8, 128, in_features=512), torch.bfloat16, "cpu"),  # 4 groups of 128
    (quant_shape(8, 16), torch.bfloat16, "cpu"),  # 8 kernel calls of 16 columns
    (quant_shape(4, 32), torch.bfloat16, "cpu"),
    (quant_shape(4, 128, symmetric=False), torch.bfloat16, "cpu"),
    (quant_shape(4, 512, in_features=512), torch.bfloat16, "cpu"),  # per channel via 256-subgroups
    # torch's int4 kernel takes groups of 32..256 and N % 16 == 0; the native kernel both
    (quant_shape(4, 16), torch.bfloat16, "native or reference"),
    (quant_shape(4, 32, out_features=40), torch.bfloat16, "native or reference"),
    # torch's kernels are scalar in fp32 (by 4 rows): only the native kernel claims fp32
    (quant_shape(8, 128), torch.float32, "native or reference"),
    (quant_shape(4, 32), torch.float16, "reference"),  # slower than the reference, not claimed
    ({}, torch.bfloat16, "reference"),  # no weight spec: no backend claims it
])
def test_cpu_resolution(shape, dtype, backend, monkeypatch):
    from shardwise.kernels.cpu import native

    if backend == "native or reference":
        monkeypatch.setenv(native.ENV, "torch")  # torch's kernels alone refuse it
        assert KernelRegistry().resolve("quant_linear", CpuAccelerator(), dtype,
                                        **shape).backend == "reference"
        monkeypatch.delenv(native.ENV)
        backend = "cpu" if native.load() else "reference"
    impl = KernelRegistry().resolve("quant_linear", CpuAccelerator(), dtype, **shape)
    assert impl.backend == backend
    if backend == "cpu":
        assert impl.fn is cpu_quant.quant_linear


def test_cuda_resolution_picks_triton():
    pytest.importorskip("triton")
    reg, acc = KernelRegistry(), FakeCuda()
    for dtype in (torch.float16, torch.bfloat16):
        assert reg.resolve("quant_linear", acc, dtype, **quant_shape(4, 16)).backend == "triton"
        assert reg.resolve("quant_linear", acc, dtype, **quant_shape(8, -1)).backend == "triton"
    assert reg.resolve("quant_linear", acc, torch.float32, **quant_shape(8, 128)).backend == \
        "reference"
    assert reg.resolve("quant_linear", acc, torch.float16,
                       **quant_shape(4, 33, in_features=66)).backend == "reference"  # odd group
    assert reg.resolve("quant_linear", acc, torch.float16).backend == "reference"


def test_resolving_on_cpu_imports_no_triton():
    """Neither ``import shardwise`` nor resolving any op on the CPU (quant_linear with its
    weight spec included) loads triton."""
    code = ("import sys, torch, shardwise\n"
            "from shardwise.kernel_registry import KernelRegistry\n"
            "from shardwise.accelerators.cpu import CpuAccelerator\n"
            "assert 'triton' not in sys.modules, 'import shardwise imported triton'\n"
            "reg, acc = KernelRegistry(), CpuAccelerator()\n"
            "assert reg.resolve('rms_norm', acc, torch.float32).backend == 'cpu'\n"
            "impl = reg.resolve('quant_linear', acc, torch.bfloat16, bits=4, group_size=32,"
            " symmetric=True, in_features=64, out_features=48)\n"
            "assert impl.backend == 'cpu', impl.backend\n"
            "for op in reg.ops():\n"
            "    reg.resolve(op, acc, torch.float32)\n"
            "assert 'triton' not in sys.modules, 'resolving on cpu imported triton'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr

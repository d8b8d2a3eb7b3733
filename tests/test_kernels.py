"""The kernel interface and the fused norm kernels.

(a) registry behaviour on fresh ``KernelRegistry`` instances; (b) the ``cpu`` backend against the
torch reference; (c) the Triton kernels under ``TRITON_INTERPRET=1`` (or on a GPU when present) on
tiny ragged shapes; (d) ``gpu``-marked tests: Triton through registry resolution on ``cuda`` at
model sizes.

Tolerances (``torch.testing.assert_close``: ``|a - b| <= atol + rtol * |b|``):
* fp32 1e-5: same float32 math, only the summation order differs;
* fp16 2e-3 and bf16 2e-2 (about two units in the last place): fused kernels may round at one
  point where the reference rounds at another (e.g. ``F.rms_norm`` multiplies by the weight before
  rounding, the reference after), which flips the last bit of some outputs.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from gpu import cuda_accelerator
from shardwise import Accelerator, KernelError
from shardwise.accelerators.cpu import CpuAccelerator
from shardwise.kernel_registry import KernelRegistry
from shardwise.kernels import cpu as cpu_backend
from shardwise.kernels import reference

OPS = ("rms_norm", "layer_norm")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
EPS = 1e-5


class _FakeAccelerator(Accelerator):
    """A CPU device whose first kernel backend is not installed."""

    name = "fake-kernels"
    device_type = "cpu"
    kernel_backends = ("nope", "cpu")


class _FakeCuda(Accelerator):
    """Claims the cuda device type without touching a GPU: resolution only, no launches."""

    name = "fake-cuda"
    device_type = "cuda"
    kernel_backends = ("triton",)


def _inputs(shape, dtype, device="cpu", seed=0):
    """x, residual: ``shape`` = [..., hidden]; weight, bias: [hidden]. x has a non-zero mean so
    layer_norm's centring matters; the weight is far from 1 so a dropped weight shows."""
    g = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    x = torch.randn(shape, generator=g) * 2 + 0.5
    residual = torch.randn(shape, generator=g)
    weight = torch.randn(hidden, generator=g) * 0.5 + 1
    bias = torch.randn(hidden, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (x, residual, weight, bias)]


def _call(impl, op, x, weight, bias, residual):
    """Run ``op`` through ``impl`` (a function) with the reference's signature."""
    if op == "rms_norm":
        return impl(x, weight, EPS, residual=residual)
    return impl(x, weight, bias, EPS, residual=residual)


def _check(got, want, x, residual, h_tol=None):
    """``got``/``want``: (out, h). h is x itself without a residual; with one it equals the
    reference exactly unless ``h_tol`` allows for a known rounding difference."""
    (out, h), (ref_out, ref_h) = got, want
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, ref_out, **TOL[x.dtype])
    if residual is None:
        assert h is x
    elif h_tol is None:
        assert torch.equal(h, ref_h)
    else:
        torch.testing.assert_close(h, ref_h, **h_tol)


# ----- (a) registry ---------------------------------------------------------------------------


def test_ops_lists_both_norms():
    assert set(OPS) <= set(KernelRegistry().ops())


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_accelerator_resolves_cpu_backend(op, dtype):
    impl = KernelRegistry().resolve(op, CpuAccelerator(), dtype)
    assert impl.backend == "cpu"
    assert impl.fn is getattr(cpu_backend, op)


@pytest.mark.parametrize("op", OPS)
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
    reg.register("rms_norm", "cpu", cpu_backend.rms_norm, supports=small_rows_only)
    assert reg.resolve("rms_norm", CpuAccelerator(), torch.float32, hidden=64).backend == "cpu"
    assert reg.resolve("rms_norm", CpuAccelerator(), torch.float32,
                       hidden=65).backend == "reference"
    assert seen[0] == dict(device_type="cpu", dtype=torch.float32, hidden=64)


@pytest.mark.parametrize("op", OPS)
def test_triton_backend_registers_for_cuda_with_hidden_limit(op):
    pytest.importorskip("triton")
    from shardwise.kernels import triton as tri

    reg = KernelRegistry()
    acc = _FakeCuda()
    assert reg.resolve(op, acc, torch.bfloat16, hidden=8192).backend == "triton"
    assert reg.resolve(op, acc, torch.bfloat16, hidden=32768).backend == "triton"
    assert reg.resolve(op, acc, torch.float32, hidden=32768).backend == "reference"
    assert reg.resolve(op, acc, torch.float64, hidden=64).backend == "reference"
    assert reg.resolve(op, CpuAccelerator(), torch.float32).backend == "cpu"  # not on cpu
    assert tri.max_hidden(torch.float32) == 16384


def test_import_shardwise_imports_no_triton():
    """Neither ``import shardwise`` nor resolving on the CPU loads triton."""
    code = ("import sys, torch, shardwise\n"
            "from shardwise.kernel_registry import KernelRegistry\n"
            "from shardwise.accelerators.cpu import CpuAccelerator\n"
            "assert 'triton' not in sys.modules, 'import shardwise imported triton'\n"
            "assert KernelRegistry().resolve('rms_norm', CpuAccelerator(), torch.float32)"
            ".backend == 'cpu'\n"
            "assert 'triton' not in sys.modules, 'resolving on cpu imported triton'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


# ----- (b) cpu backend vs reference -----------------------------------------------------------

CPU_SHAPES = [(1, 33), (3, 64), (7, 100), (2, 3, 100)]  # [..., hidden], ragged hidden sizes
CPU_DTYPES = sorted(cpu_backend.DTYPES, key=str)  # every dtype the backend claims


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_cpu_rms_norm_matches_reference(dtype, shape, with_residual):
    x, residual, weight, _ = _inputs(shape, dtype)
    residual = residual if with_residual else None
    _check(cpu_backend.rms_norm(x, weight, EPS, residual),
           reference.rms_norm(x, weight, EPS, residual), x, residual)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_cpu_layer_norm_matches_reference(dtype, shape, with_residual, with_bias):
    x, residual, weight, bias = _inputs(shape, dtype)
    residual = residual if with_residual else None
    bias = bias if with_bias else None
    _check(cpu_backend.layer_norm(x, weight, bias, EPS, residual),
           reference.layer_norm(x, weight, bias, EPS, residual), x, residual)


@pytest.mark.parametrize("op", OPS)
def test_cpu_backend_takes_float32_params_with_bf16_input(op):
    x, residual, weight, bias = _inputs((3, 40), torch.bfloat16)
    weight, bias = weight.float(), bias.float()
    _check(_call(getattr(cpu_backend, op), op, x, weight, bias, residual),
           _call(getattr(reference, op), op, x, weight, bias, residual), x, residual)


# ----- (c) triton kernels: interpreter on CPU, or the GPU when there is one --------------------

TRITON_SHAPES = [(1, 17), (3, 64), (2, 2, 96)]  # tiny: each program costs ms when interpreted
TRITON_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def tri(triton_device):
    """The triton backend module, and the device its kernels run on here."""
    device = triton_device
    from shardwise.kernels import triton as backend

    return backend, device


def _h_tol(dtype, device):
    """The interpreter rounds float32 → bf16 by truncation (a GPU rounds to nearest even), so
    its bf16 ``h`` may be one unit in the last place (2**-7 relative) off torch's ``x + r``."""
    if dtype == torch.bfloat16 and device == "cpu":
        return dict(atol=0.0, rtol=2.0**-7)
    return None


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("shape", TRITON_SHAPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_triton_rms_norm_matches_reference(tri, dtype, shape, with_residual):
    backend, device = tri
    x, residual, weight, _ = _inputs(shape, dtype, device)
    residual = residual if with_residual else None
    _check(backend.rms_norm(x, weight, EPS, residual),
           reference.rms_norm(x, weight, EPS, residual), x, residual, _h_tol(dtype, device))


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("shape", TRITON_SHAPES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_layer_norm_matches_reference(tri, dtype, shape, with_residual, with_bias):
    backend, device = tri
    x, residual, weight, bias = _inputs(shape, dtype, device)
    residual = residual if with_residual else None
    bias = bias if with_bias else None
    _check(backend.layer_norm(x, weight, bias, EPS, residual),
           reference.layer_norm(x, weight, bias, EPS, residual), x, residual,
           _h_tol(dtype, device))


@pytest.mark.parametrize("op", OPS)
def test_triton_strided_inputs(tri, op):
    """Rows with a pitch (views into a wider buffer) and a last dim that is not contiguous."""
    backend, device = tri
    wide, _, weight, bias = _inputs((3, 40), torch.float32, device)
    x = wide[:, :24]  # [3, 24], row stride 40: launched in place
    residual = _inputs((24, 3), torch.float32, device, seed=1)[0].t()  # [3, 24], stride (1, 3)
    weight, bias = weight[:24], bias[:24]
    _check(_call(getattr(backend, op), op, x, weight, bias, residual),
           _call(getattr(reference, op), op, x, weight, bias, residual), x, residual)


def test_triton_refuses_rows_beyond_one_block(tri):
    backend, device = tri
    x = torch.zeros(1, backend.max_hidden(torch.bfloat16) + 1, dtype=torch.bfloat16,
                    device=device)
    with pytest.raises(KernelError, match="hidden size"):
        backend.rms_norm(x, x[0], EPS)
    assert not backend.supports_hidden(device_type="cuda", dtype=torch.bfloat16,
                                       hidden=x.shape[-1])


def test_triton_empty_input(tri):
    backend, device = tri
    x = torch.zeros(0, 64, device=device)
    out, h = backend.rms_norm(x, torch.ones(64, device=device), EPS, residual=x.clone())
    assert out.shape == h.shape == (0, 64)


# ----- (d) GPU: triton through registry resolution at model sizes -----------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [4096, 8192])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("with_residual", [True, False])
def test_gpu_resolved_triton_matches_reference(op, dtype, hidden, rows, with_residual):
    accelerator = cuda_accelerator(dtype)
    impl = KernelRegistry().resolve(op, accelerator, dtype, hidden=hidden)
    assert impl.backend == "triton", f"cuda resolved {op} to {impl.backend!r}"
    x, residual, weight, bias = _inputs((rows, hidden), dtype, device="cuda")
    residual = residual if with_residual else None
    got = _call(impl, op, x, weight, bias, residual)
    want = _call(getattr(reference, op), op, x, weight, bias, residual)
    _check(got, want, x, residual)  # on a GPU bf16 rounds to nearest even: h is exact


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_gpu_resolved_triton_leading_dims(op):
    accelerator = cuda_accelerator(torch.bfloat16)
    impl = KernelRegistry().resolve(op, accelerator, torch.bfloat16, hidden=4096)
    x, residual, weight, bias = _inputs((2, 32, 4096), torch.bfloat16, device="cuda")
    _check(_call(impl, op, x, weight, bias, residual),
           _call(getattr(reference, op), op, x, weight, bias, residual), x, residual)

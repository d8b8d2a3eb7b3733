"""Weight-only quantization: the format, ``quant_linear`` in every backend against the reference.

(a) format: error bounds, int4 packing, asymmetric vs symmetric, errors; (b) the reference op and
the prepack contract; (c) registry resolution; (d) the ``cpu`` backend; (e) the Triton kernels
under ``TRITON_INTERPRET=1`` (or a GPU) on tiny shapes with small blocks, both paths; (f)
``gpu``-marked tests at model sizes through registry resolution.

Tolerance of a backend against the reference (``max|got - ref| <= tol * max|ref|``): both round
the same dequantized weights to x.dtype and sum in float32, but may round at different points:
* bf16 ``2**-6`` (two units in the last place of the largest output): the CPU kernels take bf16
  scales (the reference multiplies by the float32 scale, then rounds) and the CPU int8 group
  path rounds each group's partial sum to bf16; the interpreter rounds float32 → bf16 by
  truncation;
* fp16 ``2**-8`` (two units at fp16's 11 bits of precision), for summation order and a GPU
  reference GEMM's own rounding.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gpu import cuda_accelerator
from shardwise import Accelerator, KernelError
from shardwise.accelerators.cpu import CpuAccelerator
from shardwise.kernel_registry import KernelRegistry
from shardwise.kernels.cpu import quant as cpu_quant
from shardwise.kernels.reference import quant as ref
from shardwise.kernels.reference.quant import (QuantizationError, QuantizedWeight,
                                               dequantize_weight, quantize_weight)

TOL = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-8}
SPECS = [(bits, sym) for bits in (8, 4) for sym in (True, False)]


class _FakeCuda(Accelerator):
    """Claims the cuda device type without touching a GPU: resolution only, no launches."""

    name = "fake-cuda"
    device_type = "cuda"
    kernel_backends = ("triton",)


def _weight(out_features, in_features, seed=0, offset=0.0):
    """A float32 weight [out, in] with a per-row spread and mean, so groups differ."""
    g = torch.Generator().manual_seed(seed)
    row_scale = torch.rand(out_features, 1, generator=g) * 0.1 + 0.01
    return torch.randn(out_features, in_features, generator=g) * row_scale + offset


def _x(shape, dtype, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def _assert_matches(got, want, dtype):
    """got/want [..., out] in dtype; max abs error within TOL[dtype] of the largest output."""
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    bound = TOL[dtype] * want.float().abs().max().item()
    assert err <= bound, f"max abs error {err:.4g} > {bound:.4g} ({dtype})"


def _reference(x, qw, bias=None):
    return ref.quant_linear(x, ref.prepack(qw), bias)


# ----- (a) format ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits,symmetric", SPECS)
@pytest.mark.parametrize("group_size", [16, 32, -1])
def test_dequantize_error_is_at_most_half_a_step(bits, symmetric, group_size):
    """Round to nearest: every weight is within scale/2 of its dequantized value (float32
    rounding aside: 1e-6 relative)."""
    w = _weight(48, 64, offset=0.02)
    qw = quantize_weight(w, bits, group_size, symmetric)
    size = 64 if group_size == -1 else group_size
    err = (dequantize_weight(qw) - w).abs().reshape(48, 64 // size, size).amax(-1)
    assert bool((err <= qw.scales * (0.5 + 1e-6)).all()), (err / qw.scales).max()
    # ... and the bound is tight enough to mean something: a step is small against the weights.
    assert qw.scales.max() < w.abs().max() / (6 if bits == 4 else 100)


@pytest.mark.parametrize("bits,symmetric", SPECS)
def test_storage_dtypes_and_shapes(bits, symmetric):
    qw = quantize_weight(_weight(48, 64), bits, 16, symmetric)
    if bits == 8:
        assert qw.qweight.dtype == torch.int8 and qw.qweight.shape == (48, 64)
    else:
        assert qw.qweight.dtype == torch.uint8 and qw.qweight.shape == (48, 32)
    assert qw.scales.dtype == torch.float32 and qw.scales.shape == (48, 4)
    assert (qw.zeros is None) == symmetric
    if not symmetric:
        assert qw.zeros.dtype == torch.float32 and qw.zeros.shape == (48, 4)
    assert qw.spec == ref.QuantSpec(bits, 16, symmetric, 64, 48)
    q = ref.int_weight(qw)
    qmax = 127 if bits == 8 else 7
    # symmetric leaves the most negative code unused (nothing is clipped); asymmetric maps each
    # group's min and max onto the full range.
    lo = -qmax if symmetric else -qmax - 1
    assert q.shape == (48, 64) and int(q.min()) == lo and int(q.max()) == qmax


@pytest.mark.parametrize("group_size", [None, -1])
def test_per_channel_group(group_size):
    qw = quantize_weight(_weight(8, 40), 8, group_size)
    assert qw.group_size == 40 and qw.scales.shape == (8, 1)


def test_int4_pack_unpack_round_trip_and_nibble_order():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (5, 6, 34), generator=g, dtype=torch.int8)
    packed = ref.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 6, 17)
    assert torch.equal(ref.unpack_int4(packed), q)
    # byte j = (q[2j] + 8) | (q[2j+1] + 8) << 4: column 0 in the low nibble.
    assert ref.pack_int4(torch.tensor([-8, 7], dtype=torch.int8)).item() == 0xF0
    assert ref.pack_int4(torch.tensor([5, -6], dtype=torch.int8)).item() == 13 | (2 << 4)
    assert ref.unpack_int4(torch.tensor([0x1F], dtype=torch.uint8)).tolist() == [7, -7]


@pytest.mark.parametrize("bits", [4, 8])
def test_asymmetric_beats_symmetric_on_all_positive_weights(bits):
    w = torch.rand(16, 64, generator=torch.Generator().manual_seed(3)) + 10.0  # in [10, 11)
    sym = (dequantize_weight(quantize_weight(w, bits, 32, True)) - w).abs().max()
    asym = (dequantize_weight(quantize_weight(w, bits, 32, False)) - w).abs().max()
    # symmetric spends its range on [-11, 11], asymmetric on [10, 11]: ~20x finer steps.
    assert asym * 10 < sym, (asym, sym)


@pytest.mark.parametrize("bits,symmetric", SPECS)
def test_constant_and_zero_groups_are_exact(bits, symmetric):
    w = torch.zeros(4, 32)
    w[1] = 0.75
    w[2, 16:] = -3.0
    assert torch.equal(dequantize_weight(quantize_weight(w, bits, 16, symmetric)), w)


def test_integral_zero_points_load_exactly():
    """A GPTQ-style integer zero point is a float zero with an integral value."""
    q = torch.tensor([[-8, -1, 0, 7]], dtype=torch.int8)
    qw = QuantizedWeight(ref.pack_int4(q), torch.tensor([[0.5]]), torch.tensor([[-3.0]]), 4, 4)
    assert dequantize_weight(qw).tolist() == [[-2.5, 1.0, 1.5, 5.0]]


@pytest.mark.parametrize("bits", [2, 3, 16, 0])
def test_bad_bits_name_the_allowed_values(bits):
    with pytest.raises(QuantizationError, match=r"bits must be one of \(4, 8\), got " + str(bits)):
        quantize_weight(_weight(4, 32), bits, 16)


@pytest.mark.parametrize("group_size", [48, 0, 7, 128])
def test_bad_group_size_names_both_numbers(group_size):
    with pytest.raises(ValueError, match=f"group_size {group_size} does not divide "
                                         "in_features 64"):
        quantize_weight(_weight(4, 64), 8, group_size)


def test_other_bad_inputs():
    with pytest.raises(QuantizationError, match="in_features 33 must be even"):
        quantize_weight(_weight(4, 33), 4, -1)
    with pytest.raises(QuantizationError, match="NaN or inf"):
        quantize_weight(torch.full((4, 32), float("nan")), 8)
    with pytest.raises(QuantizationError, match="float weight"):
        quantize_weight(torch.ones(4, 32, dtype=torch.int32), 8)
    assert issubclass(QuantizationError, KernelError)


# ----- (b) the reference op and the contract --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_dequantize_then_linear(dtype):
    qw = quantize_weight(_weight(48, 64), 4, 16, False)
    x, bias = _x((2, 3, 64), dtype), _x((48,), dtype, seed=2)
    want = F.linear(x, dequantize_weight(qw).to(dtype), bias)
    assert torch.equal(_reference(x, qw, bias), want)


def test_call_checks_backend_dtype_and_features():
    qw = quantize_weight(_weight(48, 128), 8, -1)
    cpu_packed = cpu_quant.quant_linear.prepack(qw, "cpu", torch.bfloat16)
    x = _x((1, 128), torch.bfloat16)
    with pytest.raises(KernelError, match="packed for 'cpu'"):
        ref.quant_linear(x, cpu_packed)
    with pytest.raises(KernelError, match="packed for 'reference'"):
        cpu_quant.quant_linear(x, ref.prepack(qw))
    with pytest.raises(KernelError, match="packed for 'QuantizedWeight'"):
        cpu_quant.quant_linear(x, qw)
    with pytest.raises(KernelError, match="packed for torch.bfloat16, x is torch.float32"):
        cpu_quant.quant_linear(x.float(), cpu_packed)
    with pytest.raises(KernelError, match="x has 64 features, the weight 128"):
        cpu_quant.quant_linear(x[:, :64], cpu_packed)


def test_prepack_refuses_a_spec_its_backend_cannot_run():
    qw = quantize_weight(_weight(40, 64), 4, 32)  # 40 outputs: not a multiple of 16
    with pytest.raises(KernelError, match="backend 'cpu' cannot run"):
        cpu_quant.quant_linear.prepack(qw, "cpu", torch.bfloat16)
    with pytest.raises(KernelError, match="cannot run"):  # fp32: not claimed (slow kernels)
        cpu_quant.quant_linear.prepack(quantize_weight(_weight(48, 64), 4, 32), "cpu",
                                       torch.float32)


# ----- (c) resolution -------------------------------------------------------------------------


def _shape(bits, group_size, in_features=128, out_features=96, symmetric=True):
    return dict(bits=bits, group_size=group_size, symmetric=symmetric, in_features=in_features,
                out_features=out_features)


def test_quant_linear_is_an_op():
    assert "quant_linear" in KernelRegistry().ops()


@pytest.mark.parametrize("shape,dtype,backend", [
    (_shape(8, 128), torch.bfloat16, "cpu"),  # per channel
    (_shape(8, 128, in_features=512), torch.bfloat16, "cpu"),  # 4 groups of 128
    (_shape(8, 16), torch.bfloat16, "cpu"),  # 8 kernel calls of 16 columns
    (_shape(4, 32), torch.bfloat16, "cpu"),
    (_shape(4, 128, symmetric=False), torch.bfloat16, "cpu"),
    (_shape(4, 512, in_features=512), torch.bfloat16, "cpu"),  # per channel via 256-subgroups
    (_shape(4, 16), torch.bfloat16, "reference"),  # the kernel's groups are 32..256
    (_shape(4, 32, out_features=40), torch.bfloat16, "reference"),  # N % 16
    (_shape(8, 128), torch.float32, "reference"),  # scalar kernels in fp32/fp16: by 4 rows
    (_shape(4, 32), torch.float16, "reference"),  # slower than the reference, not claimed
    ({}, torch.bfloat16, "reference"),  # no weight spec: no backend claims it
])
def test_cpu_resolution(shape, dtype, backend):
    impl = KernelRegistry().resolve("quant_linear", CpuAccelerator(), dtype, **shape)
    assert impl.backend == backend
    if backend == "cpu":
        assert impl.fn is cpu_quant.quant_linear


def test_cuda_resolution_picks_triton():
    pytest.importorskip("triton")
    reg, acc = KernelRegistry(), _FakeCuda()
    for dtype in (torch.float16, torch.bfloat16):
        assert reg.resolve("quant_linear", acc, dtype, **_shape(4, 16)).backend == "triton"
        assert reg.resolve("quant_linear", acc, dtype, **_shape(8, -1)).backend == "triton"
    assert reg.resolve("quant_linear", acc, torch.float32, **_shape(8, 128)).backend == \
        "reference"
    assert reg.resolve("quant_linear", acc, torch.float16,
                       **_shape(4, 33, in_features=66)).backend == "reference"  # odd group
    assert reg.resolve("quant_linear", acc, torch.float16).backend == "reference"


def test_resolving_quant_linear_on_cpu_imports_no_triton():
    code = ("import sys, torch\n"
            "from shardwise.kernel_registry import KernelRegistry\n"
            "from shardwise.accelerators.cpu import CpuAccelerator\n"
            "impl = KernelRegistry().resolve('quant_linear', CpuAccelerator(), torch.bfloat16,"
            " bits=4, group_size=32, symmetric=True, in_features=64, out_features=48)\n"
            "assert impl.backend == 'cpu', impl.backend\n"
            "assert 'triton' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


# ----- (d) cpu backend ------------------------------------------------------------------------

# (in, out, group): ragged-ish; int4 runs all but group 16 (its kernel's groups are 32..256).
CPU_CASES = [(64, 48, 16), (64, 48, 32), (64, 96, -1), (128, 48, 64), (128, 96, -1),
             (256, 48, 128)]
CPU_DTYPES = sorted(cpu_quant.DTYPES, key=str)


def _cpu_claims(qw, dtype=torch.bfloat16):
    return cpu_quant.supports(device_type="cpu", dtype=dtype, **qw.spec.as_shape())


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("bits,symmetric", SPECS)
@pytest.mark.parametrize("in_features,out_features,group_size", CPU_CASES)
@pytest.mark.parametrize("rows", [1, 3])
def test_cpu_matches_reference(dtype, bits, symmetric, in_features, out_features, group_size,
                               rows):
    qw = quantize_weight(_weight(out_features, in_features), bits, group_size, symmetric)
    if not _cpu_claims(qw, dtype):
        assert bits == 4 and group_size == 16, f"cpu refuses {qw.spec}"
        pytest.skip("the cpu int4 kernel takes groups of 32..256")
    packed = cpu_quant.quant_linear.prepack(qw, "cpu", dtype)
    x, bias = _x((rows, in_features), dtype), _x((out_features,), dtype, seed=2)
    for b in (None, bias):
        _assert_matches(cpu_quant.quant_linear(x, packed, b), _reference(x, qw, b), dtype)


def test_cpu_cases_cover_every_kernel_path():
    """The skips above leave int8 per-channel, int8 grouped and int4 grouped + per-channel."""
    kinds = set()
    for in_features, out_features, group_size in CPU_CASES:
        for bits in (8, 4):
            qw = quantize_weight(_weight(out_features, in_features), bits, group_size)
            if _cpu_claims(qw):
                packed = cpu_quant.quant_linear.prepack(qw, "cpu", torch.bfloat16)
                grouped = qw.spec.n_groups > 1
                kinds.add((packed.meta["kind"], grouped))
    assert kinds == {("int8", False), ("int8", True), ("int4", False), ("int4", True)}


def test_cpu_leading_dims_and_strided_input():
    qw = quantize_weight(_weight(96, 128), 4, 64, symmetric=False)
    packed = cpu_quant.quant_linear.prepack(qw, "cpu", torch.bfloat16)
    x = _x((2, 3, 256), torch.bfloat16)[..., ::2]  # [2, 3, 128], last-dim stride 2
    _assert_matches(cpu_quant.quant_linear(x, packed), _reference(x, qw), torch.bfloat16)


@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_packs_once_and_calls_reuse_the_packed_weight(bits, monkeypatch):
    calls = {"pack": 0, "convert_int4": 0}
    real_pack, real_convert = cpu_quant.CpuQuantLinear._pack, cpu_quant._convert_int4

    def counting_pack(self, *args):
        calls["pack"] += 1
        return real_pack(self, *args)

    def counting_convert(u):
        calls["convert_int4"] += 1
        return real_convert(u)

    monkeypatch.setattr(cpu_quant.CpuQuantLinear, "_pack", counting_pack)
    monkeypatch.setattr(cpu_quant, "_convert_int4", counting_convert)
    qw = quantize_weight(_weight(48, 128), bits, -1)
    impl = KernelRegistry().resolve("quant_linear", CpuAccelerator(), torch.bfloat16,
                                    **qw.spec.as_shape())
    assert impl.backend == "cpu"
    packed = impl.fn.prepack(qw, "cpu", torch.bfloat16)
    ptrs = {k: t.data_ptr() for k, t in packed.tensors.items()}
    expected = {"pack": 1, "convert_int4": int(bits == 4)}
    assert calls == expected
    for rows in (1, 3, 1):
        impl(_x((rows, 128), torch.bfloat16), packed)
    assert calls == expected, "quant_linear repacked the weight during a call"
    assert {k: t.data_ptr() for k, t in packed.tensors.items()} == ptrs
    assert packed.nbytes < 48 * 128 * (1 if bits == 8 else 0.5) * 1.1  # no hidden dense copy


# ----- (e) triton: interpreter on CPU, or the GPU when there is one ----------------------------


@pytest.fixture(scope="module")
def tri(triton_device):
    """(module, kernels with small blocks that accept this device, device)."""
    device = triton_device
    from shardwise.kernels.triton import quant as tq

    gemv = tq.GemvConfig(block_n=32, block_k=32, rows_x_k=64, min_block_k=16, split_k=1)
    split = tq.GemvConfig(block_n=32, block_k=16, min_block_k=16, split_k=2)
    gemm = tq.GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4)
    kernels = {"gemv": tq.TritonQuantLinear(gemv, gemm, device_types={device}),
               "split": tq.TritonQuantLinear(split, gemm, device_types={device})}
    return tq, kernels, device


TRITON_DTYPES = [torch.float16, torch.bfloat16]
# (rows, in, group, kernel): GEMV with 1 and 3 rows, split-K (2 splits), GEMM with 9/10 rows.
# A group that is a multiple of the K tile takes one scale per row per tile (64/16, 96/16, 128/64);
# group 24 is gathered per element, and in 72 then leaves a partial K tile. out 48 leaves a
# partial N tile (block_n 32).
TRITON_CASES = [(1, 64, 16, "gemv"), (3, 72, 24, "gemv"), (3, 96, 16, "split"),
                (9, 128, 64, "gemv"), (10, 72, 24, "gemv")]


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("bits,symmetric", SPECS)
@pytest.mark.parametrize("rows,in_features,group_size,kernel", TRITON_CASES)
def test_triton_matches_reference(tri, dtype, bits, symmetric, rows, in_features, group_size,
                                  kernel):
    _, kernels, device = tri
    qw = quantize_weight(_weight(48, in_features), bits, group_size, symmetric)
    packed = kernels[kernel].prepack(qw, device, dtype)
    x, bias = _x((rows, in_features), dtype, device), _x((48,), dtype, device, seed=2)
    for b in (None, bias):
        got = kernels[kernel](x, packed, b)
        _assert_matches(got.cpu(), _reference(x.cpu(), qw, None if b is None else b.cpu()),
                        dtype)


@pytest.mark.parametrize("rows,path", [(8, "gemv"), (9, "gemm")])
def test_triton_path_by_rows(tri, rows, path, monkeypatch):
    tq, kernels, device = tri
    seen = []
    for name in ("_launch_gemv", "_launch_gemm"):
        real = getattr(tq.TritonQuantLinear, name)
        monkeypatch.setattr(tq.TritonQuantLinear, name,
                            lambda self, *a, _r=real, _n=name: seen.append(_n) or _r(self, *a))
    qw = quantize_weight(_weight(48, 64), 8, 32)
    kernels["gemv"](_x((rows, 64), torch.float16, device), kernels["gemv"].prepack(
        qw, device, torch.float16))
    assert seen == [f"_launch_{path}"]


def test_triton_strided_rows_leading_dims_and_empty(tri):
    _, kernels, device = tri
    k = kernels["gemv"]
    qw = quantize_weight(_weight(48, 64), 4, 16, symmetric=False)
    packed = k.prepack(qw, device, torch.float16)
    wide = _x((2, 5, 100), torch.float16, device)
    for x in (wide[:, :1, :64], wide[:, :, :64]):  # row pitch 100; 2 (GEMV) and 10 (GEMM) rows
        _assert_matches(k(x, packed).cpu(), _reference(x.cpu(), qw), torch.float16)
    assert k(torch.zeros(0, 64, dtype=torch.float16, device=device), packed).shape == (0, 48)


def test_triton_packed_layout(tri):
    _, kernels, device = tri
    qw = quantize_weight(_weight(48, 64), 4, 16, symmetric=False)
    t = kernels["gemv"].prepack(qw, device, torch.bfloat16).tensors
    assert torch.equal(t["qweight"].cpu(), qw.qweight)  # the reference nibble layout
    assert t["scales"].shape == t["offsets"].shape == (48, 4)
    torch.testing.assert_close(t["offsets"].cpu(), -qw.zeros * qw.scales)


# ----- (f) GPU: triton through registry resolution at model sizes -----------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("bits,symmetric", SPECS)
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("rows", [1, 4, 16, 64])
def test_gpu_resolved_triton_matches_reference(dtype, bits, symmetric, group_size, rows):
    accelerator = cuda_accelerator(dtype)
    qw = quantize_weight(_weight(4096, 4096), bits, group_size, symmetric)
    impl = KernelRegistry().resolve("quant_linear", accelerator, dtype, **qw.spec.as_shape())
    assert impl.backend == "triton", f"cuda resolved quant_linear to {impl.backend!r}"
    packed = impl.fn.prepack(qw, "cuda", dtype)
    x, bias = _x((rows, 4096), dtype, "cuda"), _x((4096,), dtype, "cuda", seed=2)
    _assert_matches(impl(x, packed, bias), _reference(x, qw.to("cuda"), bias), dtype)


@pytest.mark.gpu
def test_gpu_leading_dims_and_split_k():
    accelerator = cuda_accelerator(torch.bfloat16)
    qw = quantize_weight(_weight(11008, 4096), 4, 128, symmetric=False)
    impl = KernelRegistry().resolve("quant_linear", accelerator, torch.bfloat16,
                                    **qw.spec.as_shape())
    packed = impl.fn.prepack(qw, "cuda", torch.bfloat16)
    for shape in ((1, 1, 4096), (2, 3, 4096), (2, 40, 4096)):
        x = _x(shape, torch.bfloat16, "cuda")
        _assert_matches(impl(x, packed), _reference(x, qw.to("cuda")), torch.bfloat16)

"""What each backend promises beyond matching the reference (tests/test_kernel_parity.py does
that): limits it refuses with a named error, what it does instead of raising where raising
would need a device sync, how it packs weights, how it compiles.

Triton kernels run under ``TRITON_INTERPRET=1`` on the CPU (tiny shapes) or on the GPU when
there is one.
"""

from __future__ import annotations

import pytest
import torch

from kernel_inputs import EPS, TOL, garbage_cache, heads, quant_weight, quant_x, write_case
from shardwise import KernelError
from shardwise.accelerators.cpu import CpuAccelerator
from shardwise.kernel_registry import KernelRegistry
from shardwise.kernels.cpu import attention as cpu_attention, quant as cpu_quant
from shardwise.kernels.reference import attention as ref_attention, quant as ref_quant
from shardwise.kernels.reference.attention import alibi_slopes
from shardwise.kernels.reference.quant import quantize_weight
from shardwise.kernels.reference.rotary import rotary_cos_sin


@pytest.fixture(scope="module")
def tri_norms(triton_device):
    """The triton backend package (its norm launchers and row limit), and the device."""
    from shardwise.kernels import triton as backend

    return backend, triton_device


@pytest.fixture(scope="module")
def tri_attention(triton_device):
    """The triton attention module, and the device its kernels run on here."""
    from shardwise.kernels.triton import attention

    return attention, triton_device


@pytest.fixture(scope="module")
def tri_kv_cache(triton_device):
    from shardwise.kernels.triton import kv_cache

    return kv_cache


# ----- cpu ------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("alibi", [False, True])
def test_cpu_decode_compiles_as_an_opaque_op(window, alibi):
    """Under torch.compile (fullgraph: no graph break) the cpu decode is its custom op: the
    compiled function reads lengths/starts at run time, so new lengths need no recompile."""
    q = heads(3, 4, 1, 16)
    slopes = alibi_slopes(4) if alibi else None
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    fn = torch.compile(lambda q, k, v, n, s: cpu_attention.attention_decode(
        q, k, v, n, starts=s, alibi_slopes=slopes, window=window), backend=backend,
        fullgraph=True, dynamic=False)
    for lengths, starts in (([11, 1, 16], [3, 0, 0]), ([16, 2, 5], [0, 1, 5])):
        k_cache, v_cache = garbage_cache(3, 2, 16, 16, lengths, torch.float32, starts=starts)
        n, s = torch.tensor(lengths), torch.tensor(starts)
        want = ref_attention.attention_decode(q, k_cache, v_cache, n, starts=s, alibi_slopes=slopes,
                                    window=window)
        torch.testing.assert_close(fn(q, k_cache, v_cache, n, s), want, **TOL[torch.float32])
    assert len(compiles) == 1
    # the native C++ op where the extension builds, else the Python one
    native = cpu_attention._native_decode()
    op = "shardwise_native.cpu_attention_decode" if native else "shardwise.cpu_attention_decode"
    assert op in str(compiles[0].graph)
    torch.library.opcheck(torch.ops.shardwise.cpu_attention_decode,
                          (q, k_cache, v_cache, n, s, slopes, 0.25, window))
    if native:
        torch.library.opcheck(torch.ops.shardwise_native.cpu_attention_decode,
                              (q, k_cache, v_cache, n, s, slopes, 0.25, window, None))


def test_call_checks_backend_dtype_and_features():
    qw = quantize_weight(quant_weight(48, 128), 8, -1)
    cpu_packed = cpu_quant.quant_linear.prepack(qw, "cpu", torch.bfloat16)
    x = quant_x((1, 128), torch.bfloat16)
    with pytest.raises(KernelError, match="packed for 'cpu'"):
        ref_quant.quant_linear(x, cpu_packed)
    with pytest.raises(KernelError, match="packed for 'reference'"):
        cpu_quant.quant_linear(x, ref_quant.prepack(qw))
    with pytest.raises(KernelError, match="packed for 'QuantizedWeight'"):
        cpu_quant.quant_linear(x, qw)
    with pytest.raises(KernelError, match="packed for torch.bfloat16, x is torch.float32"):
        cpu_quant.quant_linear(x.float(), cpu_packed)
    with pytest.raises(KernelError, match="x has 64 features, the weight 128"):
        cpu_quant.quant_linear(x[:, :64], cpu_packed)


def test_prepack_refuses_a_spec_its_backend_cannot_run(monkeypatch):
    from shardwise.kernels.cpu import native

    monkeypatch.setenv(native.ENV, "torch")  # the native kernel takes 40 outputs (padded)
    qw = quantize_weight(quant_weight(40, 64), 4, 32)  # 40 outputs: not a multiple of 16
    with pytest.raises(KernelError, match="backend 'cpu' cannot run"):
        cpu_quant.quant_linear.prepack(qw, "cpu", torch.bfloat16)
    with pytest.raises(KernelError, match="cannot run"):  # fp32: not claimed (slow kernels)
        cpu_quant.quant_linear.prepack(quantize_weight(quant_weight(48, 64), 4, 32), "cpu",
                                       torch.float32)


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("bits", [4, 8])
def test_cpu_packs_once_and_calls_reuse_the_packed_weight(bits, kernel, monkeypatch):
    from shardwise.kernels.cpu import native

    monkeypatch.setenv(native.ENV, kernel)
    if kernel == "native" and not native.load():
        pytest.skip("the native CPU quant kernel does not build here (its log line says why)")
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
    qw = quantize_weight(quant_weight(48, 128), bits, -1)
    impl = KernelRegistry().resolve("quant_linear", CpuAccelerator(), torch.bfloat16,
                                    **qw.spec.as_shape())
    assert impl.backend == "cpu"
    packed = impl.fn.prepack(qw, "cpu", torch.bfloat16)
    ptrs = {k: t.data_ptr() for k, t in packed.tensors.items()}
    assert packed.meta["kind"] == ("native" if kernel == "native" else f"int{bits}")
    expected = {"pack": 1, "convert_int4": int(bits == 4 and kernel == "torch")}
    assert calls == expected
    for rows in (1, 3, 1):
        impl(quant_x((rows, 128), torch.bfloat16), packed)
    assert calls == expected, "quant_linear repacked the weight during a call"
    assert {k: t.data_ptr() for k, t in packed.tensors.items()} == ptrs
    assert packed.nbytes < 48 * 128 * (1 if bits == 8 else 0.5) * 1.1  # no hidden dense copy


# ----- triton -----------------------------------------------------------------------------------


def test_triton_refuses_rows_beyond_one_block(tri_norms):
    backend, device = tri_norms
    x = torch.zeros(1, backend.max_hidden(torch.bfloat16) + 1, dtype=torch.bfloat16,
                    device=device)
    with pytest.raises(KernelError, match="hidden size"):
        backend.rms_norm(x, x[0], EPS)
    assert not backend.supports_hidden(device_type="cuda", dtype=torch.bfloat16,
                                       hidden=x.shape[-1])


def test_triton_empty_input(tri_norms):
    backend, device = tri_norms
    x = torch.zeros(0, 64, device=device)
    out, h = backend.rms_norm(x, torch.ones(64, device=device), EPS, residual=x.clone())
    assert out.shape == h.shape == (0, 64)


def test_triton_decode_clamps_lengths_past_the_cache(tri_attention):
    """Lengths are not checked on the device path (no sync); they are clamped, never overread."""
    backend, device = tri_attention
    q = heads(1, 2, 1, 16, torch.float32, device)
    k_cache, v_cache = garbage_cache(1, 2, 20, 16, [20], torch.float32, device)
    got = backend.attention_decode(q, k_cache, v_cache, torch.tensor([99], device=device),
                                   num_splits=2, block_n=16)
    want = ref_attention.attention_decode(q, k_cache, v_cache, torch.tensor([20], device=device))
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_triton_refuses_tensors_on_another_device(tri_attention):
    backend, device = tri_attention
    q = heads(1, 2, 1, 16, torch.float32, device)
    k_cache, v_cache = garbage_cache(1, 2, 20, 16, [20], torch.float32, device)
    with pytest.raises(KernelError, match="lengths"):
        backend.attention_decode(q, k_cache, v_cache, torch.tensor([5], device="meta"))


def test_triton_kv_cache_write_bounds(tri_kv_cache, triton_device):
    (k_cache, v_cache), (k_new, v_new) = write_case(torch.float32, triton_device)
    before = k_cache.clone()
    past = torch.tensor([0, 8], device=triton_device)
    with pytest.raises(KernelError, match="max_tokens=10"):
        tri_kv_cache.kv_cache_write(k_cache, v_cache, k_new, v_new, past)
    assert torch.equal(k_cache, before)
    # unchecked (graph capture): the in-range tokens land, the rest are dropped, nothing else moves
    tri_kv_cache.kv_cache_write(k_cache, v_cache, k_new, v_new, past, check=False)
    assert torch.equal(k_cache[0, :, :3], k_new[0])
    assert torch.equal(k_cache[1, :, 8:], k_new[1, :, :2])
    assert torch.equal(k_cache[1, :, :8], before[1, :, :8])


def test_triton_decode_split_heuristic(tri_attention):
    """40 cache tokens in tiles of 16, 3 splits asked: 3 splits of 16 (the last one partial), the
    split the parity matrix's interpreter decode cases force."""
    backend, device = tri_attention
    assert backend.decode_splits(4, 2, 40, 16, torch.device(device), 3) == (3, 16)


def test_triton_rotary_keeps_the_layout(triton_device):
    """q/k as transposed views of a projection's output: the outputs keep their strides."""
    from shardwise.kernels.triton import rotary

    q, k = (heads(2, n, 3, 24, torch.float32, triton_device, seed) for n, seed in ((4, 1), (2, 2)))
    cos, sin = rotary_cos_sin(torch.arange(3, device=triton_device), 8)
    q_out, k_out = rotary.rotary(q, k, cos, sin)
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()


@pytest.fixture(scope="module")
def tri_quant(triton_device):
    """(module, kernels with small blocks that accept this device, device)."""
    device = triton_device
    from shardwise.kernels.triton import quant as tq

    gemv = tq.GemvConfig(block_n=32, block_k=32, rows_x_k=64, min_block_k=16, split_k=1)
    split = tq.GemvConfig(block_n=32, block_k=16, min_block_k=16, split_k=2)
    gemm = tq.GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4)
    # up to 8 rows on the GEMV kernel (the default hands rows beyond 2 to the GEMM), so its
    # multi-row tiles stay covered
    kernels = {"gemv": tq.TritonQuantLinear(gemv, gemm, gemv_max_rows=8, device_types={device}),
               "split": tq.TritonQuantLinear(split, gemm, gemv_max_rows=8,
                                             device_types={device})}
    return tq, kernels, device


@pytest.mark.parametrize("rows,path", [(8, "gemv"), (9, "gemm"), (11, "gemm"), (12, "dequant")])
def test_triton_path_by_rows(tri_quant, rows, path, monkeypatch):
    """Rows up to gemv_max_rows take the GEMV, then the GEMM, and from the bit width's
    dequant_min_rows the weight is dequantized once for torch.mm."""
    tq, kernels, device = tri_quant
    monkeypatch.setitem(kernels["gemv"].dequant_min_rows, 8, 12)  # the fixture is shared
    seen = []
    for name in ("_launch_gemv", "_launch_gemm", "_launch_dequant"):
        real = getattr(tq.TritonQuantLinear, name)
        monkeypatch.setattr(tq.TritonQuantLinear, name,
                            lambda self, *a, _r=real, _n=name: seen.append(_n) or _r(self, *a))
    qw = quantize_weight(quant_weight(48, 64), 8, 32)
    kernels["gemv"](quant_x((rows, 64), torch.float16, device), kernels["gemv"].prepack(
        qw, device, torch.float16))
    assert seen == [f"_launch_{path}"]


def test_triton_default_thresholds():
    """The registered instance: the GEMV up to 2 rows, int8 dequantized once from 128 rows and
    int4 from 1024 (the thresholds kernels/triton/quant.py's DEQUANT_MIN_ROWS comment measures),
    tiles autotuned (no fixed configs)."""
    from shardwise.kernels.triton import quant as tq

    assert tq.quant_linear.gemv_max_rows == 2
    assert tq.quant_linear.dequant_min_rows == {8: 128, 4: 1024}
    assert tq.quant_linear.gemv is None and tq.quant_linear.gemm is None


def test_triton_packed_layout(tri_quant):
    _, kernels, device = tri_quant
    qw = quantize_weight(quant_weight(48, 64), 4, 16, symmetric=False)
    t = kernels["gemv"].prepack(qw, device, torch.bfloat16).tensors
    assert torch.equal(t["qweight"].cpu(), qw.qweight)  # the reference nibble layout
    assert t["scales"].shape == t["offsets"].shape == (48, 4)
    torch.testing.assert_close(t["offsets"].cpu(), -qw.zeros * qw.scales)


def test_triton_empty_rows(tri_quant):
    _, kernels, device = tri_quant
    qw = quantize_weight(quant_weight(48, 64), 4, 16, symmetric=False)
    packed = kernels["gemv"].prepack(qw, device, torch.float16)
    assert kernels["gemv"](torch.zeros(0, 64, dtype=torch.float16, device=device),
                           packed).shape == (0, 48)

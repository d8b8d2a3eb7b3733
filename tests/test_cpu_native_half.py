"""The CPU backend's native 16-bit blocked linear (``kernels/cpu/native/half.cpp``) against its
oracle (``shardwise.kernels.reference.linear.blocked_linear``) and the exact product: bf16 and
fp16, row counts around its 8/4/2/1 chunks, widths that leave a part block, a bias in either
dtype; its checks for bad input; inside ``torch.compile``; and the layout it reads
(``cpu_blocked_layout``): a 16-bit linear laid out in blocks computes what it did, from one row
up to a prompt, gives its usual layout back in ``state_dict`` and on undo, and is left as it is
when the native kernels are opted out. Skipped with the reason where the extension does not
build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.accelerators import cpu_blocked_layout as layout
from shardwise.errors import ConfigError
from shardwise.kernels.cpu import native
from shardwise.kernels.reference.linear import blocked_linear as reference
from shardwise.ledger import Ledger

pytestmark = pytest.mark.skipif(not native.load(respect_choice=False),
                                reason="the native CPU extension does not build here (AVX512-VNNI "
                                       "CPU and a C++ compiler needed)")

DTYPES = [torch.bfloat16, torch.float16]
#: the op's paths: bf16 by vdpbf16ps where the CPU has AVX512-BF16 ("dot", forced with
#: SHARDWISE_CPU_BF16_DOT=1: the op's own timing may pick either), bf16 and fp16 widened to fp32
#: with FMAs ("widen": bf16's on other CPUs, forced with SHARDWISE_CPU_BF16_DOT=0)
PATHS = [pytest.param(torch.bfloat16, "dot", id="bf16-dot"),
         pytest.param(torch.bfloat16, "widen", id="bf16-widen"),
         pytest.param(torch.float16, "widen", id="fp16-widen")]


def _use_path(path: str, monkeypatch) -> None:
    monkeypatch.setenv("SHARDWISE_CPU_BF16_DOT", "0" if path == "widen" else "1")


def _within_one_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                         bias: torch.Tensor | None) -> None:
    """``got`` [M, N] is the exact ``x @ w.T + bias`` (float64) up to the fp32 sum's own error
    (at most K · 2^-24 · Σ|x w| per output) plus one rounding to got's dtype (half an ulp:
    ≤ eps/2 of the value)."""
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    k = x.shape[-1]
    bound = (x.double().abs() @ w.double().abs().t()) * k * 2.0 ** -24 \
        + exact.abs() * torch.finfo(got.dtype).eps / 2 * 1.001
    assert ((got.double() - exact).abs() <= bound + 1e-12).all()


@pytest.mark.parametrize("dtype,path", PATHS)
@pytest.mark.parametrize("n,k", [(70, 33), (64, 128), (576, 200), (5, 8)])
@pytest.mark.parametrize("bias", ["none", "same", "fp32"])
def test_native_blocked_linear_is_the_fp32_sum_rounded_once(dtype, path, n, k, bias,
                                                            monkeypatch):
    _use_path(path, monkeypatch)
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = {"none": None, "same": torch.randn(n, generator=g).to(dtype),
         "fp32": torch.randn(n, generator=g)}[bias]
    blocked = layout.block_weight(w.t())  # [Nb, K, 32]
    for rows in (1, 2, 3, 5, 8, 13, 40, layout.NATIVE_ROWS + 1):  # each chunk size, remainders
        if rows > layout.NATIVE_ROWS and bias == "fp32" and path == "widen":
            continue  # past NATIVE_ROWS their bias is added in x's dtype, as F.linear (below)
        x = torch.randn(rows, k, generator=g).to(dtype)
        got = native.cpu_blocked_linear(x, blocked, b, n)
        assert got.shape == (rows, n) and got.dtype == dtype
        _within_one_rounding(got, x, w, b)
        want = reference(x, blocked, b, n)  # the oracle: same contract, another sum order
        assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -6


@pytest.mark.parametrize("dtype", DTYPES)
def test_past_native_rows_the_widening_path_is_addmm_on_the_plain_weight(dtype, monkeypatch):
    """More than NATIVE_ROWS rows of fp16, or of bf16 on a CPU without AVX512-BF16: ATen's GEMM
    on the weight reassembled from the blocks, bit for bit what ``addmm`` gives on the plain
    [K, N] weight (bias in x's dtype, as ``F.linear``), within one rounding of the exact product,
    twice in a row (the reassembly buffer is reused) and for a smaller weight after a larger
    one. bf16 on a CPU with AVX512-BF16 keeps its own loops at every row count (ATen's bf16
    GEMM there runs on the instruction they are timed against): the widening ones here, within
    one rounding too."""
    monkeypatch.setenv("SHARDWISE_CPU_BF16_DOT", "0")
    own_loops = dtype == torch.bfloat16 and native.cpu_bf16_dot_choice()[1] > 0
    g = torch.Generator().manual_seed(3)
    for n, k in ((200, 96), (70, 40)):
        w = torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype)
        blocked = layout.block_weight(w.t())
        x = torch.randn(layout.NATIVE_ROWS + 30, k, generator=g).to(dtype)
        mat2 = w.t().contiguous()  # [K, N]
        for _ in range(2):
            got = native.cpu_blocked_linear(x, blocked, b, n)
            if own_loops:  # the same loops as at NATIVE_ROWS rows (chunks of 8: the same sums)
                rows = layout.NATIVE_ROWS
                assert torch.equal(got[:rows], native.cpu_blocked_linear(x[:rows], blocked, b, n))
            else:
                assert torch.equal(got, torch.addmm(b, x, mat2))
        _within_one_rounding(got, x, w, b)
        if not own_loops:
            assert torch.equal(native.cpu_blocked_linear(x, blocked, None, n), x @ mat2)


def test_native_blocked_linear_keeps_nan_and_inf_and_takes_no_rows():
    w = torch.ones(40, 16, dtype=torch.bfloat16)
    blocked = layout.block_weight(w.t())
    x = torch.ones(2, 16, dtype=torch.bfloat16)
    x[0, 3], x[1, 5] = float("nan"), float("inf")
    got = native.cpu_blocked_linear(x, blocked, None, 40)
    assert got[0].isnan().all() and got[1].isinf().all() and (got[1] > 0).all()
    empty = native.cpu_blocked_linear(x[:0], blocked, None, 40)
    assert empty.shape == (0, 40)


def test_native_blocked_linear_refuses_what_does_not_fit():
    w = torch.randn(40, 16).bfloat16()
    blocked = layout.block_weight(w.t())  # [2, 16, 32]
    x = torch.randn(2, 16).bfloat16()
    cases = [
        (x, blocked.float(), None, 40, "weight must be bfloat16 or float16"),
        (x.half(), blocked, None, 40, "in the weight's dtype, or float32"),
        (x.double(), blocked, None, 40, "in the weight's dtype, or float32"),
        (torch.randn(2, 8).bfloat16(), blocked, None, 40, "x has 8 features"),
        (x, blocked, None, 80, "80 outputs do not fit 2 blocks"),
        (x, blocked[:, :, :16].contiguous(), None, 40, r"\[Nb, K, 32\]"),
        (x, blocked, torch.randn(7).bfloat16(), 40, "bias must have 40"),
    ]
    for args in cases:
        with pytest.raises(RuntimeError, match=args[-1]):
            native.cpu_blocked_linear(*args[:-1])


def test_native_blocked_linear_runs_inside_torch_compile():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).bfloat16()
    blocked = layout.block_weight(w.t())
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(1, 64, generator=g).bfloat16()

    def step(x, blocked, b):
        return torch.relu(native.cpu_blocked_linear(x * 2, blocked, b, 96)) + 1

    got = torch.compile(step, fullgraph=True, dynamic=False)(x, blocked, b)
    assert torch.equal(got, step(x, blocked, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
def test_a_16bit_linear_laid_out_in_blocks_computes_what_it_did(dtype, conv1d, monkeypatch):
    """One row to a prompt (past :data:`NATIVE_ROWS`: the op's GEMM on the reassembled weight),
    eager;
    one row compiled; the plain layout given back by ``state_dict`` and by the ledger's undo,
    bit for bit."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    module = (Conv1D(72, 48) if conv1d else nn.Linear(48, 72)).to(dtype)
    plain = {k: v.clone() for k, v in module.state_dict().items()}
    w = plain["weight"].t() if conv1d else plain["weight"]  # [N, K]
    ledger = Ledger(module)
    with ledger.recording():
        assert layout.block_linear_weights([module]) == 1
    assert module.weight.shape == (3, 48, layout.BLOCK_N) and module.weight.dtype == dtype
    calls, kernel = [], native.cpu_blocked_linear
    monkeypatch.setattr(native, "cpu_blocked_linear",
                        lambda x, *rest: calls.append(x.shape[0]) or kernel(x, *rest))
    for rows in (1, 5, layout.NATIVE_ROWS, layout.NATIVE_ROWS + 8):
        x = torch.randn(1, rows, 48).to(dtype)
        with torch.no_grad():  # as an engine runs: the native kernel up to NATIVE_ROWS
            got = module(x)
        assert got.shape == (1, rows, 72) and got.dtype == dtype
        _within_one_rounding(got.reshape(-1, 72), x.reshape(-1, 48), w, plain["bias"])
        if rows == 1:  # autograd recording: the reassembled weight's GEMM, differentiable
            with_grad = module(x)
            assert with_grad.requires_grad
            _within_one_rounding(with_grad.detach().reshape(-1, 72), x.reshape(-1, 48), w,
                                 plain["bias"])
    assert calls == [1, 5, layout.NATIVE_ROWS, layout.NATIVE_ROWS + 8]  # not under autograd
    x = torch.randn(1, 1, 48).to(dtype)
    compiled = torch.compile(lambda t: module(t), fullgraph=True, dynamic=False)
    with torch.no_grad():
        assert torch.equal(compiled(x), module(x))
    assert all(torch.equal(v, plain[k]) for k, v in module.state_dict().items())
    ledger.give_back()
    assert "forward" not in vars(module)
    assert torch.equal(module.weight, plain["weight"]) and module.weight.is_contiguous()


def test_16bit_linears_keep_their_layout_when_the_native_kernels_are_opted_out(monkeypatch):
    monkeypatch.setenv(native.ENV, "torch")
    fp32, bf16 = nn.Linear(16, 8), nn.Linear(16, 8).bfloat16()
    assert layout.block_linear_weights([fp32, bf16]) == 1
    assert fp32.weight.dim() == 3 and bf16.weight.shape == (8, 16)
    assert "forward" not in vars(bf16)


def _flushes_denormals(monkeypatch, env: str | None) -> bool:
    """Whether bf16 runs the dot loops under ``env``: vdpbf16ps flushes a denormal x to zero,
    the widening loops keep it (x one bf16 denormal against a weight of ones)."""
    if env is None:
        monkeypatch.delenv(native.BF16_DOT_ENV, raising=False)
    else:
        monkeypatch.setenv(native.BF16_DOT_ENV, env)
    w = torch.ones(3, 4, dtype=torch.bfloat16)
    x = torch.tensor([[1e-40, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    assert x[0, 0] != 0 and x[0, 0].abs() < torch.finfo(torch.bfloat16).tiny
    got = native.cpu_blocked_linear(x, layout.block_weight(w.t()), None, 3)
    return bool((got == 0).all())


def test_bf16_takes_the_loops_the_ops_timing_picks_unless_forced(monkeypatch):
    """Unset: the dot loops unless the widening ones ran in under 1/1.15 of their time (one
    timing per process, the same pick at every call); 1 / 0 force either where the CPU has
    AVX512-BF16; without it both times are 0 and bf16 always widens."""
    monkeypatch.delenv(native.BF16_DOT_ENV, raising=False)
    picks, dot_s, widen_s = native.cpu_bf16_dot_choice()
    assert native.cpu_bf16_dot_choice() == (picks, dot_s, widen_s)
    has_dot = dot_s > 0
    assert (widen_s > 0) == has_dot
    assert picks == (has_dot and not widen_s * 1.15 < dot_s)
    assert _flushes_denormals(monkeypatch, None) == picks
    assert _flushes_denormals(monkeypatch, "1") == has_dot
    assert not _flushes_denormals(monkeypatch, "0")
    monkeypatch.setenv(native.BF16_DOT_ENV, "1")
    assert native.cpu_bf16_dot_choice()[0] == has_dot


@pytest.mark.parametrize("value", ["yes", "2", " 1", "auto"])
def test_a_bad_bf16_dot_value_is_refused(value, monkeypatch):
    monkeypatch.setenv(native.BF16_DOT_ENV, value)
    with pytest.raises(ConfigError, match="SHARDWISE_CPU_BF16_DOT=.*expected 1 .* 0 .* or unset"):
        native.check_bf16_dot_env()
    for good in ("1", "0", ""):
        monkeypatch.setenv(native.BF16_DOT_ENV, good)
        native.check_bf16_dot_env()


def test_load_refuses_a_bad_bf16_dot_value_before_building(monkeypatch):
    monkeypatch.setattr(native, "_state", {})  # as in a fresh process
    for name, fresh in (("LOADED", False), ("ELEMENTWISE", False), ("ELEMENTWISE_ALL", False)):
        monkeypatch.setattr(native, name, fresh)  # load() sets them: restored after the test
    built = []
    monkeypatch.setattr(native, "_try_build", lambda: built.append(1) or True)
    monkeypatch.setenv(native.BF16_DOT_ENV, "on")
    with pytest.raises(ConfigError, match="SHARDWISE_CPU_BF16_DOT='on'"):
        native.load(respect_choice=False)
    assert built == []
    monkeypatch.setenv(native.BF16_DOT_ENV, "0")
    assert native.load(respect_choice=False) and built == [1]


def test_extra_compiler_flags_follow_the_fixed_ones(monkeypatch):
    monkeypatch.delenv(native.EXTRA_CFLAGS_ENV, raising=False)
    assert native.cflags() == native.CFLAGS
    monkeypatch.setenv(native.EXTRA_CFLAGS_ENV, " -DSHARDWISE_PREFETCH_BYTES=0  -DX=1 ")
    assert native.cflags() == [*native.CFLAGS, "-DSHARDWISE_PREFETCH_BYTES=0", "-DX=1"]

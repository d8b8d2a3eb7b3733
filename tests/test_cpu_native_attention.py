"""The CPU backend's native decode attention (``kernels/cpu/native/attention.cpp``) against the
reference ``attention_decode`` (its oracle), and its chunk op against ``attention_chunks``: dtypes,
GQA groups, left padding, sliding windows, ALiBi, sinks, empty and full ranges, large scores; its
own checks for bad input (the compiled step calls it with no Python before it); inside
``torch.compile``; and that the CPU backend's ``attention_decode`` takes it where the extension
builds (else skipped with the reason)."""

from __future__ import annotations

import pytest
import torch

from shardwise import KernelError
from shardwise.kernels.cpu import attention as cpu_attention
from shardwise.kernels.cpu import native
from shardwise.kernels.reference.attention import attention_chunks as chunks_reference
from shardwise.kernels.reference.attention import attention_decode as reference

pytestmark = pytest.mark.skipif(not native.load(respect_choice=False),
                                reason="the native CPU extension does not build here (AVX512-VNNI "
                                       "CPU and a C++ compiler needed)")

#: max |native - reference| per dtype: fp32 sums in another order; bf16/fp16 round the output
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _op(q, k, v, lengths, starts=None, alibi=None, scale=None, window=None, sinks=None):
    return torch.ops.shardwise_native.cpu_attention_decode(q, k, v, lengths, starts, alibi,
                                                           scale, window, sinks)


def _case(dtype, batch=3, q_heads=8, kv_heads=2, tokens=40, d=64, seed=0, magnitude=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, q_heads, 1, d, generator=g) * magnitude).to(dtype)
    k = (torch.randn(batch, kv_heads, tokens, d, generator=g) * magnitude).to(dtype)
    v = torch.randn(batch, kv_heads, tokens, d, generator=g).to(dtype)
    return q, k, v


def _check(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("d", [64, 128, 80])
def test_matches_reference_with_padding_and_ragged_lengths(dtype, heads, d):
    q, k, v = _case(dtype, q_heads=heads[0], kv_heads=heads[1], d=d)
    lengths, starts = torch.tensor([40, 17, 1]), torch.tensor([0, 5, 0])
    _check(_op(q, k, v, lengths, starts), reference(q, k, v, lengths, starts=starts), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extra", ["window", "alibi", "sinks", "scale"])
def test_matches_reference_with_each_option(dtype, extra):
    q, k, v = _case(dtype)
    lengths, starts = torch.tensor([40, 23, 9]), torch.tensor([0, 4, 2])
    kw = {"window": {"window": 6}, "alibi": {"alibi_slopes": torch.rand(8)},
          "sinks": {"sinks": torch.randn(8)}, "scale": {"scale": 0.3}}[extra]
    got = _op(q, k, v, lengths, starts, kw.get("alibi_slopes"), kw.get("scale"),
              kw.get("window"), kw.get("sinks"))
    _check(got, reference(q, k, v, lengths, starts=starts, **kw), dtype)


def test_empty_range_gives_zeros_and_large_scores_stay_finite():
    q, k, v = _case(torch.float32, magnitude=30.0)  # scores in the thousands: max subtracted
    lengths, starts = torch.tensor([40, 0, 7]), torch.tensor([0, 0, 7])
    got = _op(q, k, v, lengths, starts)
    assert torch.isfinite(got).all() and not got[1:].any()  # rows 1 and 2 attend to nothing
    _check(got, reference(q, k, v, lengths, starts=starts), torch.float32)


def test_reads_only_the_valid_range():
    q, k, v = _case(torch.float32)
    lengths, starts = torch.tensor([30, 20, 10]), torch.tensor([2, 0, 5])
    want = _op(q, k, v, lengths, starts)
    k2, v2 = k.clone(), v.clone()
    for b, (s, n) in enumerate([(2, 30), (0, 20), (5, 10)]):
        k2[b, :, :s] = v2[b, :, :s] = float("nan")
        k2[b, :, n:] = v2[b, :, n:] = float("nan")
    torch.testing.assert_close(_op(q, k2, v2, lengths, starts), want, rtol=0, atol=0)


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v, n: (q[:, :, 0], k, v, n), "takes q"),
    (lambda q, k, v, n: (q, k[:, :, :, :32], v[:, :, :, :32], n), "takes q"),
    (lambda q, k, v, n: (q[:, :6], k[:, :1].expand(-1, 4, -1, -1).contiguous(),
                         v[:, :1].expand(-1, 4, -1, -1).contiguous(), n), "multiple of kv_heads"),
    (lambda q, k, v, n: (q, k, v, n + 1), "lengths <= max_tokens"),
    (lambda q, k, v, n: (q, k, v, n.float()), "int32/int64"),
    (lambda q, k, v, n: (q.half(), k, v, n), "share a dtype"),
])
def test_bad_input_is_refused_by_the_op_itself(bad, match):
    q, k, v = _case(torch.float32)
    args = bad(q, k, v, torch.tensor([40, 40, 40]))
    with pytest.raises(RuntimeError, match=match):
        _op(*args)


def test_inside_torch_compile_and_as_the_backend_kernel():
    """The CPU backend's attention_decode routes to the native op, eagerly and in a compiled
    function (one opaque call), with the reference's results."""
    q, k, v = _case(torch.float32)
    lengths, starts = torch.tensor([40, 17, 3]), torch.tensor([0, 2, 0])
    want = reference(q, k, v, lengths, starts=starts)

    def step(q, k, v, lengths, starts):
        return cpu_attention.attention_decode(q * 1.0, k, v, lengths, starts=starts) + 0.0

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    _check(compiled(q, k, v, lengths, starts), want, torch.float32)
    _check(step(q, k, v, lengths, starts), want, torch.float32)
    assert cpu_attention._native_decode()
    assert "native=True" in native.key_text()  # precompiled steps are keyed by it


# ----- the prompt chunks of a served mixed step (cpu_chunk_attention, attention_chunks) --------

def _chunks(dtype, d=64, kv_heads=3, seed=1):
    """SmolLM2's heads (9 / 3): a 16-token chunk after 80 cached tokens of row 5 and a 3-token
    one starting row 2, in a 24-token bucket over 8 rows of 200 positions."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 3 * kv_heads, 24, d, generator=g).to(dtype)
    k = torch.randn(8, kv_heads, 200, d, generator=g).to(dtype)
    v = torch.randn(8, kv_heads, 200, d, generator=g).to(dtype)
    return q, k, v, torch.tensor([[5, 80, 16], [2, 0, 3], [0, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 80])
@pytest.mark.parametrize("window", [None, 7])
def test_chunks_match_the_reference_and_read_only_their_ranges(dtype, d, window):
    q, k, v, spans = _chunks(dtype, d)
    want = chunks_reference(q, k, v, spans, window=window)
    k[5, :, 96:] = v[5, :, 96:] = float("nan")  # past the chunks' positions: never read
    k[2, :, 3:] = v[2, :, 3:] = float("nan")
    k[[0, 1, 3, 4, 6, 7]] = float("nan")  # rows with no chunk
    got = torch.ops.shardwise_native.cpu_chunk_attention(q, k, v, spans, None, None, window, None)
    _check(got, want, dtype)
    assert not got[:, :, 19:].any()  # padding tokens


def test_chunks_without_the_extension_take_the_prefill_op(monkeypatch):
    """Where the native op does not build, the backend's attention_chunks runs attention_prefill
    per chunk in the opaque op the compiled step calls instead: the reference's results too,
    with every option, eagerly and compiled."""
    monkeypatch.setattr(cpu_attention, "_native_decode", lambda: False)
    q, k, v, spans = _chunks(torch.float32)
    kw = {"alibi_slopes": torch.rand(9), "scale": 0.2, "window": 9}
    want = chunks_reference(q, k, v, spans, **kw)
    _check(cpu_attention.attention_chunks(q, k, v, spans, **kw), want, torch.float32)
    step = torch.compile(lambda *a: cpu_attention.attention_chunks(*a, **kw), fullgraph=True)
    _check(step(q, k, v, spans), want, torch.float32)


@pytest.mark.parametrize("spans", [
    [[8, 0, 4]],               # no such row
    [[1, 190, 16]],            # past the row's positions
    [[1, 0, 20], [2, 0, 5]],   # more tokens than q holds
])
def test_chunks_bad_spans_are_refused(spans):
    q, k, v, _ = _chunks(torch.float32)
    spans = torch.tensor(spans)
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.shardwise_native.cpu_chunk_attention(q, k, v, spans, None, None, None, None)
    with pytest.raises(KernelError, match="do not fit"):  # the backend's eager checks first
        cpu_attention.attention_chunks(q, k, v, spans)


def test_chunks_inside_torch_compile():
    q, k, v, spans = _chunks(torch.bfloat16)
    want = chunks_reference(q, k, v, spans)

    def step(q, k, v, spans):
        return cpu_attention.attention_chunks(q * 1.0, k, v, spans) + 0.0

    _check(torch.compile(step, fullgraph=True, dynamic=False)(q, k, v, spans), want,
           torch.bfloat16)

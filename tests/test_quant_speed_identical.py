"""The faster quantization (chunked rows, packing without unpacking) writes exactly the bytes the
straightforward code wrote: ``quantize_weight`` and the CPU backend's packings against a frozen
copy of the whole-tensor implementations they replaced (the oracle below, as of rev 8def8cd),
compared with ``torch.equal`` (bit-identical; no tolerance) over int8/int4, symmetric/asymmetric,
per channel and grouped, row counts that are not a multiple of a chunk or of 16, weights that are
not float32 or not contiguous, and a chunk of a single row.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.kernels.cpu import quant as cpu_quant
from shardwise.kernels.reference import quant as ref_quant
from shardwise.kernels.reference.quant import QuantizationError, QuantizedWeight

# ----- the oracle: the implementations before the speed-up (rev 8def8cd), unchanged ------------

_TINY = torch.finfo(torch.float32).tiny


def _qrange(bits):
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def _old_searched_scales(wg, bits, steps=(0.0,)):
    qmin, qmax = _qrange(bits)
    m = wg.gather(-1, wg.abs().argmax(-1, keepdim=True))
    m = torch.where(m == 0, torch.full_like(m, _TINY), m)
    weight = wg * wg
    best_score = torch.full(m.shape[:-1], -1.0, dtype=torch.float32, device=wg.device)
    best = (m / qmin).squeeze(-1)
    for step in steps:
        q = (wg * ((qmin - step) / m)).round_().clamp_(qmin, qmax)
        wq = weight.mul(q)
        sum_lx = torch.linalg.vecdot(wq, wg)
        sum_l2 = torch.linalg.vecdot(wq, q).clamp_min_(_TINY)
        score = sum_lx * sum_lx / sum_l2
        better = score > best_score
        best = torch.where(better, sum_lx / sum_l2, best)
        best_score = torch.where(better, score, best_score)
    return torch.where(best == 0, torch.full_like(best, _TINY), best)


def _old_params(wg, bits, symmetric):
    qmin, qmax = _qrange(bits)
    if symmetric:
        if bits == 4:
            return _old_searched_scales(wg, bits), None
        return wg.abs().amax(-1).clamp_min(_TINY) / qmax, None
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = (hi - lo) / (qmax - qmin)
    flat = hi.abs().clamp_min(1e-8) / (qmax - qmin)
    scales = torch.where(scales > 0, scales, flat)
    return scales, qmin - lo / scales


def _old_pack_int4(q):
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _old_unpack_int4(packed):
    lo = (packed & 0x0F).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def old_quantize_weight(w, bits, group_size, symmetric):
    """``quantize_weight`` before the speed-up (arguments already valid)."""
    out_features, in_features = w.shape
    group_size = in_features if group_size in (None, -1) else group_size
    wg = w.detach().float().reshape(out_features, in_features // group_size, group_size)
    scales, zeros = _old_params(wg, bits, symmetric)
    q = wg / scales[..., None]
    if zeros is not None:
        q = q + zeros[..., None]
    q = q.round_().clamp_(*_qrange(bits)).to(torch.int8).reshape(out_features, in_features)
    qweight = _old_pack_int4(q) if bits == 4 else q
    return QuantizedWeight(qweight.contiguous(), scales.contiguous(),
                           zeros.contiguous() if zeros is not None else None, bits, group_size)


def _old_row_blocks(t, pad):
    t = torch.cat((t.float(), t.new_zeros(pad, t.shape[1], dtype=torch.float32)))
    blocks = t.reshape(-1, 16, t.shape[1]).transpose(1, 2)
    return torch.empty(blocks.shape, dtype=blocks.dtype).copy_(blocks)


def old_pack_native(qw):
    """``cpu_quant._pack_native`` before the speed-up: (tensors, meta)."""
    n, k, bits = qw.out_features, qw.in_features, qw.bits
    pad = -n % 16
    q = _old_unpack_int4(qw.qweight) if bits == 4 else qw.qweight
    u = (q.to(torch.int16) + (8 if bits == 4 else 128)).to(torch.uint8)
    u = torch.cat((u, u.new_zeros(pad, k)))
    if bits == 8:
        w = u.reshape(-1, 16, k // 4, 4)
    else:
        v = u.reshape(-1, 16, k // 8, 2, 4)
        w = v[..., 0, :] | (v[..., 1, :] << 4)
    tensors = {"qweight": w.transpose(1, 2).contiguous(), "scales": _old_row_blocks(qw.scales, pad)}
    if qw.zeros is not None:
        tensors["zeros"] = _old_row_blocks(qw.zeros, pad)
    return tensors, {"kind": "native", "ablock": ref_quant.activation_block(bits, qw.group_size)}


# ----- the comparisons ------------------------------------------------------------------------

def _same_weight(new: QuantizedWeight, old: QuantizedWeight) -> None:
    assert (new.bits, new.group_size) == (old.bits, old.group_size)
    for name in ("qweight", "scales", "zeros"):
        a, b = getattr(new, name), getattr(old, name)
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous(), name
        assert torch.equal(a, b), f"{name}: {(a != b).sum()} of {b.numel()} values differ"


def _weight(n, k, seed, dtype=torch.float32):
    """Random weights with the features quantization must get right: a heavy tail, ties of
    opposite sign in a group's largest magnitude, an all-zero row and a constant row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[:, ::7] *= 6.0  # outliers
    if n > 3 and k >= 4:
        w[1, :4] = torch.tensor([0.5, -0.5, 0.25, -0.5])  # |max| ties, first one positive
        w[1, 4:] = w[1, 4:].clamp(-0.4, 0.4)
        w[2] = 0.0
        w[3] = 0.125
    return w.to(dtype)


#: (bits, group_size (-1 per channel), symmetric, out, in): the 1.7B's group 128 and 32, groups
#: that leave 64/32 for an in not divisible, rows not a multiple of 16 or of a chunk, a row
#: wider than a chunk (one row per chunk)
CASES = [(4, 128, True, 96, 2048), (4, 32, True, 70, 576), (4, 64, True, 33, 1536),
         (4, 32, False, 40, 192), (4, -1, True, 20, 128), (4, 96, False, 33, 192),
         (8, -1, True, 48, 2048), (8, 32, False, 40, 64), (8, 16, True, 17, 48),
         (8, -1, False, 21, 96), (4, 128, True, 3, 1 << 17), (8, 64, True, 5, 3 * (1 << 15))]


@pytest.mark.parametrize("bits,group_size,symmetric,n,k", CASES)
def test_quantize_weight_is_bit_identical_to_the_whole_tensor_code(bits, group_size, symmetric,
                                                                    n, k):
    w = _weight(n, k, seed=n + k)
    new = ref_quant.quantize_weight(w, bits, group_size, symmetric)
    _same_weight(new, old_quantize_weight(w, bits, group_size, symmetric))


@pytest.mark.parametrize("first", [1.0, -1.0])
def test_ties_of_opposite_sign_take_the_first_as_before(first):
    """Groups whose largest magnitude appears with both signs (common in weights stored in bf16
    or coarsely): the scale's sign comes from the first, as argmax of |w| picked it."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(64, 256, generator=g) * 4).round() / 32  # many equal magnitudes
    w[:, 0], w[:, 1] = first * 0.25, -first * 0.25  # ties at the front of group 0
    w[5, 130], w[5, 140] = -0.5, 0.5
    for symmetric in (True, False):
        _same_weight(ref_quant.quantize_weight(w, 4, 128, symmetric),
                     old_quantize_weight(w, 4, 128, symmetric))
    bf16 = _weight(48, 512, seed=6, dtype=torch.bfloat16)
    _same_weight(ref_quant.quantize_weight(bf16, 4, 32), old_quantize_weight(bf16, 4, 32, True))


@pytest.mark.parametrize("chunk", [1, 100, 1 << 12])
def test_the_bytes_do_not_depend_on_the_chunk_size(monkeypatch, chunk):
    w = _weight(50, 256, seed=4)
    for bits, symmetric in ((4, True), (4, False), (8, True)):
        monkeypatch.setattr(ref_quant, "CHUNK_ELEMENTS", chunk)
        _same_weight(ref_quant.quantize_weight(w, bits, 32, symmetric),
                     old_quantize_weight(w, bits, 32, symmetric))


@pytest.mark.parametrize("layout", ["bfloat16", "transposed", "column_slice"])
def test_other_dtypes_and_strides_quantize_as_before(layout):
    """A bf16 weight, a transposed one (a transformers Conv1D's ``w.t()``) and a slice of the
    input features (a tensor-parallel shard) read as the float32 copy the old code made."""
    w = _weight(64, 384, seed=9)
    if layout == "bfloat16":
        w = w.to(torch.bfloat16)
    elif layout == "transposed":
        w = w.t().contiguous().t()
    else:
        w = _weight(64, 512, seed=9)[:, 64:448]
    for bits, group, symmetric in ((4, 128, True), (4, 32, False), (8, -1, True)):
        _same_weight(ref_quant.quantize_weight(w, bits, group, symmetric),
                     old_quantize_weight(w, bits, group, symmetric))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_a_non_finite_value_anywhere_is_still_refused(monkeypatch, bad, bits, symmetric):
    """Found from the per-group reductions (a group's max / min / largest magnitude), in the
    last chunk, beside a larger finite value, or with NaN and inf in one group."""
    monkeypatch.setattr(ref_quant, "CHUNK_ELEMENTS", 4096)
    for row, col, other in ((-1, 5, None), (7, 200, (7, 201, 1e30)), (3, 0, (3, 1, float("nan")))):
        w = _weight(300, 512, seed=2)
        w[row, col] = bad
        if other is not None:
            w[other[0], other[1]] = other[2]
        with pytest.raises(QuantizationError, match="NaN or inf"):
            ref_quant.quantize_weight(w, bits, 128, symmetric)


@pytest.mark.parametrize("bits,group_size,symmetric,n,k", CASES)
def test_native_packing_is_bit_identical(bits, group_size, symmetric, n, k):
    qw = old_quantize_weight(_weight(n, k, seed=n * k), bits, group_size, symmetric)
    tensors, meta = cpu_quant._pack_native(qw)
    old_tensors, old_meta = old_pack_native(qw)
    assert meta == old_meta and tensors.keys() == old_tensors.keys()
    for name, t in tensors.items():
        old = old_tensors[name]
        assert t.dtype == old.dtype and t.shape == old.shape, name
        assert t.stride() == old.stride(), name  # the compile cache keys on strides
        assert torch.equal(t, old), name
    assert torch.equal(ref_quant.int_weight(cpu_quant.unpack_native(
        ref_quant.PackedQuantWeight("cpu", qw.spec, torch.bfloat16, tensors, meta))),
        ref_quant.int_weight(qw))


def test_pack_int4_matches_the_old_packing_on_every_pair():
    q = torch.cartesian_prod(torch.arange(-8, 8), torch.arange(-8, 8)).to(torch.int8)  # [256, 2]
    assert torch.equal(ref_quant.pack_int4(q.reshape(1, -1)), _old_pack_int4(q.reshape(1, -1)))

"""The torch references against independent oracles: they are what every backend is held to
(tests/test_kernel_parity.py), so they are checked against something other than themselves.

Rotary against HF's own rotary functions (Llama, GPT-NeoX partial, GPT-J interleaved partial);
activations against float64 formulas; attention against float64 ``scaled_dot_product_attention``,
HF BLOOM's ALiBi attention, HF's sliding-window mask function and GPT-Neo's local-attention
mask; decode against prefill's last row; the KV-cache write against a hand-made cache; the
weight-only quantization format (error bounds, int4 packing, asymmetric vs symmetric, errors)
and ``quant_linear`` = dequantize then ``F.linear``. Oracles in float64 vs the float32
reference: 1e-5 (``F64``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_inputs import (F64, QUANT_SPECS, garbage_cache, heads, padding_mask, positions, qkv,
                           quant_weight, quant_x, randn, window_starts, write_case)
from shardwise import KernelError
from shardwise.kernels.reference import activations as act, attention as att
from shardwise.kernels.reference import kv_cache as kv, quant as ref, rotary as rot
from shardwise.kernels.reference.quant import (QuantizationError, QuantizedWeight,
                                               dequantize_weight, quantize_weight)


# ----- rotary, activations, attention, KV cache ------------------------------------------------


def test_rotary_matches_hf_llama():
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as hf

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, rope_theta=500000.0)
    q, k, _ = qkv(2, 4, 2, 6, 6, 32)
    pos = positions(2, 6)
    cos, sin = hf.LlamaRotaryEmbedding(config)(q, pos)  # [batch, seq, 32]: cat(c, c)
    my_cos, my_sin = rot.rotary_cos_sin(pos, 32, base=500000.0)
    torch.testing.assert_close(my_cos, cos[..., :16], **F64)
    torch.testing.assert_close(my_sin, sin[..., :16], **F64)
    for want, got in zip(hf.apply_rotary_pos_emb(q, k, cos, sin), rot.rotary(q, k, my_cos, my_sin)):
        torch.testing.assert_close(got, want, **F64)


def test_rotary_matches_hf_gpt_neox_partial():
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox import modeling_gpt_neox as hf

    config = GPTNeoXConfig(hidden_size=128, num_attention_heads=4, rotary_pct=0.25)
    q, k, _ = qkv(2, 4, 4, 5, 5, 32)
    pos = positions(2, 5)
    cos, sin = hf.GPTNeoXRotaryEmbedding(config)(q, pos)  # [batch, seq, 8]: rotary_dim 8
    assert cos.shape[-1] == 8
    got = rot.rotary(q, k, cos[..., :4], sin[..., :4])
    for want, g in zip(hf.apply_rotary_pos_emb(q, k, cos, sin), got):
        torch.testing.assert_close(g, want, **F64)
    torch.testing.assert_close(got[0][..., 8:], q[..., 8:], atol=0, rtol=0)  # passed through


def test_rotary_matches_hf_gptj_interleaved_partial():
    from transformers.models.gptj import modeling_gptj as hf

    rotary_dim, pos = 8, positions(2, 5)
    q, k, _ = qkv(2, 4, 4, 5, 5, 32)
    # GPTJAttention.forward: a [max_pos, rotary_dim] sin|cos table gathered by position, applied
    # to the first rotary_dim dims of [batch, seq, heads, d] tensors
    sin, cos = hf.create_sinusoidal_positions(64, rotary_dim)[pos].split(rotary_dim // 2, -1)

    def gptj(x):
        x = x.transpose(1, 2)
        rot = hf.apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos)
        return torch.cat([rot, x[..., rotary_dim:]], -1).transpose(1, 2)

    my_cos, my_sin = rot.rotary_cos_sin(pos, rotary_dim)
    torch.testing.assert_close(my_cos, cos, **F64)
    got = rot.rotary(q, k, my_cos, my_sin, style="interleaved")
    torch.testing.assert_close(got[0], gptj(q), **F64)
    torch.testing.assert_close(got[1], gptj(k), **F64)


def test_rotary_styles_differ_and_bad_inputs_raise():
    q, k, _ = qkv(1, 2, 2, 3, 3, 16)
    cos, sin = rot.rotary_cos_sin(torch.arange(1, 4), 16)
    assert not torch.allclose(rot.rotary(q, k, cos, sin)[0],
                              rot.rotary(q, k, cos, sin, style="interleaved")[0])
    with pytest.raises(KernelError, match="style"):
        rot.rotary(q, k, cos, sin, style="neox")
    big = rot.rotary_cos_sin(torch.arange(3), 32)
    with pytest.raises(KernelError, match="rotary_dim"):
        rot.rotary(q, k, *big)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_matches_float64_formula(approximate):
    x, bias = randn(3, 7, 33, scale=3), randn(33, seed=1)
    h = x.double() + bias.double()
    if approximate == "none":
        want = 0.5 * h * (1 + torch.erf(h / 2 ** 0.5))
    else:
        want = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h ** 3)))
    torch.testing.assert_close(act.bias_gelu(x, bias, approximate).double(), want, **F64)
    torch.testing.assert_close(act.bias_gelu(x + bias, None, approximate).double(), want, **F64)


def test_bias_relu_matches_float64_formula():
    x, bias = randn(3, 7, 33, scale=3), randn(33, seed=1)
    want = (x.double() + bias.double()).clamp_min(0)
    torch.testing.assert_close(act.bias_relu(x, bias).double(), want, **F64)
    torch.testing.assert_close(act.bias_relu(x + bias).double(), want, **F64)
    assert want.eq(0).any() and want.gt(0).any()
    xb, bb = x.bfloat16(), bias.bfloat16()  # one rounding: relu commutes with it
    assert torch.equal(act.bias_relu(xb, bb), (xb.float() + bb.float()).bfloat16().relu())


def test_silu_and_mul_matches_float64_formula():
    x = randn(2, 5, 2 * 24, scale=3)
    gate, up = x.double().chunk(2, -1)
    want = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(act.silu_and_mul(x).double(), want, **F64)
    torch.testing.assert_close(act.silu_and_mul(*x.chunk(2, -1)).double(), want, **F64)
    with pytest.raises(KernelError, match="even"):
        act.silu_and_mul(x[..., :-1])


def _sdpa64(q, k, v, visible):
    """Oracle: float64 SDPA over explicitly repeated kv heads with a bool mask [b, 1, q, kv]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=visible)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_matches_float64_sdpa(kv_heads, causal):
    q, k, v = qkv(2, 4, kv_heads, 9, 9, 16)
    visible = torch.ones(9, 9, dtype=torch.bool)
    visible = visible.tril() if causal else visible
    torch.testing.assert_close(att.attention_prefill(q, k, v, causal=causal).double(),
                               _sdpa64(q, k, v, visible), **F64)


def test_prefill_chunk_after_cached_tokens_is_bottom_right_causal():
    q, k, v = qkv(1, 2, 1, 3, 8, 16)
    visible = torch.arange(8)[None, :] <= torch.arange(5, 8)[:, None]  # query i at 5 + i
    torch.testing.assert_close(att.attention_prefill(q, k, v).double(),
                               _sdpa64(q, k, v, visible), **F64)
    with pytest.raises(KernelError, match="q_len"):
        att.attention_prefill(k, q[:, :1], q[:, :1])  # q_len 8 > kv_len 3


def test_prefill_padding_mask_and_rows_without_keys():
    q, k, v = qkv(3, 4, 2, 7, 7, 16)
    mask = padding_mask(3, 7)
    out = att.attention_prefill(q, k, v, key_padding_mask=mask)
    visible = torch.ones(7, 7, dtype=torch.bool).tril() & mask[:, None, None, :]
    live = visible.any(-1)[:, 0]  # [batch, q_len]: query rows that see a key
    want = _sdpa64(q, k, v, visible)
    torch.testing.assert_close(out.transpose(1, 2)[live].double(), want.transpose(1, 2)[live],
                               **F64)
    assert (~live).any() and out.transpose(1, 2)[~live].eq(0).all()  # pad queries: zeros
    # an int 0/1 mask means the same
    torch.testing.assert_close(att.attention_prefill(q, k, v, key_padding_mask=mask.long()), out)


def _hf_sliding_window(window, q_len, kv_len):
    """HF's sliding-window causal mask [q_len, kv_len] (Mistral/Qwen2/Phi-3 ``sliding_window``)
    for queries at the last q_len of kv_len positions."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    q_idx = torch.arange(kv_len - q_len, kv_len)[:, None]
    return sliding_window_causal_mask_function(window)(0, 0, q_idx, torch.arange(kv_len)[None])


def test_hf_sliding_window_is_gpt_neo_local_attention():
    """GPT-Neo's local layers mask ``tril(ones) ^ tril(ones, -window_size)``: the same keys."""
    ones = torch.ones(10, 10, dtype=torch.bool)
    for window in (1, 3, 10):
        neo = torch.bitwise_xor(ones.tril(), ones.tril(-window))
        assert torch.equal(_hf_sliding_window(window, 10, 10), neo)


@pytest.mark.parametrize("window", [1, 3, 8, 20])  # 20: wider than the sequence
@pytest.mark.parametrize("q_len,kv_len,kv_heads", [(9, 9, 4), (9, 9, 1), (3, 11, 2)])
def test_prefill_sliding_window_matches_hf_mask(window, q_len, kv_len, kv_heads):
    q, k, v = qkv(2, 4, kv_heads, q_len, kv_len, 16)
    visible = _hf_sliding_window(window, q_len, kv_len)
    torch.testing.assert_close(att.attention_prefill(q, k, v, window=window).double(),
                               _sdpa64(q, k, v, visible), **F64)
    if window >= kv_len:  # no key out of reach: plain causal attention
        torch.testing.assert_close(att.attention_prefill(q, k, v, window=window),
                                   att.attention_prefill(q, k, v), atol=0, rtol=0)


def test_prefill_sliding_window_with_padding_and_alibi():
    """Windows count positions (pads included, as HF's masks do), combined with the padding
    mask and BLOOM's ALiBi bias; left-padding query rows stay zero."""
    q, k, v = qkv(3, 4, 2, 9, 9, 16)
    mask, slopes = padding_mask(3, 9), att.alibi_slopes(4)
    out = att.attention_prefill(q, k, v, key_padding_mask=mask, alibi_slopes=slopes, window=4)
    visible = _hf_sliding_window(4, 9, 9) & mask[:, None, None, :]  # [3, 1, 9, 9]
    pos = att.alibi_key_positions(mask, 3, 9, "cpu").double()  # BLOOM's, checked above
    bias = slopes.double()[None, :, None, None] * pos[:, None, None, :]
    bias = bias.masked_fill(~visible, float("-inf"))
    live = visible.any(-1)[:, 0]  # [batch, q_len]
    group = q.shape[1] // k.shape[1]
    want = F.scaled_dot_product_attention(q.double(), *(t.double().repeat_interleave(group, 1)
                                                         for t in (k, v)), attn_mask=bias)
    torch.testing.assert_close(out.transpose(1, 2)[live].double(), want.transpose(1, 2)[live],
                               **F64)
    assert out.transpose(1, 2)[~live].eq(0).all()


def _hf_bloom_attention(q, k, v, key_padding_mask):
    """HF BLOOM's own attention (BloomAttention.forward with build_alibi_tensor and an additive
    causal+padding mask), fed our q/k/v through its fused-qkv projection."""
    from transformers import BloomConfig
    from transformers.models.bloom import modeling_bloom as hf

    batch, heads, seq, d = q.shape
    fused = torch.stack([q, k, v], 3).permute(0, 2, 1, 3, 4).reshape(batch, seq, heads * 3 * d)

    class _Fused(torch.nn.Module):
        def forward(self, hidden):
            return fused

    attn = hf.BloomAttention(BloomConfig(hidden_size=heads * d, n_head=heads), layer_idx=0).eval()
    attn.query_key_value, attn.dense = _Fused(), torch.nn.Identity()
    alibi = hf.build_alibi_tensor(key_padding_mask.long(), heads, torch.float32)
    visible = torch.ones(seq, seq, dtype=torch.bool).tril() & key_padding_mask[:, None, None, :]
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    zeros = torch.zeros(batch, seq, heads * d)
    with torch.no_grad():
        out, _ = attn(zeros, zeros, alibi, additive)
    return out.view(batch, seq, heads, d).transpose(1, 2), visible.any(-1)[:, 0]


@pytest.mark.parametrize("heads", [4, 6])  # 6: BLOOM's extra slopes for non-powers of 2
def test_prefill_alibi_matches_hf_bloom(heads):
    from transformers.models.bloom import modeling_bloom as hf

    torch.testing.assert_close(att.alibi_slopes(heads), hf._get_alibi_slopes(heads, "cpu"),
                               atol=0, rtol=0)
    q, k, v = qkv(3, heads, heads, 8, 8, 16)
    mask = padding_mask(3, 8)
    want, live = _hf_bloom_attention(q, k, v, mask)
    got = att.attention_prefill(q, k, v, key_padding_mask=mask,
                                alibi_slopes=att.alibi_slopes(heads))
    torch.testing.assert_close(got.transpose(1, 2)[live], want.transpose(1, 2)[live], **F64)
    no_alibi = att.attention_prefill(q, k, v, key_padding_mask=mask)
    assert not torch.allclose(no_alibi, got, atol=1e-3)  # the bias matters at these sizes


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("starts", [None, [3, 0, 0, 5]])
def test_decode_matches_float64_sdpa_and_ignores_garbage(kv_heads, starts):
    lengths = [11, 1, 0, 16]
    q = heads(4, 4, 1, 16)
    k_cache, v_cache = garbage_cache(4, kv_heads, 16, 16, lengths, torch.float32, starts=starts)
    out = att.attention_decode(q, k_cache, v_cache, torch.tensor(lengths),
                               starts=torch.tensor(starts) if starts else None)
    assert torch.isfinite(out).all()
    for b, n in enumerate(lengths):
        s = starts[b] if starts else 0
        want = (torch.zeros(1, 4, 1, 16, dtype=torch.float64) if n == 0 else
                _sdpa64(q[b:b + 1], k_cache[b:b + 1, :, s:n], v_cache[b:b + 1, :, s:n], None))
        torch.testing.assert_close(out[b:b + 1].double(), want, **F64)


@pytest.mark.parametrize("alibi", [False, True])
def test_decode_after_left_padded_prompt_equals_prefill(alibi):
    """A left-padded prompt written to the cache as is, decoded with ``starts`` = its padding,
    gives the last row of the padded prefill (with BLOOM's ALiBi positions too)."""
    q, k, v = qkv(3, 4, 2, 7, 7, 16)
    mask = padding_mask(3, 7)  # pads 0, 3, 6
    slopes = att.alibi_slopes(4) if alibi else None
    full = att.attention_prefill(q, k, v, key_padding_mask=mask, alibi_slopes=slopes)
    k_cache, v_cache = garbage_cache(3, 2, 12, 16, [7] * 3, torch.float32)
    kv.kv_cache_write(k_cache, v_cache, k, v, 0)
    got = att.attention_decode(q[:, :, -1:], k_cache, v_cache, torch.tensor([7] * 3),
                               starts=torch.tensor([0, 3, 6]), alibi_slopes=slopes)
    torch.testing.assert_close(got, full[:, :, -1:], **F64)


def test_decode_alibi_equals_prefill_last_row():
    """Decoding token n with ALiBi equals the last row of a causal prefill over n tokens."""
    q, k, v = qkv(1, 4, 4, 6, 6, 16)
    slopes = att.alibi_slopes(4)
    full = att.attention_prefill(q, k, v, alibi_slopes=slopes)
    k_cache, v_cache = garbage_cache(1, 4, 9, 16, [6], torch.float32)
    k_cache[:, :, :6], v_cache[:, :, :6] = k, v
    got = att.attention_decode(q[:, :, -1:], k_cache, v_cache, torch.tensor([6]),
                               alibi_slopes=slopes)
    torch.testing.assert_close(got, full[:, :, -1:], **F64)


@pytest.mark.parametrize("window", [1, 5, 12])
@pytest.mark.parametrize("starts", [None, [3, 0, 0, 5]])
def test_decode_window_matches_float64_sdpa_and_ignores_garbage(window, starts):
    """Only positions max(start, length - window) .. length - 1 are read (the rest is NaN)."""
    lengths = [11, 1, 0, 16]
    firsts = window_starts(lengths, starts, window)
    q = heads(4, 4, 1, 16)
    k_cache, v_cache = garbage_cache(4, 2, 16, 16, lengths, torch.float32, starts=firsts)
    out = att.attention_decode(q, k_cache, v_cache, torch.tensor(lengths), window=window,
                               starts=torch.tensor(starts) if starts else None)
    assert torch.isfinite(out).all() and out[2].eq(0).all()
    for b, (s, n) in enumerate(zip(firsts, lengths)):
        if n:
            want = _sdpa64(q[b:b + 1], k_cache[b:b + 1, :, s:n], v_cache[b:b + 1, :, s:n], None)
            torch.testing.assert_close(out[b:b + 1].double(), want, **F64)


@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("window", [2, 5, 9])
def test_decode_window_equals_windowed_prefill_last_row(alibi, window):
    """A left-padded prompt in the cache, decoded with ``starts`` and a window, gives the last
    row of the windowed, padded prefill (pads count as positions in both)."""
    q, k, v = qkv(3, 4, 2, 7, 7, 16)
    mask = padding_mask(3, 7)  # pads 0, 3, 6
    slopes = att.alibi_slopes(4) if alibi else None
    full = att.attention_prefill(q, k, v, key_padding_mask=mask, alibi_slopes=slopes,
                                 window=window)
    k_cache, v_cache = garbage_cache(3, 2, 12, 16, [7] * 3, torch.float32)
    kv.kv_cache_write(k_cache, v_cache, k, v, 0)
    got = att.attention_decode(q[:, :, -1:], k_cache, v_cache, torch.tensor([7] * 3),
                               starts=torch.tensor([0, 3, 6]), alibi_slopes=slopes,
                               window=window)
    torch.testing.assert_close(got, full[:, :, -1:], **F64)


def test_decode_rejects_bad_lengths():
    q = heads(2, 2, 1, 16)
    k_cache, v_cache = garbage_cache(2, 2, 8, 16, [8, 8], torch.float32)
    with pytest.raises(KernelError, match="max_tokens"):
        att.attention_decode(q, k_cache, v_cache, torch.tensor([3, 9]))
    with pytest.raises(KernelError, match="starts <= lengths"):
        att.attention_decode(q, k_cache, v_cache, torch.tensor([3, 4]),
                             starts=torch.tensor([4, 0]))
    with pytest.raises(KernelError, match="lengths"):
        att.attention_decode(q, k_cache, v_cache, torch.tensor([3.0, 1.0]))


@pytest.mark.parametrize("positions", [4, [0, 7]])
def test_kv_cache_write_places_tokens(positions):
    (k_cache, v_cache), (k_new, v_new) = write_case()
    k_want, v_want = k_cache.clone(), v_cache.clone()
    starts = positions if isinstance(positions, list) else [positions] * 2
    for b, p in enumerate(starts):
        k_want[b, :, p:p + 3], v_want[b, :, p:p + 3] = k_new[b], v_new[b]
    pos = torch.tensor(positions) if isinstance(positions, list) else positions
    kv.kv_cache_write(k_cache, v_cache, k_new, v_new, pos)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


# ----- weight-only quantization: the format and the reference op --------------------------------


@pytest.mark.parametrize("bits,symmetric", QUANT_SPECS)
@pytest.mark.parametrize("group_size", [16, 32, -1])
def test_dequantize_error_is_at_most_half_a_step(bits, symmetric, group_size):
    """Round to nearest: every weight is within scale/2 of its dequantized value (float32
    rounding aside: 1e-6 relative)."""
    w = quant_weight(48, 64, offset=0.02)
    qw = quantize_weight(w, bits, group_size, symmetric)
    size = 64 if group_size == -1 else group_size
    diff = (dequantize_weight(qw) - w).reshape(48, 64 // size, size)
    if bits == 4 and symmetric:  # searched scales may clip: held to Q4_0's error instead
        _assert_no_worse_than_q4_0(w.reshape(48, 64 // size, size), diff)
        return
    err = diff.abs().amax(-1)
    assert bool((err <= qw.scales * (0.5 + 1e-6)).all()), (err / qw.scales).max()
    # ... and the bound is tight enough to mean something: a step is small against the weights.
    assert qw.scales.max() < w.abs().max() / (6 if bits == 4 else 100)


def _assert_no_worse_than_q4_0(wg: torch.Tensor, diff: torch.Tensor) -> None:
    """Symmetric int4 scales are searched (least squares weighted by w², which may clip the
    largest values): each group's weighted squared error is at most that of Q4_0's scale
    (the signed largest value / -8) with its rounded codes. wg, diff: [out, groups, size]."""
    m = wg.gather(-1, wg.abs().argmax(-1, keepdim=True))  # [out, groups, 1]
    d = m / -8
    q0_err = wg - d * (wg / d).round().clamp(-8, 7)
    weighted = lambda e: (wg * wg * e * e).sum(-1)  # noqa: E731
    assert bool((weighted(diff) <= weighted(q0_err) * (1 + 1e-5) + 1e-12).all())


@pytest.mark.parametrize("bits,symmetric", QUANT_SPECS)
def test_storage_dtypes_and_shapes(bits, symmetric):
    qw = quantize_weight(quant_weight(48, 64), bits, 16, symmetric)
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
    assert q.shape == (48, 64)
    if bits == 4 and symmetric:  # searched scales (Q4_0's way): the -8 code is used too
        assert int(q.min()) >= -8 and int(q.max()) <= 7 and int(q.min()) == -8
        return
    # symmetric int8 leaves the most negative code unused (nothing is clipped); asymmetric maps
    # each group's min and max onto the full range.
    lo = -qmax if symmetric else -qmax - 1
    assert int(q.min()) == lo and int(q.max()) == qmax


@pytest.mark.parametrize("group_size", [None, -1])
def test_per_channel_group(group_size):
    qw = quantize_weight(quant_weight(8, 40), 8, group_size)
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


@pytest.mark.parametrize("bits,symmetric", QUANT_SPECS)
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
        quantize_weight(quant_weight(4, 32), bits, 16)


@pytest.mark.parametrize("group_size", [48, 0, 7, 128])
def test_bad_group_size_names_both_numbers(group_size):
    with pytest.raises(ValueError, match=f"group_size {group_size} does not divide "
                                         "in_features 64"):
        quantize_weight(quant_weight(4, 64), 8, group_size)


def test_other_bad_inputs():
    with pytest.raises(QuantizationError, match="in_features 33 must be even"):
        quantize_weight(quant_weight(4, 33), 4, -1)
    with pytest.raises(QuantizationError, match="NaN or inf"):
        quantize_weight(torch.full((4, 32), float("nan")), 8)
    with pytest.raises(QuantizationError, match="float weight"):
        quantize_weight(torch.ones(4, 32, dtype=torch.int32), 8)
    assert issubclass(QuantizationError, KernelError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_dequantize_then_linear(dtype):
    qw = quantize_weight(quant_weight(48, 64), 4, 16, False)
    x, bias = quant_x((2, 3, 64), dtype), quant_x((48,), dtype, seed=2)
    want = F.linear(x, dequantize_weight(qw).to(dtype), bias)
    assert torch.equal(ref.quant_linear(x, ref.prepack(qw), bias), want)

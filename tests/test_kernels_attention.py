"""The attention kernel family: rotary, bias_gelu, bias_relu, silu_and_mul, attention_prefill,
attention_decode (both with sliding windows), kv_cache_write.

(a) the references against independent oracles: HF's own rotary functions (Llama, GPT-NeoX
partial, GPT-J interleaved partial), HF BLOOM's ALiBi attention, HF's sliding-window mask
function and GPT-Neo's local-attention mask, float64 formulas and float64
``scaled_dot_product_attention``; (b) registry: every op defined, resolved per backend/dtype;
(c) the ``cpu`` backend against the reference; (d) the Triton kernels under ``TRITON_INTERPRET=1``
(or on a GPU) on tiny ragged shapes, several decode splits; (e) ``gpu``-marked tests: Triton
through registry resolution at model sizes.

Tolerances (``assert_close``: ``|a - b| <= atol + rtol * |b|``):
* fp32 1e-5: float32 math on both sides, only the order of sums (and FMAs) differs;
* fp16 2e-3 / bf16 2e-2 (1-2 units in the last place): backends round at other points than the
  reference (bias add or silu rounded before the next op, P rounded to the value dtype before
  P @ V), and Triton's interpreter rounds float32 → bf16 by truncation.
* oracles in float64 vs the float32 reference: 1e-5.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import shardwise
from shardwise import Accelerator, KernelError
from shardwise.accelerators.cpu import CpuAccelerator
from shardwise.kernel_registry import KernelRegistry
from shardwise.kernels.cpu import activations as _cpu_act, attention as _cpu_att
from shardwise.kernels.cpu import kv_cache as _cpu_kv, rotary as _cpu_rot
from shardwise.kernels.reference import activations as _ref_act, attention as _ref_att
from shardwise.kernels.reference import kv_cache as _ref_kv, rotary as _ref_rot


def _merged(*modules):
    """One namespace over the per-family modules (public names; ``OPS``/``REGISTERED`` merged)."""
    names = {}
    for m in modules:
        names.update({k: v for k, v in vars(m).items() if not k.startswith("__")})
    for table in ("OPS", "REGISTERED"):
        if any(hasattr(m, table) for m in modules):
            names[table] = {k: v for m in modules for k, v in getattr(m, table, {}).items()}
    return SimpleNamespace(**names)


cpu = _merged(_cpu_rot, _cpu_act, _cpu_att, _cpu_kv)
ref = _merged(_ref_rot, _ref_act, _ref_att, _ref_kv)

OPS = ("rotary", "bias_gelu", "bias_relu", "silu_and_mul", "attention_prefill",
       "attention_decode", "kv_cache_write")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
F64 = dict(atol=1e-5, rtol=1e-5)
DTYPES = [torch.float32, torch.bfloat16]
CPU_DTYPES = sorted(cpu.DTYPES, key=str)  # every dtype the cpu backend may claim


class _FakeCuda(Accelerator):
    """Claims the cuda device type without touching a GPU: resolution only, no launches."""

    name = "fake-cuda"
    device_type = "cuda"
    kernel_backends = ("triton",)


def _randn(*shape, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _heads(batch, n_heads, seq, d, dtype=torch.float32, device="cpu", seed=0):
    """[batch, n_heads, seq, d] as a transposed view of [batch, seq, n_heads, d]: the layout a
    projection gives, so kernels see non-contiguous strides."""
    return _randn(batch, seq, n_heads, d, dtype=dtype, device=device, seed=seed).transpose(1, 2)


def _qkv(batch, q_heads, kv_heads, q_len, kv_len, d, dtype=torch.float32, device="cpu"):
    return (_heads(batch, q_heads, q_len, d, dtype, device, 1),
            _heads(batch, kv_heads, kv_len, d, dtype, device, 2),
            _heads(batch, kv_heads, kv_len, d, dtype, device, 3))


def _padding_mask(batch, kv_len, device="cpu"):
    """[batch, kv_len] bool: sequence b is left-padded by 3 * b tokens."""
    pad = torch.arange(batch, device=device)[:, None] * 3
    return torch.arange(kv_len, device=device)[None, :] >= pad


def _positions(batch, seq, device="cpu"):
    """Ragged position ids [batch, seq]: sequence b starts at 5 * b (a decode offset)."""
    starts = 5 * torch.arange(batch, device=device)
    return torch.arange(seq, device=device)[None, :] + starts[:, None]


def _window_starts(lengths, starts, window):
    """The first cache position each sequence's new token sees under a sliding window."""
    starts = starts or [0] * len(lengths)
    return [max(s, n - window) if window else s for s, n in zip(starts, lengths)]


def _garbage_cache(batch, kv_heads, max_tokens, d, lengths, dtype, device="cpu", starts=None):
    """Caches whose positions outside starts[b] .. lengths[b] - 1 hold NaN (k) and 1e4 (v): any
    read of them shows."""
    k, v = (_randn(batch, kv_heads, max_tokens, d, dtype=dtype, device=device, seed=s)
            for s in (4, 5))
    for b, n in enumerate(lengths):
        first = starts[b] if starts else 0
        for sl in (slice(n, None), slice(0, first)):
            k[b, :, sl] = float("nan")
            v[b, :, sl] = 1e4
    return k, v


# ----- (a) references against independent oracles --------------------------------------------


def test_rotary_matches_hf_llama():
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as hf

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, rope_theta=500000.0)
    q, k, _ = _qkv(2, 4, 2, 6, 6, 32)
    pos = _positions(2, 6)
    cos, sin = hf.LlamaRotaryEmbedding(config)(q, pos)  # [batch, seq, 32]: cat(c, c)
    my_cos, my_sin = ref.rotary_cos_sin(pos, 32, base=500000.0)
    torch.testing.assert_close(my_cos, cos[..., :16], **F64)
    torch.testing.assert_close(my_sin, sin[..., :16], **F64)
    for want, got in zip(hf.apply_rotary_pos_emb(q, k, cos, sin), ref.rotary(q, k, my_cos, my_sin)):
        torch.testing.assert_close(got, want, **F64)


def test_rotary_matches_hf_gpt_neox_partial():
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox import modeling_gpt_neox as hf

    config = GPTNeoXConfig(hidden_size=128, num_attention_heads=4, rotary_pct=0.25)
    q, k, _ = _qkv(2, 4, 4, 5, 5, 32)
    pos = _positions(2, 5)
    cos, sin = hf.GPTNeoXRotaryEmbedding(config)(q, pos)  # [batch, seq, 8]: rotary_dim 8
    assert cos.shape[-1] == 8
    got = ref.rotary(q, k, cos[..., :4], sin[..., :4])
    for want, g in zip(hf.apply_rotary_pos_emb(q, k, cos, sin), got):
        torch.testing.assert_close(g, want, **F64)
    torch.testing.assert_close(got[0][..., 8:], q[..., 8:], atol=0, rtol=0)  # passed through


def test_rotary_matches_hf_gptj_interleaved_partial():
    from transformers.models.gptj import modeling_gptj as hf

    rotary_dim, pos = 8, _positions(2, 5)
    q, k, _ = _qkv(2, 4, 4, 5, 5, 32)
    # GPTJAttention.forward: a [max_pos, rotary_dim] sin|cos table gathered by position, applied
    # to the first rotary_dim dims of [batch, seq, heads, d] tensors
    sin, cos = hf.create_sinusoidal_positions(64, rotary_dim)[pos].split(rotary_dim // 2, -1)

    def gptj(x):
        x = x.transpose(1, 2)
        rot = hf.apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos)
        return torch.cat([rot, x[..., rotary_dim:]], -1).transpose(1, 2)

    my_cos, my_sin = ref.rotary_cos_sin(pos, rotary_dim)
    torch.testing.assert_close(my_cos, cos, **F64)
    got = ref.rotary(q, k, my_cos, my_sin, style="interleaved")
    torch.testing.assert_close(got[0], gptj(q), **F64)
    torch.testing.assert_close(got[1], gptj(k), **F64)


def test_rotary_styles_differ_and_bad_inputs_raise():
    q, k, _ = _qkv(1, 2, 2, 3, 3, 16)
    cos, sin = ref.rotary_cos_sin(torch.arange(1, 4), 16)
    assert not torch.allclose(ref.rotary(q, k, cos, sin)[0],
                              ref.rotary(q, k, cos, sin, style="interleaved")[0])
    with pytest.raises(KernelError, match="style"):
        ref.rotary(q, k, cos, sin, style="neox")
    big = ref.rotary_cos_sin(torch.arange(3), 32)
    with pytest.raises(KernelError, match="rotary_dim"):
        ref.rotary(q, k, *big)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_matches_float64_formula(approximate):
    x, bias = _randn(3, 7, 33, scale=3), _randn(33, seed=1)
    h = x.double() + bias.double()
    if approximate == "none":
        want = 0.5 * h * (1 + torch.erf(h / 2 ** 0.5))
    else:
        want = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h ** 3)))
    torch.testing.assert_close(ref.bias_gelu(x, bias, approximate).double(), want, **F64)
    torch.testing.assert_close(ref.bias_gelu(x + bias, None, approximate).double(), want, **F64)


def test_bias_relu_matches_float64_formula():
    x, bias = _randn(3, 7, 33, scale=3), _randn(33, seed=1)
    want = (x.double() + bias.double()).clamp_min(0)
    torch.testing.assert_close(ref.bias_relu(x, bias).double(), want, **F64)
    torch.testing.assert_close(ref.bias_relu(x + bias).double(), want, **F64)
    assert want.eq(0).any() and want.gt(0).any()
    xb, bb = x.bfloat16(), bias.bfloat16()  # one rounding: relu commutes with it
    assert torch.equal(ref.bias_relu(xb, bb), (xb.float() + bb.float()).bfloat16().relu())


def test_silu_and_mul_matches_float64_formula():
    x = _randn(2, 5, 2 * 24, scale=3)
    gate, up = x.double().chunk(2, -1)
    want = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(ref.silu_and_mul(x).double(), want, **F64)
    torch.testing.assert_close(ref.silu_and_mul(*x.chunk(2, -1)).double(), want, **F64)
    with pytest.raises(KernelError, match="even"):
        ref.silu_and_mul(x[..., :-1])


def _sdpa64(q, k, v, visible):
    """Oracle: float64 SDPA over explicitly repeated kv heads with a bool mask [b, 1, q, kv]."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=visible)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_matches_float64_sdpa(kv_heads, causal):
    q, k, v = _qkv(2, 4, kv_heads, 9, 9, 16)
    visible = torch.ones(9, 9, dtype=torch.bool)
    visible = visible.tril() if causal else visible
    torch.testing.assert_close(ref.attention_prefill(q, k, v, causal=causal).double(),
                               _sdpa64(q, k, v, visible), **F64)


def test_prefill_chunk_after_cached_tokens_is_bottom_right_causal():
    q, k, v = _qkv(1, 2, 1, 3, 8, 16)
    visible = torch.arange(8)[None, :] <= torch.arange(5, 8)[:, None]  # query i at 5 + i
    torch.testing.assert_close(ref.attention_prefill(q, k, v).double(),
                               _sdpa64(q, k, v, visible), **F64)
    with pytest.raises(KernelError, match="q_len"):
        ref.attention_prefill(k, q[:, :1], q[:, :1])  # q_len 8 > kv_len 3


def test_prefill_padding_mask_and_rows_without_keys():
    q, k, v = _qkv(3, 4, 2, 7, 7, 16)
    mask = _padding_mask(3, 7)
    out = ref.attention_prefill(q, k, v, key_padding_mask=mask)
    visible = torch.ones(7, 7, dtype=torch.bool).tril() & mask[:, None, None, :]
    live = visible.any(-1)[:, 0]  # [batch, q_len]: query rows that see a key
    want = _sdpa64(q, k, v, visible)
    torch.testing.assert_close(out.transpose(1, 2)[live].double(), want.transpose(1, 2)[live],
                               **F64)
    assert (~live).any() and out.transpose(1, 2)[~live].eq(0).all()  # pad queries: zeros
    # an int 0/1 mask means the same
    torch.testing.assert_close(ref.attention_prefill(q, k, v, key_padding_mask=mask.long()), out)


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
    q, k, v = _qkv(2, 4, kv_heads, q_len, kv_len, 16)
    visible = _hf_sliding_window(window, q_len, kv_len)
    torch.testing.assert_close(ref.attention_prefill(q, k, v, window=window).double(),
                               _sdpa64(q, k, v, visible), **F64)
    if window >= kv_len:  # no key out of reach: plain causal attention
        torch.testing.assert_close(ref.attention_prefill(q, k, v, window=window),
                                   ref.attention_prefill(q, k, v), atol=0, rtol=0)


def test_prefill_sliding_window_with_padding_and_alibi():
    """Windows count positions (pads included, as HF's masks do), combined with the padding
    mask and BLOOM's ALiBi bias; left-padding query rows stay zero."""
    q, k, v = _qkv(3, 4, 2, 9, 9, 16)
    mask, slopes = _padding_mask(3, 9), ref.alibi_slopes(4)
    out = ref.attention_prefill(q, k, v, key_padding_mask=mask, alibi_slopes=slopes, window=4)
    visible = _hf_sliding_window(4, 9, 9) & mask[:, None, None, :]  # [3, 1, 9, 9]
    pos = ref.alibi_key_positions(mask, 3, 9, "cpu").double()  # BLOOM's, checked above
    bias = slopes.double()[None, :, None, None] * pos[:, None, None, :]
    bias = bias.masked_fill(~visible, float("-inf"))
    live = visible.any(-1)[:, 0]  # [batch, q_len]
    group = q.shape[1] // k.shape[1]
    want = F.scaled_dot_product_attention(q.double(), *(t.double().repeat_interleave(group, 1)
                                                         for t in (k, v)), attn_mask=bias)
    torch.testing.assert_close(out.transpose(1, 2)[live].double(), want.transpose(1, 2)[live],
                               **F64)
    assert out.transpose(1, 2)[~live].eq(0).all()


@pytest.mark.parametrize("impl", [ref, cpu], ids=["ref", "cpu"])
def test_window_must_be_positive_and_causal(impl):
    q, k, v = _qkv(1, 2, 2, 4, 4, 16)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(KernelError, match="window"):
            impl.attention_prefill(q, k, v, window=bad)
    with pytest.raises(KernelError, match="causal"):
        impl.attention_prefill(q, k, v, causal=False, window=2)
    k_cache, v_cache = _garbage_cache(1, 2, 8, 16, [4], torch.float32)
    with pytest.raises(KernelError, match="window"):
        impl.attention_decode(q[:, :, :1], k_cache, v_cache, torch.tensor([4]), window=0)


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

    torch.testing.assert_close(ref.alibi_slopes(heads), hf._get_alibi_slopes(heads, "cpu"),
                               atol=0, rtol=0)
    q, k, v = _qkv(3, heads, heads, 8, 8, 16)
    mask = _padding_mask(3, 8)
    want, live = _hf_bloom_attention(q, k, v, mask)
    got = ref.attention_prefill(q, k, v, key_padding_mask=mask,
                                alibi_slopes=ref.alibi_slopes(heads))
    torch.testing.assert_close(got.transpose(1, 2)[live], want.transpose(1, 2)[live], **F64)
    no_alibi = ref.attention_prefill(q, k, v, key_padding_mask=mask)
    assert not torch.allclose(no_alibi, got, atol=1e-3)  # the bias matters at these sizes


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("starts", [None, [3, 0, 0, 5]])
def test_decode_matches_float64_sdpa_and_ignores_garbage(kv_heads, starts):
    lengths = [11, 1, 0, 16]
    q = _heads(4, 4, 1, 16)
    k_cache, v_cache = _garbage_cache(4, kv_heads, 16, 16, lengths, torch.float32, starts=starts)
    out = ref.attention_decode(q, k_cache, v_cache, torch.tensor(lengths),
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
    q, k, v = _qkv(3, 4, 2, 7, 7, 16)
    mask = _padding_mask(3, 7)  # pads 0, 3, 6
    slopes = ref.alibi_slopes(4) if alibi else None
    full = ref.attention_prefill(q, k, v, key_padding_mask=mask, alibi_slopes=slopes)
    k_cache, v_cache = _garbage_cache(3, 2, 12, 16, [7] * 3, torch.float32)
    ref.kv_cache_write(k_cache, v_cache, k, v, 0)
    got = ref.attention_decode(q[:, :, -1:], k_cache, v_cache, torch.tensor([7] * 3),
                               starts=torch.tensor([0, 3, 6]), alibi_slopes=slopes)
    torch.testing.assert_close(got, full[:, :, -1:], **F64)


def test_decode_alibi_equals_prefill_last_row():
    """Decoding token n with ALiBi equals the last row of a causal prefill over n tokens."""
    q, k, v = _qkv(1, 4, 4, 6, 6, 16)
    slopes = ref.alibi_slopes(4)
    full = ref.attention_prefill(q, k, v, alibi_slopes=slopes)
    k_cache, v_cache = _garbage_cache(1, 4, 9, 16, [6], torch.float32)
    k_cache[:, :, :6], v_cache[:, :, :6] = k, v
    got = ref.attention_decode(q[:, :, -1:], k_cache, v_cache, torch.tensor([6]),
                               alibi_slopes=slopes)
    torch.testing.assert_close(got, full[:, :, -1:], **F64)


@pytest.mark.parametrize("window", [1, 5, 12])
@pytest.mark.parametrize("starts", [None, [3, 0, 0, 5]])
def test_decode_window_matches_float64_sdpa_and_ignores_garbage(window, starts):
    """Only positions max(start, length - window) .. length - 1 are read (the rest is NaN)."""
    lengths = [11, 1, 0, 16]
    firsts = _window_starts(lengths, starts, window)
    q = _heads(4, 4, 1, 16)
    k_cache, v_cache = _garbage_cache(4, 2, 16, 16, lengths, torch.float32, starts=firsts)
    out = ref.attention_decode(q, k_cache, v_cache, torch.tensor(lengths), window=window,
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
    q, k, v = _qkv(3, 4, 2, 7, 7, 16)
    mask = _padding_mask(3, 7)  # pads 0, 3, 6
    slopes = ref.alibi_slopes(4) if alibi else None
    full = ref.attention_prefill(q, k, v, key_padding_mask=mask, alibi_slopes=slopes,
                                 window=window)
    k_cache, v_cache = _garbage_cache(3, 2, 12, 16, [7] * 3, torch.float32)
    ref.kv_cache_write(k_cache, v_cache, k, v, 0)
    got = ref.attention_decode(q[:, :, -1:], k_cache, v_cache, torch.tensor([7] * 3),
                               starts=torch.tensor([0, 3, 6]), alibi_slopes=slopes,
                               window=window)
    torch.testing.assert_close(got, full[:, :, -1:], **F64)


def test_decode_rejects_bad_lengths():
    q = _heads(2, 2, 1, 16)
    k_cache, v_cache = _garbage_cache(2, 2, 8, 16, [8, 8], torch.float32)
    with pytest.raises(KernelError, match="max_tokens"):
        ref.attention_decode(q, k_cache, v_cache, torch.tensor([3, 9]))
    with pytest.raises(KernelError, match="starts <= lengths"):
        ref.attention_decode(q, k_cache, v_cache, torch.tensor([3, 4]),
                             starts=torch.tensor([4, 0]))
    with pytest.raises(KernelError, match="lengths"):
        ref.attention_decode(q, k_cache, v_cache, torch.tensor([3.0, 1.0]))


def _write_case(dtype=torch.float32, device="cpu"):
    """Caches [2, 2, 10, 8] and 3 new tokens of k and v [2, 2, 3, 8]."""
    caches = [_randn(2, 2, 10, 8, dtype=dtype, device=device, seed=s) for s in (0, 1)]
    new = [_randn(2, 2, 3, 8, dtype=dtype, device=device, seed=s) for s in (2, 3)]
    return caches, new


@pytest.mark.parametrize("positions", [4, [0, 7]])
def test_kv_cache_write_places_tokens(positions):
    (k_cache, v_cache), (k_new, v_new) = _write_case()
    k_want, v_want = k_cache.clone(), v_cache.clone()
    starts = positions if isinstance(positions, list) else [positions] * 2
    for b, p in enumerate(starts):
        k_want[b, :, p:p + 3], v_want[b, :, p:p + 3] = k_new[b], v_new[b]
    pos = torch.tensor(positions) if isinstance(positions, list) else positions
    ref.kv_cache_write(k_cache, v_cache, k_new, v_new, pos)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


@pytest.mark.parametrize("impl", [ref.kv_cache_write, cpu.kv_cache_write], ids=["ref", "cpu"])
@pytest.mark.parametrize("positions", [8, -1, [0, 8]])
def test_kv_cache_write_past_the_end_raises_and_writes_nothing(impl, positions):
    (k_cache, v_cache), (k_new, v_new) = _write_case()
    before = k_cache.clone()
    pos = torch.tensor(positions) if isinstance(positions, list) else positions
    with pytest.raises(KernelError, match="max_tokens=10"):
        impl(k_cache, v_cache, k_new, v_new, pos)
    assert torch.equal(k_cache, before)


# ----- (b) registry ---------------------------------------------------------------------------


def test_every_attention_op_is_defined():
    reg = KernelRegistry()
    assert set(OPS) <= set(reg.ops())
    for op in OPS:
        assert reg.implementations(op)["reference"].fn is ref.OPS[op]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_resolution_follows_what_won(op, dtype):
    impl = KernelRegistry().resolve(op, CpuAccelerator(), dtype)
    fn, dtypes = cpu.REGISTERED.get(op, (None, frozenset()))
    assert impl.backend == ("cpu" if dtype in dtypes else "reference")
    assert impl.fn is (fn if dtype in dtypes else ref.OPS[op])
    assert KernelRegistry().resolve(op, CpuAccelerator(), torch.float64).backend == "reference"


def test_only_decode_attention_is_capturable():
    """The injected step calls attention_decode inside graphs only where it says it may."""
    reg = KernelRegistry()
    for op in OPS:
        cpu_impl = reg.resolve(op, CpuAccelerator(), torch.float32)
        assert cpu_impl.capturable == (op == "attention_decode")
        assert not reg.implementations(op)["reference"].capturable  # host-side lengths


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("alibi", [False, True])
def test_cpu_decode_compiles_as_an_opaque_op(window, alibi):
    """Under torch.compile (fullgraph: no graph break) the cpu decode is its custom op: the
    compiled function reads lengths/starts at run time, so new lengths need no recompile."""
    q = _heads(3, 4, 1, 16)
    slopes = ref.alibi_slopes(4) if alibi else None
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    fn = torch.compile(lambda q, k, v, n, s: cpu.attention_decode(
        q, k, v, n, starts=s, alibi_slopes=slopes, window=window), backend=backend,
        fullgraph=True, dynamic=False)
    for lengths, starts in (([11, 1, 16], [3, 0, 0]), ([16, 2, 5], [0, 1, 5])):
        k_cache, v_cache = _garbage_cache(3, 2, 16, 16, lengths, torch.float32, starts=starts)
        n, s = torch.tensor(lengths), torch.tensor(starts)
        want = ref.attention_decode(q, k_cache, v_cache, n, starts=s, alibi_slopes=slopes,
                                    window=window)
        torch.testing.assert_close(fn(q, k_cache, v_cache, n, s), want, **TOL[torch.float32])
    assert len(compiles) == 1
    assert "shardwise.cpu_attention_decode" in str(compiles[0].graph)
    torch.library.opcheck(torch.ops.shardwise.cpu_attention_decode,
                          (q, k_cache, v_cache, n, s, slopes, 0.25, window))


@pytest.mark.parametrize("op", OPS)
def test_cuda_resolves_triton(op):
    pytest.importorskip("triton")
    reg = KernelRegistry()
    impl = reg.resolve(op, _FakeCuda(), torch.bfloat16, head_dim=128)
    assert impl.backend == "triton"
    assert impl.capturable == (op == "attention_decode")  # reads lengths on the device
    assert reg.resolve(op, _FakeCuda(), torch.float64).backend == "reference"
    big = reg.resolve(op, _FakeCuda(), torch.float16, head_dim=512).backend
    assert big == ("reference" if op.startswith("attention") else "triton")


# ----- (c) cpu backend vs reference -----------------------------------------------------------


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("style", ref.ROTARY_STYLES)
@pytest.mark.parametrize("rotary_dim", [24, 10])  # head_dim 24: full and partial
def test_cpu_rotary(dtype, style, rotary_dim):
    q, k, _ = _qkv(2, 4, 2, 5, 5, 24, dtype)
    cos, sin = ref.rotary_cos_sin(_positions(2, 5), rotary_dim)
    for got, want in zip(cpu.rotary(q, k, cos, sin, style=style),
                         ref.rotary(q, k, cos, sin, style=style)):
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_cpu_bias_gelu(dtype, approximate, with_bias):
    x, bias = _randn(3, 5, 40, dtype=dtype, scale=3), _randn(40, dtype=dtype, seed=1)
    bias = bias if with_bias else None
    torch.testing.assert_close(cpu.bias_gelu(x, bias, approximate),
                               ref.bias_gelu(x, bias, approximate), **TOL[dtype])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_cpu_bias_relu(dtype, with_bias):
    x, bias = _randn(3, 5, 40, dtype=dtype, scale=3), _randn(40, dtype=dtype, seed=1)
    bias = bias if with_bias else None
    assert torch.equal(cpu.bias_relu(x, bias), ref.bias_relu(x, bias))  # the same roundings


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_cpu_silu_and_mul(dtype):
    x = _randn(3, 5, 2 * 36, dtype=dtype, scale=3)
    torch.testing.assert_close(cpu.silu_and_mul(x), ref.silu_and_mul(x), **TOL[dtype])
    gate, up = x.chunk(2, -1)
    torch.testing.assert_close(cpu.silu_and_mul(gate, up), ref.silu_and_mul(gate, up),
                               **TOL[dtype])


PREFILL_CASES = {  # name: (batch, q_heads, kv_heads, q_len, kv_len, kwargs)
    "causal-gqa": (2, 4, 2, 13, 13, {}),
    "encoder-mqa": (2, 4, 1, 13, 13, {"causal": False}),
    "chunk": (2, 4, 2, 5, 13, {}),
    "padding": (3, 4, 2, 13, 13, {"key_padding_mask": _padding_mask(3, 13)}),
    "alibi": (2, 4, 4, 13, 13, {"alibi_slopes": ref.alibi_slopes(4)}),
    "alibi-padding-gqa": (3, 4, 2, 13, 13, {"alibi_slopes": ref.alibi_slopes(4),
                                            "key_padding_mask": _padding_mask(3, 13)}),
    "window-gqa": (2, 4, 2, 13, 13, {"window": 4}),
    "window-1-mqa": (2, 4, 1, 13, 13, {"window": 1}),
    "window-wide": (2, 4, 2, 13, 13, {"window": 13}),  # reaches every key: plain causal
    "window-chunk": (2, 4, 2, 5, 13, {"window": 6}),
    "window-chunk-long": (2, 4, 2, 5, 80, {"window": 8}),  # Triton skips the first key tile
    "window-padding-alibi-gqa": (3, 4, 2, 13, 13, {"window": 5,
                                                   "alibi_slopes": ref.alibi_slopes(4),
                                                   "key_padding_mask": _padding_mask(3, 13)}),
}


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_cpu_prefill(dtype, case):
    batch, q_heads, kv_heads, q_len, kv_len, kwargs = PREFILL_CASES[case]
    q, k, v = _qkv(batch, q_heads, kv_heads, q_len, kv_len, 24, dtype)
    torch.testing.assert_close(cpu.attention_prefill(q, k, v, **kwargs),
                               ref.attention_prefill(q, k, v, **kwargs), **TOL[dtype])


DECODE_LENGTHS = [23, 1, 0, 40]  # ragged, a length 0 and a full cache of 40
DECODE_STARTS = [5, 0, 0, 17]  # left padding of the first and last sequence


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("kv_heads,alibi,starts", [(4, False, False), (2, True, True),
                                                   (1, False, True), (1, True, False)])
def test_cpu_decode_ignores_garbage(dtype, kv_heads, alibi, starts):
    q = _heads(4, 4, 1, 24, dtype)
    starts = DECODE_STARTS if starts else None
    k_cache, v_cache = _garbage_cache(4, kv_heads, 40, 24, DECODE_LENGTHS, dtype, starts=starts)
    kw = {"alibi_slopes": ref.alibi_slopes(4)} if alibi else {}
    if starts:
        kw["starts"] = torch.tensor(starts)
    lengths = torch.tensor(DECODE_LENGTHS)
    got = cpu.attention_decode(q, k_cache, v_cache, lengths, **kw)
    torch.testing.assert_close(got, ref.attention_decode(q, k_cache, v_cache, lengths, **kw),
                               **TOL[dtype])
    k_cache, v_cache = _garbage_cache(4, kv_heads, 40, 24, [17] * 4, dtype, starts=[2] * 4)
    same = torch.tensor([17] * 4)  # equal ranges: the one-call path
    kw["starts"] = torch.tensor([2] * 4)
    torch.testing.assert_close(cpu.attention_decode(q, k_cache, v_cache, same, **kw),
                               ref.attention_decode(q, k_cache, v_cache, same, **kw),
                               **TOL[dtype])


DECODE_WINDOW_CASES = [  # kv_heads, alibi, starts, window
    (2, False, False, 8), (1, True, True, 20), (4, False, True, 1), (2, True, False, 100)]


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("kv_heads,alibi,starts,window", DECODE_WINDOW_CASES)
def test_cpu_decode_window_ignores_garbage(dtype, kv_heads, alibi, starts, window):
    q = _heads(4, 4, 1, 24, dtype)
    starts = DECODE_STARTS if starts else None
    firsts = _window_starts(DECODE_LENGTHS, starts, window)  # garbage before them
    k_cache, v_cache = _garbage_cache(4, kv_heads, 40, 24, DECODE_LENGTHS, dtype, starts=firsts)
    kw = {"window": window, "alibi_slopes": ref.alibi_slopes(4) if alibi else None}
    if starts:
        kw["starts"] = torch.tensor(starts)
    lengths = torch.tensor(DECODE_LENGTHS)
    torch.testing.assert_close(cpu.attention_decode(q, k_cache, v_cache, lengths, **kw),
                               ref.attention_decode(q, k_cache, v_cache, lengths, **kw),
                               **TOL[dtype])


@pytest.mark.parametrize("positions", [4, [0, 7], [3, 3]])
def test_cpu_kv_cache_write(positions):
    (k_cache, v_cache), (k_new, v_new) = _write_case(torch.bfloat16)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    pos = torch.tensor(positions) if isinstance(positions, list) else positions
    cpu.kv_cache_write(k_cache, v_cache, k_new, v_new, pos)
    ref.kv_cache_write(k_ref, v_ref, k_new, v_new, pos)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# ----- (d) triton kernels: interpreter on CPU (tiny shapes), or the GPU when there is one -----


@pytest.fixture(scope="module")
def tri(triton_device):
    """The triton attention module, and the device its kernels run on here."""
    device = triton_device
    from shardwise.kernels.triton import activations, attention, kv_cache, rotary

    return _merged(rotary, activations, attention, kv_cache), device


TRITON_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("style", ref.ROTARY_STYLES)
@pytest.mark.parametrize("rotary_dim", [24, 8])
def test_triton_rotary(tri, dtype, style, rotary_dim):
    backend, device = tri
    q, k, _ = _qkv(2, 4, 2, 3, 3, 24, dtype, device)
    cos, sin = ref.rotary_cos_sin(_positions(2, 3, device), rotary_dim)
    got = backend.rotary(q, k, cos, sin, style=style)
    want = ref.rotary(q, k, cos, sin, style=style)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL[dtype])
    assert got[0].stride() == q.stride()  # layout kept
    shared = backend.rotary(q, k, cos[:1], sin[:1], style=style)  # [1, seq, r/2] broadcasts
    torch.testing.assert_close(shared[1], ref.rotary(q, k, cos[:1], sin[:1], style=style)[1],
                               **TOL[dtype])


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # interpreter: sigmoid(-big)
@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_bias_gelu(tri, dtype, approximate, with_bias):
    backend, device = tri
    x, bias = (_randn(2, 3, 1100, dtype=dtype, device=device, scale=3),  # 2 column blocks
               _randn(1100, dtype=dtype, device=device, seed=1))
    bias = bias if with_bias else None
    torch.testing.assert_close(backend.bias_gelu(x, bias, approximate),
                               ref.bias_gelu(x, bias, approximate), **TOL[dtype])


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_bias_relu(tri, dtype, with_bias):
    backend, device = tri
    x, bias = (_randn(2, 3, 1100, dtype=dtype, device=device, scale=3),  # 2 column blocks
               _randn(1100, dtype=dtype, device=device, seed=1))
    bias = bias if with_bias else None
    got = backend.bias_relu(x, bias)
    torch.testing.assert_close(got, ref.bias_relu(x, bias), **TOL[dtype])
    assert got.eq(0).any() and got.shape == x.shape
    strided = x[..., ::2]  # a non-unit column stride is copied first
    torch.testing.assert_close(backend.bias_relu(strided), ref.bias_relu(strided), **TOL[dtype])


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_triton_silu_and_mul(tri, dtype):
    backend, device = tri
    x = _randn(3, 2, 2 * 40, dtype=dtype, device=device, scale=3)
    torch.testing.assert_close(backend.silu_and_mul(x), ref.silu_and_mul(x), **TOL[dtype])
    gate, up = x.chunk(2, -1)
    torch.testing.assert_close(backend.silu_and_mul(gate, up), ref.silu_and_mul(gate, up),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_triton_prefill(tri, dtype, case):
    backend, device = tri
    batch, q_heads, kv_heads, q_len, kv_len, kwargs = PREFILL_CASES[case]
    q, k, v = _qkv(batch, q_heads, kv_heads, q_len, kv_len, 24, dtype, device)
    kwargs = {name: t.to(device) if isinstance(t, torch.Tensor) else t
              for name, t in kwargs.items()}
    torch.testing.assert_close(backend.attention_prefill(q, k, v, **kwargs),
                               ref.attention_prefill(q, k, v, **kwargs), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,alibi,starts", [(2, False, False), (1, True, True),
                                                   (4, False, True)])
def test_triton_decode_splits_ignore_garbage(tri, dtype, kv_heads, alibi, starts):
    backend, device = tri
    q = _heads(4, 4, 1, 24, dtype, device)
    starts = DECODE_STARTS if starts else None
    k_cache, v_cache = _garbage_cache(4, kv_heads, 40, 24, DECODE_LENGTHS, dtype, device, starts)
    lengths = torch.tensor(DECODE_LENGTHS, device=device, dtype=torch.int32)
    kw = {"alibi_slopes": ref.alibi_slopes(4, device)} if alibi else {}
    if starts:  # 17 starts in the second split
        kw["starts"] = torch.tensor(starts, device=device)
    want = ref.attention_decode(q, k_cache, v_cache, lengths, **kw)
    # 40 tokens in splits of 16: 3 splits, the last one partial; length 23 ends mid-split
    assert backend.decode_splits(4, kv_heads, 40, 16, torch.device(device), 3) == (3, 16)
    got = backend.attention_decode(q, k_cache, v_cache, lengths, num_splits=3, block_n=16, **kw)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert got[2].eq(0).all()  # length 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_prefill_window_skips_key_tiles(tri, dtype):
    """Queries 75..79 with window 8 see keys 68..79: the key tile(s) before 64 are never read
    (NaN there would poison P @ V), on the interpreter's tiles and on the GPU's."""
    backend, device = tri
    q, k, v = _qkv(2, 4, 2, 5, 80, 24, dtype, device)
    want = ref.attention_prefill(q, k, v, window=8)
    k, v = k.clone(), v.clone()
    k[:, :, :64], v[:, :, :64] = float("nan"), float("nan")
    got = backend.attention_prefill(q, k, v, window=8)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,alibi,starts,window", DECODE_WINDOW_CASES)
def test_triton_decode_window_ignores_garbage(tri, dtype, kv_heads, alibi, starts, window):
    """Window starts land mid-split (15, 20) or in the last split (32); positions before them
    hold garbage; window 100 > max_tokens hides nothing."""
    backend, device = tri
    q = _heads(4, 4, 1, 24, dtype, device)
    starts = DECODE_STARTS if starts else None
    firsts = _window_starts(DECODE_LENGTHS, starts, window)
    k_cache, v_cache = _garbage_cache(4, kv_heads, 40, 24, DECODE_LENGTHS, dtype, device, firsts)
    lengths = torch.tensor(DECODE_LENGTHS, device=device, dtype=torch.int32)
    kw = {"window": window, "alibi_slopes": ref.alibi_slopes(4, device) if alibi else None}
    if starts:
        kw["starts"] = torch.tensor(starts, device=device)
    want = ref.attention_decode(q, k_cache, v_cache, lengths, **kw)
    got = backend.attention_decode(q, k_cache, v_cache, lengths, num_splits=3, block_n=16, **kw)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert got[2].eq(0).all()  # length 0


def test_triton_window_must_be_positive_and_causal(tri):
    backend, device = tri
    q, k, v = _qkv(1, 2, 2, 4, 4, 16, torch.float32, device)
    with pytest.raises(KernelError, match="window"):
        backend.attention_prefill(q, k, v, window=0)
    with pytest.raises(KernelError, match="causal"):
        backend.attention_prefill(q, k, v, causal=False, window=2)
    k_cache, v_cache = _garbage_cache(1, 2, 8, 16, [4], torch.float32, device)
    with pytest.raises(KernelError, match="window"):
        backend.attention_decode(q[:, :, :1], k_cache, v_cache,
                                 torch.tensor([4], device=device), window=-1)


def test_triton_decode_default_split(tri):
    backend, device = tri
    q = _heads(2, 4, 1, 32, torch.float32, device)
    k_cache, v_cache = _garbage_cache(2, 2, 36, 32, [36, 5], torch.float32, device)
    lengths = torch.tensor([36, 5], device=device)
    torch.testing.assert_close(backend.attention_decode(q, k_cache, v_cache, lengths),
                               ref.attention_decode(q, k_cache, v_cache, lengths),
                               **TOL[torch.float32])


def test_triton_decode_clamps_lengths_past_the_cache(tri):
    """Lengths are not checked on the device path (no sync); they are clamped, never overread."""
    backend, device = tri
    q = _heads(1, 2, 1, 16, torch.float32, device)
    k_cache, v_cache = _garbage_cache(1, 2, 20, 16, [20], torch.float32, device)
    got = backend.attention_decode(q, k_cache, v_cache, torch.tensor([99], device=device),
                                   num_splits=2, block_n=16)
    want = ref.attention_decode(q, k_cache, v_cache, torch.tensor([20], device=device))
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_triton_refuses_tensors_on_another_device(tri):
    backend, device = tri
    q = _heads(1, 2, 1, 16, torch.float32, device)
    k_cache, v_cache = _garbage_cache(1, 2, 20, 16, [20], torch.float32, device)
    with pytest.raises(KernelError, match="lengths"):
        backend.attention_decode(q, k_cache, v_cache, torch.tensor([5], device="meta"))


@pytest.mark.parametrize("positions", [4, [0, 7]])
def test_triton_kv_cache_write(tri, positions):
    backend, device = tri
    (k_cache, v_cache), (k_new, v_new) = _write_case(torch.bfloat16, device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    pos = torch.tensor(positions, device=device) if isinstance(positions, list) else positions
    backend.kv_cache_write(k_cache, v_cache, k_new, v_new, pos)
    ref.kv_cache_write(k_ref, v_ref, k_new, v_new, pos)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_triton_kv_cache_write_bounds(tri):
    backend, device = tri
    (k_cache, v_cache), (k_new, v_new) = _write_case(torch.float32, device)
    before = k_cache.clone()
    with pytest.raises(KernelError, match="max_tokens=10"):
        backend.kv_cache_write(k_cache, v_cache, k_new, v_new, torch.tensor([0, 8], device=device))
    assert torch.equal(k_cache, before)
    # unchecked (graph capture): the in-range tokens land, the rest are dropped, nothing else moves
    backend.kv_cache_write(k_cache, v_cache, k_new, v_new, torch.tensor([0, 8], device=device),
                           check=False)
    assert torch.equal(k_cache[0, :, :3], k_new[0])
    assert torch.equal(k_cache[1, :, 8:], k_new[1, :, :2])
    assert torch.equal(k_cache[1, :, :8], before[1, :, :8])


# ----- (e) GPU: triton through registry resolution at model sizes -----------------------------


def _cuda_impl(op, dtype, head_dim=128):
    accelerator = shardwise.get_accelerator("cuda")
    if dtype not in accelerator.supported_dtypes:
        pytest.skip(f"this GPU does not run {dtype}")
    impl = KernelRegistry().resolve(op, accelerator, dtype, head_dim=head_dim)
    assert impl.backend == "triton", f"cuda resolved {op} to {impl.backend!r}"
    return impl


GPU_DTYPES = [torch.float16, torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("kv_heads", [8, 1])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("window", [None, 1000])
def test_gpu_decode_4096(dtype, batch, kv_heads, alibi, window):
    impl = _cuda_impl("attention_decode", dtype)
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(1, 4097, (batch,), generator=g).tolist()
    lengths[0] = 4096
    starts = [n // 3 if b % 2 else 0 for b, n in enumerate(lengths)]  # some left padding
    q = _heads(batch, 32, 1, 128, dtype, "cuda")
    firsts = _window_starts(lengths, starts, window)  # garbage before each window too
    k_cache, v_cache = _garbage_cache(batch, kv_heads, 4096, 128, lengths, dtype, "cuda", firsts)
    lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    kw = {"starts": torch.tensor(starts, device="cuda"), "window": window}
    if alibi:
        kw["alibi_slopes"] = ref.alibi_slopes(32, "cuda")
    torch.testing.assert_close(impl(q, k_cache, v_cache, lens, **kw),
                               ref.attention_decode(q, k_cache, v_cache, lens, **kw), **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("seq", [1, 333, 2048])
@pytest.mark.parametrize("case", ["causal-gqa", "padding-alibi", "encoder", "window-gqa",
                                  "window-padding-alibi"])
def test_gpu_prefill(dtype, seq, case):
    impl = _cuda_impl("attention_prefill", dtype)
    batch = 2
    gqa = case.endswith("gqa")
    q, k, v = _qkv(batch, 32, 8 if gqa else 32, seq, seq, 128, dtype, "cuda")
    kw = {"causal": case != "encoder"}
    if "padding-alibi" in case:
        kw.update(key_padding_mask=_padding_mask(batch, seq, "cuda"),
                  alibi_slopes=ref.alibi_slopes(32, "cuda"))
    if case.startswith("window"):  # 256 (Mistral-like, tile-aligned) and 100 (not aligned)
        kw["window"] = 256 if gqa else 100
    torch.testing.assert_close(impl(q, k, v, **kw), ref.attention_prefill(q, k, v, **kw),
                               **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("style,rotary_dim", [("half", 128), ("half", 32), ("interleaved", 64)])
def test_gpu_rotary(dtype, style, rotary_dim):
    impl = _cuda_impl("rotary", dtype)
    q, k, _ = _qkv(4, 32, 8, 512, 512, 128, dtype, "cuda")
    cos, sin = ref.rotary_cos_sin(_positions(4, 512, "cuda"), rotary_dim)
    for got, want in zip(impl(q, k, cos, sin, style=style),
                         ref.rotary(q, k, cos, sin, style=style)):
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_gpu_activations_and_cache_write(dtype):
    x = _randn(64, 2 * 11008, dtype=dtype, device="cuda", scale=3)
    bias = _randn(2 * 11008, dtype=dtype, device="cuda")
    for approximate in ("none", "tanh"):
        torch.testing.assert_close(_cuda_impl("bias_gelu", dtype)(x, bias, approximate),
                                   ref.bias_gelu(x, bias, approximate), **TOL[dtype])
    for b in (bias, None):
        torch.testing.assert_close(_cuda_impl("bias_relu", dtype)(x, b), ref.bias_relu(x, b),
                                   **TOL[dtype])
    torch.testing.assert_close(_cuda_impl("silu_and_mul", dtype)(x), ref.silu_and_mul(x),
                               **TOL[dtype])
    caches = [_randn(16, 8, 4096, 128, dtype=dtype, device="cuda", seed=s) for s in (0, 1)]
    new = [_randn(16, 8, 1, 128, dtype=dtype, device="cuda", seed=s) for s in (2, 3)]
    pos = torch.randint(0, 4096, (16,), device="cuda")
    refs = [c.clone() for c in caches]
    _cuda_impl("kv_cache_write", dtype)(*caches, *new, pos)
    ref.kv_cache_write(*refs, *new, pos)
    assert all(torch.equal(a, b) for a, b in zip(caches, refs))

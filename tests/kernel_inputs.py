"""Inputs and tolerances the kernel tests share (tests/test_kernel_parity.py, tests/
test_kernels_*.py): seeded tensors in the layouts the kernels see, and the tolerance of a backend
against the torch reference per dtype. A non-test module, so test modules need not import each
other.

Tolerances (``assert_close``: ``|a - b| <= atol + rtol * |b|``), as the kernel tests have always
used them:
* fp32 1e-5: float32 math on both sides, only the order of sums (and FMAs) differs;
* fp16 2e-3 / bf16 2e-2 (1-2 units in the last place): backends round at other points than the
  reference (bias add or silu rounded before the next op, P rounded to the value dtype before
  P @ V, ``F.rms_norm`` multiplying by the weight before rounding), and Triton's interpreter
  rounds float32 → bf16 by truncation;
* oracles in float64 vs the float32 reference: 1e-5 (``F64``).
``quant_linear`` is held to ``max|got - ref| <= QUANT_TOL[dtype] * max|ref|``: bf16 ``2**-6`` (the
CPU kernels take bf16 scales and the CPU int8 group path rounds each group's partial sum to
bf16; the interpreter truncates), fp16 ``2**-8`` (summation order, a GPU reference GEMM's own
rounding), fp32 ``1e-5`` (summation order: the native CPU kernel, held to its own 8-bit
activation math).
"""

from __future__ import annotations

import torch

from shardwise import Accelerator

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
F64 = dict(atol=1e-5, rtol=1e-5)
QUANT_TOL = {torch.bfloat16: 2.0**-6, torch.float16: 2.0**-8, torch.float32: 1e-5}
#: moe_grouped_mlp: ``max|got - ref| <= MOE_TOL[dtype] * max|ref|``. fp32 1e-5 (sum order); bf16
#: 2**-6: the backends round the [T*k, 2I] gate/up product and the activation to bf16 before the
#: down GEMM (as HF's bf16 experts do), the reference keeps float32 until the end
MOE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-8}
#: int8 / int4, symmetric or not: (bits, symmetric)
QUANT_SPECS = [(bits, sym) for bits in (8, 4) for sym in (True, False)]
EPS = 1e-5
#: decode cases: ragged lengths with a 0 and a full cache of 40, and the left padding of some
DECODE_LENGTHS = [23, 1, 0, 40]
DECODE_STARTS = [5, 0, 0, 17]


class FakeCuda(Accelerator):
    """Claims the cuda device type without touching a GPU: resolution only, no launches."""

    name = "fake-cuda"
    device_type = "cuda"
    kernel_backends = ("triton",)


def dtype_id(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``, for test ids."""
    return str(dtype).removeprefix("torch.")


# ----- attention family -----------------------------------------------------------------------


def randn(*shape, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def heads(batch, n_heads, seq, d, dtype=torch.float32, device="cpu", seed=0):
    """[batch, n_heads, seq, d] as a transposed view of [batch, seq, n_heads, d]: the layout a
    projection gives, so kernels see non-contiguous strides."""
    return randn(batch, seq, n_heads, d, dtype=dtype, device=device, seed=seed).transpose(1, 2)


def qkv(batch, q_heads, kv_heads, q_len, kv_len, d, dtype=torch.float32, device="cpu"):
    return (heads(batch, q_heads, q_len, d, dtype, device, 1),
            heads(batch, kv_heads, kv_len, d, dtype, device, 2),
            heads(batch, kv_heads, kv_len, d, dtype, device, 3))


def padding_mask(batch, kv_len, device="cpu"):
    """[batch, kv_len] bool: sequence b is left-padded by 3 * b tokens."""
    pad = torch.arange(batch, device=device)[:, None] * 3
    return torch.arange(kv_len, device=device)[None, :] >= pad


def positions(batch, seq, device="cpu"):
    """Ragged position ids [batch, seq]: sequence b starts at 5 * b (a decode offset)."""
    starts = 5 * torch.arange(batch, device=device)
    return torch.arange(seq, device=device)[None, :] + starts[:, None]


def window_starts(lengths, starts, window):
    """The first cache position each sequence's new token sees under a sliding window."""
    starts = starts or [0] * len(lengths)
    return [max(s, n - window) if window else s for s, n in zip(starts, lengths)]


def garbage_cache(batch, kv_heads, max_tokens, d, lengths, dtype, device="cpu", starts=None):
    """Caches whose positions outside starts[b] .. lengths[b] - 1 hold NaN (k) and 1e4 (v): any
    read of them shows."""
    k, v = (randn(batch, kv_heads, max_tokens, d, dtype=dtype, device=device, seed=s)
            for s in (4, 5))
    for b, n in enumerate(lengths):
        first = starts[b] if starts else 0
        for sl in (slice(n, None), slice(0, first)):
            k[b, :, sl] = float("nan")
            v[b, :, sl] = 1e4
    return k, v


def write_case(dtype=torch.float32, device="cpu"):
    """Caches [2, 2, 10, 8] and 3 new tokens of k and v [2, 2, 3, 8]."""
    caches = [randn(2, 2, 10, 8, dtype=dtype, device=device, seed=s) for s in (0, 1)]
    new = [randn(2, 2, 3, 8, dtype=dtype, device=device, seed=s) for s in (2, 3)]
    return caches, new


# ----- norms ----------------------------------------------------------------------------------


def norm_inputs(shape, dtype, device="cpu", seed=0):
    """x, residual: ``shape`` = [..., hidden]; weight, bias: [hidden]. x has a non-zero mean so
    layer_norm's centring matters; the weight is far from 1 so a dropped weight shows."""
    g = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    x = torch.randn(shape, generator=g) * 2 + 0.5
    residual = torch.randn(shape, generator=g)
    weight = torch.randn(hidden, generator=g) * 0.5 + 1
    bias = torch.randn(hidden, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (x, residual, weight, bias)]


def check_norm(got, want, x, residual, h_tol=None):
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


# ----- quant ----------------------------------------------------------------------------------


def quant_weight(out_features, in_features, seed=0, offset=0.0):
    """A float32 weight [out, in] with a per-row spread and mean, so groups differ."""
    g = torch.Generator().manual_seed(seed)
    row_scale = torch.rand(out_features, 1, generator=g) * 0.1 + 0.01
    return torch.randn(out_features, in_features, generator=g) * row_scale + offset


def quant_x(shape, dtype, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def assert_quant_matches(got, want, dtype):
    """got/want [..., out] in dtype; max abs error within QUANT_TOL[dtype] of the largest
    output."""
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    bound = QUANT_TOL[dtype] * want.float().abs().max().item()
    assert err <= bound, f"max abs error {err:.4g} > {bound:.4g} ({dtype})"


def quant_shape(bits, group_size, in_features=128, out_features=96, symmetric=True):
    """The weight-spec keywords ``resolve("quant_linear", ...)`` takes."""
    return dict(bits=bits, group_size=group_size, symmetric=symmetric, in_features=in_features,
                out_features=out_features)


# ----- moe ------------------------------------------------------------------------------------


def local_experts(experts, start, n_local):
    """Global expert ids [T, k] → the ids local to a rank holding experts start..start+n_local-1
    (the experts-module contract): ``e - start`` there, the sentinel ``n_local`` elsewhere."""
    here = (experts >= start) & (experts < start + n_local)
    return torch.where(here, experts - start, n_local)


def moe_inputs(tokens, hidden, inter, n_experts, top_k, dtype, device="cpu", seed=0,
               adversarial=False, remote=False):
    """x [T, H], gate_up [E, 2I, H], down [E, H, I] (scaled so outputs are O(1)), experts and
    weights [T, k] from a softmax router (renormalised); ``adversarial``: every token to expert
    E-1 first and expert 0 second; ``remote``: the rank that holds the first half of the experts
    (gate_up/down its E/2, experts local with the sentinel E/2 for the other half's slots)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(n_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    down = torch.randn(n_experts, hidden, inter, generator=g) * inter ** -0.5
    logits = torch.randn(tokens, n_experts, generator=g)
    probs = logits.softmax(-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if adversarial:
        experts = torch.tensor([n_experts - 1, 0][:top_k]).expand(tokens, top_k).contiguous()
    weights = weights / weights.sum(-1, keepdim=True)
    if remote:
        gate_up, down = gate_up[:n_experts // 2], down[:n_experts // 2]
        experts = local_experts(experts, 0, n_experts // 2)
    return (x.to(device, dtype), gate_up.to(device, dtype), down.to(device, dtype),
            experts.to(device), weights.to(device))


def assert_moe_matches(got, want, dtype):
    """got/want [T, H] in dtype; max abs error within MOE_TOL[dtype] of the largest output."""
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    bound = MOE_TOL[dtype] * max(want.float().abs().max().item(), 1.0)
    assert err <= bound, f"max abs error {err:.4g} > {bound:.4g} ({dtype})"

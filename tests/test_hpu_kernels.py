"""The ``hpu`` kernel backend (shardwise.kernels.hpu) against the torch reference, run on the
Gaudi bridge stand-in's ``hpex`` ops (tests/fake_habana/: the math the bridge's fused ops
document, on CPU tensors). Tolerances per dtype are tests/kernel_inputs.py's ``TOL``.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.accelerators.hpu import HpuAccelerator
from shardwise.kernel_registry import REFERENCE, KernelRegistry
from shardwise.kernels import hpu as hpu_kernels
from shardwise.kernels.reference import attention as ref_attention
from shardwise.kernels.reference.norms import rms_norm as ref_rms_norm
from shardwise.kernels.reference.rotary import rotary as ref_rotary, rotary_cos_sin
from hpu_standin import standin  # noqa: F401  (fixture)
from kernel_inputs import TOL

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def hpu_registry(standin):
    """A registry with the reference and the ``hpu`` backend registered on the stand-in."""
    registry = KernelRegistry()
    hpu_kernels.register(registry)
    return registry


def _impl(registry: KernelRegistry, op: str):
    return registry.implementations(op)["hpu"].fn


def test_registers_the_fused_ops_for_hpu_only(hpu_registry):
    registered = {op for op in hpu_registry.ops() if "hpu" in hpu_registry.implementations(op)}
    assert registered == {"rms_norm", "rotary", "attention_prefill"}
    impl = hpu_registry.implementations("rms_norm")["hpu"]
    assert impl.accepts("hpu", torch.bfloat16) and not impl.accepts("cpu", torch.bfloat16)
    assert not impl.accepts("hpu", torch.float64)


def test_resolves_per_device_through_the_entry_point(standin):
    assert HpuAccelerator.kernel_backends == ("hpu",)
    registry, acc = KernelRegistry(), HpuAccelerator()
    assert registry.resolve("rms_norm", acc, torch.bfloat16).backend == "hpu"
    assert registry.load_backend("hpu") == ""  # loaded through shardwise.kernels's entry point
    assert registry.resolve("attention_prefill", acc, torch.float16).backend == "hpu"
    assert registry.resolve("layer_norm", acc, torch.bfloat16).backend == REFERENCE
    assert registry.resolve("rms_norm", acc, torch.float64).backend == REFERENCE
    assert registry.resolve("rms_norm", acc, torch.bfloat16, device_type="cpu").backend == (
        REFERENCE)


def test_nothing_registered_without_the_bridge():
    registry = KernelRegistry()
    hpu_kernels.register(registry)  # no habana_frameworks on this machine's path
    assert all("hpu" not in registry.implementations(op) for op in registry.ops())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(hpu_registry, dtype, with_residual):
    x, w = _randn(3, 5, 64, seed=1, dtype=dtype), _randn(64, seed=2, dtype=dtype)
    residual = _randn(3, 5, 64, seed=3, dtype=dtype) if with_residual else None
    out, h = _impl(hpu_registry, "rms_norm")(x, w, 1e-6, residual)
    want_out, want_h = ref_rms_norm(x, w, 1e-6, residual)
    assert out.dtype == dtype and torch.equal(h, want_h)
    torch.testing.assert_close(out, want_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style, rotary_dim, batched", [("half", 16, False), ("half", 8, True),
                                                        ("interleaved", 16, True),
                                                        ("interleaved", 8, False)])
def test_rotary(hpu_registry, dtype, style, rotary_dim, batched):
    q, k = _randn(2, 4, 5, 16, seed=4, dtype=dtype), _randn(2, 2, 5, 16, seed=5, dtype=dtype)
    positions = torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]]) if batched else torch.arange(5)
    cos, sin = rotary_cos_sin(positions, rotary_dim)
    got = _impl(hpu_registry, "rotary")(q, k, cos, sin, style=style)
    want = ref_rotary(q, k, cos, sin, style=style)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, **TOL[dtype])


ATTENTION_CASES = {
    # name: (q_heads, kv_heads, q_len, kv_len, causal, padded)
    "causal-prompt": (4, 4, 6, 6, True, False),
    "gqa-causal": (4, 2, 6, 6, True, False),
    "mqa-not-causal": (4, 1, 3, 7, False, False),
    "causal-chunk-after-cache": (4, 2, 3, 7, True, False),
    "left-padded": (4, 2, 6, 6, True, True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention_prefill(hpu_registry, dtype, name):
    q_heads, kv_heads, q_len, kv_len, causal, padded = ATTENTION_CASES[name]
    q = _randn(2, q_heads, q_len, 16, seed=6, dtype=dtype)
    k, v = (_randn(2, kv_heads, kv_len, 16, seed=s, dtype=dtype) for s in (7, 8))
    mask = None
    if padded:  # the second sequence has two pad tokens on the left
        mask = torch.ones(2, kv_len, dtype=torch.bool)
        mask[1, :2] = False
    got = _impl(hpu_registry, "attention_prefill")(q, k, v, causal=causal, key_padding_mask=mask)
    want = ref_attention.attention_prefill(q, k, v, causal=causal, key_padding_mask=mask)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("extra", [{"window": 3}, {"alibi_slopes": "slopes"}])
def test_what_fused_sdpa_cannot_express_runs_the_reference(standin, hpu_registry, monkeypatch,
                                                           extra):
    fused = standin.bridge("habana_frameworks.torch.hpex.kernels").FusedSDPA
    calls = []
    monkeypatch.setattr(fused, "apply", lambda *a, **k: calls.append(a))
    if extra.get("alibi_slopes") == "slopes":
        extra = {"alibi_slopes": ref_attention.alibi_slopes(4)}
    q, k, v = (_randn(1, 4, 5, 16, seed=s, dtype=torch.float32) for s in (9, 10, 11))
    got = _impl(hpu_registry, "attention_prefill")(q, k, v, **extra)
    assert calls == []
    assert torch.equal(got, ref_attention.attention_prefill(q, k, v, **extra))


def test_fused_sdpa_gets_is_causal_for_a_full_prompt(standin, hpu_registry, monkeypatch):
    kernels = standin.bridge("habana_frameworks.torch.hpex.kernels")
    calls, original = [], kernels.FusedSDPA.apply
    monkeypatch.setattr(kernels.FusedSDPA, "apply",
                        lambda *a: calls.append(a[3:6]) or original(*a))
    q, k, v = (_randn(1, 4, 5, 16, seed=s, dtype=torch.float32) for s in (12, 13, 14))
    _impl(hpu_registry, "attention_prefill")(q, k, v, causal=True)
    assert calls == [(None, 0.0, True)]  # attn_mask, dropout_p, is_causal

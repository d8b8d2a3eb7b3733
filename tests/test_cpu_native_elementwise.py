"""The CPU backend's native elementwise ops (``kernels/cpu/native/elementwise.cpp``: residual-add +
RMSNorm, rotary, silu(gate) * up) against their oracles, the CPU backend's torch forms of the same
contracts (themselves tested against the reference in test_kernels_backends.py): every dtype,
row tails that are not a multiple of 16, strided q/k, partial rotary, both rotary styles, special
values; their checks for bad input; that the CPU kernels call them only inside a compiled step
(for rows at least ``NATIVE_MIN_WIDTH`` wide, and not with ``SHARDWISE_CPU_ELEMENTWISE=torch``),
giving there what the torch forms give eagerly.
A whole model whose compiled step calls them (the widths lowered so a tiny Llama takes them)
decodes as the eager injected model and HF do."""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.accelerators import cpu_precompile as precompile
from shardwise.errors import ConfigError
from shardwise.kernels.cpu import activations, native, norms, rotary
from shardwise.kernels.reference import activations as ref_activations
from shardwise.kernels.reference import rotary as ref_rotary
from models import prompt_ids, tiny_causal_lm

pytestmark = pytest.mark.skipif(not native.load(respect_choice=False),
                                reason="the native CPU extension does not build here (AVX512-VNNI "
                                       "CPU and a C++ compiler needed)")

OPS = torch.ops.shardwise_native
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: max |native - torch form|: bf16/fp16 round as the torch forms do, so they agree bit for bit
#: in these cases; fp32 sums the squares in another order (rms) and its exp may differ in the
#: last bits (silu)
TOL = {torch.float32: 2e-6, torch.bfloat16: 0.0, torch.float16: 0.0}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = TOL[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _randn(*shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 5, 576), (7, 100), (2, 9)])
def test_rms_norm_matches_the_torch_form(dtype, shape):
    x, r = _randn(*shape, dtype=dtype), _randn(*shape, dtype=dtype, seed=1, scale=3.0)
    w = (torch.rand(shape[-1], generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    out, h = OPS.cpu_add_rms_norm(x, r, w, 1e-5)
    want_out, want_h = norms.rms_norm(x, w, 1e-5, residual=r)
    _close(out, want_out)
    assert torch.equal(h, want_h)  # one rounded add
    _close(OPS.cpu_rms_norm(x, w, 1e-5), norms.rms_norm(x, w, 1e-5)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1536, 8, 33])
def test_silu_and_mul_matches_the_torch_form_fused_and_split(dtype, inter):
    fused = _randn(2, 3, 2 * inter, dtype=dtype, scale=4.0)
    _close(OPS.cpu_silu_and_mul(fused, None), activations.silu_and_mul(fused))
    gate, up = (t.contiguous() for t in fused.chunk(2, dim=-1))
    _close(OPS.cpu_silu_and_mul(gate, up), activations.silu_and_mul(gate, up))
    # and within a rounding of the reference, which rounds once (silu * up in float32)
    want = ref_activations.silu_and_mul(fused)
    torch.testing.assert_close(OPS.cpu_silu_and_mul(fused, None).float(), want.float(),
                               rtol=0.02 if dtype != torch.float32 else 2e-6, atol=1e-2)


def test_silu_special_values():
    x = torch.tensor([0.0, -0.0, 1e-30, 88.0, 89.5, 200.0, -88.0, -104.0, -200.0,
                      float("inf"), float("-inf"), float("nan")])
    fused = torch.cat([x, torch.ones_like(x)])[None]
    got, want = OPS.cpu_silu_and_mul(fused, None)[0], torch.nn.functional.silu(x)
    torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("case", [(1, 32, 8, 1, 64, 64), (2, 4, 2, 5, 64, 32),
                                  (3, 3, 3, 2, 80, 80), (1, 2, 1, 3, 96, 24)])
def test_rotary_matches_the_reference_on_strided_inputs(dtype, style, case):
    b, hq, hk, s, d, rot = case
    # q, k as the layer makes them: [b, s, heads, d] transposed to [b, heads, s, d]
    q = _randn(b, s, hq, d, dtype=dtype).transpose(1, 2)
    k = _randn(b, s, hk, d, dtype=dtype, seed=1).transpose(1, 2)
    angles = torch.rand(b, s, rot // 2, generator=torch.Generator().manual_seed(2)) * 50
    got_q, got_k = OPS.cpu_rotary(q, k, angles.cos(), angles.sin(), style == "interleaved")
    want_q, want_k = ref_rotary.rotary(q, k, angles.cos(), angles.sin(), style=style)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # float math, one rounding


def test_rotary_shares_one_table_across_the_batch():
    q, k = _randn(3, 4, 2, 64, dtype=torch.float32), _randn(3, 2, 2, 64, dtype=torch.float32)
    angles = torch.rand(1, 2, 32)
    got = OPS.cpu_rotary(q, k, angles.cos(), angles.sin(), False)
    want = ref_rotary.rotary(q, k, angles.cos(), angles.sin())
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("call, message", [
    (lambda: OPS.cpu_rms_norm(torch.randn(2, 8), torch.randn(4), 1e-5), "weight must be"),
    (lambda: OPS.cpu_rms_norm(torch.randn(2, 8), torch.randn(8).bfloat16(), 1e-5),
     "in x's dtype"),
    (lambda: OPS.cpu_rms_norm(torch.randn(2, 8).double(), torch.randn(8).double(), 1e-5),
     "dtype must be"),
    (lambda: OPS.cpu_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-5),
     "residual must match"),
    (lambda: OPS.cpu_silu_and_mul(torch.randn(2, 7), None), "even last dim"),
    (lambda: OPS.cpu_silu_and_mul(torch.randn(2, 8), torch.randn(2, 4)), "one shape"),
    (lambda: OPS.cpu_rotary(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8),
                            torch.randn(1, 1, 8), torch.randn(1, 1, 8), False), "do not fit"),
    (lambda: OPS.cpu_rotary(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8),
                            torch.randn(1, 4).double(), torch.randn(1, 4), False), "float32"),
])
def test_bad_input_is_refused_by_name(call, message):
    with pytest.raises(RuntimeError, match=message):
        call()


def _traced_ops(fn, *args) -> set[str]:
    """The shardwise_native ops in the graph torch.compile captures for fn(*args)."""
    seen: set[str] = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target).removesuffix(".default") for n in gm.graph.nodes
                    if "shardwise_native" in str(n.target))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen


def _layer_ops(x, r, w, q, k, c, s, g):
    out, h = norms.rms_norm(x, w, 1e-5, residual=r)
    q2, k2 = rotary.rotary(q, k, c, s)
    return out, h, q2, k2, activations.silu_and_mul(g)


def _layer_args(hidden: int, heads: int, inter: int):
    """Inputs of one layer's elementwise ops: hidden-wide rows, heads x 64 q, inter-wide MLP."""
    x, r = torch.randn(1, 1, hidden), torch.randn(1, 1, hidden)
    q, k = torch.randn(1, heads, 1, 64), torch.randn(1, heads // 2, 1, 64)
    angles = torch.rand(1, 1, 32)
    return x, r, torch.rand(hidden), q, k, angles.cos(), angles.sin(), torch.randn(1, 1, 2 * inter)


WIDE = _layer_args(1024, 16, 2048)  # each at its op's native_min_width
NATIVE_OPS = {"shardwise_native.cpu_add_rms_norm", "shardwise_native.cpu_rotary",
              "shardwise_native.cpu_silu_and_mul"}


def test_compiled_code_calls_the_native_ops_and_eager_code_does_not(monkeypatch):
    assert native.NATIVE_MIN_WIDTH == {"rms_norm": 1024, "rotary": 1024, "silu_and_mul": 2048}
    assert _traced_ops(_layer_ops, *WIDE) == NATIVE_OPS
    compiled = torch.compile(_layer_ops, backend="eager", fullgraph=True)(*WIDE)
    for got, want in zip(compiled, _layer_ops(*WIDE)):  # eager: the torch forms
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    monkeypatch.setattr(native, "ELEMENTWISE", False)  # what SHARDWISE_CPU_ELEMENTWISE=torch sets
    assert _traced_ops(_layer_ops, *WIDE) == set()


def test_narrow_layers_keep_the_torch_forms_in_compiled_code(monkeypatch):
    assert _traced_ops(_layer_ops, *_layer_args(576, 9, 1536)) == set()  # SmolLM2's widths
    assert _traced_ops(_layer_ops, *_layer_args(1024, 8, 1536)) == {  # only the norm is wide
        "shardwise_native.cpu_add_rms_norm"}
    monkeypatch.setattr(native, "ELEMENTWISE_ALL", True)  # SHARDWISE_CPU_ELEMENTWISE=always
    assert _traced_ops(_layer_ops, *_layer_args(576, 9, 1536)) == NATIVE_OPS


def test_a_bad_elementwise_choice_is_refused(monkeypatch):
    monkeypatch.setenv(native.ELEMENTWISE_ENV, "fast")
    expected = "SHARDWISE_CPU_ELEMENTWISE='fast'.*native, always, torch"
    with pytest.raises(ConfigError, match=expected):
        native.choice(native.ELEMENTWISE_ENV)
    monkeypatch.setenv(native.ELEMENTWISE_ENV, "always")
    assert native.choice(native.ELEMENTWISE_ENV) == "always"


def test_a_compiled_step_on_the_native_ops_decodes_as_eager_and_hf(monkeypatch, tmp_path):
    """fp32: logits within 1e-5 of the eager injected model (the compiled step's sums run in
    another order, as in test_cpu_graphs.py), 16 greedy tokens identical to HF's."""
    monkeypatch.setattr(precompile, "precompiled_folder", lambda: tmp_path)  # no earlier step
    monkeypatch.setattr(native, "ELEMENTWISE_ALL", True)  # SHARDWISE_CPU_ELEMENTWISE=always
    taken, real = [], native.in_compiled_step

    def spy(op: str, width: int) -> bool:
        used = real(op, width)
        if used:  # only while a step is traced
            taken.append(op)
        return used
    monkeypatch.setattr(native, "in_compiled_step", spy)
    ref = tiny_causal_lm("llama")
    engines = [shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                        replace_with_kernel_inject=True, enable_graph=graphs)
               for graphs in (False, True)]
    assert set(taken) == {"rms_norm", "rotary", "silu_and_mul"}  # the compiled step took them
    greedy = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    ids = prompt_ids(batch=1, length=8)
    with torch.no_grad():
        want = ref.generate(ids, **greedy)
    runs = [e.generate(ids, output_logits=True, return_dict_in_generate=True, **greedy)
            for e in engines]
    assert all(torch.equal(run.sequences, want) for run in runs)
    eager, compiled = (torch.stack(run.logits) for run in runs)
    assert (compiled - eager).abs().max().item() < 1e-5

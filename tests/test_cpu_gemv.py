"""The CPU graphs' one-row product for 16-bit linears (:mod:`shardwise.accelerators.cpu_gemv`).

Numerics: the bf16 contract — exact products, fp32 sums, one rounding to bf16 — so the result
is within one bf16 rounding of the fp32 product of the same bf16 values, eagerly and compiled.
The engine test checks that a bf16 model with graphs routes its linears (the output head too)
through it where the native CPU kernels are opted out (through the native 16-bit blocked
kernel otherwise: tests/test_cpu_native_half.py) and decodes as the eager bf16 engine does
(teacher-forced, near-ties aside).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise
from shardwise.accelerators import cpu_gemv
from shardwise.accelerators.cpu_gemv import (RowProductLinear, row_product,
                                             row_product_eligible, use_row_products)
from shardwise.accelerators.cpu_graphs import CpuCompileStrategy
from shardwise.ledger import Ledger
from models import forced_decode_logits, prompt_ids, tiny_causal_lm

NEW = 16
GREEDY = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The fp32 (float64-summed) product of the same 16-bit values: [M, N]."""
    return (x.double() @ w.double().t()).float()


def _bf16_ulp(y: torch.Tensor) -> torch.Tensor:
    """One bf16 rounding step at each value's magnitude (2^-7 relative), plus a floor for the
    sum's own fp32 rounding."""
    return y.abs() * 2.0 ** -7 + 1e-4


@pytest.mark.parametrize("k", [300, cpu_gemv.LONG_ROW + cpu_gemv.ROW_CHUNK])  # one piece, chunked
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_product_is_the_fp32_sum_rounded_once(dtype, k):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = torch.randn(70, k, generator=g).to(dtype)
    want = _exact(x, w)
    got = row_product(x, w)
    assert got.dtype == dtype and got.shape == (1, 70)
    assert ((got.float() - want).abs() <= _bf16_ulp(want)).all()


def test_a_long_row_of_a_transposed_weight_is_chunked_in_place():
    """Conv1D hands a transposed view ([N, K] with K strided): the chunked sum reads it as is."""
    g = torch.Generator().manual_seed(1)
    k = cpu_gemv.LONG_ROW * 2
    x = torch.randn(1, k, generator=g).bfloat16()
    w = torch.randn(k, 40, generator=g).bfloat16().t()  # [40, K], not contiguous
    got = row_product(x, w)
    want = _exact(x, w.contiguous())
    assert ((got.float() - want).abs() <= _bf16_ulp(want)).all()


def test_the_bias_is_added_before_the_one_rounding():
    """A bias is summed in fp32 with the products and rounded once, as F.linear does (added
    after a first rounding, about a quarter of the outputs came out one bf16 step off)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 512, generator=g).bfloat16()
    w = torch.randn(4096, 512, generator=g).bfloat16()
    bias = (torch.randn(4096, generator=g) * 4).bfloat16()
    want = (_exact(x, w) + bias.float()).bfloat16()  # the exact sum, rounded once
    got = row_product(x, w, bias)
    off = (got.float() - want.float()).abs() > _bf16_ulp(want.float()) * 0.5
    assert off.float().mean().item() < 0.01  # only fp32-order ties may round the other way


@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
def test_compiled_row_product_streams_the_weight_as_stored(conv1d, monkeypatch):
    """Inside torch.compile (the CPU strategy), one row: the module's forward is the row
    product (traced: counted), reading the parameter itself — transformers' Conv1D [K, N]
    weight through its transposed view — within one rounding of the exact product."""
    from transformers.pytorch_utils import Conv1D

    traced = []
    monkeypatch.setattr(cpu_gemv, "row_product",
                        lambda *a: traced.append(1) or row_product(*a))
    g = torch.Generator().manual_seed(1)
    lin = (Conv1D(96, 256) if conv1d else nn.Linear(256, 96)).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
        lin.bias.copy_(torch.randn(96, generator=g))
    weight = lin.weight.t() if conv1d else lin.weight  # [N, K]
    ptr = lin.weight.data_ptr()
    assert use_row_products([lin]) == 1
    assert isinstance(lin.forward, RowProductLinear) and lin.weight.data_ptr() == ptr
    x = torch.randn(1, 1, 256, generator=g).bfloat16()
    graph = CpuCompileStrategy().capture(lambda t: lin(t), x)
    got = graph(x).float()
    assert traced  # the compiled step ran the row product, not the module's own product
    want = _exact(x[0], weight) + lin.bias.float()
    assert got.shape == (1, 1, 96)
    assert ((got[0] - want).abs() <= _bf16_ulp(want)).all()
    # eager, and more than one row: the module's own product, unchanged
    traced.clear()
    xs = torch.randn(4, 256, generator=g).bfloat16()
    assert torch.equal(lin(xs), type(lin).forward(lin, xs)) and not traced


def test_only_plain_16bit_linears_are_changed_and_undo_restores_them():
    fp32 = nn.Linear(8, 8)
    bf16 = nn.Linear(8, 8).to(torch.bfloat16)
    patched = nn.Linear(8, 8).to(torch.bfloat16)
    patched.forward = lambda x: x
    norm = nn.LayerNorm(8).to(torch.bfloat16)
    assert [row_product_eligible(m) for m in (fp32, bf16, patched, norm)] == \
        [False, True, False, False]
    root = nn.ModuleList([fp32, bf16, patched, norm])
    ledger = Ledger(root)
    with ledger.recording():
        assert use_row_products([fp32, bf16, patched, norm]) == 1
    assert isinstance(vars(bf16)["forward"], RowProductLinear)
    assert "forward" not in vars(fp32) and "forward" not in vars(norm)
    ledger.give_back()
    assert "forward" not in vars(bf16)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_bf16_engine_with_graphs_decodes_as_eager(kernels, monkeypatch):
    """The compiled bf16 step against the eager bf16 engine, both fed the eager engine's greedy
    tokens one decode step at a time (teacher forcing through the captured step): logits within
    two bf16 roundings of the largest, and the same next token wherever eager's top two are
    further apart than that. Free-running tokens alone would hang on near-ties: this tiny random
    model's top two logits are one bf16 ulp apart at some steps, where either engine's rounding
    may pick either token. With the native kernels (the default where they build) every linear
    weight, the output head's too, is laid out in column blocks read by the native 16-bit
    kernel; opted out, the linears keep their layout and get the compiled row product."""
    from shardwise.accelerators import cpu_blocked_layout as layout
    from shardwise.kernels.cpu import native

    if kernels == "native" and not native.load():
        pytest.skip("the native CPU kernels do not build on this machine")
    monkeypatch.setenv(native.ENV, kernels)
    ids = prompt_ids(batch=1, length=8)

    def engine(**kwargs):
        return shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                        dtype=torch.bfloat16, replace_with_kernel_inject=True,
                                        **kwargs)
    eager, compiled = engine(), engine(enable_graph=True)
    model = compiled.module
    want = layout.BlockedLinear if kernels == "native" else RowProductLinear
    routed = [n for n, m in model.named_modules() if isinstance(vars(m).get("forward"), want)]
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert routed and len(routed) == len(linears) - 1  # all but the head, wrapped by the graphs
    assert isinstance(model.get_output_embeddings().forward.original, want)
    if kernels == "native":  # the model's own bf16 weights, in blocks (no second copy)
        assert all(m.weight.dim() == 3 and m.weight.dtype == torch.bfloat16
                   for m in model.modules() if isinstance(m, nn.Linear))
    tokens = eager.generate(ids, **GREEDY).sequences  # [1, 8 + NEW]
    la = forced_decode_logits(eager.module, tokens, ids.shape[1])  # [1, NEW + 1, vocab]
    lb = forced_decode_logits(model, tokens, ids.shape[1])
    tol = 2 * 2.0 ** -7 * la.abs().max().item()
    assert (la - lb).abs().max().item() <= tol
    top2 = la.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > tol  # [1, NEW + 1]
    assert decisive.sum().item() >= NEW // 2  # most steps are not near-ties: the check bites
    assert torch.equal(la.argmax(-1)[decisive], lb.argmax(-1)[decisive])
    assert torch.equal(la.argmax(-1)[:, :-1], tokens[:, ids.shape[1]:])  # eager is its own greedy
    free = compiled.generate(ids, **GREEDY).sequences  # the generate path itself, up to a tie
    first_tie = int((~decisive[0]).nonzero()[0]) if (~decisive).any() else NEW
    assert torch.equal(free[:, :ids.shape[1] + first_tie], tokens[:, :ids.shape[1] + first_tie])

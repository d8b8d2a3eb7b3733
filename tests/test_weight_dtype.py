"""``init_inference(dtype=torch.float32, weight_dtype=bf16 | fp16)``: 16-bit linear weights
under fp32 activations (what llama.cpp's F16/BF16 files run).

The oracle is the plain Hugging Face model in fp32 whose linear weights (and the tied
embedding, one table with the head) were rounded once to the storage dtype: the engine must
compute exactly that in fp32 (logits within 1e-5: fp32 sums in another order; greedy tokens
identical), not a bf16 model. Covered: the native op with an fp32 x (every path, against the
exact product and its oracle, compiled too), Llama (``nn.Linear``, untied head, fused
projections) and GPT-2 (``Conv1D``, tied head), the opt-out of the native kernels (ATen on the
widened weight), ``state_dict`` and ``close()``, and every refusal before heavy work."""

from __future__ import annotations

import copy

import pytest
import torch

import shardwise
from shardwise.accelerators import cpu_blocked_layout as layout
from shardwise.errors import ConfigError
from shardwise.kernels.cpu import native
from shardwise.kernels.reference.linear import blocked_linear as reference

from models import prompt_ids, rounded_copy, tiny_causal_lm

NATIVE = native.load(respect_choice=False)
needs_native = pytest.mark.skipif(not NATIVE, reason="the native CPU extension does not build "
                                                     "here (AVX512 CPU and a C++ compiler needed)")
#: fp32 logits of the engine against the rounded-weights oracle: the same products in fp32,
#: summed in another order (the values are O(1), so this is a few fp32 ulps times K)
ATOL = 1e-5


@needs_native
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, layout.NATIVE_ROWS, layout.NATIVE_ROWS + 9])
def test_the_native_op_multiplies_fp32_rows_by_16bit_blocks_exactly(wdtype, rows, monkeypatch):
    """Both bf16 paths (the dot loops never take an fp32 x: they would round it)."""
    monkeypatch.delenv("SHARDWISE_CPU_BF16_DOT", raising=False)
    g = torch.Generator().manual_seed(rows)
    n, k = 70, 200
    w = torch.randn(n, k, generator=g).to(wdtype)
    bias = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    blocked = layout.block_weight(w.t())
    got = native.cpu_blocked_linear(x, blocked, bias, n)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    exact = x.double() @ w.double().t() + bias.double()
    bound = (x.double().abs() @ w.double().abs().t()) * k * 2.0 ** -24  # fp32 sums only
    assert ((got.double() - exact).abs() <= bound + 1e-12).all()
    torch.testing.assert_close(got, reference(x, blocked, bias, n), atol=1e-5, rtol=1e-5)


@needs_native
def test_the_op_with_an_fp32_x_runs_inside_torch_compile():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=g).half()
    blocked = layout.block_weight(w.t())
    x = torch.randn(1, 64, generator=g)

    def step(x, blocked):
        return torch.relu(native.cpu_blocked_linear(x * 2, blocked, None, 96)) + 1

    got = torch.compile(step, fullgraph=True, dynamic=False)(x, blocked)
    assert got.dtype == torch.float32 and torch.equal(got, step(x, blocked))


def _engine(model, wdtype, **kw):
    return shardwise.init_inference(model, dtype=torch.float32, weight_dtype=wdtype,
                                    replace_with_kernel_inject=True, enable_graph=True, **kw)


def _parity(arch: str, wdtype: torch.dtype, tokens: int = 16):
    model = tiny_causal_lm(arch)
    oracle, fp32 = rounded_copy(model, wdtype), copy.deepcopy(model)
    engine = _engine(model, wdtype)
    ids = prompt_ids(batch=2, length=9)
    with torch.no_grad():
        got, want, full = engine.module(ids).logits, oracle(ids).logits, fp32(ids).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert (got - full).abs().max() > 0  # the weights were rounded: not the fp32 model
    out = engine.module.generate(ids, max_new_tokens=tokens, do_sample=False)
    assert torch.equal(out, oracle.generate(ids, max_new_tokens=tokens, do_sample=False))
    return model, oracle, engine


@needs_native
@pytest.mark.parametrize("arch,wdtype", [("llama", torch.bfloat16), ("gpt2", torch.float16)])
def test_16bit_weights_under_fp32_compute_are_the_rounded_fp32_model(arch, wdtype):
    """Logits within 1e-5 of the fp32 model with rounded weights, 16 greedy tokens identical
    (prompt: the eager forward; decode: the captured step); the linear weights are stored in
    16 bits (the tied table too), the norms stay fp32; ``state_dict`` gives the stored 16-bit
    weights in their usual layout; ``close()`` gives an fp32 model with the rounded values."""
    model, oracle, engine = _parity(arch, wdtype)
    linears = [m for m in model.modules() if layout.gemm_like(m)]
    assert linears and all(m.weight.dtype == wdtype for m in linears)
    norms = [m.weight for m in model.modules() if "Norm" in type(m).__name__]
    assert norms and all(w.dtype == torch.float32 for w in norms)
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert model.get_input_embeddings().weight.dtype == (wdtype if tied else torch.float32)
    state = model.state_dict()
    for name, want in oracle.state_dict().items():
        assert state[name].shape == want.shape, name
        assert torch.equal(state[name].float(), want), name
    engine.close()
    for name, want in oracle.state_dict().items():
        got = dict(model.named_parameters()).get(name)
        if got is not None:
            assert got.dtype == torch.float32 and torch.equal(got, want), name


@needs_native
def test_the_warning_names_only_what_stays_wide_after_the_fused_groups_follow(caplog):
    """Llama's q/k/v and gate/up run fused: their parts follow the fused weight's 16-bit layout
    at the end of the layout step, so the one warning counts only the untied input embedding
    (it had named the parts too, read before they followed)."""
    model = tiny_causal_lm("llama")
    assert not model.config.tie_word_embeddings
    with caplog.at_level("WARNING", logger="shardwise"):
        _engine(model, torch.float16)
    wide = [n for n, p in model.named_parameters()
            if p.dim() >= 2 and p.dtype != torch.float16]
    assert wide == ["model.embed_tokens.weight"]
    said = [r.getMessage() for r in caplog.records if "weight_dtype=float16" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        "shardwise: weight_dtype=float16: 1 weight tensors (") and "q_proj" not in said[0]


@needs_native
def test_moe_experts_stay_fp32_and_a_warning_says_so(caplog):
    """Mixtral: attention, router and head stored in bf16, the experts' stacked tensors kept
    fp32 (named in one warning); the engine is the model with only those linears rounded
    (logits within 5e-5: measured 1.3e-5, the experts' combine sums in another order)."""
    model = tiny_causal_lm("mixtral")
    oracle = rounded_copy(model, torch.bfloat16)  # rounds 2-D linear weights only
    with caplog.at_level("WARNING", logger="shardwise"):
        engine = _engine(model, torch.bfloat16)
    ids = prompt_ids(batch=2, length=9)
    with torch.no_grad():
        torch.testing.assert_close(engine.module(ids).logits, oracle(ids).logits, atol=5e-5,
                                   rtol=0)
    assert torch.equal(engine.module.generate(ids, max_new_tokens=8, do_sample=False),
                       oracle.generate(ids, max_new_tokens=8, do_sample=False))
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    assert experts and all(p.dtype == torch.float32 for p in experts)
    said = [r.getMessage() for r in caplog.records if "weight_dtype=bfloat16" in r.getMessage()]
    assert len(said) == 1 and "experts" in said[0] and "stay float32" in said[0]


@needs_native
def test_without_the_native_kernels_the_widened_weights_give_the_same_model(monkeypatch):
    """Opted out (``SHARDWISE_CPU_QUANT_KERNEL=torch``): ATen's fp32 GEMM on each weight widened
    as it is reassembled; still the rounded model."""
    monkeypatch.setenv(native.ENV, "torch")
    _parity("llama", torch.bfloat16, tokens=8)


@pytest.mark.parametrize("kwargs,match", [
    ({"weight_dtype": "fp32"}, "not a storage dtype"),
    ({"weight_dtype": torch.int8}, "not a storage dtype"),
    ({"weight_dtype": "bf16", "dtype": torch.bfloat16}, "the compute dtype is torch.bfloat16"),
    ({"weight_dtype": "bf16", "quant": {"weight": {"num_bits": 8}}}, "quantization already"),
    ({"weight_dtype": "bf16", "offload": {"device": "nvme", "nvme_path": "/tmp"}},
     "offload= is not supported"),
    ({"weight_dtype": "bf16", "enable_graph": False}, "needs enable_graph=True"),
])
def test_bad_weight_dtype_settings_are_refused_by_name(kwargs, match):
    settings = {"dtype": torch.float32, "replace_with_kernel_inject": True,
                "enable_graph": True, **kwargs}
    with pytest.raises(ConfigError, match=match):
        shardwise.InferenceConfig.build(**settings)


def test_a_16bit_model_or_a_strategy_without_the_layout_is_refused_before_any_change(
        monkeypatch):
    """The compute dtype resolved from the model, and the accelerator's graph strategy (a
    frozen one keeps fp32 copies), are checked at init: the model is left as it was."""
    half = tiny_causal_lm("llama", dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match="the compute dtype is torch.bfloat16"):
        shardwise.init_inference(half, weight_dtype="bf16", replace_with_kernel_inject=True,
                                 enable_graph=True)
    monkeypatch.setenv("SHARDWISE_CPU_GRAPHS", "frozen")
    model = tiny_causal_lm("llama")
    with pytest.raises(ConfigError, match="cannot keep the linear weights in it"):
        _engine(model, "fp16")
    for built, fresh in ((half, tiny_causal_lm("llama", dtype=torch.bfloat16)),
                         (model, tiny_causal_lm("llama"))):
        state = built.state_dict()
        assert all(torch.equal(state[k], v) for k, v in fresh.state_dict().items())
        assert all("forward" not in vars(m) for m in built.modules())

"""A ``group_size`` that does not divide a layer's input features (issue 21: SmolLM2-135M's 576
with groups of 128) is never refused: the layer gets the largest divisor below it that a fast
kernel takes (finer groups: never less accurate), and the quantization report names it.

Oracle: the torch reference kernel on the same weight quantized with the group size chosen
(``kernels/reference/quant.py``); the CPU's packed kernels compute in bf16, so they are compared
within bf16 rounding, and the fp32 reference of the chosen groups is compared with the fp32
product for the quantization error itself.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import shardwise
from shardwise.kernels.reference import quant as ref_quant
from shardwise.quant import QuantLinear, check_fits, parse_quant, quantize_model
from shardwise.quant.config import fitting_group_sizes
from models import prompt_ids

CPU = shardwise.get_accelerator("cpu")
BF16 = torch.bfloat16


@pytest.mark.parametrize("requested,in_features,first", [
    (128, 2048, (128,)),           # divides: as asked
    (128, 576, (96, 72, 64)),      # SmolLM2-135M: the divisors below 128, largest first
    (128, 64, (64,)),              # larger than the layer: one group per row
    (64, 106, (53,)),              # 2 x 53: 53 is the only divisor in [16, 64]
    (64, 14, (14,)),               # no divisor of at least 16: one scale per output row
    (8, 12, (6, 4)),               # a small request goes down to half of it
])
def test_fitting_group_sizes(requested, in_features, first):
    sizes = fitting_group_sizes(requested, in_features)
    assert sizes[:len(first)] == first
    assert all(in_features % s == 0 and s <= max(requested, in_features) for s in sizes)
    assert list(sizes) == sorted(sizes, reverse=True)


def _linear(in_features: int, out_features: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_features, out_features))


@pytest.mark.parametrize("bits,q_type", [(8, "symmetric"), (8, "asymmetric"),
                                          (4, "symmetric"), (4, "asymmetric")])
def test_576_inputs_with_groups_of_128_quantize_as_groups_of_96(bits, q_type):
    """A layer shaped like SmolLM2-135M's attention (576 in) with group_size=128: groups of 96,
    run by the CPU's fast kernel, equal to the reference kernel of the same groups; the report
    says so; the result is closer to the float product than per-channel quantization."""
    holder = _linear(576, 64)
    with torch.no_grad():  # columns of different scales, as real weights have: groups matter
        holder[0].weight.copy_(torch.randn(64, 576) * torch.randn(576).exp())
    weight, bias = holder[0].weight.detach().clone(), holder[0].bias.detach().clone()
    x = torch.randn(3, 576)
    report = quantize_model(holder, {"weight": {"num_bits": bits, "group_size": 128,
                                                "q_type": q_type}}, CPU, BF16, names=["0"])
    layer = report.layers["0"]
    assert layer.group_size == 96 and layer.backend == "cpu"
    assert isinstance(holder[0], QuantLinear) and holder[0].spec.group_size == 96
    assert report.notes == ["group_size=128 does not divide the 576 input features of 1 layer "
                            "(e.g. '0'): it uses groups of 96 (a divisor of 576: finer than "
                            "asked)"]
    assert report.to_dict()["notes"] == report.notes
    qw = ref_quant.quantize_weight(weight, bits=bits, group_size=96,
                                   symmetric=q_type == "symmetric")
    expected = ref_quant.quant_linear(x, ref_quant.prepack(qw, "cpu", torch.float32), bias)
    got = holder[0](x.to(BF16)).float()
    # the kernel rounds x, the scales (and offsets) and the output to bf16 (2^-9 relative
    # each) and sums in fp32 in another order: bounded by a few bf16 steps of sum |x_i w_i|
    w_q = ref_quant.dequantize_weight(qw)  # [64, 576], the groups of 96 as the reference has them
    bound = 3 * 2.0 ** -8 * (x.abs() @ w_q.abs().t() + bias.abs()) + 1e-3
    assert ((got - expected).abs() <= bound).all()
    # groups of 96 reconstruct the weight better than one scale per row
    per_row = ref_quant.quantize_weight(weight, bits=bits, group_size=576,
                                        symmetric=q_type == "symmetric")
    err_96 = (ref_quant.dequantize_weight(qw) - weight).square().mean()
    err_row = (ref_quant.dequantize_weight(per_row) - weight).square().mean()
    assert err_96 < err_row


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_the_largest_divisor_a_fast_kernel_takes_is_chosen(kernel, monkeypatch):
    """288 inputs, group_size=256: 144 divides 288 but torch's CPU int4 kernel takes groups that
    are multiples of 32 only, so int4 gets 96 (the largest that is); int8 takes any group: 144.
    The native kernel takes 144 at int4 too (an activation block of 16)."""
    from shardwise.kernels.cpu import native

    monkeypatch.setenv(native.ENV, kernel)
    if kernel == "native" and not native.load():
        pytest.skip("the native CPU quant kernel does not build here")
    sizes = {}
    for bits in (8, 4):
        holder = _linear(288, 32)
        report = quantize_model(holder, {"weight": {"num_bits": bits, "group_size": 256}}, CPU,
                                BF16, names=["0"])
        sizes[bits] = (report.layers["0"].group_size, report.layers["0"].backend)
    assert sizes == {8: (144, "cpu"), 4: (96 if kernel == "torch" else 144, "cpu")}


def _smollm_like() -> transformers.PreTrainedModel:
    """A 2-layer Llama with SmolLM2-135M's widths (hidden 576, 9 heads of 64, 3 kv heads,
    MLP 1536), a small vocabulary."""
    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=2, num_attention_heads=9,
                                      num_key_value_heads=3, vocab_size=256,
                                      max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("bits", [8, 4])
def test_a_smollm2_shaped_model_quantizes_with_group_128(bits):
    """The setting refused before (group 128 on 576 inputs): check_fits passes, init_inference
    quantizes every planned linear on the fast kernel — 576-input layers with groups of 96, the
    1536-input down projections with 128 — reports it, and decodes."""
    quant = {"weight": {"num_bits": bits, "group_size": 128}}
    model = _smollm_like()
    assert len(check_fits(model, quant, CPU, BF16)) == 14
    engine = shardwise.init_inference(model, device="cpu", dtype=BF16, quant=quant)
    report = engine.quantization
    sizes = {name.rsplit(".", 1)[-1]: layer.group_size for name, layer in report.layers.items()}
    assert sizes == {"q_proj": 96, "k_proj": 96, "v_proj": 96, "o_proj": 96, "gate_proj": 96,
                     "up_proj": 96, "down_proj": 128}
    assert {b for kinds in report.backends().values() for b in kinds} == {"cpu"}
    assert len(report.notes) == 1 and "576 input features of 12 layers" in report.notes[0]
    out = engine.generate(prompt_ids(length=8), max_new_tokens=4, do_sample=False,
                          pad_token_id=0)
    assert out.shape == (1, 12)


def test_a_saved_regrouped_model_reloads_with_its_groups(tmp_path):
    """The groups chosen are part of each saved layer's spec: reloading gives the same
    weights and outputs without choosing again."""
    from shardwise.quant import load_quantized, save_quantized

    model = _smollm_like()
    quantize_model(model, {"weight": {"num_bits": 4, "group_size": 128}}, CPU, BF16)
    ids = prompt_ids(length=8)
    with torch.no_grad():
        want = model(ids).logits
    save_quantized(model, tmp_path / "q")
    fresh = _smollm_like()
    report = load_quantized(fresh, tmp_path / "q", CPU)
    assert {layer.group_size for layer in report.layers.values()} == {96, 128}
    assert len(report.notes) == 1 and "576 input features of 12 layers" in report.notes[0]
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, want)


def test_a_layer_narrower_than_a_group_gets_one_group_per_row_and_says_why():
    holder = _linear(64, 32)
    report = quantize_model(holder, {"weight": {"num_bits": 8, "group_size": 128}}, CPU, BF16,
                            names=["0"])
    assert report.layers["0"].group_size == 64
    assert report.notes == ["group_size=128 does not divide the 64 input features of 1 layer "
                            "(e.g. '0'): it uses one group per output row (the layer has fewer "
                            "inputs than a group)"]


def test_q_groups_that_do_not_cut_a_layer_equally_are_still_refused():
    """DeepSpeed's q_groups means G equal groups per row: no equal cut is a named error."""
    model = nn.Sequential(nn.Linear(64, 32))
    with pytest.raises(shardwise.ConfigError, match="q_groups=3 does not divide layer '0'"):
        quantize_model(model, parse_quant({"weight": {"q_groups": 3}}), CPU, BF16, names=["0"])

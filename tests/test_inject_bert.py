"""Kernel injection for BERT (encoder-only, post-LayerNorm, non-causal, no KV cache): parity with
the plain HF model for ``BertModel``, ``BertForMaskedLM`` and ``BertForSequenceClassification``,
padded batches, the mask forms HF hands its encoder, tensor parallelism on 2 gloo ranks, errors.

Models: tests/models.py's tiny BERT (hidden 64, 4 heads, 2 layers) with every parameter moved by
seeded noise of std 0.1 (:func:`_scrambled`): HF initialises biases to 0 and LayerNorm weights to
1, which would hide a swapped norm or a bias added twice, and its 0.02-std weights make attention
so flat that ignoring the padding mask moves the outputs by only ~0.004 (0.6 after scrambling).
Inputs: batch 4 × 16 tokens (plus token type ids) without a mask, right-padded and left-padded.

Tolerances, on ``last_hidden_state`` and ``pooler_output`` (BertModel) or ``logits`` (heads), every
position (padded ones included: HF computes them from the real keys too), magnitudes up to ~4;
about 2× the max measured (``pytest -s`` prints each; under load, x86-64, torch 2.13):
* fp32: within ``FP32_ATOL`` = 4e-6 (measured ≤ 1.85e-6 with the reference kernels, masked_lm;
  TP=2 ≤ 1.79e-6; the cpu backend's kernels are the same ATen ops as HF's and give 0).
* bf16: within ``BF16_ATOL`` = 0.07 of HF run in bf16 (measured max 0.035 with the reference
  kernels, about 1 bf16 ulp at magnitude 4: they compute in fp32 and round once, HF rounds after
  each op; 0 with the cpu backend); TP=2 within ``TP_BF16_ATOL`` = 0.094 (measured 0.047: the
  row-parallel all-reduce adds bf16 partial sums).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import shardwise
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.inject import InjectionError, inject_model
from shardwise.inject.encoder import (EncoderAttention, EncoderInjectionSpec, EncoderMLP,
                                      InjectedEncoder, InjectedEncoderLayer, key_padding_mask)
from shardwise.policies.bert import BertPolicy
from families import family
from models import TINY_CONFIGS, prompt_ids, tiny_encoder
from tp_harness import TP, case, digest, table_fixture

BERT = family("bert")  # the one family with bounds of its own: tests/families.py holds them
FP32_ATOL = BERT.tolerances["inject_fp32"]  # 4e-6
BF16_ATOL = BERT.tolerances["inject_bf16"]  # 0.07
TP_BF16_ATOL = BERT.tolerances["inject_tp_bf16"]  # 0.094
HEADS = ["base", "masked_lm", "classifier"]
MASKS = ["none", "right", "left"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ATOL = {torch.float32: FP32_ATOL, torch.bfloat16: BF16_ATOL}
TP_ATOL = {torch.float32: FP32_ATOL, torch.bfloat16: TP_BF16_ATOL}


# ----- models and inputs --------------------------------------------------------------------------

def _scrambled(model: torch.nn.Module, std: float = 0.1) -> torch.nn.Module:
    """Every parameter + seeded noise (see the module docstring); same result for same shapes."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return model


def _model(head: str, **config_changes) -> torch.nn.Module:
    """A scrambled tiny BERT: ``base`` (BertModel), ``masked_lm`` or ``classifier`` (3 labels)."""
    if head != "classifier" and not config_changes:
        return _scrambled(tiny_encoder("bert", head=head))
    spec = dict(TINY_CONFIGS["bert"])
    config = getattr(transformers, spec.pop("cls"))(**spec, **config_changes)
    auto = {"base": transformers.AutoModel, "masked_lm": transformers.AutoModelForMaskedLM,
            "classifier": transformers.AutoModelForSequenceClassification}[head]
    if head == "classifier":
        config.num_labels = 3
    torch.manual_seed(0)
    return _scrambled(auto.from_config(config).eval())


def _inputs(mask: str, seed: int = 1) -> dict:
    ids = prompt_ids(batch=4, length=16, seed=seed)
    types = (torch.arange(16) >= 9).long().expand(4, 16)  # a sentence pair
    out = dict(input_ids=ids, token_type_ids=types)
    if mask != "none":
        m = torch.ones_like(ids)
        lengths = [16, 11, 5, 1]
        for b, n in enumerate(lengths):
            if mask == "right":
                m[b, n:] = 0
            else:
                m[b, :16 - n] = 0
        out["attention_mask"] = m
    return out


def _outputs(head: str, out) -> dict[str, torch.Tensor]:
    if head == "base":
        return {"last_hidden_state": out.last_hidden_state.float(),
                "pooler_output": out.pooler_output.float()}
    return {"logits": out.logits.float()}


def _max_diff(head: str, got, expected) -> float:
    got, expected = _outputs(head, got), _outputs(head, expected)
    assert got.keys() == expected.keys()
    return max((got[k] - expected[k]).abs().max().item() for k in got)


def _pair(head: str, dtype=torch.float32, **engine_kwargs):
    ref = _model(head).to(dtype)
    engine = shardwise.init_inference(_model(head), device="cpu", dtype=dtype,
                                      replace_with_kernel_inject=True, **engine_kwargs)
    return ref, engine


@pytest.fixture(params=["cpu", "reference"])
def backends(request, monkeypatch):
    """Run with the cpu backend's kernels, then with the torch references only."""
    from shardwise.accelerators.cpu import CpuAccelerator

    if request.param == "reference":
        monkeypatch.setattr(CpuAccelerator, "kernel_backends", ())
    return request.param


# ----- parity -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("head", HEADS)
def test_parity_with_hf(head, dtype, backends):
    dtype = DTYPES[dtype]
    ref, engine = _pair(head, dtype)
    encoder = engine.module.base_model.encoder
    assert isinstance(encoder, InjectedEncoder)
    expected_backend = "reference" if backends == "reference" else "cpu"
    assert encoder.kernels.backends["attention_prefill"] == expected_backend
    worst = {}
    for mask in MASKS:
        inputs = _inputs(mask)
        with torch.no_grad():
            worst[mask] = _max_diff(head, engine(**inputs), ref(**inputs))
    print(f"{head} {dtype} {backends}: max |diff| {worst}")
    assert max(worst.values()) < ATOL[dtype], worst


def test_padding_mask_is_applied():
    """The same check with the mask dropped inside the layers fails: the parity tests can fail."""
    ref, engine = _pair("masked_lm")
    inputs = _inputs("right")
    with torch.no_grad():
        expected = ref(**inputs)
        got = engine(**{k: v for k, v in inputs.items() if k != "attention_mask"})
    assert _max_diff("masked_lm", got, expected) > 100 * FP32_ATOL


def test_eager_attention_mask_form():
    """With HF eager attention BertModel hands its encoder an additive float 4-d mask."""
    ref = _model("base")
    model = _model("base")
    for m in (ref, model):
        m.set_attn_implementation("eager")
    engine = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)
    for mask in ("left", "right"):
        inputs = _inputs(mask)
        with torch.no_grad():
            assert _max_diff("base", engine(**inputs), ref(**inputs)) < FP32_ATOL


@pytest.mark.parametrize("form", ["bool", "additive"])
def test_user_4d_padding_mask(form):
    """A 4-d padding mask given by the user reaches the encoder as is and is accepted."""
    ref, engine = _pair("base")
    inputs = _inputs("left")
    mask2d = inputs.pop("attention_mask")
    visible = mask2d.bool()[:, None, None, :].expand(4, 1, 16, 16)
    mask4d = visible if form == "bool" else torch.zeros(visible.shape).masked_fill(
        ~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = ref(**inputs, attention_mask=mask2d)
        got = engine(**inputs, attention_mask=mask4d)
    assert _max_diff("base", got, expected) < FP32_ATOL


def test_return_dict_false():
    ref, engine = _pair("masked_lm")
    inputs = _inputs("right")
    with torch.no_grad():
        got, expected = engine(**inputs, return_dict=False), ref(**inputs, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(expected) == 1
    assert (got[0] - expected[0]).abs().max().item() < FP32_ATOL


def test_state_dict_unchanged_and_hf_layers_not_run(monkeypatch):
    model = _model("masked_lm")
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)
    after = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert list(after) == list(before)  # same names, same order
    assert after == before  # the same tensors: adopted, not copied
    assert isinstance(model.bert.encoder, InjectedEncoder)
    assert all(isinstance(layer, InjectedEncoderLayer) for layer in model.bert.encoder.layer)
    from transformers.models.bert import modeling_bert

    def hf_layer_ran(*args, **kwargs):
        raise AssertionError("an HF BertLayer ran after injection")

    monkeypatch.setattr(modeling_bert.BertLayer, "forward", hf_layer_ran)
    monkeypatch.setattr(modeling_bert.BertSelfAttention, "forward", hf_layer_ran)
    with torch.no_grad():
        out = model(**_inputs("left"))
    assert out.logits.shape == (4, 16, 256)


# ----- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["output_attentions", "output_hidden_states"])
def test_per_layer_outputs_are_refused(flag):
    _, engine = _pair("base")
    with pytest.raises(ShardwiseError, match=flag):
        engine(**_inputs("none"), **{flag: True})
    engine.module.config.output_hidden_states = True  # from the config, no keyword
    with pytest.raises(ShardwiseError, match="output_hidden_states"):
        engine(**_inputs("none"))


def test_enable_graph_says_an_encoder_has_no_decode_step():
    with pytest.raises(ConfigError, match="encoder: it has no decode step"):
        shardwise.init_inference(_model("base"), device="cpu", replace_with_kernel_inject=True,
                                 enable_graph=True)


def test_unsupported_masks_are_refused():
    _, engine = _pair("base")
    inputs = _inputs("none")
    causal = torch.ones(16, 16, dtype=torch.bool).tril().expand(4, 1, 16, 16)
    with pytest.raises(ShardwiseError, match="padding masks only"):
        engine(**inputs, attention_mask=causal)
    biases = torch.randn(4, 1, 16, 16)  # ALiBi-like additive biases are not a padding mask
    with pytest.raises(ShardwiseError, match="padding masks only"):
        engine(**inputs, attention_mask=biases)
    with pytest.raises(ShardwiseError, match="2-d .* or 4-d"):
        key_padding_mask(torch.ones(4, 16, 16, dtype=torch.bool), 4, 16)
    with pytest.raises(ShardwiseError, match="BlockMask"):
        key_padding_mask(object(), 4, 16)
    per_head = torch.ones(4, 4, 16, 16, dtype=torch.bool)
    per_head[:, 1, :, 3] = False  # one head hides a key the others see
    with pytest.raises(ShardwiseError, match="differs between queries or heads"):
        key_padding_mask(per_head, 4, 16)


def test_key_padding_mask_forms():
    m = torch.tensor([[1, 1, 0], [0, 1, 1]])
    want = m.bool()
    additive = torch.zeros(2, 1, 3, 3).masked_fill(~want[:, None, None, :], float("-inf"))
    for mask in (m, m.bool(), want[:, None, None, :].expand(2, 1, 3, 3), additive):
        assert torch.equal(key_padding_mask(mask, 2, 3), want)
    assert key_padding_mask(torch.ones(2, 3, dtype=torch.long), 2, 3) is None
    assert key_padding_mask(None, 2, 3) is None


def test_cross_attention_inputs_are_refused():
    _, engine = _pair("base")
    with pytest.raises(ShardwiseError, match="no cross-attention"):
        engine(**_inputs("none"), encoder_hidden_states=torch.randn(4, 5, 64))


@pytest.mark.parametrize("changes, match", [
    (dict(is_decoder=True), "is_decoder=True"),
    (dict(position_embedding_type="relative_key"), "position_embedding_type='relative_key'"),
    (dict(hidden_act="relu"), "activation 'relu'"),
])
def test_unsupported_configs_are_refused_at_init(changes, match):
    with pytest.raises(InjectionError, match=match):
        shardwise.init_inference(_model("base", **changes), device="cpu",
                                 replace_with_kernel_inject=True)


def test_injecting_twice_is_refused():
    model = _model("base")
    inject_model(model, shardwise.get_accelerator("cpu"), torch.float32, None)
    with pytest.raises(InjectionError, match="already injected"):
        inject_model(model, shardwise.get_accelerator("cpu"), torch.float32, None)


def test_max_tokens_is_refused_not_ignored_for_an_encoder():
    with pytest.raises(InjectionError, match="max_tokens=64.*encoder"):
        shardwise.init_inference(_model("base"), device="cpu", replace_with_kernel_inject=True,
                                 max_out_tokens=64)


def test_injection_records_its_encoder_swap_in_the_active_ledger():
    """The swap of the HF encoder is in the ledger's log: giving the log back (with a snapshot
    of an unrelated module, so only the log can do it) puts the HF encoder back."""
    from shardwise.ledger import Ledger

    model = _model("masked_lm")
    hf_encoder = model.bert.encoder
    ledger = Ledger(torch.nn.Module())
    with ledger.recording():
        encoder = inject_model(model, shardwise.get_accelerator("cpu"), torch.float32, None)
    assert model.bert.encoder is encoder and isinstance(encoder, InjectedEncoder)
    assert any("InjectedEncoder" in what for what in ledger.undos)
    ledger.give_back()
    assert model.bert.encoder is hf_encoder


def test_spec_is_validated():
    mlp = EncoderMLP(in_proj="i", out_proj="m", norm="n2")
    EncoderInjectionSpec(encoder="encoder", layers="layer", mlp=mlp,
                         attention=EncoderAttention(qkv=("q", "k", "v"), out_proj="o", norm="n1"))
    with pytest.raises(ValueError, match="qkv"):
        EncoderAttention(qkv=("q", "k"), out_proj="o", norm="n1")
    with pytest.raises(ValueError, match="in_proj"):
        EncoderMLP(in_proj="", out_proj="m", norm="n2")
    with pytest.raises(ValueError, match="activation_config"):
        EncoderMLP(in_proj="i", out_proj="m", norm="n2", activation_config=())
    with pytest.raises(ValueError, match="attention=.*EncoderAttention"):
        EncoderInjectionSpec(encoder="encoder", layers="layer", attention=mlp, mlp=mlp)


def test_flat_spec_fields_are_refused_naming_their_group():
    """A plugin's encoder spec written against the flat fields of earlier versions gets the
    mapping to the groups when it builds, replaces or reads one."""
    import dataclasses

    from shardwise.inject import MovedFieldError

    with pytest.raises(MovedFieldError) as err:
        EncoderInjectionSpec(encoder="encoder", layers="layer", qkv=("q", "k", "v"),
                             out_proj="o", attn_norm="n1", mlp_in="i", mlp_out="m",
                             mlp_norm="n2")
    for moved in ("qkv -> attention.qkv", "attn_norm -> attention.norm",
                  "mlp_in -> mlp.in_proj", "mlp_norm -> mlp.norm", "EncoderAttention("):
        assert moved in str(err.value), moved
    spec = BertPolicy.injection
    with pytest.raises(MovedFieldError, match="activation_config -> mlp.activation_config"):
        dataclasses.replace(spec, activation_config=("act",))
    with pytest.raises(MovedFieldError, match="moved to EncoderInjectionSpec.attention.out_proj"):
        spec.out_proj


# ----- tensor parallelism: 2 gloo ranks, all cases in one pair of processes ---------------------

TP_CASES = {f"{head}-{name}": (head, dtype) for head in ("base", "masked_lm")
            for name, dtype in DTYPES.items()}
TP_CASES["classifier-fp32"] = ("classifier", torch.float32)


def _tp_case(rank: int, head: str, dtype: torch.dtype) -> dict:
    ref = _model(head).to(dtype)
    model = _model(head)
    engine = shardwise.init_inference(model, device="cpu", dtype=dtype,
                                      replace_with_kernel_inject=True, **TP)
    worst, digests = {}, []
    for mask in MASKS:
        inputs = _inputs(mask)
        with torch.no_grad():
            expected = ref(**inputs)
            mine = inputs if rank == 0 else {k: torch.zeros_like(v) for k, v in inputs.items()}
            got = engine(**mine)  # the engine broadcasts rank 0's inputs
        worst[mask] = _max_diff(head, got, expected)
        digests.append(digest(next(iter(_outputs(head, got).values()))))
    encoder = model.base_model.encoder
    return dict(max_abs=worst, digests=digests, injected=isinstance(encoder, InjectedEncoder),
                local_heads=[layer.heads for layer in encoder.layer])


ranks = table_fixture(_tp_case, TP_CASES, "inject_bert_tp")


@pytest.mark.parametrize("name", list(TP_CASES))
def test_tp2_injection_matches_hf(ranks, name):
    r0, r1 = case(ranks, name)
    _, dtype = TP_CASES[name]
    assert r0["injected"] and r1["injected"]
    assert r0["local_heads"] == r1["local_heads"] == [2, 2]  # 4 heads over 2 ranks
    assert r0["digests"] == r1["digests"]  # every rank returns the same outputs
    print(f"{name}: max |diff| {r0['max_abs']}")
    for r in (r0, r1):
        assert max(r["max_abs"].values()) < TP_ATOL[dtype], r["max_abs"]

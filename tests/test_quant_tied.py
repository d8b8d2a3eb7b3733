"""A quantized output head tied to the input embeddings (shardwise.quant.tied): the table is
stored once (packed, under the head's name), the embedding reads only the rows it looks up
(packed_rows, against its oracle dequantize_rows), parity with the fp32 HF model holds within
families.QUANT_BOUNDS, no full-precision copy remains, save/reload keeps one table, tensor
parallelism (vocab-parallel head and embedding) works, and what cannot work is refused by name."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import shardwise
from families import QUANT_BOUNDS as BOUNDS
from models import logit_parity as parity, prompt_ids, tiny_causal_lm
from shardwise.errors import ConfigError, KernelError
from shardwise.kernels.cpu import quant as cpu_quant
from shardwise.kernels.reference import quant as ref_quant
from shardwise.quant import (QuantLinear, load_quantized, parse_quant, quantize_model,
                             save_quantized)
from shardwise.quant.tied import QuantEmbedding

CPU = shardwise.get_accelerator("cpu")
BF16 = torch.bfloat16
#: tiny families whose head is tied to the input embeddings (llama tied by config below)
TIED = ("gpt2", "opt", "bloom", "falcon", "llama-tied")


def tied_model(arch: str, seed: int = 0) -> nn.Module:
    if arch != "llama-tied":
        model = tiny_causal_lm(arch, seed)
    else:
        model = tiny_causal_lm("llama", seed)
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


def storage_bytes(model: nn.Module) -> int:
    """Bytes of every distinct storage the model's weights hold: its parameters and the packed
    buffers of its quantized layers (the rotary tables' buffers are no weights)."""
    seen: dict[int, int] = {}
    packed = [b for m in model.modules() if isinstance(m, QuantLinear) for b in m.buffers()]
    for t in [*model.parameters(), *packed]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


# ----- the row reads against the oracle ---------------------------------------------------------


def _layouts(qw):
    """The packed layouts whose rows are read: reference, native (the packing alone: no built op
    needed), torch int8 (8 bits)."""
    yield "reference", ref_quant.prepack(qw)
    tensors, meta = cpu_quant._pack_native(qw)
    yield "native", ref_quant.PackedQuantWeight("cpu", qw.spec, BF16, tensors, meta)
    if qw.bits == 8:
        yield "int8", ref_quant.PackedQuantWeight("cpu", qw.spec, BF16,
                                                  cpu_quant._pack_int8(qw, BF16), {"kind": "int8"})


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size,symmetric", [(-1, True), (32, True), (16, False)])
def test_packed_rows_equal_the_oracle_in_every_readable_layout(bits, group_size, symmetric):
    g = torch.Generator().manual_seed(3)
    qw = ref_quant.quantize_weight(torch.randn(50, 64, generator=g), bits, group_size, symmetric)
    ids = torch.tensor([[0, 49, 17, 16], [15, 3, 32, 33]])  # tile edges of the native layout
    oracle = ref_quant.dequantize_rows(qw, ids)
    assert torch.equal(oracle, ref_quant.dequantize_weight(qw)[ids])
    for layout, packed in _layouts(qw):
        got = ref_quant.packed_rows(packed, ids)
        assert got.shape == (2, 4, 64)
        if layout == "int8":  # torch's int8 layout: bf16 scales, float32 offsets -zero * scale
            assert torch.allclose(got, int8_layout_rows(qw, ids), rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(got, oracle), layout


def int8_layout_rows(qw, ids):
    """What torch's int8 layout computes with: ``q * bf16(scale) - zero * scale``."""
    q = ref_quant.int_weight(qw).float().reshape(qw.out_features, -1, qw.group_size)
    w = q * qw.scales.to(BF16).float()[..., None]
    if qw.zeros is not None:
        w = w - (qw.zeros * qw.scales)[..., None]
    return w.reshape(qw.out_features, -1)[ids]


def test_packed_rows_refuse_an_opaque_layout_by_name():
    qw = ref_quant.quantize_weight(torch.randn(32, 64), 4, 32)
    tensors, group = cpu_quant._pack_int4(qw, BF16)
    packed = ref_quant.PackedQuantWeight("cpu", qw.spec, BF16, tensors,
                                         {"kind": "int4", "kernel_group": group})
    with pytest.raises(KernelError, match="opaque"):
        ref_quant.packed_rows(packed, torch.tensor([1]))


def test_packed_rows_compile_without_graph_breaks():
    qw = ref_quant.quantize_weight(torch.randn(40, 64), 4, 32)
    tensors, meta = cpu_quant._pack_native(qw)
    packed = ref_quant.PackedQuantWeight("cpu", qw.spec, BF16, tensors, meta)
    fn = torch.compile(lambda ids: ref_quant.packed_rows(packed, ids, BF16), fullgraph=True)
    ids = torch.tensor([[5, 39]])
    assert torch.equal(fn(ids), ref_quant.dequantize_rows(qw, ids, BF16))


# ----- the model: stored once, parity, bytes ----------------------------------------------------


@pytest.mark.parametrize("arch", TIED)
@pytest.mark.parametrize("bits", [8, 4])
def test_a_tied_head_is_quantized_once_with_parity(arch, bits):
    ref, model = tied_model(arch), tied_model(arch)
    embed_name = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    vocab, hidden = model.get_input_embeddings().weight.shape
    ids = prompt_ids(batch=2, length=16)
    with torch.no_grad():
        ref_logits = ref(ids).logits
    before = storage_bytes(model)
    table = weakref.ref(model.get_input_embeddings().weight)
    report = quantize_model(model, {"weight": {"num_bits": bits}, "lm_head": True}, CPU, BF16)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, QuantLinear) and isinstance(embed, QuantEmbedding)
    assert embed.head is head and head.spec.bits == 8  # tied: 8 bits by default, 4 or 8
    assert report.layers[report_head(report)].bits == 8
    # no full-precision table left: the tied Parameter is gone (nothing holds it), and the
    # model's bytes are its parameters' plus the packed table's, nothing more
    gc.collect()
    assert table() is None
    assert head.weight_nbytes < vocab * hidden * 2  # < the bf16 table: once, int8 + scales
    assert f"{embed_name}.weight" not in model.state_dict()
    assert storage_bytes(model) < before
    assert storage_bytes(model) == report.bytes_after
    with torch.no_grad():
        logits = model(ids).logits
        rows = embed(ids)
    # the embedding returns exactly the rows the head computes with
    kernel_qw = cpu_quant.unpack_native(head.packed) if head.meta.get("kind") == "native" \
        else None
    if kernel_qw is not None:
        assert torch.equal(rows, ref_quant.dequantize_rows(kernel_qw, ids, BF16))
    rel, agree = parity(ref_logits, logits)
    max_rel, min_agree = BOUNDS[bits]
    print(f"{arch} int{bits} tied head int8: rel {rel:.4f} agree {agree:.2f}")
    assert rel < max_rel and agree >= min_agree


def report_head(report) -> str:
    return next(n for n, layer in report.layers.items() if layer.kind == "lm_head")


def test_an_int8_tied_head_keeps_hfs_greedy_tokens():
    """int8 everywhere (the head tied): the same greedy tokens as the fp32 HF model."""
    ref, model = tied_model("gpt2"), tied_model("gpt2")
    quantize_model(model, {"weight": {"num_bits": 8}, "lm_head": True}, CPU, torch.float32)
    ids = prompt_ids(batch=1, length=8)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ref.generate(ids, **kw), model.generate(ids, **kw))


def test_the_tied_head_bits_can_be_chosen_and_round_trip():
    config = parse_quant({"weight": {"num_bits": 4}, "lm_head": {"num_bits": 4, "group_size": 32}})
    assert (config.lm_head_bits, config.lm_head_group_size) == (4, 32)
    assert parse_quant(config.to_dict()) == config
    assert config.for_head(tied=True).bits == 4 and config.for_head(True).group_size == 32
    plain = parse_quant({"weight": {"num_bits": 4}, "lm_head": True})
    assert plain.for_head(tied=True).bits == 8 and plain.for_head(tied=False).bits == 4
    assert parse_quant({"weight": {"num_bits": 4}, "lm_head": {"enabled": False}}).lm_head is False
    model = tied_model("gpt2")
    quantize_model(model, config, CPU, BF16)
    head = model.get_output_embeddings()
    assert (head.spec.bits, head.spec.group_size) == (4, 32)
    assert isinstance(model.get_input_embeddings(), QuantEmbedding)


@pytest.mark.parametrize("value,match", [
    ({"num_bits": 3}, "num_bits must be the integer 4 or 8"),
    ({"bits": 8}, "unknown quant lm_head key 'bits'"),
    ("yes", "lm_head must be true or false"),
])
def test_bad_lm_head_settings_are_named(value, match):
    with pytest.raises(ConfigError, match=match):
        parse_quant({"weight": {"num_bits": 4}, "lm_head": value})


def test_a_layout_without_readable_rows_is_refused_before_any_layer_changes(monkeypatch):
    """torch's int4 CPU layout is opaque: a tied int4 head on it is refused, model untouched."""
    monkeypatch.setenv("SHARDWISE_CPU_QUANT_KERNEL", "torch")
    model = tied_model("llama-tied")
    with pytest.raises(ConfigError, match="tied to the input embeddings.*opaque"):
        quantize_model(model, {"weight": {"num_bits": 4}, "lm_head": {"num_bits": 4}}, CPU, BF16)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    # its int8 layout has readable rows: the default tied head works there
    quantize_model(model, {"weight": {"num_bits": 4}, "lm_head": True}, CPU, BF16)
    assert model.get_output_embeddings().meta["kind"] == "int8"
    assert isinstance(model.get_input_embeddings(), QuantEmbedding)


def test_an_embedding_subclass_is_refused_by_name():
    class Scaled(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 2.0

    model = tied_model("llama-tied")
    old = model.model.embed_tokens
    scaled = Scaled(*old.weight.shape)
    scaled.weight = old.weight
    model.model.embed_tokens = scaled
    with pytest.raises(ConfigError, match="Scaled, not a plain nn.Embedding"):
        quantize_model(model, {"weight": {"num_bits": 8}, "lm_head": True}, CPU, BF16)


# ----- save / reload, checkpoint reading, the engine ----------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
def test_save_and_reload_keep_one_table(tmp_path, bits):
    from safetensors import safe_open

    model = tied_model("gpt2")
    quantize_model(model, {"weight": {"num_bits": bits}, "lm_head": True}, CPU, BF16)
    path = save_quantized(model, tmp_path / "q.safetensors")
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
    assert "lm_head.qweight" in keys and not [k for k in keys if k.startswith("transformer.wte")]
    fresh = tied_model("gpt2", seed=5)
    load_quantized(fresh, path)
    assert isinstance(fresh.get_input_embeddings(), QuantEmbedding)
    assert fresh.get_input_embeddings().head is fresh.get_output_embeddings()
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)


def test_init_inference_quantizes_a_tied_head_once_and_undo_reties(tmp_path):
    ref, model = tied_model("gpt2"), tied_model("gpt2")
    engine = shardwise.init_inference(model, device="cpu", dtype=BF16,
                                      quant={"weight": {"num_bits": 4}, "lm_head": True})
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        rel, agree = parity(ref(ids).logits, engine(input_ids=ids).logits)
    assert rel < BOUNDS[4][0] and agree >= BOUNDS[4][1]
    assert isinstance(engine.module.get_input_embeddings(), QuantEmbedding)
    given = engine.close()  # back to float modules, dequantized, and tied again
    assert given is model and type(given.get_input_embeddings()) is nn.Embedding
    assert given.get_output_embeddings().weight is given.get_input_embeddings().weight
    with torch.no_grad():
        rel_back, _ = parity(ref(ids).logits, given(ids).logits)
    assert rel_back < BOUNDS[4][0]  # the int4 layers and the int8 table, dequantized


def test_checkpoint_reading_quantizes_a_tied_head_once(tmp_path):
    model = tied_model("gpt2")
    model.save_pretrained(tmp_path / "hf")
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        ref_logits = model(ids).logits
    engine = shardwise.init_inference(None, checkpoint=str(tmp_path / "hf"), device="cpu",
                                      dtype=BF16, quant={"weight": {"num_bits": 8},
                                                         "lm_head": True})
    loaded = engine.module
    assert isinstance(loaded.get_input_embeddings(), QuantEmbedding)
    assert isinstance(loaded.get_output_embeddings(), QuantLinear)
    with torch.no_grad():
        rel, agree = parity(ref_logits, engine(input_ids=ids).logits)
    assert rel < BOUNDS[8][0] and agree >= BOUNDS[8][1]



def test_the_compiled_decode_step_runs_the_tied_lookup_as_eager_does():
    """CPU graphs compile the decode step with the QuantEmbedding's row reads inside it."""
    ids = prompt_ids(batch=1, length=8)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    quant = {"weight": {"num_bits": 8}, "lm_head": True}
    graphs = shardwise.init_inference(tied_model("gpt2"), device="cpu", dtype=BF16,
                                      replace_with_kernel_inject=True, enable_graph=True,
                                      quant=quant, max_tokens=64)
    eager = shardwise.init_inference(tied_model("gpt2"), device="cpu", dtype=BF16, quant=quant)
    assert isinstance(graphs.module.get_input_embeddings(), QuantEmbedding)
    assert torch.equal(graphs.generate(ids, **kw), eager.generate(ids, **kw))

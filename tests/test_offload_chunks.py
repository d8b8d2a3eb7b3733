"""Offload slots sized by the decoder layers (``shardwise.offload.chunks``): an output head
larger than a slot streams in row chunks, an input embedding larger than a slot reads only the
rows of its ids, and the model computes exactly what it computes resident.

The tiny test families have a 256-token vocabulary, so their embeddings are smaller than a
layer; these tests give them a vocabulary of :data:`VOCAB` (GPT-2 tied: a 512 KiB table against
a 195 KiB layer; Llama untied: two 512 KiB tables against 145 KiB layers), which makes the
head and the embedding several slots large. Every case runs fp32 from the ``"nvme"`` tier under
``tmp_path`` against the same model resident: greedy tokens identical, logits within 1e-6 (the
chunked head alone: exactly equal).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import shardwise
from families import family
from models import prompt_ids
from shardwise.offload.chunks import (GatheredEmbedding, _runs, chunk_pieces, chunk_rows,
                                      row_multiple)
from shardwise.offload.store import ALIGN, TensorEntry, layout_unit, unit_filename
from tp_harness import TP, case, table_fixture

VOCAB = 2048
ATOL = 1e-6
NEW_TOKENS = 10
GREEDY = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              pad_token_id=0)


def big_vocab_lm(arch: str, vocab: int = VOCAB, seed: int = 0) -> nn.Module:
    """A tiny ``arch`` causal LM whose vocabulary is ``vocab`` (embedding and head larger than a
    decoder layer)."""
    spec = dict(family(arch).config)
    spec["vocab_size"] = vocab
    config = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _offload(path, k: int = 2, device: str = "nvme") -> dict:
    out = {"device": device, "buffer_count": k}
    if device == "nvme":
        out["nvme_path"] = str(path)
    return out


def _ids(batch: int = 2, length: int = 8) -> torch.Tensor:
    return prompt_ids(batch=batch, length=length, vocab=VOCAB)


def _layer_blob_bytes(engine) -> int:
    """The largest decoder layer's blob file in the engine's store (units 1 .. L)."""
    layers = engine.module.config.num_hidden_layers
    return max(os.path.getsize(Path(engine.offload.path) / unit_filename(i))
               for i in range(1, layers + 1))


def _model_bytes(model: nn.Module) -> int:
    seen = {id(p): p for p in model.parameters()}  # tied: once
    return sum(p.numel() * p.element_size() for p in seen.values())


def _layer_param_bytes(model: nn.Module) -> int:
    layers = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return sum(p.numel() * p.element_size() for p in layers.parameters())


CASES = [("gpt2", False, 2), ("gpt2", True, 3), ("llama", False, 3), ("llama", True, 2)]


@pytest.mark.parametrize("arch,inject,k", CASES,
                         ids=[f"{a}-{'inject' if i else 'hf'}-k{k}" for a, i, k in CASES])
def test_chunked_head_and_gathered_embedding_match_the_resident_model(arch, inject, k,
                                                                        tmp_path):
    ids = _ids()
    settings = dict(device="cpu", dtype=torch.float32, replace_with_kernel_inject=inject)
    resident = shardwise.init_inference(big_vocab_lm(arch), **settings)
    ref_logits = resident(input_ids=ids).logits
    ref_tokens = resident.generate(ids, **GREEDY)
    engine = shardwise.init_inference(big_vocab_lm(arch), offload=_offload(tmp_path, k),
                                      **settings)
    report = engine.offload
    head = "lm_head"
    embed = "transformer.wte" if arch == "gpt2" else "model.embed_tokens"
    # the slots are sized by the largest layer, and the vocabulary-sized units do not fit one
    slot = _layer_blob_bytes(engine)
    assert report.slot_bytes == slot and report.ring_bytes == k * slot
    layers = "transformer.h." if arch == "gpt2" else "model.layers."
    assert report.slot_unit.startswith(layers)
    head_file = unit_filename(engine.module.config.num_hidden_layers + 1)  # after embed, layers
    assert os.path.getsize(Path(report.path) / head_file) > 2 * slot
    assert report.chunked[head] >= 3 and report.gathered == [embed]
    assert report.resident_units == []
    assert f"{head} in {report.chunked[head]} row chunks" in report.summary()
    assert f"{embed} rows read on demand" in report.summary()
    report.reset_stats()
    logits = engine(input_ids=ids).logits
    tokens = engine.generate(ids, **GREEDY)
    assert (logits - ref_logits).abs().max() <= ATOL
    assert torch.equal(tokens, ref_tokens)
    stats = report.stats()
    assert stats["units_read"] == len(report.units)  # every layer and every chunk was read
    assert engine._ledger.held_bytes()["parameters"] == 0  # no original kept aside
    assert 0 < stats["gathered_bytes"] < stats["bytes_read"]
    # a pass streams the layers and the head once, plus a few rows for the input
    per_pass = stats["bytes_read"] / stats["passes"]
    blobs = sum(f.stat().st_size for f in Path(report.path).glob("unit-*.bin"))
    table = VOCAB * engine.module.config.hidden_size * 4
    # before, a pass read every blob (the embedding's and the head's whole): now one table less
    assert per_pass < blobs - 0.9 * table
    # the model's bytes as the store lays them out (each layer's tensors padded to 4 KiB), the
    # table counted once: a pass reads less
    padding = sum(os.path.getsize(Path(report.path) / unit_filename(i + 1)) for i in range(
        engine.module.config.num_hidden_layers)) - _layer_param_bytes(resident.module)
    assert per_pass < _model_bytes(resident.module) + padding


def test_the_chunked_head_is_exactly_the_unchunked_one(tmp_path):
    ref = big_vocab_lm("llama")
    engine = shardwise.init_inference(big_vocab_lm("llama"), device="cpu", dtype=torch.float32,
                                      offload=_offload(tmp_path, 2))
    x = torch.randn(3, 5, ref.config.hidden_size)
    head = engine.module.lm_head
    assert "forward" in vars(head) and isinstance(head, nn.Linear)  # instance level, same class
    with torch.no_grad():
        assert torch.equal(head(x), ref.lm_head(x))
        ids = torch.tensor([[0, 5, 5, 2047, 17, 16], [4095 % VOCAB, 1, 2, 3, 4, 1000]])
        assert torch.equal(engine.module.get_input_embeddings()(ids), ref.model.embed_tokens(ids))
        with pytest.raises(IndexError):
            engine.module.get_input_embeddings()(torch.tensor([[VOCAB]]))


def test_hooks_of_the_head_still_run(tmp_path):
    engine = shardwise.init_inference(big_vocab_lm("llama"), device="cpu", dtype=torch.float32,
                                      offload=_offload(tmp_path, 2))
    seen = []
    handle = engine.module.lm_head.register_forward_hook(
        lambda m, a, out: seen.append(tuple(out.shape)))
    engine(input_ids=_ids(1, 4))
    handle.remove()
    assert seen == [(1, 4, VOCAB)]


def test_close_gives_back_the_whole_model(tmp_path):
    ids = _ids()
    ref = big_vocab_lm("gpt2")
    with torch.no_grad():
        ref_logits = ref(ids).logits
    model = big_vocab_lm("gpt2")
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      offload=_offload(tmp_path, 2))
    engine.generate(ids, **GREEDY)
    back = engine.close()
    assert back.lm_head.weight is back.transformer.wte.weight  # still tied
    assert "forward" not in vars(back.lm_head) and "forward" not in vars(back.transformer.wte)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ref_logits)
    assert torch.equal(back.lm_head.weight, ref.lm_head.weight)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_an_embedding_with_max_norm_stays_resident(arch, tmp_path):
    """max_norm renormalizes the table while looking up: not gathered, kept resident (a tied
    head with it); the rest still streams and the tokens match."""
    ids = _ids()
    ref = big_vocab_lm(arch)
    model = big_vocab_lm(arch)
    for m in (ref, model):
        m.get_input_embeddings().max_norm = 1.0
    with torch.no_grad():
        ref_tokens = ref.generate(ids, **GREEDY)
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      offload=_offload(tmp_path, 2))
    report = engine.offload
    embed = "transformer.wte" if arch == "gpt2" else "model.embed_tokens"
    expect = [embed, "lm_head"] if arch == "gpt2" else [embed]
    assert report.resident_units == expect and report.gathered == []
    assert ("lm_head" in report.chunked) == (arch == "llama")
    assert "kept resident" in report.summary()
    table = VOCAB * model.config.hidden_size * 4
    assert report.resident_bytes >= table
    assert torch.equal(engine.generate(ids, **GREEDY), ref_tokens)


def test_a_quantized_head_streams_unchunked_or_stays_resident(tmp_path):
    """quant lm_head=True: the head is a quantized linear (not nn.Linear's forward), so it is not
    chunked; it is larger than a slot, so it stays resident. Tokens match the same quantized
    model resident."""
    ids = _ids()
    settings = dict(device="cpu", dtype=torch.float32,
                    quant={"weight": {"num_bits": 8}, "lm_head": True})
    resident = shardwise.init_inference(big_vocab_lm("llama"), **settings)
    engine = shardwise.init_inference(big_vocab_lm("llama"), offload=_offload(tmp_path, 2),
                                      **settings)
    report = engine.offload
    assert "lm_head" not in report.chunked
    assert "lm_head" in report.resident_units or "lm_head" in report.units
    assert torch.equal(engine.generate(ids, **GREEDY), resident.generate(ids, **GREEDY))


def test_chunk_geometry():
    # fp32 rows of 64: 256 B, so 16 rows make an aligned step; a 10 000 B slot holds 39 rows
    w = TensorEntry("weight", torch.float32, (1000, 64), 0, 1000 * 64 * 4)
    assert row_multiple(256) == 16 and chunk_rows(w, 10_000) == 32
    assert row_multiple(4096) == 1 and row_multiple(6 * 4) == 512
    assert chunk_rows(w, 255) == 0
    assert _runs([0, 256, 8192, 12288 - 100], 256) == [(0, 4096), (8192, 16384)]
    # GPT-2 24l-1024h's head (50257 x 1024 fp32) in slots of its 48 MiB layers: 5 chunks of
    # balanced size, each aligned and within a slot, covering every row once
    slot = 50_384_896
    head = layout_unit(25, "lm_head", [("weight", torch.empty(50257, 1024, device="meta"))])
    pieces = chunk_pieces(24, head, slot)
    assert [p.index for p in pieces] == [24, 25, 26, 27, 28]
    assert [p.rows for p in pieces] == [(i * 10052, min((i + 1) * 10052, 50257))
                                        for i in range(5)]
    assert all(p.offset % ALIGN == 0 and p.nbytes % ALIGN == 0 and p.nbytes <= slot
               and p.offset + p.nbytes <= head.nbytes for p in pieces)


def test_gathered_rows_read_aligned_blocks(tmp_path):
    """Rows straddling a block boundary and repeated ids come back exact, with one read per run
    of adjacent blocks."""
    engine = shardwise.init_inference(big_vocab_lm("llama"), device="cpu", dtype=torch.float32,
                                      offload=_offload(tmp_path, 2))
    ref = big_vocab_lm("llama").model.embed_tokens.weight
    gather = vars(engine.module.model.embed_tokens)["forward"]
    assert isinstance(gather, GatheredEmbedding)
    reads, threads = [], []
    real = gather.reader.read

    def read(*a):
        reads.append(a[1:3])
        threads.append(threading.current_thread().name)
        return real(*a)
    gather.reader.read = read
    ids = [0, 1, 15, 16, 17, 100, 2047]
    rows = gather.read_rows(ids)
    assert torch.equal(rows, ref[ids])
    # rows 0..17 (256 B each) are in blocks 0-1, 100 in block 6, 2047 in block 127
    assert len(reads) == 3 and all(o % ALIGN == 0 and n % ALIGN == 0 for o, n in reads)
    # the runs are read on the row readers' threads (at once), not one by one by the caller
    assert all(name.startswith("shardwise-rows") for name in threads), threads
    engine.close()  # the readers stop; a later lookup reads on the calling thread
    threads.clear()
    assert torch.equal(gather.read_rows(ids), ref[ids])
    assert threads == [threading.current_thread().name] * 3


def test_gathered_rows_closed_while_submitting_finish_on_the_calling_thread(tmp_path):
    """A close() on another thread between taking the pool and submitting every run: the runs
    not submitted are read by the caller, none twice, none lost."""
    engine = shardwise.init_inference(big_vocab_lm("llama"), device="cpu", dtype=torch.float32,
                                      offload=_offload(tmp_path, 2))
    ref = big_vocab_lm("llama").model.embed_tokens.weight
    gather = vars(engine.module.model.embed_tokens)["forward"]
    pool = gather.reader._row_pool()
    submits, real_submit = [], pool.submit

    def submit(*a):
        if submits:  # the second run: as if closed in between
            raise RuntimeError("cannot schedule new futures after shutdown")
        submits.append(a)
        return real_submit(*a)
    pool.submit = submit
    ids = [0, 100, 2047]  # three runs of blocks
    assert torch.equal(gather.read_rows(ids), ref[ids])
    assert len(submits) == 1
    engine.close()


# ----- tensor parallelism ------------------------------------------------------------------------


def _tp_case(rank: int, arch: str, store: str) -> dict:
    os.makedirs(store, exist_ok=True)
    ids = _ids()
    settings = dict(device="cpu", dtype=torch.float32)
    resident = shardwise.init_inference(big_vocab_lm(arch), **settings, **TP)
    mine = ids if rank == 0 else torch.zeros_like(ids)
    ref_logits = resident(input_ids=mine).logits
    ref_tokens = resident.generate(mine, **GREEDY)
    engine = shardwise.init_inference(big_vocab_lm(arch), offload=_offload(store, 2),
                                      **settings, **TP)
    logits = engine(input_ids=mine).logits
    tokens = engine.generate(mine, **GREEDY)
    report = engine.offload
    return dict(max_abs=(logits - ref_logits).abs().max().item(),
                tokens_equal=torch.equal(tokens, ref_tokens), tokens=tokens.tolist(),
                chunked=report.chunked, gathered=report.gathered,
                units_read=report.stats()["units_read"], units=len(report.units))


TP_TABLE = {"gpt2": ("gpt2",), "llama": ("llama",)}


tp_ranks = table_fixture(_tp_case, TP_TABLE, "offload-chunks-tp", deadline_s=300, case_dirs=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TP_TABLE))
def test_tp2_chunked_head_and_gathered_embedding_match_resident_tp(tp_ranks, name):
    r0, r1 = case(tp_ranks, name)
    for r in (r0, r1):
        assert r["max_abs"] <= ATOL and r["tokens_equal"], r
        assert r["chunked"].get("lm_head", 0) >= 2 and len(r["gathered"]) == 1, r
        assert r["units_read"] == r["units"]
    assert r0["tokens"] == r1["tokens"]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_checkpoint_loaded_straight_into_blobs_chunks_and_gathers_too(arch, tmp_path):
    """``checkpoint=`` with ``offload=``: the units are written while loading (on meta until the
    offload step), then the head's chunks and the embedding's rows are read from those blobs."""
    ids = _ids()
    ref = big_vocab_lm(arch)
    with torch.no_grad():
        ref_tokens = ref.generate(ids, **GREEDY)
        ref_logits = ref(ids).logits
    ref.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "nvme").mkdir()
    engine = shardwise.init_inference(None, checkpoint=str(tmp_path / "ckpt"), device="cpu",
                                      dtype=torch.float32,
                                      offload=_offload(tmp_path / "nvme", 2))
    report = engine.offload
    assert report.chunked.get("lm_head", 0) >= 3 and len(report.gathered) == 1
    assert (engine(ids).logits - ref_logits).abs().max() <= ATOL
    assert torch.equal(engine.generate(ids, **GREEDY), ref_tokens)
    assert not any(p.is_meta for p in engine.module.parameters())


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_chunks_through_the_copy_stream_path(tier, tmp_path, monkeypatch):
    """The accelerator path (host blob or staging slot -> device slot on a copy stream), run on
    this CPU as tests/test_offload.py does: the chunks are copied like layers, the embedding's
    rows come from the host blob (``"cpu"``) or the file (``"nvme"``)."""
    from shardwise.offload import ring as ring_module
    from shardwise.offload.ring import DeviceLoader
    from shardwise.offload.transform import offload_model

    class Event:
        def __init__(self, device):
            pass

        def record(self, stream=None):
            pass

        def wait(self, stream=None):
            pass

        def synchronize(self):
            pass
    monkeypatch.setattr(ring_module, "device_event", Event)
    ids = _ids()
    resident = shardwise.init_inference(big_vocab_lm("gpt2"), device="cpu", dtype=torch.float32)
    ref_tokens = resident.generate(ids, **GREEDY)
    engine = shardwise.init_inference(big_vocab_lm("gpt2"), device="cpu", dtype=torch.float32)
    monkeypatch.setattr(engine.accelerator, "computes_in_host_memory", False)
    settings = {"device": tier, "buffer_count": 3, "pin_memory": False,
                **({"nvme_path": str(tmp_path)} if tier == "nvme" else {})}
    report = offload_model(engine.module, settings, engine.accelerator, engine.device,
                           engine.plan)
    try:
        assert isinstance(report.ring.loader, DeviceLoader)
        assert report.chunked["lm_head"] >= 3 and report.gathered == ["transformer.wte"]
        assert torch.equal(engine.generate(ids, **GREEDY), ref_tokens)
        assert report.stats()["units_read"] == len(report.units)
    finally:
        report.close()


def test_a_chunked_head_with_a_bias_keeps_the_bias_resident(tmp_path):
    ids = _ids()
    ref, model = big_vocab_lm("llama"), big_vocab_lm("llama")
    bias = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    for m in (ref, model):
        m.lm_head.bias = nn.Parameter(bias.clone(), requires_grad=False)
    with torch.no_grad():
        ref_logits, ref_tokens = ref(ids).logits, ref.generate(ids, **GREEDY)
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      offload=_offload(tmp_path, 2))
    report = engine.offload
    assert report.chunked["lm_head"] >= 3
    assert report.resident_bytes >= VOCAB * 4  # the bias
    assert torch.equal(model.lm_head.bias, bias)
    assert torch.equal(engine(ids).logits, ref_logits)
    assert torch.equal(engine.generate(ids, **GREEDY), ref_tokens)

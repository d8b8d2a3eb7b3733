"""Offload with a quantized output head tied to the input embeddings (``quant={"lm_head": ...}``,
shardwise.quant.tied): the table is stored once, in the head's packed buffers, and the
``QuantEmbedding`` reads rows of it before the first layer runs — outside the head's forward,
when a ring slot would hold some other unit. The head therefore stays resident
(shardwise.offload.chunks.read_outside) and the layers stream; tokens match the resident model.
"""

from __future__ import annotations

import pytest
import torch

import shardwise
from models import prompt_ids, tiny_causal_lm
from shardwise.quant.tied import QuantEmbedding

NEW_TOKENS = 10
GREEDY = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              pad_token_id=0)


@pytest.mark.parametrize("head", [True, {"num_bits": 4, "group_size": 32}],
                         ids=["head-default-bits", "head-int4"])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_tied_head_stays_resident_and_tokens_match(bits, head, tmp_path):
    ids = prompt_ids(batch=2, length=8)
    settings = {"device": "cpu", "dtype": torch.float32,
                "quant": {"weight": {"num_bits": bits}, "lm_head": head}}
    resident = shardwise.init_inference(tiny_causal_lm("gpt2"), **settings)
    engine = shardwise.init_inference(
        tiny_causal_lm("gpt2"), offload={"device": "nvme", "nvme_path": str(tmp_path),
                                         "buffer_count": 2}, **settings)
    embedding = engine.module.get_input_embeddings()
    assert isinstance(embedding, QuantEmbedding)  # the table once, in the head
    assert engine.offload.resident_units == ["lm_head"]
    assert "lm_head" not in engine.offload.units
    engine.offload.reset_stats()
    logits, ref = engine(input_ids=ids).logits, resident(input_ids=ids).logits
    assert torch.equal(logits, ref)  # the same kernels on the same bytes
    assert torch.equal(engine.generate(ids, **GREEDY), resident.generate(ids, **GREEDY))
    stats = engine.offload.stats()
    assert stats["units_read"] == len(engine.offload.units)  # the layers did stream
    assert stats["passes"] >= NEW_TOKENS
    # the head's packed table is real memory outside the ring (its rows are looked up between
    # passes, when every slot may hold a layer)
    slots = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in engine.offload.ring.loader.slots]
    for name in embedding.head._tensor_names:
        ptr = getattr(embedding.head, name).untyped_storage().data_ptr()
        assert not any(lo <= ptr < hi for lo, hi in slots), name

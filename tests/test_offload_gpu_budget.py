"""Offload on a GPU whose memory is a third of the model (issue 17's GPU item).

The process's CUDA allocator is capped (``torch.cuda.set_per_process_memory_fraction``) at a
third of the model's weight bytes, which stands in for a GPU three times smaller than the model:
any allocation past the cap raises an out-of-memory error, so the run finishing is the memory
check. The model streams from pinned host memory through the ring; its greedy tokens must equal
the same model resident on the same GPU (run before the cap), no decoder layer's weights may sit
on the GPU outside the ring, and the allocator's peak must stay within the ring, the resident
parts and a stated margin.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import shardwise
from models import prompt_ids

#: a Llama whose decoder layers dominate its bytes: 24 layers of 15.2 M parameters (61 MB fp32)
#: beside a 1024-token vocabulary, so the ring (3 layers) is a small part of the budget
CONFIG = dict(vocab_size=1024, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256)
NEW_TOKENS = 16
BUFFERS = 3
#: activations, the KV cache and the allocator's rounding, beside the ring and resident parts
MARGIN = 64 << 20


def _model() -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _tokens(engine, ids: torch.Tensor) -> torch.Tensor:
    out = engine.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0)
    return out.cpu()


@pytest.mark.gpu
def test_model_three_times_the_gpu_budget_generates_as_resident():
    settings = {"device": "cuda", "dtype": torch.float32, "replace_with_kernel_inject": True}
    ids = prompt_ids(batch=2, length=12).cuda()
    probe = _model()
    model_bytes = sum(p.numel() * p.element_size() for p in probe.parameters())
    layer_bytes = sum(p.numel() * p.element_size() for p in probe.model.layers[0].parameters())
    outside = model_bytes - layer_bytes * len(probe.model.layers)  # embedding, head, norm
    del probe
    resident = shardwise.init_inference(_model(), **settings)
    expected = _tokens(resident, ids)
    resident.close()
    del resident
    torch.cuda.empty_cache()

    budget = model_bytes // 3
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(budget / total, 0)
    engine = None
    try:
        torch.cuda.reset_peak_memory_stats(0)
        engine = shardwise.init_inference(
            _model(), offload={"device": "cpu", "pin_memory": True, "buffer_count": BUFFERS},
            **settings)
        on_gpu = [n for n, p in engine.module.model.layers.named_parameters()
                  if p.device.type == "cuda"]
        tokens = _tokens(engine, ids)
        peak = torch.cuda.max_memory_allocated(0)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        if engine is not None:  # after the cap: close() may bring weights back
            engine.close()
    assert torch.equal(tokens, expected)
    assert not on_gpu, on_gpu[:4]  # every layer's weights live in the host blobs
    assert peak <= BUFFERS * layer_bytes + outside + MARGIN, (peak, layer_bytes, outside)

"""init_inference: the model is transformed in place; bad input fails before any heavy work."""

import pytest
import torch

import shardwise
from models import prompt_ids, tiny_causal_lm


def test_module_is_the_users_model_cast_in_place():
    model = tiny_causal_lm("llama")
    engine = shardwise.init_inference(model, device="cpu", dtype="bf16")
    assert engine.module is model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.dtype == torch.bfloat16
    assert not model.training
    assert engine.dtype == torch.bfloat16 and engine.device == torch.device("cpu")


def test_dtype_none_keeps_the_models_dtype_and_auto_takes_the_preferred():
    model = tiny_causal_lm("gpt2")
    assert shardwise.init_inference(model, device="cpu").dtype == torch.float32
    acc = shardwise.get_accelerator("cpu")
    assert shardwise.init_inference(model, device="cpu", dtype="auto").dtype == acc.preferred_dtype


def test_integer_buffers_keep_their_dtype():
    model = tiny_causal_lm("gpt2")
    before = {n: b.dtype for n, b in model.named_buffers() if not b.is_floating_point()}
    shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16)
    after = {n: b.dtype for n, b in model.named_buffers() if not b.is_floating_point()}
    assert before == after


def test_device_veto_leaves_the_model_untouched():
    model = tiny_causal_lm("llama")
    with pytest.raises(shardwise.UnsupportedDtypeError, match="cannot run dtype float16.*float32"):
        shardwise.init_inference(model, device="cpu", dtype=torch.float16)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_unknown_device_lists_installed_plugins():
    with pytest.raises(shardwise.PluginError, match="unknown device 'cpuu'.*cpu.*Did you mean 'cpu'"):
        shardwise.init_inference(tiny_causal_lm("llama"), device="cpuu")


def test_bad_model_arguments():
    with pytest.raises(shardwise.ConfigError, match="must be a torch.nn.Module"):
        shardwise.init_inference("some/model", device="cpu")
    with torch.device("meta"):
        meta = tiny_causal_lm("llama")
    with pytest.raises(shardwise.ConfigError, match="meta device"):
        shardwise.init_inference(meta, device="cpu")


def test_engine_call_moves_inputs_and_matches_the_model():
    model = tiny_causal_lm("opt")
    ids = prompt_ids()
    with torch.no_grad():
        expected = model(ids).logits
    engine = shardwise.init_inference(model, device="cpu")
    assert torch.equal(engine(input_ids=ids).logits, expected)
    assert torch.equal(engine.generate(ids, max_new_tokens=4, do_sample=False),
                       model.generate(ids, max_new_tokens=4, do_sample=False))

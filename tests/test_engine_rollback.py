"""A failed ``init_inference`` leaves the model as handed in, and ``engine.close()`` gives it
back (shardwise.ledger): same module objects, same Parameter objects holding the same tensors,
no hooks, no instance-level forwards, no new attributes, identical outputs; a retry works.
Also the static KV cache checked against the device's free memory at init."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import shardwise
from shardwise import transforms
from shardwise.errors import ConfigError, ShardwiseError
from shardwise.inject import InjectedModel, KVCacheMemoryError
from shardwise.ledger import Ledger
from shardwise.quant import Quantizer, QuantLinear
from models import prompt_ids, tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
              "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
              "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
              "_load_state_dict_pre_hooks")
BAD_QUANT = {"weight": {"num_bits": 8, "q_groups": 3}}  # 3 equal groups do not fit 64 in_features
GOOD_QUANT = {"weight": {"num_bits": 8}}  # per channel


def fingerprint(model: nn.Module) -> dict:
    """Everything about the model's structure an in-place transform could change."""
    return {
        "modules": [(n, id(m), type(m)) for n, m in model.named_modules()],
        "params": [(n, id(p), p.dtype, p.device, p.requires_grad,
                    None if p.is_meta else p.data_ptr()) for n, p in model.named_parameters()],
        "buffers": [(n, id(b), b.dtype, b.device, None if b.is_meta else b.data_ptr())
                    for n, b in model.named_buffers()],
        "hooks": {n: tuple(len(getattr(m, h, ())) for h in HOOK_DICTS)
                  for n, m in model.named_modules()},
        "attrs": {n: sorted(vars(m)) for n, m in model.named_modules()},
        "training": {n: m.training for n, m in model.named_modules()},
        "config": dict(vars(model.config)),
    }


def values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_as_handed_in(model: nn.Module, before: dict, weights: dict, logits: torch.Tensor):
    assert fingerprint(model) == before
    assert not any("forward" in vars(m) for m in model.modules())  # no instance forwards
    assert not any(isinstance(m, (InjectedModel, QuantLinear)) for m in model.modules())
    assert not [k for k in vars(model) if k.startswith("_shardwise")]
    now = values(model)
    assert now.keys() == weights.keys()
    assert all(torch.equal(now[k], weights[k]) and now[k].dtype == weights[k].dtype
               for k in weights)
    with torch.no_grad():
        assert torch.equal(model(prompt_ids()).logits, logits)


def _model_and_record():
    model = tiny_causal_lm("llama")
    with torch.no_grad():
        logits = model(prompt_ids()).logits
    return model, fingerprint(model), values(model), logits


def test_group_size_that_does_not_fit_fails_before_any_change(monkeypatch):
    """Defect 3: q_groups=3 on 64 input features is refused before injection runs (not
    after it), the model is untouched, and a retry with settings that fit works."""
    model, before, weights, logits = _model_and_record()
    injected = []
    real_inject = shardwise.inject.inject_model
    monkeypatch.setattr(shardwise.inject, "inject_model",
                        lambda *a, **k: injected.append(1) or real_inject(*a, **k))
    with pytest.raises(ConfigError, match="q_groups=3 does not divide"):
        shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True,
                                 quant=BAD_QUANT)
    assert not injected  # checked up front, not after the model was injected
    assert_as_handed_in(model, before, weights, logits)
    engine = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True,
                                      quant=GOOD_QUANT)
    assert engine.quantization.layers and isinstance(model.model, InjectedModel)
    out = engine.generate(prompt_ids(), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 12)


def _fail_in_step_7(monkeypatch):
    """Graph capture (step 7, after injection, quantization and the bf16 cast) patches the
    head's forward and adds a hook, then fails."""
    def failing_capture(model, accelerator, weight_dtype=None):
        head = model.get_output_embeddings()
        head.forward = lambda x: x
        head.register_forward_hook(lambda *a: None)
        model.model.register_forward_pre_hook(lambda *a: None)
        raise RuntimeError("capture failed (injected by the test)")
    monkeypatch.setattr(shardwise.inject, "enable_graphs", failing_capture)
    return dict(enable_graph=True)


def _fail_mid_quantization(monkeypatch):
    """Step 6 fails on the third layer, two already replaced by QuantLinears."""
    real, calls = Quantizer.quantize_module, []

    def flaky(self, model, name):
        calls.append(name)
        if len(calls) == 3:
            raise RuntimeError("quantization failed (injected by the test)")
        return real(self, model, name)
    monkeypatch.setattr(Quantizer, "quantize_module", flaky)
    return {}


def _fail_after_cast(monkeypatch):
    """The cast (step 6) runs, moving every Parameter's data to bf16, then fails."""
    real = transforms.cast_and_move

    def cast_then_fail(model, device, dtype, **kwargs):
        real(model, device, dtype, **kwargs)
        raise RuntimeError("cast failed (injected by the test)")
    monkeypatch.setattr(transforms, "cast_and_move", cast_then_fail)
    return {}


@pytest.mark.parametrize("fail", [_fail_in_step_7, _fail_mid_quantization, _fail_after_cast],
                         ids=["graphs", "mid-quantization", "after-cast"])
def test_failure_in_a_later_step_restores_the_model(monkeypatch, fail):
    model, before, weights, logits = _model_and_record()
    extra = fail(monkeypatch)
    with pytest.raises(RuntimeError, match="injected by the test"):
        shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16,
                                 replace_with_kernel_inject=True, quant=GOOD_QUANT, **extra)
    assert_as_handed_in(model, before, weights, logits)
    monkeypatch.undo()
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16,
                                      replace_with_kernel_inject=True, quant=GOOD_QUANT)
    assert engine.generate(prompt_ids(), max_new_tokens=3, do_sample=False,
                           pad_token_id=0).shape == (1, 11)


def test_user_hooks_and_handles_survive_a_rollback(monkeypatch):
    """The user's own hooks stay, and their handles still remove them (dicts restored in
    place)."""
    model, *_ = _model_and_record()
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    _fail_after_cast(monkeypatch)
    with pytest.raises(RuntimeError):
        shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16,
                                 replace_with_kernel_inject=True)
    with torch.no_grad():
        model(prompt_ids())
    assert len(seen) == 1
    handle.remove()
    assert not model.lm_head._forward_hooks


def test_close_gives_the_model_back():
    """An engine that only added structure (injection over the weights as handed in) gives
    the model back exactly; the closed engine refuses further use."""
    model, before, weights, logits = _model_and_record()
    # unfused: the weights' data pointers are compared, and fused projections re-point the
    # weights into one storage per group (test_inject_fuse checks their close())
    engine = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True,
                                      fuse_projections=False)
    ids = prompt_ids()
    engine.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert isinstance(model.model, InjectedModel)
    stack = weakref.ref(model.model)
    assert engine.close() is model
    assert_as_handed_in(model, before, weights, logits)
    gc.collect()
    assert stack() is None  # the injected stack and its KV cache are freed
    assert engine.close() is model  # idempotent
    with pytest.raises(ShardwiseError, match="closed"):
        engine(input_ids=ids)
    shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)  # again


def test_close_rebuilds_weights_the_engine_replaced():
    """A bf16 cast replaced every weight and the originals were let go of at init (memory holds
    one copy); close() casts them back (the bf16 rounding stays, as its log line says) into
    the same Parameter objects, and gives back the modules and outputs of that model."""
    model, before, weights, _ = _model_and_record()
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16,
                                      replace_with_kernel_inject=True)
    out = engine.generate(prompt_ids(), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 10)
    assert engine.close() is model
    assert fingerprint(model)["modules"] == before["modules"]
    assert [(n, id(p), p.dtype) for n, p in model.named_parameters()] == [
        (n, i, d) for n, i, d, *_ in before["params"]]
    now = values(model)
    assert all(torch.equal(now[k], weights[k].bfloat16().float()) for k in weights)


def test_ledger_restores_what_it_recorded():
    """The Ledger alone: replaced modules and parameters, a re-pointed Parameter (even
    meta <-> cpu), attributes, hooks and config values come back; added ones go."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model.config = type("Cfg", (), {})()
    model.config.dtype = "float32"
    first, weight, bias = model[0], model[0].weight, model[0].bias
    data, bias_data = weight.data, bias.data.clone()
    ledger = Ledger(model)
    model[0] = nn.Linear(4, 2)
    torch.utils.swap_tensors(weight, nn.Parameter(torch.empty(4, 4, device="meta")))
    bias.data = bias.data.to(torch.bfloat16)
    first.bias = nn.Parameter(torch.zeros(4))
    first.register_forward_hook(lambda *a: None)
    first.forward = lambda x: x
    first.extra = 1
    model.config.dtype = "bfloat16"
    model.eval()
    ledger.restore()
    assert model[0] is first and first.weight is weight and first.weight.data_ptr() == \
        data.data_ptr() and not first.weight.is_meta and first.weight.requires_grad
    assert first.bias is bias and torch.equal(bias, bias_data) and bias.dtype == torch.float32
    assert "forward" not in vars(first) and "extra" not in vars(first)
    assert not first._forward_hooks and model.training and model.config.dtype == "float32"
    assert ledger.held_bytes() == {"parameters": 0, "buffers": 0}


def test_max_tokens_beyond_free_memory_fails_at_init():
    """Defect 10: an impossible max_tokens is a ConfigError at init naming the bytes, the free
    memory and what would fit, before anything changed."""
    model, before, weights, logits = _model_and_record()
    with pytest.raises(KVCacheMemoryError, match=r"needs \d+ bytes.*bytes free.*max_tokens=\d+ "
                                                 r"would fit") as info:
        shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True,
                                 max_tokens=10**12)
    assert isinstance(info.value, ConfigError)
    # llama tiny: 2 layers x 2 x 2 kv heads x 16 head_dim x 4 bytes = 512 bytes per token
    assert f"needs {512 * 10**12} bytes" in str(info.value)
    assert_as_handed_in(model, before, weights, logits)


@pytest.fixture
def free_bytes(monkeypatch):
    """Pretend the CPU has ``free[0]`` bytes free."""
    accelerator = type(shardwise.plugins.get_accelerator("cpu"))
    free = [10_000]
    monkeypatch.setattr(accelerator, "free_memory", lambda self, index=0: free[0])
    return free


def test_kv_cache_fits_the_accelerators_free_memory(free_bytes):
    """The free memory comes from the accelerator: 10 000 free bytes hold 19 tokens of 512;
    a larger batch at generate time is refused the same way, before allocating."""
    model = tiny_causal_lm("llama")
    with pytest.raises(KVCacheMemoryError, match=r"at most max_tokens=19 would fit"):
        shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True,
                                 max_tokens=1024)
    free_bytes[0] = 512 * 64 + 100  # one sequence of 64 tokens fits, a batch of 4 does not
    engine = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True,
                                      max_tokens=64)
    engine.generate(prompt_ids(), max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(KVCacheMemoryError, match=r"a batch of 4 .*max_tokens=16 would fit"):
        engine.generate(prompt_ids(batch=4), max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_failed_quantize_while_reading_gives_the_meta_model_back(tmp_path, monkeypatch):
    """Defect 8: a load that quantizes while reading fails half way (third layer): the user's
    meta model comes back with no QuantLinear shells and its own meta Parameters, a retry
    loads it, and close() gives the meta model back again."""
    import transformers

    tiny_causal_lm("llama").save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    before = fingerprint(model)
    real, calls = Quantizer.quantize_tensor_for, []

    def flaky(self, name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 3:
            raise OSError("read failed (injected by the test)")
        return real(self, name, *args, **kwargs)
    monkeypatch.setattr(Quantizer, "quantize_tensor_for", flaky)
    load = dict(checkpoint=str(tmp_path), device="cpu", replace_with_kernel_inject=True,
                quant=GOOD_QUANT)
    with pytest.raises(OSError, match="injected by the test"):
        shardwise.init_inference(model, **load)
    assert fingerprint(model) == before
    assert all(p.is_meta for p in model.parameters())
    assert not any(isinstance(m, (QuantLinear, InjectedModel)) for m in model.modules())
    monkeypatch.undo()
    engine = shardwise.init_inference(model, **load)
    fresh = shardwise.init_inference(None, **load)  # the same checkpoint, built by shardwise
    ids = prompt_ids()
    assert torch.equal(engine(input_ids=ids).logits, fresh(input_ids=ids).logits)
    assert engine.close() is model and fingerprint(model) == before
    assert fresh.close() is None  # built from the checkpoint: nothing to give back


def _tp_rollback(rank: int) -> dict:
    """One rank: sharding, injection and quantization all ran, then the cast fails; the model
    must be whole again (unsharded, no hooks), then a retry without quant runs at tp 2."""
    model, before, weights, logits = _model_and_record()
    real = transforms.cast_and_move

    def cast_then_fail(*args):
        real(*args)
        raise RuntimeError("cast failed (injected by the test)")
    transforms.cast_and_move = cast_then_fail
    try:
        shardwise.init_inference(model, device="cpu", tensor_parallel={"tp_size": 2},
                                 replace_with_kernel_inject=True, quant=GOOD_QUANT)
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    finally:
        transforms.cast_and_move = real
    try:
        assert_as_handed_in(model, before, weights, logits)
        restored = "yes"
    except AssertionError as exc:
        restored = f"no: {exc}"
    engine = shardwise.init_inference(model, device="cpu", tensor_parallel={"tp_size": 2},
                                      replace_with_kernel_inject=True)
    retry = (engine(input_ids=prompt_ids()).logits - logits).abs().max().item()
    return {"raised": raised, "restored": restored, "retry_diff": retry}


def test_tp2_failure_after_sharding_restores_each_ranks_model(tmp_path):
    from distributed import run_ranks

    results = run_ranks(_tp_rollback, 2, tmp_path, deadline_s=300)
    for rank, result in enumerate(results):
        assert result["ok"], result.get("trace", result.get("error"))
        value = result["value"]
        assert "injected by the test" in (value["raised"] or ""), (rank, value)
        assert value["restored"] == "yes", (rank, value["restored"])
        assert value["retry_diff"] < 1e-4, (rank, value["retry_diff"])


def _patched_and_recorded(order: list):
    from shardwise import ledger as ledger_mod

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    ledger = Ledger(model)
    with ledger.recording():
        assert ledger_mod.active() is ledger
        ledger_mod.set_forward(model[0], lambda x: x)
        ledger_mod.add_hook(model[1].register_forward_hook(lambda *a: None))
        ledger_mod.replace_module(model, "1", torch.nn.Tanh())
        ledger_mod.record("first", lambda: order.append("first"))
        ledger_mod.record("second", lambda: order.append("second"))
        ledger.on_restore("outside the tree", lambda: order.append("outside"))
    assert ledger_mod.active() is None
    ledger_mod.record("ignored", lambda: order.append("ignored"))  # no active ledger
    return model, ledger


@pytest.mark.parametrize("how", ["give_back", "restore"])
def test_recorded_patches_are_undone_newest_first(how):
    """Changes recorded as they are made (set_forward, add_hook, replace_module, record) are
    undone newest first by give_back (close), then the snapshot and the on_restore undos;
    outside ``recording()`` nothing is recorded. A failed init's restore puts the snapshot
    back without running the transforms' undos (they may be collectives or lossy): only the
    on_restore ones, for changes outside the tree."""
    order = []
    model, ledger = _patched_and_recorded(order)
    getattr(ledger, how)()
    assert order == (["second", "first", "outside"] if how == "give_back" else ["outside"])
    assert "forward" not in vars(model[0]) and type(model[1]) is torch.nn.ReLU
    assert not model[1]._forward_hooks


def test_a_failed_init_runs_no_collective_undo(monkeypatch):
    """The rollback of a failed init is the snapshot alone: an undo recorded by a step that
    ran (here one that would hang on a collective) is never called."""
    from shardwise import ledger as ledger_mod

    called = []
    real = transforms.cast_and_move

    def cast_record_then_fail(model, device, dtype, **kwargs):
        real(model, device, dtype, **kwargs)
        ledger_mod.record("all-gather (would wait for other ranks)", lambda: called.append(1))
        raise RuntimeError("failed after recording (injected by the test)")
    monkeypatch.setattr(transforms, "cast_and_move", cast_record_then_fail)
    model, before, weights, logits = _model_and_record()
    with pytest.raises(RuntimeError, match="injected by the test"):
        shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16,
                                 replace_with_kernel_inject=True)
    assert not called
    assert_as_handed_in(model, before, weights, logits)

"""Fused q|k|v and gate|up projections at injection (shardwise.inject.fuse): the same numbers as
the unfused injected model, one copy of the weights (the parts' tensors are views of the fused
ones), state_dict / save_pretrained / save_checkpoint / close() exactly as without fusion, the
off switch, the groups left unfused, graphs (the CPU's blocked layout viewed by the parts) and
offload (kept unfused).

Measured (x86-64, torch 2.13, under load): fp32 fused against unfused logits differ by 0.0 on
every family here (the bound is 1e-5); quantized fused and unfused logits are bit-equal (each
output row is the same kernel arithmetic over the same row of weights)."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import shardwise
from models import prompt_ids, tiny_causal_lm
from tp_harness import with_random_biases
from shardwise.errors import ConfigError
from shardwise.inject import injected_stack
from shardwise.inject.fuse import FUSE_ENV, fuse_by_default, fusion_report

FP32_ATOL = 1e-5
GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
#: families with separate q/k/v (and gate/up where gated) in tests/families.py; qwen2 and opt
#: have q/k/v biases (random here: with_random_biases)
SEPARATE = {"llama": (2, 2), "qwen2": (2, 2), "mistral": (2, 2), "opt": (2, 0),
            "gptj": (2, 0)}
QUANT = {"int8": {"num_bits": 8}, "int4": {"num_bits": 4},
         "int8-g32": {"num_bits": 8, "group_size": 32}, "int4-g32": {"num_bits": 4, "group_size": 32}}

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(arch: str, fuse: bool, monkeypatch, **kwargs):
    monkeypatch.setenv(FUSE_ENV, "1" if fuse else "0")
    model = with_random_biases(tiny_causal_lm(arch))
    return model, shardwise.init_inference(model, device="cpu", dtype=kwargs.pop(
        "dtype", torch.float32), replace_with_kernel_inject=True, **kwargs)


def _run(engine, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = prompt_ids(batch=2, length=8, vocab=vocab)
    with torch.no_grad():
        return engine(input_ids=ids).logits, engine.generate(ids, **GEN)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _held_bytes(model: nn.Module) -> int:
    """Bytes of the distinct storages the model's parameters and buffers hold."""
    storages = {_storage(t): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    return sum(storages.values())


@pytest.mark.parametrize("arch", list(SEPARATE))
def test_fused_fp32_matches_unfused(arch, monkeypatch):
    model, fused = _engine(arch, True, monkeypatch)
    qkv, gate_up = SEPARATE[arch]
    assert fusion_report(injected_stack(model)) == {"q|k|v": qkv, "gate|up": gate_up}
    ref_model, unfused = _engine(arch, False, monkeypatch)
    assert fusion_report(injected_stack(ref_model)) == {"q|k|v": 0, "gate|up": 0}
    logits, tokens = _run(fused, model.config.vocab_size)
    ref_logits, ref_tokens = _run(unfused, model.config.vocab_size)
    assert (logits - ref_logits).abs().max().item() < FP32_ATOL
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quant", list(QUANT))
def test_fused_quantized_equals_unfused_exactly(arch, quant, monkeypatch):
    cfg = {"weight": QUANT[quant]}
    model, fused = _engine(arch, True, monkeypatch, quant=cfg)
    stack = injected_stack(model)
    ref_model, unfused = _engine(arch, False, monkeypatch, quant=cfg)
    layer = stack.parts.layers[0]
    if layer.fused_groups:  # the CPU's int4 fallback layout (torch's) is opaque: left unfused
        assert fusion_report(stack) == {"q|k|v": 2, "gate|up": 2}
        q, k = layer.self_attn.q_proj, layer.self_attn.k_proj
        assert _storage(q.qweight) == _storage(k.qweight) == _storage(
            layer.fused_groups[0].module.qweight)
    else:
        assert layer.parts.qkv[0].meta.get("kind") == "int4"
    logits, tokens = _run(fused, model.config.vocab_size)
    ref_logits, ref_tokens = _run(unfused, model.config.vocab_size)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(tokens, ref_tokens)
    assert _state(model) == _state(ref_model)  # the quantized state dicts: same keys, same bits


def _state(model: nn.Module) -> dict[str, tuple]:
    """name → (dtype, shape, a checksum of the bytes) of the state dict."""
    return {k: (v.dtype, tuple(v.shape), v.contiguous().view(torch.uint8).sum().item())
            for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_state_dict_is_unchanged_and_close_gives_the_weights_back(arch, monkeypatch):
    model = with_random_biases(tiny_causal_lm(arch))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    held = _held_bytes(model)
    monkeypatch.setenv(FUSE_ENV, "1")
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      replace_with_kernel_inject=True)
    attn = model.model.layers[0].self_attn
    assert _held_bytes(model) == held  # one copy of the weights: the fused tensors are them
    # one storage: the parts are views of the fused tensors
    assert _storage(attn.q_proj.weight) == _storage(attn.k_proj.weight) == _storage(
        attn.v_proj.weight)
    assert dict(model.named_parameters()).keys() == params.keys()
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    engine.close()
    back = model.state_dict()
    assert all(torch.equal(back[k], before[k]) for k in before)
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameters
    storages = [_storage(attn.q_proj.weight), _storage(attn.k_proj.weight),
                _storage(attn.v_proj.weight)]
    assert len(set(storages)) == 3  # their own storage again
    assert all(p.is_contiguous() for p in model.parameters())


def test_save_pretrained_and_save_checkpoint_round_trip(tmp_path, monkeypatch):
    model, engine = _engine("qwen2", True, monkeypatch)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    logits, _ = _run(engine, model.config.vocab_size)
    model.save_pretrained(tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    state = loaded.state_dict()
    assert state.keys() == ref.keys() and all(torch.equal(state[k], ref[k]) for k in ref)
    engine.save_checkpoint(tmp_path / "sw")
    again = shardwise.init_inference(None, checkpoint=str(tmp_path / "sw"), device="cpu",
                                     dtype=torch.float32, replace_with_kernel_inject=True)
    assert fusion_report(injected_stack(again.module))["q|k|v"] == 2
    assert (_run(again, model.config.vocab_size)[0] - logits).abs().max().item() < FP32_ATOL


def test_quantized_checkpoint_round_trip_is_exact(tmp_path, monkeypatch):
    model, engine = _engine("llama", True, monkeypatch, quant={"weight": {"num_bits": 8}})
    logits, tokens = _run(engine, model.config.vocab_size)
    engine.save_checkpoint(tmp_path / "q")
    again = shardwise.init_inference(None, checkpoint=str(tmp_path / "q"), device="cpu",
                                     dtype=torch.float32, replace_with_kernel_inject=True)
    assert _state(again.module) == _state(model)
    again_logits, again_tokens = _run(again, model.config.vocab_size)
    assert torch.equal(again_logits, logits) and torch.equal(again_tokens, tokens)


def test_the_switch_turns_it_off(monkeypatch):
    from shardwise import get_accelerator
    from shardwise.inject import inject_model

    model = tiny_causal_lm("llama")
    stack = inject_model(model, get_accelerator("cpu"), torch.float32, 64,
                         fuse_projections=False)
    assert fusion_report(stack) == {"q|k|v": 0, "gate|up": 0}
    assert stack.parts.layers[0].parts.qkv[0] is model.model.layers[0].self_attn.q_proj
    monkeypatch.setenv(FUSE_ENV, "off")
    assert fuse_by_default() is False
    monkeypatch.setenv(FUSE_ENV, "maybe")
    with pytest.raises(ConfigError, match=FUSE_ENV):
        fuse_by_default()


def test_groups_that_cannot_fuse_keep_their_projections(monkeypatch):
    """A part with a forward hook (its hook would be skipped) and a transformers Conv1D
    (GPT-2's fused c_attn is one module already) stay as they are."""
    from shardwise import get_accelerator
    from shardwise.inject import inject_model

    model = tiny_causal_lm("llama")
    calls = []
    model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda *a: calls.append(1))
    stack = inject_model(model, get_accelerator("cpu"), torch.float32, 64,
                         fuse_projections=True)
    assert fusion_report(stack) == {"q|k|v": 1, "gate|up": 2}
    with torch.no_grad():
        model(prompt_ids(batch=1, length=4))
    assert calls == [1]  # layer 1 still calls its k_proj
    gpt2 = inject_model(tiny_causal_lm("gpt2"), get_accelerator("cpu"), torch.float32, 64,
                        fuse_projections=True)
    assert fusion_report(gpt2) == {"q|k|v": 0, "gate|up": 0}


@pytest.mark.parametrize("odd", ["bias on q only", "k quantized"])
def test_parts_of_different_kinds_stay_unfused(odd):
    """q with a bias and k without (Whisper-like), or one part quantized and another not: the
    group is left as it is (no error), the others fuse."""
    from shardwise import get_accelerator
    from shardwise.inject import inject_model
    from shardwise.quant.modules import QuantLinear

    model = tiny_causal_lm("llama")
    attn = model.model.layers[0].self_attn
    if odd == "bias on q only":
        attn.q_proj.bias = nn.Parameter(torch.zeros(attn.q_proj.out_features))
    else:
        from shardwise.quant import quantize_model

        quantize_model(model, {"weight": {"num_bits": 8}}, get_accelerator("cpu"), torch.float32)
        attn.k_proj = nn.Linear(attn.k_proj.in_features, attn.k_proj.out_features, bias=False)
        assert isinstance(attn.q_proj, QuantLinear)
    with torch.no_grad():
        expected = model(prompt_ids(batch=1, length=4)).logits
    stack = inject_model(model, get_accelerator("cpu"), torch.float32, 64,
                         fuse_projections=True)
    assert fusion_report(stack) == {"q|k|v": 1, "gate|up": 2}
    with torch.no_grad():
        got = model(prompt_ids(batch=1, length=4)).logits
    assert (got - expected).abs().max().item() < 1e-4


def test_unfused_inside_init_on_the_models_own_bf16_weights_closes(monkeypatch):
    """A bf16 model handed in as bf16 with graphs: the compiled one-row product runs its layers
    unfused (``unfused_faster``), i.e. the fusion is undone inside init on the model's own
    weights; each part gets its original tensor back, and ``close()`` gives the model back
    (native CPU kernels opted out: with them 16-bit layers stay fused, next test)."""
    from shardwise.kernels.cpu import native

    monkeypatch.setenv(native.ENV, "torch")
    monkeypatch.setenv(FUSE_ENV, "1")
    model = tiny_causal_lm("llama").to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q_before = _storage(model.model.layers[0].self_attn.q_proj.weight)
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16,
                                      replace_with_kernel_inject=True, enable_graph=True)
    assert fusion_report(injected_stack(model)) == {"q|k|v": 0, "gate|up": 0}
    assert _storage(model.model.layers[0].self_attn.q_proj.weight) == q_before  # not a copy
    engine.generate(prompt_ids(batch=1, length=6, vocab=model.config.vocab_size), **GEN)
    assert engine.close() is model
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_pickled_undo_state_carries_no_ledger(monkeypatch):
    """The compiler pickles what its guards reach when it saves a step for later starts; a copy
    of the ledger's storage weak references would be freed twice when collected (a crash), so
    the undo state pickles empty."""
    import pickle

    model, engine = _engine("llama", True, monkeypatch)
    group = injected_stack(model).parts.layers[0].fused_groups[0]
    assert group.undo.ledger is not None and group.undo.storages
    copy = pickle.loads(pickle.dumps(group.undo))
    assert copy.ledger is None and not copy.storages and not copy.originals
    engine.close()


def test_unfuse_gives_the_parts_their_storage_and_the_same_numbers(monkeypatch):
    model, engine = _engine("llama", True, monkeypatch)
    logits, _ = _run(engine, model.config.vocab_size)
    stack = injected_stack(model)
    assert stack.unfuse_projections() == 4
    attn = model.model.layers[0].self_attn
    assert _storage(attn.q_proj.weight) != _storage(attn.k_proj.weight)
    assert stack.parts.layers[0].parts.qkv[0] is attn.q_proj
    assert (_run(engine, model.config.vocab_size)[0] - logits).abs().max().item() < FP32_ATOL


def test_cpu_graphs_lay_out_the_fused_weight_once(monkeypatch):
    """The CPU compile strategy's blocked layout: the fused weight is laid out and the parts
    view its blocks (no second copy), state_dict still gives the plain layout, the captured
    step gives the unfused engine's tokens, and close() gives the weights back."""
    model, engine = _engine("llama", True, monkeypatch, enable_graph=True)
    before = {k: v.clone() for k, v in tiny_causal_lm("llama").state_dict().items()}
    ref_model, ref = _engine("llama", False, monkeypatch)
    stack = injected_stack(model)
    group = stack.parts.layers[0].fused_groups[0]
    attn = model.model.layers[0].self_attn
    assert group.module.weight.dim() == 3  # laid out in blocks (the default cpp layout)
    assert _storage(attn.q_proj.weight) == _storage(group.module.weight)
    ids = prompt_ids(batch=1, length=8, vocab=model.config.vocab_size)
    assert torch.equal(engine.generate(ids, **GEN), ref.generate(ids, **GEN))
    state = model.state_dict()
    ref_state = ref_model.state_dict()
    assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)
    engine.close()
    back = model.state_dict()
    assert back["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    assert all(torch.equal(back[k], ref_state[k]) for k in ref_state)
    assert before.keys() == back.keys()


def test_a_graph_forward_faster_unfused_gets_the_parts(monkeypatch):
    """A strategy forward whose class says ``unfused_faster`` (the CPU's one-row bf16 product,
    measured faster per part in the compiled step) puts that layer back on its parts before
    capture: the captured step calls the parts, with the tokens of the unfused engine."""
    from shardwise.accelerators import cpu_gemv
    from shardwise.kernels.cpu import native

    monkeypatch.setenv(native.ENV, "torch")  # 16-bit weights keep their layout: row products
    model, engine = _engine("llama", True, monkeypatch, dtype=torch.bfloat16, enable_graph=True)
    stack = injected_stack(model)
    assert fusion_report(stack) == {"q|k|v": 0, "gate|up": 0}
    attn = model.model.layers[0].self_attn
    assert isinstance(vars(attn.q_proj).get("forward"), cpu_gemv.RowProductLinear)
    assert _storage(attn.q_proj.weight) != _storage(attn.k_proj.weight)
    ref_model, ref = _engine("llama", False, monkeypatch, dtype=torch.bfloat16)
    ids = prompt_ids(batch=1, length=8, vocab=model.config.vocab_size)
    assert torch.equal(engine.generate(ids, **GEN), ref.generate(ids, **GEN))
    engine.close()
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_bf16_graphs_on_the_native_kernel_keep_the_projections_fused(monkeypatch):
    """Where the native 16-bit kernel builds, a bf16 engine with graphs lays the fused q|k|v and
    gate|up weights out in blocks and keeps them fused (one wider product per group), with the
    tokens of the unfused eager engine; ``close()`` gives a bf16 model its own weights back,
    bit for bit."""
    from shardwise.accelerators import cpu_blocked_layout as layout
    from shardwise.kernels.cpu import native

    if not native.load():
        pytest.skip("the native CPU kernels do not build on this machine")
    model, engine = _engine("llama", True, monkeypatch, dtype=torch.bfloat16, enable_graph=True)
    stack = injected_stack(model)
    layers = model.config.num_hidden_layers
    assert fusion_report(stack) == {"q|k|v": layers, "gate|up": layers}
    attn = model.model.layers[0].self_attn
    fused = [m for m in attn.modules() if isinstance(vars(m).get("forward"), layout.BlockedLinear)
             and m.weight.dtype == torch.bfloat16]
    assert fused and all(m.weight.dim() == 3 for m in fused)
    ref_model, ref = _engine("llama", False, monkeypatch, dtype=torch.bfloat16)
    ids = prompt_ids(batch=1, length=8, vocab=model.config.vocab_size)
    assert torch.equal(engine.generate(ids, **GEN), ref.generate(ids, **GEN))
    own = tiny_causal_lm("llama").to(torch.bfloat16)  # handed in as bf16: its own tensors used
    before = {k: v.clone() for k, v in own.state_dict().items()}
    bf16 = shardwise.init_inference(own, device="cpu", dtype=torch.bfloat16,
                                    replace_with_kernel_inject=True, enable_graph=True)
    assert own.model.layers[0].mlp.down_proj.weight.dim() == 3  # laid out in blocks, in place
    bf16.generate(ids, **GEN)
    assert bf16.close() is own
    after = own.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_offload_keeps_the_unfused_projections(tmp_path, monkeypatch):
    """The offload step streams each part's tensors as per-layer blobs: it puts the layers back
    on their unfused projections first (core/offload/transform.py)."""
    model, engine = _engine("llama", True, monkeypatch, offload={"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2})
    ref_model, ref = _engine("llama", False, monkeypatch)
    assert fusion_report(injected_stack(model)) == {"q|k|v": 0, "gate|up": 0}
    ids = prompt_ids(batch=1, length=8, vocab=model.config.vocab_size)
    assert torch.equal(engine.generate(ids, **GEN), ref.generate(ids, **GEN))


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_cuda_fused_projections_match_unfused(quant, monkeypatch):
    """On the GPU (Triton quantized layouts, CUDA graphs): fused and unfused engines give the
    same greedy tokens and fp16 logits within 1e-3 (a wider GEMM may tile the sum differently);
    quantized ones bit-equal logits where the kernel's tiles do not depend on N, else 1e-3."""
    from gpu import cuda_accelerator

    cuda_accelerator(torch.float16)
    kwargs = dict(device="cuda", dtype=torch.float16, replace_with_kernel_inject=True,
                  enable_graph=True)
    if quant:
        kwargs["quant"] = {"weight": QUANT[quant]}
    out = {}
    for fuse in (True, False):
        monkeypatch.setenv(FUSE_ENV, "1" if fuse else "0")
        model = with_random_biases(tiny_causal_lm("qwen2"))
        engine = shardwise.init_inference(model, **kwargs)
        report = fusion_report(injected_stack(model))
        assert report == ({"q|k|v": 2, "gate|up": 2} if fuse else {"q|k|v": 0, "gate|up": 0})
        ids = prompt_ids(batch=2, length=8, vocab=model.config.vocab_size).cuda()
        with torch.no_grad():
            out[fuse] = (engine(input_ids=ids).logits.float(), engine.generate(ids, **GEN))
    assert (out[True][0] - out[False][0]).abs().max().item() < 1e-3
    assert torch.equal(out[True][1], out[False][1])

"""Kernel injection (``replace_with_kernel_inject``) and decode-step graphs (``enable_graph``) on
one process: parity with the plain HF model per family and dtype, the static KV cache's limits,
generate modes, errors. Tensor parallelism + injection: tests/test_inject_tp.py.

Tolerances (tiny random models, tests/models.py, batch 2 × 8-token prompts), about 2× the max
measured over every family on the cpu backend (``pytest -s`` prints each; measured under load,
x86-64 AVX-512, torch 2.13):
* fp32: logits within ``FP32_ATOL`` = 5e-7 of HF (measured ≤ 2.4e-7: qwen2, qwen2-sw4; opt 0;
  the graph-safe decode step and the reference bias_gelu the same), 32 greedy tokens identical.
* bf16: logits within ``BF16_ATOL`` = 0.016 of HF bf16 along HF's own greedy continuation
  (measured ≤ 0.0078 = 1 bf16 ulp at |logit| in [1, 2), bloom; 0.0039 or 0 for the rest: the
  kernels round once where HF rounds after every op), and teacher-forced next-token agreement
  (tests/models.py ``teacher_forced_agreement``: both models fed HF's continuation in one
  forward) ≥ ``MIN_FORCED_AGREEMENT`` = 0.9 (measured ≥ 0.985, i.e. at most 1 of 66 positions).
"""

from __future__ import annotations

import logging

import pytest
import torch

import shardwise
from shardwise.accelerator import GraphStrategy
from shardwise.errors import ConfigError
from shardwise.inject.injector import injected_stack
from shardwise.inject import (InjectedModel, InjectionError, MaxTokensError, StaleCacheError,
                              StaticKVCache)
from families import families
from graph_doubles import ReplayOnCpu
from models import (MIN_FORCED_AGREEMENT, bf16_against_hf, forced_decode_logits, prompt_ids,
                    teacher_forced_agreement, tiny_causal_lm)

#: every decoder family with injection data, and the config variants that change the layer:
#: Falcon's three qkv layouts / residual forms / ALiBi, windows smaller than the prompt
FAMILIES = families(kind="causal", inject=1)  # tests/families.py
FP32_ATOL = 5e-7
BF16_ATOL = 0.016
NEW = 32
GREEDY = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)


def _pair(arch: str, dtype=torch.float32, **engine_kwargs):
    ref = tiny_causal_lm(arch, dtype=dtype)
    model = tiny_causal_lm(arch)
    engine = shardwise.init_inference(model, device="cpu", dtype=dtype,
                                      replace_with_kernel_inject=True, **engine_kwargs)
    return ref, engine


def _compare(ref, engine, ids, **gen):
    gen = {**GREEDY, **gen}
    with torch.no_grad():
        ref_logits, ref_tokens = ref(ids).logits.float(), ref.generate(ids, **gen)
    logits, tokens = engine(input_ids=ids).logits.float(), engine.generate(ids, **gen)
    return (logits - ref_logits).abs().max().item(), ref_tokens, tokens


@pytest.mark.parametrize("arch", FAMILIES)
def test_fp32_parity(arch):
    ref, engine = _pair(arch)
    assert isinstance(injected_stack(engine.module), InjectedModel)
    max_abs, ref_tokens, tokens = _compare(ref, engine, prompt_ids(batch=2, length=8))
    print(f"{arch} fp32: max |logit diff| {max_abs:.2e}")
    assert max_abs < FP32_ATOL, max_abs
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_parity(arch):
    ref, engine = _pair(arch, torch.bfloat16)
    max_abs, forced = bf16_against_hf(ref, engine, new_tokens=NEW)
    print(f"{arch} bf16: max |logit diff| {max_abs:.4f}, teacher-forced agreement {forced:.3f}")
    assert max_abs < BF16_ATOL, max_abs
    assert forced >= MIN_FORCED_AGREEMENT, forced

def test_bf16_bound_rejects_a_model_a_little_off():
    """The bf16 logit bound can fail: one attention projection moved by 5% (noise of 0.05 × its
    own std) moves the logits by 0.024 (measured; logits here stay within ±0.63), past
    ``BF16_ATOL`` (the bound of 0.05 it replaced let this through)."""
    ref = tiny_causal_lm("llama", dtype=torch.bfloat16)
    model = tiny_causal_lm("llama")
    with torch.no_grad():
        weight = model.model.layers[0].self_attn.o_proj.weight
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(3))
                    * weight.std() * 0.05)
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16,
                                      replace_with_kernel_inject=True)
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        ref_tokens = ref.generate(ids, **GREEDY)
        ref_logits = ref(ref_tokens).logits.float()
    logits = engine(input_ids=ref_tokens).logits.float()
    max_abs = (logits - ref_logits).abs().max().item()
    print(f"5% off: max |logit diff| {max_abs:.4f}")
    assert max_abs > BF16_ATOL
    with pytest.raises(ValueError, match="same sequence"):
        teacher_forced_agreement(ref_logits, logits[:, 1:-1], ids.shape[1])


def test_state_dict_names_unchanged_and_hf_generate_works():
    ref = tiny_causal_lm("llama")
    model = tiny_causal_lm("llama")
    keys = list(model.state_dict())
    shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)
    assert list(model.state_dict()) == keys
    ids = prompt_ids(batch=1, length=6)
    with torch.no_grad():  # the bare module's generate, not the engine's
        assert torch.equal(model.generate(ids, **GREEDY), ref.generate(ids, **GREEDY))


@pytest.mark.parametrize("arch", FAMILIES)
def test_beam_search_and_left_padding(arch):
    ref, engine = _pair(arch)
    ids = prompt_ids(batch=2, length=8)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    beams = dict(max_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=0)
    greedy = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(engine.generate(ids, **beams), ref.generate(ids, **beams))
        assert torch.equal(engine.generate(ids, attention_mask=mask, **greedy),
                           ref.generate(ids, attention_mask=mask, **greedy))


def test_mask_with_holes_is_refused():
    _, engine = _pair("llama")
    ids = prompt_ids(batch=1, length=6)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1]])
    with pytest.raises(shardwise.errors.ShardwiseError, match="left padding"):
        engine(input_ids=ids, attention_mask=mask)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w1", pad_token="w0",
                                   eos_token="w0")


def test_pipeline_still_works():
    from transformers import pipeline

    ref, engine = _pair("llama")
    tok = _tiny_tokenizer()
    text = "w5 w17 w99 w3"
    kwargs = dict(max_new_tokens=8, do_sample=False)
    mine = pipeline("text-generation", model=engine.module, tokenizer=tok)(text, **kwargs)
    theirs = pipeline("text-generation", model=ref, tokenizer=tok)(text, **kwargs)
    assert mine == theirs and mine[0]["generated_text"].startswith(text)


def test_max_tokens_exceeded_by_prompt_and_by_generation():
    _, engine = _pair("gpt2", max_out_tokens=24)  # DeepSpeed's name
    with pytest.raises(MaxTokensError, match=r"prompt has 30 tokens.*max_tokens=24.*max_out_tokens"):
        engine.generate(prompt_ids(1, 30), max_new_tokens=2, pad_token_id=0)
    with pytest.raises(MaxTokensError, match=r"generation reached 24 tokens.*max_tokens=24"):
        engine.generate(prompt_ids(1, 8), max_new_tokens=20, min_new_tokens=20, pad_token_id=0)
    out = engine.generate(prompt_ids(1, 8), max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
    assert out.shape == (1, 24)  # exactly full is fine


def test_stale_cache_is_an_error():
    _, engine = _pair("llama")
    first = engine(input_ids=prompt_ids(1, 4))
    engine(input_ids=prompt_ids(1, 5))  # a new sequence retires the first cache
    assert isinstance(first.past_key_values, StaticKVCache)
    with pytest.raises(StaleCacheError):
        engine(input_ids=prompt_ids(1, 1), past_key_values=first.past_key_values)


def test_unsupported_family_lists_supported_ones():
    from transformers import AutoModelForCausalLM, GPTBigCodeConfig

    config = GPTBigCodeConfig(n_embd=64, n_layer=1, n_head=4, vocab_size=256, n_positions=64)
    model = AutoModelForCausalLM.from_config(config).eval()  # no shardwise policy
    with pytest.raises(InjectionError) as err:
        shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)
    text = str(err.value)
    assert "gpt_bigcode" in text and "tensor_parallel" in text
    for family in ("llama", "gpt2", "opt", "bloom", "falcon", "phi3", "gpt_neox", "gptj"):
        assert family in text


@pytest.mark.parametrize("setting", [{"do_layer_norm_before": False},
                                     {"layer_norm_elementwise_affine": False}])
def test_layer_structure_the_injected_layer_lacks_is_refused(setting):
    model = tiny_causal_lm("opt")
    for key, value in setting.items():
        setattr(model.config, key, value)
    with pytest.raises(InjectionError, match=f"{next(iter(setting))}=False.*tensor_parallel"):
        shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)


def test_config_rules():
    model = tiny_causal_lm("llama")
    with pytest.raises(ConfigError, match="replace_with_kernel_inject"):
        shardwise.init_inference(model, device="cpu", enable_cuda_graph=True)
    with pytest.raises(ConfigError, match="replace_with_kernel_inject"):
        shardwise.init_inference(model, device="cpu", max_tokens=64)


# ----- the spec's groups, and injection recorded in the ledger ------------------------------------

def _llama_spec():
    from shardwise.policies.llama import LlamaPolicy

    return LlamaPolicy.injection


def test_flat_spec_fields_are_refused_naming_their_group():
    """A plugin policy written against the flat fields of earlier versions gets the mapping to
    the groups when it builds, replaces or reads one — not an AttributeError deep in inject."""
    import dataclasses

    from shardwise.inject.spec import InjectionSpec, MovedFieldError

    with pytest.raises(MovedFieldError) as err:
        InjectionSpec(base_model="model", layers="layers", embed="embed_tokens",
                      final_norm="norm", norm="rms", attn_norm="input_layernorm",
                      mlp_norm="post_attention_layernorm", qkv=("qkv",), out_proj="o",
                      positions="rotary", rotary_module="rotary_emb", mlp="gated",
                      mlp_in=("gate_up",), mlp_out="down")
    text = str(err.value)
    for moved in ("norm -> residual.norm", "qkv -> attention.qkv", "mlp_in -> mlp.in_proj",
                  "rotary_module -> positions.rotary_module", "positions='rotary' -> Positions(",
                  "mlp='gated' -> MLP("):
        assert moved in text, moved
    assert isinstance(err.value, ConfigError)
    spec = _llama_spec()
    with pytest.raises(MovedFieldError, match="alibi_scaled -> positions.alibi_scaled"):
        dataclasses.replace(spec, alibi_scaled=True)  # a flat injection_overrides row
    with pytest.raises(MovedFieldError, match="moved to InjectionSpec.attention.window_config"):
        spec.window_config
    assert not hasattr(spec, "pos_offset") and not hasattr(spec, "no_such_field")


def test_spec_groups_are_validated():
    import dataclasses

    from shardwise.inject.spec import MLP, Attention, Positions, Residual

    for build, match in [(lambda: Positions("learned"), "learned positions need embed"),
                         (lambda: Positions("rope"), "kind='rope'"),
                         (lambda: Attention(qkv=("q", "k"), out_proj="o"), "qkv="),
                         (lambda: Attention(qkv=("qkv",), out_proj="o", qkv_layout="heads"),
                          "qkv_layout"),
                         (lambda: MLP("gated", in_proj=("g", "u", "x"), out_proj="d"), "in_proj"),
                         (lambda: MLP("plain", in_proj=("i",), out_proj="d", activation="tanh"),
                          "activation='tanh'"),
                         (lambda: Residual("rms", attn_norm="n", mlp_norm=None, final_norm="f"),
                          "mlp_norm=None needs parallel"),
                         (lambda: dataclasses.replace(_llama_spec(), attention=MLP(
                             "plain", in_proj=("i",), out_proj="d")), "attention=.*Attention")]:
        with pytest.raises(ValueError, match=match):
            build()


def test_falcon_variants_replace_whole_groups():
    from transformers import FalconConfig

    from shardwise.policies.falcon import FalconPolicy

    policy = FalconPolicy()
    base = policy.injection_spec(FalconConfig(alibi=False, parallel_attn=False,
                                              new_decoder_architecture=False))
    assert base.positions.kind == "rotary" and not base.residual.parallel
    alibi = policy.injection_spec(FalconConfig(alibi=True, parallel_attn=True,
                                               new_decoder_architecture=False))
    assert (alibi.positions.kind, alibi.positions.rotary_module) == ("alibi", None)
    assert alibi.positions.alibi_scaled and alibi.residual.parallel
    assert alibi.residual.mlp_norm is None and alibi.attention == base.attention
    two_norms = policy.injection_spec(FalconConfig(new_decoder_architecture=True,
                                                   num_ln_in_parallel_attn=2))
    assert two_norms.residual.parallel
    assert (two_norms.residual.attn_norm, two_norms.residual.mlp_norm) == ("ln_attn", "ln_mlp")


def test_injection_records_its_stack_swap_in_the_active_ledger():
    """The swap of the HF base model is in the ledger's log: giving the log back (with a
    snapshot of an unrelated module, so only the log can do it) puts the HF stack back."""
    from shardwise.inject import inject_model
    from shardwise.ledger import Ledger

    model = tiny_causal_lm("opt")  # base model "model.decoder": a nested parent
    hf_stack = model.model.decoder
    ledger = Ledger(torch.nn.Module())
    with ledger.recording():
        stack = inject_model(model, shardwise.get_accelerator("cpu"), torch.float32, 64)
    assert model.model.decoder is stack and isinstance(stack, InjectedModel)
    assert any("InjectedModel" in what for what in ledger.undos)
    ledger.give_back()
    assert model.model.decoder is hf_stack


def test_injection_adopts_the_modules_it_finds():
    """Whatever module sits at a projection's name when injection runs (here a stand-in for a
    quantized linear) is the one the injected layer calls."""
    from shardwise.inject import inject_model

    class CountingLinear(torch.nn.Linear):
        calls = 0

        def forward(self, x):
            CountingLinear.calls += 1
            return super().forward(x)

    model = tiny_causal_lm("llama")
    for layer in model.model.layers:
        old = layer.mlp.down_proj
        new = CountingLinear(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        layer.mlp.down_proj = new
    ids = prompt_ids(1, 4)
    with torch.no_grad():
        expected = model(ids).logits
        CountingLinear.calls = 0
        inject_model(model, shardwise.get_accelerator("cpu"), torch.float32, 64)
        got = model(ids).logits
    assert CountingLinear.calls == len(model.model.layers)
    assert (got - expected).abs().max().item() < FP32_ATOL


def test_dtype_fallback_logs_once(caplog, monkeypatch):
    # A cpu backend whose bias_gelu takes bf16 only: fp32 GPT-2 runs it on the reference.
    import dataclasses

    from shardwise.kernel_registry import registry

    assert registry.load_backend("cpu") == ""
    impls = registry._impls["bias_gelu"]
    monkeypatch.setitem(impls, "cpu", dataclasses.replace(impls["cpu"],
                                                          dtypes=frozenset({torch.bfloat16})))
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        ref, engine = _pair("gpt2")
        max_abs, ref_tokens, tokens = _compare(ref, engine, prompt_ids(batch=2, length=8))
    lines = [r.getMessage() for r in caplog.records if "torch reference" in r.getMessage()]
    assert len(lines) == 1 and "bias_gelu" in lines[0]
    print(f"reference bias_gelu fp32: max |logit diff| {max_abs:.2e}")
    assert max_abs < FP32_ATOL and torch.equal(tokens, ref_tokens)  # never wrong numbers


# ----- graphs -------------------------------------------------------------------------------------

def test_enable_graph_on_cpu_with_eager_graphs_is_a_documented_noop(caplog, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CPU_GRAPHS", "eager")  # the default compiles: test_cpu_graphs
    with caplog.at_level(logging.INFO, logger="shardwise"):
        ref, engine = _pair("llama", enable_graph=True)
    assert any("no-op" in r.getMessage() for r in caplog.records)
    _, ref_tokens, tokens = _compare(ref, engine, prompt_ids(batch=2, length=8))
    assert torch.equal(tokens, ref_tokens)


class CannotCapture(GraphStrategy):
    name = "broken"
    accelerates = True

    def capture(self, fn, *example_args):
        raise NotImplementedError("this device has no graphs")


@pytest.mark.parametrize("capturable", [True, False], ids=["kernel", "masked"])
@pytest.mark.parametrize("arch", families(graph_step=True))
def test_graph_safe_decode_step_matches(monkeypatch, arch, capturable):
    """The captured step (head included) with the capturable decode kernel, and with the masked
    attention over the whole cache that devices without one get, gives HF's tokens."""
    from shardwise.accelerators.cpu import CpuAccelerator

    monkeypatch.setattr(CpuAccelerator, "graph_strategy", lambda self: ReplayOnCpu())
    ReplayOnCpu.captures = 0
    ref, engine = _pair(arch, enable_graph=True)
    stack = injected_stack(engine.module)
    assert stack.kernels.decode_capturable  # the cpu backend's attention_decode is
    monkeypatch.setattr(stack.kernels, "decode_capturable", capturable)
    head = engine.module.get_output_embeddings()
    eager_heads = _count_calls(monkeypatch, head.forward, "original")
    ids = prompt_ids(batch=2, length=8)
    max_abs, ref_tokens, tokens = _compare(ref, engine, ids)
    print(f"{arch} graph step ({capturable=}) fp32: max |logit diff| {max_abs:.2e}")
    assert max_abs < FP32_ATOL and torch.equal(tokens, ref_tokens)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        eager_heads.clear()
        assert torch.equal(engine.generate(ids, attention_mask=mask, **GREEDY),
                           ref.generate(ids, attention_mask=mask, **GREEDY))
        assert len(eager_heads) == 1  # the prompt's; every decode step's logits are the graph's
        assert torch.equal(engine.generate(ids[:1], **GREEDY), ref.generate(ids[:1], **GREEDY))
    assert ReplayOnCpu.captures == 2  # the init trial (batch 1, kept for batch 1), batch 2


def test_head_answers_from_the_graph_only_for_the_unchanged_step_output(monkeypatch):
    """HeadFromGraph returns the captured logits once, for the step's own hidden state; a
    changed or different tensor gets the head's own forward."""
    from shardwise.accelerators.cpu import CpuAccelerator

    monkeypatch.setattr(CpuAccelerator, "graph_strategy", lambda self: ReplayOnCpu())
    _, engine = _pair("llama", enable_graph=True)
    stack, head = injected_stack(engine.module), engine.module.get_output_embeddings()
    ids = prompt_ids(batch=1, length=6)
    with torch.inference_mode():
        cache = engine.module(ids, use_cache=True).past_key_values

        def step():  # one captured decode step: (hidden, the logits the graph computed)
            hidden = stack(ids[:, -1:], past_key_values=cache, use_cache=True).last_hidden_state
            return hidden, stack.graphs._pending[-1]
        hidden, captured = step()
        assert head(hidden[:, -1:, :]) is captured  # a full view of it, as the HF shells slice
        again = head(hidden)  # handed out once: recomputed, to the same values
        assert again is not captured and torch.allclose(again, captured, atol=1e-5)
        hidden, captured = step()
        hidden.mul_(2)  # changed in place after the step: the graph's logits are stale
        assert torch.equal(head(hidden), head.forward.original(hidden))
        hidden, captured = step()
        assert head(hidden.clone()) is not captured  # other memory: the head's own forward


def _count_calls(monkeypatch, owner, name: str) -> list:
    """Record each call of ``owner.name`` (a list of call numbers, clearable)."""
    calls, real = [], getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(len(calls))
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, counted)
    return calls


def test_graphs_are_kept_per_batch_bucket(monkeypatch):
    """Alternating batch sizes replays each bucket's graph over its own kept cache buffers; a
    batch smaller than its bucket (3 in 4) runs that graph padded, left padding and beam
    search included."""
    from shardwise.accelerators.cpu import CpuAccelerator

    monkeypatch.setattr(CpuAccelerator, "graph_strategy", lambda self: ReplayOnCpu())
    ReplayOnCpu.captures = 0
    ref, engine = _pair("llama", enable_graph=True)
    stack = injected_stack(engine.module)
    with torch.no_grad():
        for batch in (2, 1, 2, 3, 1, 4):
            ids = prompt_ids(batch=batch, length=6)
            assert torch.equal(engine.generate(ids, **GREEDY), ref.generate(ids, **GREEDY))
        ids, mask = prompt_ids(batch=3, length=6), torch.ones(3, 6, dtype=torch.int64)
        mask[1, :2] = 0
        assert torch.equal(engine.generate(ids, attention_mask=mask, **GREEDY),
                           ref.generate(ids, attention_mask=mask, **GREEDY))
        beams = dict(max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0)
        assert torch.equal(engine.generate(ids[:1], **beams), ref.generate(ids[:1], **beams))
    assert ReplayOnCpu.captures == 3  # buckets 1 (the init trial), 2 and 4: none twice
    assert sorted(stack._kv) == [1, 2, 4] == sorted(stack.graphs.buckets())
    stack.graphs.clear()  # dropping the graphs frees the other buckets' buffers at next cache
    with torch.no_grad():
        engine.generate(prompt_ids(batch=2, length=6), max_new_tokens=2, do_sample=False)
    assert sorted(stack._kv) == [2] == sorted(stack.graphs.buckets())
    assert ReplayOnCpu.captures == 4


@pytest.mark.parametrize("batch,bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8),
                                          (9, 16), (17, 24), (64, 64)])
def test_batch_buckets(batch, bucket):
    assert GraphStrategy().batch_bucket(batch) == bucket


def test_graph_capture_failure_is_an_init_error(monkeypatch):
    from shardwise.accelerators.cpu import CpuAccelerator

    monkeypatch.setattr(CpuAccelerator, "graph_strategy", lambda self: CannotCapture())
    with pytest.raises(ConfigError, match="cannot capture the decode step.*enable_graph=False"):
        _pair("llama", enable_graph=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_graph_decode(dtype):
    """The captured decode step against HF. The reference is the fp32 model cast as the engine
    casts it: under transformers 5.17 on the H200, ``from_config(dtype=torch.float16)`` drew a
    different model (max logit difference 0.75 against the fp32 one, where the cast model and
    the injected one are both within 5e-4 of it), which read as an injection fault."""
    ref = tiny_causal_lm("llama").to(dtype).cuda()
    model = tiny_causal_lm("llama")
    engine = shardwise.init_inference(model, device="cuda", dtype=dtype,
                                      replace_with_kernel_inject=True, enable_graph=True)
    assert engine.module.base_model.graphs is not None
    ids = prompt_ids(batch=2, length=8).cuda()
    with torch.no_grad():
        ref_tokens = ref.generate(ids, **GREEDY)
    tokens = engine.generate(ids, **GREEDY)
    if dtype == torch.float32:
        assert torch.equal(tokens, ref_tokens)
        return
    with torch.no_grad():  # fp16: HF's continuation fed through the captured decode step
        ref_logits = ref(ref_tokens).logits.float()
    forced = teacher_forced_agreement(ref_logits,
                                      forced_decode_logits(engine.module, ref_tokens, 8), 8)
    assert forced >= MIN_FORCED_AGREEMENT, forced


@pytest.mark.gpu
@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_injection_parity(arch):
    """Every family on the Triton kernels: fp32 logits within 1e-3 (TF32-free Triton dots may
    still sum in another order) and identical greedy tokens; graphs on, so the captured
    decode step with ALiBi and windows runs too."""
    ref = tiny_causal_lm(arch).cuda()
    engine = shardwise.init_inference(tiny_causal_lm(arch), device="cuda", dtype=torch.float32,
                                      replace_with_kernel_inject=True, enable_graph=True)
    ids = prompt_ids(batch=2, length=8).cuda()
    with torch.no_grad():
        ref_logits, ref_tokens = ref(ids).logits, ref.generate(ids, **GREEDY)
    assert (engine(input_ids=ids).logits - ref_logits).abs().max().item() < 1e-3
    assert torch.equal(engine.generate(ids, **GREEDY), ref_tokens)


def test_the_compiled_cache_write_stays_in_place_without_a_cache_sized_copy():
    # inductor lowered scatter_ on a graph input to a copy of the whole cache written back
    # (every layer, every step); the indexed put must stay in place
    import re

    from torch._inductor.utils import run_and_get_code
    from shardwise.inject.cache import write_rows

    def step(cache, index, new, query):
        write_rows(cache, index, new)
        return query @ cache.transpose(-1, -2)

    cache = torch.zeros(2, 3, 40, 8)
    index, new, query = torch.tensor([5, 31]), torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)
    with torch.inference_mode():
        out, code = run_and_get_code(torch.compile(step, fullgraph=True), cache, index, new, query)
    assert torch.equal(cache[0, :, 5], new[0, :, 0]) and torch.equal(cache[1, :, 31], new[1, :, 0])
    assert cache.count_nonzero() == new.count_nonzero()  # nothing else written
    torch.testing.assert_close(out, query @ cache.transpose(-1, -2))
    assert not re.search(r"empty_strided\w*\(\(2, 3, 40, 8\)", "\n".join(code))

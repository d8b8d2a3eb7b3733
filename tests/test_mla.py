"""Multi-head latent attention (DeepSeek-V3's MLA, :mod:`shardwise.inject.mla`) under kernel
injection: prefill, the absorbed decode step and graphs against HF, the latent KV cache, bad
policies, tensor parallelism (2 gloo ranks); and the DeepSeek-V3 policy's router correction bias,
which a fresh model holds as zeros. The MoE side of DeepSeek-V3: tests/test_moe.py
(one process) and tests/test_moe_ep.py (ep × tp); the ``deepseek_v3-mla`` family's
generic injection checks (bf16, beam search, left padding, the graph-safe step): test_inject.py.

Families: every ``model_type="deepseek_v3"`` family of tests/families.py — ``deepseek_v3``
(query LoRA, interleaved rotary, v narrower than q/k, MoE layers) and ``deepseek_v3-mla``
(one q_proj, "half" rotary, v wider than q/k, dense).

Tolerance: fp32 logits within ``FP32_ATOL`` = 1e-6 of HF, prompt and every decode step (measured
≤ 3.0e-7 on the cpu backend under load, x86-64, torch 2.13: the absorbed decode sums
``(W_UK^T q) · c`` where HF sums ``q · (W_UK c)``; the graph-safe step the same).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

import shardwise
from shardwise.inject import InjectionError, StaticKVCache
from shardwise.inject.injector import injected_stack, plan_injection
from shardwise.inject.mla import LatentAttentionCore, LatentAttentionError, absorbed_weights
from shardwise.inject.spec import LatentAttention
from shardwise.layout import HeadBlocks, HeadPartition, ShardContext, ShardingError
from shardwise.policy import policy_for
from families import QUANT_BOUNDS, families
from graph_doubles import ReplayOnCpu
from models import forced_decode_logits, logit_parity, prompt_ids, tiny_causal_lm
from tp_harness import case, run_cases, run_pair

FAMILIES = families(model_type="deepseek_v3")  # tests/families.py
FP32_ATOL = 1e-6
#: decode steps checked (test_moe.py and test_inject.py generate 32 greedy tokens of these
#: families; here each step's logits are compared)
NEW = 16
GREEDY = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)


def _engine(arch: str, **kwargs):
    return shardwise.init_inference(tiny_causal_lm(arch), device="cpu", dtype=torch.float32,
                                    replace_with_kernel_inject=True, **kwargs)


def _replay_graphs(monkeypatch):
    """The CPU's graph strategy replaced by ReplayOnCpu: the graph-safe decode step, eagerly."""
    from shardwise.accelerators.cpu import CpuAccelerator

    monkeypatch.setattr(CpuAccelerator, "graph_strategy", lambda self: ReplayOnCpu())


def _dims(model):
    """(heads, L, N, R, V) of a DeepSeek-V3 config."""
    c = model.config
    return (c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
            c.v_head_dim)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph_safe"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_prefill_and_every_decode_step_match_hf(monkeypatch, arch, graphs):
    """HF's greedy continuation fed back: the prompt's logits (expanded per head) and each
    decode step's (absorbed, over the latent cache; with graphs the captured step) match HF."""
    if graphs:
        _replay_graphs(monkeypatch)
    ref, engine = tiny_causal_lm(arch), _engine(arch, enable_graph=graphs)
    assert (injected_stack(engine.module).graphs is not None) == graphs
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        tokens = ref.generate(ids, **GREEDY)
        expected = forced_decode_logits(ref, tokens, ids.shape[1])
    got = forced_decode_logits(engine.module, tokens, ids.shape[1])
    max_abs = (got - expected).abs().max().item()
    print(f"{arch} {'graph-safe' if graphs else 'eager'}: max |logit diff| {max_abs:.2e}")
    assert max_abs < FP32_ATOL
    assert torch.equal(engine.generate(ids, **GREEDY), tokens)


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_prompt_continued_after_cached_tokens(arch):
    """A second prompt chunk after cached tokens attends over the cached latents, expanded:
    the same logits as HF's one forward over the whole sequence."""
    ref, engine = tiny_causal_lm(arch), _engine(arch)
    ids = prompt_ids(batch=2, length=11)
    with torch.no_grad():
        expected = ref(ids).logits
        first = engine.module(ids[:, :5], use_cache=True)
        second = engine.module(ids[:, 5:], past_key_values=first.past_key_values,
                               use_cache=True)
    got = torch.cat([first.logits, second.logits], dim=1)
    assert (got - expected).abs().max().item() < FP32_ATOL


def test_compiled_graph_decode():
    """The CPU's compiled decode step (torch.compile; the absorbed products are products with
    constant buffers) gives HF's tokens."""
    arch = "deepseek_v3-mla"
    ref, engine = tiny_causal_lm(arch), _engine(arch, enable_graph=True)
    ids = prompt_ids(batch=1, length=8)
    with torch.no_grad():
        assert torch.equal(engine.generate(ids, **GREEDY), ref.generate(ids, **GREEDY))


# ----- the latent cache and the absorbed decode -------------------------------------------------


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_cache_holds_one_latent_per_token(arch):
    """One tensor per layer [batch, 1, max_tokens, L + R], keys and values at once; its bytes
    are what init_inference checked against free memory."""
    engine = _engine(arch, max_tokens=64)
    heads, latent, nope, rope, value = _dims(engine.module)
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        cache = engine.module(ids, use_cache=True).past_key_values
    assert isinstance(cache, StaticKVCache)
    layers = engine.module.config.num_hidden_layers
    assert len(cache.k) == layers and cache.v is cache.k
    assert all(t.shape == (2, 1, 64, latent + rope) for t in cache.k)
    assert cache.buffers.nbytes == layers * 2 * 64 * (latent + rope) * 4
    plan = plan_injection(tiny_causal_lm(arch), shardwise.get_accelerator("cpu"), torch.float32,
                          64)  # what init_inference checks against the free memory
    assert plan.kv_bytes(torch.float32, batch=2) == cache.buffers.nbytes
    # per-head keys and values would take heads × (N + R + V) per token
    assert latent + rope < heads * (nope + rope + value)
    stack = injected_stack(engine.module)
    assert (stack.kv_heads, stack.head_dim) == (1, latent + rope)


@pytest.mark.parametrize("arch", FAMILIES)
def test_decode_never_expands_the_cache(monkeypatch, arch):
    """A decode step runs absorbed: kv_b_proj is not called (the prompt calls it once per
    layer), so no per-head key or value of a cached token is made."""
    engine = _engine(arch)
    layers = engine.module.model.layers
    calls = []
    for layer in layers:
        layer.self_attn.kv_b_proj.register_forward_hook(lambda *a: calls.append(1))
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        out = engine.module(ids, use_cache=True)
        assert len(calls) == len(layers)
        engine.module(ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
    assert len(calls) == len(layers)


def test_absorbed_weights_are_kv_b_proj_split_per_head():
    """W_UK [H, N, L] and W_UV^T [H, L, V] read by probing kv_b_proj are its weight's rows
    [H, N + V, L], split and transposed."""
    model = tiny_causal_lm("deepseek_v3")
    heads, latent, nope, _, value = _dims(model)
    kv_b = model.model.layers[0].self_attn.kv_b_proj
    core = next(m for m in _engine("deepseek_v3").module.modules()
                if isinstance(m, LatentAttentionCore))
    w_uk, w_uv_t = absorbed_weights(kv_b, core.dims, torch.float32, torch.device("cpu"))
    rows = kv_b.weight.detach().view(heads, nope + value, latent)
    torch.testing.assert_close(w_uk, rows[:, :nope], rtol=0, atol=0)
    torch.testing.assert_close(w_uv_t, rows[:, nope:].transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("arch", FAMILIES)
def test_state_dict_unchanged_and_close_restores(arch):
    """The absorbed weights are not saved (non-persistent buffers); close() gives HF's layers
    back, which then compute HF's logits."""
    ref, model = tiny_causal_lm(arch), tiny_causal_lm(arch)
    keys = list(model.state_dict())
    engine = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)
    assert list(model.state_dict()) == keys
    engine.close()
    assert injected_stack(model) is None
    ids = prompt_ids(batch=1, length=6)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_quantized_projections_are_absorbed_too():
    """int8 weight-only quantization (QuantLinear kv_b_proj, probed for the absorbed halves as
    any linear): the injected model stays within the int8 bounds of HF fp32 and gives the
    logits the same quantized model gives without injection, within 0.02 relative (the two
    paths round different intermediates to bf16 — injection absorbs kv_b_proj — and then to
    8 bits per activation block, so their errors are partly independent; measured 0.0077 apart
    with blocks of 32, 0.0123 with the 8-bit weights' blocks of 16, each 0.009-0.014 from HF
    fp32, agreement 1.0; bf16 compute)."""
    ref = tiny_causal_lm("deepseek_v3")
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        tokens = ref.generate(ids, **GREEDY)
        expected = ref(tokens).logits
    logits = {}
    for inject in (False, True):
        engine = shardwise.init_inference(tiny_causal_lm("deepseek_v3"), device="cpu",
                                          dtype=torch.bfloat16,
                                          quant={"weight": {"num_bits": 8}},
                                          replace_with_kernel_inject=inject)
        assert type(engine.module.model.layers[0].self_attn.kv_b_proj).__name__ == "QuantLinear"
        with torch.no_grad():
            logits[inject] = engine(input_ids=tokens).logits.float()
    max_rel, min_agree = QUANT_BOUNDS[8]
    rel, agree = logit_parity(expected, logits[True])
    assert rel < max_rel and agree >= min_agree, (rel, agree)
    assert logit_parity(logits[False], logits[True])[0] < 0.02  # partly independent roundings


# ----- DeepSeek-V3's router: the correction bias (zero in a fresh model) -----------------------


def _with_correction_bias(model):
    """Random e_score_correction_bias on every MoE layer (HF initialises it to zeros, which would
    hide a bias ignored or added to the weights instead of to the choice)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers[model.config.first_k_dense_replace:]:
            bias = layer.mlp.gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape, generator=g) * 0.1)
    return model


def test_router_correction_bias_moves_the_choice_as_hf():
    """The policy's MoESpec (sigmoid, float32, correction bias for the choice only, routed
    scale, renormalised) under injection: with a bias that re-routes every token of the first
    MoE layer (checked on HF), the logits and greedy tokens are still HF's."""
    ref, plain = _with_correction_bias(tiny_causal_lm("deepseek_v3")), tiny_causal_lm("deepseek_v3")
    engine = shardwise.init_inference(_with_correction_bias(tiny_causal_lm("deepseek_v3")),
                                      device="cpu", replace_with_kernel_inject=True)
    ids = prompt_ids(batch=2, length=8)
    routes = []
    for model in (ref, plain):
        gate = model.model.layers[model.config.first_k_dense_replace].mlp.gate
        gate.register_forward_hook(lambda m, i, out: routes.append(out[2].sort(-1).values))
    with torch.no_grad():
        expected, _ = ref(ids).logits, plain(ids)
        assert (routes[0] != routes[1]).any(-1).float().mean() > 0.5  # the bias re-routes
        assert (engine(input_ids=ids).logits - expected).abs().max().item() < FP32_ATOL
        assert torch.equal(engine.generate(ids, **GREEDY), ref.generate(ids, **GREEDY))


# ----- tensor parallelism: heads split, the latent whole on every rank -------------------------


def _tp_case(rank: int, arch: str, graphs: bool, split: bool) -> dict:
    """``arch`` at tp_size=2 with injection: each decode step's logits against HF's (one
    process), the local widths, the cache's shape."""
    from shardwise.accelerators.cpu import CpuAccelerator

    ref = tiny_causal_lm(arch)
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        tokens = ref.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=0)
        expected = forced_decode_logits(ref, tokens, ids.shape[1])
    original = CpuAccelerator.graph_strategy
    if graphs:
        CpuAccelerator.graph_strategy = lambda self: ReplayOnCpu()
    try:
        engine = _engine(arch, enable_graph=graphs, tensor_parallel={"tp_size": 2})
        got = forced_decode_logits(engine.module, tokens, ids.shape[1])
    finally:
        CpuAccelerator.graph_strategy = original
    attn = engine.module.model.layers[0].self_attn
    query = attn.q_proj if attn.q_proj is not None else attn.q_b_proj
    stack = injected_stack(engine.module)
    return {"max_abs": (got - expected).abs().max().item(),
            "shapes": [list(m.weight.shape) for m in (query, attn.kv_b_proj, attn.o_proj,
                                                      attn.kv_a_proj_with_mqa)],
            "cache": [stack.kv_heads, stack.head_dim], "graphs": stack.graphs is not None,
            "source": engine.plan.sharding.plan.source}


#: name → (family, graphs, heads split): DeepSeek-V3's policy plan splits the heads; the dense
#: variant gets HF's own tp_plan (its MLPs alone: the attention whole on every rank)
_TP_CASES = {"deepseek_v3-mla-hf-plan": ("deepseek_v3-mla", False, False),
             "deepseek_v3-graphs": ("deepseek_v3", True, True)}


def _tp_cases(rank: int) -> dict:
    return run_cases(rank, {name: partial(_tp_case, rank, *args)
                            for name, args in _TP_CASES.items()})


@pytest.fixture(scope="module")
def tp_ranks(tmp_path_factory):
    return run_pair(_tp_cases, tmp_path_factory.mktemp("mla_tp"), deadline_s=240)


@pytest.mark.parametrize("name", list(_TP_CASES))
def test_tensor_parallel_splits_the_heads_or_keeps_them_whole(tp_ranks, name):
    """tp_size=2: the policy's plan keeps half the heads of the queries and kv_b_proj (column)
    and of o_proj's input (row); HF's plan (the dense variant) keeps the attention whole, the
    injected layer reading the heads from the weights. The down-projection and the latent
    cache stay whole; every decode step (eager, or the graph-safe one) matches HF's single
    process."""
    arch, graphs, split = _TP_CASES[name]
    model = tiny_causal_lm(arch)
    heads, latent, nope, rope, value = _dims(model)
    hidden = model.config.hidden_size
    query_in = model.config.q_lora_rank or hidden
    local = heads // 2 if split else heads
    for r in case(tp_ranks, name):
        print(f"{name} TP=2: max |logit diff| {r['max_abs']:.2e}")
        assert r["max_abs"] < FP32_ATOL
        assert r["source"] == ("policy:deepseek_v3" if split else "hf_tp_plan")
        assert r["shapes"] == [[local * (nope + rope), query_in],
                               [local * (nope + value), latent],
                               [hidden, local * value], [latent + rope, hidden]]
        assert r["cache"] == [1, latent + rope] and r["graphs"] == graphs


def test_head_blocks_keep_whole_heads_of_their_own_width():
    """HeadBlocks: each rank keeps its heads' blocks whatever the per-head width (here 24 and
    40, neither the config's head_dim of 8); a size that is no whole number of heads is a
    ShardingError naming the dimension. Uneven heads (7 over 2 ranks: 4 | 3) split as Heads."""
    ranks = [ShardContext(2, r, HeadPartition.compute(4, 4, 8, 2, r)) for r in (0, 1)]
    assert [HeadBlocks("heads").ranges(96, c) for c in ranks] == [[(0, 48)], [(48, 96)]]
    assert [HeadBlocks("heads").ranges(160, c) for c in ranks] == [[(0, 80)], [(80, 160)]]
    uneven = [ShardContext(2, r, HeadPartition.compute(7, 7, 8, 2, r)) for r in (0, 1)]
    assert [HeadBlocks("heads").ranges(7 * 24, c) for c in uneven] == [[(0, 96)], [(96, 168)]]
    with pytest.raises(ShardingError, match="q_b_proj.*size 97.*not 4 heads"):
        HeadBlocks("heads").ranges(97, ranks[0], "q_b_proj (column, output features)")


# ----- bad input ------------------------------------------------------------------------------


def test_latent_attention_spec_is_validated():
    with pytest.raises(ValueError, match="q_proj or all of q_a_proj"):
        LatentAttention(out_proj="o", kv_a_proj="a", kv_a_norm="n", kv_b_proj="b",
                        q_a_proj="qa")
    with pytest.raises(ValueError, match="no q/k/v projections"):
        LatentAttention(qkv=("q", "k", "v"), out_proj="o", q_proj="q", kv_a_proj="a",
                        kv_a_norm="n", kv_b_proj="b")
    with pytest.raises(ValueError, match="kv_b_proj=''"):
        LatentAttention(out_proj="o", q_proj="q", kv_a_proj="a", kv_a_norm="n")


def _with_attention(monkeypatch, model, **changes):
    """The model's policy with its LatentAttention changed (instance-scoped)."""
    policy = policy_for(model)
    spec = policy.injection_spec(model.config)
    spec = dataclasses.replace(spec, attention=dataclasses.replace(spec.attention, **changes))
    monkeypatch.setattr(type(policy), "injection_spec", lambda self, config: spec)


@pytest.mark.parametrize("changes, match", [
    (dict(kv_b_proj="self_attn.nothing"), "no module 'self_attn.nothing'"),
    (dict(kv_a_norm="input_layernorm"), "fit no head count"),
])
def test_a_policy_that_does_not_match_the_weights_fails_before_any_change(monkeypatch, changes,
                                                                          match):
    model = tiny_causal_lm("deepseek_v3")
    _with_attention(monkeypatch, model, **changes)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LatentAttentionError, match=match):
        shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)
    assert injected_stack(model) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_kv_b_proj_with_a_bias_is_refused(monkeypatch):
    """The absorbed decode has no term for a bias on kv_b_proj: refused at init, by name."""
    model = tiny_causal_lm("deepseek_v3-mla")
    kv_b = model.model.layers[1].self_attn.kv_b_proj
    kv_b.bias = torch.nn.Parameter(torch.zeros(kv_b.out_features))
    with pytest.raises(LatentAttentionError, match="kv_b_proj has a bias"):
        shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)
    assert issubclass(LatentAttentionError, shardwise.errors.ConfigError)
    assert not issubclass(LatentAttentionError, InjectionError)  # its own name

"""Mixture-of-Experts blocks through shardwise's one MoE mechanism (:mod:`shardwise.moe`) on one
process: every ``families(moe=1)`` family against plain HF, with and without kernel injection,
graphs on and off, adversarial routing, ``close()``. Expert parallelism over 2 ranks:
tests/test_moe_ep.py.

Tolerances (tiny random models, tests/families.py, batch 2 × 8-token prompts; cpu backend,
measured under load on x86-64, torch 2.13):
* fp32: logits within ``FP32_ATOL`` = 1e-4 of HF (the issue's bound; measured ≤ 2.1e-7: the
  grouped GEMMs sum in another order than HF's grouped_mm experts), 32 greedy tokens identical.
* bf16: logits within ``BF16_ATOL`` = 0.016 of HF bf16 along HF's own greedy continuation
  (measured ≤ 0.0042, about one bf16 ulp at |logit| in [0.5, 1): the router weights stay float32
  into the experts' float32 combine where HF rounds them and each expert's output to bf16; the
  bound is test_inject.py's) and teacher-forced next-token agreement ≥
  ``MIN_FORCED_AGREEMENT`` = 0.9 (measured ≥ 0.985: at most 1 of 66 positions).

Families come from tests/families.py (``moe``), so every MoE family a policy adds is checked
here; the tests read the block's parts by the family's MoESpec names. A family whose injected
layer differs from HF's in bf16 beyond the MoE block (its own attention) states its bound as
``Family.tolerances["moe_bf16"]``, with the measured value.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise
from shardwise.inject.injector import injected_stack
from shardwise.ledger import Ledger
from shardwise.moe import MoEBlockForward, MoEError, install_moe, to_stacked_layout
from shardwise.plan import build_plan
from families import families, family
from graph_doubles import ReplayOnCpu
from models import (MIN_FORCED_AGREEMENT, bf16_against_hf, prompt_ids,
                    tiny_causal_lm)

FAMILIES = families(moe=1)  # tests/families.py
FP32_ATOL = 1e-4
BF16_ATOL = 0.016
NEW = 32
GREEDY = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)


def _cpu():
    from shardwise.plugins import get_accelerator

    return get_accelerator("cpu")


def _engine(model, dtype=torch.float32, **kwargs):
    return shardwise.init_inference(model, device="cpu", dtype=dtype,
                                    replace_with_kernel_inject=True, **kwargs)


def _spec(model):
    return build_plan(model).policy.moe


def _blocks(model):
    """(layer index, MoE block) of every MoE layer of an HF model (or an injected one)."""
    plan = build_plan(model)
    layers = model.model.layers
    return [(i, layers[i].get_submodule(plan.policy.moe.block)) for i in plan.experts.moe_layers]


def _part(block, spec, name):
    """The block's part ``name`` ("router", "experts") by the family's MoESpec."""
    return block.get_submodule(getattr(spec, name))


_REFERENCES: dict = {}


def _reference(arch, ids):
    """HF's fp32 (logits, greedy tokens) for ``ids``, computed once per case."""
    key = (arch, tuple(ids.flatten().tolist()))
    if key not in _REFERENCES:
        ref = tiny_causal_lm(arch)
        with torch.no_grad():
            _REFERENCES[key] = ref(ids).logits, ref.generate(ids, **GREEDY)
    return _REFERENCES[key]


def _compare(arch, model, ids):
    ref_logits, ref_tokens = _reference(arch, ids)
    with torch.no_grad():
        logits, tokens = model(input_ids=ids).logits, model.generate(ids, **GREEDY)
    return (logits - ref_logits).abs().max().item(), ref_tokens, tokens


# ----- parity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", FAMILIES)
def test_fp32_parity_injected(arch):
    engine = _engine(tiny_causal_lm(arch))
    assert injected_stack(engine.module) is not None
    assert engine.moe.experts and set(engine.moe.experts.values()) == {"kernel"}
    max_abs, ref_tokens, tokens = _compare(arch, engine, prompt_ids(batch=2, length=8))
    print(f"{arch} injected fp32: max |logit diff| {max_abs:.2e}")
    assert max_abs < FP32_ATOL
    assert torch.equal(tokens, ref_tokens)


def test_gpt_oss_clamp_read_from_the_experts_where_the_config_lacks_it():
    """transformers before 5.2x kept GPT-OSS's SwiGLU limit and alpha on the experts module,
    not the config: with the config's fields gone the module's are used, with the same result;
    with both gone the error names both places."""
    model = tiny_causal_lm("gpt_oss")
    for name in ("swiglu_limit", "swiglu_alpha"):  # as an older config: absent (past the
        model.config.__dict__[name] = None          # validation a newer config does)
    engine = _engine(model)
    max_abs, ref_tokens, tokens = _compare("gpt_oss", engine, prompt_ids(batch=2, length=8))
    assert max_abs < FP32_ATOL and torch.equal(tokens, ref_tokens)
    bare = tiny_causal_lm("gpt_oss")
    bare.config.__dict__["swiglu_limit"] = None
    for layer in bare.model.layers:
        del layer.mlp.experts.limit
    with pytest.raises(MoEError, match="swiglu_limit.*experts' limit and alpha"):
        _engine(bare)


@pytest.mark.parametrize("arch", FAMILIES)
def test_fp32_parity_blocks_alone_and_ledger_gives_them_back(arch):
    """Without injection: install_moe alone on the HF layers (what ep > 1 and quant run on a
    model that is not injected), then the ledger's undo puts HF's forwards back."""
    model = tiny_causal_lm(arch)
    ledger = Ledger(model)
    with ledger.recording():
        report = install_moe(model, build_plan(model), _cpu(), torch.float32)
    assert report.layers == build_plan(model).experts.moe_layers
    assert all("forward" in vars(block) for _, block in _blocks(model))
    max_abs, ref_tokens, tokens = _compare(arch, model, prompt_ids(batch=2, length=8))
    print(f"{arch} blocks alone fp32: max |logit diff| {max_abs:.2e}")
    assert max_abs < FP32_ATOL
    assert torch.equal(tokens, ref_tokens)
    ledger.give_back()
    spec = _spec(model)
    for _, block in _blocks(model):
        assert "forward" not in vars(block)
        assert "forward" not in vars(_part(block, spec, "experts"))


@pytest.mark.parametrize("arch", FAMILIES)
def test_bf16_parity(arch):
    ref, engine = tiny_causal_lm(arch, dtype=torch.bfloat16), _engine(tiny_causal_lm(arch),
                                                                      torch.bfloat16)
    max_abs, forced = bf16_against_hf(ref, engine, new_tokens=NEW)
    print(f"{arch} bf16: max |logit diff| {max_abs:.4f}, teacher-forced agreement {forced:.3f}")
    assert max_abs < family(arch).tolerances.get("moe_bf16", BF16_ATOL)
    assert forced >= MIN_FORCED_AGREEMENT


@pytest.mark.parametrize("arch", FAMILIES)
def test_graph_decode_step_matches(monkeypatch, arch):
    """The captured decode step (ReplayOnCpu: the graph-safe step, static buffers) runs the MoE
    blocks and gives HF's tokens; the compiled CPU graph: test_moe_compiled_graph_decode."""
    from shardwise.accelerators.cpu import CpuAccelerator

    monkeypatch.setattr(CpuAccelerator, "graph_strategy", lambda self: ReplayOnCpu())
    engine = _engine(tiny_causal_lm(arch), enable_graph=True)
    assert engine.moe.capturable  # the cpu backend's moe ops are
    max_abs, ref_tokens, tokens = _compare(arch, engine, prompt_ids(batch=2, length=8))
    assert max_abs < FP32_ATOL and torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_compiled_graph_decode(arch):
    """The CPU's compiled decode step (torch.compile) traces the MoE block — routed experts
    only (Mixtral), and with a dense layer and a gated shared expert (Qwen2-MoE): no host sync,
    same tokens as HF. (Every other MoE family was checked the same way by hand: a compile each
    is too slow for the suite.)"""
    from shardwise.moe.block import ExpertsKernelForward

    engine = _engine(tiny_causal_lm(arch), enable_graph=True)
    ids = prompt_ids(batch=1, length=8)
    with torch.no_grad():
        assert torch.equal(engine.generate(ids, **GREEDY), _reference(arch, ids)[1])
    assert engine.module.base_model.graphs.buckets() == {1}
    # one process holds every expert: the kernel is told no id is another rank's (batch 1
    # takes token_mlp without the sentinel branch)
    forwards = [vars(m).get("forward") for m in engine.module.modules()]
    experts = [f for f in forwards if isinstance(f, ExpertsKernelForward)]
    assert experts and all(f.local_only for f in experts)


# ----- routing ----------------------------------------------------------------------------------


def _zero_routers(model):
    """Every router weight zero: equal scores, so every token's top-k is experts 0..k-1 (the
    lowest indices win ties, in HF's topk as in the kernel's)."""
    spec = _spec(model)
    with torch.no_grad():
        for _, block in _blocks(model):
            router = _part(block, spec, "router")
            router.weight.zero_()
            if getattr(router, "bias", None) is not None:  # GPT-OSS's router bias
                router.bias.zero_()
            if spec.correction_bias:  # DeepSeek-V3's: for the choice only
                getattr(router, spec.correction_bias).zero_()
    return model


@pytest.mark.parametrize("arch", FAMILIES)
def test_adversarial_routing_every_token_to_the_same_experts(arch):
    """Every token of every MoE layer to the same experts (a 2 × 16-token prompt: 32 tokens on
    one expert pair, far past an even share): HF's logits at every position, so no token was
    dropped."""
    ref = _zero_routers(tiny_causal_lm(arch))
    engine = _engine(_zero_routers(tiny_causal_lm(arch)))
    ids = prompt_ids(batch=2, length=16)
    with torch.no_grad():
        max_abs = (engine(input_ids=ids).logits - ref(ids).logits).abs().max().item()
    assert max_abs < FP32_ATOL


def test_block_is_dropless_with_every_token_on_one_expert():
    """64 tokens all routed to expert 3 (router row 3 large, the others zero, tokens with a
    positive projection on it): the block's output is the dense computation of that expert for
    every token."""
    model = tiny_causal_lm("mixtral")
    index, block = _blocks(model)[0]
    ledger = Ledger(model)
    with ledger.recording():
        install_moe(model, build_plan(model), _cpu(), torch.float32)
    direction = torch.randn(64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[3] = direction * 100
        block.gate.weight[1] = direction * 50  # every token's second choice
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(6))
        x = x + direction * (x @ direction).abs()[:, None]  # x · direction > 0 for every token
        assert bool(((x @ direction) > 0).all())
        out = block(x[None])[0]
        probs = torch.softmax(x @ block.gate.weight.T, -1)
        top = probs[:, [3, 1]]
        top = top / top.sum(-1, keepdim=True)
        experts = block.experts

        def mlp(e):
            gate, up = (x @ experts.gate_up_proj[e].T).chunk(2, -1)
            return (torch.nn.functional.silu(gate) * up) @ experts.down_proj[e].T
        expected = top[:, :1] * mlp(3) + top[:, 1:] * mlp(1)
    assert torch.allclose(out, expected, atol=1e-5)
    ledger.give_back()


def test_expert_ranges_sum_to_the_whole_block():
    """The block on two expert ranges (ep 2, each rank's share, no group: the partial sums)
    adds up to the block on all experts: global ids outside the range become the sentinel
    E_local and contribute nothing; an experts module still holding every expert is read
    through a view of the range."""
    model = tiny_causal_lm("mixtral")
    plan = build_plan(model)
    _, block = _blocks(model)[0]
    ledger = Ledger(model)
    with ledger.recording():
        install_moe(model, plan, _cpu(), torch.float32)
    whole = vars(block)["forward"]
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(7))
    parts = []
    for start, end in ((0, 2), (2, 4)):
        experts_forward = type(vars(block.experts)["forward"])(
            block.experts, whole.kernels, vars(block.experts)["forward"].math, (start, end), 4)
        partial = MoEBlockForward(whole.parts, whole.spec, whole.router, whole.kernels,
                                  (start, end), 4)
        with torch.no_grad():
            vars(block.experts)["forward"], saved = experts_forward, vars(block.experts)["forward"]
            parts.append(partial(x))
            vars(block.experts)["forward"] = saved
    with torch.no_grad():
        full = whole(x)
    assert torch.allclose(parts[0] + parts[1], full, atol=1e-6)
    assert not torch.allclose(parts[0], full, atol=1e-3)  # each range alone is a share
    ledger.give_back()


# ----- structure, errors, close -------------------------------------------------------------


def test_dense_layers_keep_their_mlp_under_injection():
    """Qwen2-MoE's layer 0 is dense (mlp_only_layers): the injected layer calls its MLP; the
    MoE layers call their block."""
    engine = _engine(tiny_causal_lm("qwen2_moe"))
    layers = injected_stack(engine.module).parts.layers
    dense_in = layers[0].parts.mlp_in  # gate and up (one fused product, or the two)
    assert layers[0].parts.moe is None and dense_in
    assert sum(m.weight.shape[0] for m in dense_in) == 2 * engine.module.config.intermediate_size
    assert all(layer.parts.moe is layer.mlp for layer in layers[1:])
    assert engine.moe.layers == (1, 2)


@pytest.mark.parametrize("arch", FAMILIES)
def test_close_restores_the_hf_blocks(arch):
    ref, model = tiny_causal_lm(arch), tiny_causal_lm(arch)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = _engine(model, enable_graph=False)
    assert engine.close() is model
    spec = _spec(model)
    for _, block in _blocks(model):
        assert "forward" not in vars(block)
        assert "forward" not in vars(_part(block, spec, "experts"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_a_policy_without_moe_spec_is_refused_before_any_change(monkeypatch):
    from shardwise.policies.mixtral import MixtralPolicy

    monkeypatch.setattr(MixtralPolicy, "moe", None)
    model = tiny_causal_lm("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MoEError, match="gives no MoESpec"):
        _engine(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all("forward" not in vars(layer.mlp) for layer in model.model.layers)


def test_a_block_not_where_the_spec_says_is_named(monkeypatch):
    from shardwise.moe import MoESpec
    from shardwise.policies.mixtral import MixtralPolicy

    monkeypatch.setattr(MixtralPolicy, "moe", MoESpec(block="mlp", router="router"))
    with pytest.raises(MoEError, match="layer 0: the MoE block 'mlp' .* has no router 'router'"):
        _engine(tiny_causal_lm("mixtral"))


def test_an_unknown_dispatch_is_refused_before_any_change():
    from shardwise.errors import ConfigError

    model = tiny_causal_lm("mixtral")
    with pytest.raises(ConfigError, match="dispatch must be one of"):
        install_moe(model, build_plan(model), _cpu(), torch.float32, dispatch="broadcast")
    assert all("forward" not in vars(block) for _, block in _blocks(model))
    report = install_moe(model, build_plan(model), _cpu(), torch.float32, dispatch="auto")
    assert report.dispatch == "all_reduce"  # the same tokens on every rank


def test_moe_ep1_without_injection_leaves_the_hf_blocks():
    """moe={"ep_size": 1} alone does not run the MoE step (nothing to change)."""
    engine = shardwise.init_inference(tiny_causal_lm("mixtral"), moe={"ep_size": 1},
                                      device="cpu")
    assert engine.moe is None
    assert all("forward" not in vars(block) for _, block in _blocks(engine.module))


# ----- the GPT-OSS layout hook -----------------------------------------------------------------


def test_gpt_oss_experts_convert_to_the_stacked_layout_and_back():
    """to_stacked_layout('gpt_oss') rewrites the experts in place (same Parameters) into the
    kernels' layout — the kernel then computes GptOssExperts' own output — and the recorded undo
    gives the original tensors back bit for bit."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from shardwise.kernels.reference.moe import moe_grouped_mlp

    config = GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                          num_experts_per_tok=2)
    torch.manual_seed(0)
    experts = GptOssExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(5, 32)
    idx = torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 0]])
    w = torch.rand(5, 2)
    with torch.no_grad():
        expected = experts(x, idx, w)
    originals = {n: p.detach().clone() for n, p in experts.named_parameters()}
    params = dict(experts.named_parameters())
    holder = nn.Module()
    holder.experts = experts
    ledger = Ledger(holder)
    with ledger.recording():
        to_stacked_layout(experts, "gpt_oss")
        to_stacked_layout(experts, "gpt_oss")  # once only
    assert experts.gate_up_proj.shape == (4, 32, 32) and experts.down_proj.shape == (4, 32, 16)
    assert dict(experts.named_parameters()) == params  # the same Parameter objects
    got = moe_grouped_mlp(x, experts.gate_up_proj, experts.down_proj, idx, w,
                          gate_up_bias=experts.gate_up_proj_bias,
                          down_bias=experts.down_proj_bias, clamp=config.swiglu_limit,
                          alpha=config.swiglu_alpha)
    assert torch.allclose(got, expected, atol=1e-5)
    ledger.give_back()
    assert all(torch.equal(p, originals[n]) for n, p in experts.named_parameters())


# ----- CUDA (skipped where no GPU exists) ---------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("arch", FAMILIES)
def test_cuda_moe_parity_with_graphs(arch):
    """Every MoE family on the Triton kernels with CUDA graphs: fp32 logits within 1e-3 of HF
    (Triton dots sum in another order) and identical greedy tokens, the decode steps replayed
    from the captured graph."""
    ref = tiny_causal_lm(arch).cuda()
    engine = shardwise.init_inference(tiny_causal_lm(arch), device="cuda", dtype=torch.float32,
                                      replace_with_kernel_inject=True, enable_graph=True)
    assert engine.module.base_model.graphs is not None
    ids = prompt_ids(batch=2, length=8).cuda()
    with torch.no_grad():
        ref_logits, ref_tokens = ref(ids).logits, ref.generate(ids, **GREEDY)
    assert (engine(input_ids=ids).logits - ref_logits).abs().max().item() < 1e-3
    assert torch.equal(engine.generate(ids, **GREEDY), ref_tokens)

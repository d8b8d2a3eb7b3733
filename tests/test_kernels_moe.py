"""The MoE references against Hugging Face's own MoE blocks (tiny random configs, fp32 1e-5), the
routing corner cases (adversarial: every token to one expert, exact) and the CPU paths (decode:
capturable, no host sync; prefill: sorted segments) against the reference."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import assert_moe_matches, local_experts, moe_inputs

from shardwise import KernelError
from shardwise.kernels.reference import moe as ref

F32 = dict(atol=1e-5, rtol=1e-5)


def _init(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for name, b in module.named_buffers():
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return module.eval()


def _x(tokens, hidden, seed=5):
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))


def test_mixtral_block_matches_hf():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=6,
                        num_experts_per_tok=2)
    block = _init(MixtralSparseMoeBlock(cfg), 0)
    x = _x(9, 32)
    with torch.no_grad():
        want = block(x[None])[0]
        weights, experts = ref.moe_route(x @ block.gate.weight.T, 2, renormalize=True)
        got = ref.moe_grouped_mlp(x, block.experts.gate_up_proj, block.experts.down_proj,
                                  experts, weights)
    torch.testing.assert_close(got, want, **F32)


def test_qwen2_moe_routed_experts_match_hf():
    """Qwen2-MoE without renormalisation; the shared expert (and its gate) is not in the op."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=8,
                         num_experts_per_tok=3, norm_topk_prob=False,
                         shared_expert_intermediate_size=40)
    block = _init(Qwen2MoeSparseMoeBlock(cfg), 1)
    x = _x(7, 32)
    with torch.no_grad():
        shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        want = block(x[None])[0] - shared
        weights, experts = ref.moe_route(x @ block.gate.weight.T, 3, renormalize=False)
        got = ref.moe_grouped_mlp(x, block.experts.gate_up_proj, block.experts.down_proj,
                                  experts, weights)
    torch.testing.assert_close(got, want, **F32)


def test_deepseek_v3_router_and_experts_match_hf():
    """Sigmoid scores, correction bias for the choice only, group-limited top-k, scale."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16,
                           num_experts_per_tok=4, n_group=4, topk_group=2, norm_topk_prob=True,
                           routed_scaling_factor=2.5, n_shared_experts=1)
    block = _init(DeepseekV3MoE(cfg), 2)
    x = _x(11, 32)
    with torch.no_grad():
        _, hf_w, hf_e = block.gate(x)
        w, e = ref.moe_route(x @ block.gate.weight.T, 4, scoring="sigmoid",
                             bias=block.gate.e_score_correction_bias, n_group=4, topk_group=2,
                             renormalize=True, scale=2.5)
        # HF's top-k is unsorted: compare each token's set of (expert, weight)
        for t in range(x.shape[0]):
            a, b = hf_e[t].argsort(), e[t].argsort()
            assert torch.equal(hf_e[t][a], e[t][b])
            torch.testing.assert_close(w[t][b], hf_w[t][a], **F32)
        want = block(x[None])[0] - block.shared_experts(x)
        got = ref.moe_grouped_mlp(x, block.experts.gate_up_proj, block.experts.down_proj, e, w)
    torch.testing.assert_close(got, want, **F32)


def test_gpt_oss_experts_match_hf():
    """Expert biases, clamped SwiGLU, GPT-OSS's transposed interleaved layout converted."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=4,
                       num_experts_per_tok=2, swiglu_limit=0.5)
    block = _init(GptOssMLP(cfg), 3)
    x = _x(6, 32) * 3  # large enough that the clamp bites
    ex = block.experts
    with torch.no_grad():
        want = block(x[None])[0][0]
        logits = x @ block.router.weight.T + block.router.bias
        w, e = ref.moe_route(logits, 2, renormalize=True)
        gate_up, gate_up_bias, down, down_bias = ref.gpt_oss_layout(
            ex.gate_up_proj, ex.gate_up_proj_bias, ex.down_proj, ex.down_proj_bias)
        got = ref.moe_grouped_mlp(x, gate_up, down, e, w, gate_up_bias=gate_up_bias,
                                  down_bias=down_bias, clamp=ex.limit, alpha=ex.alpha)
        gu = x @ gate_up[0].T + gate_up_bias[0]
        assert (gu.abs() > 0.5).any()  # the clamp changed something
    torch.testing.assert_close(got, want, **F32)


def test_adversarial_routing_is_exact_and_dropless():
    """Every token to expert 2 (and expert 0 second): each token's output is its own two MLPs,
    bit for bit what one token alone gives; nothing is dropped."""
    x = _x(12, 16)
    gate_up, down = _x(4 * 20, 16, 6).view(4, 20, 16), _x(4 * 16, 10, 7).view(4, 16, 10)
    experts = torch.tensor([[2, 0]] * 12)
    weights = torch.full((12, 2), 0.5)
    all_tokens = ref.moe_grouped_mlp(x, gate_up, down, experts, weights)
    order, counts, offsets = ref.moe_permute(experts, 4)
    assert counts.tolist() == [12, 0, 12, 0] and offsets.tolist() == [0, 12, 12, 24, 24]
    assert order.tolist() == list(range(1, 24, 2)) + list(range(0, 24, 2))
    for t in range(12):
        one = ref.moe_grouped_mlp(x[t:t + 1], gate_up, down, experts[:1], weights[:1])
        torch.testing.assert_close(all_tokens[t:t + 1], one, **F32)
    assert all_tokens.abs().sum(-1).gt(0).all()


def _ep_split(tokens, inter, dtype, seed=11):
    """8 experts top-2 over 2 ranks of 4: the whole call's inputs and each rank's own (its
    experts' weights, local ids with the sentinel 4 for the other rank's slots)."""
    x, gate_up, down, experts, weights = moe_inputs(tokens, 64, inter, 8, 2, dtype, seed=seed)
    ranks = [(x, gate_up[s:s + 4], down[s:s + 4], local_experts(experts, s, 4), weights)
             for s in (0, 4)]
    return (x, gate_up, down, experts, weights), ranks


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("inter", [32, 12])  # cpu: grouped_mm and the gathered path
def test_sentinel_slots_contribute_nothing(backend, inter):
    """Expert parallelism's contract: the index E_local (= the experts held) marks another
    rank's expert. The two ranks' outputs sum to the whole call's; a rank holding none of a
    token's experts gives it exactly 0; a call whose slots are all the sentinel gives zeros."""
    from shardwise.kernels.cpu import moe as cpu_moe

    fn = ref.moe_grouped_mlp if backend == "reference" else cpu_moe.moe_grouped_mlp
    whole, ranks = _ep_split(16, inter, torch.float32)
    parts = [fn(*r) for r in ranks]
    torch.testing.assert_close(parts[0] + parts[1], ref.moe_grouped_mlp(*whole), **F32)
    for part, (_, _, _, local, _) in zip(parts, ranks):
        away = (local == 4).all(-1)  # tokens with no expert on this rank
        assert away.any() and (~away).any()
        assert torch.equal(part[away], torch.zeros_like(part[away]))
    x, gate_up, down, _, weights = ranks[0]
    nowhere = torch.full((16, 2), 4)
    assert torch.equal(fn(x, gate_up, down, nowhere, weights), torch.zeros_like(x))


def test_reference_refuses_expert_indices_past_the_sentinel():
    x, gate_up, down = torch.zeros(2, 16), torch.zeros(4, 24, 16), torch.zeros(4, 16, 12)
    w = torch.zeros(2, 2)
    ref.moe_grouped_mlp(x, gate_up, down, torch.tensor([[4, 0], [3, 4]]), w)  # 4: the sentinel
    for bad in ([[5, 0], [1, 2]], [[-1, 0], [1, 2]]):
        with pytest.raises(KernelError, match="another rank"):
            ref.moe_grouped_mlp(x, gate_up, down, torch.tensor(bad), w)


def test_permute_is_a_stable_sort_by_expert():
    experts = torch.tensor([[3, 1], [1, 0], [3, 2], [1, 3]])
    order, counts, offsets = ref.moe_permute(experts, 5)
    assert order.tolist() == [3, 1, 2, 6, 5, 0, 4, 7]
    assert counts.tolist() == [1, 3, 1, 3, 0] and offsets.tolist() == [0, 1, 4, 5, 8, 8]


@pytest.mark.parametrize("kwargs,message", [
    (dict(top_k=9), "top_k"), (dict(scoring="relu"), "scoring"), (dict(n_group=3), "n_group"),
    (dict(n_group=2, topk_group=3), "topk_group"), (dict(bias=torch.zeros(7)), "bias")])
def test_route_bad_input(kwargs, message):
    args = dict(top_k=2) | kwargs
    with pytest.raises(KernelError, match=message):
        ref.moe_route(torch.zeros(3, 8), args.pop("top_k"), **args)


def test_grouped_mlp_bad_input():
    x, experts, w = torch.zeros(2, 16), torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2)
    with pytest.raises(KernelError, match="gpt_oss_layout"):  # GPT-OSS's transposed layout
        ref.moe_grouped_mlp(x, torch.zeros(4, 16, 24), torch.zeros(4, 12, 16), experts, w)
    with pytest.raises(KernelError, match="clamp"):
        ref.moe_grouped_mlp(x, torch.zeros(4, 24, 16), torch.zeros(4, 16, 12), experts, w,
                            activation="gelu", clamp=7.0)
    with pytest.raises(KernelError, match="expert indices"):
        ref.moe_permute(torch.tensor([[0, 4]]), 4)


def _meta_inputs(tokens, inter=32):
    # bf16: torch's meta kernel of grouped_mm takes bf16 only (its CPU kernel takes fp32 too)
    x, gate_up, down = (torch.empty(s, device="meta", dtype=torch.bfloat16) for s in
                        ((tokens, 64), (8, 2 * inter, 64), (8, 64, inter)))
    return (x, gate_up, down, torch.empty(tokens, 2, dtype=torch.long, device="meta"),
            torch.empty(tokens, 2, device="meta"))


@pytest.mark.parametrize("tokens", [1, 8, 40])
def test_cpu_grouped_mlp_never_syncs_with_the_host(tokens):
    """Meta tensors have no values: an op that runs on them reads none on the host (no
    ``.item()``, ``nonzero`` or routing-dependent shape), which is what a graph capture needs.
    The reference (the oracle) does read them, so the check is not vacuous."""
    from shardwise.kernels.cpu import moe as cpu_moe

    for inter in (32, 12):  # grouped_mm and the gathered path
        out = cpu_moe.moe_grouped_mlp(*_meta_inputs(tokens, inter))
        assert out.shape == (tokens, 64) and out.device.type == "meta"
    out = cpu_moe.streamed_mlp(*_meta_inputs(tokens))  # the compiled decode path
    assert out.shape == (tokens, 64) and out.device.type == "meta"
    w, e = cpu_moe.moe_route(torch.empty(tokens, 8, device="meta"), 2, renormalize=True)
    assert w.shape == e.shape == (tokens, 2)
    with pytest.raises((RuntimeError, NotImplementedError)):
        ref.moe_grouped_mlp(*_meta_inputs(tokens))


#: name -> (tokens, hidden, inter, experts, top_k, adversarial, gpt_oss, remote) for the
#: compiled decode path: 1 and 8 tokens, all tokens to one expert, GPT-OSS's biases and clamp,
#: half the experts on this rank (the sentinel), rows not a multiple of the chunk (H=40, I=12)
STREAMED = {"t1": (1, 64, 32, 8, 2, False, False, False),
            "t8": (8, 64, 32, 8, 2, False, False, False),
            "adversarial": (6, 64, 32, 8, 2, True, False, False),
            "gpt-oss": (5, 64, 32, 4, 2, False, True, False),
            "sentinel": (7, 64, 32, 8, 2, False, False, True),
            "uneven": (3, 40, 12, 4, 3, False, False, False)}


def _streamed_case(name, dtype):
    t, h, i, e, k, adv, oss, remote = STREAMED[name]
    x, gate_up, down, experts, weights = moe_inputs(t, h, i, e, k, dtype, adversarial=adv,
                                                    remote=remote)
    kwargs = {}
    if oss:  # expert biases and a clamp that bites
        n = gate_up.shape[0]
        kwargs = dict(gate_up_bias=_x(n, 2 * i, 8).to(dtype), down_bias=_x(n, h, 9).to(dtype),
                      clamp=0.5)
    return (x, gate_up, down, experts, weights), kwargs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(STREAMED))
def test_streamed_decode_path_matches_the_reference(name, dtype):
    """The path the compiled decode step takes (run eagerly here: the same torch code)."""
    from shardwise.kernels.cpu import moe as cpu_moe

    args, kwargs = _streamed_case(name, dtype)
    assert_moe_matches(cpu_moe.streamed_mlp(*args, **kwargs),
                       ref.moe_grouped_mlp(*args, **kwargs), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("route", [[1, 3], [4, 2], [0, 4], [4, 4]],
                         ids=["here", "sentinel-first", "sentinel-second", "all-away"])
def test_one_token_decode_path_matches_the_reference(route, dtype):
    """The compiled step's path at batch 1 (run eagerly here: the same torch code), on a rank
    holding 4 of 8 experts: slots of this rank, the sentinel in either slot (it reads an expert
    of this rank and adds nothing), none here (zeros); and GPT-OSS's biases and clamp."""
    from shardwise.kernels.cpu import moe as cpu_moe

    x, gate_up, down, _, weights = moe_inputs(1, 64, 32, 8, 2, dtype, remote=True)
    experts = torch.tensor([route])
    args = (x, gate_up, down, experts, weights)
    kw = dict(gate_up_bias=_x(4, 64, 8).to(dtype), down_bias=_x(4, 64, 9).to(dtype), clamp=0.5)
    # token_mlp (every expert here: told by sentinel=False) and the sentinel-skipping slots
    for path in (cpu_moe.token_mlp, cpu_moe.sentinel_token_mlp):
        assert_moe_matches(path(*args), ref.moe_grouped_mlp(*args), dtype)
        if route == [4, 4]:
            assert torch.equal(path(*args), torch.zeros_like(x)), path.__name__
        assert_moe_matches(path(*args, **kw), ref.moe_grouped_mlp(*args, **kw), dtype)
        one_bias = dict(down_bias=kw["down_bias"])  # either bias alone
        assert_moe_matches(path(*args, **one_bias), ref.moe_grouped_mlp(*args, **one_bias),
                           dtype)


def test_compiled_decode_traces_whole_into_the_streamed_path():
    """Under torch.compile (fullgraph: no graph break, so no host sync) a decode call becomes one
    graph with no grouped GEMM in it (one token: no sort either, the token path), and computes
    what the reference does, sentinel included;
    a call with more slots per expert keeps the grouped GEMMs in bf16 (fp32 grouped_mm does not
    trace: the streamed path)."""
    from shardwise.kernels.cpu import moe as cpu_moe

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def call(*args):
        return cpu_moe.moe_grouped_mlp(*args)

    def grouped_gemms(gm):
        return sum("grouped_mm" in str(node.target) for node in gm.graph.nodes)

    def sorts(gm):
        return sum("argsort" in str(node.target) for node in gm.graph.nodes)

    def conds(gm):
        return sum("cond" in str(node.target) for node in gm.graph.nodes)

    compiled = torch.compile(call, backend=keep, fullgraph=True, dynamic=False)
    many = cpu_moe.STREAMED_SLOTS_PER_EXPERT * 4 // 2 + 1  # tokens: 4 local experts, top-2
    for tokens, dtype, gemms in ((3, torch.float32, 0), (1, torch.bfloat16, 0),
                                 (many, torch.bfloat16, 2), (many, torch.float32, 0)):
        args = moe_inputs(tokens, 64, 32, 8, 2, dtype, remote=True)  # 4 experts here
        assert_moe_matches(compiled(*args), ref.moe_grouped_mlp(*args), dtype)
        assert grouped_gemms(graphs[-1]) == gemms, (tokens, dtype)
        assert (sorts(graphs[-1]) == 0) == (tokens == 1), (tokens, dtype)  # 1 token: token_mlp
        # 1 token: each routed slot under its own cond (a slot routed elsewhere reads nothing)
        assert (conds(graphs[-1]) > 0) == (tokens == 1), (tokens, dtype)
    assert len(graphs) == 4
    every = torch.compile(lambda *args: cpu_moe.moe_grouped_mlp(*args, sentinel=False),
                          backend=keep, fullgraph=True, dynamic=False)
    args = moe_inputs(1, 64, 32, 8, 2, torch.float32)  # every expert here, and told so
    assert_moe_matches(every(*args), ref.moe_grouped_mlp(*args), torch.float32)
    assert conds(graphs[-1]) == 0 and sorts(graphs[-1]) == 0  # token_mlp alone, no branch


def test_cpu_graph_strategy_compiles_the_decode_path():
    """The CPU graph strategy (inductor, C++) captures a decode call, bf16 with the sentinel and
    GPT-OSS's biases, and replays it with new routing."""
    from shardwise.accelerators.cpu_graphs import CpuCompileStrategy
    from shardwise.kernels.cpu import moe as cpu_moe

    (x, gate_up, down, experts, weights), kw = _streamed_case("gpt-oss", torch.bfloat16)
    gate_up, down = gate_up[:3], down[:3]  # 3 of the 4 experts here: 3 is the sentinel
    bias = kw["gate_up_bias"][:3], kw["down_bias"][:3]

    def step(x, experts, weights):
        return cpu_moe.moe_grouped_mlp(x, gate_up, down, experts, weights, gate_up_bias=bias[0],
                                       down_bias=bias[1], clamp=0.5)

    graph = CpuCompileStrategy().capture(step, x, experts, weights)
    for seed in (1, 2):
        new = torch.randint(0, 4, experts.shape, generator=torch.Generator().manual_seed(seed))
        want = ref.moe_grouped_mlp(x, gate_up, down, new, weights, gate_up_bias=bias[0],
                                   down_bias=bias[1], clamp=0.5)
        assert_moe_matches(graph(x, new, weights), want, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_graph_strategy_captures_one_token_with_the_sentinel(dtype):
    """Batch-1 decode on a rank holding 4 of 8 experts, captured once by the CPU graph strategy
    (inductor, C++, the torch.cond branches inside), replayed with every kind of routing: both
    slots here, one here, none here (the sentinel slots skipped), with and without
    GPT-OSS's biases: the reference's output each time."""
    from shardwise.accelerators.cpu_graphs import CpuCompileStrategy
    from shardwise.kernels.cpu import moe as cpu_moe

    x, gate_up, down, experts, weights = moe_inputs(1, 64, 32, 8, 2, dtype, remote=True)
    biased = dict(gate_up_bias=_x(4, 64, 8).to(dtype), down_bias=_x(4, 64, 9).to(dtype),
                  clamp=0.5)
    for kw in ({}, biased):
        def step(x, experts, weights):
            return cpu_moe.moe_grouped_mlp(x, gate_up, down, experts, weights, **kw)

        graph = CpuCompileStrategy().capture(step, x, torch.tensor([[1, 3]]), weights)
        for route in ([1, 3], [4, 2], [0, 4], [4, 4], [3, 0]):
            new = torch.tensor([route])
            want = ref.moe_grouped_mlp(x, gate_up, down, new, weights, **kw)
            got = graph(x, new, weights)
            assert_moe_matches(got, want, dtype)
            if route == [4, 4]:
                assert torch.equal(got, torch.zeros_like(x))


def test_cpu_grouped_mlp_refuses_what_the_reference_refuses():
    from shardwise.kernels.cpu import moe as cpu_moe

    x, experts, w = torch.zeros(2, 16), torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2)
    with pytest.raises(KernelError, match="gpt_oss_layout"):
        cpu_moe.moe_grouped_mlp(x, torch.zeros(4, 16, 24), torch.zeros(4, 12, 16), experts, w)
    with pytest.raises(KernelError, match="top_k"):
        cpu_moe.moe_route(torch.zeros(3, 8), 9)


def test_cpu_resolves_the_capturable_moe_ops():
    """On the CPU accelerator fp32 and bf16 resolve to the cpu backend, declared capturable
    (what the decode step's graph needs); fp16 falls back to the reference."""
    import shardwise
    from shardwise.kernel_registry import KernelRegistry

    registry, cpu = KernelRegistry(), shardwise.get_accelerator("cpu")
    for op in ("moe_grouped_mlp", "moe_route"):
        for dtype in (torch.float32, torch.bfloat16):
            impl = registry.resolve(op, cpu, dtype)
            assert (impl.backend, impl.capturable) == ("cpu", True), (op, dtype)
        assert registry.resolve(op, cpu, torch.float16).backend == "reference"

"""Sharding without processes: partitions, layouts, plan matching and sources, slicing on a fake
rank, and the errors bad plans and impossible sizes give."""

import pytest
import torch
import transformers
from torch import nn
from transformers.pytorch_utils import Conv1D

import shardwise
from shardwise.policy import find_policy
from shardwise.sharding import (ColumnParallel, Even, Fused, HeadPartition, Heads,
                                PerHeadInterleaved, RowParallel, ShardContext, ShardingError,
                                ShardingPlan, VocabParallelEmbedding, VocabParallelHead,
                                choose_plan, even_sizes, heuristic_plan, pattern_matches,
                                plan_from_hf, prepare, prepare_for, slice_all, slice_module,
                                tp_world_problem)
from families import families
from models import tiny_causal_lm


# ----- partitions ---------------------------------------------------------------------------------

def test_even_sizes_differ_by_at_most_one():
    assert even_sizes(7, 2) == [4, 3]
    assert even_sizes(10, 4) == [3, 3, 2, 2]
    assert even_sizes(8, 2) == [4, 4]


def _heads(q, kv, tp, hd=16):
    return [HeadPartition.compute(q, kv, hd, tp, r) for r in range(tp)]


def test_uneven_heads_split_four_three():
    parts = _heads(7, 7, 2)
    assert [(p.q_range, p.kv_range) for p in parts] == [((0, 4), (0, 4)), ((4, 7), (4, 7))]
    assert [p.quantity("q_width") for p in parts] == [64, 48]


def test_grouped_query_splits_by_whole_kv_groups():
    parts = _heads(9, 3, 2)
    assert [(p.q_range, p.kv_range) for p in parts] == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    assert [p.quantity("kv_groups") for p in parts] == [3, 3]


def test_fewer_kv_heads_than_ranks_are_replicated_and_share_their_q_heads():
    mqa = _heads(4, 1, 2)  # multi-query: the kv head on both ranks, q heads split
    assert [(p.q_range, p.kv_range, p.quantity("kv_groups")) for p in mqa] == [
        ((0, 2), (0, 1), 2), ((2, 4), (0, 1), 2)]
    gqa = _heads(8, 2, 4)  # 2 ranks per kv head
    assert [(p.q_range, p.kv_range) for p in gqa] == [
        ((0, 2), (0, 1)), ((2, 4), (0, 1)), ((4, 6), (1, 2)), ((6, 8), (1, 2))]
    uneven = _heads(5, 1, 2)
    assert [p.q_heads for p in uneven] == [3, 2]


@pytest.mark.parametrize("q,kv,tp,works", [
    (4, 4, 8, "1, 2, 3, 4"),  # fewer heads than ranks
    (6, 2, 3, "1, 2, 4, 6"),  # 3 ranks cannot share 2 kv heads equally
    (4, 2, 8, "1, 2, 4"),  # 4 ranks per kv head but only 2 q heads each
])
def test_impossible_head_splits_name_heads_tp_and_sizes_that_work(q, kv, tp, works):
    with pytest.raises(ShardingError) as info:
        HeadPartition.compute(q, kv, 16, tp, 0)
    msg = str(info.value)
    assert f"{q} heads ({kv} kv heads)" in msg and f"tp_size={tp}" in msg
    assert msg.endswith(f"tp sizes that would work: {works}")


# ----- layouts ------------------------------------------------------------------------------------

def _ctx(rank, q=4, kv=4, hd=16, tp=2):
    return ShardContext(tp, rank, HeadPartition.compute(q, kv, hd, tp, rank))


def test_layouts_give_each_rank_its_ranges():
    assert Even().ranges(128, _ctx(1)) == [(64, 128)]
    assert Heads("kv_heads").ranges(32, _ctx(1, q=4, kv=2)) == [(16, 32)]
    qkv = Fused(parts=(("q", "heads"), ("k", "kv_heads"), ("v", "kv_heads")))
    assert qkv.ranges(192, _ctx(1)) == [(32, 64), (96, 128), (160, 192)]  # GPT-2 c_attn
    assert qkv.ranges(128, _ctx(1, q=4, kv=2)) == [(32, 64), (80, 96), (112, 128)]  # Phi-3 GQA
    gate_up = Fused(parts=(("gate", "even"), ("up", "even")))
    assert gate_up.ranges(256, _ctx(1)) == [(64, 128), (192, 256)]
    assert PerHeadInterleaved(per_head=3).ranges(24, _ctx(1, hd=2)) == [(12, 24)]
    assert Even(uneven=True).ranges(257, _ctx(1)) == [(129, 257)]


def test_layout_errors_name_the_size_and_what_would_work():
    with pytest.raises(ShardingError, match=r"size 100.*3 equal parts.*1, 2, 4, 5, 10, 20, 25, 50\)"):
        Even().ranges(100, ShardContext(3, 0), "mlp.up (column, output features)")
    with pytest.raises(ShardingError, match=r"expects 64 \(4 heads × head_dim 16\)"):
        Heads("heads").ranges(60, _ctx(0))
    with pytest.raises(ShardingError, match="head counts are unknown"):
        Heads("heads").ranges(64, ShardContext(2, 0))


# ----- plans --------------------------------------------------------------------------------------

def test_patterns_match_one_segment_per_star_with_or_without_the_base_prefix():
    assert pattern_matches("layers.*.self_attn.q_proj", "model.layers.0.self_attn.q_proj", "model")
    assert pattern_matches("layers.*.self_attn.q_proj", "layers.11.self_attn.q_proj")
    assert not pattern_matches("layers.*.self_attn.q_proj", "model.layers.0.self_attn.q_proj")
    assert not pattern_matches("layers.*.q", "layers.0.1.q")
    assert not pattern_matches("layers.*.q", "xlayers.0.q")


def test_first_matching_row_wins():
    plan = ShardingPlan.from_mapping({"h.0.fc": "replicated", "h.*.fc": "colwise"})
    assert plan.role_for("h.0.fc").name == "replicated"
    assert plan.role_for("h.1.fc") == ColumnParallel()


def test_plan_sources_in_order():
    llama, gpt2 = tiny_causal_lm("llama"), tiny_causal_lm("gpt2")
    assert choose_plan(llama, policy=find_policy("llama")).source == "hf_tp_plan"
    assert choose_plan(gpt2, policy=find_policy("gpt2")).source == "policy:gpt2"
    assert choose_plan(gpt2).source == "heuristic"
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    user = choose_plan(llama, {LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")})
    assert user.source == "injection_policy"
    roles = user.resolve(llama)
    assert roles["model.layers.1.mlp.down_proj"] == RowParallel()
    assert roles["model.layers.1.self_attn.k_proj"] == ColumnParallel()
    assert "lm_head" not in roles


def test_hf_plan_with_entries_that_cannot_be_applied_faithfully_defers_to_the_policy():
    config = transformers.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                     pad_token_id=0)
    phi3 = transformers.AutoModelForCausalLM.from_config(config)
    plan, why = plan_from_hf(phi3)
    assert plan is None and "qkv_proj: colwise_gather_output" in why


def test_heuristic_pairs_linears_without_names_and_leaves_fused_ones_alone():
    rows = {r.pattern: r.role.name for r in heuristic_plan(tiny_causal_lm("llama")).rows}
    assert rows["model.layers.0.self_attn.o_proj"] == "row"
    assert rows["model.layers.0.self_attn.k_proj"] == "column"
    assert rows["model.layers.1.mlp.down_proj"] == "row"
    gpt2 = {r.pattern for r in heuristic_plan(tiny_causal_lm("gpt2")).rows}
    assert "transformer.h.0.mlp.c_fc" in gpt2 and "transformer.h.0.attn.c_attn" not in gpt2


# ----- bad plans ----------------------------------------------------------------------------------

def test_user_plan_naming_a_missing_module_fails_naming_it():
    model = tiny_causal_lm("llama")
    plan = ShardingPlan.from_mapping({"layers.*.mlp.down_proj": "rowwise",
                                      "layers.*.mlp.dwn_proj": "rowwise"})
    with pytest.raises(ShardingError, match=r"do not exist.*'layers\.\*\.mlp\.dwn_proj'"):
        prepare(model, plan, 2)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    with pytest.raises(ShardingError, match=r"'mlp\.down'.*linear layers are: self_attn\.q_proj"):
        prepare_for(model, {LlamaDecoderLayer: ("mlp.down",)}, 2)
    with pytest.raises(ShardingError, match="no module of that class"):
        prepare_for(model, {nn.TransformerEncoderLayer: ("linear2",)}, 2)
    with pytest.raises(ShardingError, match="is not a role"):
        ShardingPlan.from_mapping({"lm_head": "colwize"})


def test_role_on_the_wrong_kind_of_module_fails():
    plan = ShardingPlan.from_mapping({"embed_tokens": "colwise"})
    with pytest.raises(ShardingError, match="'model.embed_tokens' is a Embedding; the column role"):
        prepare(tiny_causal_lm("llama"), plan, 2)


def test_tied_weights_must_be_sliced_alike():
    gpt2 = tiny_causal_lm("gpt2")
    plan = ShardingPlan.from_mapping({"wte": VocabParallelEmbedding(), "h.*.mlp.c_fc": "colwise"})
    with pytest.raises(ShardingError, match="tied weight shared by transformer.wte, lm_head"):
        prepare(gpt2, plan, 2)


def test_model_with_nothing_to_shard():
    with pytest.raises(ShardingError, match="nothing to shard in Sequential"):
        prepare_for(nn.Sequential(nn.LayerNorm(8), nn.ReLU()), None, 2)


def test_heads_that_cannot_split_fail_with_sizes_that_work():
    with pytest.raises(ShardingError, match=r"4 heads \(2 kv heads\) over tp_size=3.*1, 2, 4"):
        prepare_for(tiny_causal_lm("llama"), None, 3)


def test_world_must_equal_tp_size():
    assert tp_world_problem(2, 2) is None and tp_world_problem(1, 4) is None
    assert "needs 2 ranks" in tp_world_problem(2, 1)
    assert "does not fit a world of 3" in tp_world_problem(2, 3)
    assert "data-parallel replicas" in tp_world_problem(2, 4)


def test_init_inference_rejects_unsplittable_heads_before_joining_a_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    model = tiny_causal_lm("llama")
    with pytest.raises(ShardingError, match="tp sizes that would work: 1, 2, 4"):
        shardwise.init_inference(model, device="cpu", tensor_parallel={"tp_size": 3})
    assert not torch.distributed.is_initialized()
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (64, 64)


# ----- slicing on a fake rank ---------------------------------------------------------------------

class Pair(nn.Module):
    def __init__(self, col, row):
        super().__init__()
        self.up, self.down = col, row

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _spec(model, plan, rank, tp=2):
    slice_all(prepare(model, ShardingPlan.from_mapping(plan), tp), rank)
    return model


def _pair(seed, kind):
    torch.manual_seed(seed)
    if kind == "linear":
        return Pair(nn.Linear(8, 12), nn.Linear(12, 8))
    return Pair(Conv1D(12, 8), Conv1D(8, 12))  # Conv1D(nf=out, nx=in), weight [in, out]


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_column_then_row_slices_sum_to_the_whole(kind):
    """rank 0's output + rank 1's output == the unsharded output (what the all-reduce does)."""
    x = torch.randn(3, 8)
    whole = _pair(0, kind)(x)
    shards = [_spec(_pair(0, kind), {"up": "colwise", "down": "rowwise"}, r) for r in (0, 1)]
    assert torch.allclose(shards[0](x) + shards[1](x), whole, atol=1e-6)
    up, down = shards[1].up, shards[1].down
    if kind == "linear":
        assert (up.weight.shape, up.bias.shape, up.out_features) == ((6, 8), (6,), 6)
        assert (down.weight.shape, down.in_features) == ((8, 6), 6)
    else:
        assert (up.weight.shape, up.nf, down.weight.shape, down.nx) == ((8, 6), 6, (6, 8), 6)
    assert torch.count_nonzero(down.bias) == 0  # the row bias is added once, by rank 0
    assert torch.equal(shards[0].down.bias, _pair(0, kind).down.bias)


def test_vocab_parallel_slices_and_ties():
    torch.manual_seed(0)
    model = nn.Module()
    model.emb = nn.Embedding(257, 4, padding_idx=1)
    model.head = nn.Linear(4, 257, bias=False)
    model.head.weight = model.emb.weight
    full = model.emb.weight.detach().clone()
    _spec(model, {"emb": VocabParallelEmbedding(), "head": VocabParallelHead()}, 1)
    assert model.head.weight is model.emb.weight  # still tied
    assert torch.equal(model.emb.weight, full[129:])  # 257 rows → 129 | 128
    assert (model.emb.num_embeddings, model.emb.padding_idx, model.head.out_features) == (
        128, None, 128)


def test_gpt2_fused_qkv_slice_keeps_each_ranks_heads():
    model = tiny_causal_lm("gpt2")
    c_attn = model.transformer.h[0].attn.c_attn
    full = c_attn.weight.detach().clone()  # [64, 192] = [in, q | k | v]
    prepared = prepare_for(model, None, 2)
    spec = next(s for s in prepared.specs if s.name.endswith("h.0.attn.c_attn"))
    slice_module(spec, 1)
    expected = torch.cat([full[:, 32:64], full[:, 96:128], full[:, 160:192]], dim=1)
    assert torch.equal(c_attn.weight, expected) and c_attn.nf == 96


def test_intermediate_size_that_cannot_split_fails_naming_the_module():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=130, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=256)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ShardingError, match=r"model\.layers\.0\.mlp\.gate_proj \(column, output "
                                            r"features\) has size 130.*whole model, tp sizes "
                                            r"that would work: 1, 2$"):
        prepare_for(model, None, 4)


# ----- per-instance config views: attention forwards that read head counts from self.config -----

def _phi3_config():
    return transformers.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   pad_token_id=0)


def test_config_view_overrides_some_attributes_and_reads_the_rest_live():
    import copy
    import pickle

    from shardwise.sharding.apply import ConfigView

    config = _phi3_config()
    view = ConfigView(config, {"num_attention_heads": 2})
    assert view.num_attention_heads == 2 and config.num_attention_heads == 4
    assert view.hidden_size == 64 and view._attn_implementation == config._attn_implementation
    config.sliding_window = 7  # later changes to the shared config reach the view
    assert view.sliding_window == 7
    view.rope_scaling_marker = "x"  # writes of other attributes go to the shared config
    assert config.rope_scaling_marker == "x"
    view.num_attention_heads = 3  # an overridden attribute stays the view's own
    assert (view.num_attention_heads, config.num_attention_heads) == (3, 4)
    for clone in (copy.deepcopy(view), pickle.loads(pickle.dumps(view))):
        assert isinstance(clone, ConfigView) and clone.num_attention_heads == 3
        assert clone.hidden_size == 64
    nested = ConfigView(view, {"num_key_value_heads": 1})  # flattened: one level over config
    assert (nested.num_attention_heads, nested.num_key_value_heads) == (3, 1)
    assert nested._shared is config
    with pytest.raises(AttributeError):
        view.no_such_attribute


def _phi3_attention_output(model, x):
    """Layer 0's attention on ``x`` [batch, seq, hidden] (causal, positions 0..seq-1)."""
    positions = torch.arange(x.shape[1])[None]
    cos_sin = model.model.rotary_emb(x, positions)
    with torch.no_grad():
        return model.model.layers[0].self_attn(x, cos_sin, None)[0]


def test_phi3_attention_slices_on_each_rank_sum_to_the_whole():
    """Fused [q | k | v] split by heads/kv heads, o_proj by heads, and the attention's config
    view with the rank's head counts: the ranks' partial outputs (before the all-reduce) sum to
    the unsharded attention output, and the model's own config is untouched."""
    from shardwise.sharding.apply import ConfigView, set_attention_attrs

    def model():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(_phi3_config()).eval()

    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    whole = _phi3_attention_output(model(), x)
    parts = []
    for rank in (0, 1):
        m = model()
        prepared = prepare_for(m, None, 2)
        slice_all(prepared, rank)
        attrs = set_attention_attrs(prepared, rank)
        assert attrs["model.layers.0.self_attn"]["config.num_attention_heads"] == 2
        attention = m.model.layers[0].self_attn
        assert isinstance(attention.config, ConfigView)
        assert attention.config.num_attention_heads == 2 and m.config.num_attention_heads == 4
        parts.append(_phi3_attention_output(m, x))
    assert torch.allclose(parts[0] + parts[1], whole, atol=1e-5)


def test_policy_naming_a_config_attribute_the_attention_lacks_fails_naming_it():
    from shardwise.policies.phi3 import Phi3Policy

    class Broken(Phi3Policy):
        attention_config_attrs = {"num_attention_heads": "q_heads", "num_q_heads": "q_heads"}

    model = transformers.AutoModelForCausalLM.from_config(_phi3_config())
    with pytest.raises(ShardingError, match=r"sets config\.num_q_heads on attention module "
                                            r"'model\.layers\.0\.self_attn'"):
        prepare_for(model, None, 2, policy=Broken())


# ----- families B: Falcon's grouped q|k|v, head counts by config, BLOOM's ALiBi slices ------------

def test_grouped_interleaved_keeps_each_ranks_q_heads_and_its_groups_k_v():
    from shardwise.sharding import GroupedInterleaved

    def ranges(q, kv, tp, hd=1):
        return [GroupedInterleaved().ranges((q + 2 * kv) * hd, _ctx(r, q, kv, hd, tp), "qkv")
                for r in range(tp)]

    # [kv, (q per kv, k, v), head_dim], head_dim 1 so indices read as rows
    assert ranges(4, 2, 2) == [[(0, 4)], [(4, 8)]]  # whole groups [q q k v] per rank
    assert ranges(7, 1, 2) == [[(0, 4), (7, 9)], [(4, 9)]]  # multi-query: q 4|3, k v on both
    assert ranges(4, 4, 2) == [[(0, 6)], [(6, 12)]]  # groups of one: [heads, (q, k, v)]
    assert ranges(8, 2, 4) == [[(0, 2), (4, 6)], [(2, 6)], [(6, 8), (10, 12)], [(8, 12)]]
    with pytest.raises(ShardingError, match=r"expects 8 \(2 kv heads × \(2 q heads \+ 2\)"):
        GroupedInterleaved().ranges(12, _ctx(0, 4, 2, 1), "qkv")


def _falcon(arch):
    torch.manual_seed(0)
    return tiny_causal_lm(arch)


@pytest.mark.parametrize("arch,counts", [
    ("falcon", (4, 2, 16)),  # new decoder architecture: num_kv_heads
    ("falcon-mqa", (4, 1, 16)),  # multi-query: ONE kv head whatever num_kv_heads says (4)
    ("falcon-7heads-mqa", (7, 1, 16)),
    ("falcon-alibi", (4, 4, 16)),  # multi-head
])
def test_falcon_head_counts_follow_its_layout(arch, counts):
    model = _falcon(arch)
    assert tuple(find_policy("falcon").head_counts(model.config)) == counts


def _falcon_attention_output(model, x):
    """Layer 0's attention (rotary, causal, no mask) before any all-reduce."""
    positions = torch.arange(x.shape[1])[None]
    cos_sin = model.transformer.rotary_emb(x, position_ids=positions)
    with torch.no_grad():
        out, _ = model.transformer.h[0].self_attention(x, alibi=None, attention_mask=None,
                                                       position_embeddings=cos_sin)
    return out


@pytest.mark.parametrize("arch", families(model_type="falcon", positions="rotary"))
def test_falcon_attention_slices_on_each_rank_sum_to_the_whole(arch):
    from shardwise.sharding.apply import set_attention_attrs

    width = _falcon(arch).config.hidden_size
    x = torch.randn(2, 5, width, generator=torch.Generator().manual_seed(3))
    whole = _falcon_attention_output(_falcon(arch), x)
    parts = []
    for rank in (0, 1):
        model = _falcon(arch)
        prepared = prepare_for(model, None, 2)
        slice_all(prepared, rank)
        set_attention_attrs(prepared, rank)
        parts.append(_falcon_attention_output(model, x))  # row-parallel dense: partial sums
    assert torch.allclose(parts[0] + parts[1], whole, atol=1e-5)


def test_head_sliced_input_narrows_folded_and_plain_head_dims():
    from shardwise.sharding import HeadSlicedInput

    heads = HeadPartition.compute(4, 4, 16, 2, 1)  # rank 1: heads 2, 3
    folded = torch.arange(2 * 4 * 3.0).view(8, 1, 3)  # [batch * heads, 1, seq], b * 4 + h
    got = HeadSlicedInput("alibi", dim=0, folded=True).take(folded, heads)
    assert torch.equal(got, folded.view(2, 4, 1, 3)[:, 2:].reshape(4, 1, 3))
    plain = torch.randn(2, 4, 5, 5)  # [batch, heads, q, k]
    assert torch.equal(HeadSlicedInput("mask").take(plain, heads), plain[:, 2:])
    broadcast = torch.randn(2, 1, 5, 5)
    assert HeadSlicedInput("mask").take(broadcast, heads) is broadcast
    assert HeadSlicedInput("alibi").take(None, heads) is None
    with pytest.raises(ShardingError, match=r"'alibi' has shape \(2, 3, 1, 5\); dimension 1 "
                                            r"should hold 4 heads"):
        HeadSlicedInput("alibi").take(torch.randn(2, 3, 1, 5), heads)


def _bloom_attention_output(model, x, alibi, positional=False):
    attention, residual = model.transformer.h[0].self_attention, torch.zeros_like(x)
    with torch.no_grad():  # forward(hidden_states, residual, alibi, attention_mask, ...)
        out, _ = (attention(x, residual, alibi, None) if positional
                  else attention(x, residual, alibi=alibi, attention_mask=None))
    return out


def test_bloom_alibi_is_narrowed_to_each_ranks_heads_by_an_instance_hook():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    from shardwise.sharding.apply import set_attention_attrs
    from shardwise.sharding.inputs import install_head_slicers

    def bloom():
        torch.manual_seed(0)
        return tiny_causal_lm("bloom")

    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(3))
    alibi = build_alibi_tensor(torch.ones(2, 6), 4, torch.float32)  # every head: [8, 1, 6]
    whole = _bloom_attention_output(bloom(), x, alibi)
    parts = []
    for rank in (0, 1):
        model = bloom()
        prepared = prepare_for(model, None, 2)
        assert sorted(prepared.head_sliced) == ["transformer.h.0.self_attention",
                                                "transformer.h.1.self_attention"]
        slice_all(prepared, rank)
        set_attention_attrs(prepared, rank)
        install_head_slicers(prepared.head_sliced, prepared.heads[rank])
        # the full alibi goes in, as a keyword (rank 0) or positionally (rank 1)
        parts.append(_bloom_attention_output(model, x, alibi, positional=rank == 1))
    assert torch.allclose(parts[0] + parts[1], whole, atol=1e-5)
    fresh = bloom().transformer.h[0].self_attention  # the class is untouched
    assert not fresh._forward_pre_hooks


def test_head_sliced_argument_the_forward_lacks_fails_naming_it():
    from shardwise.sharding import HeadSlicedInput

    class Broken(type(find_policy("bloom"))):
        head_sliced_inputs = {"h.*.mlp": (HeadSlicedInput("alibi"),)}  # BloomMLP has no alibi

    with pytest.raises(ShardingError, match=r"slices argument\(s\) alibi of "
                                            r"'transformer\.h\.0\.mlp' \(BloomMLP\)"):
        prepare_for(tiny_causal_lm("bloom"), None, 2, policy=Broken())


# ----- undo: the whole tensor gathered back from every rank's slice -------------------------------

class _GatherOf:
    """A communicator stand-in whose all_gather returns every rank's (given) slice, padded as
    each rank pads its own, concatenated along ``dim``: one process plays all ranks."""

    def __init__(self, slices: list[torch.Tensor]) -> None:
        self.slices = slices

    def all_gather(self, tensor, dim=0):
        width = tensor.shape[dim]
        padded = [torch.cat([s, s.new_zeros(*s.shape[:dim], width - s.shape[dim],
                                            *s.shape[dim + 1:])], dim=dim) for s in self.slices]
        return torch.cat(padded, dim=dim)


@pytest.mark.parametrize("ranges", [
    [[(0, 4)], [(4, 7)]],  # an uneven vocabulary: 4 | 3 rows
    [[(0, 2), (4, 6)], [(2, 4), (6, 8)]],  # a fused [q | k]-like layout, two pieces each
    [[(0, 4)], [(0, 4)]],  # one kv head replicated on both ranks
])
def test_gather_whole_rebuilds_the_tensor_from_every_ranks_slices(ranges):
    from shardwise.sharding import gather_whole

    size = max(b for r in ranges for _, b in r)
    whole = torch.randn(size, 3)
    slices = [torch.cat([whole[a:b] for a, b in r]) for r in ranges]
    comm = _GatherOf(slices)
    for rank in range(2):
        assert torch.equal(gather_whole(slices[rank], 0, ranges, size, comm), whole)
    columns = [s.t().contiguous() for s in slices]  # the split along dim 1
    assert torch.equal(gather_whole(columns[1], 1, ranges, size, _GatherOf(columns)), whole.t())


def test_gather_whole_refuses_slices_that_do_not_cover_the_tensor():
    from shardwise.sharding import ShardingError, gather_whole

    slices = [torch.ones(2, 1), torch.ones(2, 1)]
    with pytest.raises(ShardingError, match="cover 4 of 6 entries"):
        gather_whole(slices[0], 0, [[(0, 2)], [(2, 4)]], 6, _GatherOf(slices))

"""Tensor parallelism for GPT-Neo, GPT-J, GPT-NeoX and Phi-3 (data-only policies in policies/)
on 2 gloo ranks: TP=2 logits match the plain single-process HF model, greedy tokens are identical,
every rank returns the same outputs, each rank holds half of the sharded weights, the plan comes
from the expected source, and the attention attributes follow the split.

What each family exercises:

* ``gpt_neo`` — separate q/k/v without bias, ``out_proj`` with a bias (added once), alternating
  global/local (sliding-window) attention, wte tied to lm_head.
* ``gptj`` — no q/k/v/out biases, partial rotary (``rotary_dim``), attention and MLP in parallel
  from one LayerNorm, lm_head with a bias.
* ``gpt_neox`` — per-head interleaved ``query_key_value`` under HF's own plan (plain ``colwise``
  made faithful by the policy's layout); ``gpt_neox-7heads`` — the same with 7 heads (4 | 3)
  and a vocabulary of 257, where an even split of the fused output would cut heads apart;
  ``gpt_neox-policy-plan`` — the policy's own plan (also sharding ``embed_in``).
* ``phi3`` — fused [q | k | v] (grouped-query) and [gate | up]; HF's ``colwise_gather_output``
  plan defers to the policy; the attention reads its head count from ``self.config``.

All cases run in ONE pair of processes (a module-scoped fixture); each case records its own result
or error and each test asserts on one case.
"""

from __future__ import annotations

import contextlib
import re

import pytest

import shardwise
from families import families
from models import tiny_causal_lm
from shardwise.policies.gpt_neox import GPTNeoXPolicy
from shardwise.policy import find_policy
from shardwise.sharding import HeadPartition, PerHeadInterleaved, ShardContext, prepare_for
from tp_harness import assert_parity, case, hf_case, run_cases, run_pair

#: family → the policy class name registered for its model_type
POLICIES = {"gpt_neo": "GPTNeoPolicy", "gptj": "GPTJPolicy", "gpt_neox": "GPTNeoXPolicy",
            "phi3": "Phi3Policy"}


# ----- what each rank runs ------------------------------------------------------------------------

@contextlib.contextmanager
def _capturing_engines():
    """Record the engines ``shardwise.init_inference`` returns inside the block (hf_case keeps
    its engine to itself; the attention checks need the sharded modules)."""
    engines, real = [], shardwise.init_inference

    def init_inference(*args, **kwargs):
        engines.append(real(*args, **kwargs))
        return engines[-1]

    shardwise.init_inference = init_inference
    try:
        yield engines
    finally:
        shardwise.init_inference = real


def _generic(name: str) -> str:
    """``gpt_neox.layers.1.attention`` → ``gpt_neox.layers.*.attention``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _attention_state(engine) -> dict:
    """Per attention pattern: the attributes the report says were set, and the values the live
    modules hold (``config.X`` read through the module's config), which must agree across
    layers; plus per sharded pattern its weight shape on this rank, and the model config's head
    count (which sharding must not change)."""
    model, report = engine.module, engine.sharding
    reported, live = {}, {}
    for name, values in report.attention.items():
        module = model.get_submodule(name)
        held = {attr: (getattr(module.config, attr[len("config."):]) if attr.startswith("config.")
                       else getattr(module, attr)) for attr in values}
        for table, value in ((reported, values), (live, held)):
            previous = table.setdefault(_generic(name), value)
            assert previous == value, f"{name}: {value} differs from another layer's {previous}"
    shapes = {_generic(n): list(m.shape_after) for n, m in report.sharded.items()}
    heads = getattr(model.config, "num_attention_heads", None)
    return dict(reported_attrs=reported, live_attrs=live, shapes=shapes, config_heads=heads,
                notes=list(report.notes))


def _family_case(rank: int, arch: str, **kwargs) -> dict:
    """:func:`hf_case` (parity, tokens, bytes, plan) plus :func:`_attention_state`."""
    with _capturing_engines() as engines:
        result = hf_case(rank, arch, **kwargs)
    return {**result, **_attention_state(engines[-1])}


def _cases(rank: int) -> dict:
    """Case name → what this rank runs for it."""
    neox_plan = dict(GPTNeoXPolicy.tp_plan)  # {pattern: Role}: passed as a user's plan
    return {
        "gpt_neo": lambda: _family_case(rank, "gpt_neo"),
        "gptj": lambda: _family_case(rank, "gptj"),
        "gpt_neox": lambda: _family_case(rank, "gpt_neox"),
        "phi3": lambda: _family_case(rank, "phi3"),
        # the eager attention path too (the default is SDPA): both read num_key_value_groups
        "phi3-eager": lambda: _family_case(rank, "phi3", attention="eager"),
        "gpt_neox-7heads": lambda: _family_case(rank, "gpt_neox-7heads", even=False),
        "gpt_neox-policy-plan": lambda: _family_case(rank, "gpt_neox",
                                                     injection_policy=neox_plan),
    }


def _run_all(rank: int) -> dict:
    return run_cases(rank, _cases(rank))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_pair(_run_all, tmp_path_factory.mktemp("tp_families_a"))


# ----- the tests ----------------------------------------------------------------------------------

#: the TP=2 families of these model types (tests/families.py), and the cases of their own
FAMILIES = families(tp=True, model_type=list(POLICIES))
PARITY = [*FAMILIES, "phi3-eager", "gpt_neox-policy-plan"]
EVEN = [*families(tp_even=True, model_type=list(POLICIES)), "gpt_neox-policy-plan"]


@pytest.mark.slow
@pytest.mark.parametrize("name", PARITY)
def test_tp2_matches_the_single_process_model(ranks, name):
    assert_parity(ranks, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", EVEN)
def test_each_rank_holds_half_of_the_sharded_weights(ranks, name):
    r0, r1 = case(ranks, name)
    assert r0["rank_bytes"] == r1["rank_bytes"]
    assert r0["rank_bytes"][0] == r0["rank_bytes"][1]  # even split: the same on both ranks
    for rank, r in enumerate((r0, r1)):
        assert r["rank_bytes"][rank] == r["counted_bytes"]  # the report counts what is there
        assert r["counted_bytes"] == r["expected_bytes"], r["summary"]


def _hf_plan(model_type: str) -> dict:
    """The installed transformers' base_model_tp_plan of a family (it grows between releases:
    5.x added GPT-J's and the embedding rows)."""
    from transformers import AutoConfig

    return dict(AutoConfig.for_model(model_type).base_model_tp_plan or {})


def _embedding_row(model_type: str) -> dict:
    """The vocab_embedding role when the family's HF plan splits the input embedding."""
    return ({"vocab_embedding": 1} if "embedding_rowwise" in _hf_plan(model_type).values()
            else {})


#: case → (plan source, roles, lm_head tied to the input embedding)
PLANS = {
    "gpt_neo": ("policy:gpt_neo", {"column": 8, "row": 4, "vocab_embedding": 1,
                                   "vocab_head": 1}, True),
    # HF's plan where the installed transformers has one, else the policy's: the same roles
    "gptj": ("hf_tp_plan" if _hf_plan("gptj") else "policy:gptj",
             {"column": 8, "row": 4, "vocab_embedding": 1, "vocab_head": 1}, False),
    # HF's base_model_tp_plan (an embedding row from transformers 5.x) + the class's lm_head row
    "gpt_neox": ("hf_tp_plan", {"column": 4, "row": 4, **_embedding_row("gpt_neox"),
                                "vocab_head": 1}, False),
    "gpt_neox-policy-plan": ("injection_policy", {"column": 4, "row": 4, "vocab_embedding": 1,
                                                  "vocab_head": 1}, False),
    "phi3": ("policy:phi3", {"column": 4, "row": 4, "vocab_embedding": 1, "vocab_head": 1},
             False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_plan_sources_roles_and_ties(ranks, name):
    source, roles, tied = PLANS[name]
    r0, _ = case(ranks, name)
    assert r0["source"] == source
    assert r0["roles"] == roles
    assert r0["tied"] is tied


@pytest.mark.slow
def test_phi3_hf_plan_defers_to_the_policy_with_a_note(ranks):
    r0, _ = case(ranks, "phi3")
    assert any("qkv_proj: colwise_gather_output" in n for n in r0["notes"]), r0["notes"]


#: case → per rank: the attention attributes set (by attention pattern)
ATTRIBUTES = {
    "gpt_neo": [{"transformer.h.*.attn.attention": {"num_heads": 2, "embed_dim": 32}}] * 2,
    "gptj": [{"transformer.h.*.attn": {"num_attention_heads": 2, "embed_dim": 32}}] * 2,
    "gpt_neox": [{"gpt_neox.layers.*.attention": {"head_size": 16}}] * 2,
    "gpt_neox-7heads": [{"gpt_neox.layers.*.attention": {"head_size": 16}}] * 2,
    "phi3": [{"model.layers.*.self_attn": {
        "num_key_value_heads": 1, "num_key_value_groups": 2,
        "config.num_attention_heads": 2, "config.num_key_value_heads": 1}}] * 2,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ATTRIBUTES))
def test_attention_attributes_follow_the_split(ranks, name):
    for rank, r in enumerate(case(ranks, name)):
        assert r["reported_attrs"] == ATTRIBUTES[name][rank]
        assert r["live_attrs"] == ATTRIBUTES[name][rank]  # what the HF forward will read
        assert r["config_heads"] == {"gpt_neox-7heads": 7}.get(name, 4)  # model config intact


@pytest.mark.slow
def test_uneven_heads_keep_whole_interleaved_head_blocks(ranks):
    r0, r1 = case(ranks, "gpt_neox-7heads")
    assert [r0["heads"], r1["heads"]] == [[4, 4], [3, 3]]
    qkv, dense = "gpt_neox.layers.*.attention.query_key_value", "gpt_neox.layers.*.attention.dense"
    # [heads × 3 × 16, 112]: 4 | 3 whole head blocks, not 168 | 168
    assert [r0["shapes"][qkv], r1["shapes"][qkv]] == [[192, 112], [144, 112]]
    assert [r0["shapes"][dense], r1["shapes"][dense]] == [[112, 64], [112, 48]]
    assert [r0["shapes"]["lm_head"], r1["shapes"]["lm_head"]] == [[129, 112], [128, 112]]


# ----- without processes --------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", list(POLICIES))
def test_policies_are_registered_for_their_model_types(model_type):
    policy = find_policy(model_type)
    assert type(policy).__name__ == POLICIES[model_type]
    assert type(policy).__module__ == f"shardwise.policies.{model_type}"


def test_interleaved_layout_keeps_whole_head_blocks_for_uneven_heads():
    ctx = [ShardContext(2, r, HeadPartition.compute(7, 7, 16, 2, r)) for r in (0, 1)]
    layout = PerHeadInterleaved(per_head=3)
    assert [layout.ranges(336, c) for c in ctx] == [[(0, 192)], [(192, 336)]]


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_rank_slice_together_covers_each_weight_once(arch):
    """Across the ranks, each sharded module's kept indices along its split dimension are
    disjoint and cover it whole (what the all-reduce / all-gather afterwards relies on)."""
    prepared = prepare_for(tiny_causal_lm(arch), None, 2)
    for spec in prepared.specs:
        kept = sorted(i for ranges in spec.ranges for a, b in ranges for i in range(a, b))
        assert kept == list(range(spec.size)), spec.name


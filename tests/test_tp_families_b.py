"""Tensor parallelism for BLOOM, Falcon and BERT (data-only policies in policies/) on 2 gloo
ranks: TP=2 outputs match the plain single-process HF model, greedy tokens are identical for the
causal LMs, every rank returns the same outputs, each rank holds half of the sharded weights where
the split is even, and the plan comes from the family's policy.

What each case exercises:

* ``bloom`` — per-head interleaved ``query_key_value`` [heads, 3, head_dim], the embedding
  LayerNorm, tied lm_head, and ALiBi: the model builds the bias for all heads, each rank's
  attention must see its own heads' slopes (``bloom-alibi``: the slopes each rank's attention
  receives; with the slicing hooks removed the forward fails, and with every rank given the first
  heads' slopes the logits are wrong — so the parity tests would catch a missing or wrong slice).
* ``falcon`` — new decoder architecture: [kv groups, (q heads, k, v), head_dim], two LayerNorms,
  biases; ``falcon-mqa`` — multi-query [q | k | v] (the kv head on both ranks), parallel
  attention; ``falcon-7heads-mqa`` — 7 heads split 4 | 3 (Falcon-7B's 71 heads do not split
  evenly either); ``falcon-alibi`` — multi-head [heads, 3, head_dim], sequential, ALiBi folded
  into the 4-D mask (SDPA and eager).
* ``bert`` — encoder with separate query/key/value, padded batch (non-causal mask): the MLM
  logits and last hidden state (``BertForMaskedLM``, decoder tied to the vocab-parallel word
  embeddings) and the bare ``BertModel`` (last hidden state, pooler).

All cases run in ONE pair of processes (a module-scoped fixture); each case records its own
result or error and each test asserts on one case.
"""

from __future__ import annotations

import pytest
import torch

import shardwise
from families import families, family
from models import prompt_ids, tiny_causal_lm, tiny_encoder
from shardwise.policy import find_policy
from shardwise.sharding import HeadSlicedInput, shard_model
from tp_harness import (ATOL, NEW_TOKENS, TP, _expected_rank_bytes, assert_parity,
                        with_random_biases, case, digest, hf_case, run_cases, run_pair)

#: BERT's hidden states and MLM logits (fp32): measured ≤ 4.8e-7 (bert-mlm last_hidden_state)
BERT_ATOL = family("bert").tolerances["tp_fp32"]  # 1e-6 (tests/families.py)
CAUSAL = families(kind="causal", tp=True, model_type=("bloom", "falcon"))  # tests/families.py
POLICIES = {"bloom": "BloomPolicy", "falcon": "FalconPolicy", "bert": "BertPolicy"}


# ----- BLOOM's ALiBi: what each rank's attention sees, and what goes wrong without the slice -----

class _FirstHeads(HeadSlicedInput):
    """A wrong slice on purpose: every rank gets the FIRST heads' entries (rank 0's slopes)."""

    def head_range(self, heads):
        return heads.num_heads, 0, heads.q_heads


def _bloom_variant(head_sliced_inputs):
    """The BLOOM policy with other head_sliced_inputs (a subclass: data only)."""
    return type("BloomVariant", (type(find_policy("bloom")),),
                {"head_sliced_inputs": head_sliced_inputs})()


def _bloom_alibi_case(rank: int) -> dict:
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    ref, model = (with_random_biases(tiny_causal_lm("bloom")) for _ in range(2))
    ids = prompt_ids(batch=2, length=8)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the alibi is then built from the mask (build_alibi_tensor)
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).logits
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32, **TP)
    seen = {}
    attn = model.transformer.h[0].self_attention  # registered after the slicer: sees its output
    attn.register_forward_pre_hook(lambda m, a, kw: seen.update(alibi=kw["alibi"]),
                                   with_kwargs=True)
    with torch.no_grad():
        logits = engine(input_ids=ids, attention_mask=mask).logits
    heads = attn.num_heads
    # alibi [batch * heads, 1, seq] = slope × position; row 0 is unpadded: position 1 → the slope
    slopes = seen["alibi"].view(2, heads, -1)[0, :, 1]
    keep = mask.bool()
    out = dict(max_abs=(logits - expected)[keep].abs().max().item(), digest=digest(logits),
               heads=heads, slopes=slopes.tolist(),
               all_slopes=_get_alibi_slopes(model.config.n_head, torch.device("cpu")).tolist())
    # the same model with no slicing hooks: the attention gets every head's alibi
    bare = tiny_causal_lm("bloom")
    shard_model(bare, communicator=engine.communicator, policy=_bloom_variant({}))
    try:
        with torch.no_grad():
            bare(ids)
        out["unsliced_error"] = None
    except RuntimeError as exc:
        out["unsliced_error"] = str(exc)
    # every rank given the first heads' slopes: runs, but the logits are wrong
    wrong = with_random_biases(tiny_causal_lm("bloom"))
    shard_model(wrong, communicator=engine.communicator, policy=_bloom_variant(
        {"h.*.self_attention": (_FirstHeads("alibi", dim=0, folded=True),)}))
    with torch.no_grad():
        out["wrong_slopes_max_abs"] = (wrong(ids, attention_mask=mask).logits
                                       - expected)[keep].abs().max().item()
    return out


# ----- BERT: an encoder, compared on its outputs (no generate) ------------------------------------

def _bert_case(rank: int, head: str) -> dict:
    ref, model = (with_random_biases(tiny_encoder("bert", head=head)) for _ in range(2))
    ids = prompt_ids(batch=2, length=8, vocab=ref.config.vocab_size)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # right padding: the non-causal mask must keep working on split heads
    inputs = dict(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    with torch.no_grad():
        expected = ref(**inputs)
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32, **TP)
    mine = inputs if rank == 0 else {**inputs, "input_ids": torch.zeros_like(ids),
                                     "attention_mask": torch.zeros_like(mask)}
    with torch.no_grad():
        got = engine(**mine)
    keep = mask.bool()
    diffs = {"last_hidden_state": (got.hidden_states[-1] - expected.hidden_states[-1])[keep]}
    if head == "masked_lm":
        diffs["logits"] = (got.logits - expected.logits)[keep]
    else:
        diffs["pooler_output"] = got.pooler_output - expected.pooler_output
    report = engine.sharding
    attn = model.bert.encoder.layer[0].attention.self if head == "masked_lm" \
        else model.encoder.layer[0].attention.self
    return dict(
        max_abs={k: d.abs().max().item() for k, d in diffs.items()},
        digest=digest(got.logits if head == "masked_lm" else got.last_hidden_state),
        source=report.source, roles=dict(report.roles()), heads=report.heads,
        attn=[attn.num_attention_heads, attn.all_head_size, attn.attention_head_size],
        rank_bytes=report.rank_param_bytes,
        counted_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        expected_bytes=_expected_rank_bytes(ref, report), summary=report.summary(),
        tied=model.get_output_embeddings().weight is model.get_input_embeddings().weight
        if head == "masked_lm" else None)


# ----- the pair -----------------------------------------------------------------------------------

#: causal case → hf_case keyword arguments (``even``: each rank holds exactly half)
CAUSAL_ARGS = {
    "bloom": dict(arch="bloom"),
    "falcon": dict(arch="falcon"),
    "falcon-mqa": dict(arch="falcon-mqa"),  # k, v replicated: see its own bytes test
    "falcon-7heads-mqa": dict(arch="falcon-7heads-mqa", even=False),
    "falcon-alibi": dict(arch="falcon-alibi"),
    "falcon-alibi-eager": dict(arch="falcon-alibi-eager"),  # eager: alibi viewed per head
}


def _cases(rank: int) -> dict:
    cases = {name: (lambda kw=kw: hf_case(rank, **kw)) for name, kw in CAUSAL_ARGS.items()}
    cases["bloom-alibi"] = lambda: _bloom_alibi_case(rank)
    cases["bert-mlm"] = lambda: _bert_case(rank, "masked_lm")
    cases["bert-base"] = lambda: _bert_case(rank, "base")
    return cases


def _run_all(rank: int) -> dict:
    return run_cases(rank, _cases(rank))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_pair(_run_all, tmp_path_factory.mktemp("tp_b"))


# ----- the tests ----------------------------------------------------------------------------------

def test_policies_are_registered():
    for model_type, cls in POLICIES.items():
        policy = find_policy(model_type)
        assert policy is not None and type(policy).__name__ == cls, model_type


@pytest.mark.slow
@pytest.mark.parametrize("name", CAUSAL)
def test_tp2_matches_the_single_process_model(ranks, name):
    r0, r1 = assert_parity(ranks, name)  # tokens equal across ranks included
    for r in (r0, r1):
        assert r["tied"] is True, "lm_head and the word embeddings are no longer one Parameter"
    assert r0["sampled"] == r1["sampled"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CAUSAL)
def test_plan_comes_from_the_family_policy(ranks, name):
    r0, _ = case(ranks, name)
    family = name.split("-")[0]
    assert r0["source"] == f"policy:{family}"
    assert r0["roles"] == {"column": 4, "row": 4, "vocab_embedding": 1, "vocab_head": 1}


@pytest.mark.slow
@pytest.mark.parametrize("name", [*families(kind="causal", tp_even=True,
                                           model_type=("bloom", "falcon")), "bert-base"])
def test_each_rank_holds_half_of_the_sharded_weights(ranks, name):
    r0, r1 = case(ranks, name)
    assert r0["rank_bytes"] == r1["rank_bytes"]
    for rank, r in enumerate((r0, r1)):
        assert r["rank_bytes"][rank] == r["counted_bytes"]
        assert r["counted_bytes"] == r["expected_bytes"], r["summary"]


@pytest.mark.slow
def test_bert_mlm_holds_half_but_for_the_aliased_decoder_bias(ranks):
    # HF ties cls.predictions.decoder.bias to cls.predictions.bias (one Parameter); the decoder
    # gets its vocab slice, the alias (unused by the forward) keeps the whole [256] fp32 copy
    for rank, r in enumerate(case(ranks, "bert-mlm")):
        assert r["rank_bytes"][rank] == r["counted_bytes"]
        assert r["counted_bytes"] == r["expected_bytes"] + 256 * 4, r["summary"]


@pytest.mark.slow
def test_multi_query_keeps_the_kv_head_on_both_ranks(ranks):
    # per layer, query_key_value [(4 + 2) × 16, 64] keeps its 2 q heads + k + v on each rank:
    # (2 + 2) × 16 rows instead of half of 6 × 16, i.e. 16 × 64 fp32 more (no biases), 2 layers
    kv_extra = 2 * 16 * 64 * 4
    for rank, r in enumerate(case(ranks, "falcon-mqa")):
        assert r["heads"] == [2, 1]
        assert r["counted_bytes"] == r["rank_bytes"][rank]
        assert r["counted_bytes"] == r["expected_bytes"] + kv_extra, r["summary"]
    heads = [case(ranks, "falcon-7heads-mqa")[r]["heads"] for r in (0, 1)]
    assert heads == [[4, 1], [3, 1]]  # 7 heads: 4 | 3, the one kv head replicated


@pytest.mark.slow
def test_bloom_alibi_slopes_follow_each_ranks_heads(ranks):
    r0, r1 = case(ranks, "bloom-alibi")
    slopes = r0["all_slopes"]  # 4 heads: 1/4, 1/16, 1/64, 1/256
    assert r0["heads"] == r1["heads"] == 2
    assert r0["slopes"] == pytest.approx(slopes[:2]) and r1["slopes"] == pytest.approx(slopes[2:])
    print(f"bloom-alibi TP=2 fp32 (left-padded): max |logit diff| "
          f"{max(r0['max_abs'], r1['max_abs']):.2e}")
    for r in (r0, r1):  # padded batch: the alibi built from the mask is sliced too
        assert r["max_abs"] < ATOL
    assert r0["digest"] == r1["digest"]


@pytest.mark.slow
def test_bloom_without_the_alibi_slice_fails_and_with_wrong_slopes_differs(ranks):
    for r in case(ranks, "bloom-alibi"):
        assert r["unsliced_error"], "an unsliced alibi (every head's) ran on half the heads"
        assert r["wrong_slopes_max_abs"] > 10 * ATOL  # rank 1's heads with rank 0's slopes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-mlm", "bert-base"])
def test_bert_outputs_match_the_single_process_model(ranks, name):
    r0, r1 = case(ranks, name)
    print(f"{name} TP=2 fp32: max |diff| {r0['max_abs']} | {r1['max_abs']}")
    for r in (r0, r1):
        for what, diff in r["max_abs"].items():
            assert diff < BERT_ATOL, f"{name}: {what} differs by {diff:.2e}\n{r['summary']}"
        assert r["source"] == "policy:bert" and r["heads"] == [2, 2]
        assert r["attn"] == [2, 32, 16]  # num_attention_heads, all_head_size, head size
    assert r0["digest"] == r1["digest"], "ranks returned different outputs"
    expected_roles = {"column": 8, "row": 4, "vocab_embedding": 1}  # q, k, v, up × 2
    if name == "bert-mlm":
        expected_roles["vocab_head"] = 1
        assert r0["tied"] is True
    assert r0["roles"] == expected_roles

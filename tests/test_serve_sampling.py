"""The serving sampler (shardwise.serve.sampling): greedy is transformers' greedy pick, a seed
makes a stream repeat and ``index`` makes the ``n`` choices differ, ``top_p`` keeps exactly the
nucleus (the set transformers' TopPLogitsWarper keeps), the penalties follow OpenAI's formula,
log-probabilities are ``log_softmax`` of the penalised logits."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import TopPLogitsWarper

from models import prompt_ids, tiny_causal_lm
from shardwise.serve.sampling import Sampler, draw, nucleus
from shardwise.serve.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=16, **kwargs)


def stream(sampler: Sampler, logits: torch.Tensor, steps: int) -> list[int]:
    return [sampler.sample(logits).token_id for _ in range(steps)]


def logits_of(probs: list[float], order: list[int]) -> torch.Tensor:
    """Logits [len(probs)] whose softmax puts ``probs[i]`` on token ``order[i]``."""
    out = torch.empty(len(probs))
    out[torch.tensor(order)] = torch.tensor(probs).log()
    return out


# ----- greedy ------------------------------------------------------------------------------------

def test_greedy_is_argmax_and_ties_go_to_the_lowest_id():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1000, generator=g)
        assert Sampler(params(temperature=0.0)).sample(logits).token_id == int(logits.argmax())
    tied = torch.zeros(10)
    tied[[7, 3, 8]] = 5.0
    assert Sampler(params(temperature=0.0)).sample(tied).token_id == 3


def test_greedy_equals_transformers_generate():
    model = tiny_causal_lm("llama")
    ids = prompt_ids(length=6)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
        expected = expected[0, ids.shape[1]:].tolist()
        sampler, seq = Sampler(params(temperature=0.0)), ids
        for _ in expected:
            token = sampler.sample(model(seq).logits[0, -1].float()).token_id
            seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
    assert seq[0, ids.shape[1]:].tolist() == expected


def test_padded_vocab_columns_are_never_picked():
    logits = torch.zeros(64)
    logits[60:] = 100.0                               # padding past the tokenizer's 50 ids
    assert Sampler(params(temperature=0.0), vocab_size=50).sample(logits).token_id < 50
    assert all(t < 50 for t in stream(Sampler(params(seed=0), vocab_size=50), logits, 50))
    with pytest.raises(ValueError, match="fewer than the tokenizer's vocab_size"):
        Sampler(params(), vocab_size=65).sample(logits)


# ----- seeds -------------------------------------------------------------------------------------

def test_a_seed_repeats_the_stream_and_index_changes_it():
    logits = torch.zeros(1000)                        # uniform: streams collide by chance rarely
    first = stream(Sampler(params(seed=1234)), logits, 40)
    assert stream(Sampler(params(seed=1234)), logits, 40) == first
    other = stream(Sampler(params(seed=1234), index=1), logits, 40)
    assert sum(a == b for a, b in zip(first, other)) < 5
    assert stream(Sampler(params(seed=1234), index=1), logits, 40) == other
    # the seed of choice ``index`` is seed + index: choice 1 of seed s is choice 0 of seed s + 1
    assert stream(Sampler(params(seed=1235)), logits, 40) == other


def test_without_a_seed_streams_differ_and_the_global_rng_is_untouched():
    logits = torch.zeros(1000)
    state = torch.get_rng_state()
    a, b = (stream(Sampler(params()), logits, 40) for _ in range(2))
    assert sum(x == y for x, y in zip(a, b)) < 5
    assert torch.equal(torch.get_rng_state(), state)


def test_samples_follow_softmax_of_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    draws = 4000
    for temperature in (0.5, 1.0, 2.0):
        tokens = torch.tensor(stream(Sampler(params(temperature=temperature, seed=7)), logits,
                                     draws))
        freq = torch.bincount(tokens, minlength=4).float() / draws
        expected = torch.softmax(logits / temperature, -1)
        # 4 binomial standard deviations at most
        tolerance = 4 * (expected * (1 - expected) / draws).sqrt() + 1e-3
        assert ((freq - expected).abs() <= tolerance).all(), (temperature, freq, expected)


def test_draw_never_picks_zero_weight_entries():
    g = torch.Generator().manual_seed(3)
    weights = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    picked = {draw(weights, g) for _ in range(500)}
    assert picked == {1, 3}


def test_draw_on_the_last_edge_still_avoids_zero_weight_entries(monkeypatch):
    # a uniform number that rounds up to the total (u == cdf[-1]) is past every bucket
    weights = torch.tensor([0.3, 0.7, 0.0, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1))
    assert draw(weights, torch.Generator()) == 1


# ----- top_p -------------------------------------------------------------------------------------

@pytest.mark.parametrize("top_p, kept", [(0.4, [9]), (0.7, [9, 2]), (0.85, [9, 2, 5]),
                                         (0.99, [9, 2, 5, 0]), (0.0, [9])])
def test_top_p_keeps_exactly_the_nucleus(top_p, kept):
    probs = [0.5, 0.3, 0.15, 0.05]
    order = [9, 2, 5, 0]                              # token ids of probs, most likely first
    full = torch.full((12,), 0.0)
    full[torch.tensor(order)] = torch.tensor(probs)
    values, ids = nucleus(full, top_p)
    assert ids.tolist() == kept and values.tolist() == pytest.approx(probs[:len(kept)])
    sampler = Sampler(params(top_p=top_p, seed=5))
    seen = set(stream(sampler, logits_of(probs + [0.0] * 8, order + [1, 3, 4, 6, 7, 8, 10, 11]),
                      400))
    assert seen == set(kept)


def test_a_nucleus_reaching_top_p_exactly_stops_there():
    # powers of two: the sums are exact, so "mass ≥ top_p" is tested at its boundary
    probs = torch.tensor([0.25, 0.5, 0.125, 0.125])
    assert nucleus(probs, 0.5)[1].tolist() == [1]
    assert nucleus(probs, 0.75)[1].tolist() == [1, 0]
    assert len(nucleus(probs, 0.875)[1]) == 3 and len(nucleus(probs, 1.0)[1]) == 4
    warped = TopPLogitsWarper(0.75)(None, probs.log()[None])[0]
    assert torch.nonzero(warped > -math.inf).flatten().tolist() == [0, 1]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.95])
def test_nucleus_is_what_transformers_top_p_warper_keeps(temperature, top_p):
    # a large vocabulary, peaked and flat, so the search for k grows past its first guesses
    g = torch.Generator().manual_seed(int(temperature * 10 + top_p * 100))
    logits = torch.randn(49152, generator=g) * 3 / temperature
    warped = TopPLogitsWarper(top_p)(None, logits[None])[0]
    expected = set(torch.nonzero(warped > -math.inf).flatten().tolist())
    _, ids = nucleus(torch.softmax(logits, -1), top_p)
    assert set(ids.tolist()) == expected


# ----- penalties ---------------------------------------------------------------------------------

def test_penalties_follow_openai_formula():
    presence, frequency = 0.7, 0.4
    vocab = 6
    sampler = Sampler(params(temperature=1.0, seed=11, logprobs=vocab, presence_penalty=presence,
                             frequency_penalty=frequency))
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0])
    counts = torch.zeros(vocab)
    for _ in range(30):
        event = sampler.sample(logits)
        penalised = logits - counts * frequency - (counts > 0).float() * presence
        expected = torch.log_softmax(penalised, -1)
        reported = dict(event.top_logprobs)
        assert [reported[j] for j in range(vocab)] == pytest.approx(expected.tolist(), abs=1e-6)
        counts[event.token_id] += 1
    assert counts.sum() == 30 and (counts > 0).sum() > 1
    assert sampler.counts == {j: int(c) for j, c in enumerate(counts.tolist()) if c}


def test_greedy_with_a_frequency_penalty_moves_off_a_repeated_token():
    logits = torch.tensor([1.0, 0.9, 0.0])
    tokens = stream(Sampler(params(temperature=0.0, frequency_penalty=0.3)), logits, 4)
    # 1.0 > 0.9 → 0;  0.7 < 0.9 → 1;  0.7 > 0.6 → 0;  0.4 < 0.6 → 1
    assert tokens == [0, 1, 0, 1]
    assert stream(Sampler(params(temperature=0.0)), logits, 4) == [0, 0, 0, 0]


def test_negative_presence_penalty_encourages_repeats():
    logits = torch.tensor([1.0, 0.9])
    tokens = stream(Sampler(params(temperature=0.0, presence_penalty=-2.0)), logits, 3)
    assert tokens == [0, 0, 0]
    tokens = stream(Sampler(params(temperature=0.0, presence_penalty=0.2)), logits, 3)
    assert tokens == [0, 1, 0]                        # 1.0 > 0.9;  0.8 < 0.9;  0.8 > 0.7


# ----- log-probabilities -------------------------------------------------------------------------

def test_logprobs_are_log_softmax_before_temperature_most_likely_first():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(500, generator=g) * 2
    expected = torch.log_softmax(logits, -1)
    for temperature, top_p in ((0.0, 1.0), (0.6, 0.9), (1.7, 1.0)):
        event = Sampler(params(temperature=temperature, top_p=top_p, seed=3, logprobs=5)
                        ).sample(logits)
        assert event.logprob == pytest.approx(expected[event.token_id].item(), abs=1e-6)
        ids = [i for i, _ in event.top_logprobs]
        values = [v for _, v in event.top_logprobs]
        assert ids == expected.argsort(descending=True)[:5].tolist()
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(expected[ids].tolist(), abs=1e-6)
        if temperature == 0.0:
            assert event.top_logprobs[0][0] == event.token_id


def test_logprobs_none_zero_and_more_than_the_vocabulary():
    logits = torch.tensor([0.0, 1.0, 2.0])
    plain = Sampler(params(temperature=0.0)).sample(logits)
    assert plain.logprob is None and plain.top_logprobs is None
    only_chosen = Sampler(params(temperature=0.0, logprobs=0)).sample(logits)
    assert only_chosen.top_logprobs == () and only_chosen.logprob == pytest.approx(
        torch.log_softmax(logits, -1)[2].item())
    assert len(Sampler(params(temperature=0.0, logprobs=20)).sample(logits).top_logprobs) == 3


# ----- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, message", [(dict(temperature=-0.1), "temperature must be ≥ 0"),
                                          (dict(top_p=1.5), "top_p must be in"),
                                          (dict(logprobs=-1), "logprobs must be")])
def test_bad_parameters_are_refused_at_construction(bad, message):
    with pytest.raises(ValueError, match=message):
        Sampler(params(**bad))


def test_batched_logits_are_refused_with_a_hint():
    with pytest.raises(ValueError, match=r"pass logits\[i\]"):
        Sampler(params()).sample(torch.zeros(2, 10))


@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 1.0), (1.0, 0.9)])
def test_nan_or_all_minus_inf_logits_are_an_error_not_a_token(temperature, top_p):
    for broken in (torch.full((10,), math.nan), torch.full((10,), -math.inf)):
        with pytest.raises(ValueError, match="no token can be picked"):
            Sampler(params(temperature=temperature, top_p=top_p, seed=0)).sample(broken)


def test_the_callers_logits_are_not_modified():
    logits = torch.tensor([1.0, 0.5, 0.2])
    before = logits.clone()
    sampler = Sampler(params(temperature=0.5, seed=0, presence_penalty=1.0, frequency_penalty=1.0,
                             top_p=0.8, logprobs=2))
    stream(sampler, logits, 5)
    assert torch.equal(logits, before)


# ----- a decode step's rows at once (sample_rows) ------------------------------------------------

def test_sample_rows_equals_each_rows_own_sample_and_isolates_a_garbage_row():
    """The plain greedy rows are picked together, the others one by one: every row gets what
    its sampler alone would give (ties to the lowest id, padded columns cut), a NaN row fails
    alone, and each greedy sampler counts its token."""
    from shardwise.serve.sampling import sample_rows

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g)
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1.0    # a tie: 7 wins
    logits[2, 35:] = 100.0                                   # padded columns past vocab 32
    logits[4] = float("nan")                                 # garbage
    kinds = [params(temperature=0.0), params(temperature=0.0), params(temperature=0.0),
             params(temperature=0.0, logprobs=2), params(temperature=0.0),
             params(temperature=0.7, seed=5)]
    fresh = lambda: [Sampler(p, 0, vocab_size=32) for p in kinds]  # noqa: E731
    batched, alone = fresh(), fresh()
    out = sample_rows(batched, logits)
    for i, (event, sampler) in enumerate(zip(out, alone)):
        if i == 4:
            assert isinstance(event, ValueError) and "NaN" in str(event)
            with pytest.raises(ValueError, match="NaN"):
                sampler.sample(logits[i])
            continue
        assert event == sampler.sample(logits[i]), i
        assert batched[i].counts == {event.token_id: 1}
    assert out[1].token_id == 7 and out[2].token_id < 32
    assert [s.batchable for s in batched] == [True, True, True, False, True, False]

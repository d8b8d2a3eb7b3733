"""shardwise's own decode loop for ``engine.generate`` on injected decoders
(:mod:`shardwise.inject.decode_loop`): the same tensor as Hugging Face's ``generate`` — greedy
against the plain HF model, sampling against HF's loop on the same engine with the same seed —,
the same streamer calls, left padding, eos stopping mid-batch, ``min_new_tokens``; every
setting it does not implement runs HF's ``generate`` instead, and the fast loop is really taken
otherwise (counted)."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import TemperatureLogitsWarper
from transformers.generation.stopping_criteria import MaxLengthCriteria
from transformers.generation.streamers import BaseStreamer

import shardwise
from shardwise.inject import decode_loop

from gpu import cuda_accelerator
from models import prompt_ids, tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")

#: families checked greedy against HF, eagerly: dense rotary, learned positions, OPT's
#: positions from the mask, ALiBi, and an MoE family
FAMILIES = ["llama", "gpt2", "opt", "bloom", "mixtral"]
#: families also checked with the captured decode step (compiling is slow on the CPU)
GRAPH_FAMILIES = ["llama", "mixtral"]
NEW = 12


def _engine(arch: str, graphs: bool = False, **kwargs):
    return shardwise.init_inference(tiny_causal_lm(arch, **kwargs), device="cpu",
                                    replace_with_kernel_inject=True, enable_graph=graphs)


@pytest.fixture(scope="module")
def engines():
    """(arch, graphs) → (the plain HF model, the injected engine), built once."""
    made = {}

    def get(arch: str, graphs: bool = False):
        if (arch, graphs) not in made:
            made[arch, graphs] = (tiny_causal_lm(arch), _engine(arch, graphs))
        return made[arch, graphs]
    yield get
    made.clear()


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of 3 prompts of 8, 5 and 3 real tokens: ids and mask [3, 8]."""
    ids = prompt_ids(batch=3, length=8)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


class Counted:
    """Counts the calls of the fast loop and of the model's HF ``generate`` (instance-level
    wrappers, removed by the fixture)."""

    def __init__(self, monkeypatch, engine) -> None:
        self.fast = self.hf = 0
        run, generate = decode_loop.run_loop, engine.module.generate

        def counted_run(*args, **kwargs):
            self.fast += 1
            return run(*args, **kwargs)

        def counted_generate(*args, **kwargs):
            self.hf += 1
            return generate(*args, **kwargs)
        monkeypatch.setattr(decode_loop, "run_loop", counted_run)
        monkeypatch.setattr(engine.module, "generate", counted_generate)


# ----- greedy against HF -------------------------------------------------------------------------

@pytest.mark.parametrize("arch,graphs", [(a, False) for a in FAMILIES]
                         + [(a, True) for a in GRAPH_FAMILIES])
def test_greedy_left_padded_batch_matches_hf(engines, monkeypatch, arch, graphs):
    ref, engine = engines(arch, graphs)
    counted = Counted(monkeypatch, engine)
    ids, mask = _padded_batch()
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = ref.generate(ids, **kw)
    got = engine.generate(ids, **kw)
    assert (counted.fast, counted.hf) == (1, 0)
    assert torch.equal(got, expected)
    single = engine.generate(ids[:1], max_new_tokens=NEW, do_sample=False)  # no mask, batch 1
    with torch.no_grad():
        assert torch.equal(single, ref.generate(ids[:1], max_new_tokens=NEW, do_sample=False))
    assert (counted.fast, counted.hf) == (2, 0)


def _eos_mid_batch(ref, ids, mask) -> int:
    """A token that row 0 of HF's greedy continuation produces at its 4th step and that no row
    produces before: with it as eos, row 0 finishes early and the others run on."""
    with torch.no_grad():
        free = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                            pad_token_id=0, eos_token_id=None)
    new = free[:, ids.shape[1]:]
    for step in range(2, NEW - 2):
        token = int(new[0, step])
        if not (new[:, :step] == token).any() and not (new[1:, step] == token).all():
            return token
    pytest.fail("no token suits an eos that stops row 0 alone (change the prompt's seed)")


@pytest.mark.parametrize("graphs", [False, True])
def test_eos_stops_rows_mid_batch_padded_like_hf(engines, monkeypatch, graphs):
    ref, engine = engines("llama", graphs)
    counted = Counted(monkeypatch, engine)
    ids, mask = _padded_batch()
    eos = _eos_mid_batch(ref, ids, mask)
    for eos_ids in (eos, [255, eos]):  # one id, and a list
        kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=7,
                  eos_token_id=eos_ids)
        with torch.no_grad():
            expected = ref.generate(ids, **kw)
        got = engine.generate(ids, **kw)
        assert torch.equal(got, expected)
        row0 = got[0, ids.shape[1]:].tolist()
        stop = row0.index(eos)
        assert stop < len(row0) - 1 and set(row0[stop + 1:]) == {7}  # finished early, padded
    assert (counted.fast, counted.hf) == (2, 0)


def test_all_rows_finish_before_max_new_tokens(engines):
    """Every row hits eos: the output stops there (shorter than max_new_tokens), as HF's."""
    ref, engine = engines("llama")
    ids = prompt_ids(batch=1, length=8)
    with torch.no_grad():
        free = ref.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    eos = int(free[0, 8 + 3])
    kw = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
    with torch.no_grad():
        expected = ref.generate(ids, **kw)
    got = engine.generate(ids, **kw)
    assert torch.equal(got, expected) and got.shape[1] < 8 + NEW


def test_min_new_tokens_holds_eos_back_like_hf(engines):
    ref, engine = engines("llama")
    ids, mask = _padded_batch()
    eos = _eos_mid_batch(ref, ids, mask)
    for extra in (dict(min_new_tokens=NEW - 1), dict(min_length=8 + NEW - 2)):
        kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                  eos_token_id=eos, **extra)
        with torch.no_grad():
            expected = ref.generate(ids, **kw)
            early = ref.generate(ids, **{**kw, "min_new_tokens": None, "min_length": None})
        assert not torch.equal(expected, early)  # the setting changes the result here
        assert torch.equal(engine.generate(ids, **kw), expected)


# ----- sampling and streaming against HF's loop on the same engine -----------------------------

@pytest.mark.parametrize("settings", [dict(), dict(temperature=0.7),
                                      dict(temperature=1.3, top_k=20, top_p=0.9),
                                      dict(top_k=0, top_p=0.8)])
def test_sampling_draws_what_hf_draws(engines, settings):
    _, engine = engines("llama")
    ids, mask = _padded_batch()
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=True, pad_token_id=0, **settings)
    runs = []
    for fast in (True, False, True):
        torch.manual_seed(1234)
        runs.append(engine.generate(ids, shardwise_fast_loop=fast, **kw))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[2], runs[1])
    torch.manual_seed(99)
    assert not torch.equal(engine.generate(ids, **kw), runs[0])  # the seed matters


class Recorder(BaseStreamer):
    """Every streamer call, in order: ("put", the tensor) and ("end",)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def put(self, value: torch.Tensor) -> None:
        self.calls.append(("put", value.clone()))

    def end(self) -> None:
        self.calls.append(("end",))


def test_streamer_calls_match_hf(engines):
    ref, engine = engines("llama")
    ids, mask = _padded_batch()
    eos = _eos_mid_batch(ref, ids, mask)
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
              eos_token_id=eos)
    fast, hf = Recorder(), Recorder()
    engine.generate(ids, streamer=fast, **kw)
    engine.generate(ids, streamer=hf, shardwise_fast_loop=False, **kw)
    assert [c[0] for c in fast.calls] == [c[0] for c in hf.calls]
    assert fast.calls[-1] == ("end",) and len(fast.calls) == NEW + 2  # prompt, tokens, end
    for a, b in zip(fast.calls[:-1], hf.calls[:-1]):
        assert a[1].device.type == "cpu" and a[1].shape == b[1].shape and torch.equal(a[1], b[1])


def test_timed_generate_on_an_engine_times_the_fast_loop(engines, monkeypatch):
    """The benchmark's timer (shardwise.generation.timed_generate) on an engine: one gap per
    new token after the first, through the fast loop."""
    from shardwise.generation import timed_generate

    _, engine = engines("llama")
    counted = Counted(monkeypatch, engine)
    ids = prompt_ids(batch=2, length=8)
    out, timings = timed_generate(engine, {"input_ids": ids}, max_new_tokens=NEW,
                                  min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 8 + NEW) and timings.new_tokens == NEW and timings.batch_size == 2
    assert (counted.fast, counted.hf) == (1, 0)


# ----- what falls back -----------------------------------------------------------------------------

#: settings the fast loop does not implement: each must run HF's generate
FALLBACKS = {
    "repetition_penalty": dict(repetition_penalty=1.3),
    "num_beams": dict(num_beams=2),
    "logits_processor": dict(logits_processor=LogitsProcessorList([TemperatureLogitsWarper(0.5)])),
    "stopping_criteria": dict(stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(12)])),
    "output_scores": dict(output_scores=True, return_dict_in_generate=True),
    "return_dict_in_generate": dict(return_dict_in_generate=True),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "use_cache": dict(use_cache=False),
    "num_return_sequences": dict(num_return_sequences=2, do_sample=True),
    "min_p": dict(min_p=0.1, do_sample=True),
    "typical_p": dict(typical_p=0.5, do_sample=True),
    "suppress_tokens": dict(suppress_tokens=[5]),
    "position_ids": dict(position_ids=torch.arange(8)[None]),
}


@pytest.mark.parametrize("name", sorted(FALLBACKS))
def test_unimplemented_settings_run_hf_generate(engines, monkeypatch, name):
    _, engine = engines("llama")
    counted = Counted(monkeypatch, engine)
    ids = prompt_ids(batch=1, length=8)
    plan = decode_loop.plan_loop(engine.module, engine._stack, (ids,),
                                 dict(max_new_tokens=4, **FALLBACKS[name]))
    assert isinstance(plan, str) and name in plan  # the reason names the setting
    try:
        engine.generate(ids, max_new_tokens=4, **FALLBACKS[name])
    except Exception:  # HF's own refusal of a setting (e.g. use_cache=False on a static cache)
        pass
    assert (counted.fast, counted.hf) == (0, 1)


def test_model_generation_config_setting_falls_back(engines, monkeypatch):
    """A non-default value in the model's own generation_config counts as given."""
    _, engine = engines("llama")
    counted = Counted(monkeypatch, engine)
    monkeypatch.setattr(engine.module.generation_config, "repetition_penalty", 1.2)
    ids = prompt_ids(batch=1, length=8)
    engine.generate(ids, max_new_tokens=4)
    assert (counted.fast, counted.hf) == (0, 1)
    monkeypatch.setattr(engine.module.generation_config, "repetition_penalty", 1.0)
    engine.generate(ids, max_new_tokens=4)
    assert (counted.fast, counted.hf) == (1, 1)


def test_switch_off_runs_hf_generate(engines, monkeypatch):
    _, engine = engines("llama")
    counted = Counted(monkeypatch, engine)
    ids = prompt_ids(batch=1, length=8)
    engine.generate(ids, max_new_tokens=4, shardwise_fast_loop=False)
    assert (counted.fast, counted.hf) == (0, 1)


def test_engine_without_injection_runs_hf_generate(monkeypatch):
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu")
    counted = Counted(monkeypatch, engine)
    engine.generate(prompt_ids(batch=1, length=8), max_new_tokens=4)
    assert (counted.fast, counted.hf) == (0, 1)


def test_default_length_and_model_eos_like_hf(engines):
    """No length given: generate's default (20 tokens in all, capped as HF caps it), the
    model's own eos and pad ids from its generation_config."""
    ref, engine = engines("opt")
    ids = prompt_ids(batch=2, length=6)
    with torch.no_grad():
        expected = ref.generate(ids)
    assert torch.equal(engine.generate(ids), expected)


def test_offloaded_engine_runs_the_fast_loop(monkeypatch, tmp_path):
    """With offload= the fast loop's step streams the units as the forward does (their hooks
    run: a pass over the units per step) and returns HF's loop's tokens on the same engine."""
    engine = shardwise.init_inference(
        tiny_causal_lm("llama"), device="cpu", replace_with_kernel_inject=True,
        offload={"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 2})
    counted = Counted(monkeypatch, engine)
    ids, mask = _padded_batch()
    kw = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    engine.offload.reset_stats()
    fast = engine.generate(ids, **kw)
    assert engine.offload.stats()["passes"] >= NEW  # prefill + NEW - 1 decode steps
    assert torch.equal(fast, engine.generate(ids, shardwise_fast_loop=False, **kw))
    assert (counted.fast, counted.hf) == (1, 1)


# ----- CUDA ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
def test_cuda_fp16_graphs_fast_loop_matches_hf_loop(monkeypatch, arch):
    """fp16 with the captured step on CUDA: the fast loop returns what HF's loop on the same
    engine returns (greedy, left-padded batch with eos mid-batch; and sampling with a seed), and
    the streamer sees the same calls."""
    accelerator = cuda_accelerator(torch.float16)
    engine = shardwise.init_inference(tiny_causal_lm(arch), device=accelerator.name,
                                      dtype=torch.float16, replace_with_kernel_inject=True,
                                      enable_graph=True)
    counted = Counted(monkeypatch, engine)
    ids, mask = (t.to(engine.device) for t in _padded_batch())
    free = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    eos = int(free[0, 8 + 3])
    for kw, seed in ((dict(do_sample=False, eos_token_id=eos), None),
                     (dict(do_sample=True, top_k=20, temperature=0.8), 7)):
        kw = dict(attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, **kw)
        outs, streams = [], []
        for fast in (True, False):
            if seed is not None:
                torch.manual_seed(seed)
            streamer = Recorder()
            outs.append(engine.generate(ids, streamer=streamer, shardwise_fast_loop=fast, **kw))
            streams.append(streamer.calls)
        assert outs[0].device.type == "cuda" and torch.equal(outs[0], outs[1])
        assert len(streams[0]) == len(streams[1])
        assert all(torch.equal(a[1], b[1]) for a, b in zip(streams[0][:-1], streams[1][:-1]))
    no_stream = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                eos_token_id=eos, pad_token_id=0)  # deferred eos check
    assert torch.equal(no_stream, engine.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
        pad_token_id=0, shardwise_fast_loop=False))
    assert (counted.fast, counted.hf) == (4, 3)  # the fast loop ran where asked


@pytest.mark.parametrize("eos", [[7], [7, 3, 500]])
def test_eos_floor_scores_equal_transformers_min_length_processors(eos):
    """EosFloor (the loop's one processor for min_length and min_new_tokens) gives the scores
    transformers' two processors give, before, at and after the floor; an eos id beyond the
    vocabulary (500 of 50) masks nothing, as in theirs."""
    from transformers.generation.logits_process import (MinLengthLogitsProcessor,
                                                        MinNewTokensLengthLogitsProcessor)

    eos_t = torch.tensor(eos)
    prompt, min_new, min_length = 5, 4, 7
    theirs = LogitsProcessorList([MinLengthLogitsProcessor(min_length, eos_t),
                                  MinNewTokensLengthLogitsProcessor(prompt, min_new, eos_t)])
    ours = decode_loop.EosFloor(max(min_length, prompt + min_new), eos_t)
    gen = torch.Generator().manual_seed(0)
    masked = 0
    for length in range(prompt, prompt + min_new + 3):
        ids = torch.randint(0, 50, (2, length), generator=gen)
        scores = torch.randn(2, 50, generator=gen)
        expect, got = theirs(ids, scores.clone()), ours(ids, scores.clone())
        torch.testing.assert_close(got, expect, rtol=0, atol=0)
        masked += bool(torch.isinf(got).any())
    assert masked == min_new  # the floor held eos back for exactly the first min_new steps

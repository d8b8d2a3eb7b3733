"""SlotRunner (``shardwise.serve.runner``): continuous batching over the slots of one static KV
cache gives each sequence what Hugging Face ``generate`` gives it alone.

A tiny greedy loop (this file's, not the scheduler's) drives several prompts of different
lengths through one runner: sequences join while others decode, a prompt is prefilled in chunks
(one of them a single token) between decode steps, a finished sequence leaves and a new one
takes its slot. Every sequence's greedy tokens equal plain HF ``generate`` of its prompt alone
(fp32), and the logits behind them are within ``FP32_ATOL`` of HF's (teacher forced: one HF
forward over the prompt and the tokens). With graphs (an accelerating strategy on CPU tensors,
tests/graph_doubles.py) warmup captures one step per batch bucket and joining and leaving
captures nothing more, while every decode step replays a captured graph.
"""

from __future__ import annotations

import pytest

import shardwise
from shardwise.errors import ConfigError
from shardwise.inject.cache import MaxTokensError
from shardwise.serve.runner import SlotRunner
from graph_doubles import CountingReplay, engine_maker, replays
from models import prompt_ids, tiny_causal_lm, tiny_encoder
from slot_scenario import DECODES, Seq, check_against_hf, prefill, scenario, step
ARCHS = ["llama", "gpt2", "opt", "mixtral", "deepseek_v3-mla"]  # rotary, learned, learned
# with offset 2, MoE, multi-head latent attention (its latent cache written per row)


@pytest.fixture(scope="module")
def engines():
    """(arch, graphs) -> (HF reference, injected engine), built once per module."""
    get, made = engine_maker()
    yield get
    made.clear()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("arch", ARCHS)
def test_slots_give_each_sequence_its_greedy_hf_tokens(engines, arch, graphs):
    ref, engine = engines(arch, graphs)
    runner = SlotRunner(engine, max_batch=3, max_tokens=32)
    try:
        runner.warmup()
        graph_keys = set(runner.stack.graphs.graphs) if graphs else set()
        captured, replayed, decodes = CountingReplay.captures, replays(), DECODES[0]
        seqs = scenario(runner)
        worst = check_against_hf(ref, seqs)
        print(f"{arch} {'graphs' if graphs else 'eager'}: max |logit diff| {worst:.2e}")
        assert all(runner.length(slot) == 0 for slot in range(3))
        if graphs:
            assert runner.buckets() == [1, 2, 4]
            assert CountingReplay.captures == captured  # joining and leaving captured nothing
            assert set(runner.stack.graphs.graphs) == graph_keys
            # every decode step of the scenario replayed a captured step
            assert replays() - replayed == DECODES[0] - decodes > 0
    finally:
        runner.close()
    if graphs:  # closing drops the runner's graphs; generate's stay
        assert all(isinstance(k, int) for k in runner.stack.graphs.graphs)


def test_generate_between_steps_leaves_the_slots_alone(engines):
    ref, engine = engines("llama", False)
    runner = SlotRunner(engine, max_batch=2, max_tokens=32)
    seq = Seq(prompt_ids(1, 6, seed=3)[0].tolist(), 5)
    prefill(runner, seq, 1, [6])
    running = [seq]
    while running:
        engine.generate(prompt_ids(2, 7, seed=4), max_new_tokens=3, do_sample=False,
                        pad_token_id=0)
        running = step(runner, running)
    check_against_hf(ref, [seq])
    runner.close()


def test_bad_calls_are_refused_before_any_work(engines):
    _, engine = engines("llama", False)
    runner = SlotRunner(engine, max_batch=2, max_tokens=8)
    assert runner.max_tokens == 8 and runner.max_batch == 2 and runner.vocab_size == 256
    with pytest.raises(MaxTokensError, match="max_tokens=8"):
        runner.prefill(0, list(range(9)), last=True)
    assert runner.length(0) == 0  # nothing written
    logits = runner.prefill(0, list(range(3, 10)), last=True)
    runner.decode([0], [int(logits.argmax())])  # the slot is full now: 8 tokens
    with pytest.raises(MaxTokensError, match="max_tokens=8"):
        runner.decode([0], [1])
    with pytest.raises(ValueError, match="holds no tokens"):
        runner.decode([1], [1])
    with pytest.raises(ValueError, match="slot twice"):
        runner.decode([0, 0], [1, 1])
    with pytest.raises(ValueError, match="one token per slot"):
        runner.decode([0], [1, 2])
    with pytest.raises(ValueError, match="not one of"):
        runner.prefill(2, [1], last=True)
    with pytest.raises(ValueError, match="at least one token"):
        runner.prefill(1, [], last=True)
    runner.release(0)
    assert runner.length(0) == 0
    runner.close()
    with pytest.raises(shardwise.ShardwiseError, match="closed"):
        runner.prefill(0, [1], last=True)
    with pytest.raises(ConfigError, match="max_tokens"):
        SlotRunner(engine, max_batch=2, max_tokens=65)  # the engine holds 64
    with pytest.raises(ConfigError, match="max_batch"):
        SlotRunner(engine, max_batch=0)


def test_engines_without_an_injected_decoder_are_refused():
    plain = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu")
    with pytest.raises(ConfigError, match="replace_with_kernel_inject"):
        SlotRunner(plain, max_batch=2)
    encoder = shardwise.init_inference(tiny_encoder("bert"), device="cpu",
                                       replace_with_kernel_inject=True)
    with pytest.raises(ConfigError, match="encoder"):
        SlotRunner(encoder, max_batch=2)

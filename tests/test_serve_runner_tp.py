"""SlotRunner under tensor parallelism (2 gloo ranks): rank 0 drives the runner, rank 1 runs
``follow`` and executes every step rank 0 broadcasts, plain and mixed steps, then the same over
2 pipeline stages with micro-batches (one process pair for all three). The tokens equal HF
``generate`` of each prompt alone, and a rank dying makes the other fail with CollectiveError
within the collective timeout instead of hanging.
"""

from __future__ import annotations

import os

import pytest
import torch

from distributed import after_peer_death, assert_survivor_failed, run_ranks
from models import prompt_ids, tiny_causal_lm

TIMEOUT_S = 5
PROMPTS = [(5, 6), (9, 5), (3, 4)]  # (prompt length, new tokens)


def _engine():
    import shardwise

    os.environ.pop("OMP_NUM_THREADS", None)
    return shardwise.init_inference(tiny_causal_lm("llama"), device="cpu", mp_size=2,
                                    replace_with_kernel_inject=True, comm_timeout=TIMEOUT_S,
                                    max_tokens=32)


def _prompts() -> list[list[int]]:
    return [prompt_ids(1, n, seed=20 + n)[0].tolist() for n, _ in PROMPTS]


def _greedy(runner) -> list[list[int]]:
    """Prompt 0 in slot 0; prompt 1 joins slot 1 in chunks (4, 1, rest) while 0 decodes;
    prompt 0 leaves and prompt 2 takes its slot; all run to the end."""
    prompts, news = _prompts(), [new for _, new in PROMPTS]
    tokens: list[list[int]] = [[], [], []]
    slot_of = {0: 0, 1: 1, 2: 0}

    def take(i, logits):
        tokens[i].append(int(logits.argmax()))

    def decode(seqs):
        live = [i for i in seqs if len(tokens[i]) < news[i]]
        if live:
            logits = runner.decode([slot_of[i] for i in live], [tokens[i][-1] for i in live])
            for i, row in zip(live, logits):
                take(i, row)
        for i in [i for i in live if len(tokens[i]) == news[i]]:
            runner.release(slot_of[i])

    take(0, runner.prefill(0, prompts[0], last=True))
    assert runner.prefill(1, prompts[1][:4], last=False) is None
    decode([0])
    runner.heartbeat()
    runner.prefill(1, prompts[1][4:5], last=False)
    decode([0])
    take(1, runner.prefill(1, prompts[1][5:], last=True))
    while len(tokens[0]) < news[0]:
        decode([0, 1])
    take(2, runner.prefill(0, prompts[2], last=True))
    while any(len(tokens[i]) < news[i] for i in (1, 2)):
        decode([1, 2])
    return tokens


# ----- mixed steps: decode tokens and prompt chunks in one forward

MIXED_PROMPTS = [(5, 8), (4, 7), (13, 5), (3, 4)]  # (prompt length, new tokens)


def _mixed_prompts() -> list[list[int]]:
    return [prompt_ids(1, n, seed=30 + n)[0].tolist() for n, _ in MIXED_PROMPTS]


def _mixed_greedy(runner) -> list[list[int]]:
    """Prompts 0 and 1 decode in slots 0, 1; prompt 2 (slot 2, chunks of 6, 4 and the rest) and
    prompt 3 (slot 3, chunks of 2 and the rest) are prefilled through mixed steps, two of which
    carry both prompts' chunks; then all decode to the end."""
    prompts, news = _mixed_prompts(), [new for _, new in MIXED_PROMPTS]
    tokens: list[list[int]] = [[], [], [], []]

    def live(seqs):
        return [i for i in seqs if len(tokens[i]) < news[i]]

    def take_rows(seqs, logits):
        for i, row in zip(seqs, logits):
            tokens[i].append(int(row.argmax()))

    for i in (0, 1):
        tokens[i].append(int(runner.prefill(i, prompts[i], last=True).argmax()))
    chunks = [[(2, prompts[2][:6], False)],
              [(2, prompts[2][6:10], False), (3, prompts[3][:2], False)],
              [(3, prompts[3][2:], True), (2, prompts[2][10:], True)]]
    for parts in chunks:
        seqs = live([0, 1])
        logits, firsts = runner.mixed(seqs, [tokens[i][-1] for i in seqs], parts)
        take_rows(seqs, logits)
        for (slot, _, last), first in zip(parts, firsts):
            assert (first is None) == (not last)
            if first is not None:
                tokens[slot].append(int(first.argmax()))
    while live([0, 1, 2, 3]):
        seqs = live([0, 1, 2, 3])
        take_rows(seqs, runner.decode(seqs, [tokens[i][-1] for i in seqs]))
    return tokens


def _staged_engine():
    """The same model over 2 pipeline stages, a decode step's rows in 2 micro-batches."""
    import shardwise

    return shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                    pipeline_parallel={"pp_size": 2, "micro_batches": 2},
                                    replace_with_kernel_inject=True, comm_timeout=TIMEOUT_S,
                                    max_tokens=32)


def _serve(rank: int):
    from shardwise.serve.runner import SlotRunner, follow

    engine = _engine()
    if rank != 0:
        follow(engine)  # returns when rank 0 closes the first runner
        follow(engine)  # and the second (mixed steps)
        engine.close()
        staged = _staged_engine()
        follow(staged)  # and the pipeline's, split
        follow(staged)  # and split where measured faster
        return None
    runner = SlotRunner(engine, max_batch=2)
    runner.warmup()
    tokens = _greedy(runner)
    runner.close()
    runner = SlotRunner(engine, max_batch=4)
    mixed = _mixed_greedy(runner)
    runner.close()
    engine.close()
    staged = _staged_engine()
    runner = SlotRunner(staged, max_batch=2, pipeline_split=True)
    runner.warmup()
    staged_tokens = _greedy(runner)
    parts = sorted(list(key[1:]) for key in runner.cache.part_keys)  # [first row, rows]
    runner.close()
    auto = SlotRunner(staged, max_batch=2)  # each bucket's step timed whole and split
    auto.warmup()
    auto_tokens = _greedy(auto)
    auto.close()
    return {"plain": tokens, "mixed": mixed, "staged": staged_tokens,
            "staged_parts": parts, "staged_mixed": runner.mixed_unsupported,
            "auto": auto_tokens, "auto_split": {str(k): v for k, v in auto.split_buckets.items()},
            "auto_seconds": {str(k): v for k, v in auto.split_seconds.items()}}


def _hf_new_tokens(prompt: list[int], new: int) -> list[int]:
    ref = tiny_causal_lm("llama")
    with torch.no_grad():
        return ref.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                            pad_token_id=0)[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One process pair for both runners' scenarios."""
    return run_ranks(_serve, 2, tmp_path_factory.mktemp("serve_tp"), deadline_s=150)


def test_two_ranks_give_hf_greedy_tokens(served):
    assert all(r["ok"] for r in served), [r.get("trace") for r in served]
    for prompt, (_, new), got in zip(_prompts(), PROMPTS, served[0]["value"]["plain"]):
        expected = _hf_new_tokens(prompt, new)
        assert len(expected) == new  # no end-of-sequence token cut HF's short
        assert got == expected
    assert served[1]["value"] is None  # the follower left its loop at each close


def test_two_ranks_run_mixed_steps_with_hf_greedy_tokens(served):
    """Rank 0's ``SlotRunner.mixed`` sends the step (decode slots and tokens, each chunk's
    slot, size and ``last``, the chunk tokens) and rank 1's ``follow`` runs the same packed
    forward; the tokens equal HF ``generate`` of each prompt alone."""
    assert all(r["ok"] for r in served), [r.get("trace") for r in served]
    for prompt, (_, new), got in zip(_mixed_prompts(), MIXED_PROMPTS,
                                     served[0]["value"]["mixed"]):
        expected = _hf_new_tokens(prompt, new)
        assert len(got) == new and got[:len(expected)] == expected  # HF stops at its eos


def test_pipeline_stages_serve_hf_greedy_tokens_with_the_rows_in_flight(served):
    """Under pipeline stages (rank 0 the first stage, rank 1 the second) the same scenario
    gives HF's tokens; a decode step over 2 rows runs as 2 micro-batches of one row (one
    sequence each) through the stages, each its own step over its row of the slot cache."""
    from shardwise.serve.runner import SPLIT_MARGIN

    assert all(r["ok"] for r in served), [r.get("trace") for r in served]
    value = served[0]["value"]
    for prompt, (_, new), got in zip(_prompts(), PROMPTS, value["staged"]):
        assert got == _hf_new_tokens(prompt, new)
    assert value["staged_parts"] == [[0, 1], [1, 1]]
    assert "pipeline stages" in value["staged_mixed"]  # prefill and decode steps alternate
    # "auto": the 2-row bucket's step timed whole and as micro-batches, split only when faster
    # by the margin (which one is the machine's: the tokens are HF's either way)
    assert value["auto"] == value["staged"]
    assert list(value["auto_split"]) == ["2"] and list(value["auto_seconds"]) == ["2"]
    whole, split = value["auto_seconds"]["2"]
    assert value["auto_split"]["2"] == (split < SPLIT_MARGIN * whole)


def _follower_dies(rank: int) -> dict:
    """Rank 1 dies after following one prefill; rank 0's next decode fails, later steps are
    refused and closing returns at once."""
    import time

    import shardwise
    from shardwise.serve import runner as runner_mod

    engine = _engine()
    if rank == 1:
        receive, seen = runner_mod._receive, []

        def receive_then_die(engine, n=None):
            if len(seen) == 4:  # init and its payload (the mixed buckets), the prefill's two
                os._exit(9)
            seen.append(n)
            return receive(engine, n)
        runner_mod._receive = receive_then_die
        runner_mod.follow(engine)
    runner = runner_mod.SlotRunner(engine, max_batch=2)
    logits = runner.prefill(0, _prompts()[0], last=True)
    token = int(logits.argmax())

    def decode_many():
        for _ in range(20):
            runner.decode([0], [token])
    result = after_peer_death(rank, decode_many)
    try:  # the ranks may be out of step now: every later step is refused
        runner.decode([0], [token])
    except shardwise.ShardwiseError as exc:
        result["later"] = str(exc)
    start = time.monotonic()
    runner.close()  # sends nothing to the dead rank: no second timeout
    result["close_s"] = time.monotonic() - start
    return result


def test_rank_0_fails_within_the_timeout_when_a_follower_dies(tmp_path):
    results = run_ranks(_follower_dies, 2, tmp_path, deadline_s=120)
    assert_survivor_failed(results, "failed", TIMEOUT_S)
    survivor = results[0]["value"]
    assert "earlier step failed under tensor parallelism" in survivor["later"]
    assert survivor["close_s"] < TIMEOUT_S / 2


def _leader_dies(rank: int) -> dict:
    """Rank 0 dies after one prefill; rank 1's follow fails within the timeout."""
    import time

    import shardwise
    from shardwise.serve.runner import SlotRunner, follow

    engine = _engine()
    if rank == 0:
        SlotRunner(engine, max_batch=2).prefill(0, _prompts()[0], last=True)
        os._exit(9)
    start = time.monotonic()
    try:
        follow(engine)
    except shardwise.CollectiveError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None}


def test_follower_fails_within_the_timeout_when_rank_0_dies(tmp_path):
    results = run_ranks(_leader_dies, 2, tmp_path, deadline_s=120)
    assert results[0]["error"].startswith("no result (exit code 9)")
    assert results[1]["ok"], results[1].get("trace")
    follower = results[1]["value"]
    assert follower["error"], "follow returned although rank 0 was dead"
    assert "on rank 1/2" in follower["error"], follower["error"]
    assert follower["seconds"] < TIMEOUT_S + 10

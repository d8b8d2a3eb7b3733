"""Mixed steps under tensor parallelism (2 gloo ranks): rank 0's ``SlotRunner.mixed`` sends
the step (decode slots and tokens, each chunk's slot, size and ``last``, the chunk tokens) and
rank 1's ``follow`` runs the same packed forward; the tokens equal HF ``generate`` of each
prompt alone."""

from __future__ import annotations

import os

import torch

from distributed import run_ranks
from models import prompt_ids, tiny_causal_lm

PROMPTS = [(5, 8), (4, 7), (13, 5), (3, 4)]  # (prompt length, new tokens)


def _prompts() -> list[list[int]]:
    return [prompt_ids(1, n, seed=30 + n)[0].tolist() for n, _ in PROMPTS]


def _greedy(runner) -> list[list[int]]:
    """Prompts 0 and 1 decode in slots 0, 1; prompt 2 (slot 2) and 3 (slot 3) are prefilled
    through mixed steps (two chunks of 2, one step carrying both prompts' chunks); then all
    decode to the end."""
    prompts, news = _prompts(), [new for _, new in PROMPTS]
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


def _serve(rank: int):
    import shardwise
    from shardwise.serve.runner import SlotRunner, follow

    os.environ.pop("OMP_NUM_THREADS", None)
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu", mp_size=2,
                                      replace_with_kernel_inject=True, comm_timeout=5,
                                      max_tokens=32)
    if rank != 0:
        follow(engine)  # returns when rank 0 closes
        return None
    runner = SlotRunner(engine, max_batch=4)
    tokens = _greedy(runner)
    runner.close()
    return tokens


def test_two_ranks_run_mixed_steps_with_hf_greedy_tokens(tmp_path):
    results = run_ranks(_serve, 2, tmp_path, deadline_s=120)
    assert all(r["ok"] for r in results), [r.get("trace") for r in results]
    ref = tiny_causal_lm("llama")
    for prompt, (_, new), got in zip(_prompts(), PROMPTS, results[0]["value"]):
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=new,
                                    do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert len(got) == new and got[:len(expected)] == expected  # HF stops at its eos
    assert results[1]["value"] is None  # the follower left its loop at close

"""A rank that dies mid-run under tensor parallelism: the survivor fails with CollectiveError
within the collective timeout instead of hanging."""

import os

import shardwise
from distributed import after_peer_death, assert_survivor_failed, run_ranks
from models import prompt_ids, tiny_causal_lm

TIMEOUT_S = 5


def _dies_mid_run(rank: int) -> dict:
    os.environ.pop("OMP_NUM_THREADS", None)
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu", mp_size=2,
                                      comm_timeout=TIMEOUT_S)
    ids = prompt_ids()
    engine.generate(ids, max_new_tokens=2, do_sample=False)  # both ranks alive: works
    # rank 1 dies between two requests
    return after_peer_death(rank, lambda: engine.generate(ids, max_new_tokens=8, do_sample=False))


def test_survivor_fails_clearly_within_the_timeout(tmp_path):
    results = run_ranks(_dies_mid_run, 2, tmp_path, deadline_s=120)
    assert_survivor_failed(results, "failed", TIMEOUT_S)

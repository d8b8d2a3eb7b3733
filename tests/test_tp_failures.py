"""A rank that dies mid-run under tensor parallelism: the survivor fails with CollectiveError
within the collective timeout instead of hanging."""

import os
import time


import shardwise
from distributed import run_ranks
from models import prompt_ids, tiny_causal_lm

TIMEOUT_S = 5


def _dies_mid_run(rank: int) -> dict:
    os.environ.pop("OMP_NUM_THREADS", None)
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu", mp_size=2,
                                      comm_timeout=TIMEOUT_S)
    ids = prompt_ids()
    engine.generate(ids, max_new_tokens=2, do_sample=False)  # both ranks alive: works
    if rank == 1:
        os._exit(9)  # dies between two requests
    start = time.monotonic()
    try:
        engine.generate(ids, max_new_tokens=8, do_sample=False)
    except shardwise.CollectiveError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None}


def test_survivor_fails_clearly_within_the_timeout(tmp_path):
    results = run_ranks(_dies_mid_run, 2, tmp_path, deadline_s=120)
    assert results[1]["error"].startswith("no result (exit code 9)")
    assert results[0]["ok"], results[0].get("trace")
    survivor = results[0]["value"]
    assert survivor["error"], "rank 0 generated although rank 1 was dead"
    assert "failed on rank 0/2" in survivor["error"]
    assert survivor["seconds"] < TIMEOUT_S + 10

"""Run a function on N local ranks (separate processes, gloo) the way torchrun would set them up.

``run_ranks(fn, world_size, tmp_path)`` starts ``world_size`` processes with RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set, calls ``fn(rank, *args)`` in each, and returns each
rank's JSON-serialisable result, or the text of the exception it raised. Every run has a deadline
so a hung collective fails the test instead of hanging the suite.

The ranks are forked from one server process (multiprocessing's ``forkserver``) that imported
torch, transformers and shardwise once per test session, so a rank does not pay those imports
(a spawned rank did: seconds per pair on 2 cores, over the suite's many pairs). The server only
imports (no thread pool, no process group, no tensor work), and each rank gets the test's
environment as it is when ``run_ranks`` is called, not the server's.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import traceback
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Free ports handed to every rank, for tests that create several process groups in a row: a
#: new group on the port of one just destroyed can meet the old store still closing.
SPARE_PORTS_ENV = "SHARDWISE_TEST_SPARE_PORTS"


def use_next_master_port() -> None:
    """Point MASTER_PORT at the next spare port (every rank must call this in the same order)."""
    spare = os.environ[SPARE_PORTS_ENV].split(",")
    os.environ["MASTER_PORT"], os.environ[SPARE_PORTS_ENV] = spare[0], ",".join(spare[1:])


#: What the fork server imports once (see the module docstring).
PRELOAD = ["torch", "transformers", "shardwise"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (first use)
    return ctx


def _entry(fn, rank: int, world_size: int, port: int, out_dir: str, args: tuple, env: dict):
    os.environ.clear()  # the test's environment at run_ranks, not the fork server's
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), **env})
    try:
        result = {"ok": True, "value": fn(rank, *args)}
    except BaseException as exc:  # report everything, including SystemExit, to the parent
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "trace": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run_ranks(fn, world_size: int, tmp_path, *args, deadline_s: float = 120.0,
              env: dict | None = None) -> list[dict]:
    """Run ``fn(rank, *args)`` on ``world_size`` ranks; returns one result dict per rank
    (``{"ok": True, "value": ...}``, ``{"ok": False, "error": ...}`` or ``{"ok": False,
    "error": "no result (exit code N)"}`` for a rank that died)."""
    ctx = _context()
    port = free_port()
    env = {**os.environ, SPARE_PORTS_ENV: ",".join(str(free_port()) for _ in range(8)),
           **(env or {})}
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, str(tmp_path), args,
                                              env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(deadline_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        raise AssertionError(f"ranks {hung} still running after {deadline_s}s: a collective hung")
    results = []
    for r, p in enumerate(procs):
        f = Path(tmp_path, f"rank{r}.json")
        results.append(json.loads(f.read_text()) if f.exists()
                       else {"ok": False, "error": f"no result (exit code {p.exitcode})"})
    return results


def after_peer_death(rank: int, call) -> dict:
    """Rank 1 exits (code 9); rank 0 then runs ``call()``, which must fail with
    ``shardwise.CollectiveError``: its message and the seconds it took, for
    :func:`assert_survivor_failed` (error None: ``call`` returned although its peer was dead)."""
    import time

    import shardwise

    if rank == 1:
        os._exit(9)
    start = time.monotonic()
    try:
        call()
    except shardwise.CollectiveError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None}


def assert_survivor_failed(results: list[dict], what: str, timeout_s: float) -> None:
    """The results of :func:`run_ranks` over a function ending in :func:`after_peer_death`:
    rank 1 died, rank 0 got a CollectiveError naming ``what`` within the collective timeout
    (plus slack for a loaded machine)."""
    assert results[1]["error"].startswith("no result (exit code 9)")
    assert results[0]["ok"], results[0].get("trace")
    survivor = results[0]["value"]
    assert survivor["error"], "rank 0's call returned although rank 1 was dead"
    assert f"{what} on rank 0/2" in survivor["error"], survivor["error"]
    assert survivor["seconds"] < timeout_s + 10

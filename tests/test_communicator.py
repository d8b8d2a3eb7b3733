"""Communicator: local at world size 1; real collectives on 2 gloo ranks; a dead or silent rank
makes the others fail with CollectiveError within the timeout instead of hanging."""

import os
import time

import pytest
import torch

import shardwise
from shardwise.communicator import LocalCommunicator, create_communicator, resolve_timeout
from distributed import run_ranks


def test_world_size_one_needs_no_process_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    comm = create_communicator(shardwise.get_accelerator("cpu"))
    assert isinstance(comm, LocalCommunicator)
    assert not torch.distributed.is_initialized()
    x = torch.arange(6.0).reshape(2, 3)
    assert comm.all_reduce(x) is x
    assert torch.equal(comm.all_gather(x), x)
    assert torch.equal(comm.all_to_all(x), x)
    comm.barrier()
    with pytest.raises(shardwise.CollectiveError):
        comm.broadcast(x, src=1)


def test_timeout_must_be_positive(monkeypatch):
    with pytest.raises(shardwise.ConfigError, match="positive"):
        resolve_timeout(0)
    monkeypatch.setenv("SHARDWISE_COMM_TIMEOUT", "7")
    assert resolve_timeout(None) == 7.0


def _collectives(rank):
    os.environ.pop("OMP_NUM_THREADS", None)  # let the accelerator split the cores between ranks
    comm = create_communicator(shardwise.get_accelerator("cpu"), timeout_s=30)
    world = comm.world_size
    x = torch.full((2, 3), float(rank + 1))
    summed = comm.all_reduce(x.clone()).tolist()
    biggest = comm.all_reduce(x.clone(), op="max").tolist()
    gathered = comm.all_gather(torch.tensor([rank, 10 + rank]), dim=0).tolist()
    b = torch.tensor([rank * 100.0])
    comm.broadcast(b, src=1)
    # rank r sends row i to rank i: row i of the input is 10*r + i
    a2a = comm.all_to_all(torch.tensor([[10.0 * rank + i] for i in range(world)])).tolist()
    comm.barrier()
    threads = torch.get_num_threads()
    comm.close()
    return dict(world=world, rank=comm.rank, summed=summed, biggest=biggest, gathered=gathered,
                broadcast=b.tolist(), a2a=a2a, threads=threads)


def test_collectives_on_two_ranks(tmp_path):
    results = run_ranks(_collectives, 2, tmp_path)
    cores_per_rank = max(1, shardwise.get_accelerator("cpu").max_ranks_per_node() // 2)
    for rank, res in enumerate(results):
        assert res["ok"], res.get("trace", res["error"])
        v = res["value"]
        assert (v["world"], v["rank"]) == (2, rank)
        assert v["summed"] == [[3.0] * 3] * 2
        assert v["biggest"] == [[2.0] * 3] * 2
        assert v["gathered"] == [0, 10, 1, 11]
        assert v["broadcast"] == [100.0]
        assert v["a2a"] == [[float(rank)], [10.0 + rank]]
        assert v["threads"] == cores_per_rank  # 2 ranks on one node don't oversubscribe cores


def _dies_or_stalls(rank, mode):
    comm = create_communicator(shardwise.get_accelerator("cpu"), timeout_s=4)
    comm.barrier()
    if rank == 1:
        if mode == "die":
            os._exit(3)
        time.sleep(15)  # alive but never joins the collective
        return "stalled"
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
    except shardwise.CollectiveError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.parametrize("mode", ["die", "stall"])
def test_dead_or_silent_rank_fails_others_within_timeout(tmp_path, mode):
    results = run_ranks(_dies_or_stalls, 2, tmp_path, mode, deadline_s=60)
    assert results[0]["ok"], results[0].get("trace")
    survivor = results[0]["value"]
    assert survivor["error"], "rank 0's all_reduce succeeded although rank 1 never joined it"
    assert "all_reduce failed on rank 0/2" in survivor["error"]
    assert "another rank probably died" in survivor["error"].lower()
    assert survivor["seconds"] < 4 + 10  # the 4 s timeout plus slack; never a hang

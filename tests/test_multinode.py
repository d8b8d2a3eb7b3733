"""Multi-node, exercised for real: two "nodes" (network namespaces joined by a veth link,
tests/netns.py), each running ``shardwise launch --nnodes 2 --node-rank R --nproc-per-node 1``
with the c10d rendezvous hosted on node 0 (10.77.0.1). The ranks only reach each other over the
link (gloo bound to each node's end of it), as on two hosts.

* TP=2, then PP=2, across the nodes: fp32 logits within 1e-4 of the single-process model, 32
  greedy tokens identical; under TP each rank holds about half the split weights, under PP each
  rank one stage (the layers cut in two);
* a node killed mid-run: the surviving rank fails within the collective timeout
  (``SHARDWISE_COMM_TIMEOUT``) with shardwise's CollectiveError, and its launch exits non-zero;
* mismatched versions and model configs across the nodes: named at start-up on every rank
  (:mod:`shardwise.launch.startup_check`), and the same check on 2 local ranks.

Where namespaces cannot be created (not root, or refused by the kernel/container) the multi-node
tests skip with that reason. Every process runs under a deadline and the namespaces are deleted
in a finalizer, so a failure cannot hang the suite or leave namespaces behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import netns
from distributed import run_ranks
from shardwise.launch.environment import USER_ENV_MARKER

TESTS_DIR = Path(__file__).resolve().parent
#: collective timeout of every rank (seconds): the kill test's survivor must fail within it
COMM_TIMEOUT_S = 20
#: the collective timeout when the link is cut: the survivor waits all of it
PARTITION_TIMEOUT_S = 10
#: the rendezvous port on node 0 (a fresh namespace has every port free)
RDZV_PORT = 29411
#: how long a node waits for the other to join the rendezvous (seconds)
RDZV_TIMEOUT_S = 60
#: deadline of one launch (both nodes); the whole file runs in well under a minute
LAUNCH_DEADLINE_S = 150
#: the version node 1 pretends to run in the mismatch test
OTHER_VERSION = "4.99.0"

#: One rank of every case: ``script.py MODE``; writes ``<name>_node<N>.json`` to $MULTINODE_OUT.
RANK_SCRIPT = textwrap.dedent("""\
    import json, os, subprocess, sys, time
    sys.path.insert(0, os.environ["MULTINODE_TESTS_DIR"])
    import torch
    import shardwise
    from models import prompt_ids, tiny_causal_lm

    MODE, NODE = sys.argv[1], int(os.environ["MULTINODE_NODE"])
    RANK = int(os.environ["RANK"])
    TP = {"tensor_parallel": {"tp_size": 2}}

    def write(name, **record):
        record.update(rank=RANK, node=NODE, world=int(os.environ["WORLD_SIZE"]),
                      group_rank=int(os.environ["GROUP_RANK"]), time=time.time())
        path = os.path.join(os.environ["MULTINODE_OUT"], f"{name}_node{NODE}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(record, fh)
        os.replace(path + ".tmp", path)

    def addresses():
        out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True)
        return sorted(line.split()[3] for line in out.stdout.splitlines())

    def tp():
        ref, model = tiny_causal_lm("llama"), tiny_causal_lm("llama")  # same seed on both nodes
        ids = prompt_ids(batch=2, length=8)
        gen = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            ref_logits, ref_tokens = ref(ids).logits, ref.generate(ids, **gen)
        full = sum(p.numel() for p in ref.parameters())
        engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32, **TP)
        logits, tokens = engine(input_ids=ids).logits, engine.generate(ids, **gen)
        write("tp", max_abs=(logits - ref_logits).abs().max().item(),
              tokens_equal=torch.equal(tokens, ref_tokens), new_tokens=tokens.shape[1] - 8,
              rank_params=sum(p.numel() for p in model.parameters()), full_params=full,
              sharded=len(engine.sharding.sharded), addresses=addresses())
        pp(ids, gen, ref_logits, ref_tokens)

    def pp(ids, gen, ref_logits, ref_tokens):
        # PP=2 on the same two ranks (the TP engine stays open: its process group is reused)
        from shardwise.pipeline import RemoteLayer
        model = tiny_causal_lm("llama")
        engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                          pipeline_parallel={"pp_size": 2})
        logits, tokens = engine(input_ids=ids).logits, engine.generate(ids, **gen)
        layers = model.model.layers
        write("pp", max_abs=(logits - ref_logits).abs().max().item(),
              tokens_equal=torch.equal(tokens, ref_tokens), new_tokens=tokens.shape[1] - 8,
              owned=[i for i, layer in enumerate(layers) if not isinstance(layer, RemoteLayer)],
              layers=len(layers))

    def kill():
        engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                          dtype=torch.float32, **TP)
        ids = prompt_ids(batch=1, length=8)
        engine(input_ids=ids)  # one forward across the nodes works
        write("ready")
        if NODE == 1:
            time.sleep(600)  # killed by the test, with everything in its namespace
        start = time.time()
        try:
            while True:
                engine(input_ids=ids)  # blocks on the all-reduce of a peer that is gone
        except Exception as exc:
            write("survivor", error=f"{type(exc).__name__}: {exc}",
                  is_collective_error=isinstance(exc, shardwise.CollectiveError),
                  blocked_s=time.time() - start)
            raise

    def mismatch():
        from shardwise.communicator import create_communicator
        from shardwise.launch.startup_check import (RankMismatchError, check_ranks_agree,
                                                    fingerprint)
        model = tiny_causal_lm("llama")
        if NODE == 1:  # another install, and a model from another config, on this node
            # (the module as imported now: building a model can replace transformers' lazy one)
            sys.modules["transformers"].__version__ = os.environ["MULTINODE_OTHER_VERSION"]
            model.config.rope_theta = 1234.0  # no shape changes: only the config hash differs
        cfg = shardwise.InferenceConfig.build(None, device="cpu", **TP)
        comm = create_communicator(shardwise.get_accelerator("cpu"))
        try:
            check_ranks_agree(comm, fingerprint(model, cfg))
        except RankMismatchError as exc:
            write("mismatch", error=str(exc))
            raise
        write("mismatch", error=None)

    {"tp": tp, "kill": kill, "mismatch": mismatch}[MODE]()
""")


@pytest.fixture
def nodes():
    """Two fresh namespaces joined by a veth link, deleted after the test even on failure."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"cannot create network namespaces for the two nodes: {reason}")
    pair = netns.TwoNodes.create()
    try:
        yield pair
    finally:
        pair.destroy()


def _env(node: int, pair: netns.TwoNodes, out: Path, timeout_s: int) -> dict[str, str]:
    """A node's launch environment: gloo bound to the node's end of the link, a short timeout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "SHARDWISE_ACCELERATOR", USER_ENV_MARKER)}
    return {**env, "GLOO_SOCKET_IFNAME": pair.links[node], "SHARDWISE_COMM_TIMEOUT":
            str(timeout_s), "MULTINODE_OUT": str(out), "MULTINODE_NODE": str(node),
            "MULTINODE_TESTS_DIR": str(TESTS_DIR), "MULTINODE_OTHER_VERSION": OTHER_VERSION,
            "OMP_NUM_THREADS": "1"}


def _launch_command(node: int, pair: netns.TwoNodes, script: Path, mode: str) -> list[str]:
    """``shardwise launch`` of node ``node``: one rank, c10d rendezvous on node 0's address."""
    return [sys.executable, "-m", "shardwise", "launch", "--nnodes", "2", "--node-rank",
            str(node), "--nproc-per-node", "1", "--device", "cpu", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{netns.ADDRESSES[0]}:{RDZV_PORT}", "--rdzv-id", pair.tag,
            "--local-addr", netns.ADDRESSES[node], "--max-restarts", "0",
            # node 0 hosts the store: torch's own guess compares the endpoint with the addresses
            # of the hostname, which in a namespace resolve to loopback, not to the link
            "--rdzv-conf", f"is_host={int(node == 0)},join_timeout={RDZV_TIMEOUT_S}",
            str(script), mode]


def _start(pair: netns.TwoNodes, tmp_path: Path, mode: str,
           timeout_s: int = COMM_TIMEOUT_S) -> list[subprocess.Popen]:
    """Start the launch on both nodes (collective timeout ``timeout_s``); each one's output goes
    to ``node<N>.log``."""
    script = tmp_path / "script.py"
    script.write_text(RANK_SCRIPT)
    procs = []
    for node in (0, 1):
        log = open(tmp_path / f"node{node}.log", "w")
        procs.append(pair.popen(node, _launch_command(node, pair, script, mode), cwd=tmp_path,
                                env=_env(node, pair, tmp_path, timeout_s), stdout=log,
                                stderr=subprocess.STDOUT, text=True))
        log.close()
    return procs


def _wait(procs: list[subprocess.Popen], deadline: float) -> list[int | None]:
    """Each launch's exit code, or None for one still running at ``deadline`` (monotonic)."""
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [proc.poll() for proc in procs]


def _logs(tmp_path: Path) -> str:
    return "\n".join(f"--- node {n} ---\n{(tmp_path / f'node{n}.log').read_text()[-4000:]}"
                     for n in (0, 1))


def _record(tmp_path: Path, name: str, node: int) -> dict:
    path = tmp_path / f"{name}_node{node}.json"
    assert path.exists(), f"node {node} wrote no {name} record\n{_logs(tmp_path)}"
    return json.loads(path.read_text())


def _wait_for(paths: list[Path], deadline: float, procs: list[subprocess.Popen]) -> bool:
    """Whether every path exists before ``deadline`` (False early when a launch exited)."""
    while time.monotonic() < deadline:
        if all(p.exists() for p in paths):
            return True
        if any(proc.poll() is not None for proc in procs):
            return all(p.exists() for p in paths)
        time.sleep(0.2)
    return False


# ----- across two nodes -------------------------------------------------------------------------

@pytest.mark.slow
def test_tp2_and_pp2_across_two_nodes_match_the_single_process_model(nodes, tmp_path):
    procs = _start(nodes, tmp_path, "tp")
    codes = _wait(procs, time.monotonic() + LAUNCH_DEADLINE_S)
    assert codes == [0, 0], f"launch exit codes {codes}\n{_logs(tmp_path)}"
    records = [_record(tmp_path, "tp", node) for node in (0, 1)]
    assert sorted(r["rank"] for r in records) == [0, 1]
    assert sorted(r["group_rank"] for r in records) == [0, 1]  # one rank per node
    for node, rec in enumerate(records):
        # each rank ran in its own namespace: it sees only its own end of the link
        assert rec["addresses"] == sorted(["127.0.0.1/8", f"{netns.ADDRESSES[node]}/24"]), rec
        assert rec["world"] == 2
        assert rec["max_abs"] <= 1e-4, rec
        assert rec["tokens_equal"] and rec["new_tokens"] == 32, rec
        assert rec["sharded"] > 0
        # about half of the split weights: fewer than 3/4 of the model, more than 1/2
        assert rec["full_params"] / 2 < rec["rank_params"] < rec["full_params"] * 3 / 4, rec
    # PP=2 across the same two nodes: each rank one stage (half the layers), same outputs
    stages = [_record(tmp_path, "pp", node) for node in (0, 1)]
    by_rank = sorted(stages, key=lambda r: r["rank"])
    layers = by_rank[0]["layers"]
    assert by_rank[0]["owned"] + by_rank[1]["owned"] == list(range(layers)), by_rank
    assert by_rank[0]["owned"] and by_rank[1]["owned"]
    for rec in stages:
        assert rec["max_abs"] <= 1e-4, rec
        assert rec["tokens_equal"] and rec["new_tokens"] == 32, rec


def _kill_node(pair: netns.TwoNodes, node: int) -> None:
    """The whole node goes at once: its launcher and its rank (SIGKILL, sockets closed)."""
    for pid in pair.pids(node):
        os.kill(pid, 9)


def _cut_link(pair: netns.TwoNodes, node: int) -> None:
    """The node stays up but its link goes down: its peers see no close, only silence."""
    netns._ip("-n", pair.names[node], "link", "set", pair.links[node], "down")


#: how node 1 is lost -> (what the test does, the survivor's collective timeout)
LOSSES = {"killed": (_kill_node, COMM_TIMEOUT_S), "cut off": (_cut_link, PARTITION_TIMEOUT_S)}


@pytest.mark.slow
@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_node_lost_mid_run_fails_the_survivor_within_the_timeout(nodes, tmp_path, loss):
    """Killed: gloo sees the peer's sockets close and the survivor fails at once. Cut off (link
    down): nothing tells the survivor, which fails when its collective times out. Either way a
    CollectiveError naming the rank and the timeout, and node 0's launch exits non-zero."""
    act, timeout_s = LOSSES[loss]
    procs = _start(nodes, tmp_path, "kill", timeout_s)
    ready = [tmp_path / f"ready_node{n}.json" for n in (0, 1)]
    started = _wait_for(ready, time.monotonic() + LAUNCH_DEADLINE_S, procs)
    assert started, f"the ranks never got through init\n{_logs(tmp_path)}"
    lost_at = time.time()
    act(nodes, 1)
    waited = procs if loss == "killed" else procs[:1]  # a cut-off node's rank sleeps on
    codes = _wait(waited, time.monotonic() + timeout_s + 30)
    assert codes[0] is not None, f"node 0's launch still runs after losing its peer\n" \
                                 f"{_logs(tmp_path)}"
    assert codes[0] != 0, codes
    survivor = _record(tmp_path, "survivor", 0)
    assert survivor["is_collective_error"], survivor["error"]
    assert f"failed on rank {survivor['rank']}/2" in survivor["error"], survivor["error"]
    assert f"timeout {timeout_s}s" in survivor["error"], survivor["error"]
    assert survivor["time"] - lost_at < timeout_s + 10, survivor
    if loss == "cut off":  # it waited for the timeout: nothing else could tell it
        assert survivor["blocked_s"] > timeout_s - 1, survivor
    else:
        assert codes[1] not in (0, None), codes
    assert "CollectiveError" in _logs(tmp_path)  # the launch's report names the failure


@pytest.mark.slow
def test_mismatched_versions_and_configs_across_nodes_are_named_at_start_up(nodes, tmp_path):
    procs = _start(nodes, tmp_path, "mismatch")
    codes = _wait(procs, time.monotonic() + LAUNCH_DEADLINE_S)
    assert codes[0] not in (0, None) and codes[1] not in (0, None), \
        f"launch exit codes {codes}\n{_logs(tmp_path)}"
    records = [_record(tmp_path, "mismatch", node) for node in (0, 1)]
    assert records[0]["error"] == records[1]["error"]  # every rank raises the same error
    text, other = records[0]["error"], records[1]["rank"]
    import transformers

    assert (f"transformers version: {transformers.__version__!r} on rank {1 - other} "
            f"(host ") in text, text
    assert f"{OTHER_VERSION!r} on rank {other} (host " in text, text
    assert "model config (hash)" in text, text
    for same in ("torch version", "shardwise version", "parameter names",
                 "inference settings (hash"):
        assert same not in text, text
    assert "RankMismatchError" in _logs(tmp_path)


# ----- the start-up check on two local ranks ----------------------------------------------------

#: what rank 1 changes -> the line the error must contain (None: the ranks agree)
LOCAL_CASES = {
    "same": None,
    "torch": "torch version: ",
    "model": "model class: 'LlamaForCausalLM' on rank 0 (host ",
    "settings": "inference settings (hash of tp_size",
}


def _local_fingerprint(rank: int, change: str) -> dict:
    """This rank's fingerprint for case ``change`` (rank 1 applies the change)."""
    import torch

    import shardwise
    from models import tiny_causal_lm
    from shardwise.launch.startup_check import fingerprint

    changed = rank == 1 and change
    model = tiny_causal_lm("gpt2" if changed == "model" else "llama")
    cfg = shardwise.InferenceConfig.build(None, device="cpu", dtype=torch.float32,
                                          tensor_parallel={"tp_size": 1 if changed == "settings"
                                                           else 2})
    fp = fingerprint(model, cfg)
    if changed == "torch":
        fp["torch"] = "2.0.0"
    return fp


def _local_checks(rank: int) -> dict[str, str | None]:
    """Every case of :data:`LOCAL_CASES` over one communicator: case -> error text or None."""
    sys.path.insert(0, str(TESTS_DIR))
    import shardwise
    from shardwise.communicator import create_communicator
    from shardwise.launch.startup_check import RankMismatchError, check_ranks_agree

    comm = create_communicator(shardwise.get_accelerator("cpu"))
    out = {}
    try:
        for change in LOCAL_CASES:
            try:
                check_ranks_agree(comm, _local_fingerprint(rank, change))
                out[change] = None
            except RankMismatchError as exc:
                out[change] = str(exc)
    finally:
        comm.close()
    return out


@pytest.mark.slow
def test_start_up_check_on_two_local_ranks_names_what_differs(tmp_path):
    results = run_ranks(_local_checks, 2, tmp_path, deadline_s=120)
    assert all(r["ok"] for r in results), results
    ranks = [r["value"] for r in results]
    for change, named in LOCAL_CASES.items():
        errors = [ranks[0][change], ranks[1][change]]
        if named is None:
            assert errors == [None, None], errors
            continue
        assert errors[0] == errors[1] and named in errors[0], (change, errors)
        assert "Install the same shardwise, torch and transformers on every node" in errors[0]
    model_error = ranks[0]["model"]  # another family: its config and parameters differ as well
    assert "model config (hash)" in model_error and "parameter names" in model_error
    assert "torch version" not in model_error


def test_fingerprint_is_the_same_for_equal_settings_and_names_class_keyed_policies():
    """Equal settings built twice give one fingerprint (an injection_policy keyed by a layer
    class included: it is hashed by the class's name, not its address); another policy, dtype
    or model config changes exactly the entry it belongs to."""
    import torch
    import transformers

    import shardwise
    from models import tiny_causal_lm
    from shardwise.launch.startup_check import fingerprint, mismatches

    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer

    def build(policy=("self_attn.o_proj", "mlp.down_proj"), dtype=torch.float32, theta=None):
        model = tiny_causal_lm("llama")
        if theta is not None:
            model.config.rope_theta = theta
        cfg = shardwise.InferenceConfig.build(None, dtype=dtype, injection_policy={layer: policy},
                                              tensor_parallel={"tp_size": 2})
        return fingerprint(model, cfg)

    base = build()
    assert build() == base and mismatches([base, build()]) == []
    for other, key in ((build(policy=("self_attn.o_proj",)), "settings"),
                       (build(dtype=torch.bfloat16), "settings"),
                       (build(theta=1234.0), "model_config")):
        assert [k for k in base if base[k] != other[k]] == [key]
        assert len(mismatches([base, other])) == 1

"""CpuCommunicator: the shared-memory all_reduce among the ranks of one node.

Results must equal gloo's and be bit-identical on every rank, over many calls in a row (the
sequence / parity logic); tensors over the slot size, other devices' layouts and a disabled path
go to gloo; a dead or silent rank makes the others raise CollectiveError within the timeout; the
/dev/shm segment never outlives set-up.
"""

import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import shardwise
from shardwise.accelerators import cpu_shm_protocol as shm
from shardwise.accelerators.cpu import CpuAccelerator
from shardwise.accelerators.cpu_comm import CpuCommunicator
from shardwise.accelerators.cpu_shm_protocol import ShmSegment
from shardwise.communicator import create_communicator
from distributed import run_ranks, use_next_master_port

pytestmark = pytest.mark.skipif(not shm.memory_order_ok()[0] or not os.path.isdir("/dev/shm"),
                                reason="the shared-memory path runs on x86-64 Linux only")

SLOT = 1 << 20  # slot size the multi-rank tests ask for: 262144 fp32 elements


def _digest(t: torch.Tensor) -> str:
    """Hash of the tensor's bytes (bit-identity across ranks, whatever the dtype)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _comm(timeout_s=30):
    os.environ.pop("OMP_NUM_THREADS", None)
    if not torch.distributed.is_initialized():
        use_next_master_port()  # a fresh store for each new group (see tests/distributed.py)
    return create_communicator(shardwise.get_accelerator("cpu"), timeout_s=timeout_s)


# ----- in one process -----------------------------------------------------------------------------

def test_cpu_accelerator_picks_the_cpu_communicator():
    assert CpuAccelerator().communicator_class() is CpuCommunicator


def test_env_settings(monkeypatch):
    monkeypatch.delenv(shm.ENABLE_ENV, raising=False)
    assert shm.env_setting() is True
    for off in ("0", "off", "False"):
        monkeypatch.setenv(shm.ENABLE_ENV, off)
        assert shm.env_setting() is False
        assert shm.ENABLE_ENV in shm.local_refusal()
    monkeypatch.setenv(shm.ENABLE_ENV, "maybe")
    with pytest.raises(shardwise.ConfigError, match=shm.ENABLE_ENV):
        shm.env_setting()
    monkeypatch.setenv(shm.SLOT_BYTES_ENV, "5000")
    assert shm.slot_bytes_setting() == 8192  # rounded up to whole pages
    monkeypatch.setenv(shm.SLOT_BYTES_ENV, "lots")
    with pytest.raises(shardwise.ConfigError, match=shm.SLOT_BYTES_ENV):
        shm.slot_bytes_setting()
    monkeypatch.delenv(shm.SLOT_BYTES_ENV)
    assert shm.slot_bytes_setting() is None


def test_default_slot_shrinks_to_fit_dev_shm():
    assert shm.default_slot_bytes(2, 24 << 30) == 4 << 20
    # a container's 64 MiB /dev/shm and 8 ranks: 2 x 8 x slot <= 16 MiB
    assert shm.default_slot_bytes(8, 64 << 20) == 1 << 20
    assert shm.default_slot_bytes(8, 1 << 20) == 64 << 10  # floor


def test_segment_create_open_unlink():
    seg, token = ShmSegment.create("test", 2, 8192)
    try:
        assert os.path.exists(seg.path) and seg.path.startswith("/dev/shm/shardwise-allreduce-")
        other = ShmSegment.open(seg.path, 2, 8192, token)
        a = seg.slot(1, 1, torch.float32, (2, 3))
        b = other.slot(1, 1, torch.float32, (2, 3))
        a.copy_(torch.arange(6.0).reshape(2, 3))
        assert torch.equal(b, a)  # two mappings, one memory
        with pytest.raises(ValueError, match="another segment"):
            ShmSegment.open(seg.path, 2, 8192, token + 1)
        del a, b
        other.close()
    finally:
        seg.close()
    assert not os.path.exists(seg.path)


def _my_segments() -> list[str]:
    """Names in /dev/shm of segments this process created (its pid is in the name)."""
    return [n for n in os.listdir("/dev/shm")
            if n.startswith(shm.SEGMENT_PREFIX) and f"-p{os.getpid()}-" in n]


def test_segment_name_holds_the_creator():
    seg, token = ShmSegment.create("test", 2, 8192)
    try:
        name = os.path.basename(seg.path)
        start = shm.process_start_time(os.getpid())
        assert name == (f"shardwise-allreduce-test-n{shm.pid_namespace()}-p{os.getpid()}-"
                        f"s{start}-{token:016x}")
        assert _my_segments() == [name]
        assert seg.path not in shm.sweep_dead_segments()  # its creator (we) is alive
        assert os.path.exists(seg.path)
    finally:
        seg.close()
    assert _my_segments() == []


KILLED_CREATOR = """\
import os, signal
from shardwise.accelerators.cpu_shm_protocol import ShmSegment
seg, _ = ShmSegment.create("test", 2, 8192)
print(seg.path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # dies between creating and unlinking: no atexit runs
"""


def test_segment_of_a_killed_creator_is_swept_at_the_next_creation(tmp_path):
    """Defect 11: a rank killed between creating the segment and unlinking it left 16 MiB in
    /dev/shm forever; the next creation on the machine now removes it."""
    proc = subprocess.run([sys.executable, "-c", KILLED_CREATOR], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    leaked = proc.stdout.strip()
    assert leaked.startswith("/dev/shm/shardwise-allreduce-test-") and os.path.exists(leaked)
    try:
        seg, _ = ShmSegment.create("test", 2, 8192)
        seg.close()
        assert not os.path.exists(leaked), "the dead creator's segment was not swept"
    finally:
        if os.path.exists(leaked):
            os.unlink(leaked)


def test_sweep_judges_only_names_it_can_trust(tmp_path):
    """In a scratch folder: dead creator (swept), pid reused by another process (swept), live
    creator, another PID namespace, unknown start time, foreign names (all kept)."""
    me, ns = os.getpid(), shm.pid_namespace()
    start = shm.process_start_time(me)
    child = subprocess.Popen(["true"])
    child.wait()  # an exited, reaped pid
    names = {
        "dead": f"shardwise-allreduce-1-n{ns}-p{child.pid}-s123-{1:016x}",
        "reused": f"shardwise-allreduce-1-n{ns}-p{me}-s{start + 1}-{2:016x}",
        "alive": f"shardwise-allreduce-1-n{ns}-p{me}-s{start}-{3:016x}",
        "other_ns": f"shardwise-allreduce-1-n{ns + 1}-p{child.pid}-s123-{4:016x}",
        "no_start": f"shardwise-allreduce-1-n{ns}-p{child.pid}-s0-{5:016x}",
        "old_scheme": f"shardwise-allreduce-29500-{6:016x}",
        "not_ours": "psm_shm.1234",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    removed = shm.sweep_dead_segments(str(tmp_path))
    assert sorted(removed) == sorted(str(tmp_path / names[k]) for k in ("dead", "reused"))
    assert sorted(os.listdir(tmp_path)) == sorted(
        names[k] for k in ("alive", "other_ns", "no_start", "old_scheme", "not_ours"))


def test_process_liveness_sees_exit_and_zombies():
    me = os.getpid()
    assert shm.process_alive(me, shm.process_start_time(me))
    assert not shm.process_alive(me, shm.process_start_time(me) + 1)  # pid reused
    child = subprocess.Popen(["sleep", "30"])
    start = shm.process_start_time(child.pid)
    assert shm.process_alive(child.pid, start)
    child.kill()
    time.sleep(0.2)  # exited but not reaped: a zombie, which kill(pid, 0) would call alive
    assert not shm.process_alive(child.pid, start)
    child.wait()
    assert not shm.process_alive(child.pid, start)


def test_reduce_order_is_rank_order():
    """Three bf16 operands accumulate in fp32, so the result is not the chained bf16 sum."""
    slots = [torch.tensor([256.0], dtype=torch.bfloat16), torch.tensor([1.0], dtype=torch.bfloat16),
             torch.tensor([1.0], dtype=torch.bfloat16)]
    out = torch.empty(1, dtype=torch.bfloat16)
    shm.reduce_into(out, slots, "sum")
    assert out.item() == 258.0  # bf16 chain: (256 + 1) rounds to 256, + 1 -> 256 again
    shm.reduce_into(out, slots, "max")
    assert out.item() == 256.0


# ----- on 2 ranks ---------------------------------------------------------------------------------

def _matches_gloo(rank):
    os.environ[shm.SLOT_BYTES_ENV] = str(SLOT)
    comm = _comm()
    assert comm.shm_enabled, comm.shm_reason
    seg_path = comm._shm.segment.path
    # rank 0 (the creator) has unlinked the name before its set-up returned
    names_after_setup = _my_segments() + ([seg_path] if rank == 0 and os.path.exists(seg_path)
                                          else [])
    comm.all_reduce(torch.ones(1))  # after one call every rank is past rank 0's set-up (unlink)
    out = {"limit": comm.shm_max_bytes, "linked_after_setup": os.path.exists(seg_path),
           "names_after_setup": names_after_setup, "cases": {}}
    for dtype in (torch.float32, torch.bfloat16):
        limit = comm.shm_max_bytes // dtype.itemsize
        for numel in (1, 7, 1024, 4096, limit, limit + 1):
            gen = torch.Generator().manual_seed(1000 * rank + numel)
            x = torch.randn(numel, generator=gen).to(dtype)  # [numel], different on each rank
            for op in ("sum", "max", "min", "product", "avg"):
                got = comm.all_reduce(x.clone(), op=op)
                path = comm.last_path
                want = comm.gloo_all_reduce(x.clone(), op=op)
                exact = torch.equal(got, want)
                close = torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-6)
                out["cases"][f"{dtype} {numel} {op}"] = [path, exact, close, _digest(got)]
    # other shapes and layouts: a 2-D tensor, a transposed (non-contiguous) view, grad leaf
    m = torch.arange(12.0).reshape(3, 4) * (rank + 1)  # [3, 4]: rank 0 k, rank 1 2k
    out["2d"] = comm.all_reduce(m.clone()).tolist()
    out["transposed"] = comm.all_reduce(m.clone().t()).tolist()
    g = torch.ones(5, requires_grad=True)
    comm.all_reduce(g)
    out["grad_leaf"] = g.tolist()
    # torch.inference_mode: a shape first seen inside it, then reused outside; and an inference
    # tensor reduced outside the mode (gloo accepts both, so must the shm path)
    with torch.inference_mode():
        inf = torch.ones(6)  # [6], an inference tensor
        comm.all_reduce(inf)
    normal = torch.ones(6)
    comm.all_reduce(normal)
    comm.all_reduce(inf)
    out["inference_mode"] = [inf.tolist(), normal.tolist()]
    out["path"] = comm.last_path
    # 200 calls in a row, every call's values differ, each filling a whole slot (copies take
    # long enough that a flag published before its data, or a slot overwritten too early, shows)
    bad = []
    base = torch.arange(SLOT // 4, dtype=torch.float32)  # [262144]
    for i in range(200):
        x = base + 1000.0 * i + 7.0 * rank
        comm.all_reduce(x)
        if not torch.equal(x, 2 * base + 2000.0 * i + 7.0):
            bad.append(i)
    out["repeat_bad"] = bad
    # ranks passing different sizes is an error, not garbage (and the path goes on working)
    try:
        comm.all_reduce(torch.ones(10 + rank))
        out["mismatch"] = None
    except shardwise.CollectiveError as exc:
        out["mismatch"] = str(exc)
    out["after_mismatch"] = comm.all_reduce(torch.ones(3)).tolist()
    out["counts"] = dict(comm.path_counts)
    comm.close()
    out["linked_after_close"] = os.path.exists(seg_path)
    out["port_files"] = glob.glob(f"/dev/shm/shardwise-allreduce-{os.environ['MASTER_PORT']}-*")
    return out


def _two_rank_suite(rank):
    """Both 2-rank scenarios in one pair of processes (each spawn costs seconds of imports)."""
    return {"matches_gloo": _matches_gloo(rank), "fallbacks": _fallbacks(rank)}


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    # a generous deadline: only a hang should reach it, not a loaded 2-core CI machine
    results = run_ranks(_two_rank_suite, 2, tmp_path_factory.mktemp("two_ranks"),
                        deadline_s=180)
    errors = [f"rank {r}: {res.get('trace', res.get('error'))}"
              for r, res in enumerate(results) if not res["ok"]]
    assert not errors, "\n".join(errors)
    return [res["value"] for res in results]


def test_shm_all_reduce_matches_gloo_on_two_ranks(two_rank_results):
    r0, r1 = (v["matches_gloo"] for v in two_rank_results)
    assert r0["limit"] == SLOT
    for case, (path, exact, close, digest) in r0["cases"].items():
        dtype, numel, op = case.split()
        over = int(numel) * (4 if dtype == "torch.float32" else 2) > SLOT
        assert path == ("gloo" if over else "shm"), case
        if op == "avg":
            assert close, f"{case}: avg differs from gloo's beyond rounding"
        else:
            assert exact, f"{case}: differs from gloo's result"
        assert r1["cases"][case][3] == digest, f"{case}: ranks hold different bits"
    rows = [[2.0 * (4 * i + j) * 1.5 for j in range(4)] for i in range(3)]  # k + 2k = 3k
    for v in (r0, r1):
        assert v["2d"] == [[3.0 * (4 * i + j) for j in range(4)] for i in range(3)] == rows
        assert v["transposed"] == [list(col) for col in zip(*rows)]
        assert v["grad_leaf"] == [2.0] * 5
        assert v["inference_mode"] == [[4.0] * 6, [2.0] * 6]
        assert v["path"] == "shm"
        assert v["repeat_bad"] == [], "repeated calls returned wrong sums"
        assert "different tensors" in v["mismatch"] and "rank 1: 11 x float32" in v["mismatch"]
        assert v["after_mismatch"] == [2.0] * 3
        assert v["counts"]["shm"] > 200 and v["counts"]["gloo"] > 0
        assert not v["linked_after_setup"], "the segment should be unlinked once all mapped it"
        assert v["names_after_setup"] == [], "set-up returned with the segment still named"
        assert not v["linked_after_close"] and v["port_files"] == []


def _fallbacks(rank):
    os.environ.pop(shm.SLOT_BYTES_ENV, None)
    os.environ[shm.ENABLE_ENV] = "0"
    off = _comm()
    x = off.all_reduce(torch.ones(8))
    out = {"off_reason": off.shm_reason, "off_enabled": off.shm_enabled,
           "off_path": off.last_path, "off_sum": x.tolist(), "off_counts": dict(off.path_counts)}
    # enabled again, but rank 1 cannot map the segment: everyone falls back, nothing is left
    os.environ[shm.ENABLE_ENV] = "1"
    real_open = ShmSegment.open
    if rank == 1:
        def broken_open(*args, **kwargs):
            raise PermissionError("pretend /dev/shm belongs to someone else")
        ShmSegment.open = broken_open
    half = _comm()
    ShmSegment.open = real_open
    out["half_reason"] = half.shm_reason
    out["half_sum"] = half.all_reduce(torch.ones(8)).tolist()
    out["half_path"] = half.last_path
    out["port_files"] = glob.glob(f"/dev/shm/shardwise-allreduce-{os.environ['MASTER_PORT']}-*")
    on = _comm()
    out["on_sum"] = on.all_reduce(torch.ones(8)).tolist()
    out["on_path"] = on.last_path
    on.close()
    return out


def test_disabled_or_unmappable_means_gloo(two_rank_results):
    for v in (v["fallbacks"] for v in two_rank_results):
        assert not v["off_enabled"] and "SHARDWISE_CPU_SHM_ALLREDUCE=0" in v["off_reason"]
        assert v["off_path"] == "gloo" and v["off_counts"] == {"shm": 0, "gloo": 1}
        assert v["off_sum"] == [2.0] * 8
        assert "rank 1 could not map" in v["half_reason"] and "someone else" in v["half_reason"]
        assert v["half_path"] == "gloo" and v["half_sum"] == [2.0] * 8
        assert v["port_files"] == [], "a failed set-up left its segment in /dev/shm"
        assert v["on_path"] == "shm" and v["on_sum"] == [2.0] * 8


def _three_rank_correctness(rank, comm) -> dict:
    out = {"enabled": comm.shm_enabled}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(1000, generator=gen).to(dtype)  # [1000]
        got = comm.all_reduce(x.clone())
        want = comm.gloo_all_reduce(x.clone())
        ref = sum(torch.randn(1000, generator=torch.Generator().manual_seed(r)).to(dtype).float()
                  for r in range(3))  # fp32 sum in rank order: what the shm path must give
        out[str(dtype)] = [_digest(got), torch.equal(got, ref.to(dtype)),
                           torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)]
    out["repeat_bad"] = []
    for i in range(50):
        x = torch.full((64,), float(i + rank))
        comm.all_reduce(x)
        if not torch.equal(x, torch.full((64,), float(3 * i + 3))):
            out["repeat_bad"].append(i)
    return out


def _call(comm, tensor) -> tuple[str | None, float]:
    """all_reduce; returns (the CollectiveError's text or None, seconds taken)."""
    start = time.monotonic()
    try:
        comm.all_reduce(tensor)
        error = None
    except shardwise.CollectiveError as exc:
        error = str(exc)
    return error, time.monotonic() - start


STALL_TIMEOUT_S = 1.0
DEAD_TIMEOUT_S = 10.0


def _three_rank_suite(rank, out_dir):
    """3 ranks on 2 cores (the waits must yield): correctness, then a silent rank, then a dead
    one, in one set of processes (each spawn costs seconds of imports). Results are written to
    ``out_dir`` as they come, since rank 2 ends by dying."""
    os.environ[shm.SLOT_BYTES_ENV] = str(SLOT)
    out = {}

    def save():
        Path(out_dir, f"suite{rank}.json").write_text(json.dumps(out))

    comm = _comm()  # owns the process group: left open, the later communicators reuse it
    out["correct"] = _three_rank_correctness(rank, comm)
    save()
    # a silent rank: rank 1 arrives STALL_TIMEOUT_S + 1.5 s late
    stall = _comm(STALL_TIMEOUT_S)
    stall.all_reduce(torch.ones(4))
    if rank == 1:
        time.sleep(STALL_TIMEOUT_S + 1.5)
    out["stall"] = _call(stall, torch.ones(4))
    out["stall_again"] = _call(stall, torch.ones(4))[0]
    save()
    # a dead rank: rank 2 exits after set-up (the gloo set-up also brings rank 1 back in step)
    dead = _comm(DEAD_TIMEOUT_S)
    dead.all_reduce(torch.ones(4))
    out["dead_path"] = dead.last_path
    if rank == 2:
        save()
        os._exit(3)
    out["dead"] = _call(dead, torch.ones(4))
    save()
    return "done"


@pytest.fixture(scope="module")
def three_rank_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("three_ranks")
    results = run_ranks(_three_rank_suite, 3, tmp, str(tmp), deadline_s=180)
    for res in results[:2]:
        assert res["ok"], res.get("trace", res["error"])
    assert "exit code 3" in results[2]["error"], results[2]
    return [json.loads(Path(tmp, f"suite{r}.json").read_text()) for r in range(3)]


def test_three_ranks_sum_in_rank_order(three_rank_results):
    values = [v["correct"] for v in three_rank_results]
    for v in values:
        assert v["enabled"] and v["repeat_bad"] == []
        for dtype in ("torch.float32", "torch.bfloat16"):
            digest, is_rank_order_sum, near_gloo = v[dtype]
            assert is_rank_order_sum and near_gloo, dtype
            assert digest == values[0][dtype][0], f"{dtype}: ranks hold different bits"


def test_silent_rank_times_out_and_late_rank_fails_too(three_rank_results):
    for rank in (0, 2):
        error, seconds = three_rank_results[rank]["stall"]
        assert error, f"rank {rank}'s all_reduce succeeded although rank 1 never joined it"
        assert f"all_reduce failed on rank {rank}/3" in error and "rank(s) [1]" in error
        assert f"timed out after {STALL_TIMEOUT_S:g}s" in error
        assert "another rank probably died" in error.lower()
        assert STALL_TIMEOUT_S <= seconds < STALL_TIMEOUT_S + 3
        # the path stays failed rather than running out of step
        assert "already failed" in three_rank_results[rank]["stall_again"]
    # rank 1 arrives late, finds the others gave up: fails at once, not after its own timeout
    error, seconds = three_rank_results[1]["stall"]
    assert error and "aborted" in error and seconds < 1


def test_dead_rank_fails_the_others_fast(three_rank_results):
    for rank in (0, 1):
        v = three_rank_results[rank]
        assert v["dead_path"] == "shm"
        error, seconds = v["dead"]
        assert error, f"rank {rank}'s all_reduce succeeded although rank 2 was dead"
        assert f"all_reduce failed on rank {rank}/3" in error and "[2]" in error
        assert "has exited" in error and f"timeout {DEAD_TIMEOUT_S:g}s" in error
        assert seconds < 3, "a dead rank should be noticed well before the timeout"

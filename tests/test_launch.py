"""``shardwise launch`` / ``python -m shardwise.launch``: ranks started through torch's elastic
launcher, each with the accelerator's settings applied before the script runs; bad input refused
before any rank starts; a failing rank fails the launch; multi-node through torchrun's options.

Every launch runs in a subprocess with a timeout, so nothing can hang the suite."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch.distributed.run

from shardwise.accelerator import Accelerator, visible_device_for_rank
from shardwise.cli import main as cli_main
from shardwise.errors import ConfigError
import shardwise.launch as launch_mod
from shardwise.launch import (RANK_ENTRY, build_parser, main as launch_main, resolve_nproc,
                              torchrun_args)
from shardwise.launch.environment import (USER_ENV_MARKER, describe_ranks, rank_environment,
                                          uniform_environment, user_set_names)
from distributed import free_port

CORES = len(os.sched_getaffinity(0))
TIMEOUT_S = 90
needs_two_cores = pytest.mark.skipif(CORES < 2, reason="two CPU ranks need two usable cores")

#: Writes what the rank got to $LAUNCH_TEST_OUT/rank<R>.json after one all_reduce of rank + 1.
RANK_SCRIPT = textwrap.dedent("""\
    import json, os, sys
    import torch
    import shardwise
    from shardwise.communicator import create_communicator

    comm = create_communicator(shardwise.get_accelerator())
    total = comm.all_reduce(torch.tensor([float(comm.rank + 1)])).item()
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "SHARDWISE_ACCELERATOR")
    record = {name: os.environ.get(name) for name in names}
    record.update(threads=torch.get_num_threads(), argv=sys.argv, sum=total)
    out = os.path.join(os.environ["LAUNCH_TEST_OUT"], f"rank{os.environ['RANK']}.json")
    with open(out, "w") as fh:
        json.dump(record, fh)
    comm.close()
""")


def _env(tmp_path, **extra: str) -> dict[str, str]:
    """The environment of a launch: no inherited thread or accelerator settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "SHARDWISE_ACCELERATOR", USER_ENV_MARKER)}
    return {**env, "LAUNCH_TEST_OUT": str(tmp_path), **extra}


def _run(cmd: list[str], tmp_path, **extra: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ``tmp_path`` with a deadline; stdout and stderr together in ``.stdout``."""
    return subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path, **extra), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)


def _script(tmp_path, name: str = "script.py", text: str = RANK_SCRIPT) -> str:
    (tmp_path / name).write_text(text)
    return name


def _ranks(tmp_path, world_size: int) -> list[dict]:
    """Every rank's record, in rank order; fails naming the ranks that wrote none."""
    missing = [r for r in range(world_size) if not (tmp_path / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} did not run"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


def _check_two_ranks(proc, tmp_path, threads: int) -> list[dict]:
    """The checks every successful 2-rank CPU launch must pass."""
    assert proc.returncode == 0, proc.stdout
    ranks = _ranks(tmp_path, 2)
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) for r in ranks] == [
        ("0", "0", "2"), ("1", "1", "2")]
    assert all(r["argv"] == ["script.py", "a", "b"] for r in ranks)
    assert all(r["OMP_NUM_THREADS"] == str(threads) and r["threads"] == threads for r in ranks)
    assert all(r["SHARDWISE_ACCELERATOR"] == "cpu" for r in ranks)
    assert all(r["sum"] == 3.0 for r in ranks)  # 1 + 2 over gloo
    assert proc.stdout.count("shardwise launch: 2 ranks on cpu") == 1  # rank 0 only, once
    return ranks


# ----- launches ---------------------------------------------------------------------------------

@needs_two_cores
def test_cli_launch_splits_cores_and_runs_every_rank(tmp_path):
    proc = _run(["shardwise", "launch", "--nproc-per-node", "2", "--device", "cpu",
                 _script(tmp_path), "a", "b"], tmp_path)
    _check_two_ranks(proc, tmp_path, threads=max(1, CORES // 2))
    assert f"each rank: OMP_NUM_THREADS={max(1, CORES // 2)}" in proc.stdout


@needs_two_cores
def test_python_m_launch_works_the_same_and_reads_the_accelerator_from_env(tmp_path):
    proc = _run([sys.executable, "-m", "shardwise.launch", "--nproc-per-node", "2",
                 _script(tmp_path), "a", "b"], tmp_path, SHARDWISE_ACCELERATOR="cpu")
    _check_two_ranks(proc, tmp_path, threads=max(1, CORES // 2))


@needs_two_cores
def test_user_set_thread_count_is_kept_in_every_rank(tmp_path):
    mine = CORES + 1  # differs from both shardwise's split and torchrun's default of 1
    proc = _run(["shardwise", "launch", "--nproc-per-node", "2", "--device", "cpu",
                 _script(tmp_path), "a", "b"], tmp_path, OMP_NUM_THREADS=str(mine))
    _check_two_ranks(proc, tmp_path, threads=mine)
    assert f"OMP_NUM_THREADS={mine} (yours)" in proc.stdout


def test_one_rank_gets_every_core_and_module_mode_works(tmp_path):
    """One rank: torchrun sets no thread count, so OMP_NUM_THREADS comes from the accelerator;
    ``-m`` runs a module from the working directory with its own argv."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    _script(tmp_path, "pkg/job.py")
    proc = _run(["shardwise", "launch", "--nproc-per-node", "1", "--device", "cpu",
                 "-m", "pkg.job", "x"], tmp_path)
    assert proc.returncode == 0, proc.stdout
    (rank,) = _ranks(tmp_path, 1)
    assert rank["OMP_NUM_THREADS"] == str(CORES) and rank["threads"] == CORES
    assert rank["argv"] == [str(tmp_path / "pkg" / "job.py"), "x"]
    assert rank["WORLD_SIZE"] == "1" and rank["sum"] == 1.0


@needs_two_cores
def test_a_rank_that_raises_fails_the_launch_with_its_error(tmp_path):
    bad = _script(tmp_path, "bad.py", textwrap.dedent("""\
        import os
        if os.environ["RANK"] == "1":
            raise ValueError("rank one broke on purpose")
    """))
    proc = _run(["shardwise", "launch", "--nproc-per-node", "2", "--device", "cpu", bad],
                tmp_path)
    assert proc.returncode != 0
    assert "ValueError: rank one broke on purpose" in proc.stdout
    assert "bad.py failed on rank 1 (exit code 1)" in proc.stdout


def test_no_python_mode_execs_the_program_with_the_settings(tmp_path):
    proc = _run(["shardwise", "launch", "--nproc-per-node", "1", "--device", "cpu",
                 "--no-python", "sh", "-c", "echo got $OMP_NUM_THREADS $SHARDWISE_ACCELERATOR"],
                tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert f"got {CORES} cpu" in proc.stdout


def test_two_nodes_through_torchruns_static_rendezvous(tmp_path):
    """Two launchers on this host as node 0 and node 1 (--nnodes 2 --node-rank --master-addr
    --master-port): one world of two ranks, one per node."""
    port = str(free_port())
    script = _script(tmp_path)

    def node(rank: int) -> subprocess.Popen:
        cmd = ["shardwise", "launch", "--nnodes", "2", "--node-rank", str(rank), "--master-addr",
               "127.0.0.1", "--master-port", port, "--nproc-per-node", "1", "--device", "cpu",
               script, "a", "b"]
        return subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    nodes = [node(0), node(1)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], outputs
    ranks = _ranks(tmp_path, 2)
    assert [(r["RANK"], r["LOCAL_RANK"], r["WORLD_SIZE"]) for r in ranks] == [
        ("0", "0", "2"), ("1", "0", "2")]
    assert all(r["sum"] == 3.0 and r["OMP_NUM_THREADS"] == str(CORES) for r in ranks)
    assert "2 ranks on cpu (1 per node x 2 nodes)" in "".join(outputs)


# ----- the per-rank entry -----------------------------------------------------------------------

@pytest.mark.parametrize("recorded, expected", [("", max(1, CORES // 2)), ("OMP_NUM_THREADS", 7)])
def test_rank_entry_replaces_torchruns_default_but_not_yours(tmp_path, recorded, expected):
    """Started as torchrun would start it with OMP_NUM_THREADS=7 already in the environment: the
    launcher's record says whether that 7 was yours (kept) or a default (replaced); torch's
    thread count follows either way, although torch read 7 at start-up."""
    script = _script(tmp_path, "probe.py", textwrap.dedent("""\
        import json, os, torch
        print(json.dumps([os.environ["OMP_NUM_THREADS"], torch.get_num_threads()]))
    """))
    proc = _run([sys.executable, "-m", RANK_ENTRY, "--device", "cpu", script], tmp_path,
                OMP_NUM_THREADS="7", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", RANK="1",
                **{USER_ENV_MARKER: recorded})
    assert proc.returncode == 0, proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [str(expected), expected]


# ----- bad input: refused before any rank starts ------------------------------------------------

@pytest.fixture
def no_ranks(monkeypatch):
    """Fails the test if torch's launcher is ever called."""
    calls = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: calls.append(args))
    yield calls
    assert calls == [], "ranks were started despite bad input"


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "2", "missing.py"], "script 'missing.py' not found"),
    (["--nproc-per-node", str(CORES + 1), "--device", "cpu", "SCRIPT"],
     f"--nproc-per-node {CORES + 1} is more than cpu can host on this node: at most {CORES} "
     f"rank"),
    (["--nproc-per-node", "0", "--device", "cpu", "SCRIPT"], "must be at least 1"),
    (["--nproc-per-node", "gpu", "--device", "cpu", "SCRIPT"], "a whole number or 'auto'"),
    (["--nproc-per-node", "1", "--device", "no-such-device", "SCRIPT"],
     "unknown device 'no-such-device'; installed accelerator plugins:"),
    (["--nproc-per-node", "1", "-m", "no_such_module_here"], "module 'no_such_module_here'"),
    # torchrun options torch's launcher answers with an assertion traceback or a hang
    (["--nproc-per-node", "1", "--nnodes", "2:1", "SCRIPT"],
     "--nnodes must be a number of nodes N >= 1 or a range MIN:MAX with 1 <= MIN <= MAX, got "
     "'2:1'"),
    (["--nproc-per-node", "1", "--nnodes", "0", "SCRIPT"], "--nnodes must be"),
    (["--nproc-per-node", "1", "--nnodes", "1:2:3", "SCRIPT"], "--nnodes must be"),
    (["--nproc-per-node", "1", "--max-restarts", "-1", "SCRIPT"],
     "--max-restarts must be 0 or more, got -1"),
    (["--nproc-per-node", "1", "--monitor-interval", "0", "SCRIPT"],
     "--monitor-interval must be more than 0 seconds"),
    (["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "5", "SCRIPT"],
     "--node-rank 5 is not a node of --nnodes 2: node ranks are 0 .. 1"),
    (["--nproc-per-node", "1", "--master-port", "70000", "SCRIPT"],
     "--master-port must be a TCP port from 0 to 65535, got 70000"),
])
def test_bad_input_exits_non_zero_before_starting_ranks(tmp_path, monkeypatch, capsys, no_ranks,
                                                         argv, message):
    monkeypatch.chdir(tmp_path)
    script = _script(tmp_path)
    assert cli_main(["launch", *[script if a == "SCRIPT" else a for a in argv]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise launch: error: ") and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["--rdzv-backend", "nosuch"], "ValueError: The rendezvous backend 'nosuch' is not registered"),
    (["--nnodes", "1", "--rdzv-endpoint", "localhost"], "port is missing in endpoint: localhost"),
])
def test_options_torch_refuses_are_one_line(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    code = cli_main(["launch", "--nproc-per-node", "1", "--device", "cpu", *argv,
                     _script(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    (line,) = [l for l in err.splitlines() if l.startswith("shardwise launch: ")]
    assert line.startswith("shardwise launch: error: torch's launcher refused the options: ")
    assert message in line


def test_master_port_in_use_is_one_line_error(tmp_path):
    """Defect 12: torch's EADDRINUSE traceback becomes one line saying what to do."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _run(["shardwise", "launch", "--nproc-per-node", "1", "--device", "cpu",
                     "--master-addr", "127.0.0.1", "--master-port", str(port),
                     _script(tmp_path)], tmp_path)
    assert proc.returncode == 1, proc.stdout
    assert "Traceback" not in proc.stdout and not list(tmp_path.glob("rank*.json"))
    assert proc.stdout.strip().splitlines()[-1] == (
        f"shardwise launch: error: --master-port {port} is in use on this host (another job, or "
        f"a launcher that has not exited yet, holds it); pick another free port, or on a single "
        f"node omit --master-port (a free one is then chosen)")


def test_port_in_use_message_names_the_option(tmp_path):
    parser = build_parser()
    multi = parser.parse_args(["--nnodes", "2", "--nproc-per-node", "1", "s.py"])
    assert launch_mod.port_in_use_message(multi, 29500).startswith(
        "port 29500 (the default --master-port) is in use on this host")
    c10d = parser.parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400",
                              "--nproc-per-node", "1", "s.py"])
    assert launch_mod.port_in_use_message(c10d, 29400).startswith(
        "port 29400 of --rdzv-endpoint 'h:29400' is in use on this host")
    assert launch_mod._port_in_use(RuntimeError(
        "The server socket has failed to listen on any local network address. port: 29500, "
        "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")) == 29500
    assert launch_mod._port_in_use(RuntimeError("connection reset")) is None


def test_the_cpu_limit_says_why(tmp_path, monkeypatch, capsys, no_ranks):
    monkeypatch.chdir(tmp_path)
    assert launch_main(["--nproc-per-node", str(CORES + 1), "--device", "cpu",
                        _script(tmp_path)], prog="p") == 2
    assert "share its cores" in capsys.readouterr().err


def test_help_shows_torchruns_options_and_shardwises(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["launch", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv-backend",
                   "--rdzv-endpoint", "--max-restarts", "--device"):
        assert option in out, option
    assert out.startswith("usage: shardwise launch")


# ----- argument rewriting and the environment rule ----------------------------------------------

def test_torchrun_args_run_the_rank_entry_and_keep_torchruns_options():
    args = build_parser().parse_args(
        ["--nnodes", "2", "--node-rank", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
         "h0:29400", "--nproc-per-node", "auto", "-m", "pkg.job", "--x", "1"])
    out = torchrun_args(args, "cpu", 3)
    assert (out.nnodes, out.node_rank, out.rdzv_backend, out.rdzv_endpoint) == (
        "2", 1, "c10d", "h0:29400")
    assert (out.module, out.no_python, out.training_script, out.nproc_per_node) == (
        True, False, RANK_ENTRY, "3")
    assert out.training_script_args == ["--device", "cpu", "--module", "pkg.job", "--x", "1"]
    assert args.training_script == "pkg.job"  # the parsed arguments are not modified


class FakeDevices(Accelerator):
    """Two settings: a visible-devices variable (one per rank) and a thread count."""

    name = "fakedev"
    device_type = "cpu"
    visible_devices_env = "FAKE_VISIBLE_DEVICES"

    def device_count(self):
        return 2

    def launch_env(self, local_rank, local_world_size):
        return {self.visible_devices_env: visible_device_for_rank(
            self.visible_devices_env, local_rank, local_world_size), "OMP_NUM_THREADS": "4"}


def test_rule_keeps_your_values_but_narrows_your_device_list(monkeypatch):
    acc = FakeDevices()
    monkeypatch.delenv("FAKE_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert user_set_names(acc, 2, os.environ) == []
    assert rank_environment(acc, 1, 2, set()) == {"FAKE_VISIBLE_DEVICES": "1",
                                                 "OMP_NUM_THREADS": "4"}
    assert uniform_environment(acc, 2, set()) == {"OMP_NUM_THREADS": "4"}
    monkeypatch.setenv("FAKE_VISIBLE_DEVICES", "5,7")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    mine = set(user_set_names(acc, 2, os.environ))
    assert mine == {"FAKE_VISIBLE_DEVICES", "OMP_NUM_THREADS"}
    assert rank_environment(acc, 1, 2, mine) == {"FAKE_VISIBLE_DEVICES": "7"}
    line = describe_ranks(acc, 4, 2, mine)
    assert line == ("shardwise launch: 4 ranks on fakedev (2 per node x 2 nodes); "
                    "local rank 0: FAKE_VISIBLE_DEVICES=5, OMP_NUM_THREADS=2 (yours), "
                    "2 torch threads; local rank 1: FAKE_VISIBLE_DEVICES=7, "
                    "OMP_NUM_THREADS=2 (yours), 2 torch threads")


def test_nproc_auto_takes_the_limit_and_more_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setenv("FAKE_VISIBLE_DEVICES", "5,7")
    assert resolve_nproc("auto", FakeDevices()) == 2
    assert resolve_nproc("1", FakeDevices()) == 1
    with pytest.raises(ConfigError, match=r"at most 2 ranks \(one rank per device; 2 visible, "
                                          r"FAKE_VISIBLE_DEVICES='5,7'\)"):
        resolve_nproc("3", FakeDevices())

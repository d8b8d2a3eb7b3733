"""``shardwise launch`` / ``python -m shardwise.launch``: start ranks the way torchrun does, with
each rank set up for its accelerator.

``shardwise launch --nproc-per-node N [torchrun's options] [--device NAME] script.py [args]``

This is torch's own elastic launcher (``torch.distributed.run``): its argument parser and its
``run()``, so every torchrun option works as in torchrun, multi-node included (``--nnodes``,
``--node-rank``, ``--master-addr``/``--master-port``, ``--rdzv-backend``/``--rdzv-endpoint``,
``--max-restarts``, ``-m``/``--module``, ``--no-python``...). What it adds:

* before anything starts, it checks the target exists, resolves the accelerator (``--device``,
  else ``$SHARDWISE_ACCELERATOR``, else detection; unknown names fail with the plugin error) and
  checks ``--nproc-per-node`` against the accelerator's ``max_ranks_per_node()`` (``auto`` takes
  that limit);
* torch's launcher starts :mod:`shardwise.launch.rank_entry` per rank, which applies the
  accelerator's ``launch_env`` for its local rank (visible device per rank, threads per rank;
  the rule for variables you set is in :mod:`shardwise.launch.environment`) and then runs the
  script in the same process. The choice of accelerator reaches the script through
  ``$SHARDWISE_ACCELERATOR``, so ``init_inference`` uses the same one;
* global rank 0 prints one line saying what each rank got.

A rank that fails makes the launch exit non-zero with torch's failure report (the exception of the
first rank that failed is in it); bad input exits with code 2 before any rank starts. Options torch's
launcher would reject with an assertion traceback (``--nnodes 2:1``, ``--max-restarts -1``,
``--monitor-interval 0``) or wait forever on (``--node-rank`` outside ``--nnodes``) are refused up
front; what torch's launcher still refuses (an unknown ``--rdzv-backend``, a bad endpoint) and a
rendezvous port already in use (``EADDRINUSE``) are one-line errors saying what to do, never a
traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.machinery
import importlib.util
import inspect
import os
import re
import shutil
import sys
import traceback
from typing import Iterator

from ..accelerator import Accelerator
from ..errors import ConfigError, ShardwiseError
from ..plugins import ACCELERATOR_ENV, get_accelerator
from .environment import USER_ENV_MARKER, uniform_environment, user_set_names

#: The module torch's launcher runs once per rank.
RANK_ENTRY = "shardwise.launch.rank_entry"

__all__ = ["RANK_ENTRY", "build_parser", "main", "module_command", "resolve_nproc",
           "torchrun_args", "validate"]


def module_command(module: str, args: list[str], nproc_per_node: int, nnodes: int = 1,
                   node_rank: int = 0, master_addr: str | None = None,
                   master_port: int | None = None, device: str | None = None) -> list[str]:
    """The command line that launches ``python -m module args`` on ``nproc_per_node`` ranks
    here (what ``shardwise bench --tp`` and ``shardwise serve --tp`` run): standalone
    rendezvous on one node, static (node rank, master address and port) across several."""
    cmd = [sys.executable, "-m", "shardwise.launch", f"--nproc-per-node={nproc_per_node}",
           f"--nnodes={nnodes}"]
    if device:
        cmd.append(f"--device={device}")
    if nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--node-rank={node_rank}", f"--master-addr={master_addr or 'localhost'}",
                f"--master-port={master_port or 29500}"]
    return [*cmd, "-m", module, *args]


def build_parser(prog: str = "shardwise launch") -> argparse.ArgumentParser:
    """torchrun's own parser, with shardwise's options added in their own group."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = prog
    parser.description = ("Start N ranks per node with torch's elastic launcher (torchrun), each "
                          "set up for the accelerator: its visible device, or its share of the "
                          "CPU cores. Every torchrun option works as in torchrun.")
    parser.epilog = ("Each rank gets the accelerator's launch settings (e.g. CUDA_VISIBLE_DEVICES "
                     "per rank, OMP_NUM_THREADS = usable cores / ranks on the CPU). A variable "
                     "you set yourself keeps your value in every rank, except the visible-devices "
                     "variable: your list is narrowed to one entry per rank.")
    _set_help(parser, "nproc_per_node",
              "ranks on this node: a number, or auto (the accelerator's max_ranks_per_node()); "
              "more than that limit is refused before anything starts")
    group = parser.add_argument_group("shardwise")
    group.add_argument("--device", metavar="NAME",
                       help="accelerator plugin for the ranks (default: $SHARDWISE_ACCELERATOR, "
                            "else detection); passed to the script as $SHARDWISE_ACCELERATOR. "
                            "--nproc-per-node auto takes its max_ranks_per_node()")
    return parser


def _set_help(parser: argparse.ArgumentParser, dest: str, text: str) -> None:
    """Replace the help of torchrun's option ``dest`` where shardwise reads it differently."""
    for action in parser._actions:
        if action.dest == dest:
            action.help = text


def _limit_reason(accelerator: Accelerator) -> str:
    """Why the accelerator hosts so few ranks: one per visible device (the default rule), else
    the first line of the docstring of its own ``max_ranks_per_node``."""
    method = type(accelerator).max_ranks_per_node
    if method is Accelerator.max_ranks_per_node:
        env = accelerator.visible_devices_env
        shown = f", {env}={os.environ[env]!r}" if env and env in os.environ else ""
        return f"one rank per device; {accelerator.device_count()} visible{shown}"
    doc = (inspect.getdoc(method) or "").strip()
    return doc.splitlines()[0].rstrip(".") if doc else "its max_ranks_per_node()"


def resolve_nproc(value: str, accelerator: Accelerator) -> int:
    """The ranks per node ``--nproc-per-node`` asks for (``auto``: the accelerator's limit),
    checked against ``accelerator.max_ranks_per_node()``."""
    limit = accelerator.max_ranks_per_node()
    if str(value).strip() == "auto":
        nproc = limit
    else:
        try:
            nproc = int(value)
        except ValueError:
            raise ConfigError(f"--nproc-per-node must be a whole number or 'auto' (the most "
                              f"{accelerator.name} can host on this node), got {value!r}") from None
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, got {nproc}"
                          + (f" ({accelerator.name} reports no usable device on this node)"
                             if str(value).strip() == "auto" else ""))
    if nproc > limit:
        raise ConfigError(
            f"--nproc-per-node {nproc} is more than {accelerator.name} can host on this node: at "
            f"most {limit} rank{'s' if limit != 1 else ''} ({_limit_reason(accelerator)}). Pass "
            f"--nproc-per-node {limit} or fewer, and add nodes (--nnodes) for more ranks")
    return nproc


def check_target(args: argparse.Namespace) -> None:
    """The script file, module (``-m``) or program (``--no-python``) must exist here."""
    target = args.training_script
    if args.no_python:
        if shutil.which(target) is None:
            raise ConfigError(f"program {target!r} not found (--no-python runs it directly): "
                              f"give its path or put it on PATH")
    elif args.module:
        top = target.split(".")[0]  # only the top level: finding it imports nothing
        if (importlib.util.find_spec(top) is None
                and importlib.machinery.PathFinder.find_spec(top, [os.getcwd()]) is None):
            raise ConfigError(f"module {target!r} not found: {top!r} is not importable from "
                              f"{os.getcwd()} or sys.path (-m runs a module like python -m)")
    elif not os.path.isfile(target):
        raise ConfigError(f"script {target!r} not found (looked in {os.getcwd()}): give the path "
                          f"of a Python file, or use -m for a module")


def _check_modes(args: argparse.Namespace) -> None:
    """Refuse torchrun options that contradict each other or shardwise's per-rank binding."""
    if args.module and args.no_python:
        raise ConfigError("--module and --no-python cannot be used together (as in torchrun)")
    if getattr(args, "virtual_local_rank", False):
        raise ConfigError("--virtual-local-rank is not supported: shardwise launch gives every "
                          "rank its own device itself (the accelerator's launch settings)")


def parse_nnodes(value: str) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` as (min, max) with 0 < min <= max, else ConfigError."""
    parts = str(value).split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        low, high = 0, 0
    if not 0 < low <= high:
        raise ConfigError(f"--nnodes must be a number of nodes N >= 1 or a range MIN:MAX with "
                          f"1 <= MIN <= MAX, got {value!r}")
    return low, high


def check_torchrun_options(args: argparse.Namespace) -> None:
    """Refuse the torchrun options torch's launcher would answer with an assertion traceback, or
    (a node rank outside the nodes) by waiting forever for nodes that never come."""
    _, max_nodes = parse_nnodes(args.nnodes)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if not args.monitor_interval > 0:
        raise ConfigError(f"--monitor-interval must be more than 0 seconds, got "
                          f"{args.monitor_interval}")
    if args.master_port is not None and not 0 <= args.master_port <= 65535:
        raise ConfigError(f"--master-port must be a TCP port from 0 to 65535, got "
                          f"{args.master_port}")
    if args.rdzv_backend == "static" and not args.standalone \
            and not 0 <= args.node_rank < max_nodes:
        raise ConfigError(f"--node-rank {args.node_rank} is not a node of --nnodes "
                          f"{args.nnodes}: node ranks are 0 .. {max_nodes - 1}")


def validate(args: argparse.Namespace) -> tuple[Accelerator, int]:
    """Check everything cheap before any rank starts; the accelerator and ranks per node."""
    _check_modes(args)
    check_torchrun_options(args)
    check_target(args)
    accelerator = get_accelerator(args.device)
    nproc = resolve_nproc(args.nproc_per_node, accelerator)
    for local_rank in range(nproc):  # e.g. a visible-devices list shorter than nproc
        accelerator.launch_env(local_rank, nproc)
    return accelerator, nproc


def torchrun_args(args: argparse.Namespace, device: str, nproc: int) -> argparse.Namespace:
    """torchrun's arguments that run :data:`RANK_ENTRY` per rank, with the user's target (and its
    mode) handed to it; every other torchrun option is passed as given."""
    mode = ["--module"] if args.module else ["--no-python"] if args.no_python else []
    out = copy.copy(args)
    out.nproc_per_node = str(nproc)
    out.module, out.no_python, out.run_path = True, False, False
    out.training_script = RANK_ENTRY
    out.training_script_args = ["--device", device, *mode, args.training_script,
                                *args.training_script_args]
    return out


@contextlib.contextmanager
def launcher_environment(accelerator: Accelerator, nproc: int) -> Iterator[None]:
    """The launcher's environment while torch's launcher runs (restored afterwards): which
    variables are yours (:data:`USER_ENV_MARKER`), the accelerator's name, and the settings
    common to all local ranks (so torch's launcher keeps them instead of its defaults)."""
    saved = dict(os.environ)
    mine = set(user_set_names(accelerator, nproc, os.environ))
    common = uniform_environment(accelerator, nproc, mine)
    os.environ.update({USER_ENV_MARKER: ",".join(sorted(mine)), ACCELERATOR_ENV: accelerator.name,
                       **common})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _failure_line(exc, target: str) -> str:
    """``bad.py failed on rank 1 (exit code 1)``, plus how many other ranks failed."""
    rank, failure = exc.get_first_failure()
    others = len(exc.failures) - 1
    more = f", and on {others} other rank{'s' if others > 1 else ''}" if others > 0 else ""
    return f"{target} failed on rank {rank} (exit code {failure.exitcode}){more}"


def _failure_exit_code(exc) -> int:
    """The exit code of the first failed rank (1 when it was killed by a signal)."""
    _, failure = exc.get_first_failure()
    return failure.exitcode if failure.exitcode > 0 else 1


def _port_in_use(exc: BaseException) -> int | None:
    """The port of a "server socket has failed to listen ... EADDRINUSE" error (-1 when the
    message names none); None for any other error."""
    text = str(exc)
    if "EADDRINUSE" not in text and "address already in use" not in text.lower():
        return None
    found = re.search(r"port: (\d+)", text)
    return int(found.group(1)) if found else -1


def port_in_use_message(args: argparse.Namespace, port: int) -> str:
    """What to do when the rendezvous port is taken, naming the option it came from."""
    shown = port if port >= 0 else "the rendezvous port"
    held = "another job, or a launcher that has not exited yet, holds it"
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        if args.master_port is None:  # torch's default, 29500, on a multi-node launch
            return (f"port {shown} (the default --master-port) is in use on this host ({held}); "
                    f"pass --master-port with a free port, the same on every node")
        return (f"--master-port {shown} is in use on this host ({held}); pick another free "
                f"port, or on a single node omit --master-port (a free one is then chosen)")
    return (f"port {shown} of --rdzv-endpoint {args.rdzv_endpoint!r} is in use on this host "
            f"({held}); pick a free port in --rdzv-endpoint, or on a single node use "
            f"--standalone, which picks one itself")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _launcher_refusal(exc: BaseException) -> str:
    """One line for an error torch's launcher raised on its options: its message, or where it
    was raised when it has none (a bare ``AssertionError``)."""
    text = _first_line(exc)
    if not text:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        text = f"a check failed at {frame.filename}:{frame.lineno} ({frame.line})"
    return f"torch's launcher refused the options: {type(exc).__name__}: {text}"


def launch(args: argparse.Namespace, accelerator: Accelerator, nproc: int) -> int:
    """Run torch's launcher over :data:`RANK_ENTRY`; the exit code (0 when every rank did).

    A rank that fails: its exit code (1 if killed) and torch's report. No rank started: one
    line on stderr, ``shardwise launch: error: ...`` (exit 1 for a port in use or a failed
    rendezvous, 2 for options torch's launcher refused)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import run

    def error(message: str, code: int) -> int:
        print(f"shardwise launch: error: {message}", file=sys.stderr, flush=True)
        return code

    with launcher_environment(accelerator, nproc):
        try:
            run(torchrun_args(args, accelerator.name, nproc))
        except ChildFailedError as exc:
            print(f"shardwise launch: {_failure_line(exc, args.training_script)}; torch's "
                  f"report:\n{exc.format_msg()}", file=sys.stderr, flush=True)
            return _failure_exit_code(exc)
        except RendezvousError as exc:
            return error(f"rendezvous failed ({type(exc).__name__}: {exc}); check --nnodes, "
                         f"--rdzv-endpoint / --master-addr:--master-port and that every node "
                         f"started", 1)
        except (DistError, OSError) as exc:
            port = _port_in_use(exc)
            if port is not None:
                return error(port_in_use_message(args, port), 1)
            if isinstance(exc, DistError):  # the store / rendezvous between the nodes
                return error(f"rendezvous failed ({type(exc).__name__}: {_first_line(exc)}); "
                             f"check --nnodes, --rdzv-endpoint / --master-addr:--master-port "
                             f"and that every node started", 1)
            return error(f"torch's launcher failed: {type(exc).__name__}: {exc}", 1)
        except (AssertionError, ValueError) as exc:
            return error(_launcher_refusal(exc), 2)
    return 0


def main(argv: list[str] | None = None, prog: str = "shardwise launch") -> int:
    """Parse, validate, launch; the exit code (2 for bad input, before any rank starts)."""
    args = build_parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
    try:
        accelerator, nproc = validate(args)
    except ShardwiseError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return launch(args, accelerator, nproc)

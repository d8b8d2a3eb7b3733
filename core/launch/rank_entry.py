"""One rank of ``shardwise launch``: torch's elastic launcher starts this module once per rank.

``python -m shardwise.launch.rank_entry --device NAME [--module | --no-python] TARGET [ARGS...]``

It reads LOCAL_RANK / LOCAL_WORLD_SIZE (set by torch's launcher), applies the accelerator's
launch settings for this rank to ``os.environ`` under the rule of
:mod:`shardwise.launch.environment`, sets torch's thread count from ``OMP_NUM_THREADS`` (torch
reads that variable only at start-up, before this module could set it), prints on global rank 0
a one-line summary of what every rank got, and then runs the target in this same process:
a script through ``runpy.run_path(..., run_name="__main__")``, a module (``--module``) through
``runpy.run_module``, or a program (``--no-python``) through ``exec``. ``sys.argv`` is what
``python TARGET ARGS...`` would give.

Nothing here initialises a device runtime before the settings are applied: the accelerator class
is instantiated without its availability probe (the launcher already checked it), so variables
like ``CUDA_VISIBLE_DEVICES`` take effect when the script first touches the device.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ..accelerator import Accelerator
from ..plugins import ACCELERATOR_ENV, accelerator_plugins, get_accelerator
from .environment import (describe_ranks, launch_names, rank_environment, read_user_set,
                          torch_threads)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The entry's own options, the target and the target's arguments (passed untouched)."""
    parser = argparse.ArgumentParser(prog="python -m shardwise.launch.rank_entry",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", required=True, help="accelerator plugin name")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--module", action="store_true", help="TARGET is a module (python -m)")
    mode.add_argument("--no-python", action="store_true", help="TARGET is a program to exec")
    parser.add_argument("target", help="script path, module name or program")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the target's arguments")
    return parser.parse_args(argv)


def load_accelerator(name: str) -> Accelerator:
    """An instance of plugin ``name`` without running its availability probe (which may
    initialise the device runtime); an unknown or broken plugin raises the usual plugin error."""
    record_ = accelerator_plugins().get(name)
    if record_ is None or not record_.loaded:
        return get_accelerator(name)
    return record_.obj()


def local_ranks() -> tuple[int, int]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) as torch's launcher set them."""
    return int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def user_set(accelerator: Accelerator, local_world_size: int) -> set[str]:
    """Launch variables to keep as they are: those the launcher recorded as yours; without a
    shardwise launcher's record, every one already present (nothing of yours is overridden)."""
    recorded = read_user_set(os.environ)
    if recorded is not None:
        return recorded
    return {n for n in launch_names(accelerator, local_world_size) if n in os.environ}


def apply_settings(accelerator: Accelerator) -> str | None:
    """Apply this rank's settings to ``os.environ`` and torch's thread count; returns the
    summary line on global rank 0 of the first attempt (None elsewhere)."""
    local_rank, local_world = local_ranks()
    mine = user_set(accelerator, local_world)
    summary = None
    if os.environ.get("RANK", "0") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                             "0") == "0":
        # Before applying: the other ranks' settings are computed from the node's environment.
        summary = describe_ranks(accelerator, int(os.environ.get("WORLD_SIZE", local_world)),
                                 local_world, mine)
    os.environ.update(rank_environment(accelerator, local_rank, local_world, mine))
    os.environ[ACCELERATOR_ENV] = accelerator.name
    threads = torch_threads(os.environ)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return summary


def run_target(args: argparse.Namespace) -> None:
    """Run the script, module or program as ``python TARGET ARGS...`` would."""
    if args.no_python:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execvp(args.target, [args.target, *args.args])
    if args.module:
        sys.argv = [args.target, *args.args]  # run_module puts the module's file in argv[0]
        runpy.run_module(args.target, run_name="__main__", alter_sys=True)
        return
    sys.argv = [args.target, *args.args]
    sys.path[0] = os.path.dirname(os.path.abspath(args.target))  # as `python script.py` does
    runpy.run_path(args.target, run_name="__main__")


@record
def main(argv: list[str] | None = None) -> None:
    """Entry point of one rank (``@record``: an exception reaches the launcher's error report)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    summary = apply_settings(load_accelerator(args.device))
    if summary:
        print(summary, file=sys.stderr, flush=True)
    run_target(args)


if __name__ == "__main__":
    main()

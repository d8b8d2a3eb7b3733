"""One rank of ``shardwise bench --tp N``, started by torch's elastic launcher.

``python -m shardwise.bench.worker --spec SPEC.json``: reads the plan, applies the accelerator's
per-rank launch settings (re-executing itself when they change the environment, so settings read
at start-up such as thread counts take effect), runs the shardwise variant of every model and
cell, and writes ``rank<RANK>.json`` into the spec's ``out_dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

#: Set once the worker has re-executed itself with its launch settings (guards against a loop).
_APPLIED_ENV = "SHARDWISE_BENCH_LAUNCH_ENV_APPLIED"


def needed_env(launch_env: dict[str, str], environ: dict[str, str]) -> dict[str, str]:
    """The launch settings ``environ`` does not have yet."""
    return {k: v for k, v in launch_env.items() if environ.get(k) != v}


def apply_launch_env(accelerator, argv: list[str]) -> None:
    """Re-execute this worker with the accelerator's settings for this local rank, if any are
    missing from the environment; returns only when the environment already has them."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    missing = needed_env(accelerator.launch_env(local_rank, local_world), dict(os.environ))
    if not missing or os.environ.get(_APPLIED_ENV):
        return
    env = {**os.environ, **missing, _APPLIED_ENV: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *argv], env)


def run(spec: dict) -> Path:
    """Run the shardwise variant of the spec's plan on this rank; returns the file written."""
    import torch.distributed as dist
    from tqdm import tqdm

    from ..plugins import get_accelerator
    from .plan import Plan
    from .runner import run_local

    plan = Plan.from_dict(spec["plan"])
    accelerator = get_accelerator(plan.device)
    rank = int(os.environ.get("RANK", "0"))
    total = len(plan.models) * len(plan.cells) * (plan.warmup + plan.repeats)
    with tqdm(total=total, unit="gen", disable=rank != 0 or not spec.get("progress", True), file=sys.stderr) as progress:
        records = run_local(plan, accelerator, [plan.variant], progress)
    path = Path(spec["out_dir"]) / f"rank{rank}.json"
    path.write_text(json.dumps({"rank": rank, "runs": records}))
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return path


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m shardwise.bench.worker")
    parser.add_argument("--spec", required=True, help="spec file written by `shardwise bench`")
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())

    from ..plugins import get_accelerator

    apply_launch_env(get_accelerator(spec["plan"]["device"]), argv)
    run(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())

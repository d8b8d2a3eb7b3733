"""One rank of ``shardwise bench --tp N``, started by ``shardwise launch`` (which has already
applied the accelerator's per-rank settings, e.g. threads per rank).

``python -m shardwise.bench.worker --spec SPEC.json``: reads the plan, runs the shardwise variants
on every model and cell, and writes ``rank<RANK>.json`` into the spec's ``out_dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

def run(spec: dict) -> Path:
    """Run the shardwise variants of the spec's plan on this rank; returns the file written."""
    import torch.distributed as dist
    from tqdm import tqdm

    from ..plugins import get_accelerator
    from .plan import Plan
    from .runner import run_local

    plan = Plan.from_dict(spec["plan"])
    accelerator = get_accelerator(plan.device)
    rank = int(os.environ.get("RANK", "0"))
    total = len(plan.models) * len(plan.cells) * len(plan.variants) * (plan.warmup + plan.repeats)
    with tqdm(total=total, unit="gen", disable=rank != 0 or not spec.get("progress", True),
              file=sys.stderr) as progress:
        records = run_local(plan, accelerator, False, plan.variants, progress)
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
    run(json.loads(Path(args.spec).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

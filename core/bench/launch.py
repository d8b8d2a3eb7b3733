"""``--tp N`` / ``--ep N``: run the shardwise variants on the plan's ranks
(:attr:`~.plan.Plan.world`) started through ``shardwise launch`` (torch's elastic launcher with
each rank set up by the accelerator), each rank running :mod:`shardwise.bench.worker`.

The parent writes the plan to a spec file, launches the ranks, and reads back one result file
per rank (``rank<R>.json``). Rank 0's samples are the figures (ranks of a tensor- or
expert-parallel step finish together); a failure on any other rank fails the run with that
rank's error. Each record also keeps every rank's own facts (``ranks``: the bytes its decode
step read — under expert parallelism the experts *it* holds that were routed to — its weights,
peak memory and median step), from which the figures give each rank's GB/s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..accelerator import Accelerator
from ..launch import module_command
from .plan import Plan
from .runner import record
from .stats import median

WORKER_MODULE = "shardwise.bench.worker"


def launch_command(spec_path: str, nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                   master_addr: str | None = None, master_port: int | None = None,
                   device: str | None = None) -> list[str]:
    """The launcher command line of the bench worker (:func:`shardwise.launch.module_command`)."""
    return module_command(WORKER_MODULE, ["--spec", spec_path], nproc_per_node, nnodes,
                          node_rank, master_addr, master_port, device)


def merge_ranks(per_rank: dict[int, list[dict]], plan: Plan, returncode: int) -> list[dict]:
    """Rank 0's records, failed where another rank failed the same run; when rank 0 wrote
    nothing, every run of the variant fails with the launcher's exit code."""
    if 0 not in per_rank:
        error = (f"the launched ranks exited with code {returncode} before writing results; "
                 f"their output is above")
        if returncode == 0 and per_rank:
            error = "rank 0 ran on another node (--node-rank 0): its figures are written there"
        return [record(spec, name, cell, status="failed", error=error, world_size=plan.world)
                for spec in plan.models for name in plan.variant_names for cell in plan.cells]
    merged = [dict(r) for r in per_rank[0]]
    for rank, records in sorted(per_rank.items()):
        for mine, theirs in zip(merged, records):
            if rank and theirs["status"] != "ok" and mine["status"] == "ok":
                mine.update(status="failed", error=f"rank {rank}: {theirs['error']}")
    if len(per_rank) > 1:
        for i, mine in enumerate(merged):
            mine["ranks"] = [rank_facts(rank, records[i]) for rank, records
                             in sorted(per_rank.items()) if i < len(records)]
    return merged


#: A rank's own fields kept in a merged record's ``ranks``.
RANK_FIELDS = ("status", "weight_bytes", "decode_bytes", "decode_bytes_method",
               "peak_memory_bytes")


def rank_facts(rank: int, rec: dict) -> dict:
    """What one rank measured for a run: :data:`RANK_FIELDS` and its median decode step
    (``decode_s``, over its own timed repeats; None without decode steps)."""
    steps = [t for r in rec["samples"]["repeats"] for t in r["per_token_s"]]
    return {"rank": rank, **{k: rec.get(k) for k in RANK_FIELDS},
            "decode_s": median(steps) if steps else None}


def read_rank_files(folder: str | os.PathLike) -> dict[int, list[dict]]:
    """``rank → records`` from the ``rank<R>.json`` files in ``folder``."""
    out = {}
    for path in Path(folder).glob("rank*.json"):
        out[int(path.stem.removeprefix("rank"))] = json.loads(path.read_text())["runs"]
    return out


def run_ranks(plan: Plan, accelerator: Accelerator, nproc_per_node: int,
              rendezvous: dict[str, Any] | None = None, show_progress: bool = True) -> list[dict]:
    """Launch the ranks for the shardwise variants of every model and cell; their records."""
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-") as folder:
        spec = Path(folder) / "spec.json"
        spec.write_text(json.dumps({"plan": plan.to_dict(), "out_dir": folder,
                                    "progress": show_progress}))
        cmd = launch_command(str(spec), nproc_per_node, plan.nnodes, device=accelerator.name,
                             **(rendezvous or {}))
        print(f"launching {plan.world} ranks: {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd)
        return merge_ranks(read_rank_files(folder), plan, proc.returncode)

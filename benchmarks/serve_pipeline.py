"""Serving over pipeline stages: the slot runner's decode step (what ``shardwise serve --pp P``
runs per token) with the running sequences split into M micro-batches, against M = 1 (the
whole step through one stage after the other), in one run.

    python benchmarks/serve_pipeline.py --preset gpt2-24l-1024h --micro-batches 1 2 4 \\
        --slots 8 --steps 16 --output benchmarks/results/serve-pipeline-gpt2-24l-8slots.json

Launches ``--pp`` ranks through ``shardwise launch`` (one thread each). Every rank builds the
preset (random weights, fixed seed) and, for each M, ``init_inference(model,
pipeline_parallel={"pp_size": P, "micro_batches": M}, replace_with_kernel_inject=True)``;
rank 0 drives a :class:`~shardwise.serve.runner.SlotRunner` of ``--slots`` slots (the other
ranks :func:`~shardwise.serve.runner.follow` it), prefills one prompt per slot (the serve load
benchmark's lengths), then times ``--steps`` decode steps over every slot, ``--repeats``
times. Rank 0 prints the median step in ms and the tokens per second (slots / step) per M, and
checks every M's greedy tokens equal M = 1's. M > 1 forces the split
(``SlotRunner(pipeline_split=True)``); the row then also shows what ``pipeline_split="auto"``
(``shardwise serve --pp P --micro-batches M``) picks at warm-up for the batch buckets it times
(an idle step timed whole and split). Eager steps (``--graphs`` captures each micro-batch's step: one compile per
micro-batch and bucket on every rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# benchmarks/: the script's folder (the ranks' launch and results file as the bubble's; one
# prompt length per slot as serve_step's, the serve load benchmark's)
from pipeline_bubble import launch_workers, write_results
from serve_step import PROMPT_LENGTHS


def _run_runner(runner, ids: list[list[int]], steps: int, repeats: int) -> tuple[list, list]:
    """Rank 0: prefill every slot, then ``repeats`` × ``steps`` timed greedy decode steps over
    all of them (slots released and refilled between repeats). Returns (each repeat's median
    step seconds, the last repeat's tokens per slot)."""
    times, tokens = [], []
    slots = list(range(len(ids)))
    for _ in range(repeats):
        tokens = [[int(runner.prefill(s, p, last=True).argmax())] for s, p in enumerate(ids)]
        step_s = []
        for _ in range(steps):
            start = time.perf_counter()
            logits = runner.decode(slots, [t[-1] for t in tokens])
            step_s.append(time.perf_counter() - start)
            for t, row in zip(tokens, logits):
                t.append(int(row.argmax()))
        for s in slots:
            runner.release(s)
        times.append(statistics.median(step_s))
    return times, tokens


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import shardwise
    from shardwise.bench.presets import build_preset
    from shardwise.serve.runner import SlotRunner, follow

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_preset(args.preset, dtype=torch.float32, seed=0)
    g = torch.Generator().manual_seed(1)
    lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(args.slots)]
    ids = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    rows = []
    for m in args.micro_batches:
        pp = {"pp_size": args.pp, **({"micro_batches": m} if m > 1 else {})}
        engine = shardwise.init_inference(model, device="cpu", dtype=args.dtype,
                                          pipeline_parallel=pp, replace_with_kernel_inject=True,
                                          enable_graph=args.graphs,
                                          max_tokens=max(lengths) + args.steps + 1)
        if rank == 0:
            runner = SlotRunner(engine, max_batch=args.slots, pipeline_split=m > 1)
            runner.warmup()
            times, tokens = _run_runner(runner, ids, args.steps, args.repeats)
            runner.close()
            row = dict(m=m, step_s=times, tokens=tokens)
            if m > 1:  # what "auto" (serve --micro-batches M) picks at warm-up, and its timings
                auto = SlotRunner(engine, max_batch=args.slots)
                auto.warmup()
                auto.close()
                row["auto_split"] = {str(b): c for b, c in auto.split_buckets.items()}
                row["auto_seconds"] = {str(b): t for b, t in auto.split_seconds.items()}
            rows.append(row)
        else:
            follow(engine)
            if m > 1:
                follow(engine)
        engine.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def report(rows: list[dict], args: argparse.Namespace) -> int:
    print(f"\n{args.preset} {args.dtype}, PP={args.pp} (1 thread per rank), {args.slots} "
          f"sequences decoding, {args.steps} steps x {args.repeats} repeats, "
          f"{'graphs' if args.graphs else 'eager'} (median step of each repeat; ratio against "
          f"M=1's)")
    print(f"{'M':>3} {'step ms (repeats)':>30} {'tok/s':>8} {'vs M=1':>7}  tokens = M=1")
    base = statistics.median(rows[0]["step_s"])
    bad = 0
    for r in rows:
        step = statistics.median(r["step_s"])
        same = r["tokens"] == rows[0]["tokens"]
        bad += not same
        each = ", ".join(f"{t * 1e3:.1f}" for t in r["step_s"])
        print(f"{r['m']:>3} {step * 1e3:>8.1f} ({each}){'':>1} {args.slots / step:>8.1f} "
              f"{base / step:>6.2f}x  {'yes' if same else 'NO'}")
        if "auto_split" in r:  # the measured buckets (the others follow the one below)
            picks = ", ".join(f"{b} rows {'split' if r['auto_split'][b] else 'whole'} "
                              f"({t[1] * 1e3:.1f} vs {t[0] * 1e3:.1f} ms whole)"
                              for b, t in r["auto_seconds"].items())
            print(f"      auto at warm-up: {picks}")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--preset", default="gpt2-24l-1024h")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4], metavar="M")
    ap.add_argument("--slots", type=int, default=8, help="sequences decoding together")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--output", default="serve_pipeline.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.pp < 2 or min(args.micro_batches) < 1 or args.slots < 1 or args.steps < 1:
        ap.error("--pp must be >= 2; --micro-batches, --slots and --steps >= 1")
    if args.micro_batches[0] != 1:
        ap.error("--micro-batches must start with 1 (the baseline the others are set against)")
    load_before = os.getloadavg()
    rows = launch_workers(__file__, args.pp, sys.argv[1:], args.output)
    code = report(rows, args)
    write_results(args.output, "python benchmarks/serve_pipeline.py " + " ".join(sys.argv[1:]),
                  load_before, [{k: v for k, v in r.items() if k != "tokens"} for r in rows])
    return code

if __name__ == "__main__":
    sys.exit(main())

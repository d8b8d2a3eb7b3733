"""Pipeline bubble: per-stage busy time and the measured bubble against the theoretical
``(P − 1) / (P − 1 + M)``, for M micro-batches over P stages (issue #18). ``shardwise bench
--pp P --micro-batches M`` reports the same figures for one M next to the HF baseline; this
script sweeps several M, forward and generate, with an optional per-layer delay.

Launches ``pp × tp`` ranks through ``shardwise launch`` (torch's elastic launcher) on this node.
Each rank builds the same preset model (random weights, fixed seed) and, for every M in
``--micro-batches``, runs ``init_inference(model, pipeline_parallel={"pp_size": P,
"micro_batches": M}, tensor_parallel={"tp_size": T})`` then, after ``--warmup`` untimed calls,
``--repeats`` timed ones of each mode:

* ``forward``: one forward of the batch without a cache (a prefill), split into M micro-batches;
* ``generate``: greedy ``engine.generate`` of ``--new-tokens`` tokens, every prefill / decode
  step split into M micro-batches, each with its own KV cache per stage.

``engine.pipeline_stats`` gives each stage's busy seconds (inside its own layers) and the wall
time (the slowest rank's, from a common start to its last micro-batch; the broadcast of the
outputs excluded); the bubble of a stage is ``1 − busy / wall``. Rank 0 prints one row per M and
mode (the median repeat by wall time) and writes every repeat to ``--output`` (JSON). The
tokens of every M are checked equal to M = 1's (a mismatch is reported, and the exit code is 1).

``--delay-ms D`` makes every decoder layer sleep D ms per call (a pre-hook inside the stage's
measured time), so a stage's compute stands above the noise of a small, shared machine: the
measured bubble then shows the schedule itself. Without it the bubble includes the
point-to-point and Python overheads of each step, which dominate on tiny models.

Command (what benchmarks/README.md quotes)::

    python benchmarks/pipeline_bubble.py --pp 2 --preset gpt2-12l-768h --batch 8 \\
        --micro-batches 1 2 4 8 --new-tokens 8 --output /tmp/pipeline_bubble.json
    python benchmarks/pipeline_bubble.py --pp 2 --preset gpt2-2l-64h --delay-ms 20 \\
        --micro-batches 1 2 4 8
    python benchmarks/pipeline_bubble.py --pp 2 --preset gpt2-12l-768h --split 9 3 \\
        --micro-batches 1 2 4 8
    python benchmarks/pipeline_bubble.py --pp 2 --preset gpt2-12l-768h --batch 8 \\
        --micro-batches 1 2 4 8 --new-tokens 8 --split auto

The bubble counts a stage busy whenever it is not waiting on another stage (its layers and
the model's own work around them on that rank: embedding, masks, head); the share of the wall
inside its layers alone is printed too ('in layers'). The theoretical bubble holds for stages of
equal cost: with real compute, give the stages equal work (``--split``: the last stage runs the
output head besides its layers; ``--split auto`` measures the cut on this workload). The default
cut balances the bytes each stage reads per decode step; ``generate`` with a 32-token prompt and
8 new tokens spends much of its time in the prefill, where the layers compute every prompt token
and the head one per row, so its balanced cut differs (gpt2-12l-768h: 8/4, not 9/3).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _timed(engine, mode: str, ids, new_tokens: int):
    """One call of ``mode``; returns (outputs to compare, its PipelineStats)."""
    if mode == "forward":
        out = engine(input_ids=ids).logits.argmax(-1)
    else:
        out = engine.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)
    return out, engine.pipeline_stats


def _delay(model, delay_s: float) -> list:
    """Every decoder layer this rank runs sleeps ``delay_s`` per call (hook handles)."""
    from shardwise.moe.block import decoder_layers
    from shardwise.pipeline import RemoteLayer
    from shardwise.policy import policy_for

    return [layer.register_forward_pre_hook(lambda *_: time.sleep(delay_s))
            for layer in decoder_layers(model, policy_for(model))
            if not isinstance(layer, RemoteLayer)]


def _rebalanced(model, m: int, ids, args: argparse.Namespace, tp: dict) -> list[int]:
    """``--split rebalance``: the split balanced on this workload's run through the pipeline
    itself at ``m`` micro-batches (``engine.stages.rebalanced_split()``): an engine with the
    default cut runs the last of ``--modes`` ``--warmup`` times untimed and once measured."""
    import torch

    import shardwise

    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      pipeline_parallel={"pp_size": args.pp,
                                                         "micro_batches": m}, **tp)
    hooks = _delay(model, args.delay_ms / 1e3) if args.delay_ms else []
    for _ in range(args.warmup + 1):
        _timed(engine, args.modes[-1], ids, args.new_tokens)
    split = list(engine.stages.rebalanced_split())
    for h in hooks:
        h.remove()
    engine.close()
    return split


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import shardwise
    from shardwise.bench.presets import build_preset

    dist.init_process_group("gloo")  # kept across the engines (each engine reuses it)
    rank = dist.get_rank()
    model = build_preset(args.preset, dtype=torch.float32, seed=0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len), generator=g)
    rows, reference = [], {}
    tp = {"tensor_parallel": {"tp_size": args.tp}} if args.tp > 1 else {}
    for m in args.micro_batches:
        split = args.split
        if split == "rebalance":
            split = _rebalanced(model, m, ids, args, tp) if m > 1 else None
        pp = {"pp_size": args.pp, **({"micro_batches": m} if m > 1 else {}),
              **({"split": split} if split else {})}
        engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                          pipeline_parallel=pp, **tp)
        split = [b - a for a, b in engine.stages.plan.bounds]
        hooks = _delay(model, args.delay_ms / 1e3) if args.delay_ms else []
        for mode in args.modes:
            for _ in range(args.warmup):
                _timed(engine, mode, ids, args.new_tokens)
            for repeat in range(args.repeats):
                out, stats = _timed(engine, mode, ids, args.new_tokens)
                same = None
                if m == 1:
                    reference[mode] = out
                elif mode in reference:
                    same = bool(torch.equal(out, reference[mode]))
                if stats is None:  # M = 1: one batch, nothing micro-batched to measure
                    rows.append(dict(m=m, mode=mode, repeat=repeat, same_as_m1=same))
                    continue
                rows.append(dict(m=m, mode=mode, repeat=repeat, same_as_m1=same, split=split,
                                 wall_s=stats.wall_s, busy_s=list(stats.busy_s),
                                 layers_s=list(stats.layers_s),
                                 bubble=list(stats.bubble), steps=stats.steps,
                                 theoretical=stats.theoretical_bubble,
                                 ideal_wall_s=stats.ideal_wall_s))
        for h in hooks:
            h.remove()
        engine.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def report(rows: list[dict], args: argparse.Namespace) -> int:
    split = f", split {args.split}" if args.split else ""
    print(f"\n{args.preset} fp32, PP={args.pp} x TP={args.tp}{split}, batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens, delay {args.delay_ms} "
          f"ms/layer (median of {args.repeats} by wall time; bubble = 1 - busy / wall, busy = "
          f"not waiting on another stage; wall/ideal = the wall over a perfect schedule's of "
          f"these stage costs; 'in layers' = share of the wall inside its layers)")
    print(f"{'mode':9} {'M':>3} {'steps':>5} {'wall ms':>9} {'busy ms per stage':>22} "
          f"{'bubble per stage':>20} {'theory':>7} {'x theory':>8} {'wall/ideal':>10} "
          f"{'in layers':>14}  tokens = M=1")
    bad, last_split = 0, None
    for mode in args.modes:
        for m in args.micro_batches:
            runs = [r for r in rows if r["m"] == m and r["mode"] == mode]
            bad += sum(r["same_as_m1"] is False for r in runs)
            same = {None: "-", True: "yes", False: "NO"}[
                None if runs[0]["same_as_m1"] is None
                else all(r["same_as_m1"] for r in runs)]
            if "wall_s" not in runs[0]:
                print(f"{mode:9} {m:>3} {'':>5} {'(one batch: not micro-batched)':>63}"
                      f"{'':>26}  {same}")
                continue
            r = sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
            if r.get("split") and r["split"] != last_split:
                print(f"  split {'/'.join(map(str, r['split']))}")
                last_split = r["split"]
            busy = ", ".join(f"{b * 1e3:.1f}" for b in r["busy_s"])
            bubble = ", ".join(f"{b:.1%}" for b in r["bubble"])
            ratio = max(r["bubble"]) / r["theoretical"]
            layers = ", ".join(f"{t / r['wall_s']:.0%}" for t in r["layers_s"])
            print(f"{mode:9} {m:>3} {r['steps']:>5} {r['wall_s'] * 1e3:>9.1f} {busy:>22} "
                  f"{bubble:>20} {r['theoretical']:>7.1%} {ratio:>8.2f} "
                  f"{r['wall_s'] / r['ideal_wall_s']:>10.3f} {layers:>14}  {same}")
    return 1 if bad else 0


def _parse_split(ap: argparse.ArgumentParser, split: list[str] | None,
                 pp: int) -> "list[int] | str | None":
    """``--split``: None, ``"auto"``, ``"rebalance"``, or ``pp`` layer counts."""
    if split is None:
        return None
    if split in (["auto"], ["rebalance"]):
        return split[0]
    try:
        counts = [int(n) for n in split]
    except ValueError:
        ap.error(f"--split takes {pp} layer counts, 'auto' or 'rebalance', got "
                 f"{' '.join(split)}")
    if len(counts) != pp:
        ap.error(f"--split gives {len(counts)} stages, --pp {pp}")
    return counts


def measure_split(args: argparse.Namespace) -> list[int]:
    """``--split auto``: the layers per stage that balance the measured seconds of this
    workload (:func:`shardwise.pipeline.measured_split`), on this process with one thread (as
    each rank runs): the batch in the largest M's micro-batches, each through ``generate``
    (``forward`` when only forward runs), once untimed and once timed."""
    import torch

    from shardwise.bench.presets import build_preset
    from shardwise.pipeline import measured_split

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_preset(args.preset, dtype=torch.float32, seed=0)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len),
                            generator=g)
        parts = ids.tensor_split(max(args.micro_batches))
        gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                   do_sample=False, pad_token_id=0)

        @torch.inference_mode()
        def run() -> None:
            for part in parts:
                if "generate" in args.modes:
                    model.generate(part, **gen)
                else:
                    model(input_ids=part)

        return list(measured_split(model, run, args.pp))
    finally:
        torch.set_num_threads(threads)


def launch_workers(script: str, ranks: int, argv: list[str], output: str) -> list:
    """Run ``script argv --worker --out RAW`` on ``ranks`` ranks of this node through
    ``shardwise launch``; the rows rank 0 wrote to RAW (next to ``output``, removed after).
    (benchmarks/serve_pipeline.py launches its ranks with it too.)"""
    out = Path(output).with_suffix(".raw.json")
    cmd = [sys.executable, "-m", "shardwise", "launch", "--nproc-per-node", str(ranks),
           script, *argv, "--worker", "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    rows = json.loads(out.read_text())
    out.unlink()
    return rows


def write_results(output: str, command: str, load_before: tuple, rows: list) -> None:
    """``output`` (JSON): the command, the load averages before and after the run, the rows."""
    load = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count(),
            "what": "1, 5, 15 minute load averages (os.getloadavg) before and after the run"}
    Path(output).write_text(json.dumps({"command": command, "load": load, "rows": rows},
                                       indent=1))
    print(f"\nwrote {output}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    ap.add_argument("--preset", default="gpt2-12l-768h",
                    help="a built-in model shape (shardwise bench --list-presets)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8], metavar="M")
    ap.add_argument("--modes", nargs="+", choices=["forward", "generate"],
                    default=["forward", "generate"])
    ap.add_argument("--split", nargs="+", metavar="N",
                    help="decoder layers per stage (pipeline_parallel split), e.g. 8 4 for "
                         "gpt2-12l-768h, or 'auto': measured on this workload before the ranks "
                         "start (shardwise.pipeline.measured_split: one process, one thread, "
                         "the largest M's micro-batches through generate, or forward when only "
                         "forward runs), or 'rebalance': for every M, balanced on a run of "
                         "the pipeline itself with the default cut (engine.stages."
                         "rebalanced_split(); the last of --modes, --warmup + 1 times); the "
                         "theoretical bubble assumes stages of equal cost (default: balanced "
                         "by weight bytes read per step)")
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="sleep per decoder layer call, inside the stage's busy time")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="pipeline_bubble.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.split = _parse_split(ap, args.split, args.pp)
    if args.worker:
        worker(args)
        return 0
    if args.pp < 2 or args.tp < 1 or min(args.micro_batches) < 1 or args.batch < 1:
        ap.error("--pp must be >= 2; --tp, --batch and every --micro-batches >= 1")
    if max(args.micro_batches) > args.batch:
        ap.error(f"--micro-batches {max(args.micro_batches)} is more than --batch "
                 f"{args.batch} rows (at most one micro-batch per row)")
    load_before = os.getloadavg()
    argv = sys.argv[1:]
    if args.split == "auto":
        args.split = measure_split(args)
        at = argv.index("--split")
        argv[at:at + 2] = ["--split", *map(str, args.split)]
        print(f"--split auto: measured {' '.join(map(str, args.split))}", flush=True)
    rows = launch_workers(__file__, args.pp * args.tp, argv, args.output)
    code = report(rows, args)
    command = "python benchmarks/pipeline_bubble.py " + " ".join(sys.argv[1:])
    if "auto" in sys.argv[1:]:
        command += f"  (--split auto measured {' '.join(map(str, args.split))})"
    write_results(args.output, command, load_before, rows)
    return code

if __name__ == "__main__":
    sys.exit(main())

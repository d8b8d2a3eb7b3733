"""Mixed steps (chunked prefill inside the decode batch), captured per chunk bucket and eager,
against alternating prefill calls and decode steps: the serve stack's scheduler alone (no HTTP,
no client processes), the modes interleaved on ONE stack in one process, so a loaded machine
slows them alike.

    python benchmarks/serve_mixed.py                        # default model, 8 streams, 3 rounds
    python benchmarks/serve_mixed.py --streams 8 --rounds 5 --requests-per-stream 4
    python benchmarks/serve_mixed.py --long 400             # + a 400-token prompt per stream
    python benchmarks/serve_mixed.py --steps --rounds 15    # the runner's step times alone

The load is ``benchmarks/serve_load.py``'s at one concurrency: ``--streams`` streams each submit
``--requests-per-stream`` greedy requests one after the other (``--max-tokens`` new tokens each),
prompts of 32-128 tokens (``--long N``: each stream's second request has an N-token prompt), so
requests keep joining while the others decode. Per mode and round: the inter-token gaps of
every stream (the times its token events reach the asyncio loop, as a client's chunks would:
p50, p99 and p99/p50), time to first token p50/p99 and the decode tokens/s (tokens after each
request's first over the round's wall time). Prints the medians over rounds of each mode, with
the load average; ``--output`` writes every round and the medians as JSON. The stack is the server's own
(:func:`shardwise.serve.server.build_stack`: kernel injection, graphs, the preferred dtype); the
mode is switched between rounds while the scheduler is idle: ``alternating`` (the scheduler's
``mixed`` off), ``mixed-eager`` (mixed steps with the runner's chunk buckets emptied: every
mixed step eager, chunks cut by the stall allowance alone) and ``mixed`` (the captured step of
each chunk bucket, as served). Each round also reports the mixed steps it ran captured and
eager, and the graph strategy's compilations during the round (0: nothing recompiled).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

import torch
from serve_load import PROMPT_LENGTHS  # the same prompts as the HTTP load (this folder)

from shardwise.bench.stats import median, percentile

#: mode → (the scheduler's ``mixed``, mixed steps captured)
MODES = {"alternating": (False, False), "mixed-eager": (True, False), "mixed": (True, True)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams (default 8)")
    parser.add_argument("--requests-per-stream", type=int, default=4,
                        help="requests each stream sends one after the other (default 4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per mode")
    parser.add_argument("--long", type=int, default=0,
                        help="prompt tokens of each stream's second request (0: no long prompt)")
    parser.add_argument("--max-context", type=int, default=512, help="tokens a slot holds")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--output", help="JSON file for every round's figures and the medians")
    parser.add_argument("--steps", action="store_true",
                        help="time the runner's steps alone instead of the load: a decode step "
                             "of streams - 1 slots, and a mixed step of the same slots with a "
                             "chunk of each bucket's size, eager and captured, interleaved "
                             "--rounds times; medians and p90 in ms")
    args = parser.parse_args(argv)
    for name in ("streams", "requests_per_stream", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.long < 0 or args.long + args.max_tokens > args.max_context:
        parser.error(f"--long must be >= 0 and --long + --max-tokens at most --max-context "
                     f"({args.max_context})")
    return args


async def one_round(scheduler, args, seed: int) -> dict[str, float]:
    """Run the load once → p50/p99 inter-token gap (ms), p99/p50, TTFT p50/p99 (ms),
    decode tokens/s."""
    from shardwise.serve.types import FinishEvent, GenRequest, SamplingParams

    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    gaps, ttfts, decoded = [], [], [0]

    async def stream(index: int) -> None:
        for r in range(args.requests_per_stream):
            n = args.long if (args.long and r == 1) else \
                PROMPT_LENGTHS[(index + r) % len(PROMPT_LENGTHS)]
            prompt = [rng.randrange(1000, 2000) for _ in range(n)]
            request = GenRequest(f"s{index}r{r}", prompt,
                                 SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
            sent = time.perf_counter()
            handle = scheduler.submit(request, loop)
            last = None
            async for event in handle.events():
                if isinstance(event, FinishEvent):
                    break
                now = time.perf_counter()
                if last is None:
                    ttfts.append(now - sent)
                else:
                    gaps.append(now - last)
                    decoded[0] += 1
                last = now

    began = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(args.streams)))
    wall = time.perf_counter() - began
    q = lambda values, p: 1e3 * percentile(values, p)  # noqa: E731
    return {"itl_p50_ms": q(gaps, 50), "itl_p99_ms": q(gaps, 99),
            "itl_p99_over_p50": q(gaps, 99) / q(gaps, 50),
            "ttft_p50_ms": q(ttfts, 50), "ttft_p99_ms": q(ttfts, 99),
            "decode_tok_s": decoded[0] / wall}


def step_times(runner, args) -> dict[str, dict[str, float]]:
    """``--steps``: slots 0 .. streams - 2 hold the load's prompts and decode; each round
    times one decode step of them, then for each chunk bucket one mixed step of them with a
    chunk of that many prompt tokens into the last slot (released after), eager and captured.
    Returns kind → {"p50_ms", "p90_ms"}."""
    buckets, chunks = runner.mixed_buckets, runner.mixed_chunks
    if not buckets:
        raise SystemExit(f"mixed steps are not captured here: {runner.mixed_eager_reason}")
    decoding = list(range(args.streams - 1))
    chunk_slot = args.streams - 1
    tokens = []
    for slot in decoding:
        prompt = [1000 + slot] * PROMPT_LENGTHS[slot % len(PROMPT_LENGTHS)]
        tokens.append(int(runner.prefill(slot, prompt, last=True).argmax()))
    times: dict[str, list[float]] = {}

    def timed(kind: str, call) -> None:
        began = time.perf_counter()
        call()
        times.setdefault(kind, []).append(1e3 * (time.perf_counter() - began))

    for _ in range(args.rounds):
        timed("decode", lambda: runner.decode(decoding, tokens))
        for bucket in buckets:
            for captured in (False, True):
                runner.mixed_buckets, runner.mixed_chunks = \
                    (buckets, chunks) if captured else ((), None)
                chunk = [(chunk_slot, [1500] * bucket, True)]
                timed(f"mixed {bucket} {'captured' if captured else 'eager'}",
                      lambda: runner.mixed(decoding, tokens, chunk))
                runner.release(chunk_slot)
    runner.mixed_buckets, runner.mixed_chunks = buckets, chunks
    return {kind: {"p50_ms": percentile(v, 50), "p90_ms": percentile(v, 90)}
            for kind, v in times.items()}


def main(argv=None) -> None:
    import shardwise
    from shardwise.bench.runner import quiet_loader_bars
    from shardwise.models import default_model_path, load_model
    from shardwise.serve.server import build_stack

    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = shardwise.get_accelerator().preferred_dtype
    with quiet_loader_bars():
        model, tokenizer = load_model(default_model_path(), dtype)
    model.to(dtype=dtype)
    stack = build_stack(model, tokenizer, max_batch=args.streams, max_tokens=args.max_context,
                        max_waiting=4 * args.streams, start=not args.steps,
                        replace_with_kernel_inject=True, enable_graph=True, dtype=dtype)
    scheduler = stack.scheduler
    if args.steps:
        load = os.getloadavg()[0]
        rows = step_times(stack.runner, args)
        print(f"{args.streams - 1} decoding slots, threads {torch.get_num_threads()}, {dtype}, "
              f"load {load:.1f}-{os.getloadavg()[0]:.1f}; step times over {args.rounds} rounds:")
        for kind, row in rows.items():
            print(f"  {kind:<22} p50 {row['p50_ms']:8.2f} ms   p90 {row['p90_ms']:8.2f} ms")
        if args.output:
            with open(args.output, "w") as f:
                json.dump({"command": " ".join(sys.argv), "threads": torch.get_num_threads(),
                           "dtype": str(dtype), "steps": rows}, f, indent=1)
        return
    if not scheduler.mixed:
        raise SystemExit(f"this runner has no mixed steps: {stack.runner.mixed_unsupported}")
    runner = stack.runner
    buckets, chunks = runner.mixed_buckets, runner.mixed_chunks
    if not buckets:
        print(f"note: mixed steps are not captured here ({runner.mixed_eager_reason}): "
              f"'mixed' runs them eagerly too")

    def switch(mode: str) -> None:
        scheduler.mixed, captured = MODES[mode]
        runner.mixed_buckets, runner.mixed_chunks = (buckets, chunks) if captured else ((), None)

    def timed(mode: str, seed: int) -> dict[str, float]:
        switch(mode)
        steps = dict(runner.mixed_steps)
        compiles = getattr(runner.strategy, "compiles", 0)
        row = asyncio.run(one_round(scheduler, args, seed=seed))
        row.update({f"{k}_steps": runner.mixed_steps[k] - steps[k] for k in steps})
        row["compiles"] = getattr(runner.strategy, "compiles", 0) - compiles
        return row

    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    loads = []
    try:
        for mode in MODES:  # warm-up round of each mode (untimed)
            timed(mode, seed=0)
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            for mode in order:  # interleaved, alternating which goes first
                loads.append(os.getloadavg()[0])
                results[mode].append(timed(mode, seed=1 + r))
    finally:
        scheduler.stop(drain_s=1.0)
    print(f"{args.streams} streams x {args.requests_per_stream} requests x {args.max_tokens} "
          f"tokens, long prompt {args.long or 'none'}, threads {torch.get_num_threads()}, "
          f"{dtype}, load {min(loads):.1f}-{max(loads):.1f}; medians over {args.rounds} rounds:")
    keys = list(results["mixed"][0])
    print(f"  {'mode':<12}" + "".join(f"{k:>17}" for k in keys))
    medians = {mode: {k: median([r[k] for r in rounds]) for k in keys}
               for mode, rounds in results.items()}
    for mode, row in medians.items():
        print(f"  {mode:<12}" + "".join(f"{row[k]:>17.2f}" for k in keys))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "threads": torch.get_num_threads(),
                       "dtype": str(dtype), "load": [min(loads), max(loads)],
                       "medians": medians, "rounds": results}, f, indent=1)


if __name__ == "__main__":
    main()

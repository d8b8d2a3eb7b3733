"""Where a served token's time goes: the serve stack's decode step alone (no HTTP, no clients)
against the same engine's ``generate`` step, at 1 and 8 sequences.

    python benchmarks/serve_step.py                      # default model, graphs, bf16/preferred
    python benchmarks/serve_step.py --threads 1 --rounds 20

On a quiet 2-core EPYC, ``serve_load.py`` saw inter-token gaps of 24.9 ms at 1 stream and
55.6 ms at 8 (2026-11-26), where the peers benchmark's ``generate`` steps of the same model
took 11.8 ms (batch 1) and ~23.5 ms (batch 8): this script says whether the difference is in the
slot runner's step itself (per-row ranges, the bucket's captured step, the logits gather) or
around it (HTTP, client processes and the scheduler's thread sharing the cores and the GIL).

Both engines are built in this process (two copies of the model), their steps timed
interleaved, ``--rounds`` times each: ``runner.decode`` over slots 0..b-1 holding the serve
benchmark's prompt lengths, and one ``generate`` token step at batch b (the time of
``max_new_tokens=1 + --tokens`` minus that of ``max_new_tokens=1``, over ``--tokens``). Prints
medians in ms; writes nothing.

``--thread`` adds the runner's step run as the server runs it, on another thread than the one
that built the model: ``thread, pool held`` while the building thread keeps its OpenMP worker
pool, ``thread, pool released`` after ``accelerator.release_thread_pool()`` on the building
thread (what the scheduler's ``start`` does). Measured 2026-11-27 (2 cores, bf16, load ~1),
``python benchmarks/serve_step.py --thread --rounds 8``: b=1 13.3 ms on the building thread,
25.1 ms on another with the pool held, 13.1 ms released; b=8 40.6 / 72.0 / 41.8 ms (libgomp
stops spinning between parallel regions once its pools' threads outnumber the cores, so every
region pays a wake-up).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

from shardwise.bench.plan import QUANT_CONFIGS, engine_options

#: the serve benchmark's prompt lengths (benchmarks/serve_load.py), one per slot
PROMPT_LENGTHS = (32, 96, 48, 128, 64, 112, 40, 80)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    parser.add_argument("--tokens", type=int, default=8,
                        help="generate tokens per timed generate call (default 8)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--no-graphs", action="store_true", help="eager decode steps")
    parser.add_argument("--quant", choices=sorted(QUANT_CONFIGS), default=None,
                        help="both engines' weights quantized as `shardwise serve --quant`")
    parser.add_argument("--thread", action="store_true",
                        help="also time the step on another thread, pool held and released")
    args = parser.parse_args(argv)
    for name in ("rounds", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    return args


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
    graphs = not args.no_graphs
    options = {**engine_options(inject=True, graphs=graphs, quant=args.quant), "dtype": dtype}
    gen_engine = shardwise.init_inference(copy.deepcopy(model), max_tokens=512, **options)
    stack = build_stack(model, tokenizer, max_batch=8, max_tokens=512, start=False, **options)
    runner = stack.runner
    for slot, n in enumerate(PROMPT_LENGTHS):
        runner.prefill(slot, list(range(1000, 1000 + n)), True)
    prompt = {b: torch.randint(1000, 2000, (b, 64), generator=torch.Generator().manual_seed(b))
              for b in (1, 8)}

    def generate(b: int, new: int) -> float:
        began = time.perf_counter()
        with torch.no_grad():
            gen_engine.module.generate(prompt[b], max_new_tokens=new, min_new_tokens=new,
                                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - began

    times: dict[str, list[float]] = {}
    for b in (1, 8):  # warm: generate's own capture of its batch's step
        generate(b, 1 + args.tokens)
    for _ in range(args.rounds):
        for b in (1, 8):
            began = time.perf_counter()
            runner.decode(list(range(b)), [1500] * b)
            times.setdefault(f"serve step b={b}", []).append(time.perf_counter() - began)
            step = (generate(b, 1 + args.tokens) - generate(b, 1)) / args.tokens
            times.setdefault(f"generate step b={b}", []).append(step)
            if args.thread:
                for pool in ("held", "released"):
                    if pool == "released":
                        stack.engine.accelerator.release_thread_pool()
                    times.setdefault(f"thread, pool {pool} b={b}", []).append(
                        on_thread(lambda: runner.decode(list(range(b)), [1500] * b)))
    print(f"threads {torch.get_num_threads()}, {dtype}, quant {args.quant}, graphs {graphs}, load "
          f"{os.getloadavg()[0]:.1f}; medians over {args.rounds} rounds:")
    for name, values in times.items():
        print(f"  {name:<28} {1e3 * statistics.median(values):7.1f} ms")


def on_thread(step, repeats: int = 5) -> float:
    """Median seconds of ``step()`` run ``repeats`` times on a new thread (after one untimed
    call there: the thread's first parallel region starts its pool)."""
    import threading

    took: list[float] = []

    def run() -> None:
        step()
        for _ in range(repeats):
            began = time.perf_counter()
            step()
            took.append(time.perf_counter() - began)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return statistics.median(took)


if __name__ == "__main__":
    main()

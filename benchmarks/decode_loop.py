"""shardwise's own decode loop against Hugging Face's ``generate`` loop, on the same engine, in
one process, interleaved.

Both run the same prefill and the same decode step (with ``--graphs``, the same captured
step): the difference is the host work around the step. Each round times one
``engine.generate`` of each (``shardwise_fast_loop=True`` / ``False``; the order alternates
from round to round), per token with ``shardwise.generation.TokenTimer`` — the streamer the
benchmark uses —, greedy, exactly ``--new-tokens`` tokens. Prints, per engine setting, the
median decode ms/token of each loop and their ratio, and writes every sample as JSON.

Default: the embedded SmolLM2-135M-Instruct (``shardwise bench``'s default model), bf16 with
injection and graphs, then int4 (bf16 compute) with injection and graphs:

    python benchmarks/decode_loop.py --output benchmarks/results/cpu-decode-loop.json

Each variant gets its own copy of the model (the last one the loaded model itself). On a GPU,
e.g. the 1.1B preset at batch 1, 8 and 32:

    python benchmarks/decode_loop.py --device cuda --dtype fp16 --preset llama-22l-2048h-gqa \
        --variant inject-graphs --batch 1 8 32 --prompt-len 128 --new-tokens 64
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch

import shardwise
from shardwise.bench.plan import Cell, engine_options
from shardwise.bench.runner import HFLoop, generation_kwargs, make_inputs
from shardwise.config import parse_dtype
from shardwise.generation import timed_generate

#: --variant name → init_inference keywords (dtype aside)
VARIANTS = {name: engine_options(inject=True, graphs=graphs, quant=quant)
            for name, graphs, quant in (("inject-graphs", True, None), ("inject", False, None),
                                        ("int4-inject-graphs", True, "int4"),
                                        ("int8-inject-graphs", True, "int8"))}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a HF model directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--preset", help="a bench preset (random weights), e.g. llama-22l-2048h-gqa")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--variant", nargs="+", default=["inject-graphs", "int4-inject-graphs"],
                   choices=sorted(VARIANTS))
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (each loop once)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--output", help="JSON file for every sample")
    return p.parse_args(argv)


def load_source(args: argparse.Namespace, dtype: torch.dtype):
    """(model, tokenizer or None) of --preset, --model or the default model, in ``dtype``."""
    if args.preset:
        from shardwise.bench.presets import build_preset

        return build_preset(args.preset, dtype), None
    from shardwise.models import load_model

    return load_model(args.model, dtype=dtype)


def provenance(args: argparse.Namespace) -> dict:
    """The results' header: command, load, threads, machine, device, torch; ``rows`` empty."""
    return {"command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
            "load": os.getloadavg(), "threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(),
            "device": shardwise.get_accelerator(args.device).device_name(),
            "torch": torch.__version__, "rows": []}


def finish(results: dict, output: str | None) -> int:
    """Stamp the end of a run, write ``results`` to ``output`` (if given); the exit status:
    0 when every row saw the same tokens."""
    results["load_after"] = os.getloadavg()
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if output:
        with open(output, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["same_tokens"] for r in results["rows"]) else 1


def _time_pair(engine, inputs: dict, kwargs: dict, sync, fast_first: bool) -> dict:
    """One round: each loop once, in the given order → {loop: TokenTimings as a dict}."""
    out = {}
    for fast in ((True, False) if fast_first else (False, True)):
        _, timings = timed_generate(engine if fast else HFLoop(engine), inputs, sync, **kwargs)
        out["shardwise" if fast else "hf"] = timings.to_dict()
    return out


def _measure(engine, tokenizer, name: str, batch: int, args: argparse.Namespace) -> dict:
    """The interleaved rounds of one engine at one batch size → its result row."""
    cell = Cell(batch, args.prompt_len, args.new_tokens)
    vocab = engine.module.config.get_text_config().vocab_size
    inputs = {k: v.to(engine.device) for k, v in make_inputs(tokenizer, vocab, cell, 0).items()}
    kwargs = generation_kwargs(engine.module, args.new_tokens)
    sync = engine.accelerator.synchronize
    # warm-up: each loop once (captures/compiles what the batch needs)
    out_fast = engine.generate(**inputs, **kwargs)
    out_hf = HFLoop(engine).generate(**inputs, **kwargs)
    same = bool(torch.equal(out_fast, out_hf))
    rounds = [_time_pair(engine, inputs, kwargs, sync, fast_first=i % 2 == 0)
              for i in range(args.rounds)]
    row = {"variant": name, "dtype": args.dtype, "batch": batch, "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "same_tokens": same, "rounds": rounds}
    for loop in ("shardwise", "hf"):
        per_token = [t for r in rounds for t in r[loop]["per_token_s"]]
        row[f"{loop}_ms_per_token"] = statistics.median(per_token) * 1e3
        row[f"{loop}_prefill_ms"] = statistics.median(r[loop]["prefill_s"] for r in rounds) * 1e3
    row["speedup"] = row["hf_ms_per_token"] / row["shardwise_ms_per_token"]
    print(f"{name:>20} {args.dtype} b{batch}: shardwise loop {row['shardwise_ms_per_token']:.2f} "
          f"ms/token, HF loop {row['hf_ms_per_token']:.2f} ms/token ({row['speedup']:.2f}x); "
          f"prefill {row['shardwise_prefill_ms']:.1f} / {row['hf_prefill_ms']:.1f} ms; same "
          f"tokens: {same}", flush=True)
    return row


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    source, tokenizer = load_source(args, dtype)
    results = provenance(args)
    for i, name in enumerate(args.variant):  # the last variant transforms the loaded model
        model = source if i == len(args.variant) - 1 else copy.deepcopy(source)
        engine = shardwise.init_inference(model, device=args.device, dtype=dtype,
                                          **VARIANTS[name])
        for batch in args.batch:
            results["rows"].append(_measure(engine, tokenizer, name, batch, args))
        del engine
    return results


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    return finish(run(args), args.output)


if __name__ == "__main__":
    raise SystemExit(main())

"""Fused q|k|v and gate|up projections against the unfused ones, in one process, interleaved.

For each precision (``--precision``: fp32, bf16, int8, int4 — the quantized ones on the model's
``--dtype``, bf16 by default for them as ``shardwise bench`` runs them) two engines are built on
copies of the same model, with injection (``--graphs``: and graphs), one with fused projections
(the default) and one with ``SHARDWISE_FUSE_PROJECTIONS=0`` (:mod:`shardwise.inject.fuse`).
Each round times one greedy ``engine.generate`` of each, the order alternating from round to
round, per token (``shardwise.generation.timed_generate``); prints the median decode ms/token of
each, their ratio and whether the tokens are the same, and writes every sample as JSON with the
load average before and after (the machine's load is part of the figure: label it).

Default: the embedded SmolLM2-135M (``shardwise bench``'s default model), batch 1, eager
injection (the step where per-call cost shows most). The quiet-machine command:

    python benchmarks/fused_projections.py --output benchmarks/results/cpu-fused-projections.json

and with graphs: ``--graphs`` (compiles each engine's step: minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch

import shardwise
from shardwise.bench.plan import Cell, engine_options
from shardwise.bench.runner import generation_kwargs, make_inputs
from shardwise.config import parse_dtype
from shardwise.generation import timed_generate
from shardwise.inject import injected_stack
from shardwise.inject.fuse import fusion_report

from decode_loop import finish, load_source, provenance  # benchmarks/: the script's folder

#: --precision → (the model's dtype when --dtype is not given, quant preset or None)
PRECISIONS = {"fp32": ("fp32", None), "bf16": ("bf16", None), "int8": ("bf16", "int8"),
              "int4": ("bf16", "int4")}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a HF model directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--preset", help="a bench preset (random weights), e.g. llama-22l-2048h-gqa")
    p.add_argument("--device", default="cpu")
    p.add_argument("--precision", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                   help="the model's dtype for every precision (default: fp32 for fp32, else "
                        "bf16)")
    p.add_argument("--graphs", action="store_true", help="enable_graph too")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (each engine once)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--output", help="JSON file for every sample")
    return p.parse_args(argv)


def _engine(model, args: argparse.Namespace, dtype: torch.dtype, quant: str | None, fuse: bool):
    """``init_inference`` of ``model`` with fused projections on or off."""
    return shardwise.init_inference(model, device=args.device, dtype=dtype,
                                    fuse_projections=fuse,
                                    **engine_options(inject=True, graphs=args.graphs, quant=quant))


def _measure(engines: dict, tokenizer, name: str, args: argparse.Namespace) -> dict:
    """The interleaved rounds of the fused and unfused engines → one result row."""
    first = engines["fused"]
    cell = Cell(args.batch, args.prompt_len, args.new_tokens)
    vocab = first.module.config.get_text_config().vocab_size
    inputs = {k: v.to(first.device) for k, v in make_inputs(tokenizer, vocab, cell, 0).items()}
    kwargs = generation_kwargs(first.module, args.new_tokens)
    sync = first.accelerator.synchronize
    tokens = {k: e.generate(**inputs, **kwargs) for k, e in engines.items()}  # warm-up
    same = bool(torch.equal(tokens["fused"], tokens["unfused"]))
    rounds = []
    for i in range(args.rounds):
        order = ("fused", "unfused") if i % 2 == 0 else ("unfused", "fused")
        rounds.append({k: timed_generate(engines[k], inputs, sync, **kwargs)[1].to_dict()
                       for k in order})
    row = {"precision": name, "batch": args.batch, "prompt_len": args.prompt_len,
           "new_tokens": args.new_tokens, "graphs": args.graphs, "same_tokens": same,
           "fused_groups": fusion_report(injected_stack(first.module)), "rounds": rounds}
    for key in engines:
        per_token = [t for r in rounds for t in r[key]["per_token_s"]]
        row[f"{key}_ms_per_token"] = statistics.median(per_token) * 1e3
    row["speedup"] = row["unfused_ms_per_token"] / row["fused_ms_per_token"]
    print(f"{name:>5} b{args.batch}{' graphs' if args.graphs else ''}: fused "
          f"{row['fused_ms_per_token']:.2f} ms/token, unfused {row['unfused_ms_per_token']:.2f} "
          f"({row['speedup']:.3f}x); same tokens: {same}; {row['fused_groups']}", flush=True)
    return row


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    results = provenance(args)
    for name in args.precision:
        model_dtype, quant = PRECISIONS[name]
        dtype = parse_dtype(args.dtype or model_dtype)
        source, tokenizer = load_source(args, dtype)
        engines = {"fused": _engine(copy.deepcopy(source), args, dtype, quant, True),
                   "unfused": _engine(source, args, dtype, quant, False)}
        results["rows"].append(_measure(engines, tokenizer, name, args))
        for engine in engines.values():
            engine.close()
        del engines, source
    return results


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    return finish(run(args), args.output)


if __name__ == "__main__":
    raise SystemExit(main())

"""``shardwise bench``: time the plain Hugging Face model against shardwise on this device, over
a matrix of models × batch sizes × prompt lengths × new tokens, with roofline figures.

Writes a JSON file with every sample and its provenance, and a PNG chart next to it (with the
``plot`` extra). ``--compare a.json b.json`` prints the ratios between two saved runs.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from ..errors import ConfigError

#: The parser, kept to write the command line of a run back into its results.
_PARSER: argparse.ArgumentParser | None = None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _add_matrix_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to run")
    g.add_argument("--model", action="append", metavar="PATH",
                   help="a Hugging Face model directory or GGUF file (repeatable)")
    g.add_argument("--preset", action="append", metavar="NAME",
                   help="a built-in model shape with random weights (repeatable; "
                        "--list-presets shows them). Default without --model/--preset: the "
                        "embedded SmolLM2-135M-Instruct")
    g.add_argument("--batch", type=_positive, nargs="+", default=[1], metavar="N")
    g.add_argument("--prompt-len", type=_positive, nargs="+", default=[32], metavar="N",
                   help="prompt tokens (default 32)")
    g.add_argument("--new-tokens", type=_positive, nargs="+", default=[32], metavar="N",
                   help="tokens generated per run (default 32)")
    g.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="untimed generate calls per cell and variant (default 1)")
    g.add_argument("--repeats", type=_positive, default=3, metavar="N",
                   help="timed generate calls per cell and variant (default 3)")
    g.add_argument("--seed", type=int, default=0, help="seed of the presets' weights and prompts")


def _add_variant_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the shardwise variant (the baseline is the plain HF model)")
    g.add_argument("--device", help="accelerator plugin (default: $SHARDWISE_ACCELERATOR or "
                                    "detection)")
    g.add_argument("--dtype", choices=["fp32", "fp16", "bf16", "auto"],
                   help="dtype of both variants (default: the model's own; auto: the device's "
                        "preferred)")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks, started through torch.distributed.run")
    g.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes taking part in --tp")
    g.add_argument("--node-rank", type=int, default=0, metavar="R",
                   help="this node's rank (--nnodes > 1)")
    g.add_argument("--master-addr", metavar="HOST", help="node 0's address (--nnodes > 1)")
    g.add_argument("--master-port", type=int, metavar="PORT", help="rendezvous port (--nnodes > 1)")
    g.add_argument("--inject", action="store_true", help="kernel injection")
    g.add_argument("--graphs", action="store_true", help="graph capture")
    g.add_argument("--quant", choices=["int8", "int4"], help="weight quantization")
    g.add_argument("--baseline-dtype", choices=["fp32", "fp16", "bf16", "auto"],
                   help="dtype of the HF baseline only (default: --dtype), e.g. an fp32 "
                        "baseline against --dtype bf16 --quant int8")


def _add_output_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output", metavar="FILE.json",
                   help="results file (default shardwise-bench-<date>.json); the chart is "
                        "written next to it as .png")
    g.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--bandwidth-mib", type=_positive, metavar="MiB",
                   help="size of the bandwidth probe's buffer (default 512 on CPU, 2048 else)")
    g.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="print the ratios B/A of two saved runs and exit")
    g.add_argument("--list-presets", action="store_true", help="list the presets and exit")


def add_parser(sub):
    """Register ``bench`` on the ``shardwise`` subcommand parser."""
    global _PARSER
    p = sub.add_parser("bench", help="benchmark shardwise against the plain HF model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_matrix_options(p)
    _add_variant_options(p)
    _add_output_options(p)
    _PARSER = p
    return p


def command_argv(args: argparse.Namespace) -> list[str]:
    """The options of ``args`` that differ from their defaults, as command-line words."""
    words: list[str] = []
    for action in _PARSER._actions if _PARSER else []:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value == action.default or value is None:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            words.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value:
                words += [flag, str(item)]
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return words


def _options(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}


def _plan(args: argparse.Namespace):
    """Validate everything cheap (device, dtype, --tp, models, matrix) before heavy work."""
    from ..bench.plan import (Plan, check_tp, engine_options, make_cells, resolve_dtype_name,
                              resolve_models)
    from ..plugins import get_accelerator

    if args.warmup < 0:
        raise ConfigError(f"--warmup must be 0 or more, got {args.warmup}")
    accelerator = get_accelerator(args.device)
    nproc = check_tp(accelerator, args.tp, args.nnodes)
    plan = Plan(models=resolve_models(args.model, args.preset),
                cells=make_cells(args.batch, args.prompt_len, args.new_tokens),
                device=accelerator.name, dtype=resolve_dtype_name(accelerator, args.dtype),
                tp=args.tp, nnodes=args.nnodes,
                baseline_dtype=resolve_dtype_name(accelerator, args.baseline_dtype),
                engine_options=engine_options(args.inject, args.graphs, args.quant),
                warmup=args.warmup, repeats=args.repeats, seed=args.seed)
    return plan, accelerator, nproc


def _compare(paths: list[str]) -> int:
    from ..bench.compare import format_compare
    from ..bench.report import read_json

    a, b = (read_json(p) for p in paths)
    print(format_compare(a, b, paths[0], paths[1]))
    return 0


def _write_outputs(doc: dict, output: Path, chart: bool) -> None:
    from ..bench.chart import PLOT_INSTALL, write_chart
    from ..bench.report import write_json

    print(f"results: {write_json(doc, output)}")
    if not chart:
        return
    png = write_chart(doc, output.with_suffix(".png"))
    print(f"chart: {png}" if png else f"chart: skipped, matplotlib is not installed; for "
                                      f"charts run `{PLOT_INSTALL}`")


def run(args: argparse.Namespace) -> int:
    """Run ``shardwise bench``; exit code 1 when no run succeeded."""
    if args.list_presets:
        from ..bench.presets import describe_presets

        print(describe_presets())
        return 0
    if args.compare:
        return _compare(args.compare)
    from ..bench.report import command_line, format_table
    from ..bench.session import run_bench

    plan, accelerator, nproc = _plan(args)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    output = Path(args.output or f"shardwise-bench-{stamp}.json")
    rendezvous = {"node_rank": args.node_rank, "master_addr": args.master_addr,
                  "master_port": args.master_port} if args.nnodes > 1 else None
    doc = run_bench(plan, accelerator, command=command_line(command_argv(args)),
                    options=_options(args), nproc_per_node=nproc, rendezvous=rendezvous,
                    bandwidth_bytes=args.bandwidth_mib and args.bandwidth_mib * 2**20,
                    show_progress=not args.no_progress)
    print(format_table(doc))
    _write_outputs(doc, output, chart=not args.no_chart)
    return 0 if any(r["status"] == "ok" for r in doc["runs"]) else 1

"""``shardwise bench``: time the plain Hugging Face model against shardwise on this device, over
a matrix of models × batch sizes × prompt lengths × new tokens, with roofline figures.

Without variant options (--inject, --graphs, --quant, --dtype, --offload, --plain) it runs
what shardwise does fastest on this device, as the accelerator says: kernel injection with
graphs in its preferred dtype, then the same with int8 and with int4 weights (where it has
fast kernels), against the HF model in that dtype. With them it runs the one variant they
describe (--offload: its weights streamed from disk or host memory, reported against a probe
of that tier's read bandwidth). --pp P runs the plain variant (or the one --inject, --graphs
and --quant describe) over P pipeline stages with M micro-batches in flight (--micro-batches)
and reports, per row, every stage's busy time over the timed repeats and the measured bubble
against the theoretical (P - 1) / (P - 1 + M).

Writes a JSON file with every sample and its provenance, and a PNG chart next to it (with the
``plot`` extra). ``--compare a.json b.json`` prints the ratios between two saved runs. Every
option is checked before anything runs; the exit code is 0 only when every run succeeded.
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import replace
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
    g = p.add_argument_group(
        "the shardwise variant",
        "The baseline is the plain HF model. With none of --dtype, --inject, --graphs,\n"
        "--quant, --offload, --plain: the device's default set (injection + graphs, then also\n"
        "int8 and int4, in the device's preferred dtype, HF too); with any, the one variant they\n"
        "describe.")
    g.add_argument("--device", help="accelerator plugin (default: $SHARDWISE_ACCELERATOR or "
                                    "detection)")
    g.add_argument("--dtype", choices=["fp32", "fp16", "bf16", "auto"],
                   help="dtype of the shardwise variant and the HF baseline (default: the "
                        "model's own; auto: the device's preferred)")
    g.add_argument("--weight-dtype", choices=["bf16", "fp16"],
                   help="with --dtype fp32 --inject --graphs: the linear weights kept in 16 "
                        "bits under fp32 activations (init_inference(weight_dtype=...))")
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks, started through torch.distributed.run")
    g.add_argument("--ep", type=int, nargs="+", default=[1], metavar="N",
                   help="MoE models only: expert-parallel ranks (moe={'ep_size': N}), started "
                        "as --tp's; with --tp a variant runs on lcm(tp, ep) ranks (--tp 2 --ep "
                        "2: 2 ranks splitting heads by tp and experts by ep). Several values "
                        "run each variant at each size (--ep 1 2: in one process, and on 2 "
                        "ranks)")
    g.add_argument("--moe-dispatch", choices=["all_reduce", "all_to_all", "auto"],
                   help="with --ep > 1: how the expert-parallel ranks combine the experts' "
                        "outputs (moe={'dispatch': ...}; default: the engine's)")
    g.add_argument("--pp", type=int, default=1, metavar="P",
                   help="pipeline stages (pipeline_parallel={'pp_size': P}), started as --tp's "
                        "(P x tp ranks); each row then reports every stage's busy time and the "
                        "measured bubble against the theoretical (P-1)/(P-1+M). Runs the plain "
                        "variant unless --inject, --graphs or --quant describe another (not "
                        "with --offload yet)")
    g.add_argument("--micro-batches", type=_positive, metavar="M",
                   help="with --pp: micro-batches each forward (prefill and every decode step) "
                        "is split into, each with its own KV cache (default 2 x P; at most one "
                        "per row of --batch)")
    g.add_argument("--nnodes", type=int, default=1, metavar="N",
                   help="nodes taking part in --tp/--ep/--pp")
    g.add_argument("--node-rank", type=int, default=0, metavar="R",
                   help="this node's rank (--nnodes > 1)")
    g.add_argument("--master-addr", metavar="HOST", help="node 0's address (--nnodes > 1)")
    g.add_argument("--master-port", type=int, metavar="PORT", help="rendezvous port (--nnodes > 1)")
    g.add_argument("--inject", action="store_true", help="kernel injection")
    g.add_argument("--graphs", action="store_true", help="graph capture (needs --inject)")
    g.add_argument("--hf-loop", action="store_true",
                   help="time Hugging Face's generate loop around each injected engine's step "
                        "(engine.generate(..., shardwise_fast_loop=False)) instead of "
                        "shardwise's own decode loop; benchmarks/decode_loop.py compares both "
                        "on one engine")
    g.add_argument("--quant", choices=["int8", "int4"], help="weight quantization")
    g.add_argument("--quant-head", action="store_true",
                   help="with --quant: quantize the output head too (a head tied to the input "
                        "embeddings is stored once, quantized)")
    g.add_argument("--offload", choices=["nvme", "cpu"],
                   help="ZeRO-Inference: the variant's weights stream layer by layer from files "
                        "under --nvme-path (nvme) or from host memory to an accelerator (cpu), "
                        "read ahead while the previous layer computes (offload=); the run "
                        "first probes that tier's read bandwidth and each row reports the bytes "
                        "streamed per decode step, their GB/s against the probe, the read/compute "
                        "overlap and the peak RSS")
    g.add_argument("--nvme-path", metavar="DIR",
                   help="with --offload nvme: an existing writable directory on a fast local "
                        "disk for the repacked weights (reused by later runs of the same model "
                        "and settings)")
    g.add_argument("--buffer-count", type=int, metavar="K",
                   help="with --offload: ring slots, at least 2, each the size of the largest "
                        "layer; K-1 layers are read ahead (default: the engine's, 4)")
    g.add_argument("--plain", action="store_true",
                   help="one shardwise variant with no optimising option (init_inference only "
                        "places and casts the model; with --tp it shards it)")
    g.add_argument("--baseline-dtype", choices=["fp32", "fp16", "bf16", "auto"],
                   help="dtype of the HF baseline only (default: --dtype), e.g. an fp32 "
                        "baseline against --dtype bf16 --quant int8")
    g.add_argument("--baseline-experts", metavar="IMPL",
                   help="MoE models only: HF's experts implementation for the baseline (eager, "
                        "grouped_mm, batched_mm, ...; default: HF's own default); the row is "
                        "named hf[IMPL]")


def _add_output_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output", metavar="FILE.json",
                   help="results file (default shardwise-bench-<date>.json in the current "
                        "folder, which must exist and be writable); the chart is written next "
                        "to it as .png")
    g.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--bandwidth-mib", type=_positive, metavar="MiB",
                   help="size of the bandwidth probe's buffer (default 512 on CPU, 2048 else); "
                        "with --offload also of the tier's probe (default 256)")
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


#: Options that pick the shardwise variant; with none of them the device's default set runs.
VARIANT_OPTIONS = ("dtype", "inject", "graphs", "quant", "offload", "plain", "weight_dtype")
#: Options that only --offload reads.
OFFLOAD_ONLY_OPTIONS = ("nvme_path", "buffer_count")
#: Options only a multi-node run (--nnodes > 1) reads.
MULTI_NODE_OPTIONS = ("node_rank", "master_addr", "master_port")
#: Modes that do something else than running, and take no run options.
OTHER_MODES = ("compare", "list_presets")


def _given(args: argparse.Namespace) -> list[str]:
    """The dests of the options given with a non-default value."""
    return [a.dest for a in (_PARSER._actions if _PARSER else []) if a.option_strings
            and getattr(args, a.dest, None) not in (a.default, None)]


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_combinations(args: argparse.Namespace) -> None:
    """Refuse option combinations that would be ignored or fail later: one ConfigError naming
    the options, before any model, device or file is touched."""
    given = _given(args)
    modes = [d for d in OTHER_MODES if d in given]
    if modes:
        others = [d for d in given if d != modes[0]]
        if others:
            raise ConfigError(f"{_flag(modes[0])} takes no other option; drop "
                              f"{', '.join(map(_flag, others))}")
        return
    if args.plain and (args.inject or args.graphs or args.quant):
        raise ConfigError("--plain is the variant without optimising options; drop --plain or "
                          "drop --inject/--graphs/--quant")
    if args.quant_head and not args.quant:
        from ..bench.plan import QUANT_HEAD_ALONE

        raise ConfigError(QUANT_HEAD_ALONE)
    if args.graphs and not args.inject:
        raise ConfigError("--graphs captures the injected decode step: add --inject (or drop "
                          "--graphs; without variant options the bench runs both)")
    stray = [d for d in OFFLOAD_ONLY_OPTIONS if d in given]
    if stray and not args.offload:
        raise ConfigError(f"{', '.join(map(_flag, stray))}: used only by --offload (how the "
                          f"weights stream in); add --offload nvme (or cpu), or drop "
                          f"{'them' if len(stray) > 1 else 'it'}")
    _check_pipeline_options(args)
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.moe_dispatch and max(args.ep) <= 1:
        raise ConfigError(f"--moe-dispatch {args.moe_dispatch} picks how expert-parallel ranks "
                          f"exchange the experts' work: it needs --ep > 1 (or drop it)")
    if args.nnodes == 1:
        stray = [d for d in MULTI_NODE_OPTIONS if d in given]
        if stray:
            raise ConfigError(f"{', '.join(map(_flag, stray))} need --nnodes > 1")
    elif not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank {args.node_rank} is not in 0..{args.nnodes - 1} "
                          f"(--nnodes {args.nnodes})")


#: variant options the bench does not run with --pp (injection, graphs and quant= compose with
#: stages in the engine and here; the bench's offload variant, with its read-bandwidth probe of
#: one process's ring, does not time stages yet)
NOT_WITH_PP = ("offload",)


def _check_pipeline_options(args: argparse.Namespace) -> None:
    """--pp and --micro-batches: a positive stage count, micro-batches only with stages, and no
    variant option the stages do not run with yet."""
    if args.pp < 1:
        raise ConfigError(f"--pp must be a positive number of pipeline stages, got {args.pp}")
    if args.micro_batches is not None and args.pp == 1:
        raise ConfigError(f"--micro-batches {args.micro_batches} splits each forward for the "
                          f"pipeline stages: it needs --pp > 1 (or drop it)")
    refused = [d for d in NOT_WITH_PP if getattr(args, d)]
    if args.pp > 1 and refused:
        raise ConfigError(f"--pp {args.pp} does not run with {', '.join(map(_flag, refused))} "
                          f"yet (the bench times the plain variant over pipeline stages); drop "
                          f"{'them' if len(refused) > 1 else 'it'}, or drop --pp")


def micro_batches(args: argparse.Namespace) -> int:
    """--micro-batches, by default 2 × --pp (the issue's M >= 2P); 1 without stages."""
    if args.pp == 1:
        return 1
    return args.micro_batches if args.micro_batches is not None else 2 * args.pp


def output_path(args: argparse.Namespace) -> Path:
    """The results file (``--output`` or ``shardwise-bench-<date>.json``), checked writable,
    together with the chart next to it, before the runs: a ConfigError says what is wrong."""
    from ..bench.report import check_writable

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    output = Path(args.output or f"shardwise-bench-{stamp}.json")
    if output.suffix != ".json":
        raise ConfigError(f"--output {str(output)!r} must end in .json (the chart is written "
                          f"next to it as .png)")
    check_writable(output, "--output")
    if not args.no_chart:
        check_writable(output.with_suffix(".png"), "the chart (next to --output)")
    return output


def _variants(args: argparse.Namespace, accelerator) -> tuple[list, str | None, list[str]]:
    """``(variants, baseline dtype, notes)``: the one variant the variant options describe, or
    the device's default set (see :func:`~shardwise.bench.plan.default_variants`), whose
    baseline runs in the same preferred dtype as its first variant; with ``--hf-loop`` the
    injected ones time HF's generate loop."""
    variants, baseline, notes = _described_variants(args, accelerator)
    if args.hf_loop:
        variants = [replace(v, hf_loop=True) if v.inject else v for v in variants]
    return variants, baseline, notes


def _described_variants(args: argparse.Namespace,
                        accelerator) -> tuple[list, str | None, list[str]]:
    from ..bench.plan import Variant, default_variants, resolve_dtype_name

    dtype = resolve_dtype_name(accelerator, args.dtype)
    baseline = resolve_dtype_name(accelerator, args.baseline_dtype)
    eps = list(dict.fromkeys(args.ep))
    if args.pp > 1 and not any(getattr(args, d) for d in VARIANT_OPTIONS):
        note = (f"--pp {args.pp}: the plain variant (add --inject, --graphs or --quant to time "
                f"those over the stages)")
        return [Variant(dtype, ep=ep) for ep in eps], baseline or dtype, [note]
    if any(getattr(args, d) for d in VARIANT_OPTIONS):
        variant = Variant(dtype, args.inject, args.graphs, args.quant, offload=args.offload,
                          quant_head=args.quant_head, weight_dtype=args.weight_dtype)
        return [replace(variant, ep=ep) for ep in eps], baseline or dtype, []
    variants, notes = default_variants(accelerator)
    return ([replace(v, ep=ep) for ep in eps for v in variants], baseline or variants[0].dtype,
            notes)


def _plan(args: argparse.Namespace):
    """Validate everything cheap (options, device, dtypes, models, --ep against them, --tp/--ep
    against the ranks and each model's plan on those ranks, matrix, every variant's engine
    config) before heavy work; returns ``(plan, accelerator, nproc, notes)``."""
    from ..bench.plan import (Plan, check_baseline_experts, check_cells_fit,
                              check_expert_parallel, check_offload_variants,
                              check_parallel_plans, check_tp, make_cells, resolve_models)
    from ..plugins import get_accelerator

    check_combinations(args)
    accelerator = get_accelerator(args.device)
    models = resolve_models(args.model, args.preset)
    for ep in args.ep:  # the model's experts first: the more basic problem than the ranks
        check_expert_parallel(models, ep, args.moe_dispatch)
    nproc = max(check_tp(accelerator, args.tp, args.nnodes, ep, args.pp) for ep in args.ep)
    variants, baseline_dtype, notes = _variants(args, accelerator)
    plan = Plan(models=models, cells=make_cells(args.batch, args.prompt_len, args.new_tokens),
                device=accelerator.name, variants=variants, tp=args.tp, nnodes=args.nnodes,
                baseline_dtype=baseline_dtype, baseline_experts=args.baseline_experts,
                warmup=args.warmup, repeats=args.repeats, seed=args.seed,
                moe_dispatch=args.moe_dispatch, nvme_path=args.nvme_path,
                buffer_count=args.buffer_count, pp=args.pp, micro_batches=micro_batches(args))
    if plan.pp > 1 and min(args.batch) < 2:
        notes.append(f"--pp {plan.pp}: a batch of 1 runs as one micro-batch (nothing in "
                     f"flight, no pipeline figures); give --batch >= 2")
    check_offload_variants(plan, accelerator)  # the engine's own checks, in the bench's words
    check_cells_fit(plan.models, plan.cells)
    check_baseline_experts(plan.models, plan.baseline_experts, accelerator, baseline_dtype)
    plan.check_variants()
    for ep in dict.fromkeys(args.ep):
        check_parallel_plans(plan.models, plan.tp, ep, plan.pp)
    return plan, accelerator, nproc, notes


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
    """Run ``shardwise bench``; exit code 1 when any run failed (its row says why), 2 for bad
    options (raised as ConfigError before anything runs)."""
    if args.list_presets or args.compare:
        check_combinations(args)
    if args.list_presets:
        from ..bench.presets import describe_presets

        print(describe_presets())
        return 0
    if args.compare:
        return _compare(args.compare)
    from ..bench.report import command_line, format_table
    from ..bench.session import run_bench

    plan, accelerator, _, notes = _plan(args)
    output = output_path(args)
    rendezvous = {"node_rank": args.node_rank, "master_addr": args.master_addr,
                  "master_port": args.master_port} if args.nnodes > 1 else None
    doc = run_bench(plan, accelerator, command=command_line(command_argv(args)),
                    options=_options(args), rendezvous=rendezvous,
                    bandwidth_bytes=args.bandwidth_mib and args.bandwidth_mib * 2**20,
                    show_progress=not args.no_progress, notes=notes)
    print(format_table(doc))
    _write_outputs(doc, output, chart=not args.no_chart)
    return 0 if all(r["status"] == "ok" for r in doc["runs"]) else 1

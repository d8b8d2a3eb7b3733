"""``shardwise serve``: an OpenAI-compatible HTTP server with continuous batching over one
engine (``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings`` for encoders,
``/v1/models``, ``/health``, ``/metrics``).

Without variant options it serves what shardwise runs fastest on this device, as the
accelerator says: kernel injection, with graphs where its graph strategy accelerates the
decode step, in its preferred dtype. Every option is checked (and the port bound) before the
model is loaded: bad input exits with code 2 and one line naming the problem. ``--tp N`` (and
``--pp P``: pipeline stages, P x N ranks) starts its ranks through ``shardwise launch``; rank 0
serves HTTP and sends each step to the others. SIGTERM / Ctrl-C stop accepting, let running
requests finish for ``--drain-timeout`` seconds, cancel the rest, and exit 0; a failed model
side (a rank died, a collective timed out) makes the server exit non-zero.
"""

from __future__ import annotations

import argparse

#: Defaults shown in --help (the server reads them from here too).
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BATCH = 16
DEFAULT_MAX_WAITING = 64
DEFAULT_PREFILL_BUDGET = 512
DEFAULT_DRAIN_S = 30.0


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of ``shardwise serve`` (also parsed by each ``--tp`` rank)."""
    from ..models import DEFAULT_MODEL_NAME
    from ..serve.scheduler import DEFAULT_PREFILL_STALL
    from ..serve.server import DEFAULT_MAX_TOKENS_CAP

    m = p.add_argument_group("model and engine")
    m.add_argument("--model", metavar="DIR|FILE.gguf",
                   help="a Hugging Face model directory (with config.json and a tokenizer) or a "
                        f".gguf file (default: the embedded {DEFAULT_MODEL_NAME})")
    m.add_argument("--device", help="accelerator plugin (default: $SHARDWISE_ACCELERATOR or "
                                    "detection)")
    m.add_argument("--dtype", choices=["fp32", "fp16", "bf16", "auto"],
                   help="compute dtype (default and auto: the device's preferred)")
    m.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks, started through `shardwise launch` (default 1)")
    m.add_argument("--pp", type=int, default=1, metavar="P",
                   help="pipeline stages (pipeline_parallel), each of --tp ranks: P x N ranks "
                        "started through `shardwise launch` (default 1)")
    m.add_argument("--micro-batches", type=int, metavar="M",
                   help="with --pp: a decode step's sequences may run as M groups one behind "
                        "the other through the stages, so independent requests fill them; "
                        "warm-up times each batch bucket's step whole and split and keeps the "
                        "faster, capturing the split steps too (default 1: whole steps; each "
                        "group reads the stage's weights again, which decode at small batches "
                        "cannot win back)")
    m.add_argument("--inject", action=argparse.BooleanOptionalAction, default=None,
                   help="kernel injection (default: on; continuous batching runs on the "
                        "injected layers' slot KV cache)")
    m.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture the decode step per batch bucket (default: on where the "
                        "device's graph strategy accelerates it)")
    m.add_argument("--quant", choices=["int8", "int4"], help="weight-only quantization")
    m.add_argument("--weight-dtype", choices=["bf16", "fp16"],
                   help="with --dtype fp32 (and graphs): the linear weights stored in 16 bits "
                        "under fp32 activations (init_inference(weight_dtype=...): what "
                        "llama.cpp's F16/BF16 files run)")
    m.add_argument("--comm-timeout", type=float, metavar="S",
                   help="seconds before a collective between --tp ranks gives up (default "
                        "$SHARDWISE_COMM_TIMEOUT or 300); a dead rank makes the server exit "
                        "within about this long")

    s = p.add_argument_group("server")
    s.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default "
                                                        f"{DEFAULT_HOST})")
    s.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"TCP port (default {DEFAULT_PORT}; 0 picks a free one, printed when "
                        f"ready)")
    s.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API (default: the model folder's or file's "
                        "name)")
    s.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="N",
                   help=f"sequences decoded together: KV-cache slots (default "
                        f"{DEFAULT_MAX_BATCH})")
    s.add_argument("--max-tokens", type=int, metavar="N",
                   help=f"KV-cache positions per sequence, prompt + completion (default: the "
                        f"model's context, at most {DEFAULT_MAX_TOKENS_CAP})")
    s.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING, metavar="N",
                   help=f"requests queued beyond the running batch before answering 429 "
                        f"(default {DEFAULT_MAX_WAITING})")
    s.add_argument("--prefill-budget", type=int, default=DEFAULT_PREFILL_BUDGET, metavar="N",
                   help=f"the most prompt tokens prefilled in one scheduler step; while streams "
                        f"decode, each step's share is also held to --prefill-stall (default "
                        f"{DEFAULT_PREFILL_BUDGET})")
    s.add_argument("--prefill-stall", type=float, default=DEFAULT_PREFILL_STALL, metavar="F",
                   help=f"while streams decode, the prompt chunk a step carries may add at most "
                        f"F x the typical decode step to their gap: lower keeps the inter-token "
                        f"latency steadier, higher prefills joining prompts sooner (more "
                        f"tokens/s and earlier first tokens under load) (default "
                        f"{DEFAULT_PREFILL_STALL:g}: a gap at most twice the typical step)")
    s.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_S, metavar="S",
                   help=f"on SIGTERM / Ctrl-C: seconds running requests may still finish "
                        f"before they are cancelled (default {DEFAULT_DRAIN_S:g})")
    return p


def add_parser(sub):
    """Register ``serve`` on the ``shardwise`` subcommand parser."""
    p = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_arguments(p)


def rank_parser(prog: str) -> argparse.ArgumentParser:
    """The same options as a standalone parser, for ``python -m shardwise.serve.rank_main``."""
    return add_arguments(argparse.ArgumentParser(prog=prog))


def run(args: argparse.Namespace) -> int:
    """Run ``shardwise serve``; 0 after a clean shutdown, 2 for bad options (a ConfigError
    before the model loads), 1 when the model side failed while serving."""
    from ..serve.server import serve

    return serve(args)

"""bf16 decode on CPU against fp32 and HF, in one process, interleaved (issue 21: "the bf16 path
is never slower than HF's bf16 on the same model, and never slower than shardwise's own fp32").

    python benchmarks/cpu_bf16_decode.py --preset llama-20l-1536h-gqa --threads 2 --rounds 5 \
        --output benchmarks/results/cpu-bf16-decode-llama-20l-1536h-gqa.json

Variants (each its own copy of the same fixed-seed preset weights):

* ``hf-bf16`` / ``hf-fp32``: the plain Hugging Face model (eager), in that dtype;
* ``sw-fp32``: shardwise, kernel injection + graphs (the CPU's compiled decode step), fp32;
* ``sw-bf16``: the same in bf16 (the linear weights in column blocks read by the native 16-bit
  kernel, ``kernels/cpu/native/half.cpp``, where it builds);
* ``sw-bf16-rowproduct``: bf16 as before that kernel (native CPU kernels opted out: the weights
  keep their layout and one-row linears are :mod:`shardwise.accelerators.cpu_gemv`'s compiled
  row product);
* ``sw-bf16-aten``: bf16 as before the row product (the compiled step's bf16 linears on ATen's
  GEMMs);
* ``sw-bf16-onepiece``: ``sw-bf16-rowproduct`` with every row product summed in one piece, as
  before long rows (more than ``cpu_gemv.LONG_ROW`` input features: e.g. a down projection of
  5632 or 8192) were summed in chunks.

Per-token decode time: ``(t(generate N new) - t(generate 1 new)) / (N - 1)`` for the same
prompt, greedy, batch 1 — prefill and the first token cancel out. Each round runs every variant
once (both lengths) in a fixed order, so load from other processes on a shared machine hits
them alike; the table gives medians over rounds. All variants share torch's one OpenMP pool
(``--threads``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import shardwise
from shardwise.accelerators import cpu_gemv, cpu_graphs
from shardwise.bench.presets import build_preset

VARIANTS = ("hf-bf16", "hf-fp32", "sw-fp32", "sw-bf16", "sw-bf16-rowproduct", "sw-bf16-aten",
            "sw-bf16-onepiece")


@contextlib.contextmanager
def _without_native_kernels():
    """Build an engine with the native CPU kernels opted out (16-bit weights keep their
    layout)."""
    from shardwise.kernels.cpu import native

    before = os.environ.get(native.ENV)
    os.environ[native.ENV] = "torch"
    try:
        yield
    finally:
        if before is None:
            del os.environ[native.ENV]
        else:
            os.environ[native.ENV] = before


@contextlib.contextmanager
def _without_row_products():
    """Build an engine as before the row product: bf16 linears left to ATen's GEMMs."""
    real = cpu_graphs.use_row_products
    cpu_graphs.use_row_products = lambda linears: 0
    try:
        with _without_native_kernels():
            yield
    finally:
        cpu_graphs.use_row_products = real


@contextlib.contextmanager
def _rows_in_one_piece():
    """Trace the row products as before long rows were chunked."""
    real = cpu_gemv.LONG_ROW
    cpu_gemv.LONG_ROW = 1 << 62
    try:
        with _without_native_kernels():
            yield
    finally:
        cpu_gemv.LONG_ROW = real


#: the variants built and first run (their step traced) inside a changed scope
SCOPES = {"sw-bf16-rowproduct": _without_native_kernels, "sw-bf16-aten": _without_row_products,
          "sw-bf16-onepiece": _rows_in_one_piece}


def build(variant: str, base: torch.nn.Module, ids: torch.Tensor, new: int):
    """``(generate(ids, new), its first greedy tokens)`` of ``variant`` on a copy of ``base``
    (fp32); built and run once (the warm-up: the step traced) inside its scope."""
    model = copy.deepcopy(base)
    dtype = torch.float32 if variant.endswith("fp32") else torch.bfloat16
    with SCOPES.get(variant, contextlib.nullcontext)():
        if variant.startswith("hf"):
            run = model.to(dtype).eval()
        else:
            run = shardwise.init_inference(model, device="cpu", dtype=dtype,
                                           replace_with_kernel_inject=True, enable_graph=True)

        def generate(ids: torch.Tensor, new: int) -> torch.Tensor:
            with torch.inference_mode():
                return run.generate(ids, max_new_tokens=new, min_new_tokens=new,
                                    do_sample=False, pad_token_id=0)
        first = generate(ids, new)[0, ids.shape[1]:].tolist()
    return generate, first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-20l-1536h-gqa")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = build_preset(args.preset, torch.float32)
    vocab = base.config.vocab_size
    ids = torch.randint(3, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    runs, tokens = {}, {}
    for v in args.variants:
        start = time.perf_counter()
        runs[v], tokens[v] = build(v, base, ids, args.new_tokens)  # built and warmed up
        print(f"{v}: ready in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    del base
    samples = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for v, gen in runs.items():
            t0 = time.perf_counter()
            gen(ids, 1)
            t1 = time.perf_counter()
            gen(ids, args.new_tokens)
            t2 = time.perf_counter()
            samples[v].append(((t2 - t1) - (t1 - t0)) / (args.new_tokens - 1) * 1e3)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{v} {samples[v][-1]:.1f}" for v in runs), file=sys.stderr, flush=True)
    medians = {v: statistics.median(s) for v, s in samples.items()}
    print(f"{args.preset}, batch 1, prompt {args.prompt_len}, {args.threads} threads, "
          f"median of {args.rounds} interleaved rounds (decode ms/token)")
    for v in args.variants:
        print(f"  {v:17s} {medians[v]:8.1f}   (samples: "
              f"{', '.join(f'{s:.1f}' for s in samples[v])})")
    if args.output:
        Path(args.output).write_text(json.dumps({
            "command": "python benchmarks/cpu_bf16_decode.py " + " ".join(sys.argv[1:] if argv is
                                                                          None else argv),
            "preset": args.preset, "threads": args.threads, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "rounds": args.rounds,
            "machine": {"cpu": shardwise.get_accelerator("cpu").device_name(),
                        "torch": torch.__version__, "python": platform.python_version()},
            "decode_ms_per_token_median": medians, "samples_ms": samples,
            "greedy_tokens": tokens}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

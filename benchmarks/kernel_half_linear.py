"""The CPU's 16-bit linear products per row count: the native blocked kernel
(``kernels/cpu/native/half.cpp``, weights in column blocks) against the compiled row product
(``accelerators/cpu_gemv.py``, one row, the plain layout) and ATen's ``F.linear`` on the plain
weight — what ``cpu_blocked_layout.NATIVE_ROWS`` rests on. For bf16 on a CPU with AVX512-BF16
the op's two paths are timed: ``native dot`` (``vdpbf16ps``, ``SHARDWISE_CPU_BF16_DOT=1``) and
``native widening`` (fp32 FMAs, ``=0``; both at every row count there), and the line above
the table says which one the op picks by itself on this CPU (its one-off timing, ``half.cpp``'s
``time_bf16_loops``). fp16 (and bf16 on other CPUs) has the widening loops only, ``native
blocked``: ATen's GEMM on the reassembled weight past 64 rows.

    python benchmarks/kernel_half_linear.py                    # a 1.7B Llama layer's shapes
    python benchmarks/kernel_half_linear.py --rows 1 8 --dtype fp16

Per row count, one call of each variant over a whole decoder layer's worth of weights
(``--shapes`` N×K, each repeated ``--layers`` times so a call reads from memory, not the
caches), interleaved (``timing.median_us``). Prints GB/s of weight bytes read (against a copy
probe of the same bytes, counted as ``shardwise bench`` counts it: read + written) and
GFLOP/s; ``aten (reassembled)`` (from 8 rows) is the blocked weight's path past
``cpu_blocked_layout.NATIVE_ROWS``: the plain weight put back together, then ATen.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from timing import median_us

from shardwise.accelerators.cpu_blocked_layout import block_weight, reassembled
from shardwise.accelerators.cpu_gemv import row_product
from shardwise.kernels.cpu import native

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: the op's switch between its bf16 paths (kernels/cpu/native/__init__.py)
DOT_ENV = "SHARDWISE_CPU_BF16_DOT"


def copy_probe_gbps(nbytes: int, repeats: int) -> float:
    """Bytes read per second by ``dst.copy_(src)`` of ``nbytes`` (the bench's probe: the copy
    reads ``nbytes`` and writes as many; counted as 2 × nbytes moved)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    (us,) = median_us([lambda: dst.copy_(src)], repeats)
    return 2 * nbytes / us / 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["2048x2048", "2048x2048", "2048x2048",
                                                     "2048x2048", "8192x2048", "8192x2048",
                                                     "2048x8192"],
                    help="N×K of each weight of one layer (default: a 1.7B Llama's q k v o "
                         "gate up down)")
    ap.add_argument("--layers", type=int, default=6, help="copies of the layer's weights")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not native.load():
        raise SystemExit("the native CPU kernels do not build here (or are opted out)")
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] * args.layers
    plain = [(torch.randn(n, k, generator=g) * 0.02).to(dtype) for n, k in shapes]
    blocked = [block_weight(w.t()) for w in plain]
    nbytes = sum(w.numel() * w.element_size() for w in plain)
    flop_per_row = sum(2 * w.numel() for w in plain)
    probe = copy_probe_gbps(nbytes, args.repeats)
    print(f"threads {torch.get_num_threads()}, {args.dtype}, {len(plain)} weights, "
          f"{nbytes / 2**20:.0f} MiB per call, copy probe {probe:.1f} GB/s, median of "
          f"{args.repeats} interleaved calls")
    os.environ.pop(DOT_ENV, None)  # the op's own pick, reported; each call below forces one
    picks, dot_s, widen_s = native.cpu_bf16_dot_choice()
    dot_cpu = dtype == torch.bfloat16 and dot_s > 0
    if dot_cpu:
        print(f"bf16 loops picked by the op on this CPU: {'dot' if picks else 'widening'} "
              f"(its probe: dot {dot_s * 1e6:.2f} us, widening {widen_s * 1e6:.2f} us)")
    rowprod = torch.compile(row_product, dynamic=False)
    for rows in args.rows:
        xs = [torch.randn(rows, k, generator=g).to(dtype) for _, k in shapes]

        def run_native(dot: bool):
            os.environ[DOT_ENV] = "1" if dot else "0"  # read by the op at each call
            return [native.cpu_blocked_linear(x, b, None, w.shape[0])
                    for x, b, w in zip(xs, blocked, plain)]

        if dot_cpu:
            calls = {"native dot": lambda: run_native(True),
                     "native widening": lambda: run_native(False)}
        else:
            calls = {"native blocked": lambda: run_native(False)}
        calls["aten (plain)"] = lambda: [F.linear(x, w) for x, w in zip(xs, plain)]
        if rows >= 8:  # ATen on the reassembled weight (fp16's path past NATIVE_ROWS)
            calls["aten (reassembled)"] = lambda: [F.linear(x, reassembled(b, w.shape[0]).t())
                                                   for x, b, w in zip(xs, blocked, plain)]
        if rows == 1:
            calls["row product (compiled)"] = lambda: [rowprod(x, w) for x, w in zip(xs, plain)]
        with torch.inference_mode():
            times = median_us(list(calls.values()), args.repeats)
        line = ", ".join(f"{name} {nbytes / us / 1e3:.1f} GB/s "
                         f"({100 * nbytes / us / 1e3 / probe:.0f}%) "
                         f"{rows * flop_per_row / us / 1e3:.0f} GFLOP/s"
                         for name, us in zip(calls, times))
        print(f"rows {rows}: {line}", flush=True)


if __name__ == "__main__":
    main()

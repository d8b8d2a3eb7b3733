"""The compiled one-row bf16 product (``accelerators/cpu_gemv.py``) summed over the whole row
against summed in chunks, per row length K: what ``cpu_gemv.LONG_ROW`` rests on.

    python benchmarks/kernel_row_product.py                     # K 1536 3072 4096 5632 8192
    python benchmarks/kernel_row_product.py --k 8192 --chunks 256 512 1024

For each K: ``--n``-row bf16 weights, as many as make ``--mib`` MiB (so each call reads from
memory, not the caches), one [1, K] row; each variant is ``torch.compile``'d the way the CPU
decode step's row product is traced (``cpu_gemv.row_sums`` over every weight, one piece or
``chunk`` columns at a time) and called interleaved with the others (``timing.median_us``).
Prints GB/s of weight bytes read per variant and the chunked sums' largest difference from
the one-piece sum.
"""

from __future__ import annotations

import argparse

import torch
from timing import median_us

from shardwise.accelerators.cpu_gemv import row_sums


def variants(chunks: list[int], k: int) -> dict[str, int | None]:
    """Name → chunk (None: the whole row) for the chunks that divide ``k``."""
    return {"one piece": None, **{f"chunk {c}": c for c in chunks if k % c == 0}}


def measure(k: int, args: argparse.Namespace) -> None:
    torch._dynamo.reset()  # a fresh cache per K: recompiles of earlier shapes do not count
    g = torch.Generator().manual_seed(k)
    per_weight = args.n * k * 2
    count = max(1, (args.mib << 20) // per_weight)
    weights = [torch.randn(args.n, k, generator=g).bfloat16() for _ in range(count)]
    x = torch.randn(1, k, generator=g).bfloat16()
    calls, results = {}, {}
    for name, chunk in variants(args.chunks, k).items():
        step = torch.compile(lambda x, *ws, chunk=chunk: [row_sums(x, w, chunk) for w in ws],
                             dynamic=False)
        results[name] = step(x, *weights)[0]
        calls[name] = lambda step=step: step(x, *weights)
    times = median_us(list(calls.values()), args.repeats)
    line = ", ".join(f"{name} {count * per_weight / us / 1e3:.1f} GB/s"
                     for name, us in zip(calls, times))
    worst = max((r - results["one piece"]).abs().max().item() for r in results.values())
    print(f"K={k} N={args.n} ({count} weights): {line}; largest difference {worst:.2g}",
          flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, nargs="+", default=[1536, 3072, 4096, 5632, 8192])
    ap.add_argument("--n", type=int, default=2048, help="output rows per weight")
    ap.add_argument("--chunks", type=int, nargs="+", default=[512])
    ap.add_argument("--mib", type=int, default=192, help="weight bytes per call (MiB)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, bf16, median of {args.repeats} interleaved calls")
    for k in args.k:
        measure(k, args)


if __name__ == "__main__":
    main()

"""Fused norm kernels on this machine: the torch reference vs the backend the accelerator resolves.

    python benchmarks/kernel_norms.py --device cpu --threads 1 --rows 16 --hidden 2048

Prints the median time per call (µs) of each op, interleaving reference and backend calls so
machine noise hits both alike, and the speed-up of the resolved backend over the reference.
"""

from __future__ import annotations

import argparse

import torch
from timing import median_us

import shardwise
from shardwise.kernel_registry import registry




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=400)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    acc = shardwise.get_accelerator(args.device)
    dev = acc.device()
    for dtype in acc.supported_dtypes:
        x, r = (torch.randn(args.rows, args.hidden, dtype=dtype, device=dev) for _ in range(2))
        w, b = (torch.randn(args.hidden, dtype=dtype, device=dev) for _ in range(2))
        for op, call_args in (("rms_norm", (x, w, 1e-5, r)), ("layer_norm", (x, w, b, 1e-5, r))):
            ref = registry.implementations(op)["reference"]
            impl = registry.resolve(op, acc, dtype, hidden=args.hidden)

            def timed(f):
                return lambda: (f(*call_args), acc.synchronize())

            t_ref, t_impl = median_us([timed(ref), timed(impl)], args.repeats)
            print(f"{acc.name} threads={torch.get_num_threads()} {str(dtype)[6:]:9s} {op:10s} "
                  f"reference {t_ref:8.1f} us  {impl.backend:9s} {t_impl:8.1f} us  "
                  f"speed-up {t_ref / t_impl:.2f}x")


if __name__ == "__main__":
    main()

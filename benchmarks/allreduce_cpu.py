"""all_reduce latency on CPU ranks of one node: gloo vs the shared-memory path of CpuCommunicator.

    python benchmarks/allreduce_cpu.py                      # 2 ranks, fp32, 1 KiB ... 1 MiB
    python benchmarks/allreduce_cpu.py --ranks 2 --dtype bfloat16 --sizes-kib 4 64 4096

Starts ``--ranks`` processes itself (torch.multiprocessing spawn, gloo over 127.0.0.1, each rank
with the CPU accelerator's thread share, as ``shardwise`` launches them). For each size, every
rank calls the shared-memory ``all_reduce`` and the plain gloo one in alternating blocks of
``--block`` timed calls (so machine noise hits both alike), each block after ``--warmup``
untimed calls that absorb the skew with which ranks leave the previous block; ``--repeats``
timed calls per path and size in all. ``--paths shm`` (or ``gloo``) times one path alone: gloo's
background activity after its calls lengthens the shared-memory path's tail (p90) when the two
are interleaved. The slot size is raised to the largest size asked for, so every size really
runs through shared memory. Prints rank 0's median and p90 per call in microseconds and the
speed-up (gloo median / shm median).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys

import torch
import torch.multiprocessing as mp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quantiles_us(samples: list[float]) -> tuple[str, str]:
    """Median and 90th percentile of ``samples`` (seconds), in microseconds, formatted."""
    ordered = sorted(samples)
    return (f"{statistics.median(ordered) * 1e6:.1f}",
            f"{ordered[int(0.9 * (len(ordered) - 1))] * 1e6:.1f}")


def _rank(rank: int, world: int, port: int, args, queue) -> None:
    import time

    import shardwise
    from shardwise.communicator import create_communicator

    acc = shardwise.get_accelerator("cpu")
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), **acc.launch_env(rank, world)})
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    comm = create_communicator(acc, timeout_s=60)
    if not comm.shm_enabled:
        raise SystemExit(f"shared-memory all_reduce is off: {comm.shm_reason}")
    dtype = DTYPES[args.dtype]
    rows = []
    for kib in args.sizes_kib:
        numel = kib * 1024 // dtype.itemsize
        x = torch.randn(numel).to(dtype)  # [numel], the payload of one all_reduce
        calls = {"shm": comm.all_reduce, "gloo": comm.gloo_all_reduce}
        calls = {path: calls[path] for path in args.paths}
        times = {path: [] for path in calls}
        blocks = -(-args.repeats // args.block)
        for _ in range(blocks):
            for path, call in calls.items():
                # untimed calls first: ranks leave a collective at different moments, and the
                # first call of a block would otherwise time that skew instead of the path
                for i in range(args.warmup + args.block):
                    start = time.perf_counter()
                    call(x)
                    elapsed = time.perf_counter() - start
                    if i >= args.warmup:
                        times[path].append(elapsed)
                if comm.last_path != path:
                    raise SystemExit(f"{kib} KiB: expected the {path} path, got {comm.last_path}")
                x.fill_(1.0)  # keep values bounded (sums double every call)
        rows.append((kib, *(_quantiles_us(times[p]) if p in times else ("-", "-")
                            for p in ("shm", "gloo"))))
    comm.close()
    if rank == 0:
        queue.put((torch.get_num_threads(), rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--sizes-kib", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=1000)
    ap.add_argument("--block", type=int, default=100, help="timed calls per block; blocks of "
                    "the two paths alternate so machine noise hits both alike")
    ap.add_argument("--warmup", type=int, default=20, help="untimed calls before each block")
    ap.add_argument("--paths", nargs="+", choices=["shm", "gloo"], default=["shm", "gloo"],
                    help="paths to time (one alone shows its tail without the other's noise)")
    args = ap.parse_args()
    os.environ["SHARDWISE_CPU_SHM_SLOT_BYTES"] = str(max(args.sizes_kib) * 1024)
    os.environ.pop("SHARDWISE_CPU_SHM_ALLREDUCE", None)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_rank, args=(args.ranks, _free_port(), args, queue), nprocs=args.ranks)
    threads, rows = queue.get()
    print(f"all_reduce {args.dtype}, {args.ranks} ranks x {threads} thread(s), "
          f"{args.repeats} calls per size and path; rank 0's times in microseconds; "
          f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    print(f"{'size':>9} | {'shm median':>10} {'p90':>8} | {'gloo median':>11} {'p90':>8} | "
          f"{'speed-up':>8}")
    for kib, (shm_med, shm_p90), (gloo_med, gloo_p90) in rows:
        size = f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB"
        speedup = "-" if "-" in (shm_med, gloo_med) else f"{float(gloo_med) / float(shm_med):.1f}x"
        print(f"{size:>9} | {shm_med:>10} {shm_p90:>8} | {gloo_med:>11} {gloo_p90:>8} | "
              f"{speedup:>8}")


if __name__ == "__main__":
    main()

"""Quantized experts at decode shapes: ``quant_moe_mlp`` (cpu, int8/int4; the native kernel and
torch's packed kernels) vs the float experts.

    python benchmarks/kernel_quant_moe.py --threads 2 --tokens 1 8 --hidden 1024 --inter 2816

For each token count: median µs per call (calls interleaved so machine noise hits all alike) of
the float experts in fp32 and bf16 (the ``cpu`` backend's ``moe_grouped_mlp``, which ties HF's
``grouped_mm``), and of the quantized experts in int8 per channel and int4 groups of
``--int4-group`` (128), each with the cpu backend's ``quant_moe_mlp`` on the native AVX512-VNNI
kernel (``*-native``: activations quantized to int8 per block of 16 (int8) / 32 (int4)) and on
torch's packed weight-only kernels (``*-torch``, bf16 activations: the path quantized experts took
before), all on the same weights and routing (a softmax router, top-k, renormalised); and the GB/s of
weight bytes read per call: the distinct experts hit × their bytes in that format (packed bytes
and scales for the quantized ones). ``--clock cpu`` times with the process's CPU time instead of
the wall clock (on a shared machine it leaves out the time other processes take; with
``--threads 1`` it is the call's own compute time). Where the native kernel does not build, its
columns are left out (one line says so). The same routing every call lets part of the hit
experts' bytes stay in the last-level cache between calls (at one token 2 int8 experts are
17 MiB); ``--evict`` interleaves a copy of a 256 MiB buffer with the calls, so every call reads
its weights from memory as a decode step's layers do (``kernel_moe.py --quant`` does the same
for the captured calls).
"""

from __future__ import annotations

import argparse

import torch

from shardwise.kernels.cpu import moe as cpu_moe
from shardwise.kernels.cpu import native
from shardwise.kernels.cpu import quant as cpu_quant
from shardwise.kernels.reference import moe as ref
from shardwise.kernels.reference.quant import quantize_experts
from timing import CLOCKS, median_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    ap.add_argument("--int4-group", type=int, default=128)
    ap.add_argument("--evict", action="store_true",
                    help="interleave a 256 MiB copy: every call reads its weights from memory")
    args = ap.parse_args()
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(e, 2 * i, h, generator=g) * h ** -0.5
    down = torch.randn(e, h, i, generator=g) * i ** -0.5
    floats = {"fp32": (gate_up, down), "bf16": (gate_up.bfloat16(), down.bfloat16())}
    kernels = {"torch": cpu_quant.torch_quant_moe_mlp}  # torch's packed kernels only
    if native.load():
        kernels["native"] = cpu_quant.quant_moe_mlp
    else:
        print("the native kernel does not build here: its columns are left out")
    quantized = {}  # "int8-native" → (kernel, (gate_up, down) packed for it)
    for fmt, bits, group in (("int8", 8, -1), ("int4", 4, args.int4_group)):
        qws = [quantize_experts(w, bits, group) for w in (gate_up, down)]
        for kname, kernel in kernels.items():
            quantized[f"{fmt}-{kname}"] = (kernel, tuple(
                kernel.prepack(qw, e, "cpu", torch.bfloat16) for qw in qws))
    per_expert = {name: sum(t.numel() * t.element_size() for t in pair) / e
                  for name, pair in floats.items()}
    per_expert.update({name: sum(p.nbytes for p in pair) / e
                       for name, (_, pair) in quantized.items()})
    print(f"threads={torch.get_num_threads()} clock={args.clock} H={h} I={i} E={e} k={k}; "
          f"bytes per expert: "
          + ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in per_expert.items()))
    for tokens in args.tokens:
        x = torch.randn(tokens, h, generator=g)
        weights, experts = ref.moe_route(torch.randn(tokens, e, generator=g), k,
                                          renormalize=True)
        hit = len(experts.unique())
        calls = {"fp32": lambda: cpu_moe.moe_grouped_mlp(x, *floats["fp32"], experts, weights),
                 "bf16": lambda: cpu_moe.moe_grouped_mlp(x.bfloat16(), *floats["bf16"],
                                                         experts, weights)}
        for name, (kernel, pair) in quantized.items():
            calls[name] = (lambda kernel=kernel, pair=pair: kernel(x.bfloat16(), *pair, experts,
                                                                   weights))
        if args.evict:
            src = torch.ones(64 << 20)  # 256 MiB of float32
            dst = torch.empty_like(src)
            calls["evict"] = lambda: dst.copy_(src)
        with torch.no_grad():
            times = median_us(list(calls.values()), args.repeats, warmup=3, clock=clock)
        if args.evict:
            calls.pop("evict")
            times = times[:-1]
        line = "  ".join(f"{name} {t:8.0f} us {hit * per_expert[name] / t / 1e3:5.1f} GB/s"
                         for name, t in zip(calls, times))
        speed = ", ".join(f"{name} {times[0] / t:.2f}x / {times[1] / t:.2f}x"
                          for name, t in zip(list(calls)[2:], times[2:]))
        print(f"  tokens={tokens:3d} experts hit={hit}: {line}  (vs fp32 / bf16: {speed})")


if __name__ == "__main__":
    main()

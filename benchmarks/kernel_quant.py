"""Weight-only quantized linear on this machine: dense F.linear vs the resolved ``quant_linear``,
the CPU backend's native kernel (8-bit activations, AVX512-VNNI) beside torch's packed kernels.

    python benchmarks/kernel_quant.py                       # 1.7B shapes, batch 1 and 8, 2 threads
    python benchmarks/kernel_quant.py --threads 1 --clock cpu   # on a busy machine

For each shape ``[batch, in] x [in -> out]`` it times, interleaved (so machine noise hits all
alike), dense fp32 and ``--dtype`` F.linear and every quantized variant packed by the backend the
registry resolves, once per CPU kernel (``SHARDWISE_CPU_QUANT_KERNEL`` = native / torch at
prepack time), then prints the median µs per call, the speed-up over fp32, and the weight bytes
read per call as GB/s against the device's measured copy bandwidth (the probe ``shardwise bench``
uses: the decode roofline). ``--reference`` adds the reference (dequantize + F.linear per call,
50 ms and more), ``--fp32-model`` an fp32 model's QuantLinear (fp32 read in place by the native
kernel; under ``SHARDWISE_CPU_QUANT_KERNEL=torch`` the casts to bf16 and back, timed too).

Measured on 2 cores of an AMD EPYC (Zen4, AVX512-VNNI/BF16), torch 2.13, bf16 activations, on a
machine shared with other jobs (load average 10-15 on the 2 cores: wall-clock 2-thread figures
were meaningless, up to 60x outliers), so with ``--threads 1 --clock cpu --repeats 30`` (the
process's CPU time: a core's work, without the waits), µs per call and GB/s of packed weight
bytes per core:

    shape          batch  bf16 F.linear  int8/ch native  int8/ch torch  int4 g128 native  int4 g128 torch  int4 g32 native  int4 g32 torch
    2048 -> 8192   1      2304            735 (23 GB/s)  1162 (14)       450 (20)*        550 (16)         365 (29)         647 (16)
    2048 -> 8192   8      2353           1447           2423            1012             1789             1217             1804
    8192 -> 2048   1      2019            635 (26)      1059 (16)        344 (26)         479 (19)         384 (27)         520 (20)
    8192 -> 2048   8      2200           1397           2370            1230             1662             1262             1631
    2048 -> 2048   8       796            479            540             294              442              300              434

(* a noisy row: g32, with more scale bytes, ran faster). int8 in groups of 32 (llama.cpp's Q8_0
block): native 751-892 µs at batch 1, torch's grouped path (one call per group) 2241-3552. One
core of the native kernel reads 23-29 GB/s of packed weight (two cores only since `ce5ff16`:
the extension was built without OpenMP before, so its kernels ran on one thread whatever
``--threads`` said), where torch's kernels read 14-20 per core. Prefill-sized batches
(single thread, wall clock, same load): at 2048 -> 8192 native int4 g128 / int8 took 2.8 / 23
ms at 32 rows, 44 / 44 ms at 128 and 228 / 237 ms at 512, against bf16 F.linear's 22, 63 and
332 ms and torch's packed kernels' 47-1191 ms: the native kernel is the fastest at every batch
measured, so it runs at every batch (no crossover).

A whole decode step's linears (``--decode-step smollm2-135m``: 30 layers of q, k, v, o, gate,
up, down, 210 calls of batch 1 on weights far larger than the caches) against the copy of the
same bytes and the same number of native calls on a 16 x 32 weight (the fixed cost of a call:
dispatch from Python, activation quantization, output allocation, the thread pool), per kernel
(eager ``quant_linear`` calls, and the native op called directly as a compiled step calls it):

    python benchmarks/kernel_quant.py --decode-step smollm2-135m --threads 1 --clock cpu

Measured (load 11-14 on the 2 cores, so ``--threads 1 --clock cpu``; bf16 activations, int8 per
channel, 106.8 MB of packed weights; the native op called directly): before 2026-11-26's
per-call cuts, in one process with the new build, the step took 4.78 ms (22 GB/s) of which the
210 calls' fixed cost was 0.77 ms (3.7 us each); after, 4.13-4.30 ms (25-26 GB/s) with 0.47 ms
fixed (2.2 us each, 1.2 us above a trivial aten op called the same way); the 1-thread copy of
the same bytes took 5.3-6.1 ms. (A later run at load 13-14: 5.05 ms and 0.85 ms; eager
``quant_linear`` adds its Python, 6.7 us a call, which a compiled step does not run; torch's
packed int8 kernel 10.2 ms.) Fusing q/k/v and gate/up (120 calls, the same bytes) saved only
0.08 ms more: at batch 1 the native calls are bound by the bytes, not their count.
"""

from __future__ import annotations

import argparse
import os

import torch
from timing import CLOCKS, median_us
import torch.nn.functional as F

import shardwise
from shardwise.bench.roofline import measure_bandwidth
from shardwise.kernel_registry import registry
from shardwise.kernels.cpu import native
from shardwise.kernels.reference import quant as ref

#: [in -> out] of a 1.7B Llama (hidden 2048, MLP 8192): q/o, gate/up, down
SHAPES = ((2048, 2048), (2048, 8192), (8192, 2048))
#: (label, bits, group_size, symmetric) of the quantized variants (g32: llama.cpp's Q8_0/Q4_0
#: block).
QUANT = (("int8 per-channel", 8, -1, True), ("int8 g32", 8, 32, True),
         ("int8 g128 asym", 8, 128, False), ("int4 g128", 4, 128, True),
         ("int4 g32", 4, 32, True), ("int4 g128 asym", 4, 128, False))
#: The CPU quant_linear kernels compared (SHARDWISE_CPU_QUANT_KERNEL at prepack time).
KERNELS = ("native", "torch")


def packed_variant(acc, dtype, qw, kernel: str):
    """(backend label, packed weight, impl) of ``qw`` packed for ``kernel`` (native / torch)."""
    os.environ[native.ENV] = kernel
    try:
        impl = registry.resolve("quant_linear", acc, dtype, **qw.spec.as_shape())
        packed = impl.fn.prepack(qw, acc.device(), dtype)  # once, outside the timed calls
    finally:
        os.environ.pop(native.ENV)
    kind = packed.meta.get("kind", "")
    return f"{impl.backend}/{'native' if kind == 'native' else 'torch'}", packed, impl


def variants(acc, dtype, batch, in_f, out_f, reference: bool, kernels, quant):
    """(label, backend, weight bytes, fn) for every variant of one shape."""
    dev = acc.device()
    w = torch.randn(out_f, in_f, device=dev) * 0.02
    x32 = torch.randn(batch, in_f, device=dev)
    x, wd = x32.to(dtype), w.to(dtype)
    rows = [("fp32 F.linear", "torch", w.numel() * 4, lambda: F.linear(x32, w)),
            (f"{str(dtype)[6:]} F.linear", "torch", wd.numel() * wd.element_size(),
             lambda: F.linear(x, wd))]
    if reference:
        qw4 = ref.quantize_weight(w.cpu(), 4, 128).to(dev)
        rpacked = ref.prepack(qw4)
        rows.append(("int4 g128 reference", "reference", rpacked.nbytes,
                     lambda: ref.quant_linear(x, rpacked)))
    for label, bits, group, sym in QUANT:
        if label not in quant:
            continue
        qw = ref.quantize_weight(w.cpu(), bits, group, sym)
        for kernel in kernels:
            backend, packed, impl = packed_variant(acc, dtype, qw, kernel)
            rows.append((label, backend, packed.nbytes,
                         lambda impl=impl, packed=packed: impl(x, packed)))
    return rows


def fp32_model_rows(acc, batch: int, in_f: int, out_f: int):
    """An fp32 model's quantized linear (``quantize_model(..., torch.float32)``): the
    QuantLinear runs the fastest kernel in the first dtype that has one (fp32 itself where the
    native kernel runs; else bf16, casting the fp32 input to it and the output back — the
    casts are then part of what is timed); the backend column names the dtype."""
    from torch import nn

    from shardwise.quant import quantize_model

    w = torch.randn(out_f, in_f) * 0.02
    x32 = torch.randn(batch, in_f, device=acc.device())
    rows = []
    for label, bits in (("int8/ch, fp32 model", 8), ("int4 g128, fp32 model", 4)):
        holder = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False))
        holder[0].weight.data.copy_(w)
        quantize_model(holder, {"weight": {"num_bits": bits}}, acc, torch.float32, names=["0"])
        q = holder[0]
        rows.append((label, f"{q.backend}/{str(q.compute_dtype)[6:]}", q.weight_nbytes,
                     lambda q=q: q(x32)))
    return rows


#: Decoder shapes for ``--decode-step``: hidden, MLP, kv width (kv heads x head dim), layers.
DECODE_MODELS = {"smollm2-135m": (576, 1536, 192, 30), "llama-1.7b": (2048, 8192, 2048, 24)}


def decode_step_linears(hidden: int, inter: int, kv: int) -> list[tuple[str, int, int]]:
    """(name, in, out) of one Llama layer's linears, in call order."""
    return [("q", hidden, hidden), ("k", hidden, kv), ("v", hidden, kv), ("o", hidden, hidden),
            ("gate", hidden, inter), ("up", hidden, inter), ("down", inter, hidden)]


def decode_step_rows(acc, dtype, model: str, quant: str, kernels):
    """(label, weight bytes, fn) for one decode step's linears (batch 1) of ``model`` per
    kernel, the same number of calls on a tiny weight, and the copy of the same bytes."""
    hidden, inter, kv, layers = DECODE_MODELS[model]
    _, bits, group, sym = next(q for q in QUANT if q[0] == quant)
    shapes = decode_step_linears(hidden, inter, kv)
    dev = acc.device()
    xs = {k: torch.randn(1, k, device=dev).to(dtype) for k in (hidden, inter)}
    tiny_x = torch.randn(1, 32, device=dev).to(dtype)
    rows = []
    for kernel in kernels:
        calls, nbytes = [], 0
        for _ in range(layers):
            for _name, in_f, out_f in shapes:
                qw = ref.quantize_weight(torch.randn(out_f, in_f) * 0.02, bits, group, sym)
                _, packed, impl = packed_variant(acc, dtype, qw, kernel)
                calls.append((impl, packed, xs[in_f]))
                nbytes += packed.nbytes
        rows.append((f"{quant} step, {kernel}", nbytes,
                     lambda calls=calls: [impl(x, packed) for impl, packed, x in calls]))
        tiny_qw = ref.quantize_weight(torch.randn(16, 32) * 0.02, bits, -1, True)
        _, tiny, impl = packed_variant(acc, dtype, tiny_qw, kernel)
        rows.append((f"{len(calls)} tiny calls, {kernel}", 0,
                     lambda impl=impl, tiny=tiny, n=len(calls): [impl(tiny_x, tiny)
                                                                for _ in range(n)]))
        if tiny.meta.get("kind") == "native":  # as a compiled step calls it: the op itself
            rows.append((f"{len(calls)} tiny calls, native op", 0,
                         lambda tiny=tiny, n=len(calls): [native_op(tiny_x, tiny)
                                                         for _ in range(n)]))
            rows.insert(-2, (f"{quant} step, native op", nbytes,
                             lambda calls=calls: [native_op(x, p) for _, p, x in calls]))
    nbytes = rows[0][1]
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    rows.append(("copy of the step's bytes", nbytes, lambda: dst.copy_(src)))
    return rows


def native_op(x: torch.Tensor, packed) -> torch.Tensor:
    """The native op on a natively packed weight, without quant_linear's Python checks."""
    t, spec = packed.tensors, packed.spec
    return native.cpu_qlinear(x, t["qweight"], t["scales"], t.get("zeros"), None, spec.bits,
                              spec.group_size, packed.meta["ablock"], spec.out_features)


def run_decode_step(acc, dtype, args, bandwidth: float) -> None:
    """``--decode-step``: the table of :func:`decode_step_rows` (GB/s: weight bytes read;
    the copy's row counts the bytes once, though it reads and writes them)."""
    rows = decode_step_rows(acc, dtype, args.decode_step, args.decode_quant, args.kernels)
    times = median_us([lambda f=f: (f(), acc.synchronize()) for *_, f in rows], args.repeats,
                      warmup=2, clock=CLOCKS[args.clock])
    print(f"\n{args.decode_step} decode step, batch 1, {str(dtype)[6:]} activations")
    print(f"  {'variant':34s} {'ms':>8s} {'weight MB':>9s} {'GB/s':>7s} {'% bw':>5s}")
    for (label, nbytes, _), us in zip(rows, times):
        gbps = nbytes / us / 1e3
        print(f"  {label:34s} {us / 1e3:8.3f} {nbytes / 1e6:9.1f} {gbps:7.1f} "
              f"{100 * gbps / bandwidth:4.0f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--shapes", nargs="+", default=[f"{i}x{o}" for i, o in SHAPES],
                    help="IN x OUT, e.g. 2048x8192")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--quant", nargs="+", default=[q[0] for q in QUANT],
                    choices=[q[0] for q in QUANT])
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="cpu: the process's CPU time (leaves out waiting for a core on a "
                         "shared machine; with --threads 1 only, as it sums the threads)")
    ap.add_argument("--reference", action="store_true",
                    help="also time the reference (dequantize + F.linear per call; slow)")
    ap.add_argument("--fp32-model", action="store_true",
                    help="also time an fp32 model's QuantLinear (casts to the kernel's dtype)")
    ap.add_argument("--decode-step", choices=sorted(DECODE_MODELS), default=None,
                    help="time a whole decode step's linears of this model shape instead "
                         "(module docstring)")
    ap.add_argument("--decode-quant", default="int8 per-channel",
                    choices=[q[0] for q in QUANT], help="the variant --decode-step runs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    acc = shardwise.get_accelerator(args.device)
    dtype = getattr(torch, args.dtype)
    bandwidth = measure_bandwidth(acc).gbps
    print(f"{acc.name} ({acc.device_name()}), threads={torch.get_num_threads()}, "
          f"copy bandwidth {bandwidth:.1f} GB/s, median of {args.repeats} interleaved calls")
    if args.decode_step:
        run_decode_step(acc, dtype, args, bandwidth)
        return
    for shape in args.shapes:
        in_f, out_f = map(int, shape.split("x"))
        for batch in args.batch:
            rows = variants(acc, dtype, batch, in_f, out_f, args.reference, args.kernels,
                            args.quant)
            if args.fp32_model:
                rows += fp32_model_rows(acc, batch, in_f, out_f)
            times = median_us([lambda f=f: (f(), acc.synchronize()) for *_, f in rows],
                              args.repeats, clock=CLOCKS[args.clock])
            print(f"\n[{batch}, {in_f}] x [{in_f} -> {out_f}]")
            print(f"  {'variant':22s} {'backend':13s} {'µs':>9s} {'vs fp32':>8s} "
                  f"{'weight MB':>9s} {'GB/s':>7s} {'% bw':>5s}")
            for (label, backend, nbytes, _), us in zip(rows, times):
                gbps = nbytes / us / 1e3
                print(f"  {label:22s} {backend:13s} {us:9.0f} {times[0] / us:7.2f}x "
                      f"{nbytes / 1e6:9.1f} {gbps:7.1f} {100 * gbps / bandwidth:4.0f}%")


if __name__ == "__main__":
    main()

"""Weight-only quantized linear on this machine: dense F.linear vs the resolved ``quant_linear``.

    python benchmarks/kernel_quant.py --device cpu --batch 1 4

For each shape ``[batch, in] x [in -> out]`` it times, interleaved (so machine noise hits all
alike), dense fp32 and ``--dtype`` F.linear, the reference quant_linear (dequantize + linear per
call) and int8/int4 weights through the backend the registry resolves, then prints the median µs
per call, the speed-up over fp32, and the weight bytes read per call as GB/s against the
device's measured copy bandwidth (the decode roofline).

Measured on 2 cores of an AMD EPYC (AVX512-BF16), torch 2.13, ``--threads 2``, bf16, with other
jobs sharing the machine (load average ~2): µs per call (speed-up over fp32 F.linear; % of the
19.6 GB/s copy bandwidth spent reading the weight bytes).

    shape         batch  fp32   bf16          int8/channel  int8 g128     int4 g128
    2048 -> 5632  1      2816   1588 (1.8x)    865 (3.3x)   1156 (2.4x)   396 (7.1x, 79%)
    2048 -> 5632  4      7697   1556 (4.9x)   1044 (7.4x)   1757 (4.4x)   652 (11.8x)
    1536 -> 8960  1      4145   2222 (1.9x)   1012 (4.1x)   1247 (3.3x)   449 (9.2x, 83%)
    1536 -> 8960  4      9652   1913 (5.1x)   1396 (6.9x)   2164 (4.5x)   800 (12.1x)

The reference (dequantize + F.linear per call) took 50-59 ms: 0.06-0.16x.

An fp32 model's quantized linear (rows "..., fp32 model": the QuantLinear casts the fp32 input to
bf16 for the packed kernel and the output back) costs what the bf16 kernel costs: measured with
``--threads 1 --batch 1 --repeats 30`` under load (load average ~7 on the 2 cores), µs per call
(speed-up over fp32 F.linear):

    shape         fp32   int8/channel  int8/ch, fp32 model  int4 g128    int4 g128, fp32 model
    2048 -> 5632  6100    847 (7.2x)    776 (7.9x)           354 (17x)    360 (17x)
    1536 -> 8960  3054   1075 (2.8x)   1053 (2.9x)           424 (7.2x)   467 (6.5x)

(the fp32 F.linear of the first shape was slowed by the load more than the rest). Under such
load, 2-thread runs of the packed int8/int4 kernels degrade far more than fp32 F.linear does
(a thread descheduled stalls each call's parallel region): compare kernels at ``--threads 1``
on a busy machine.
"""

from __future__ import annotations

import argparse

import torch
from timing import median_us
import torch.nn.functional as F

import shardwise
from shardwise.bench.roofline import measure_bandwidth
from shardwise.kernel_registry import registry
from shardwise.kernels.reference import quant as ref

SHAPES = ((2048, 5632), (1536, 8960))
#: (label, bits, group_size, symmetric) of the quantized variants.
QUANT = (("int8 per-channel", 8, -1, True), ("int8 g128", 8, 128, True),
         ("int8 g128 asym", 8, 128, False), ("int4 g128", 4, 128, True),
         ("int4 g128 asym", 4, 128, False))




def variants(acc, dtype, batch, in_f, out_f):
    """(label, backend, weight bytes, fn) for every variant of one shape."""
    dev = acc.device()
    w = torch.randn(out_f, in_f, device=dev) * 0.02
    x32 = torch.randn(batch, in_f, device=dev)
    x, wd = x32.to(dtype), w.to(dtype)
    rows = [("fp32 F.linear", "torch", w.numel() * 4, lambda: F.linear(x32, w)),
            (f"{str(dtype)[6:]} F.linear", "torch", wd.numel() * wd.element_size(),
             lambda: F.linear(x, wd))]
    qw4 = ref.quantize_weight(w.cpu(), 4, 128).to(dev)
    rpacked = ref.prepack(qw4)
    rows.append(("int4 g128 reference", "reference", rpacked.nbytes,
                 lambda: ref.quant_linear(x, rpacked)))
    for label, bits, group, sym in QUANT:
        qw = ref.quantize_weight(w.cpu(), bits, group, sym)
        impl = registry.resolve("quant_linear", acc, dtype, **qw.spec.as_shape())
        packed = impl.fn.prepack(qw, dev, dtype)  # once, outside the timed calls
        rows.append((label, impl.backend, packed.nbytes,
                     lambda impl=impl, packed=packed: impl(x, packed)))
    rows += fp32_model_rows(acc, w, x32)
    return rows


def fp32_model_rows(acc, w: torch.Tensor, x32: torch.Tensor):
    """An fp32 model's quantized linear (``quantize_model(..., torch.float32)``): the
    QuantLinear runs the fastest kernel in the dtype that has one (bf16 on CPU), casting the
    fp32 input to it and the output back — the casts are part of what is timed."""
    from torch import nn

    from shardwise.quant import quantize_model

    rows = []
    for label, bits in (("int8/ch, fp32 model", 8), ("int4 g128, fp32 model", 4)):
        holder = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False))
        holder[0].weight.data.copy_(w)
        quantize_model(holder, {"weight": {"num_bits": bits}}, acc, torch.float32, names=["0"])
        q = holder[0]
        rows.append((label, f"{q.backend}/{str(q.compute_dtype)[6:]}", q.weight_nbytes,
                     lambda q=q: q(x32)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    acc = shardwise.get_accelerator(args.device)
    dtype = getattr(torch, args.dtype)
    bandwidth = measure_bandwidth(acc).gbps
    print(f"{acc.name} ({acc.device_name()}), threads={torch.get_num_threads()}, "
          f"copy bandwidth {bandwidth:.1f} GB/s, median of {args.repeats} interleaved calls")
    for in_f, out_f in SHAPES:
        for batch in args.batch:
            rows = variants(acc, dtype, batch, in_f, out_f)
            times = median_us([lambda f=f: (f(), acc.synchronize()) for *_, f in rows],
                              args.repeats)
            print(f"\n[{batch}, {in_f}] x [{in_f} -> {out_f}]")
            print(f"  {'variant':22s} {'backend':13s} {'µs':>9s} {'vs fp32':>8s} "
                  f"{'weight MB':>9s} {'GB/s':>7s} {'% bw':>5s}")
            for (label, backend, nbytes, _), us in zip(rows, times):
                gbps = nbytes / us / 1e3
                print(f"  {label:22s} {backend:13s} {us:9.0f} {times[0] / us:7.2f}x "
                      f"{nbytes / 1e6:9.1f} {gbps:7.1f} {100 * gbps / bandwidth:4.0f}%")


if __name__ == "__main__":
    main()

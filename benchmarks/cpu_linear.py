"""What one decode-step linear (batch 1) reaches on this CPU, against its copy bandwidth.

    python benchmarks/cpu_linear.py --in 1024 --out 4096 --mats 64

A decode step at batch 1 multiplies one activation row by each weight matrix once, so each
linear is a matrix-vector product bound by reading the weight: GB/s = weight bytes / time.
``--mats`` distinct weight matrices are cycled through so the weights come from memory, not
from the last-level cache (``--mats 1`` shows the cache-resident rate). Variants per dtype:

* ``F.linear``: what eager PyTorch (and HF) runs (MKL sgemm/gemv in fp32, oneDNN in bf16);
* ``mkldnn prepacked``: ``torch.ops.mkldnn._linear_pointwise`` on a weight reordered once by
  ``torch.ops.mkldnn._reorder_linear_weight`` (the layout inductor's freezing pass prepacks);
* ``mkl prepacked`` (fp32): ``torch.ops.mkl._mkl_linear`` on a weight packed by
  ``torch.ops.mkl._mkl_reorder_linear_weight`` (what inductor's freezing uses for fp32);
* ``compiled (inductor|onednn|cpp)``: the loop over all matrices captured by the CPU graph
  strategy (``CpuCompileStrategy(linear=...)``: ``torch.compile`` with inductor freezing) with
  each weight packing: inductor's own (MKL's packed sgemm for fp32), oneDNN's, or inductor's
  C++ GEMM template (the default).

The copy bandwidth is measured the way ``shardwise bench`` does (read + write of a 512 MiB
copy), so the percentages are comparable to the bench's ``% BW`` column.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def copy_probe(nbytes: int = 512 << 20):
    """A callable copying a ``nbytes`` buffer (the bench's bandwidth probe), and its bytes."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return lambda: dst.copy_(src)


def interleaved_times(fns: dict, repeats: int) -> dict:
    """Seconds of each call of each function; the calls are interleaved within each repeat so
    that load from other processes hits every variant alike."""
    for fn in fns.values():
        fn()
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    return times


def variants(x: torch.Tensor, weights: list[torch.Tensor], compile_it: bool):
    out = {"F.linear": lambda: [F.linear(x, w) for w in weights]}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0]) for w in weights]
    out["mkldnn prepacked"] = lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none",
                                                                          [], "")
                                       for p in packed]
    if x.dtype == torch.float32 and torch.backends.mkl.is_available():
        try:
            mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, x.shape[0]) for w in weights]
            out["mkl prepacked"] = lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, x.shape[0])
                                            for p, w in zip(mkl, weights)]
            out["mkl prepacked"]()
        except Exception as exc:  # not built into this torch
            print(f"  (mkl prepacked unavailable: {type(exc).__name__}: {exc})")
            out.pop("mkl prepacked", None)
    if compile_it:
        from shardwise.accelerators.cpu_graphs import CpuCompileStrategy

        module = torch.nn.ModuleList(torch.nn.Linear(w.shape[1], w.shape[0], bias=False,
                                                     dtype=w.dtype) for w in weights)
        with torch.no_grad():
            for lin, w in zip(module, weights):
                lin.weight.copy_(w)  # a copy: the compiled variants read their own weights

        def stack(v):
            return tuple(lin(v) for lin in module)

        for label, linear in (("compiled (inductor)", "inductor"),
                              ("compiled (onednn)", "onednn"), ("compiled (cpp)", "cpp")):
            out[label] = CpuCompileStrategy(linear=linear).capture(stack, x)
            out[label] = (lambda graph: (lambda: graph(x)))(out[label])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--in", dest="in_f", type=int, default=1024)
    ap.add_argument("--out", dest="out_f", type=int, default=4096)
    ap.add_argument("--mats", type=int, default=64, help="distinct weights cycled (1: cached)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    copy_bytes = 512 << 20
    fns = {("copy", ""): copy_probe(copy_bytes)}
    nbytes, refs = {}, {}
    for name in args.dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        torch.manual_seed(0)
        weights = [torch.randn(args.out_f, args.in_f, dtype=dtype) for _ in range(args.mats)]
        x = torch.randn(1, args.in_f, dtype=dtype)
        refs[name] = F.linear(x, weights[0]).float()
        nbytes[name] = weights[0].numel() * weights[0].element_size()
        for label, fn in variants(x, weights, not args.no_compile).items():
            fns[(name, label)] = fn
    errors = {key: (fn()[0].float() - refs[key[0]]).abs().max().item()
              for key, fn in fns.items() if key[0] != "copy"}
    times = interleaved_times(fns, args.repeats)
    medians = {k: statistics.median(v) for k, v in times.items()}
    bw = 2 * copy_bytes / medians[("copy", "")] / 1e9
    best_bw = 2 * copy_bytes / min(times[("copy", "")]) / 1e9
    print(f"{torch.get_num_threads()} threads; copy bandwidth {bw:.1f} GB/s (read + write, "
          f"median of {args.repeats}, interleaved with the linears; best {best_bw:.1f})")
    print(f"[1, {args.in_f}] x [{args.in_f}, {args.out_f}], {args.mats} distinct weights")
    print(f"{'dtype':<6} {'variant':<22} {'us/linear':>10} {'GB/s':>7} {'% copy BW':>10} "
          f"{'best GB/s':>10}")
    for key, s in medians.items():
        if key[0] == "copy":
            continue
        per = s / args.mats
        gbps = nbytes[key[0]] / per / 1e9
        best = nbytes[key[0]] / (min(times[key]) / args.mats) / 1e9
        print(f"{key[0]:<6} {key[1]:<22} {per * 1e6:>10.1f} {gbps:>7.1f} {100 * gbps / bw:>9.1f}%"
              f" {best:>10.1f}   (max |diff| vs F.linear {errors[key]:.1e})")


if __name__ == "__main__":
    main()

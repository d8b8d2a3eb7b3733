"""The Triton kernels at model sizes on a CUDA GPU: each checked against its torch reference (the
test oracle) and timed against the torch equivalent.

    python benchmarks/kernel_cuda.py --output benchmarks/results/cuda-kernels-<gpu>.json

Cases (fp16 unless said otherwise):

* ``attention_decode`` (split-K flash decoding) at 4k/16k/32k cached tokens, batch 1/8/32/64,
  GQA (32 query heads over 8 kv heads of 128) and MQA (32 over 1), every row holding the full
  context, against ``F.scaled_dot_product_attention(..., enable_gqa=True)`` over the same cache;
  figures are µs per call and the GB/s of K and V bytes read.
* ``attention_prefill`` (flash attention) at 2k tokens, batch 1 and 4, causal, GQA, against SDPA
  (its flash backend); TFLOP/s count the causal half of the score matrix.
* ``attention_chunks`` (a served mixed step's prompt chunks packed in one 64-token bucket, each
  token a decode query over its slot's row) at 1k and 4k cached tokens, 8 cache rows, GQA
  32/8, against the same chunks through ``attention_prefill`` one call per chunk (the host op a
  backend without the kernel falls back to, eager only: it reads the spans on the host).
* ``quant_linear`` weight-only int8 (one scale per output channel) and int4 (groups of 128) at
  the layer shapes of Llama-2-7B and Llama-2-70B (qkv, o, gate+up, down), rows 1/8 (GEMV) and
  32/2048 (GEMM), against the fp16 cuBLAS ``F.linear`` of the same weight and, where this torch
  build has them for CUDA, ``torch._weight_int8pack_mm`` and ``torch._weight_int4pack_mm``
  (bf16 inputs: their only CUDA dtype); GB/s count the packed weight bytes.

Correctness is ‖kernel − reference‖ / ‖reference‖ (the reference in float32 math on the same
inputs); decode is checked at batch ≤ 8 (the reference loops over rows, and larger batches only
repeat the same program over more rows). Timing is ``triton.testing.do_bench`` (CUDA events,
median, the L2 cache flushed before every call). A measured device-to-device copy gives the
bandwidth the GB/s figures are judged against.

``--smoke`` runs tiny shapes on the CPU under ``TRITON_INTERPRET=1`` (wall-clock timing, no
meaning): it checks this script, not the kernels' speed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

# decode: (label, q_heads, kv_heads); head_dim 128 (Llama-2/3).
HEADS = (("gqa 32/8", 32, 8), ("mqa 32/1", 32, 1))
HEAD_DIM = 128
CONTEXTS = (4096, 16384, 32768)
BATCHES = (1, 8, 32, 64)
PREFILL = ((1, 2048), (4, 2048))
#: chunks: (context, ((slot, past, n), ...)) over 8 cache rows, packed into a 64-token bucket
CHUNKS = ((1024, ((3, 900, 40), (6, 0, 24))), (4096, ((3, 4000, 48), (6, 100, 16))))
CHUNK_BUCKET = 64
#: (model, layer, in_features, out_features) of Llama-2-7B and -70B (70B: GQA, 8 kv heads).
LAYERS = (("7b", "qkv", 4096, 12288), ("7b", "o", 4096, 4096),
          ("7b", "gate_up", 4096, 22016), ("7b", "down", 11008, 4096),
          ("70b", "qkv", 8192, 10240), ("70b", "o", 8192, 8192),
          ("70b", "gate_up", 8192, 57344), ("70b", "down", 28672, 8192))
ROWS = (1, 2, 8, 32, 256, 2048)
QUANT = (("int8/channel", 8, -1), ("int4 g128", 4, 128))
SMOKE = dict(heads=(("gqa 4/2", 4, 2),), head_dim=16, contexts=(64,), batches=(1, 2),
             prefill=((1, 32),), layers=(("tiny", "proj", 128, 64),), rows=(1, 32),
             chunks=((64, ((1, 20, 5), (0, 0, 3))),), chunk_bucket=16)


def timer(device: str, graphs: bool = False) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds per call: CUDA events with an L2 flush on a GPU (``graphs``: replays
    of the call captured in a CUDA graph, as the engine's decode step runs it, without the
    per-launch host cost that dominates calls of a few µs); the wall clock for the CPU smoke
    run."""
    if device == "cuda":
        import triton.testing
        if graphs:
            return lambda fn: float(triton.testing.do_bench_cudagraph(fn, rep=50,
                                                                      return_mode="median"))
        return lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=50,
                                                        return_mode="median"))

    def wall(fn):
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return sorted(samples)[1]
    return wall


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere gives NaN."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def copy_bandwidth(device: str, time_ms, mib: int) -> float:
    """GB/s of a device-to-device copy of ``mib`` MiB, counting bytes read plus written."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def attempt(fn: Callable[[], dict]) -> dict:
    """One case's figures, or the error it raised (a failing case must not hide the rest)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported per case, the run goes on
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}


def decode_case(att, ref, time_ms, device, heads, head_dim, ctx, batch, check) -> dict:
    _, n_q, n_kv = heads
    g = torch.Generator(device=device).manual_seed(ctx + batch)
    q = torch.randn(batch, n_q, 1, head_dim, device=device, generator=g).half()
    k = torch.randn(batch, n_kv, ctx, head_dim, device=device, generator=g).half()
    v = torch.randn(batch, n_kv, ctx, head_dim, device=device, generator=g).half()
    full = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    out = {}
    if check:  # ragged lengths for the check: rows end anywhere in the second half
        lengths = torch.randint(ctx // 2, ctx + 1, (batch,), device=device, generator=g)
        out["rel_err"] = rel_err(att.attention_decode(q, k, v, lengths),
                                 ref.attention_decode(q.float(), k.float(), v.float(), lengths))
    kv_bytes = 2 * k.numel() * k.element_size()
    out["triton_us"] = 1e3 * time_ms(lambda: att.attention_decode(q, k, v, full))
    out["sdpa_us"] = 1e3 * time_ms(
        lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    out["triton_gbps"] = kv_bytes / out["triton_us"] / 1e3
    out["sdpa_gbps"] = kv_bytes / out["sdpa_us"] / 1e3
    out["speedup_vs_sdpa"] = out["sdpa_us"] / out["triton_us"]
    return out


def prefill_case(att, ref, time_ms, device, head_dim, batch, length) -> dict:
    n_q, n_kv = 32, 8
    if device != "cuda":
        n_q, n_kv = 4, 2
    g = torch.Generator(device=device).manual_seed(length + batch)
    q = torch.randn(batch, n_q, length, head_dim, device=device, generator=g).half()
    k = torch.randn(batch, n_kv, length, head_dim, device=device, generator=g).half()
    v = torch.randn(batch, n_kv, length, head_dim, device=device, generator=g).half()
    out = {"rel_err": rel_err(att.attention_prefill(q[:1], k[:1], v[:1]),
                              ref.attention_prefill(q[:1].float(), k[:1].float(),
                                                    v[:1].float()))}
    flops = 4 * batch * n_q * length * length * head_dim / 2  # QK^T and PV, causal half
    out["triton_us"] = 1e3 * time_ms(lambda: att.attention_prefill(q, k, v))
    out["sdpa_us"] = 1e3 * time_ms(lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True))
    out["triton_tflops"] = flops / out["triton_us"] / 1e6
    out["sdpa_tflops"] = flops / out["sdpa_us"] / 1e6
    out["speedup_vs_sdpa"] = out["sdpa_us"] / out["triton_us"]
    return out


def chunks_case(att, ref, time_ms, device, heads, head_dim, ctx, spans, bucket) -> dict:
    _, n_q, n_kv = heads
    g = torch.Generator(device=device).manual_seed(ctx)
    q = torch.randn(1, n_q, bucket, head_dim, device=device, generator=g).half()
    k = torch.randn(8, n_kv, ctx, head_dim, device=device, generator=g).half()
    v = torch.randn(8, n_kv, ctx, head_dim, device=device, generator=g).half()
    table = torch.tensor([list(s) for s in spans] + [[0, 0, 0]] * (4 - len(spans)),
                         dtype=torch.int64, device=device)
    out = {"rel_err": rel_err(att.attention_chunks(q, k, v, table),
                              ref.attention_chunks(q.float(), k.float(), v.float(), table))}
    out["triton_us"] = 1e3 * time_ms(lambda: att.attention_chunks(q, k, v, table))
    eager = timer(device)  # the per-chunk path reads the spans on the host: never captured
    out["per_chunk_prefill_us"] = 1e3 * eager(
        lambda: ref.each_chunk(att.attention_prefill, q, k, v, table))
    out["speedup_vs_per_chunk"] = out["per_chunk_prefill_us"] / out["triton_us"]
    return out


def torch_int_mm(w: torch.Tensor, bits: int, group: int, rows: int, device: str):
    """torch's own weight-only kernel for this setting as a zero-argument call (bf16 inputs),
    or raise when this build has none for the device."""
    n, k = w.shape
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    if bits == 8:
        wq = (w / w.abs().amax(1, keepdim=True) * 127).round().to(torch.int8)
        scales = (w.abs().amax(1) / 127).to(torch.bfloat16)
        torch._weight_int8pack_mm(x, wq, scales)
        return lambda: torch._weight_int8pack_mm(x, wq, scales)
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=device)
    packed = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    wp = torch._convert_weight_to_int4pack(packed, 8)
    sz = torch.ones(k // group, n, 2, dtype=torch.bfloat16, device=device)
    torch._weight_int4pack_mm(x, wp, group, sz)
    return lambda: torch._weight_int4pack_mm(x, wp, group, sz)


def forced_paths(cls, device: str, never: int) -> dict:
    """The quant_linear of each path whatever the rows: GEMV, GEMM, dequantize + torch.mm."""
    kw = dict(device_types=frozenset({device}))
    return {"gemv": cls(gemv_max_rows=never, **kw),
            "gemm": cls(gemv_max_rows=0, dequant_min_rows={8: never, 4: never}, **kw),
            "dequant": cls(gemv_max_rows=0, dequant_min_rows={8: 0, 4: 0}, **kw)}


#: rows at which each forced path is timed besides the registered choice
PATH_ROWS = {"gemv": (1, 2), "gemm": (8, 32, 256, 2048), "dequant": (32, 256, 2048)}


def quant_case(kernel, qref, time_ms, device, in_f, out_f, rows, bits, group,
               paths=None) -> dict:
    g = torch.Generator(device=device).manual_seed(in_f + out_f + rows)
    w = torch.randn(out_f, in_f, device=device, generator=g) * 0.02
    x = torch.randn(rows, in_f, device=device, generator=g).half()
    qw = qref.quantize_weight(w, bits, group)
    packed = kernel.prepack(qw, device, torch.float16)
    rpacked = qref.prepack(qw, device, torch.float32)
    out = {"rel_err": rel_err(kernel(x, packed), qref.quant_linear(x.float(), rpacked))}
    wh = w.half()
    out["triton_us"] = 1e3 * time_ms(lambda: kernel(x, packed))
    out["cublas_fp16_us"] = 1e3 * time_ms(lambda: F.linear(x, wh))
    out["weight_bytes"] = packed.nbytes
    out["triton_gbps"] = packed.nbytes / out["triton_us"] / 1e3
    out["speedup_vs_fp16"] = out["cublas_fp16_us"] / out["triton_us"]
    out["triton_tflops"] = 2 * rows * in_f * out_f / out["triton_us"] / 1e6
    for name, forced in (paths or {}).items():
        if rows in PATH_ROWS[name]:
            out[f"{name}_err"] = rel_err(forced(x, packed), qref.quant_linear(x.float(), rpacked))
            out[f"{name}_us"] = 1e3 * time_ms(lambda: forced(x, packed))
    if device == "cuda":
        try:
            out["torch_int_us"] = 1e3 * time_ms(torch_int_mm(w, bits, group, rows, device))
            out["speedup_vs_torch_int"] = out["torch_int_us"] / out["triton_us"]
        except Exception as exc:  # noqa: BLE001 - a missing torch kernel is a fact to report
            out["torch_int_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


def run(args) -> dict:
    device = "cpu" if args.smoke else "cuda"
    shapes = SMOKE if args.smoke else dict(heads=HEADS, head_dim=HEAD_DIM, contexts=CONTEXTS,
                                           batches=BATCHES, prefill=PREFILL, layers=LAYERS,
                                           rows=ROWS, chunks=CHUNKS, chunk_bucket=CHUNK_BUCKET)
    from shardwise.kernels.reference import attention as ref_att
    from shardwise.kernels.reference import quant as qref
    from shardwise.kernels.triton import attention as att
    from shardwise.kernels.triton.quant import NEVER, TritonQuantLinear
    kernel = TritonQuantLinear(device_types=frozenset({device}))
    paths = forced_paths(TritonQuantLinear, device, NEVER) if args.paths else None
    time_ms = timer(device, args.graphs)
    doc = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
           "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton": __import__("triton").__version__, "command": " ".join(sys.argv),
           "timing": "cuda graph replays" if args.graphs else "eager calls",
           "copy_gbps": copy_bandwidth(device, timer(device), 8 if args.smoke else 2048),
           "decode": [], "prefill": [], "chunks": [], "quant": []}
    print(f"{doc['device']}: device-to-device copy {doc['copy_gbps']:.0f} GB/s", flush=True)
    for heads in shapes["heads"] if "decode" in args.parts else ():
        for ctx in shapes["contexts"]:
            for batch in shapes["batches"]:
                check = batch <= 8 or ctx == shapes["contexts"][0]
                row = {"heads": heads[0], "context": ctx, "batch": batch}
                row.update(attempt(lambda: decode_case(att, ref_att, time_ms, device, heads,
                                                       shapes["head_dim"], ctx, batch, check)))
                doc["decode"].append(row)
                print("decode", row, flush=True)
                torch.cuda.empty_cache() if device == "cuda" else None
    for batch, length in shapes["prefill"] if "prefill" in args.parts else ():
        row = {"batch": batch, "tokens": length}
        row.update(attempt(lambda: prefill_case(att, ref_att, time_ms, device,
                                                shapes["head_dim"], batch, length)))
        doc["prefill"].append(row)
        print("prefill", row, flush=True)
    for ctx, spans in shapes["chunks"] if "chunks" in args.parts else ():
        row = {"heads": shapes["heads"][0][0], "context": ctx, "spans": [list(s) for s in spans]}
        row.update(attempt(lambda: chunks_case(att, ref_att, time_ms, device, shapes["heads"][0],
                                               shapes["head_dim"], ctx, spans,
                                               shapes["chunk_bucket"])))
        doc["chunks"].append(row)
        print("chunks", row, flush=True)
    layers = [s for s in shapes["layers"] if (args.models is None or s[0] in args.models)
              and (args.layers is None or s[1] in args.layers)]
    for model, layer, in_f, out_f in layers if "quant" in args.parts else ():
        for label, bits, group in QUANT:
            for rows in shapes["rows"]:
                row = {"model": model, "layer": layer, "in": in_f, "out": out_f, "quant": label,
                       "rows": rows}
                row.update(attempt(lambda: quant_case(kernel, qref, time_ms, device, in_f,
                                                      out_f, rows, bits, group, paths)))
                doc["quant"].append(row)
                print("quant", row, flush=True)
    return doc


def fmt(value, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else \
        format(value, spec)


def summary(doc: dict) -> str:
    """The table printed last: one line a case."""
    lines = [f"{doc['device']}, torch {doc['torch']}, triton {doc['triton']}; copy "
             f"{doc['copy_gbps']:.0f} GB/s; timed as {doc['timing']}",
             "decode  heads     ctx    batch  err      triton_us  sdpa_us  x_sdpa  GB/s  %copy"]
    for r in doc["decode"]:
        lines.append(f"decode  {r['heads']:9s} {r['context']:6d} {r['batch']:5d}  "
                     f"{fmt(r.get('rel_err'), '.1e'):8s} {fmt(r.get('triton_us'), '9.1f')} "
                     f"{fmt(r.get('sdpa_us'), '8.1f')} {fmt(r.get('speedup_vs_sdpa'), '6.2f')} "
                     f"{fmt(r.get('triton_gbps'), '5.0f')} "
                     f"{fmt(100 * r['triton_gbps'] / doc['copy_gbps'] if 'triton_gbps' in r else None, '5.1f')}"
                     f"  {r.get('error', '')}")
    for r in doc["prefill"]:
        lines.append(f"prefill batch {r['batch']} tokens {r['tokens']}: err "
                     f"{fmt(r.get('rel_err'), '.1e')} triton {fmt(r.get('triton_tflops'), '.0f')}"
                     f" TFLOP/s, sdpa {fmt(r.get('sdpa_tflops'), '.0f')}, x_sdpa "
                     f"{fmt(r.get('speedup_vs_sdpa'), '.2f')} {r.get('error', '')}")
    for r in doc["chunks"]:
        lines.append(f"chunks {r['heads']} ctx {r['context']} spans {r['spans']}: err "
                     f"{fmt(r.get('rel_err'), '.1e')} triton {fmt(r.get('triton_us'), '.1f')} us,"
                     f" per-chunk prefill {fmt(r.get('per_chunk_prefill_us'), '.1f')} us, x "
                     f"{fmt(r.get('speedup_vs_per_chunk'), '.2f')} {r.get('error', '')}")
    lines.append("quant   model layer    quant         rows  err      triton_us  fp16_us  "
                 "x_fp16  torch_int_us  GB/s  %copy")
    for r in doc["quant"]:
        pct = 100 * r["triton_gbps"] / doc["copy_gbps"] if "triton_gbps" in r else None
        lines.append(f"quant   {r['model']:5s} {r['layer']:8s} {r['quant']:13s} {r['rows']:5d} "
                     f"{fmt(r.get('rel_err'), '.1e'):8s} {fmt(r.get('triton_us'), '9.1f')} "
                     f"{fmt(r.get('cublas_fp16_us'), '8.1f')} "
                     f"{fmt(r.get('speedup_vs_fp16'), '6.2f')} "
                     f"{fmt(r.get('torch_int_us'), '12.1f')} {fmt(r.get('triton_gbps'), '5.0f')} "
                     f"{fmt(pct, '5.1f')}  "
                     + " ".join(f"{p}={r[p + '_us']:.1f}" for p in PATH_ROWS if p + "_us" in r)
                     + f" {r.get('error', '')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", help="JSON file for every figure")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script)")
    parser.add_argument("--graphs", action="store_true",
                        help="time replays of each call captured in a CUDA graph")
    parser.add_argument("--parts", nargs="+", default=["decode", "prefill", "chunks", "quant"],
                        choices=["decode", "prefill", "chunks", "quant"],
                        help="which cases to run")
    parser.add_argument("--paths", action="store_true",
                        help="also time each quant_linear path forced (GEMV at 1-2 rows, GEMM, "
                             "dequantize + torch.mm), whatever the registered instance picks")
    parser.add_argument("--models", nargs="+", help="quant layer shapes of these models only "
                        "(7b, 70b; default all)")
    parser.add_argument("--layers", nargs="+", help="quant layers of these names only (qkv, o, "
                        "gate_up, down; default all)")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        parser.error("no CUDA GPU is visible: run on a GPU machine (or --smoke on the CPU)")
    doc = run(args)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(doc, f, indent=1)
    print(summary(doc))
    failed = [r for part in ("decode", "prefill", "chunks", "quant") for r in doc[part]
              if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

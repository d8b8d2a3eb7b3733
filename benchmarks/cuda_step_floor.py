"""Where a decode token's time goes on a GPU: the captured step's graph replayed back to back
(the GPU's own time, no host work between replays) against ``engine.generate``'s per-token
time, with and without a host read of every token, and HF's loop around the same engine.

    python benchmarks/cuda_step_floor.py --preset llama-22l-2048h-gqa --dtype fp16 --batch 1 8 32

Figures per batch (ms per decode step; weight GB/s over the model's parameter bytes):

* ``replay_ms``: ``graph.replay()`` of the batch bucket's captured step, 200 times back to back,
  timed with CUDA events: the floor the kernels set.
* ``loop_ms``: shardwise's decode loop, timed over a whole ``generate`` without a streamer (one
  sync at the end), minus a one-token ``generate``'s time (the prefill): the host work runs
  ahead of the GPU.
* ``loop_synced_ms``: the same loop with a streamer that reads every token on the host, as
  ``shardwise bench`` times it (per-token latency; median).
* ``hf_loop_synced_ms``: HF's ``generate`` around the same engine (``shardwise_fast_loop=False``),
  timed the same way.

The bench's bandwidth probe (a device-to-device copy) is measured here too, so the GB/s figures
are judged against the same machine's number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def copy_gbps() -> float:
    """GB/s of a 2 GiB device-to-device copy, bytes read plus written (median of 20)."""
    src = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times) / 1e9


def replay_ms(graph, n: int = 200) -> float:
    """Milliseconds per replay of a captured ``torch.cuda.CUDAGraph``, back to back."""
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def wall_generate(engine, ids, new_tokens: int, **kwargs) -> float:
    """Seconds of one ``generate`` of ``new_tokens`` tokens, synchronized at the end only."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                    **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def synced_ms(engine, ids, new_tokens: int, **kwargs) -> float:
    """Median ms per decode token with every token read on the host (the bench's timing)."""
    from shardwise.generation import timed_generate

    _, timings = timed_generate(engine, {"input_ids": ids}, torch.cuda.synchronize,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, **kwargs)
    return timings.median_s * 1e3


def measure(engine, batch: int, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    ids = torch.randint(3, vocab, (batch, prompt_len), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(batch))
    wall_generate(engine, ids, 8)  # captures this bucket's graph
    stack = engine.module.base_model
    bucket = min(key for key in stack.graphs.buckets() if key >= batch)
    row = {"batch": batch, "bucket": bucket,
           "replay_ms": replay_ms(stack.graphs.graphs[bucket].graph)}
    prefill = min(wall_generate(engine, ids, 1) for _ in range(3))
    loops = [(wall_generate(engine, ids, new_tokens) - prefill) / (new_tokens - 1)
             for _ in range(3)]
    row["loop_ms"] = 1e3 * statistics.median(loops)
    row["loop_synced_ms"] = statistics.median(synced_ms(engine, ids, new_tokens)
                                              for _ in range(3))
    row["hf_loop_synced_ms"] = statistics.median(
        synced_ms(engine, ids, new_tokens, shardwise_fast_loop=False) for _ in range(3))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-22l-2048h-gqa")
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--quant", choices=["int8", "int4"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--output", help="JSON file for the figures")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    import shardwise
    from shardwise.bench.presets import build_preset
    from shardwise.bench.plan import engine_options
    from shardwise.config import parse_dtype

    dtype = parse_dtype(args.dtype)
    model = build_preset(args.preset, dtype=dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.config.vocab_size
    engine = shardwise.init_inference(model, device="cuda", dtype=dtype,
                                      max_tokens=args.prompt_len + args.new_tokens + 8,
                                      **engine_options(True, True, args.quant))
    if args.quant:
        weight_bytes = engine.quantization.bytes_after
    probe = copy_gbps()
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join(sys.argv), "preset": args.preset, "dtype": args.dtype,
           "quant": args.quant, "weight_bytes": weight_bytes, "copy_gbps": probe, "rows": []}
    for batch in args.batch:
        row = measure(engine, batch, args.prompt_len, args.new_tokens, vocab)
        for key in ("replay_ms", "loop_ms", "loop_synced_ms", "hf_loop_synced_ms"):
            row[key.replace("_ms", "_pct_bw")] = 100 * weight_bytes / (row[key] * 1e-3) / 1e9 \
                / probe
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"{doc['device']}: copy {probe:.0f} GB/s, weights {weight_bytes / 1e9:.2f} GB")
    for r in doc["rows"]:
        print(f"batch {r['batch']:3d}: replay {r['replay_ms']:.3f} ms ({r['replay_pct_bw']:.0f}%)"
              f" | loop {r['loop_ms']:.3f} ({r['loop_pct_bw']:.0f}%) | loop, each token read "
              f"{r['loop_synced_ms']:.3f} ({r['loop_synced_pct_bw']:.0f}%) | HF's loop, each "
              f"token read {r['hf_loop_synced_ms']:.3f} ({r['hf_loop_synced_pct_bw']:.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

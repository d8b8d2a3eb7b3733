"""A model loaded from disk with offload: peak RSS growth against the model's bytes, and the
streaming rate, in a fresh process.

    python benchmarks/offload_rss.py --preset gpt2-24l-1024h --nvme-path /work/offload-bench \
        --output benchmarks/results/cpu-offload-rss-gpt2-24l-1024h.json

The preset is saved once with ``save_pretrained`` (``--checkpoint DIR``, default under the
nvme path); then a fresh Python (started through a small launcher, so its ``ru_maxrss`` starts
from the launcher's size, not this process's) imports torch, transformers and shardwise, records
its RSS, warms up on a tiny model (the same calls: the code pages of the libraries a run
touches — torch's kernels, triton's shared library, ~130 MiB — are the process's, not the
model's), records its RSS again, runs ``init_inference(None, checkpoint=DIR, dtype=fp32,
offload={"device": "nvme", ...})`` (each unit read, written to its blob and dropped: the model is never resident) and
``generate`` of ``--new-tokens`` greedy tokens. Reported: peak RSS growth over the RSS before
``init_inference`` (``ru_maxrss``: load and generation together), as a fraction of the model's
bytes; the ring and resident bytes the engine reports; decode ms/token (the generate's time
after its first token over the remaining tokens); bytes streamed per step and GB/s from the
engine's counters, against an ``O_DIRECT`` read probe of the same directory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import json, os, resource, sys, time
    import torch, transformers
    import shardwise

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    ckpt, nvme, buffers, new, batch, tiny = sys.argv[1], sys.argv[2], int(sys.argv[3]), \\
        int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    torch.manual_seed(0)
    cold = rss()
    # warm-up on a tiny model: the code pages of the libraries the run touches (torch's
    # kernels; triton's, which torch._dynamo imports when transformers loads a model's module)
    # are the process's, not the model's
    warm = shardwise.init_inference(None, checkpoint=tiny, dtype=torch.float32, offload={
        "device": "nvme", "nvme_path": nvme, "buffer_count": buffers})
    warm.generate(torch.randint(0, 100, (batch, 32)), max_new_tokens=2, do_sample=False)
    warm.close()
    del warm
    before = rss()
    start = time.perf_counter()
    engine = shardwise.init_inference(None, checkpoint=ckpt, dtype=torch.float32, offload={
        "device": "nvme", "nvme_path": nvme, "buffer_count": buffers})
    init_s = time.perf_counter() - start
    peak_init = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ids = torch.randint(0, 1000, (batch, 32))
    engine.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm
    engine.offload.reset_stats()
    start = time.perf_counter()
    engine.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    first = time.perf_counter() - start
    engine.offload.reset_stats()
    start = time.perf_counter()
    engine.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    total = time.perf_counter() - start
    stats = engine.offload.stats()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"rss_before": before, "warm_up_growth": before - cold,
                      "peak_rss": peak, "growth": peak - before,
                      "growth_at_init": peak_init - before, "rss_after": rss() - before,
                      "init_s": init_s, "decode_ms": 1e3 * (total - first) / (new - 1),
                      "stats": stats, "ring_bytes": engine.offload.ring_bytes,
                      "resident_bytes": engine.offload.resident_bytes,
                      "streamed_bytes_per_pass": engine.offload.streamed_bytes_per_pass,
                      "direct_io": engine.offload.direct_io,
                      "summary": engine.offload.summary()}))
""")


def save_checkpoint(preset: str, path: Path) -> int:
    """Save the preset (fp32, seed 0) to ``path`` once; returns the checkpoint's weight bytes
    (its safetensors files: every tensor once, tied ones included once)."""
    import torch

    from shardwise.bench.presets import build_preset

    if not (path / "config.json").exists():
        build_preset(preset, torch.float32).save_pretrained(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def run_child(ckpt: Path, nvme: Path, buffers: int, new: int, batch: int) -> dict:
    """The measurement in a fresh process (module docstring); its last stdout line is JSON."""
    launcher = ("import subprocess, sys; "
                "sys.exit(subprocess.call([sys.executable, '-c', sys.argv[1], *sys.argv[2:]]))")
    tiny = nvme / "checkpoint-warm-up-gpt2-2l-64h"
    save_checkpoint("gpt2-2l-64h", tiny)
    out = subprocess.run([sys.executable, "-c", launcher, CHILD, str(ckpt), str(nvme),
                          str(buffers), str(new), str(batch), str(tiny)], capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-4000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-24l-1024h")
    parser.add_argument("--nvme-path", required=True, type=Path)
    parser.add_argument("--checkpoint", type=Path, help="where the preset is saved (default: "
                        "NVME_PATH/checkpoint-PRESET)")
    parser.add_argument("--buffer-count", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    ckpt = args.checkpoint or args.nvme_path / f"checkpoint-{args.preset}"
    model_bytes = save_checkpoint(args.preset, ckpt)
    from shardwise.offload.store import read_probe

    probe = read_probe(args.nvme_path)
    got = run_child(ckpt, args.nvme_path, args.buffer_count, args.new_tokens, args.batch)
    per_step = got["stats"]["bytes_read"] / max(1, got["stats"]["passes"])
    doc = {"command": " ".join(sys.argv), "preset": args.preset, "model_bytes": model_bytes,
           "probe": probe, **got, "growth_over_model": got["growth"] / model_bytes,
           "bytes_per_step": per_step,
           "stream_gbps": per_step / (got["decode_ms"] * 1e6)}
    doc["stream_over_probe"] = doc["stream_gbps"] / probe["gbps"]
    if args.output:
        args.output.write_text(json.dumps(doc, indent=1))
    mib = 2 ** 20
    print(f"{args.preset}: model {model_bytes / mib:.0f} MiB; peak RSS growth "
          f"{got['growth'] / mib:.0f} MiB = {doc['growth_over_model']:.2f}x the model after "
          f"a warm-up that grew it {got['warm_up_growth'] / mib:.0f} MiB ("
          f"{got['growth_at_init'] / mib:.0f} MiB by the end of init; after generating "
          f"{got['rss_after'] / mib:.0f} MiB above the start; ring "
          f"{got['ring_bytes'] / mib:.0f} MiB, resident {got['resident_bytes'] / mib:.1f} MiB); "
          f"init {got['init_s']:.1f} s; decode {got['decode_ms']:.0f} ms/token at batch "
          f"{args.batch}; {per_step / mib:.0f} MiB/step = {doc['stream_gbps']:.2f} GB/s, "
          f"{100 * doc['stream_over_probe']:.0f}% of the O_DIRECT probe "
          f"({probe['gbps']:.2f} GB/s); overlap {got['stats'].get('overlap', 0):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak host memory per rank when loading a multi-GB checkpoint with tensor parallelism.

Builds a preset model (default ``llama-22l-2048h-gqa``, ~1.1B parameters, ~4.4 GB in fp32), saves
it as sharded safetensors (``save_pretrained(max_shard_size=...)``) into a temp dir, then launches
two TP runs through ``shardwise launch`` (torch's elastic launcher):

* ``sharded``: ``init_inference(None, checkpoint=dir, tp_size=N)``: meta skeleton, each rank reads
  only its slices;
* ``baseline``: ``from_pretrained(dir)`` on every rank, then ``init_inference(model, tp_size=N)``.

Each rank reports its peak RSS (``VmHWM`` from /proc/self/status, minus what it had after the
imports) against the model's size, the bytes it read, and a digest of its logits (both runs must
agree)::

    python benchmarks/load_sharded.py [--preset NAME] [--tp 2] [--dtype float32] [--keep DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def vm_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def reset_hwm() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs), where allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


# ----- worker (one rank) --------------------------------------------------------------------------

def worker(mode: str, ckpt: Path, tp: int, out: Path) -> None:
    import torch
    import transformers

    import shardwise

    rank = int(os.environ.get("RANK", 0))
    reset_hwm()  # peak of the load itself (VmHWM); "+forward" is the peak after one forward
    base_kib = vm_kib("VmRSS")
    start = time.perf_counter()
    if mode == "sharded":
        engine = shardwise.init_inference(None, checkpoint=str(ckpt), device="cpu",
                                          tensor_parallel={"tp_size": tp})
        bytes_read = engine.checkpoint_load.bytes_read
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
        engine = shardwise.init_inference(model, device="cpu", tensor_parallel={"tp_size": tp})
        bytes_read = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    seconds = time.perf_counter() - start
    peak_kib = vm_kib("VmHWM")
    ids = torch.arange(8).unsqueeze(0) + 100
    logits = engine(input_ids=ids).logits
    local = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    result = dict(mode=mode, rank=rank, seconds=seconds, peak_rss_gb=peak_kib * 1024 / 1e9,
                  peak_after_forward_gb=vm_kib("VmHWM") * 1024 / 1e9,
                  peak_above_start_gb=(peak_kib - base_kib) * 1024 / 1e9,
                  start_rss_gb=base_kib * 1024 / 1e9, local_param_gb=local / 1e9,
                  bytes_read_gb=bytes_read / 1e9,
                  digest=hashlib.sha256(logits.float().numpy().tobytes()).hexdigest()[:16])
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps(result))


# ----- driver -------------------------------------------------------------------------------------

def build_checkpoint(preset: str, dtype: str, path: Path, shard_size: str) -> int:
    import torch
    import transformers

    from shardwise.bench.presets import get_preset

    config = get_preset(preset).hf_config()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(path, max_shard_size=shard_size)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def launch(mode: str, ckpt: Path, tp: int, out: Path) -> None:
    cmd = [sys.executable, "-m", "shardwise", "launch", "--nproc-per-node", str(tp),
           __file__, "--worker", mode, "--ckpt", str(ckpt), "--tp", str(tp), "--out", str(out)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-22l-2048h-gqa")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--shard-size", default="1GB")
    ap.add_argument("--keep", help="checkpoint folder to reuse/keep (default: a temp dir)")
    ap.add_argument("--worker", choices=["sharded", "baseline"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, Path(args.ckpt), args.tp, Path(args.out))
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="load_sharded_"))
    ckpt, out = root / "ckpt", root / "results"
    out.mkdir(parents=True, exist_ok=True)
    try:
        if not (ckpt / "config.json").is_file():
            t = time.perf_counter()
            size = build_checkpoint(args.preset, args.dtype, ckpt, args.shard_size)
            print(f"built and saved {args.preset} ({size / 1e9:.2f} GB) in "
                  f"{time.perf_counter() - t:.0f} s", flush=True)
        model_gb = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 1e9
        for mode in ("sharded", "baseline"):
            launch(mode, ckpt, args.tp, out)
        report(out, args, model_gb)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def report(out: Path, args, model_gb: float) -> None:
    rows = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))]
    print(f"\n{args.preset} {args.dtype}: checkpoint {model_gb:.2f} GB, TP={args.tp}")
    print(f"{'mode':9} {'rank':>4} {'peak RSS':>9} {'peak-start':>10} {'x model':>7} "
          f"{'own params':>10} {'read':>7} {'seconds':>7} {'+forward':>8}  logits digest")
    for r in rows:
        print(f"{r['mode']:9} {r['rank']:>4} {r['peak_rss_gb']:8.2f}G "
              f"{r['peak_above_start_gb']:9.2f}G"
              f" {r['peak_above_start_gb'] / model_gb:7.2f} {r['local_param_gb']:9.2f}G "
              f"{r['bytes_read_gb']:6.2f}G {r['seconds']:7.1f} {r['peak_after_forward_gb']:7.2f}G"
              f"  {r['digest']}")
    digests = {r["digest"] for r in rows}
    print("logits agree across modes and ranks" if len(digests) == 1 else
          f"LOGITS DIFFER: {digests}")


if __name__ == "__main__":
    main()

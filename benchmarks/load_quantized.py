"""Peak host memory of loading a checkpoint quantized: full precision then quantize, against
quantizing each weight as it is read.

Builds a llama-shaped model of a few hundred MB (fixed-seed random weights, saved with
``save_pretrained`` into a temp dir) and loads it in fresh processes, one per mode:

* ``fp``: ``init_inference(None, checkpoint=dir, dtype=bf16)``, no quantization (for scale);
* ``then-quantize``: the same, then ``quantize_model`` (the quantize step after a load);
* ``while-reading``: ``init_inference(None, checkpoint=dir, dtype=bf16, quant=...)``: the loader
  quantizes each weight as soon as its (this rank's) slice is read.

Each process reports its peak RSS (``VmHWM`` minus the RSS after the imports), the bytes the
model holds afterwards, and a digest of its logits (the two quantized modes must agree)::

    python benchmarks/load_quantized.py [--bits 8] [--group-size G] [--tp 1] [--keep DIR]
                                        [--malloc-mmap-threshold BYTES]

glibc's malloc raises its mmap threshold as large blocks are freed, so the float slices freed
after quantizing come from (and go back to) the heap, which fragments and keeps them resident:
``--malloc-mmap-threshold 1048576`` (``MALLOC_MMAP_THRESHOLD_`` for the workers) fixes the
threshold so freed slices leave the process, showing what the loader itself holds.

A measurement, not a test: nothing is asserted.
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

sys.path.insert(0, str(Path(__file__).parent))
from load_sharded import reset_hwm, vm_kib  # noqa: E402

#: ~190M parameters: ~380 MB in bf16
CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
              num_attention_heads=16, num_key_value_heads=8, vocab_size=16000,
              max_position_embeddings=512, tie_word_embeddings=False)
MODES = ("fp", "then-quantize", "while-reading")


# ----- worker (one process per mode and rank) -----------------------------------------------------

def worker(mode: str, ckpt: Path, quant: dict, tp: int, out: Path) -> None:
    import torch

    import shardwise
    from shardwise.quant import model_bytes, quantize_model

    rank = int(os.environ.get("RANK", 0))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    _warm_up_imports()  # so the baseline below holds the libraries, not only the weights
    reset_hwm()
    base_kib = vm_kib("VmRSS")
    kwargs = dict(device="cpu", dtype=torch.bfloat16,
                  **({"tensor_parallel": {"tp_size": tp}} if tp > 1 else {}))
    start = time.perf_counter()
    if mode == "while-reading":
        engine = shardwise.init_inference(None, checkpoint=str(ckpt), quant=quant, **kwargs)
    else:
        engine = shardwise.init_inference(None, checkpoint=str(ckpt), **kwargs)
        if mode == "then-quantize":
            quantize_model(engine.module, quant, engine.accelerator, engine.dtype,
                           plan=engine.plan)
    seconds = time.perf_counter() - start
    peak_kib, end_kib = vm_kib("VmHWM"), vm_kib("VmRSS")
    logits = engine(input_ids=torch.arange(8).unsqueeze(0) + 100).logits
    result = dict(mode=mode, rank=rank, seconds=seconds,
                  peak_above_start_mb=(peak_kib - base_kib) * 1024 / 1e6,
                  end_above_start_mb=(end_kib - base_kib) * 1024 / 1e6,
                  model_mb=model_bytes(engine.module) / 1e6,
                  digest=hashlib.sha256(logits.float().numpy().tobytes()).hexdigest()[:16])
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps(result))


def _warm_up_imports() -> None:
    """Import what loading imports on first use (transformers' llama, the quant kernels) and run
    one tiny bf16 matmul (oneDNN's buffers), before the baseline RSS is taken."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401

    import shardwise.kernels.cpu.quant  # noqa: F401
    from shardwise.kernel_registry import registry

    registry.load_backend("cpu")
    torch.ones(4, 4, dtype=torch.bfloat16) @ torch.ones(4, 4, dtype=torch.bfloat16)


# ----- driver -------------------------------------------------------------------------------------

def build_checkpoint(path: Path) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="200MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run(mode: str, args, ckpt: Path, out: Path) -> None:
    script = [__file__, "--worker", mode, "--ckpt", str(ckpt), "--out", str(out),
              "--bits", str(args.bits), "--tp", str(args.tp)]
    if args.group_size is not None:
        script += ["--group-size", str(args.group_size)]
    cmd = [sys.executable, *script] if args.tp == 1 else [
        sys.executable, "-m", "shardwise", "launch", "--nproc-per-node", str(args.tp), *script]
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ)
    if args.malloc_mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    subprocess.run(cmd, check=True, env=env)


def quant_dict(args) -> dict:
    weight = {"num_bits": args.bits}
    if args.group_size is not None:
        weight["group_size"] = args.group_size
    return {"weight": weight}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=8, choices=(4, 8))
    ap.add_argument("--group-size", type=int)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--keep", help="checkpoint folder to reuse/keep (default: a temp dir)")
    ap.add_argument("--malloc-mmap-threshold", type=int,
                    help="MALLOC_MMAP_THRESHOLD_ for the workers (default: glibc's dynamic one)")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, Path(args.ckpt), quant_dict(args), args.tp, Path(args.out))
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="load_quantized_"))
    ckpt, out = root / "ckpt", root / "results"
    out.mkdir(parents=True, exist_ok=True)
    try:
        if not (ckpt / "config.json").is_file():
            size = build_checkpoint(ckpt)
            print(f"built and saved the model ({size / 1e6:.0f} MB in bf16)", flush=True)
        for mode in MODES:
            run(mode, args, ckpt, out)
        report(out, args, sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 1e6)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def report(out: Path, args, ckpt_mb: float) -> None:
    rows = [json.loads((out / f"{m}-rank{r}.json").read_text())
            for m in MODES for r in range(args.tp)]
    threshold = args.malloc_mmap_threshold or "glibc default (dynamic)"
    print(f"\ncheckpoint {ckpt_mb:.0f} MB (bf16), quant {quant_dict(args)}, tp={args.tp}, "
          f"compute bf16, malloc mmap threshold {threshold}")
    print(f"{'mode':14} {'rank':>4} {'peak RSS':>9} {'end RSS':>8} {'model':>7} {'seconds':>7}"
          f"  logits digest   (RSS: above the process's RSS after imports, MB)")
    for r in rows:
        print(f"{r['mode']:14} {r['rank']:>4} {r['peak_above_start_mb']:9.0f} "
              f"{r['end_above_start_mb']:8.0f} {r['model_mb']:7.0f} {r['seconds']:7.1f}"
              f"  {r['digest']}")
    quantized = {r["digest"] for r in rows if r["mode"] != "fp"}
    print("quantized logits agree (then-quantize == while-reading)" if len(quantized) == 1
          else f"QUANTIZED LOGITS DIFFER: {quantized}")


if __name__ == "__main__":
    main()

"""Offload with graphs against offload without: per-token decode time, one process, interleaved.

Builds one fp32 Llama-shaped model (seed 0; the size set by the options: the default is about
290 MB), injects it and offloads it to ``--nvme-path`` (a temporary folder when not given; the
``"nvme"`` tier, direct I/O where the filesystem allows it) twice: once run eagerly, once with
the decode step captured per layer (:mod:`shardwise.offload.graphs`, the accelerator's graph
strategy: on CPU each layer's step compiled by inductor, its weights read as inputs from the
ring slot). Then, for each batch size, rounds alternate between the two engines; each round
generates ``--tokens`` tokens and keeps the median gap between consecutive decode steps (a
logits processor stamps each step), so the prompt is not in the figure. Prints the median over
rounds per variant, the ratio, the machine's load average, and the capture time.

Run::

    python benchmarks/offload_graphs.py [--nvme-path DIR] [--batch 1 8] [--tokens 16] \\
        [--rounds 5] [--layers 5] [--hidden 1024] [--quant int8] [--output F.json]
    # an accelerator, from pinned host memory (CUDA graphs per layer and ring slot):
    python benchmarks/offload_graphs.py --device cuda --tier cpu [...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from shardwise.bench.plan import QUANT_CONFIGS

#: ``--quant`` → the engine's ``quant=`` dict
QUANT = {"none": None, **QUANT_CONFIGS}


def build_model(args) -> torch.nn.Module:
    """A Llama-shaped fp32 model of the options' size, weights from seed 0 (both builds equal)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def build_engine(args, path: str, graphs: bool):
    """An injected, offloaded engine; with ``graphs`` its decode step captured per layer
    (``init_inference(..., enable_graph=True)``). Returns (engine, seconds its init took)."""
    import shardwise

    kwargs = {"quant": QUANT[args.quant]} if QUANT[args.quant] else {}
    if args.tier == "nvme":
        offload = {"device": "nvme", "nvme_path": path, "buffer_count": args.buffer_count}
    else:  # pinned host memory, copied into the accelerator's ring slots
        offload = {"device": "cpu", "pin_memory": True, "buffer_count": args.buffer_count}
    model = build_model(args)
    start = time.perf_counter()
    engine = shardwise.init_inference(
        model, device=args.device, dtype=torch.float32, replace_with_kernel_inject=True,
        enable_graph=graphs, offload=offload, **kwargs)
    return engine, time.perf_counter() - start


class Stamps:
    """A logits processor stamping each generation step (decode steps: every one after the
    first)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def step_time(engine, ids: torch.Tensor, tokens: int) -> tuple[float, torch.Tensor]:
    """(median seconds between consecutive decode steps, the tokens) of one greedy generate."""
    from transformers import LogitsProcessorList

    stamps = Stamps()
    out = engine.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                          pad_token_id=0, logits_processor=LogitsProcessorList([stamps]))
    gaps = [b - a for a, b in zip(stamps.times, stamps.times[1:])]
    return statistics.median(gaps), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvme-path", default=None, help="store folder (default: a temp dir)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--buffer-count", type=int, default=3)
    parser.add_argument("--quant", choices=sorted(QUANT), default="none")
    parser.add_argument("--device", default="cpu", help="shardwise device (cpu, cuda, ...)")
    parser.add_argument("--tier", choices=("nvme", "cpu"), default="nvme",
                        help="offload tier: nvme (files under --nvme-path) or cpu (pinned host "
                             "memory: an accelerator only)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    path = args.nvme_path or (tempfile.mkdtemp(prefix="shardwise-offload-graphs-")
                              if args.tier == "nvme" else None)
    eager, _ = build_engine(args, path, graphs=False)
    captured_engine, init_s = build_engine(args, path, graphs=True)
    engines = {"offload eager": eager, "offload + graphs": captured_engine}
    size = eager.offload.streamed_bytes_per_pass
    quant = "" if args.quant == "none" else f", {args.quant}"
    print(f"model: {args.layers} layers x {args.hidden} (fp32{quant}) on {eager.device}, "
          f"{size / 2**20:.1f} MiB streamed per token from {args.tier}; store {path}; "
          f"init with the bucket-1 capture {init_s:.1f} s; {captured_engine.offload.graphs}")
    results = {"args": vars(args), "mib_per_token": size / 2**20, "init_s": init_s,
               "by_batch": {}}
    for batch in args.batch:
        ids = torch.randint(3, args.vocab, (batch, 16),
                            generator=torch.Generator().manual_seed(1)).to(eager.device)
        tokens = {name: step_time(engine, ids, 3)[1] for name, engine in engines.items()}  # warm
        same = torch.equal(tokens["offload eager"], tokens["offload + graphs"])
        samples: dict[str, list[float]] = {name: [] for name in engines}
        loads = []
        for _ in range(args.rounds):
            for name, engine in engines.items():
                samples[name].append(step_time(engine, ids, args.tokens)[0])
            loads.append(os.getloadavg()[0])
        med = {name: statistics.median(v) for name, v in samples.items()}
        ratio = med["offload eager"] / med["offload + graphs"]
        results["by_batch"][batch] = {"ms_per_token": {k: v * 1e3 for k, v in med.items()},
                                      "eager_over_graphs": ratio, "same_tokens": same,
                                      "load_avg": loads}
        print(f"batch {batch}: " + ", ".join(f"{k} {v * 1e3:.1f} ms/token" for k, v in med.items())
              + f"; eager / graphs {ratio:.2f}x; same greedy tokens: {same}; "
              f"load {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

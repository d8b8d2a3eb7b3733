"""Wall-clock of quantizing an fp32 model on CPU (``quantize_model``: the scale search, rounding
and the CPU backend's prepack of every planned linear), per model shape and quant setting.

    python benchmarks/quantize_time.py                      # 1.7B shapes (2 layers) + SmolLM2-135M
    python benchmarks/quantize_time.py --model 1.7b --layers 4 --threads 2
    python benchmarks/quantize_time.py --model 135m --profile   # cProfile's top functions too

Models: ``1.7b`` is a random-weight ``LlamaConfig`` of SmolLM2-1.7B's shapes (hidden 2048,
intermediate 8192, 32 heads, vocab 49152, tied head) with ``--layers`` layers (the real one has
24; the full fp32 model is 6.8 GB, so the time is extrapolated: per layer x 24, plus the head);
``135m`` is the real SmolLM2-135M (``shardwise.models.load_model``; random weights of its shapes
where it is not on disk). Each setting quantizes a fresh copy of the model (the copy is not
timed) ``--repeats`` times; the best is printed as seconds, linear layers per second and GB/s of
fp32 weight quantized (bytes of the weights of the layers quantized / seconds). Settings: int4
group 128 (the default group size) and 32, int8 per channel, each without and with ``lm_head``
(the tied head and the embedding it shares, quantized once).

Timed on a machine shared with other jobs: run it with ``--repeats`` 3 or more and read the best.

Measured 2026-11-27 on 2 cores of an AMD EPYC (Zen4), torch's 2 threads, another job on the
machine (load average about 1; repeated runs differ by 10-20 %), best of 2-3, 1.7B shapes with 2
layers (14 linears; the tied head is quantized with its own settings, int8 groups of 32),
extrapolated to 24 layers, before (the whole-tensor code of rev 8def8cd, patched in) -> after:

    setting              s/layer        24 layers (+ head)
    int4 g128            1.51 -> 0.15   36.3 s -> 3.5-3.8 s
    int4 g128 +lm_head   1.62 -> 0.14   41.4 s -> 3.5-3.7 s
    int4 g32             1.66 -> 0.20   39.8 s -> 4.8-5.3 s
    int4 g32 +lm_head    1.54 -> 0.17   39.3 s -> 4.3-4.8 s
    int8 ch              0.42 -> 0.06   10.0 s -> 1.4-1.7 s
    int8 ch +lm_head     0.60 -> 0.09   15.3 s -> 2.4-2.5 s

SmolLM2-135M (the real weights, 210 linears): int4 g128 1.09 -> 0.51 s, int4 g32 0.96 -> 0.61 s,
int8 0.64 -> 0.20 s (its small layers leave the per-layer Python of the quantizer a larger share).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import time

import torch

import shardwise
from shardwise.quant import quantize_model

SETTINGS = {
    "int4 g128": {"weight": {"num_bits": 4, "group_size": 128}},
    "int4 g32": {"weight": {"num_bits": 4, "group_size": 32}},
    "int8 ch": {"weight": {"num_bits": 8}},
}
FULL_LAYERS = {"1.7b": 24, "135m": 30}


def build(name: str, layers: int) -> torch.nn.Module:
    """An fp32 model of ``name``'s shapes (module docstring)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if name == "135m":
        from shardwise.models import load_model

        try:
            return load_model(None, torch.float32)[0].eval()
        except Exception as exc:  # not on disk: its shapes with random weights
            print(f"(SmolLM2-135M not loaded: {exc}; random weights of its shapes)")
        config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                             num_key_value_heads=3, num_hidden_layers=30,
                             vocab_size=49152, tie_word_embeddings=True)
    else:
        config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                             num_key_value_heads=32, num_hidden_layers=layers,
                             vocab_size=49152, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).float().eval()
    for p in model.parameters():  # a trained model's scale, not the init's
        p.data.normal_(0, 0.02)
    return model


def time_one(model: torch.nn.Module, spec: dict, repeats: int, profile: bool):
    """(best seconds, report, profile text or None) of quantizing copies of ``model``."""
    cpu = shardwise.get_accelerator("cpu")
    best, report, text = float("inf"), None, None
    for i in range(repeats):
        m = copy.deepcopy(model)
        prof = cProfile.Profile() if profile and i == 0 else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        report = quantize_model(m, spec, cpu, torch.float32)
        if prof:
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
            text = out.getvalue()
        best = min(best, time.perf_counter() - t0)
        del m
    return best, report, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["1.7b", "135m", "both"], default="both")
    ap.add_argument("--layers", type=int, default=2,
                    help="1.7b: decoder layers built (default 2; 135m always has its 30)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--no-head", action="store_true", help="skip the lm_head=True runs")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top functions")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for name in (["1.7b", "135m"] if args.model == "both" else [args.model]):
        model = build(name, args.layers)
        n_layers = model.config.num_hidden_layers
        print(f"\n{name}: {n_layers} layers built, {args.threads} threads, best of "
              f"{args.repeats}")
        print(f"{'setting':22s} {'s':>7s} {'layers':>6s} {'layers/s':>8s} {'GB/s fp32':>9s} "
              f"{'s/layer':>8s} {f'x{FULL_LAYERS[name]} layers':>12s}")
        for setting in args.settings:
            for head in (False,) if args.no_head else (False, True):
                spec = {**SETTINGS[setting], **({"lm_head": True} if head else {})}
                secs, report, text = time_one(model, spec, args.repeats, args.profile)
                mods = dict(model.named_modules())
                head_bytes = 0
                nbytes = 0
                for lname, layer in report.layers.items():
                    b = mods[lname].weight.numel() * 4
                    nbytes += b
                    head_bytes += b if layer.kind == "lm_head" else 0
                # per decoder layer: the time less the head's share (by bytes), then x full depth
                per_layer = secs * (1 - head_bytes / nbytes) / n_layers
                full = per_layer * FULL_LAYERS[name] + secs * head_bytes / nbytes
                label = setting + (" +lm_head" if head else "")
                print(f"{label:22s} {secs:7.2f} {report.layers_quantized:6d} "
                      f"{report.layers_quantized / secs:8.1f} {nbytes / secs / 1e9:9.2f} "
                      f"{per_layer:8.3f} {full:11.1f}s", flush=True)
                if text:
                    print(text)


if __name__ == "__main__":
    main()

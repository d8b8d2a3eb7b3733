"""One decode step on CPU: plain HF vs the injected step eager vs the injected step compiled by
the CPU graph strategy (CpuCompileStrategy variants), timed interleaved in one process.

    python benchmarks/cpu_graphs.py --preset gpt2-24l-1024h --variants hf cpp --repeats 40
    python benchmarks/cpu_graphs.py --preset gpt2-24l-1024h --variants hf cpp --head-outside \
        --profile

Each variant runs the same step (position ``prompt-len``, batch 1) including the output head
(``lm_head``; captured with the step, as ``enable_graph`` does, unless ``--head-outside`` runs
it eagerly after the captured step), so the times are per-token decode latencies
without ``generate``'s own per-token overhead (~1-2 ms). Calls are interleaved (one of each
variant per round) so that load from other processes on a shared machine hits every variant
alike; the table shows medians, GB/s of weights read per step and % of the copy bandwidth
measured in the same rounds. ``--max-tokens`` sizes the static KV cache (the engine's default
is 1024; the captured step reads only the filled part where the device's decode attention is
capturable, as the CPU's is; ``--masked-attention`` attends over all of it instead).
``--profile`` prints where the last variant's step spends its time (torch.profiler, self time
per step).

Variants: ``hf`` (the plain model, DynamicCache cropped back after each step), ``eager``
(the injected graph-safe step, not compiled), ``nofreeze`` (compiled, weights as graph inputs
in their own layout: fusion only, ATen GEMMs), ``inductor`` (freezing, inductor's own packing:
MKL sgemm for fp32), ``onednn`` (freezing, oneDNN packing), ``cpp`` (the default CPU strategy:
weights as graph inputs, laid out once in blocks that inductor's C++ GEMM template reads in
place; runs on its own copy of the model, since the layout changes it), ``frozen`` (freezing,
the C++ GEMM template on its own prepacked copy: the default before), ``autotune`` (freezing + mode max-autotune-no-cudagraphs with inductor's packing:
MKL and the C++ template benchmarked per GEMM shape at capture).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import shardwise  # noqa: E402
from shardwise.accelerators.cpu_graphs import CpuCompileStrategy  # noqa: E402
from shardwise.accelerator import GraphStrategy  # noqa: E402
from shardwise.bench.presets import build_preset  # noqa: E402
from shardwise.bench.roofline import weight_bytes  # noqa: E402
from shardwise.inject import DecodeGraphs, injected_stack  # noqa: E402

STRATEGIES = {
    "eager": lambda: GraphStrategy(),
    "nofreeze": lambda: CpuCompileStrategy(linear="inductor", freezing=False),
    "inductor": lambda: CpuCompileStrategy(linear="inductor", freezing=True),
    "onednn": lambda: CpuCompileStrategy(linear="onednn", freezing=True),
    "cpp": lambda: CpuCompileStrategy(linear="cpp"),
    "frozen": lambda: CpuCompileStrategy(linear="cpp", freezing=True),
    "autotune": lambda: CpuCompileStrategy(linear="inductor", mode="max-autotune-no-cudagraphs",
                                           freezing=True),
}


def hf_step(model, ids: torch.Tensor, prompt_len: int):
    """A callable running one HF decode step after the prompt (cache cropped back each time)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    # transformers >= 5.2x names the cache argument ``cache`` (``past_key_values`` deprecated)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        model(ids, use_cache=True, **{kw: cache})
    nxt = ids[:, -1:]

    def step():
        with torch.inference_mode():
            out = model(nxt, use_cache=True, logits_to_keep=1, **{kw: cache}).logits
        cache.crop(-1)  # drop the step's token: every call decodes the same position
        return out
    return step


def injected_steps(model, ids: torch.Tensor, variants: list[str], max_tokens: int | None,
                   head_outside: bool = False, masked_attention: bool = False):
    """``variant → callable`` of one injected decode step, output head included, per strategy.

    The head is captured with the step, as ``enable_graph`` does; ``head_outside`` runs it
    eagerly after the captured step instead. ``masked_attention`` makes the step attend, masked,
    over all ``max_tokens`` cache slots (what a device without a capturable decode kernel gets)
    instead of calling the cpu kernel. Together they reproduce the step as the engine ran it
    before the head joined the graph and the cpu decode became capturable."""
    kwargs = {"max_tokens": max_tokens} if max_tokens else {}
    shared = None  # (stack, cache, head) of the model as loaded, for the variants that keep it
    strategies = {name: STRATEGIES[name]() for name in variants}
    # a strategy that lays the weights out for itself gets its own copy of the model
    copies = {name: copy.deepcopy(model) for name, s in strategies.items() if _relayouts(s)}
    steps = {}
    for name, strategy in strategies.items():
        start = time.perf_counter()
        if name in copies:
            stack, cache, head = _prefilled(copies.pop(name), ids, kwargs, masked_attention,
                                            strategy)
        else:
            if shared is None:
                shared = _prefilled(model, ids, kwargs, masked_attention, None)
            stack, cache, head = shared
        nxt = ids[:, -1:]
        # every replay writes the same cache position (the prompt's next): a fixed step to time
        rows = cache.decode_rows(torch.full_like(nxt, cache.length))
        graphs = DecodeGraphs(strategy, None if head_outside else head.forward)

        def step(graphs=graphs, stack=stack, cache=cache, head=head, nxt=nxt, rows=rows):
            with torch.inference_mode():
                hidden = graphs.run(stack, cache, nxt, rows)
                logits = graphs.take_logits(hidden)
                return head(hidden) if logits is None else logits
        step()
        print(f"  {name}: capture {time.perf_counter() - start:.1f} s", file=sys.stderr)
        steps[name] = step
    return steps


def _relayouts(strategy) -> bool:
    """Whether ``strategy`` lays the model's weights out for its captured code."""
    return isinstance(strategy, CpuCompileStrategy) and not strategy.freezing and \
        strategy.linear == "cpp"


def _prefilled(model, ids: torch.Tensor, kwargs: dict, masked_attention: bool, strategy):
    """(injected stack, its cache after the prompt ``ids``, output head) of ``model``, its
    weights laid out for ``strategy`` first when it does that (as ``enable_graph`` does)."""
    from shardwise.inject.capture import _head, _share_weights

    engine = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True,
                                      **kwargs)
    stack = injected_stack(engine.module)
    head = engine.module.get_output_embeddings()
    if strategy is not None:
        _share_weights(engine.module, _head(engine.module), strategy)
    if masked_attention:
        stack.kernels.decode_capturable = False
    with torch.inference_mode():
        out = engine.module(ids, use_cache=True)
    return stack, out.past_key_values, head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-24l-1024h")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--variants", nargs="+", default=["hf", "eager", "onednn", "cpp"],
                    choices=["hf", *STRATEGIES])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="static KV cache capacity (default: the engine's, 1024); the captured "
                         "step attends over all of it, masked")
    ap.add_argument("--head-outside", action="store_true",
                    help="run the output head eagerly after the captured step (see "
                         "injected_steps)")
    ap.add_argument("--masked-attention", action="store_true",
                    help="attend over the whole static cache, masked (see injected_steps)")
    ap.add_argument("--profile", action="store_true",
                    help="print where the last variant's step spends its time")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_preset(args.preset)
    nbytes = weight_bytes(model)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_len),
                        generator=torch.Generator().manual_seed(0))
    fns = {}
    if "hf" in args.variants:
        fns["hf"] = hf_step(copy.deepcopy(model), ids, args.prompt_len)
    fns.update(injected_steps(model, ids, [v for v in args.variants if v != "hf"],
                              args.max_tokens, args.head_outside,
                              args.masked_attention))
    logits = {k: f().float().reshape(-1) for k, f in fns.items()}
    src = torch.ones(512 << 18)
    dst = torch.empty_like(src)
    fns_timed = {"copy": lambda: dst.copy_(src), **fns}
    for f in fns_timed.values():
        f()
    times = {k: [] for k in fns_timed}
    for _ in range(args.repeats):
        for k, f in fns_timed.items():
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    bw = 2 * src.numel() * 4 / med.pop("copy") / 1e9
    ref = logits.get("eager", next(iter(logits.values())))
    print(f"{args.preset}: {nbytes / 1e9:.2f} GB of weights; {torch.get_num_threads()} threads; "
          f"copy bandwidth {bw:.1f} GB/s (median of {args.repeats}, interleaved)")
    base = med.get("hf")
    print(f"{'variant':<10} {'ms/step':>8} {'min':>7} {'GB/s':>6} {'% BW':>6} {'vs hf':>6} "
          f"{'max|logit diff| vs eager':>25}")
    for k, s in med.items():
        gbps = nbytes / s / 1e9
        vs = f"{base / s:.2f}x" if base else "-"
        diff = (logits[k] - ref).abs().max().item()
        print(f"{k:<10} {s * 1e3:>8.2f} {min(times[k]) * 1e3:>7.2f} {gbps:>6.1f} "
              f"{100 * gbps / bw:>5.1f}% {vs:>6} {diff:>25.2e}")

    if args.profile:
        profile_step(args.variants[-1], fns[args.variants[-1]])


def profile_step(name: str, step, steps: int = 10) -> None:
    """The ops where ``step`` spends its time: self CPU time per step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
    print(f"{name}: profiled {total:.1f} ms/step of self time; largest:")
    for e in events[:5]:
        print(f"  {e.key[:60]:<60} {e.self_cpu_time_total / steps / 1e3:7.2f} ms/step")


if __name__ == "__main__":
    main()

"""Why a streamed layer computes slower than the same layer resident: one process, interleaved.

Builds the same preset twice (same seed, same ``quant=``): once resident, once offloaded to
``--nvme-path`` (direct I/O), and times decode steps of both in interleaved rounds, with the
offloaded engine in three modes that isolate the cause:

* ``offload``: as shipped — layer i computes while layers i+1 … i+K-1 are read into the ring.
* ``offload, reads skipped``: the ring's loader is replaced by one that reads nothing (each slot
  keeps the weights of the layer last read into it: the same layout, the same kernels, the same
  memory, numbers of another layer) — the streamed layout's compute alone.
* ``offload, reads elsewhere``: the same reads as shipped, into scratch buffers of the slots'
  size that nothing computes from (the slots keep stale weights, as above) — the reads'
  interference alone.

Per mode it prints the median decode step (wall and process CPU time) and the median decoder
layer's forward, timed from after the ring's acquire (its wait excluded) to before its release,
in wall time and in the main thread's CPU time. If ``reads skipped`` matches ``resident`` and
``reads elsewhere`` matches ``offload``, the slowdown is the concurrent reads' cost on this
machine (CPU or memory the I/O takes from the compute threads), not the streamed layout.

Run (the figures in benchmarks/README.md, "Offload", came from this)::

    python benchmarks/offload_interference.py --preset gpt2-24l-1024h --quant int4 \\
        --nvme-path /work/offload-bench --batch 64 --rounds 5 [--threads 1] [--output F.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
import warnings

import torch

from shardwise.bench.plan import QUANT_CONFIGS

#: ``--quant`` → the engine's ``quant=`` dict
QUANT = {"none": None, **QUANT_CONFIGS}
MODES = ("resident", "offload", "offload, reads skipped", "offload, reads elsewhere")


def build(preset: str, quant: dict | None, offload: dict | None):
    """An engine over a fresh fp32 build of ``preset`` (seed 0: both builds hold equal weights)."""
    import shardwise
    from shardwise.bench.presets import build_preset

    model = build_preset(preset, torch.float32, seed=0).eval()
    kwargs = {"quant": quant} if quant else {}
    if offload:
        kwargs["offload"] = offload
    return shardwise.init_inference(model, **kwargs)


class LayerTimer:
    """Forward hooks timing every decoder layer of ``model`` (registered after the ring's, so the
    ring's wait is outside): ``samples[mode]`` gets (wall s, main-thread CPU s) per layer."""

    def __init__(self, layers) -> None:
        self.mode, self.samples, self._start = None, {}, {}
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda m, a, i=i: self._begin(i))
            layer.register_forward_hook(lambda m, a, o, i=i: self._end(i), always_call=True)

    def _begin(self, i: int) -> None:
        self._start[i] = (time.perf_counter(), time.thread_time())

    def _end(self, i: int) -> None:
        wall, cpu = self._start.pop(i)
        self.samples.setdefault(self.mode, []).append(
            (time.perf_counter() - wall, time.thread_time() - cpu))


class Stepper:
    """Greedy decode steps of one engine from a prefilled cache (ids [batch, prompt])."""

    def __init__(self, engine, ids: torch.Tensor) -> None:
        self.module = engine.module
        out = self.module(input_ids=ids, use_cache=True)
        self.past, self.next = out.past_key_values, out.logits[:, -1:].argmax(-1)

    def step(self) -> tuple[float, float]:
        """One decode step: (wall s, process CPU s)."""
        wall, cpu = time.perf_counter(), time.process_time()
        out = self.module(input_ids=self.next, past_key_values=self.past, use_cache=True)
        self.past, self.next = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - wall, time.process_time() - cpu


def loader_modes(ring) -> dict[str, object]:
    """mode → the ring loader's ``start`` for it (module docstring)."""
    from shardwise.offload.store import aligned_host_buffer

    shipped = ring.loader.start
    scratch = [aligned_host_buffer(slot.numel()) for slot in ring.loader.slots]

    def skipped(entry, s):
        done = concurrent.futures.Future()
        done.set_result(0.0)
        return done

    def elsewhere(entry, s):
        return ring.loader.reader.submit(entry, scratch[s])
    return {"offload": shipped, "offload, reads skipped": skipped,
            "offload, reads elsewhere": elsewhere}


def run_batch(resident, offloaded, batch: int, prompt: int, rounds: int) -> dict:
    """Interleaved rounds at one batch size; per mode the medians (module docstring)."""
    ring = offloaded.offload.ring
    starts = loader_modes(ring)
    timers = {id(e): LayerTimer(e.module.transformer.h if hasattr(e.module, "transformer")
                                else e.module.model.layers) for e in (resident, offloaded)}
    ids = torch.randint(0, resident.module.config.vocab_size, (batch, prompt),
                        generator=torch.Generator().manual_seed(batch))
    steps: dict[str, list] = {m: [] for m in MODES}
    with torch.inference_mode():
        steppers = {id(e): Stepper(e, ids) for e in (resident, offloaded)}
        for r in range(rounds + 1):  # round 0 warms up
            for mode in MODES:
                engine = resident if mode == "resident" else offloaded
                ring.loader.start = starts.get(mode, starts["offload"])
                timers[id(engine)].mode = mode if r else None
                sample = steppers[id(engine)].step()
                if r:
                    steps[mode].append(sample)
        ring.loader.start = starts["offload"]
        ring.settle()
    layers = {**timers[id(resident)].samples, **timers[id(offloaded)].samples}
    return {mode: {"step_ms": 1e3 * statistics.median(s[0] for s in steps[mode]),
                   "step_cpu_ms": 1e3 * statistics.median(s[1] for s in steps[mode]),
                   "layer_ms": 1e3 * statistics.median(x[0] for x in layers[mode]),
                   "layer_cpu_ms": 1e3 * statistics.median(x[1] for x in layers[mode])}
            for mode in MODES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt2-24l-1024h")
    ap.add_argument("--quant", choices=sorted(QUANT), default="int4")
    ap.add_argument("--quant-head", action="store_true",
                    help="also quantize the output head (quant lm_head=True: a tied head is "
                         "stored once, at 8 bits under int4, and stays resident with offload)")
    ap.add_argument("--nvme-path", required=True, help="existing writable directory (blobs)")
    ap.add_argument("--buffer-count", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[64])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    ap.add_argument("--output", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    offload = {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": args.buffer_count}
    quant = QUANT[args.quant]
    if quant and args.quant_head:
        quant = {**quant, "lm_head": True}
    resident = build(args.preset, quant, None)
    offloaded = build(args.preset, quant, offload)
    print(offloaded.offload.summary(), flush=True)
    doc = {"command": "python benchmarks/offload_interference.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "preset": args.preset, "quant": quant, "threads": torch.get_num_threads(),
           "load_before": os.getloadavg()[0], "rows": []}
    for batch in args.batch:
        figures = run_batch(resident, offloaded, batch, args.prompt_len, args.rounds)
        doc["rows"].append({"batch": batch, "modes": figures, "load": os.getloadavg()[0]})
        print(f"batch {batch} (load {os.getloadavg()[0]:.1f}, {torch.get_num_threads()} threads)")
        for mode, f in figures.items():
            print(f"  {mode:26s} step {f['step_ms']:8.1f} ms (cpu {f['step_cpu_ms']:8.1f})"
                  f"  layer {f['layer_ms']:7.2f} ms (main-thread cpu {f['layer_cpu_ms']:6.2f})",
                  flush=True)
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(doc, fh, indent=1)
    offloaded.close()
    resident.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

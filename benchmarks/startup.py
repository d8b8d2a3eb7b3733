"""Start-up time of ``init_inference`` with injection + graphs, first and later starts.

Each start is a fresh process that loads the model and then times
``init_inference(model, replace_with_kernel_inject=True, enable_graph=True[, quant=...])``. All
starts share one new, empty compile cache (``SHARDWISE_CACHE_DIR``; ``--cache DIR`` keeps one
across runs), so the first start compiles and the later ones show what the cache saves::

    python benchmarks/startup.py                     # embedded SmolLM2-135M, fp32, 3 starts
    python benchmarks/startup.py --quant int8 --starts 2
    python benchmarks/startup.py --shape llama-1.7b --quant int4 --saved-quantized
    python benchmarks/startup.py --shape llama-1.7b --quant int4 --starts 1 --decode 64 \
        --elementwise torch        # then native (always): the A/B of the native elementwise ops

The model: the embedded SmolLM2-135M-Instruct (default; its load time, what plain HF costs before
any generate, is printed beside), or ``--shape llama-1.7b`` — the 1.7B Llama of issue 21
(hidden 2048, 24 layers, 32 heads, vocab 49152, tied embeddings; random weights, seed 0),
written once as a bf16 HF folder under ``--work`` and loaded from there by every start. With a
quant setting the compute dtype is bf16, as ``benchmarks/peers/llama_cpp.py`` runs it.

``--saved-quantized``: the first start also writes its quantized engine
(``engine.save_checkpoint``, outside the timed init), and every later start builds the engine
from that checkpoint (``init_inference(None, checkpoint=...)``: nothing is requantized, no
full-precision model is loaded) — the second start of issue 21's target.

Phases: every start prints the log lines ``init_inference`` wrote with the seconds since it
began (injection, quantization, the weight layout, each batch bucket's capture), so what
dominates is visible, with inductor's FX-graph cache counters (a later start whose step is
served from the cache shows ``fxgraph_cache_hit``; a miss or bypass there means it compiled
again) and the compile's own phases from ``torch._dynamo.utils.compile_times``
(:data:`COMPILE_PHASES`; the JSON keeps them all); ``--json FILE`` writes every start with them.

``--decode N``: after ``init_inference`` each start also times N greedy tokens after a 64-token
prompt (ms per token: median of 3 generate calls of N + 1 tokens less the median of 3 of one
token), so a change to what the step compiles is checked for its decode speed in the same
process. ``--elementwise native|always|torch`` sets ``SHARDWISE_CPU_ELEMENTWISE`` for the starts:
the compiled step calls the native rms_norm / rotary / silu_and_mul ops for wide enough layers
(the default), at every width, or traces their torch forms for inductor to fuse (what it did
before). Inductor's precompiled header
(``/tmp/torchinductor_<user>/precompiled_headers``, built once per torch install) is shared by
every cache folder, so it is not in any start's time.

Figures measured on the development VM: benchmarks/README.md, "Start-up".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: Random-weight shapes (``--shape``): LlamaConfig fields (the same 1.7B as
#: ``benchmarks/peers/llama_cpp.py``'s ``SHAPES``).
SHAPES = {
    "llama-1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                       num_key_value_heads=32, intermediate_size=8192, vocab_size=49152,
                       tie_word_embeddings=True, max_position_embeddings=8192,
                       rope_theta=130000.0, rms_norm_eps=1e-5),
}

#: (label, key of ``torch._dynamo.utils.compile_times``) printed per start: dynamo's trace,
#: AOT's whole stage (inductor's compilation inside it), inductor's lowering, its C++ code
#: generation, the wait for its kernels' C++ builds; "C++ builds" sums every build's own time,
#: whichever thread ran it (the SIMD probe's and the kernels')
COMPILE_PHASES = (("dynamo trace", "bytecode_tracing"),
                  ("AOT + inductor", "create_aot_dispatcher_function"),
                  ("inductor", "compile_fx_inner"), ("lowering", "GraphLowering.run"),
                  ("codegen", "Scheduler.codegen"), ("kernel builds wait", "async_compile.wait"),
                  ("C++ builds", "compile_file"))

_ONE_START = r"""
import json, logging, sys, time
import torch
import shardwise
spec = json.loads(sys.argv[1])
t0 = time.perf_counter()
model = None
if spec["checkpoint"] is None:
    if spec["folder"] is None:
        from shardwise.models import load_model
        model, _ = load_model()
    else:
        from transformers import AutoModelForCausalLM
        dtype = torch.bfloat16 if spec["bits"] else torch.float32  # bf16 compute when quantized
        model = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=dtype).eval()
t1, c1 = time.perf_counter(), time.process_time()
events = []

class Phases(logging.Handler):
    def emit(self, record):
        events.append((round(time.perf_counter() - t1, 2), round(time.process_time() - c1, 2),
                       record.getMessage()[:160]))

logging.getLogger("shardwise").addHandler(Phases(level=logging.INFO))
logging.getLogger("shardwise").setLevel(logging.INFO)
kwargs = {"replace_with_kernel_inject": True, "enable_graph": True}
if spec["bits"]:
    kwargs["dtype"] = torch.bfloat16
    if spec["checkpoint"] is None:
        kwargs["quant"] = {"weight": {"num_bits": spec["bits"]}}
if spec["checkpoint"] is not None:
    kwargs["checkpoint"] = spec["checkpoint"]
engine = shardwise.init_inference(model, device="cpu", **kwargs)
t2, c2 = time.perf_counter(), time.process_time()
if spec["save"]:
    engine.save_checkpoint(spec["save"])
decode = None
if spec["decode"]:
    ids = torch.randint(100, 1000, (1, 64), generator=torch.Generator().manual_seed(0))
    def timed(n):
        t = time.perf_counter()
        engine.module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t
    timed(8)  # warm-up
    one = sorted(timed(1) for _ in range(3))[1]
    full = sorted(timed(spec["decode"] + 1) for _ in range(3))[1]
    decode = {"tokens": spec["decode"], "ms_per_token": 1000 * (full - one) / spec["decode"],
              "prompt_s": one}
from torch._dynamo.utils import compile_times, counters
cache = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
names, seconds = compile_times(repr="csv", aggregate=True)  # dynamo's and inductor's phases
compile_s = {n: round(float(t), 3) for n, t in zip(names, seconds)}
graphs = getattr(getattr(engine.module, "base_model", None), "graphs", None)
strategy = getattr(graphs, "strategy", None)  # compiled now, or loaded precompiled
steps = {k: getattr(strategy, k) for k in ("compiles", "loaded") if hasattr(strategy, k)}
print(json.dumps({"load_s": t1 - t0, "init_s": t2 - t1, "init_cpu_s": c2 - c1,
                  "phases": events, "fx_cache": cache, "compile_s": compile_s,
                  "steps": steps, "cpu_s": time.process_time(), "decode": decode,
                  "save_s": time.perf_counter() - t2 if spec["save"] else None}))
"""


def one_start(spec: dict, cache: str, elementwise: str | None = None) -> dict:
    """One fresh process: the model's load time and ``init_inference``'s, in seconds, with the
    log lines init wrote (seconds since init began)."""
    env = {**os.environ, "SHARDWISE_CACHE_DIR": cache}
    if elementwise:
        env["SHARDWISE_CPU_ELEMENTWISE"] = elementwise
    done = subprocess.run([sys.executable, "-c", _ONE_START, json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"a start failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def shape_folder(shape: str, work: Path) -> Path:
    """The random-weight ``shape`` as a bf16 HF folder in ``work`` (written once, then reused:
    the 1.7B is 3.4 GB in bf16 and twice that while being built in fp32)."""
    folder = work / f"{shape}-hf"
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    print(f"writing random-weight {shape} to {folder} (once)", flush=True)
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def run(args: argparse.Namespace, cache: str) -> list[dict]:
    bits = int(args.quant[3:]) if args.quant else None
    folder = str(shape_folder(args.shape, Path(args.work))) if args.shape else None
    saved = str(Path(cache) / "saved-quantized") if args.saved_quantized else None
    results = []
    for i in range(args.starts):
        from_saved = saved is not None and i > 0
        spec = {"folder": folder, "bits": bits, "checkpoint": saved if from_saved else None,
                "save": saved if saved is not None and i == 0 else None, "decode": args.decode}
        t = one_start(spec, cache, args.elementwise)
        how = "from the saved quantized checkpoint" if from_saved else (
            f"model load {t['load_s']:.1f} s")
        print(f"start {i + 1} ({args.shape or 'smollm2-135m'}, {args.quant or 'fp32'}): "
              f"init_inference {t['init_s']:.1f} s, {t['init_cpu_s']:.1f} s CPU ({how})",
              flush=True)
        print(f"    inductor FX-graph cache: {t['fx_cache'] or 'not used'}; decode steps "
              f"{t.get('steps') or '?'}; process CPU time {t['cpu_s']:.1f} s", flush=True)
        for seconds, cpu, message in t["phases"]:
            print(f"    {seconds:7.2f} s ({cpu:6.2f} s CPU)  {message}", flush=True)
        if t["decode"]:
            print(f"    decode: {t['decode']['ms_per_token']:.2f} ms/token over "
                  f"{t['decode']['tokens']} tokens (64-token prompt "
                  f"{t['decode']['prompt_s']:.2f} s)", flush=True)
        if t["compile_s"]:
            print("    compile phases (s): " + ", ".join(
                f"{label} {t['compile_s'][key]:.1f}" for label, key in COMPILE_PHASES
                if key in t["compile_s"]), flush=True)
        results.append({"start": i + 1, "from_saved_quantized": from_saved, **spec, **t})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", choices=["int8", "int4"], default=None)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="random weights of this shape (default: embedded SmolLM2-135M)")
    parser.add_argument("--work", default="/tmp/shardwise-startup",
                        help="where --shape's HF folder is written once")
    parser.add_argument("--saved-quantized", action="store_true",
                        help="start 1 saves its quantized engine; later starts load it")
    parser.add_argument("--cache", default=None,
                        help="compile cache folder to use (default: a new, empty one)")
    parser.add_argument("--json", default=None, help="write every start here")
    parser.add_argument("--decode", type=int, default=0,
                        help="after init, time this many greedy decode tokens (default: none)")
    parser.add_argument("--elementwise", choices=["native", "always", "torch"], default=None,
                        help="SHARDWISE_CPU_ELEMENTWISE for the starts (default: as set)")
    args = parser.parse_args()
    if args.saved_quantized and not args.quant:
        parser.error("--saved-quantized needs --quant int8 or int4")
    if args.decode < 0:
        parser.error(f"--decode must be >= 0 tokens, got {args.decode}")
    if args.cache:
        results = run(args, args.cache)
    else:
        with tempfile.TemporaryDirectory(prefix="shardwise-startup-") as cache:
            results = run(args, cache)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "starts": results},
                                              indent=1))


if __name__ == "__main__":
    main()

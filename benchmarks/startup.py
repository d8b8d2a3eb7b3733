"""Start-up time of ``init_inference`` with injection + graphs, first and later starts.

Each start is a fresh process that loads the model (the embedded SmolLM2-135M-Instruct by
default; its load time, what plain HF costs before any generate, is printed beside) and then times
``init_inference(model, replace_with_kernel_inject=True, enable_graph=True[, quant=...])``. All
starts share one new, empty compile cache (``SHARDWISE_CACHE_DIR``), so the first start compiles
and the later ones show what the cache saves::

    python benchmarks/startup.py                     # fp32, 3 starts
    python benchmarks/startup.py --quant int8 --starts 2

Figures measured on the development VM: benchmarks/README.md, "Start-up".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_ONE_START = """
import json, sys, time
import shardwise
from shardwise.models import load_model
t0 = time.perf_counter()
model, _ = load_model()
t1 = time.perf_counter()
quant = json.loads(sys.argv[1])
kwargs = {"quant": {"weight": {"num_bits": quant}}} if quant else {}
shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True,
                         enable_graph=True, **kwargs)
print(json.dumps({"load_s": t1 - t0, "init_s": time.perf_counter() - t1}))
"""


def one_start(bits: int | None, cache: str) -> dict:
    """One fresh process: the model's load time and ``init_inference``'s, in seconds."""
    env = {**os.environ, "SHARDWISE_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", _ONE_START, json.dumps(bits)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", choices=["int8", "int4"], default=None)
    parser.add_argument("--starts", type=int, default=3)
    args = parser.parse_args()
    bits = int(args.quant[3:]) if args.quant else None
    with tempfile.TemporaryDirectory(prefix="shardwise-startup-") as cache:
        for i in range(args.starts):
            t = one_start(bits, cache)
            print(f"start {i + 1} ({args.quant or 'fp32'}): init_inference {t['init_s']:.1f} s "
                  f"(model load {t['load_s']:.1f} s)", flush=True)


if __name__ == "__main__":
    main()

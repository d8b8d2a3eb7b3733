"""Whether the injected fp16/bf16 model or the test's HF reference is off (the first H200
run's "fp16 injection mismatch"; README, "On a GPU").

    python benchmarks/cuda_half_diag.py [cuda|cpu]

For each half dtype the device runs, against the fp32 HF model (max |logit difference| and
teacher-forced agreement over HF's own greedy continuation, tests/models.py ``bf16_against_hf``):

* HF built in the dtype (``from_config(dtype=...)``) and HF built in fp32 and cast (``.to``);
* the injected engine, eager and with graphs, with all its kernels, with no backend kernels
  (every op the torch reference) and with each backend op in turn replaced by the reference.

Run from the repository root (it imports tests/models.py). The two logs committed as
``results/cuda-h200-half-diag-{1,2}.txt`` came from the two halves of this script as they were
run on the H200 (the kernel swaps; then HF built in the dtype against the cast one).
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")

import shardwise  # noqa: E402
from models import bf16_against_hf, tiny_causal_lm  # noqa: E402
from shardwise.kernel_registry import registry  # noqa: E402

BACKEND = {"cuda": "triton", "cpu": "cpu"}


def engine(dev: str, dtype: torch.dtype, graphs: bool):
    return shardwise.init_inference(tiny_causal_lm("llama"), device=dev, dtype=dtype,
                                    replace_with_kernel_inject=True, enable_graph=graphs)


def without(backend: str, ops: list[str]):
    """Context: ``ops`` of ``backend`` unregistered (they resolve to the reference)."""
    class Swap:
        def __enter__(self):
            self.saved = {op: registry._impls[op].pop(backend) for op in ops}

        def __exit__(self, *exc):
            for op, impl in self.saved.items():
                registry._impls[op][backend] = impl
    return Swap()


def line(label: str, ref32, model) -> None:
    diff, agree = bf16_against_hf(ref32, model)
    print(f"{label:<44} vs HF fp32: max |logit diff| {diff:.4f}, agreement {agree:.3f}",
          flush=True)


def main(dev: str) -> None:
    backend = BACKEND[dev]
    registry.load_backend(backend)
    ops = sorted(op for op in registry.ops() if backend in registry._impls[op])
    dense = [op for op in ops if not op.startswith(("moe", "quant"))]
    ref32 = tiny_causal_lm("llama").to(dev)
    dtypes = (torch.float16, torch.bfloat16) if dev == "cuda" else (torch.bfloat16,)
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        line(f"{name} HF from_config(dtype=)", ref32, tiny_causal_lm("llama", dtype=dtype).to(dev))
        line(f"{name} HF fp32 cast with .to", ref32, tiny_causal_lm("llama").to(dev).to(dtype))
        for graphs in (False, True):
            tag = f"{name} engine{' graphs' if graphs else ''}"
            line(f"{tag}, all kernels", ref32, engine(dev, dtype, graphs))
            with without(backend, ops):
                line(f"{tag}, reference only", ref32, engine(dev, dtype, graphs))
            for op in dense if not graphs else ():
                with without(backend, [op]):
                    line(f"{tag}, {op} -> reference", ref32, engine(dev, dtype, graphs))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda")

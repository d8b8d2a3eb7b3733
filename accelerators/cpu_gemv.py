"""The CPU decode-step graphs' one-row product for 16-bit linear weights (bf16, fp16), where the
native 16-bit kernel is not used (it does not build, or the native CPU kernels are opted out:
:func:`~shardwise.accelerators.cpu_blocked_layout.native_half_ready`). Where it builds, 16-bit
weights are laid out in column blocks instead and read by that kernel, which streams them
faster still, the long rows of down projections above all (``python
benchmarks/kernel_half_linear.py``).

At batch 1 a decode step's linears are matrix-vector products bound by reading the weights. The
ways torch reads a bf16 weight for one row are slow on the CPUs measured: eager ``F.linear``
(ATen's bf16 GEMV / oneDNN's matmul on the plain layout), and inside the compiled step ATen's mm
or inductor's C++ GEMM template (its bf16 micro-GEMM converts each B tile for a single row), all
read the weight at well under the copy bandwidth — slower per weight byte than the fp32 paths,
which made the bf16 step, with half the bytes, slower than fp32's (issue 21). Measured on a
2-core AMD EPYC with AVX512-BF16, one thread, twelve [5632, 2048] weights per step: eager bf16
``F.linear`` 10 GB/s, the template on frozen bf16 weights 7 GB/s, fp32 (template) 21 GB/s, this
row product 21-28 GB/s, i.e. about half fp32's time. Whole decode steps:
``benchmarks/cpu_bf16_decode.py`` and its results in benchmarks/results/.

:func:`row_product` writes the product as what it is — one dot product per output row,
``(x.float() * W.float()).sum(-1)`` over ``W`` [N, K] as stored — and inductor fuses that into
one C++ loop nest that streams ``W`` once in its plain row-major layout, converts 16 values at a
time to fp32 in registers and accumulates in fp32 vectors: near the copy bandwidth, at half the
bytes of fp32. No copy and no new layout of the weight: the model's own parameter is read, by
the compiled step and the eager forward alike.

Numerics are the bf16 contract: bf16 × bf16 products are exact in fp32, they are summed in
fp32 (the bias too), and the result is rounded once to the weight's dtype (as oneDNN's and ATen's bf16 GEMMs
do; the order of the sum differs, so results differ by fp32 rounding only).

It is used for one row only (``rows == 1``, inside ``torch.compile``): with more rows inductor
reads the weight once per row, and ``F.linear`` (oneDNN's bf16 GEMM) is faster from two rows on.
Eager calls (the prompt's forward) always run ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.ledger import set_forward

#: Weight dtypes the one-row product serves (fp32 linears use the blocked layout instead).
ROW_PRODUCT_DTYPES = (torch.bfloat16, torch.float16)
#: Rows longer than this (K, the input features) are summed in :data:`ROW_CHUNK` pieces, then
#: the pieces: inductor's loop over one long row reads it slower (``python
#: benchmarks/kernel_row_product.py`` times both ways per K; figures in benchmarks/README.md,
#: "bf16 decode on the CPU").
LONG_ROW = 4096
ROW_CHUNK = 512


def row_sums(x: torch.Tensor, weight: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """x [1, K] · each row of weight [N, K] → [1, N] float32: the fp32 products summed in fp32,
    over the whole row, or per ``chunk`` columns and then over the chunks (``chunk`` divides
    K; only the order of the sum differs)."""
    if chunk is None:
        return (x.float()[:, None, :] * weight.float()[None]).sum(-1)
    pieces = (weight.shape[-1] // chunk, chunk)
    return (x.float().unflatten(-1, pieces)[:, None] * weight.float().unflatten(-1, pieces)[None]
            ).sum(-1).sum(-1)  # [1, N, K / chunk] → [1, N]


def row_product(x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for one row: x [1, K], weight [N, K], bias [N] → [1, N] in
    ``x.dtype``, each output the fp32 sum of the fp32 products plus the bias in fp32, rounded
    once (as ``F.linear``: adding the bias after rounding would round twice). A row longer
    than :data:`LONG_ROW` that :data:`ROW_CHUNK` divides is summed per chunk
    (:func:`row_sums`)."""
    k = weight.shape[-1]
    out = row_sums(x, weight, ROW_CHUNK if k > LONG_ROW and k % ROW_CHUNK == 0 else None)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


class RowProductLinear:
    """Instance-level ``forward`` of an ``nn.Linear`` (or transformers ``Conv1D``) with a 16-bit
    weight: inside ``torch.compile`` with one row, :func:`row_product`; otherwise the module's
    own product (``F.linear``, or ``Conv1D``'s ``addmm``), unchanged."""

    #: fused q|k|v and gate|up projections run back on their parts before the step is compiled
    #: (:mod:`shardwise.inject.fuse`): separate row products measured 4% faster in the compiled
    #: step (SmolLM2-135M bf16 batch 1, 10.86 vs 11.35 ms/token, quiet, 2 threads:
    #: benchmarks/results/cpu-fused-projections-graphs-quiet.json)
    unfused_faster = True

    def __init__(self, module: nn.Module, conv1d: bool) -> None:
        self.module, self.conv1d = module, conv1d

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        weight = module.weight  # [N, K] (Linear) or [K, N] (Conv1D)
        k = weight.shape[0] if self.conv1d else weight.shape[1]
        rows = x.numel() // k if k else 0
        if not (torch.compiler.is_compiling() and rows == 1 and x.dtype == weight.dtype):
            return type(module).forward(module, x)
        w = weight.t() if self.conv1d else weight  # [N, K]; Conv1D's is a transposed view
        out = row_product(x.reshape(1, k), w, module.bias)  # [1, N]
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def __repr__(self) -> str:
        return f"RowProductLinear(conv1d={self.conv1d})"


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


def row_product_eligible(module: nn.Module) -> bool:
    """A plain ``nn.Linear``/``Conv1D`` with a 16-bit 2-d CPU weight and no forward of its own."""
    if "forward" in module.__dict__ or not (type(module) is nn.Linear or _is_conv1d(module)):
        return False
    w = getattr(module, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype in ROW_PRODUCT_DTYPES
            and w.device.type == "cpu")


def use_row_products(linears: list[nn.Module]) -> int:
    """Give each eligible module of ``linears`` (:func:`row_product_eligible`) a
    :class:`RowProductLinear` forward, instance-scoped and recorded in the active ledger (undone
    with the engine). The weights are not touched. Returns the number of modules changed."""
    done = 0
    for module in linears:
        if row_product_eligible(module):
            set_forward(module, RowProductLinear(module, _is_conv1d(module)),
                        "one-row 16-bit product forward")
            done += 1
    return done

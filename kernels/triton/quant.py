"""``quant_linear`` as Triton kernels (CUDA; fp16/bf16 activations): weight-only int8 / int4.

Imported by ``shardwise.kernels.triton.register`` (so it imports triton), never by
``import shardwise`` nor on a CPU-only run. Kernels compile on first launch.

Three paths, chosen per call by the number of rows ``M`` of ``x [M, K]``:

* GEMV (``M <= gemv_max_rows``, 2): a program owns ``BLOCK_N`` outputs for every row and walks
  its share of K in ``BLOCK_K`` steps, loading the quantized tile ``[BLOCK_N, BLOCK_K]``,
  dequantizing it in registers and accumulating the products ``x * w`` elementwise; they are
  reduced over K once, after the loop. When the N blocks alone are too few programs to fill the
  GPU, K is split over a second grid axis and the float32 partials ``[split, M, N]`` are summed
  by torch (split-K, in a fixed order).
* GEMM (up to the bit width's ``dequant_min_rows``): ``[BLOCK_M, BLOCK_N]`` output tiles, the K
  loop dequantizes the weight tile to x.dtype (int4: the two nibble tiles interleaved back into
  columns) and accumulates ``tl.dot`` in float32.
* Beyond that (prefill sizes) the whole weight is dequantized once into a scratch ``[N, K]`` of
  x.dtype and multiplied by ``torch.mm`` (the vendor GEMM): exactly the reference's math.

On CUDA the GEMV and GEMM tiles are autotuned per shape on first use (a few candidate tiles
each, short timing runs, results cached on disk by Triton), inside the graph strategy's
warm-up, never during a capture; fixed tiles (``GemvConfig`` / ``GemmConfig``) serve the
interpreter and the tests.

All dequantize as the reference does, ``w = q * scale + offset`` in float32 (``offset = -zero *
scale``, absent when symmetric); the GEMM and the dequantizing path round it to x.dtype as the
reference does before multiplying with float32 accumulation, the GEMV multiplies the float32
weight (see ``_gemv_kernel``).
int4 tiles are read as bytes ``[BLOCK_N, BLOCK_K / 2]``; the low nibble of byte ``j`` is column
``2j`` and the high nibble column ``2j + 1`` (the reference layout): the GEMV multiplies the low
nibbles with x's even columns and the high nibbles with its odd columns; the GEMM and the
dequantizing kernel interleave the two nibble tiles back into column order (``tl.interleave``).
A group must therefore hold whole bytes (even ``group_size`` for 4 bits).

Packed layout (``PackedQuantWeight.tensors``; made once by ``prepack`` on the GPU):
``qweight`` int8 [N, K] or uint8 [N, K / 2] (the reference's, contiguous); ``scales`` float32
[N, n_groups]; ``offsets`` float32 [N, n_groups] when asymmetric.

The first H200 run (benchmarks/results/cuda-h200-kernels.json, fixed tiles, a reduction over K
in every step) put the GEMV at 0.2-0.7x cuBLAS fp16 at one row and 8 rows at 6-8x the 1-row
time, hence rows beyond 2 on the GEMM; the fused GEMMs at 2048 rows took 4-40x cuBLAS, hence
the dequantizing path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from shardwise.kernels.reference.quant import (PackedQuantWeight, QuantizedWeight,
                                               QuantLinearKernel)

BACKEND = "triton"
DEVICE_TYPES = frozenset({"cuda"})
DTYPES = frozenset({torch.float16, torch.bfloat16})


def supports(*, device_type: str, dtype: torch.dtype | None, bits: int | None = None,
             group_size: int | None = None, in_features: int | None = None,
             device_types: frozenset[str] = DEVICE_TYPES, **_shape: Any) -> bool:
    """Registry predicate: fp16/bf16 on CUDA, 8 bits, or 4 bits with even groups; needs the
    weight spec and refuses without it."""
    if device_type not in device_types or dtype not in DTYPES:
        return False
    if None in (bits, group_size, in_features):
        return False
    return bits == 8 or (bits == 4 and group_size % 2 == 0)


# ----- kernels ----------------------------------------------------------------------------------
#
# Every program owns rows [n0, n0 + BLOCK_N) of the weight: W, S and Z arrive already offset to row
# n0 (64-bit arithmetic once per program) and tiles index them with 32-bit offsets ``rn`` (0 ..
# BLOCK_N). TILE_GROUP: group_size is a multiple of BLOCK_K, so a K tile lies in one group and
# needs one scale (and offset) per row, a [BLOCK_N, 1] vector; otherwise they are gathered per
# element.


@triton.jit
def _scale_offset(S, Z, rn, mask_n, k0, k, n_groups, group_size, HAS_ZERO: tl.constexpr,
                  TILE_GROUP: tl.constexpr):
    """Scale and offset (zeros when symmetric) for rows rn and columns k (k0: the tile's first
    column): float32, [BLOCK_N, 1] with TILE_GROUP, else like ``k`` [1, BLOCK] broadcast."""
    if TILE_GROUP:
        idx = rn[:, None] * n_groups + k0 // group_size
        mask = mask_n[:, None]
    else:
        idx = rn[:, None] * n_groups + k // group_size
        mask = mask_n[:, None] & (k < n_groups * group_size)
    s = tl.load(S + idx, mask=mask, other=0.0)
    if HAS_ZERO:
        z = tl.load(Z + idx, mask=mask, other=0.0)
    else:
        z = tl.zeros_like(s)
    return s, z


@triton.jit
def _exact_float(q, bias: tl.constexpr):
    """int32 ``q`` → float32, exactly: ``q`` itself for a signed byte (bias 128: ``q + 128`` is
    in [0, 256)) and ``q - 8`` for a nibble (bias -8, ``q`` in [0, 16)). The integer is
    written into the mantissa of 2**23 and 2**23 subtracted, an integer add and a float add
    instead of a conversion (conversions run at a quarter of the float rate and were what
    bounded the int4 GEMV)."""
    if bias > 0:
        return (q + (0x4B000000 + bias)).to(tl.float32, bitcast=True) - (8388608.0 + bias)
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 - bias)


@triton.jit
def _affine(q, s, z, HAS_ZERO: tl.constexpr):
    """``q * scale (+ offset)``: symmetric weights skip the add of zeros."""
    if HAS_ZERO:
        return q * s + z
    return q * s


@triton.jit
def _dequant8(W, S, Z, rn, mask_n, k0, offs_k, mask_k, K, n_groups, group_size,
              HAS_ZERO: tl.constexpr, TILE_GROUP: tl.constexpr):
    """int8 W [N, K] (from row n0) → float32 tile [BLOCK_N, BLOCK_K] of ``q * scale + offset``."""
    mask = mask_n[:, None] & mask_k[None, :]
    q = _exact_float(tl.load(W + rn[:, None] * K + offs_k[None, :], mask=mask, other=0)
                     .to(tl.int32), 128)
    s, z = _scale_offset(S, Z, rn, mask_n, k0, offs_k[None, :], n_groups, group_size, HAS_ZERO,
                         TILE_GROUP)
    return _affine(q, s, z, HAS_ZERO)


@triton.jit
def _dequant4(W, S, Z, rn, mask_n, k0, offs_j, mask_j, K, n_groups, group_size,
              HAS_ZERO: tl.constexpr, TILE_GROUP: tl.constexpr):
    """uint8 W [N, K / 2] (from row n0), byte j = column 2j (low nibble) | column 2j+1 (high
    nibble) → float32 tiles [BLOCK_N, BLOCK_K / 2] of the even and of the odd columns."""
    mask = mask_n[:, None] & mask_j[None, :]
    b = tl.load(W + rn[:, None] * (K // 2) + offs_j[None, :], mask=mask, other=0).to(tl.int32)
    s, z = _scale_offset(S, Z, rn, mask_n, k0, 2 * offs_j[None, :], n_groups, group_size,
                         HAS_ZERO, TILE_GROUP)
    lo = _affine(_exact_float(b & 15, -8), s, z, HAS_ZERO)
    hi = _affine(_exact_float(b >> 4, -8), s, z, HAS_ZERO)
    return lo, hi


@triton.jit
def _store(Y, B, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] (+ bias) → Y in its dtype."""
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(ptrs, acc.to(Y.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _gemv_kernel(X, W, S, Z, B, Y, P, M, N, K, n_groups, group_size, stride_xm, stride_ym,
                 k_per_split, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                 HAS_BIAS: tl.constexpr, TILE_GROUP: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y [M, N] = X [M, K] @ dequant(W)ᵀ for small M; with SPLIT > 1 program (n, s) writes its
    K share's float32 partial to P [SPLIT, M, N] instead. The float32 dequantized weights are
    multiplied as they are: the reference rounds them to Y's dtype first, a conversion pair per
    weight that bounded this kernel; the difference is that rounding (2**-11 relative per weight
    in fp16, 2**-8 in bf16), far inside the quantization error and the parity tolerance."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    n0 = pid_n * BLOCK_N
    W += n0.to(tl.int64) * (K * BITS // 8)
    S += n0.to(tl.int64) * n_groups
    Z += n0.to(tl.int64) * n_groups
    rn = tl.arange(0, BLOCK_N)
    offs_n = n0 + rn
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # elementwise products accumulate in [BLOCK_M, BLOCK_N, BLOCK_K (int4: BLOCK_K / 2)] and
    # are reduced over K once, after the loop (a reduction per tile costs shuffles every step)
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K * BITS // 8), dtype=tl.float32)
    x_rows = X + offs_m[:, None] * stride_xm
    for k0 in range(k_start, k_end, BLOCK_K):
        if BITS == 8:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < k_end
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0).to(tl.float32)
            w = _dequant8(W, S, Z, rn, mask_n, k0, offs_k, mask_k, K, n_groups, group_size,
                          HAS_ZERO, TILE_GROUP)
            acc += x[:, None, :] * w[None, :, :]
        else:
            offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte (column pair) index
            mask_j = 2 * offs_j < k_end
            xmask = mask_m[:, None] & mask_j[None, :]
            xe = tl.load(x_rows + 2 * offs_j[None, :], mask=xmask, other=0.0).to(tl.float32)
            xo = tl.load(x_rows + 2 * offs_j[None, :] + 1, mask=xmask, other=0.0).to(tl.float32)
            lo, hi = _dequant4(W, S, Z, rn, mask_n, k0, offs_j, mask_j, K, n_groups, group_size,
                               HAS_ZERO, TILE_GROUP)
            acc += xe[:, None, :] * lo[None, :, :]
            acc += xo[:, None, :] * hi[None, :, :]
    acc = tl.sum(acc, axis=2)
    if SPLIT == 1:
        _store(Y, B, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)
    else:
        ptrs = P + pid_s * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(ptrs, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _dot(x, w, acc, DT: tl.constexpr, F32_DOT: tl.constexpr):
    """acc + x [BLOCK_M, BK] @ wᵀ (w float32 [BLOCK_N, BK]) with w rounded to DT, float32 sums.

    F32_DOT (the interpreter, whose dot mishandles bf16): multiply the same DT-rounded operands
    as exact float32 ("ieee"), which equals a half-precision dot with float32 sums."""
    if F32_DOT:
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(DT).to(tl.float32)), acc,
                     input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(w.to(DT)), acc)
    return acc


@triton.jit
def _gemm_kernel(X, W, S, Z, B, Y, M, N, K, n_groups, group_size, stride_xm, stride_ym,
                 M_BUCKET, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                 TILE_GROUP: tl.constexpr, F32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y [M, N] = X [M, K] @ dequant(W)ᵀ with tl.dot, dequantization fused into the K loop.
    M_BUCKET (rows rounded up to a power of two) only keys the autotuning."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    DT: tl.constexpr = Y.dtype.element_ty
    n0 = pid_n * BLOCK_N
    W += n0.to(tl.int64) * (K * BITS // 8)
    S += n0.to(tl.int64) * n_groups
    Z += n0.to(tl.int64) * n_groups
    rn = tl.arange(0, BLOCK_N)
    offs_n = n0 + rn
    mask_n = offs_n < N
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: m * stride > 2**31
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = X + offs_m[:, None] * stride_xm
    for k0 in range(0, K, BLOCK_K):
        if BITS == 8:
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0)
            w = _dequant8(W, S, Z, rn, mask_n, k0, offs_k, mask_k, K, n_groups, group_size,
                          HAS_ZERO, TILE_GROUP)
            acc = _dot(x, w, acc, DT, F32_DOT)
        else:
            offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            mask_j = 2 * offs_j < K
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :],
                        other=0.0)
            lo, hi = _dequant4(W, S, Z, rn, mask_n, k0, offs_j, mask_j, K, n_groups, group_size,
                               HAS_ZERO, TILE_GROUP)
            # [BLOCK_N, BLOCK_K]: column 2j from the low nibbles, 2j + 1 from the high ones
            acc = _dot(x, tl.interleave(lo, hi), acc, DT, F32_DOT)
    _store(Y, B, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, HAS_BIAS)


@triton.jit
def _dequant_kernel(W, S, Z, OUT, N, K, n_groups, group_size, BITS: tl.constexpr,
                    HAS_ZERO: tl.constexpr, TILE_GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """OUT [N, K] (x's dtype) = dequant(W), tile [BLOCK_N, BLOCK_K] of program (n, k), rounded
    as the reference rounds its dequantized weight."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    DT: tl.constexpr = OUT.dtype.element_ty
    n0 = pid_n * BLOCK_N
    W += n0.to(tl.int64) * (K * BITS // 8)
    S += n0.to(tl.int64) * n_groups
    Z += n0.to(tl.int64) * n_groups
    OUT += n0.to(tl.int64) * K
    rn = tl.arange(0, BLOCK_N)
    mask_n = n0 + rn < N
    k0 = pid_k * BLOCK_K
    if BITS == 8:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = _dequant8(W, S, Z, rn, mask_n, k0, offs_k, mask_k, K, n_groups, group_size,
                      HAS_ZERO, TILE_GROUP)
        tl.store(OUT + rn[:, None] * K + offs_k[None, :], w.to(DT),
                 mask=mask_n[:, None] & mask_k[None, :])
    else:
        offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask_j = 2 * offs_j < K
        lo, hi = _dequant4(W, S, Z, rn, mask_n, k0, offs_j, mask_j, K, n_groups, group_size,
                           HAS_ZERO, TILE_GROUP)
        offs_k = k0 + tl.arange(0, BLOCK_K)  # the nibbles back in column order: one store
        tl.store(OUT + rn[:, None] * K + offs_k[None, :], tl.interleave(lo, hi).to(DT),
                 mask=mask_n[:, None] & (offs_k < K)[None, :])


# ----- launchers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemvConfig:
    """Fixed GEMV tiles (tests, the interpreter). ``block_k`` is for one row and shrinks as rows
    grow, keeping ``block_m * block_k <= rows_x_k`` down to ``min_block_k``; ``split_k`` None
    picks it from the SM count."""

    block_n: int = 16
    block_k: int = 256
    rows_x_k: int = 256
    min_block_k: int = 32
    split_k: int | None = None
    num_warps: int = 4


@dataclass(frozen=True)
class GemmConfig:
    """Fixed GEMM tiles (each at least 16 for tl.dot; ``block_k`` at least 32 for 4 bits)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


#: Rows from which a call dequantizes the whole weight once (x's dtype, a scratch [N, K]) and
#: multiplies with the vendor GEMM. H200, Llama-7B qkv (4096 -> 12288), autotuned tiles, in CUDA
#: graphs (results/cuda-h200-kernels-quant-paths.json): int8 GEMM vs dequantize + torch.mm 38 vs
#: 72 us at 32 rows, 113 vs 78 at 256, 745 vs 368 at 2048 (cuBLAS fp16: 319). int4's
#: dequantizing kernel then stored its two nibble tiles with stride 2 (784 us at 256 rows
#: against the GEMM's 119); it now stores the interleaved tile, not yet timed: 1024 keeps int4
#: on the GEMM until it is.
DEQUANT_MIN_ROWS = {8: 128, 4: 1024}
#: a row count no call reaches: a threshold that never switches paths
NEVER = 1 << 62
#: (block_n, block_k) the autotuned GEMV's K split is planned for, before the tile is chosen: a
#: typical tuned tile (the candidates below span 8-64 x 128-1024)
_SPLIT_TILE = (32, 512)

#: Candidate tiles the GPU picks from on first use of a (rows, N, K) shape (triton.autotune;
#: results cached on disk). GEMV: (block_n, block_k, warps, stages), its float32 products
#: [block_n, block_k] per row at most 64 registers a thread.
_GEMV_TUNE = ((16, 512, 4, 3), (32, 256, 4, 3), (64, 128, 4, 3), (8, 1024, 4, 3),
              (32, 512, 8, 3), (64, 256, 8, 3), (16, 256, 4, 4), (32, 128, 4, 4))
#: GEMM: (block_m, block_n, block_k, warps, stages); block_m beyond the rows is pruned.
_GEMM_TUNE = ((16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (32, 64, 128, 4, 4),
              (32, 128, 64, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 8, 3),
              (128, 128, 64, 8, 3), (128, 64, 64, 4, 4))


def _quick_bench(kernel_call, quantiles):
    """Autotuning's timer: short runs (the default 25 + 100 ms per candidate multiplies into
    seconds per shape at start-up)."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


def _k_per_split(args) -> int:
    """K columns per split: whole K tiles, the splits together covering K."""
    return triton.cdiv(triton.cdiv(args["K"], args["BLOCK_K"]), args["SPLIT"]) * args["BLOCK_K"]


def _tile_group(args) -> bool:
    return args["group_size"] % args["BLOCK_K"] == 0


def _gemm_prune(configs, named_args, **_):
    """Drop row tiles larger than the rows (16, the smallest candidate, always stays)."""
    return [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, named_args["M_BUCKET"])]


def _tuned(kernel, configs, key, prune=None):
    """``kernel`` autotuned over ``configs`` (dicts of meta-parameters plus num_warps and
    num_stages), its K split and group tiling derived from the chosen BLOCK_K."""
    heuristic = triton.heuristics({"TILE_GROUP": _tile_group} | (
        {"k_per_split": _k_per_split} if "SPLIT" in kernel.arg_names else {}))
    tuned = [triton.Config(dict(meta), num_warps=w, num_stages=st) for meta, w, st in configs]
    return triton.autotune(tuned, key=key, do_bench=_quick_bench, cache_results=True,
                           prune_configs_by={"early_config_prune": prune} if prune else None,
                           )(heuristic(kernel))


_gemv_tuned = _tuned(_gemv_kernel, [({"BLOCK_N": n, "BLOCK_K": k}, w, st)
                                    for n, k, w, st in _GEMV_TUNE], key=["M", "N", "K", "SPLIT"])
_gemm_tuned = _tuned(_gemm_kernel, [({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, w, st)
                                    for m, n, k, w, st in _GEMM_TUNE],
                     key=["M_BUCKET", "N", "K"], prune=_gemm_prune)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class TritonQuantLinear(QuantLinearKernel):
    """``quant_linear`` with the Triton kernels above (module docstring).

    By rows of ``x``: up to ``gemv_max_rows`` the GEMV, up to the bit width's
    ``dequant_min_rows`` the GEMM, beyond that the whole weight dequantized once and the vendor
    GEMM (``torch.mm``). Without ``gemv``/``gemm`` configs the tiles are autotuned on the GPU per
    shape (the registered instance); given, they are used as they are (tests, the interpreter).
    ``device_types`` may add "cpu" to run the kernels on CPU tensors under
    ``TRITON_INTERPRET=1`` (tests); the registered instance claims CUDA only.
    """

    backend = BACKEND

    def __init__(self, gemv: GemvConfig | None = None, gemm: GemmConfig | None = None,
                 gemv_max_rows: int = 2, device_types: frozenset[str] = DEVICE_TYPES,
                 dequant_min_rows: dict[int, int] | None = None) -> None:
        self.gemv, self.gemm = gemv, gemm
        self.gemv_max_rows, self.device_types = gemv_max_rows, frozenset(device_types)
        self.dequant_min_rows = dict(DEQUANT_MIN_ROWS if dequant_min_rows is None
                                     else dequant_min_rows)

    def supports(self, **kwargs) -> bool:
        return supports(device_types=self.device_types, **kwargs)

    def _pack(self, qw: QuantizedWeight, device: torch.device, dtype: torch.dtype):
        qw = qw.to(device)
        tensors = {"qweight": qw.qweight.contiguous(), "scales": qw.scales.contiguous()}
        if qw.zeros is not None:
            tensors["offsets"] = (-qw.zeros * qw.scales).contiguous()
        return tensors, {}

    def _linear(self, x2: torch.Tensor, packed: PackedQuantWeight,
                bias: torch.Tensor | None) -> torch.Tensor:
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        spec = packed.spec
        y = torch.empty(x2.shape[0], spec.out_features, dtype=x2.dtype, device=x2.device)
        if x2.shape[0] == 0:
            return y
        if bias is not None:
            bias = bias.contiguous()
        rows = x2.shape[0]
        if rows <= self.gemv_max_rows:
            return self._launch_gemv(x2, packed, bias, y)
        if rows < self.dequant_min_rows.get(spec.bits, NEVER):
            return self._launch_gemm(x2, packed, bias, y)
        return self._launch_dequant(x2, packed, bias, y)

    def _common(self, x2, packed, bias, y):
        """Arguments shared by both kernels (unused pointers get a placeholder tensor)."""
        t, spec = packed.tensors, packed.spec
        zeros = t.get("offsets", t["scales"])
        return (x2, t["qweight"], t["scales"], zeros, bias if bias is not None else t["scales"],
                y), dict(BITS=spec.bits, HAS_ZERO="offsets" in t, HAS_BIAS=bias is not None)

    @staticmethod
    def _gemv_tiles(rows: int, spec, device: torch.device, cfg: GemvConfig):
        """(block_m, block_k, k_per_split, split) for a launch with fixed tiles."""
        n, k = spec.out_features, spec.in_features
        block_m = triton.next_power_of_2(rows)
        block_k = max(cfg.min_block_k, min(cfg.block_k, cfg.rows_x_k // block_m))
        block_k = tile_k(block_k, spec.group_size, cfg.min_block_k)
        k_blocks = triton.cdiv(k, block_k)
        split = cfg.split_k
        if split is None:
            split = _auto_split(n, k_blocks * block_k, device, cfg.block_n, block_k)
        k_per_split = triton.cdiv(k_blocks, split) * block_k
        return block_m, block_k, k_per_split, triton.cdiv(k, k_per_split)

    def _launch_gemv(self, x2, packed, bias, y):
        spec = packed.spec
        m, n, k = x2.shape[0], spec.out_features, spec.in_features
        args, flags = self._common(x2, packed, bias, y)
        shape = (m, n, k, spec.n_groups, spec.group_size, x2.stride(0), y.stride(0))
        if self.gemv is None and x2.is_cuda:  # autotuned; the split from the SM count
            split = _auto_split(n, k, x2.device, *_SPLIT_TILE)
            partial = self._partial(y, split)
            _gemv_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)](
                *args, partial, *shape, **flags, SPLIT=split,
                BLOCK_M=triton.next_power_of_2(m))
        else:
            cfg = self.gemv or GemvConfig()  # fixed tiles (the interpreter cannot autotune)
            block_m, block_k, k_per_split, split = self._gemv_tiles(m, spec, x2.device, cfg)
            partial = self._partial(y, split)
            _gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
                *args, partial, *shape, k_per_split, **flags,
                TILE_GROUP=spec.group_size % block_k == 0, SPLIT=split, BLOCK_M=block_m,
                BLOCK_N=cfg.block_n, BLOCK_K=block_k, num_warps=cfg.num_warps)
        if split == 1:
            return y
        out = partial.sum(0)  # [split, M, N] float32 partials, summed in a fixed order
        if bias is not None:
            out += bias.float()
        return out.to(y.dtype)

    @staticmethod
    def _partial(y: torch.Tensor, split: int) -> torch.Tensor:
        """Where the GEMV writes: y itself, or float32 partials [split, M, N]."""
        if split == 1:
            return y
        return torch.empty(split, *y.shape, dtype=torch.float32, device=y.device)

    def _launch_gemm(self, x2, packed, bias, y):
        spec, cfg = packed.spec, self.gemm
        m, n = x2.shape[0], spec.out_features
        args, flags = self._common(x2, packed, bias, y)
        shape = (m, n, spec.in_features, spec.n_groups, spec.group_size, x2.stride(0),
                 y.stride(0))
        f32_dot = x2.device.type == "cpu"
        if cfg is None and x2.is_cuda:
            bucket = min(triton.next_power_of_2(m), 1024)
            _gemm_tuned[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]),
                                      triton.cdiv(n, meta["BLOCK_N"]))](
                *args, *shape, bucket, **flags, F32_DOT=f32_dot)
            return y
        cfg = cfg or GemmConfig()
        block_m = min(cfg.block_m, max(16, triton.next_power_of_2(m)))
        block_k = tile_k(cfg.block_k, spec.group_size, 32 if spec.bits == 4 else 16)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n))
        _gemm_kernel[grid](
            *args, *shape, 0, **flags, TILE_GROUP=spec.group_size % block_k == 0,
            F32_DOT=f32_dot, BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return y

    def _launch_dequant(self, x2, packed, bias, y):
        """The weight dequantized into a scratch [N, K] of x's dtype, then ``torch.mm``."""
        t, spec = packed.tensors, packed.spec
        n, k = spec.out_features, spec.in_features
        w = torch.empty(n, k, dtype=x2.dtype, device=x2.device)
        block_n, block_k = 32, tile_k(256, spec.group_size, 32)
        _dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
            t["qweight"], t["scales"], t.get("offsets", t["scales"]), w, n, k, spec.n_groups,
            spec.group_size, BITS=spec.bits, HAS_ZERO="offsets" in t,
            TILE_GROUP=spec.group_size % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k)
        if bias is None:
            return torch.mm(x2, w.t(), out=y)
        return torch.addmm(bias, x2, w.t(), out=y)


def _auto_split(n: int, k: int, device: torch.device, block_n: int, block_k: int) -> int:
    """K splits for a GEMV whose N tiles alone are too few programs to fill the GPU (about two
    per SM), each split keeping at least four K tiles; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    programs = triton.cdiv(n, block_n)
    return max(1, min(triton.cdiv(k, block_k) // 4,
                      triton.cdiv(2 * _num_sms(device.index or 0), programs)))


def tile_k(block_k: int, group_size: int, min_k: int) -> int:
    """The K tile: the largest power of two in [min_k, block_k] dividing ``group_size`` (one
    scale per row per tile), else ``block_k`` (scales gathered per element)."""
    k = block_k
    while k >= min_k:
        if group_size % k == 0:
            return k
        k //= 2
    return block_k


#: The implementation the registry hands out for CUDA.
quant_linear = TritonQuantLinear()


def register(registry) -> None:
    """Register the Triton ``quant_linear`` for fp16/bf16 CUDA tensors."""
    registry.register("quant_linear", BACKEND, quant_linear, dtypes=DTYPES,
                      device_types=DEVICE_TYPES, supports=quant_linear.supports)

"""``quant_linear`` on CPU: a native AVX512-VNNI kernel with 8-bit activations, else torch's
packed weight-only kernels.

The native kernel (default where it builds)
-------------------------------------------
Where the CPU has AVX512-VNNI and a C++ compiler works, the first quantized layer builds
``native/quant.cpp`` (:mod:`shardwise.kernels.cpu.native`: ``torch.utils.cpp_extension``, cached
per user, 15-40 s once; a later process loads the cached build) and every ``quant_linear``
this backend claims runs it, as llama.cpp's Q8_0/Q4_0 CPU paths do: **the activations are
quantized to int8 per block of 16 columns under 8-bit weights, of 32 under 4-bit**
(:data:`~shardwise.kernels.reference.quant.MAX_ACTIVATION_BLOCK`; one float32 scale per block:
``amax / 127``) and multiplied by the weight's integers with ``vpdpbusd`` (64 multiply-adds per
instruction), the float scales applied per block and per weight group. This changes the
numerics: besides the weight's own quantization, each activation is rounded to 8 bits relative
to its block's largest magnitude (as llama.cpp does). The oracle, exactly this math in torch, is
:func:`shardwise.kernels.reference.quant.int8_activation_linear` (the block size:
:func:`~shardwise.kernels.reference.quant.activation_block`, the largest of 32/16/8/4 up to 16
under 8-bit weights and 32 under 4-bit that divides the group). **Opt-out**:
``SHARDWISE_CPU_QUANT_KERNEL=torch`` keeps torch's packed kernels below (weights only quantized;
activations stay bf16). Where the native kernel cannot be built, one log line says why and torch's
kernels run.

Native layout (``meta["kind"] == "native"``, ``meta["ablock"]`` the activation block;
``Nb = ceil(N / 16)``, rows past N are zero padding): ``qweight`` uint8 ``[Nb, K / L, 16, 4]``,
for each block of 16 output rows the K columns in steps of L (a 64-byte vector: 4 bytes per
row): int8 (L = 4) bytes ``q + 128``; int4 (L = 8) byte j of a row is ``(q[k + j] + 8) | (q[k +
4 + j] + 8) << 4``. ``scales`` float32 ``[Nb, n_groups, 16]``; asymmetric adds ``zeros`` float32
``[Nb, n_groups, 16]`` (the format's zero points, unchanged). A checkpoint saved in this layout
loads where the native kernel cannot be built too: it then runs the oracle (slow, same numbers).
The packing is done once, at load; weights are read as 1 byte (int8) or half a byte (int4) plus
4 scale bytes per group and row (6% at int4 g128), under torch's OpenMP threads (one block of
16 rows per task), up to 8 activation rows sharing every loaded weight vector. Where it runs,
this backend claims every spec it takes, wider than torch's kernels below: any ``out_features``
(padded to 16 rows: GPT-2's 50257-row head at int4) and any group with an activation block
(int4 in groups of 16 included), in bf16 **and fp32** activations (``NATIVE_DTYPES``): an fp32
model's quantized linears read their fp32 input in place and return fp32, with no cast to bf16
and back (2-3 µs less per call at SmolLM2's shapes, 1 thread: 576 -> 576 int8 11.4 µs against
14.7 with the casts; equal at the 1.7B's shapes; benchmarks/kernel_quant.py --fp32-model), and
without bf16's rounding of the activations and the output. The kernel writes bf16 and fp32
outputs itself (bf16 rounded to nearest even once, after the bias is added in fp32).

torch's packed kernels (the fallback, and ``SHARDWISE_CPU_QUANT_KERNEL=torch``)
----------------------------------------------------------------------------------
What torch 2.13 offers, and what this backend therefore claims (``supports``):

* int8: ``aten._weight_int8pack_mm(x [M, K], q int8 [N, K], scales [N]) -> [M, N]``, symmetric
  per output channel only. Groups are run as one call per group (each group's ``[N, group]``
  slice is contiguous in the packed layout) summed in float32. Asymmetric weights are
  ``q * scale + offset`` with ``offset = -zero * scale``; ``x @ offsetᵀ`` is
  ``sum_g(x[:, group g]) * offset[:, g]``, a ``[M, n_groups] @ [n_groups, N]`` matmul added in
  float32. Every group size is claimed: even groups of 32 (64 launches at K 2048) beat the
  reference at every batch measured.
* int4: ``aten._convert_weight_to_int4pack_for_cpu(u int32 [N, K], inner_k_tiles) -> uint8``
  (an opaque blocked layout) and ``aten._weight_int4pack_mm_for_cpu(x, packed, kernel_group,
  scales_and_zeros [K / kernel_group, N, 2])``, which computes ``w = (u - 8) * scale + zero``
  (verified against the reference: ``u = q + 8`` and ``zero = -zero_point * scale``). The kernel
  takes groups of 32, 64, 128 or 256 and N divisible by 16; a larger group that is a multiple
  of 32 (per-channel included) is expressed exactly by repeating its scales over sub-groups.
  Groups of 16 or N % 16 != 0 resolve to the reference.
* dtypes: bf16 only (scales are stored in bf16: the kernels take them in x.dtype; fp32 is
  claimed only where the native kernel runs, above). Only the bf16
  kernels are vectorized (AVX512); with fp32/fp16 activations both run scalar loops whose cost
  grows with the rows: at batch 1 they are slower than dense fp32 ``F.linear`` (though
  faster than the reference), and at batch 4 int4 is slower than the reference too, so this
  backend claims bf16 only for them. **An fp32 model still runs these kernels** (under the
  opt-out, or where the native kernel does not build): the quantizer asks the
  registry which of the accelerator's dtypes has a fast kernel (:meth:`shardwise.quant.Quantizer.
  resolve_kernel`), packs for bf16, and the :class:`~shardwise.quant.QuantLinear` casts its fp32
  input to bf16 and the output back to fp32 (the bias is added in fp32). Added error against
  the same quantized weights computed in fp32 by the reference: 0.24-0.29% relative on the
  logits of the tests' tiny fp32 models, a tenth of int8's own quantization error, greedy tokens
  identical (tests/test_quant.py); the two casts cost a few microseconds per layer at batch 1,
  small beside the kernel. A setting this backend cannot take (int4 with
  groups of 16, or ``out_features % 16 != 0``) is refused with the reasons
  :func:`unsupported_reason` gives, unless ``allow_slow_kernels=True``.
* rows: the kernels are built for decode. Prefill-sized batches (16 rows and more) lose to
  dense bf16 ``F.linear``, though all stay faster than the reference.

At decode both read fewer weight bytes than dense ``F.linear`` and run several times faster than
fp32 ``F.linear`` (int4 the most, near the copy bandwidth); the reference (dequantize per call)
is far slower. Every figure, with its command and machine: benchmarks/README.md, "CPU kernels
against the reference" (weight-only quantized linear).

Packed layouts (``PackedQuantWeight.tensors``; ``meta["kind"]`` is "int8" or "int4"):

* int8, per channel: ``qweight`` int8 [N, K]; ``scales`` bf16 [N];
  int8, grouped:     ``qweight`` int8 [n_groups, N, group]; ``scales`` bf16 [n_groups, N];
  asymmetric adds ``offsets`` float32 [n_groups, N] (``-zeros * scales``, transposed).
* int4: ``qweight`` uint8 (torch's CPU int4 layout for [N, K]); ``scales_and_zeros`` bf16
  [K / kernel_group, N, 2] (``[..., 0]`` scale, ``[..., 1]`` ``-zero * scale``, 0 when
  symmetric); ``meta["kernel_group"]`` is the sub-group size the kernel runs with.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from shardwise import _torch_private as private
from shardwise.errors import KernelError
from shardwise.kernels.reference import moe as ref_moe
from shardwise.kernels.reference.quant import (LANE_COLUMNS, UNSIGNED_OFFSET, PackedQuantExperts,
                                               PackedQuantWeight, QuantizedWeight,
                                               QuantLinearKernel, QuantMoEKernel, QuantSpec,
                                               activation_block, dequantize_weight,
                                               expert_spec, int8_activation_linear, int_weight,
                                               pack_int4)

from . import native

BACKEND = "cpu"
DEVICE_TYPES = frozenset({"cpu"})
#: Activation dtypes torch's packed kernels are claimed for (their fp32 paths are scalar).
DTYPES = frozenset({torch.bfloat16})
#: Activation dtypes the native kernel is claimed for: fp32 read in place (no casts), bf16.
NATIVE_DTYPES = frozenset({torch.bfloat16, torch.float32})
#: Group sizes ``_weight_int4pack_mm_for_cpu`` accepts, largest first.
INT4_KERNEL_GROUPS = (256, 128, 64, 32)
INT4_N_MULTIPLE = 16


def has_int8() -> bool:
    """Whether this torch has the packed int8 weight-only matmul."""
    return private.has_int8_mm()


def has_int4() -> bool:
    """Whether this torch has the CPU int4 packing and matmul."""
    return private.has_int4_mm()


def int4_kernel_group(group_size: int) -> int | None:
    """The largest kernel group size dividing ``group_size``, or None."""
    return next((g for g in INT4_KERNEL_GROUPS if group_size % g == 0), None)


def supports(*, device_type: str, dtype: torch.dtype | None, bits: int | None = None,
             group_size: int | None = None, in_features: int | None = None,
             out_features: int | None = None, **_shape: Any) -> bool:
    """Registry predicate (module docstring); needs the weight spec, refuses without it."""
    return unsupported_reason(device_type=device_type, dtype=dtype, bits=bits,
                              group_size=group_size, in_features=in_features,
                              out_features=out_features) is None


def unsupported_reason(*, device_type: str, dtype: torch.dtype | None, bits: int | None = None,
                       group_size: int | None = None, in_features: int | None = None,
                       out_features: int | None = None, native_kernel: bool = True,
                       **_shape: Any) -> str | None:
    """Why :func:`supports` refuses (None when it accepts), naming what it would take; without
    ``native_kernel``, by torch's packed kernels' rules only (what quantized experts run)."""
    if device_type not in DEVICE_TYPES:
        return f"it runs on {'/'.join(sorted(DEVICE_TYPES))} only, not {device_type}"
    if dtype not in (NATIVE_DTYPES if native_kernel else DTYPES):
        return _dtype_reason(dtype, NATIVE_DTYPES if native_kernel else DTYPES)
    if None in (bits, group_size, in_features, out_features):
        return "it needs the weight's spec (bits, group_size, in/out features) to decide"
    fits = bits in LANE_COLUMNS and activation_block(bits, group_size) is not None
    if native_kernel and fits and native.load():
        return None  # the native kernel: any N (padded to 16 rows), groups by its lane
    if dtype not in DTYPES:  # fp32: the native kernel only (torch's fp32 paths are scalar)
        why = (f"int{bits} in groups of {group_size} (no activation block divides them)"
               if native_kernel and native.load() else
               f"it does not run here ({native.ENV}=torch, or it did not build: see the log)")
        return f"{_dtype_reason(dtype, DTYPES)} where the native kernel cannot run: {why}"
    return _torch_kernels_reason(bits, group_size, out_features)


def _dtype_reason(dtype: torch.dtype | None, dtypes: frozenset) -> str:
    names = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    return f"it takes {names} activations only, not {str(dtype).removeprefix('torch.')}"


def _torch_kernels_reason(bits: int, group_size: int, out_features: int) -> str | None:
    """Why torch's packed kernels cannot run a weight of this spec (None when they can)."""
    if bits == 8:
        return None if has_int8() else "this torch has no aten._weight_int8pack_mm"
    if bits != 4:
        return f"it runs 8 or 4 bits, not {bits}"
    if not has_int4():
        return "this torch has no aten._weight_int4pack_mm_for_cpu"
    problems = []
    if int4_kernel_group(group_size) is None:
        sizes = ", ".join(map(str, reversed(INT4_KERNEL_GROUPS)))
        problems.append(f"a group size that is a multiple of 32 ({sizes}, ..., or per channel "
                        f"when in_features is one), not {group_size}")
    if out_features % INT4_N_MULTIPLE:
        problems.append(f"out_features divisible by {INT4_N_MULTIPLE}, not {out_features}")
    return ("int4 needs " + " and ".join(problems)) if problems else None


# ----- packing (once, at load) ------------------------------------------------------------------


def _convert_int4(u: torch.Tensor) -> torch.Tensor:
    """int32 [N, K] in 0..15 → torch's CPU int4 layout (a seam for tests to count packs)."""
    return private.int4_pack(u, 1)


def _offsets(qw: QuantizedWeight) -> torch.Tensor | None:
    """float32 [n_groups, N]: ``-zeros * scales`` (None when symmetric)."""
    return None if qw.zeros is None else (-qw.zeros * qw.scales).t().contiguous()


def _pack_int8(qw: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The int8 layouts of the module docstring (per channel, or group-major)."""
    n, groups, size = qw.out_features, qw.scales.shape[1], qw.group_size
    if groups == 1:
        tensors = {"qweight": qw.qweight.contiguous(),
                   "scales": qw.scales[:, 0].to(dtype).contiguous()}
    else:  # group-major: each group's [N, group] slice is one contiguous matrix
        tensors = {"qweight": qw.qweight.reshape(n, groups, size).transpose(0, 1).contiguous(),
                   "scales": qw.scales.t().to(dtype).contiguous()}
    offsets = _offsets(qw)
    if offsets is not None:
        tensors["offsets"] = offsets
    return tensors


def _pack_int4(qw: QuantizedWeight, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], int]:
    """torch's CPU int4 layout and its scales_and_zeros; returns (tensors, kernel group)."""
    kernel_group = int4_kernel_group(qw.group_size)
    repeat = qw.group_size // kernel_group
    u = int_weight(qw).to(torch.int32) + 8  # [N, K] in 0..15
    scales = qw.scales.repeat_interleave(repeat, dim=1)  # [N, K / kernel_group]
    zeros = torch.zeros_like(scales) if qw.zeros is None else \
        -qw.zeros.repeat_interleave(repeat, dim=1) * scales
    sz = torch.stack((scales, zeros), dim=-1).transpose(0, 1).to(dtype).contiguous()
    return {"qweight": _convert_int4(u.contiguous()), "scales_and_zeros": sz}, kernel_group


# ----- the native layout (module docstring) -----------------------------------------------------

#: Output rows per 64-byte weight vector of the native kernel.
NATIVE_ROWS = 16
#: Activation rows per chunk when the native kernel cannot run and the oracle stands in.
_ORACLE_ROWS = 16


def uses_native(spec: QuantSpec) -> bool:
    """Whether a weight of ``spec`` packs for the native kernel here: it builds (first call:
    :func:`shardwise.kernels.cpu.native.load`) and the group has an activation block."""
    return activation_block(spec.bits, spec.group_size) is not None and native.load()


def _row_blocks(t: torch.Tensor, pad: int) -> torch.Tensor:
    """float32 [N, G] → [Nb, G, 16] (``pad`` zero rows appended to make N a multiple of 16)."""
    t = torch.cat((t.float(), t.new_zeros(pad, t.shape[1], dtype=torch.float32)))
    blocks = t.reshape(-1, NATIVE_ROWS, t.shape[1]).transpose(1, 2)
    # a fresh tensor: .contiguous() keeps the transpose's stride on a size-1 dim (one group),
    # and a weight loaded from a checkpoint has the canonical one, so the compile cache would
    # key the two apart
    return torch.empty(blocks.shape, dtype=blocks.dtype, device=blocks.device).copy_(blocks)


def _pack_native(qw: QuantizedWeight) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The native layout of the module docstring and its meta. Made from the stored bytes, one
    4-byte lane (an int32) at a time, without unpacking them to one int per weight: the stored
    lanes are copied into their tiles (:func:`_tiled_words`), then made native in place
    (:func:`_native_words_`)."""
    n, bits = qw.out_features, qw.bits
    if sys.byteorder != "little":
        raise KernelError("the CPU backend's native packing reads 4 bytes as one little-endian "
                          "int32; this is a big-endian machine: set "
                          "SHARDWISE_CPU_QUANT_KERNEL=torch")
    pad = -n % NATIVE_ROWS
    stored = qw.qweight.to(torch.uint8 if bits == 4 else torch.int8).contiguous()
    words = _tiled_words(stored.view(n, -1, 4).view(torch.int32).view(n, -1))
    _native_words_(words, bits)
    if pad:
        words[-1, :, NATIVE_ROWS - pad:] = 0  # padding rows hold 0 bytes
    tensors = {"qweight": words.view(torch.uint8).view(*words.shape, 4),
               "scales": _row_blocks(qw.scales, pad)}
    if qw.zeros is not None:
        tensors["zeros"] = _row_blocks(qw.zeros, pad)
    return tensors, {"kind": "native", "ablock": activation_block(bits, qw.group_size)}


def _tiled_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [N, S] (a row's 4-byte lanes) → [Nb, S, 16]: tiles of 16 rows, lane-major (rows of
    the last tile past N are left unset)."""
    n, steps = words.shape
    out = torch.empty(-(-n // NATIVE_ROWS), steps, NATIVE_ROWS, dtype=torch.int32,
                      device=words.device)
    full = n // NATIVE_ROWS
    out[:full].copy_(words[:full * NATIVE_ROWS].view(full, NATIVE_ROWS, steps).transpose(1, 2))
    if full < out.shape[0]:
        out[full, :, :n - full * NATIVE_ROWS].copy_(words[full * NATIVE_ROWS:].t())
    return out


def _native_words_(words: torch.Tensor, bits: int) -> None:
    """Turn stored lanes (int32, little-endian bytes b0..b3) into native ones, in place.

    int8: ``q + 128`` is ``q``'s bits with the sign bit flipped. int4: the stored byte ``c``
    holds columns ``2c`` (low nibble) and ``2c + 1`` (high), so a stored lane's nibbles are
    columns 0..7 in order, and the native lane's byte ``j`` holds column ``j`` (low) and ``4 + j``
    (high): nibbles 0, 4, 1, 5, 2, 6, 3, 7, the perfect shuffle of the word's two halves, done
    as two delta swaps (nibbles 2-3 with 4-5, then 1 with 2 and 5 with 6)."""
    if bits == 8:
        words.bitwise_xor_(0x80808080 - (1 << 32))  # 0x80 in every byte, as an int32
        return
    for shift, mask in ((8, 0x0000FF00), (4, 0x00F000F0)):
        t = (words >> shift).bitwise_xor_(words).bitwise_and_(mask)  # the swapped bits' xor
        words.bitwise_xor_(t).bitwise_xor_(t.bitwise_left_shift_(shift))


def _from_row_blocks(t: torch.Tensor, n: int) -> torch.Tensor:
    """[Nb, G, 16] → [N, G] (padding dropped)."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:n].contiguous()


def unpack_native(packed: PackedQuantWeight) -> QuantizedWeight:
    """The :class:`QuantizedWeight` a natively packed weight holds (exact inverse of the
    packing)."""
    t, spec = packed.tensors, packed.spec
    n, k = spec.out_features, spec.in_features
    w = t["qweight"].transpose(1, 2)  # [Nb, 16, K / L, 4]
    if spec.bits == 4:
        w = torch.stack((w & 0x0F, w >> 4), dim=-2)  # [Nb, 16, K / 8, 2, 4]
    u = w.reshape(-1, k)[:n]
    q = (u.to(torch.int16) - UNSIGNED_OFFSET[spec.bits]).to(torch.int8)
    zeros = _from_row_blocks(t["zeros"], n) if "zeros" in t else None
    return QuantizedWeight(pack_int4(q) if spec.bits == 4 else q,
                           _from_row_blocks(t["scales"], n), zeros, spec.bits, spec.group_size)


def _native_ready() -> bool:
    """Whether the native op is loaded (built on the first eager call; a compiled step reads
    the answer the eager warm-up left)."""
    if torch.compiler.is_compiling():
        return native.LOADED
    return native.load(respect_choice=False)


def _native_linear(x2: torch.Tensor, packed: PackedQuantWeight,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, K] times a natively packed weight (+ bias) → [M, N] in x2.dtype: the native op,
    or (where it cannot be built, e.g. a saved checkpoint loaded elsewhere) its oracle."""
    t, spec, ablock = packed.tensors, packed.spec, packed.meta["ablock"]
    if _native_ready():
        return native.cpu_qlinear(x2, t["qweight"], t["scales"], t.get("zeros"), bias,
                                  spec.bits, spec.group_size, ablock, spec.out_features)
    qw = unpack_native(packed)
    return torch.cat([int8_activation_linear(x2[i:i + _ORACLE_ROWS], qw, ablock, bias)
                      for i in range(0, x2.shape[0], _ORACLE_ROWS)])


# ----- the matmuls (per call) -------------------------------------------------------------------


def _grouped_int8mm(x2: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] with q [G, N, group], scales [G, N] → float32 [M, N], one call per group."""
    size = q.shape[2]
    out = torch.zeros(x2.shape[0], q.shape[1], dtype=torch.float32, device=x2.device)
    for g in range(q.shape[0]):
        out += private.int8_mm(x2[:, g * size:(g + 1) * size], q[g], scales[g])
    return out


def _epilogue(y: torch.Tensor, x2: torch.Tensor, offsets: torch.Tensor | None,
              bias: torch.Tensor | None) -> torch.Tensor:
    """y [M, N] (+ group sums of x2 @ offsets [G, N]) (+ bias), in float32, → x2.dtype."""
    if offsets is None and bias is None:
        return y.to(x2.dtype)
    y = y.float()
    if offsets is not None:
        sums = x2.float().reshape(x2.shape[0], offsets.shape[0], -1).sum(-1)  # [M, G]
        y = y.addmm_(sums, offsets)
    if bias is not None:
        y = y.add_(bias.float())
    return y.to(x2.dtype)


#: ``meta["kind"]`` → (tensor → the dimension its output rows run along, counted from the end;
#: output rows per index): native ``qweight`` [Nb, K / L, 16, 4], ``scales``/``zeros``
#: [Nb, G, 16] (16 rows per block); int8 ``qweight`` [N, K] or [G, N, group], ``scales`` [N] or
#: [G, N], ``offsets`` [G, N]. torch's int4 layout is opaque: not listed.
_ROW_DIMS: dict[str, tuple[dict[str, int], int]] = {
    "native": ({"qweight": -4, "scales": -3, "zeros": -3}, NATIVE_ROWS),
    "int8": ({"qweight": -2, "scales": -1, "offsets": -1}, 1),
}


class CpuQuantLinear(QuantLinearKernel):
    """``quant_linear`` with the native kernel where it builds, else torch's packed CPU kernels
    (module docstring); the layout is chosen at ``prepack`` (``meta["kind"]``)."""

    backend = BACKEND

    def supports(self, **kwargs) -> bool:
        return supports(**kwargs)

    def unsupported_reason(self, **kwargs) -> str | None:
        return unsupported_reason(**kwargs)

    def oracle(self, packed: PackedQuantWeight):
        """A natively packed weight's math (8-bit activations): ``int8_activation_linear``."""
        if packed.meta.get("kind") != "native":
            return None

        def native_math(x, packed, bias=None):  # x [..., K] → [..., N] in x.dtype
            y = int8_activation_linear(x.reshape(-1, packed.spec.in_features),
                                       unpack_native(packed), packed.meta["ablock"], bias)
            return y.reshape(*x.shape[:-1], packed.spec.out_features)
        return native_math

    def row_dims(self, meta: dict[str, Any]) -> tuple[dict[str, int], int] | None:
        """Where this layout's tensors stack their output rows (tensor → dimension from the
        end; rows per index), for concatenating weights along N
        (:func:`shardwise.quant.modules.quant_row_dims`); None for torch's opaque int4 layout."""
        return _ROW_DIMS.get(meta.get("kind"))

    def prepare(self, meta: dict[str, Any]) -> None:
        """Build or load the native op for a natively packed weight now, not at the first eager
        call: a decode step captured before any eager call (an engine loaded from a checkpoint)
        would otherwise trace the oracle, many times slower, into its graph."""
        if meta.get("kind") == "native":
            native.load(respect_choice=False)

    def _pack(self, qw: QuantizedWeight, device: torch.device, dtype: torch.dtype):
        qw = qw.to(device)
        if uses_native(qw.spec):
            return _pack_native(qw)
        if qw.bits == 8:
            return _pack_int8(qw, dtype), {"kind": "int8"}
        tensors, kernel_group = _pack_int4(qw, dtype)
        return tensors, {"kind": "int4", "kernel_group": kernel_group}

    def _linear(self, x2: torch.Tensor, packed: PackedQuantWeight,
                bias: torch.Tensor | None) -> torch.Tensor:
        x2, t = x2.contiguous(), packed.tensors
        if packed.meta["kind"] == "native":
            return _native_linear(x2, packed, bias)
        if packed.meta["kind"] == "int4":
            y = private.int4_mm(x2, t["qweight"], packed.meta["kernel_group"],
                                t["scales_and_zeros"])
            return _epilogue(y, x2, None, bias)
        if t["qweight"].dim() == 2:
            y = private.int8_mm(x2, t["qweight"], t["scales"])
        else:
            y = _grouped_int8mm(x2, t["qweight"], t["scales"])
        return _epilogue(y, x2, t.get("offsets"), bias)


#: The implementation the registry hands out: ``quant_linear(x, packed, bias)`` + ``.prepack``.
quant_linear = CpuQuantLinear()


# ----- quantized experts: quant_moe_mlp ---------------------------------------------------------


def _expert_mm(x2: torch.Tensor, q: torch.Tensor, s: torch.Tensor, offsets: torch.Tensor | None,
               bits: int, kernel_group: int) -> torch.Tensor:
    """x2 [M, K] (contiguous, bf16) times ONE expert's packed matrix → [M, N] in x2.dtype:
    ``quant_linear``'s three layouts (int8 per channel, int8 group-major, int4)."""
    if bits == 4:
        return private.int4_mm(x2, q, kernel_group, s)
    y = private.int8_mm(x2, q, s) if q.dim() == 2 else _grouped_int8mm(x2, q, s)
    return _epilogue(y, x2, offsets, None)


def _hit_experts_mlp(x, experts, weights, gu, dn, bits, gu_group, dn_group, activation, clamp,
                     alpha, gu_bias, dn_bias) -> torch.Tensor:
    """The routed experts' output [T, H]: the T*k slots sorted by expert (stable), then for each
    expert that got slots, its two packed matmuls on those rows only (views of its weights: the
    bytes read are those of the experts hit, each once) and a weighted ``index_add_`` into the
    tokens. Slots of expert ``E`` (another rank's) sort last and are never computed. ``gu`` /
    ``dn``: (qweight, scales, offsets or None), each with a leading [E]."""
    t, k = experts.shape
    n_experts = gu[0].shape[0]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T*k]
    counts = torch.bincount(flat, minlength=n_experts + 1).tolist()  # host ints
    if len(counts) > n_experts + 1:  # past the sentinel: the reference refuses them too
        raise KernelError(f"expert indices must be in 0..{n_experts} ({n_experts}: another "
                          f"rank's expert), got {len(counts) - 1}")
    counts = counts[:n_experts]
    tokens = order // k  # the token of each sorted slot
    slot_weights = weights.reshape(-1)[order].float()
    xs = x[tokens]  # [T*k, H]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        rows = slice(start, start + n)
        start += n
        off = gu[2][e] if gu[2] is not None else None
        h = _expert_mm(xs[rows], gu[0][e], gu[1][e], off, bits, gu_group)  # [n, 2I]
        h = h.float() if gu_bias is None else h.float() + gu_bias[e].float()
        a = ref_moe.glu(h, activation, clamp, alpha).to(x.dtype)  # [n, I]
        off = dn[2][e] if dn[2] is not None else None
        y = _expert_mm(a, dn[0][e], dn[1][e], off, bits, dn_group).float()  # [n, H]
        if dn_bias is not None:
            y = y + dn_bias[e].float()
        out.index_add_(0, tokens[rows], y * slot_weights[rows, None])
    return out.to(x.dtype)


@torch.library.custom_op("shardwise::cpu_quant_moe_mlp", mutates_args=(), device_types="cpu")
def _quant_moe_op(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                  gu_q: torch.Tensor, gu_s: torch.Tensor, gu_off: torch.Tensor | None,
                  dn_q: torch.Tensor, dn_s: torch.Tensor, dn_off: torch.Tensor | None,
                  bits: int, gu_group: int, dn_group: int, activation: str,
                  clamp: float | None, alpha: float, gu_bias: torch.Tensor | None,
                  dn_bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`_hit_experts_mlp` as an op the compiler calls without tracing into it."""
    return _hit_experts_mlp(x, experts, weights, (gu_q, gu_s, gu_off), (dn_q, dn_s, dn_off),
                            bits, gu_group, dn_group, activation, clamp, alpha, gu_bias, dn_bias)


@_quant_moe_op.register_fake
def _(x, experts, weights, gu_q, gu_s, gu_off, dn_q, dn_s, dn_off, bits, gu_group, dn_group,
      activation, clamp, alpha, gu_bias, dn_bias):
    return x.new_empty(x.shape)  # [T, H], as the real op returns


class TorchQuantMoE(QuantMoEKernel):
    """``quant_moe_mlp`` on torch's packed CPU kernels (bf16 activations): what
    :class:`CpuQuantMoE` runs where the native kernel does not.

    Layout (``PackedQuantExperts.tensors``, each stacked over the E experts): ``quant_linear``'s
    per expert — int8 per channel ``qweight`` int8 [E, N, K], ``scales`` bf16 [E, N]; int8
    grouped ``qweight`` int8 [E, G, N, group], ``scales`` bf16 [E, G, N]; asymmetric int8 adds
    ``offsets`` float32 [E, G, N]; int4 ``qweight`` uint8 [E, ...] (torch's CPU int4 layout per
    expert), ``scales_and_zeros`` bf16 [E, K / kernel_group, N, 2], ``meta["kernel_group"]``.

    The call (:func:`_hit_experts_mlp`) reads the routing on the host (one ``tolist`` of E
    counts per layer) and runs each hit expert's two matmuls on views of its packed weights, so
    the bytes read are the hit experts' only, never a gathered copy. On CPU that read is of host
    memory, not a device synchronisation; under ``torch.compile`` (the CPU graph strategy's
    captured decode step) the call is one opaque custom op with a static output shape [T, H],
    so the captured step calls it as it is (``capturable``), as ``attention_decode`` does.
    Activations, GPT-OSS's biases and clamp are applied in float32 between the two matmuls;
    the intermediate is rounded to bf16 for the down matmul (as the dense bf16 experts do).
    """

    backend = BACKEND

    def unsupported_reason(self, *, device_type: str, dtype: torch.dtype | None,
                           specs=None, **_shape: Any) -> str | None:
        if not specs:
            return "it needs the experts' weight specs (specs=(gate_up, down)) to decide"
        for spec in specs:
            reason = unsupported_reason(device_type=device_type, dtype=dtype,
                                        native_kernel=False, **spec.as_shape())  # torch's
            if reason is not None:
                return reason
        return None

    def _pack(self, qw: QuantizedWeight, experts: int, dtype: torch.dtype):
        n = qw.out_features // experts
        if qw.bits == 8:
            per_expert = [_pack_int8(ref_moe.expert_rows(qw, e, n), dtype) for e in range(experts)]
            meta = {"kind": "int8", "kernel_group": qw.group_size}
        else:
            packs = [_pack_int4(ref_moe.expert_rows(qw, e, n), dtype) for e in range(experts)]
            per_expert = [tensors for tensors, _ in packs]
            meta = {"kind": "int4", "kernel_group": packs[0][1]}
        return {name: torch.stack([p[name] for p in per_expert])
                for name in per_expert[0]}, meta

    def dequantize(self, packed: PackedQuantExperts) -> torch.Tensor:
        """float32 [E, N, K] as the kernel computes with it: int8 exactly (bf16 scales), int4
        by running each expert's kernel on the identity (its layout is opaque; a K x K x N
        product per expert: for giving a model back, not per step)."""
        t, spec, e = packed.tensors, packed.spec, packed.experts
        n, k = spec.out_features, spec.in_features
        if packed.meta["kind"] == "int4":
            eye = torch.eye(k, dtype=packed.dtype or torch.bfloat16, device=t["qweight"].device)
            return torch.stack([
                private.int4_mm(eye, t["qweight"][i], packed.meta["kernel_group"],
                                t["scales_and_zeros"][i]).float().t() for i in range(e)])
        q, scales = t["qweight"].float(), t["scales"].float()
        if q.dim() == 3:  # per channel [E, N, K]
            return q * scales[..., None]
        w = q * scales[..., None]  # [E, G, N, group]
        if "offsets" in t:
            w = w + t["offsets"][..., None]
        return w.permute(0, 2, 1, 3).reshape(e, n, k)

    def _mlp(self, x, gate_up, down, experts, weights, activation, gate_up_bias, down_bias,
             clamp, alpha) -> torch.Tensor:
        gu, dn = gate_up.tensors, down.tensors
        sz = "scales_and_zeros" if gate_up.meta["kind"] == "int4" else "scales"
        args = (x.contiguous(), experts, weights, gu["qweight"], gu[sz], gu.get("offsets"),
                dn["qweight"], dn[sz], dn.get("offsets"), gate_up.spec.bits,
                gate_up.meta["kernel_group"], down.meta["kernel_group"], activation, clamp,
                alpha, gate_up_bias, down_bias)
        if torch.compiler.is_compiling():
            return torch.ops.shardwise.cpu_quant_moe_mlp(*args)
        return _hit_experts_mlp(args[0], experts, weights, args[3:6], args[6:9], *args[9:])


#: torch's packed kernels' ``quant_moe_mlp(x, gate_up, down, experts, weights, ...)`` +
#: ``.prepack``
torch_quant_moe_mlp = TorchQuantMoE()


# ----- quantized experts: quant_moe_mlp on the native int8/int4 kernel --------------------------

#: the native layout's kind (``PackedQuantExperts.meta["kind"]``)
NATIVE = "native"


def native_reason(specs) -> str | None:
    """Why the native kernel cannot run the experts' (gate_up, down) specs here (None: it can):
    it does not build (or ``SHARDWISE_CPU_QUANT_KERNEL=torch``), or a matrix's group has no
    activation block (:func:`~shardwise.kernels.reference.quant.activation_block`)."""
    if not native.load():
        return "the native kernel is not in use here (its log line says why)"
    blocked = [s for s in specs if not uses_native(s)]
    if not blocked:
        return None
    return (f"the native kernel needs a group size with an activation block (a multiple of "
            f"{LANE_COLUMNS.get(blocked[0].bits, '?')} at int{blocked[0].bits}), not "
            f"{blocked[0].group_size}")


def _packed_expert(packed: PackedQuantExperts, e: int) -> PackedQuantWeight:
    """Expert ``e`` of natively packed experts as ``quant_linear``'s packed weight (views)."""
    return PackedQuantWeight(BACKEND, packed.spec, packed.dtype, packed.expert(e), packed.meta)


def _stacked_weight(packed: PackedQuantExperts) -> QuantizedWeight:
    """The stacked ``[E * N, K]`` :class:`QuantizedWeight` natively packed experts hold."""
    parts = [unpack_native(_packed_expert(packed, e)) for e in range(packed.experts)]
    zeros = torch.cat([p.zeros for p in parts]) if parts[0].zeros is not None else None
    return QuantizedWeight(torch.cat([p.qweight for p in parts]),
                           torch.cat([p.scales for p in parts]), zeros, packed.spec.bits,
                           packed.spec.group_size)


def _expert_native_linear(x: torch.Tensor, q, s, z, bias, e: int, bits: int, group: int,
                          ablock: int, n: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) times expert ``e``'s natively packed matrix (+ its bias row)
    → [M, n] float32: one call of the native op over the expert's contiguous bytes."""
    return native.cpu_qlinear(x, q[e], s[e], z[e] if z is not None else None,
                              bias[e] if bias is not None else None, bits, group, ablock, n)


def native_quant_mlp(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     gu_q: torch.Tensor, gu_s: torch.Tensor, gu_z: torch.Tensor | None,
                     dn_q: torch.Tensor, dn_s: torch.Tensor, dn_z: torch.Tensor | None,
                     bits: int, gu_group: int, gu_ablock: int, dn_group: int, dn_ablock: int,
                     activation: str, clamp: float | None, alpha: float,
                     gu_bias: torch.Tensor | None, dn_bias: torch.Tensor | None) -> torch.Tensor:
    """The routed experts' output [T, H] in x.dtype on natively packed experts (layout:
    :class:`CpuQuantMoE`), eager: the activations in float32 (x converted once), each expert
    matrix one call of the native op (activations quantized to int8 per block inside it).

    * one token (decode, batch 1): each of its k slots' experts run on the token as it is —
      no sort; each expert's two matrices are one contiguous stream each;
    * more tokens: the T*k slots sorted by expert (stable) and each hit expert's two matrices
      run once over its slots' rows (up to 8 rows share each loaded weight vector), the
      weighted rows added into their tokens.

    Slots of expert E (another rank's) are never computed. Reads the routing on the host (the
    expert ids of one token, or E + 1 counts): host memory on CPU, no device sync; under
    ``torch.compile`` this runs as one opaque op."""
    t, k = experts.shape
    n_experts, hidden = gu_q.shape[0], x.shape[1]
    inter = dn_q.shape[2] * LANE_COLUMNS[bits]  # K of down
    gu = (gu_q, gu_s, gu_z, gu_bias)
    dn = (dn_q, dn_s, dn_z, dn_bias)
    xf = x.float().contiguous()  # [T, H]
    out = torch.zeros(t, hidden, dtype=torch.float32, device=x.device)

    def mlp(rows: torch.Tensor, e: int) -> torch.Tensor:  # [M, H] float32 → [M, H] float32
        h = _expert_native_linear(rows, *gu, e, bits, gu_group, gu_ablock, 2 * inter)  # [M, 2I]
        a = ref_moe.glu(h, activation, clamp, alpha).contiguous()  # [M, I] float32
        return _expert_native_linear(a, *dn, e, bits, dn_group, dn_ablock, hidden)  # [M, H]

    if t == 1:
        ids = experts[0].tolist()
        _check_ids(max(ids), n_experts)
        for j, e in enumerate(ids):
            if e < n_experts:
                out.add_(mlp(xf, e) * weights[0, j].float())
        return out.to(x.dtype)
    flat = experts.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k]: slots by expert, the sentinel's last
    counts = torch.bincount(flat, minlength=n_experts + 1).tolist()  # host ints
    _check_ids(len(counts) - 1, n_experts)
    tokens = order // k  # [T*k]: each sorted slot's token
    slot_weights = weights.reshape(-1)[order].float()  # [T*k]
    xs = xf[tokens]  # [T*k, H]
    start = 0
    for e, n in enumerate(counts[:n_experts]):
        if n:
            rows = slice(start, start + n)
            out.index_add_(0, tokens[rows], mlp(xs[rows], e) * slot_weights[rows, None])
            start += n
    return out.to(x.dtype)


def _check_ids(highest: int, n_experts: int) -> None:
    if highest > n_experts:  # past the sentinel: the reference refuses them too
        raise KernelError(f"expert indices must be in 0..{n_experts} ({n_experts}: another "
                          f"rank's expert), got {highest}")


@torch.library.custom_op("shardwise::cpu_native_quant_moe_mlp", mutates_args=(),
                         device_types="cpu")
def _native_quant_moe_op(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                         gu_q: torch.Tensor, gu_s: torch.Tensor, gu_z: torch.Tensor | None,
                         dn_q: torch.Tensor, dn_s: torch.Tensor, dn_z: torch.Tensor | None,
                         bits: int, gu_group: int, gu_ablock: int, dn_group: int,
                         dn_ablock: int, activation: str, clamp: float | None, alpha: float,
                         gu_bias: torch.Tensor | None,
                         dn_bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`native_quant_mlp` as an op the compiled decode step calls without tracing it."""
    return native_quant_mlp(x, experts, weights, gu_q, gu_s, gu_z, dn_q, dn_s, dn_z, bits,
                            gu_group, gu_ablock, dn_group, dn_ablock, activation, clamp, alpha,
                            gu_bias, dn_bias)


@_native_quant_moe_op.register_fake
def _(x, experts, weights, *rest):
    return x.new_empty(x.shape)  # [T, H] in x.dtype, as the real op returns


class CpuQuantMoE(QuantMoEKernel):
    """``quant_moe_mlp`` on CPU: the native AVX512-VNNI int8/int4 kernel where it runs (the
    one dense ``quant_linear`` runs: :mod:`shardwise.kernels.cpu.quant`), else torch's packed
    weight-only kernels (:data:`torch_quant_moe_mlp`, their rules).

    **Numerics (native)**: as the native linears, the activations entering each expert matrix
    are quantized to int8 per block of 16 (8-bit) / 32 (4-bit) columns (``amax / 127``
    scales): the token for gate_up, the float32 GLU output for down. The oracle is that math
    in torch: :func:`shardwise.kernels.reference.moe.int8_activation_moe_mlp` (:meth:`oracle`); the
    weight-only reference differs from it by the activations' rounding.

    Input dtypes: registered for bf16 (what the quantizer resolves with, as ``quant_linear``),
    but natively packed experts take float32 / bf16 / fp16 as they are (``dtype`` None), so an
    fp32 model's experts skip the bf16 round trip torch's kernels need.

    Native layout (``meta["kind"] == "native"``, ``meta["ablock"]`` the activation block):
    each expert's matrix in ``quant_linear``'s native layout, stacked — ``qweight`` uint8
    ``[E, Nb, K / L, 16, 4]``, ``scales`` float32 ``[E, Nb, G, 16]`` (+ ``zeros`` alike when
    asymmetric), ``Nb = ceil(N / 16)`` (rows padded per expert), so expert ``e``'s bytes are
    one contiguous block. Which experts run how: :func:`native_quant_mlp` (one token: per
    slot, no sort; more: sorted, per hit expert); under ``torch.compile`` (the CPU graph
    strategy's captured decode step) it is one opaque custom op (``capturable``).

    Both matrices of a layer must run on the same kernel: where the native kernel runs but a
    group of one of them has no activation block, the layer is refused by name (with torch's
    kernels' reasons where they refuse too)."""

    backend = BACKEND

    def unsupported_reason(self, *, device_type: str, dtype: torch.dtype | None,
                           specs=None, **_shape) -> str | None:
        if not specs:
            return "it needs the experts' weight specs (specs=(gate_up, down)) to decide"
        if device_type not in DEVICE_TYPES or dtype not in DTYPES:
            return torch_quant_moe_mlp.unsupported_reason(device_type=device_type,
                                                              dtype=dtype, specs=specs)
        why_not_native = native_reason(specs)
        if why_not_native is None:
            return None
        if native.load() and any(uses_native(s) for s in specs):
            return f"{why_not_native} (both expert matrices must run on one kernel)"
        return torch_quant_moe_mlp.unsupported_reason(device_type=device_type, dtype=dtype,
                                                          specs=specs)

    def prepack(self, qw: QuantizedWeight, experts: int,
                device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> PackedQuantExperts:
        """The native layout (class docstring) where the native kernel takes this spec, else
        torch's packed kernels' layout (theirs, ``meta["kind"]`` int8/int4, for ``dtype``).
        The native layout is packed for any input dtype (``dtype`` None): float32, bf16 and
        fp16 activations go in as they are (each is quantized to int8 from float32 inside), so
        an fp32 model's experts take its fp32 activations, not a bf16 rounding of them."""
        if not uses_native(expert_spec(qw, experts)):
            return torch_quant_moe_mlp.prepack(qw, experts, device, dtype)
        return dataclasses.replace(super().prepack(qw, experts, device, dtype), dtype=None)

    def _pack(self, qw: QuantizedWeight, experts: int, dtype: torch.dtype | None):
        n = qw.out_features // experts
        packs = [quant_linear.prepack(ref_moe.expert_rows(qw, e, n), qw.qweight.device,
                                                torch.bfloat16)  # the layout is dtype-free
                 for e in range(experts)]
        if packs[0].meta.get("kind") != NATIVE:
            raise KernelError("quant_moe_mlp (cpu): quant_linear packed an expert in the "
                              f"{packs[0].meta.get('kind')!r} layout, not the native one")
        tensors = {name: torch.stack([p.tensors[name] for p in packs])
                   for name in packs[0].tensors}
        return tensors, dict(packs[0].meta)

    def dequantize(self, packed: PackedQuantExperts) -> torch.Tensor:
        """float32 [E, N, K]: the weights the kernel computes with (exact)."""
        if packed.meta.get("kind") != NATIVE:
            return torch_quant_moe_mlp.dequantize(packed)
        return dequantize_weight(_stacked_weight(packed)).reshape(
            packed.experts, packed.spec.out_features, packed.spec.in_features)

    def oracle(self, gate_up: PackedQuantExperts, down: PackedQuantExperts):
        """The math this kernel computes on these packed experts, in torch, as a callable with
        this op's signature (native: :func:`~shardwise.kernels.reference.moe.
        int8_activation_moe_mlp`); None where it is the weight-only reference's (torch's
        kernels)."""
        if gate_up.meta.get("kind") != NATIVE:
            return None
        blocks = (gate_up.meta["ablock"], down.meta["ablock"])

        def native_math(x, gate_up, down, experts, weights, **kwargs):
            return ref_moe.int8_activation_moe_mlp(x, _stacked_weight(gate_up),
                                               _stacked_weight(down), experts, weights, blocks,
                                               **kwargs)
        return native_math

    def _mlp(self, x, gate_up, down, experts, weights, activation, gate_up_bias, down_bias,
             clamp, alpha) -> torch.Tensor:
        kinds = (gate_up.meta.get("kind"), down.meta.get("kind"))
        if NATIVE not in kinds:  # torch's packed kernels
            return torch_quant_moe_mlp(x, gate_up, down, experts, weights,
                                           activation=activation, gate_up_bias=gate_up_bias,
                                           down_bias=down_bias, clamp=clamp, alpha=alpha)
        if kinds != (NATIVE, NATIVE):
            raise KernelError(f"quant_moe_mlp (cpu): gate_up packed {kinds[0]!r}, down "
                              f"{kinds[1]!r}: pack both for one kernel")
        gu, dn = gate_up.tensors, down.tensors
        args = (x.contiguous(), experts, weights, gu["qweight"], gu["scales"], gu.get("zeros"),
                dn["qweight"], dn["scales"], dn.get("zeros"), gate_up.spec.bits,
                gate_up.spec.group_size, gate_up.meta["ablock"], down.spec.group_size,
                down.meta["ablock"], activation, clamp, alpha, gate_up_bias, down_bias)
        if torch.compiler.is_compiling():
            return torch.ops.shardwise.cpu_native_quant_moe_mlp(*args)
        native.load(respect_choice=False)
        return native_quant_mlp(*args)


#: ``quant_moe_mlp(x, gate_up, down, experts, weights, ...)`` + ``.prepack`` / ``.oracle``
quant_moe_mlp = CpuQuantMoE()



def register(registry) -> None:
    """Register ``quant_linear`` (bf16 CPU tensors; fp32 too where the native kernel runs:
    :func:`supports` decides) and ``quant_moe_mlp`` (bf16, capturable: :class:`CpuQuantMoE`,
    the native kernel, else torch's) when torch has the packed kernels."""
    if has_int8() or has_int4():
        registry.register("quant_linear", BACKEND, quant_linear, dtypes=NATIVE_DTYPES,
                          device_types=DEVICE_TYPES, supports=supports)
        registry.register("quant_moe_mlp", BACKEND, quant_moe_mlp, dtypes=DTYPES,
                          device_types=DEVICE_TYPES, supports=quant_moe_mlp.supports,
                          capturable=True)

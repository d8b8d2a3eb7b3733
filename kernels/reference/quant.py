"""Weight-only quantization (reference): the format, its packing, and ``quant_linear``.

Format (int8 and int4, group-wise, symmetric or asymmetric; activations stay in the compute dtype)
--------------------------------------------------------------------------------------------------
A float weight ``w [out, in]`` (``F.linear`` layout) is cut along ``in`` into groups of
``group_size`` consecutive columns (``group_size == in`` is per output channel). Each
(output row, group) has an fp32 ``scale`` and, when asymmetric, an fp32 ``zero``; every weight
becomes a signed integer ``q`` in ``[-2**(bits-1), 2**(bits-1) - 1]`` and is read back as

    w ≈ (q - zero) * scale                    (zero = 0 when symmetric)

* symmetric, 8 bits: ``scale = amax / 127``, ``q = round(w / scale)`` in ``[-127, 127]`` (-128
  unused), nothing clipped.
* symmetric, 4 bits: the scale is searched per group (:func:`_searched_scales`, as llama.cpp's
  k-quants choose theirs): candidates map the group's largest-magnitude value ``m`` near
  ``-8`` (``scale = m / -(8 + step)``: Q4_0's choice is step 0, which uses all 16 levels where
  ``amax / 7`` leaves -8 unused; by default the only candidate), each gets its least-squares
  scale for its codes, and the one with the smallest ``w²``-weighted squared error wins;
  ``q = clamp(round(w / scale), -8, 7)``.
  The scale may be negative (so that ``m`` of either sign reaches -8) and a value may be
  clipped by up to a fraction of a step. Dequantization is unchanged: ``q * scale``.
* asymmetric: ``scale = (max - min) / (2**bits - 1)``, ``zero = qmin - min / scale`` and
  ``q = round(w / scale + zero)``: min maps to ``qmin`` and max to ``qmax`` exactly. ``zero`` is a
  float in the integer domain (it may be fractional and lie outside the q range, e.g. for an
  all-positive group); an integer zero point from a GPTQ/AWQ checkpoint is the special case of an
  integral value, so those load without loss.

8-bit and asymmetric: ``|w - dequantized| <= |scale| / 2`` (round to nearest), up to float32
rounding; symmetric 4-bit trades a little clipping of the extremes for a smaller error overall.

Storage (:class:`QuantizedWeight`):

* ``qweight``: bits 8 → ``int8 [out, in]`` holding ``q``;
  bits 4 → ``uint8 [out, in // 2]``, two weights per byte holding ``q + 8`` (0..15):
  **byte ``[n, j]`` = column ``2j`` in the low nibble (bits 0-3) | column ``2j + 1`` in the high
  nibble (bits 4-7)**. ``in`` must be even for 4 bits.
* ``scales``: ``float32 [out, in // group_size]``; ``zeros``: ``float32 [out, in // group_size]``
  or ``None`` (symmetric).

The ``quant_linear`` op and its prepack contract
------------------------------------------------
Backends need their own weight layouts, made once at load and never per call. So the op's
implementation (``impl.fn`` of the resolved :class:`~shardwise.kernel_registry.KernelImpl`) is a
:class:`QuantLinearKernel`: a callable with a ``prepack`` method, and both halves come from the
same resolution, so a model always packs with the backend it runs::

    impl = registry.resolve("quant_linear", accelerator, dtype, **qw.spec.as_shape())
    packed = impl.fn.prepack(qw, device, dtype)   # once, at load (PackedQuantWeight)
    y = impl(x, packed, bias)                      # per call: x [..., in] -> y [..., out]

Backends claim a weight only when resolution is told its spec (bits, group_size, symmetric,
in_features, out_features); without it they refuse and the reference is chosen. Calling a kernel
with a weight packed by another backend, or with x in another dtype than it was packed for, is a
:class:`~shardwise.KernelError`. The reference's packed form holds the :class:`QuantizedWeight`'s
own tensors, and its ``quant_linear`` dequantizes then runs ``F.linear`` in ``x.dtype``.

Quantized experts: ``quant_moe_mlp``
------------------------------------
A Mixture-of-Experts layer's stacked expert weights ``[E, N, K]`` quantize as the linear
``[E * N, K]`` (:func:`quantize_experts`: every expert row its own scales) and are packed once per
backend into a :class:`PackedQuantExperts` (``QuantMoEKernel.prepack(qw, E, device, dtype)``);
``quant_moe_mlp(x, gate_up, down, experts, weights, ...)`` is ``moe_grouped_mlp``'s contract
(``shardwise.kernels.reference.moe``) over them, an expert index ``E`` marking another rank's
expert (it contributes nothing). Resolution takes ``specs=(gate_up_spec, down_spec)``. The
reference dequantizes every expert per call (the oracle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from shardwise.errors import KernelError

from . import moe
from .example import Example

BACKEND = "reference"
ALLOWED_BITS = (4, 8)


class QuantizationError(KernelError, ValueError):
    """A weight cannot be quantized as asked (bad bits, group size, shape or values)."""


# ----- format ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantSpec:
    """What a quantized weight is: enough for a backend to say whether it can run it."""

    bits: int
    group_size: int  # == in_features for per-output-channel scales
    symmetric: bool
    in_features: int
    out_features: int

    @property
    def n_groups(self) -> int:
        """Groups per output row: ``in_features // group_size``."""
        return self.in_features // self.group_size

    def as_shape(self) -> dict[str, Any]:
        """Keyword arguments for ``registry.resolve("quant_linear", ...)``."""
        return dict(bits=self.bits, group_size=self.group_size, symmetric=self.symmetric,
                    in_features=self.in_features, out_features=self.out_features)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A quantized ``[out, in]`` weight in the reference format (module docstring).

    qweight: int8 [out, in] (8 bits) or uint8 [out, in // 2] (4 bits, low nibble = even column);
    scales: float32 [out, n_groups]; zeros: float32 [out, n_groups] or None (symmetric).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * self.group_size

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec(self.bits, self.group_size, self.symmetric, self.in_features,
                         self.out_features)

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        """The same weight with every tensor on ``device``."""
        zeros = self.zeros.to(device) if self.zeros is not None else None
        return QuantizedWeight(self.qweight.to(device), self.scales.to(device), zeros, self.bits,
                               self.group_size)


@dataclass(frozen=True, eq=False)
class PackedQuantWeight:
    """A weight in one backend's layout, made once by ``QuantLinearKernel.prepack``.

    backend: the backend whose ``quant_linear`` consumes it; spec: the weight it holds; dtype: the
    compute dtype (x.dtype) it was packed for, None when any; tensors: the backend's layout, named
    and described in that backend's module; meta: non-tensor settings of that layout.
    """

    backend: str
    spec: QuantSpec
    dtype: torch.dtype | None
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed tensors (what a GEMV reads per call)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _qrange(bits: int) -> tuple[int, int]:
    """(qmin, qmax) of the signed ``bits``-bit integers."""
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def _check_args(w: torch.Tensor, bits: int, group_size: int | None) -> int:
    """Validate quantize_weight's arguments; returns the group size (in_features when per
    channel)."""
    if bits not in ALLOWED_BITS:
        raise QuantizationError(f"bits must be one of {ALLOWED_BITS}, got {bits!r}")
    if w.dim() != 2 or not w.is_floating_point():
        raise QuantizationError(f"expected a float weight [out, in], got {tuple(w.shape)} "
                                f"{w.dtype}")
    out_features, in_features = w.shape
    if group_size is None or group_size == -1:
        group_size = in_features
    if not isinstance(group_size, int) or group_size <= 0 or in_features % group_size:
        raise QuantizationError(f"group_size {group_size!r} does not divide in_features "
                                f"{in_features}; use a divisor, or -1/None for one group per "
                                "output channel")
    if bits == 4 and in_features % 2:
        raise QuantizationError(f"4-bit packing stores two columns per byte: in_features "
                                f"{in_features} must be even")
    return group_size


def _require_finite(reduced: torch.Tensor) -> None:
    """Raise unless every value of ``reduced`` is finite: a per-group reduction that NaN and inf
    reach (a group's max, min or largest magnitude: torch's max/argmax propagate NaN), so the
    weight is checked without one more pass over it."""
    if not bool(torch.isfinite(reduced).all()):
        raise QuantizationError("weight holds NaN or inf values, which cannot be quantized")


def _symmetric_params(wg: torch.Tensor, bits: int) -> tuple[torch.Tensor, None]:
    """wg: float32 [out, groups, group_size] → scales [out, groups], no zeros: 8 bits
    ``amax / 127``; 4 bits the searched scale of :func:`_searched_scales`."""
    if bits in SCALE_SEARCH_BITS:
        return _searched_scales(wg, bits), None
    amax = wg.abs().amax(-1)
    _require_finite(amax)
    return amax.clamp_min(torch.finfo(torch.float32).tiny) / _qrange(bits)[1], None


#: Bits whose symmetric scales are searched (:func:`_searched_scales`); 8 bits keep
#: ``amax / 127`` (their rounding error is already far below the activations').
SCALE_SEARCH_BITS = (4,)
#: The candidate divisors' offsets: the group's largest-magnitude value ``m`` maps to
#: ``qmin - step`` (Q4_0's choice is step 0: ``m -> -8``), as llama.cpp's ``make_qx_quants``
#: tries ``-(nmax + 0.1 i)``. One candidate (Q4_0's codes, then the weighted least-squares
#: scale) is the default: on SmolLM2-135M-Instruct (int4 g64, fp32 elsewhere, 255 positions
#: teacher-forced) it gave agreement 0.698 / perplexity 34.80 where ``amax / 7`` gave
#: 0.596 / 41.18, Q4_0's scale alone 0.718 / 35.55 and 14 candidates 0.682 / 33.93; it costs
#: about twice ``amax / 7`` at quantization (8 candidates: five times), see benchmarks/README.md.
SCALE_SEARCH_STEPS = (0.0,)


def _searched_scales(wg: torch.Tensor, bits: int,
                     steps: tuple[float, ...] = SCALE_SEARCH_STEPS) -> torch.Tensor:
    """The symmetric scale of each group minimizing the weighted squared rounding error, as
    llama.cpp's k-quants choose theirs (``make_qx_quants``, weights ``w²``).

    wg: float32 [out, groups, group_size] → scales [out, groups]. For each candidate
    ``d = m / (qmin - step)`` (``m`` the group's signed value of largest magnitude, so the
    sign of ``d`` lets ``m`` use the extra negative level, -8 at 4 bits, as Q4_0 does) the codes
    ``q = clamp(round(w / d))`` get their least-squares scale ``s = Σ w² q w / Σ w² q²``; the
    candidate with the smallest weighted error ``Σ w² (w - s q)²`` (equivalently the largest
    ``(Σ w² q w)² / Σ w² q²``) wins. A scale may therefore be negative. The caller rounds
    again with the chosen scale (never worse than the candidate's codes). Cost: about
    ``6 len(steps)`` passes over the weight, at quantization only."""
    qmin, qmax = _qrange(bits)
    tiny = torch.finfo(torch.float32).tiny
    hi, lo = wg.amax(-1, keepdim=True), wg.amin(-1, keepdim=True)  # [out, groups, 1]
    _require_finite(hi)  # max and min propagate NaN
    _require_finite(lo)
    m = _signed_max_abs(wg, hi, lo)  # [out, groups, 1] signed
    m = m.masked_fill_(m == 0, tiny)  # m is a fresh tensor
    weight = wg * wg  # [out, groups, group_size]
    best_score = torch.full(m.shape[:-1], -1.0, dtype=torch.float32, device=wg.device)
    best = (m / qmin).squeeze(-1)  # Q4_0's scale, kept where every candidate is degenerate
    for step in steps:
        q = (wg * ((qmin - step) / m)).round_().clamp_(qmin, qmax)
        wq = weight.mul(q)
        sum_lx = torch.linalg.vecdot(wq, wg)  # [out, groups]
        sum_l2 = torch.linalg.vecdot(wq, q).clamp_min_(tiny)
        del q, wq
        score = sum_lx * sum_lx / sum_l2
        better = score > best_score
        best = torch.where(better, sum_lx / sum_l2, best)
        best_score = torch.where(better, score, best_score)
    return best.masked_fill_(best == 0, tiny)  # best is a fresh tensor (torch.where)


def _signed_max_abs(wg: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Each group's value of largest magnitude, the first one where ``a`` and ``-a`` both are:
    ``wg.gather(-1, wg.abs().argmax(-1, keepdim=True))`` from the group's max and min ``hi`` /
    ``lo`` ([out, groups, 1], finite), about 10x faster on CPU; only groups holding both signs
    of the magnitude (rare) look for the first one."""
    m = torch.where(hi >= -lo, hi, lo)
    tie = ((hi == -lo) & (hi != 0)).squeeze(-1)  # [out, groups]
    if bool(tie.any()):
        where = tie.nonzero(as_tuple=True)
        sub = wg[where]  # [ties, group_size]
        m[where] = sub.gather(-1, sub.abs().argmax(-1, keepdim=True))
    return m


def _asymmetric_params(wg: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """wg: float32 [out, groups, group_size] → (scales, zeros), each [out, groups]."""
    qmin, qmax = _qrange(bits)
    lo, hi = wg.amin(-1), wg.amax(-1)
    _require_finite(lo)
    _require_finite(hi)
    scales = (hi - lo) / (qmax - qmin)
    # A constant group has no range: any scale represents it; |value| / (qmax - qmin) keeps the
    # zero point small (or 1e-8 / 15 for an all-zero group).
    flat = hi.abs().clamp_min(1e-8) / (qmax - qmin)
    scales = torch.where(scales > 0, scales, flat)
    return scales, qmin - lo / scales


#: Float32 elements quantized per chunk of rows on a CPU (2 MiB): a chunk's working tensors (a
#: few of its size) stay in the last-level cache and reuse the allocator's blocks, where
#: whole-weight temporaries each cost a pass through memory and fresh pages (about 4x slower on a
#: 1.7B's MLP weights). Every op is row-wise (a group never spans rows), so the bytes do not
#: depend on the chunking. Other devices take the whole weight at once (fewer launches).
CHUNK_ELEMENTS = 1 << 19


def quantize_weight(w: torch.Tensor, bits: int = 8, group_size: int | None = -1,
                    symmetric: bool = True) -> QuantizedWeight:
    """Quantize a float weight ``w [out, in]`` to ``bits`` (4 or 8) bits.

    ``group_size`` must divide ``in``; ``-1``/``None`` gives one scale per output channel. The
    format, rounding and packing are described in this module's docstring. Raises
    :class:`QuantizationError` (a ``ValueError`` and a ``KernelError``) naming the bad value;
    the caller adds the layer name. Works through the rows in chunks of about
    :data:`CHUNK_ELEMENTS` values (the result does not depend on it).
    """
    group_size = _check_args(w, bits, group_size)
    out_features, in_features = w.shape
    groups, w = in_features // group_size, w.detach()
    packed_in = in_features // 2 if bits == 4 else in_features
    qweight = torch.empty(out_features, packed_in, device=w.device,
                          dtype=torch.uint8 if bits == 4 else torch.int8)
    scales = torch.empty(out_features, groups, dtype=torch.float32, device=w.device)
    zeros = None if symmetric else torch.empty_like(scales)
    params = _symmetric_params if symmetric else _asymmetric_params
    rows = max(1, CHUNK_ELEMENTS // in_features) if w.device.type == "cpu" else \
        max(1, out_features)
    for a in range(0, out_features, rows):
        b = min(a + rows, out_features)
        wg = w[a:b].float().reshape(b - a, groups, group_size)
        s, z = params(wg, bits)  # raises for NaN / inf (_require_finite)
        scales[a:b] = s
        if z is not None:
            zeros[a:b] = z
        _round_into(qweight[a:b], wg, s, z, bits)
    return QuantizedWeight(qweight, scales, zeros, bits, group_size)


def _round_into(out: torch.Tensor, wg: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None, bits: int) -> None:
    """Write the codes of ``wg`` (float32 [rows, groups, group_size]) with ``scales`` / ``zeros``
    ([rows, groups]) into ``out``: int8 [rows, in], or uint8 [rows, in // 2] packed as
    :func:`pack_int4` (the nibbles summed in float32: ``lo + 16 hi`` is exact below 256)."""
    q = wg / scales[..., None]
    if zeros is not None:
        q = q + zeros[..., None]
    qmin, qmax = _qrange(bits)
    q = q.round_().clamp_(qmin, qmax).reshape(out.shape[0], -1)  # [rows, in]
    if bits == 4:
        q = q.add_(-qmin)  # 0..15
        q = torch.add(q[:, 0::2], q[:, 1::2], alpha=16)  # [rows, in // 2]
    out.copy_(q)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 ``q [..., k]`` in [-8, 7] (k even) → uint8 ``[..., k // 2]``: byte j holds
    ``q[2j] + 8`` in its low nibble and ``q[2j + 1] + 8`` in its high nibble."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)  # [..., k] in 0..15
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., k // 2]`` → int8 ``q [..., k]`` in [-8, 7]; inverse of :func:`pack_int4`."""
    lo = (packed & 0x0F).to(torch.int8) - 8  # even columns
    hi = (packed >> 4).to(torch.int8) - 8  # odd columns
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def int_weight(qw: QuantizedWeight) -> torch.Tensor:
    """The signed integers ``q`` as int8 ``[out, in]`` (unpacked for 4 bits)."""
    return unpack_int4(qw.qweight) if qw.bits == 4 else qw.qweight


def dequantize_weight(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - zero) * scale`` as ``[out, in]``, computed in float32 and returned in ``dtype``."""
    out_features, in_features = qw.out_features, qw.in_features
    q = int_weight(qw).float().reshape(out_features, -1, qw.group_size)
    if qw.zeros is not None:
        q = q - qw.zeros[..., None]
    w = (q * qw.scales[..., None]).reshape(out_features, in_features)
    return w.to(dtype)


# ----- rows of a packed weight (a tied embedding's lookup) --------------------------------------
#
# An output head tied to the input embeddings is stored once, quantized (shardwise.quant.tied):
# the head runs ``quant_linear`` and the embedding looks up ROWS of the same packed weight,
# dequantizing only those. :func:`dequantize_rows` is the oracle (the format's own tensors);
# :func:`packed_rows` reads them from a backend's packed layout without unpacking the rest:
# the reference layout, the CPU backend's native layout (``meta["kind"] == "native"``: rows in
# tiles of 16, shardwise.kernels.cpu.quant's docstring) and its torch int8 layouts
# (``"int8"``). Every one is plain tensor indexing, so a compiled decode step traces it.


def dequantize_rows(qw: QuantizedWeight, ids: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` (any shape of int64 indices into ``[0, out)``) of the dequantized weight:
    ``dequantize_weight(qw)[ids]`` as ``[*ids.shape, in]`` in ``dtype`` — the oracle of
    :func:`packed_rows`. Dequantizes only the rows asked for."""
    flat = ids.reshape(-1)
    zeros = qw.zeros[flat] if qw.zeros is not None else None
    rows = QuantizedWeight(qw.qweight[flat], qw.scales[flat], zeros, qw.bits, qw.group_size)
    return dequantize_weight(rows, dtype).reshape(*ids.shape, qw.in_features)


def _grouped(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             group_size: int) -> torch.Tensor:
    """int q [T, K], float32 scales / zeros [T, G] → float32 ``(q - zero) * scale`` [T, K]."""
    t, k = q.shape
    w = q.float().reshape(t, -1, group_size)
    if zeros is not None:
        w = w - zeros[..., None]
    return (w * scales.float()[..., None]).reshape(t, k)


def _reference_rows(packed: PackedQuantWeight, ids: torch.Tensor) -> torch.Tensor:
    return dequantize_rows(unpacked(packed), ids)


#: Output rows per tile of the CPU backend's native layout.
NATIVE_TILE_ROWS = 16


def _native_rows(packed: PackedQuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows of the native layout: ``qweight`` uint8 [Nb, K / L, 16, 4] (int8: byte j of step s
    is column ``4 s + j``, ``q + 128``; int4: byte j of step s holds columns ``8 s + j`` (low
    nibble) and ``8 s + 4 + j`` (high), ``q + 8``), ``scales`` / ``zeros`` [Nb, G, 16]."""
    t, spec = packed.tensors, packed.spec
    tile, row = ids // NATIVE_TILE_ROWS, ids % NATIVE_TILE_ROWS  # [T] each
    w = t["qweight"][tile, :, row, :]  # [T, K / L, 4]
    if spec.bits == 4:
        w = torch.stack((w & 0x0F, w >> 4), dim=-2)  # [T, K / 8, 2, 4]: low then high nibble
    q = w.reshape(ids.shape[0], spec.in_features).to(torch.int16) - UNSIGNED_OFFSET[spec.bits]
    zeros = t["zeros"][tile, :, row] if "zeros" in t else None  # [T, G]
    return _grouped(q, t["scales"][tile, :, row], zeros, spec.group_size)


def _int8_rows(packed: PackedQuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows of the CPU backend's torch int8 layouts: per channel ``qweight`` int8 [N, K],
    ``scales`` [N]; grouped ``qweight`` [G, N, group], ``scales`` [G, N]; asymmetric adds
    ``offsets`` float32 [G, N] (``-zero * scale``; G = 1 per channel)."""
    t, spec = packed.tensors, packed.spec
    q = t["qweight"]
    if q.dim() == 2:
        w = q[ids].float() * t["scales"][ids].float()[:, None]  # [T, K]
        return w + t["offsets"][0, ids][:, None] if "offsets" in t else w
    w = q[:, ids].float() * t["scales"][:, ids].float()[..., None]  # [G, T, group]
    if "offsets" in t:
        w = w + t["offsets"][:, ids][..., None]
    return w.permute(1, 0, 2).reshape(ids.shape[0], spec.in_features)


#: Packed layouts whose rows :func:`packed_rows` reads, by (backend kind): the reference's
#: own tensors, and the CPU backend's ``meta["kind"]`` "native" and "int8".
ROW_READERS: dict[str, Callable[[PackedQuantWeight, torch.Tensor], torch.Tensor]] = {
    "reference": _reference_rows, "native": _native_rows, "int8": _int8_rows}


def row_layout(packed: PackedQuantWeight) -> str:
    """The :data:`ROW_READERS` key of ``packed``'s layout (it may be missing there)."""
    return BACKEND if packed.backend == BACKEND else str(packed.meta.get("kind"))


def rows_unsupported_reason(packed: PackedQuantWeight) -> str | None:
    """Why :func:`packed_rows` cannot read ``packed``'s rows (None when it can)."""
    layout = row_layout(packed)
    if layout in ROW_READERS:
        return None
    return (f"the {packed.backend!r} backend's {layout!r} layout of int{packed.spec.bits} "
            f"group {packed.spec.group_size} keeps its rows opaque (readable layouts: "
            f"{', '.join(ROW_READERS)})")


def packed_rows(packed: PackedQuantWeight, ids: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape, each in ``[0, out)``) of a packed quantized weight,
    dequantized: ``[*ids.shape, in]`` in ``dtype``, equal to :func:`dequantize_rows` of the
    weight it holds (computed in float32 from the stored scales). Reads only those rows.
    Raises :class:`KernelError` for a layout it cannot read (:func:`rows_unsupported_reason`)."""
    reason = rows_unsupported_reason(packed)
    if reason is not None:
        raise KernelError(f"packed_rows: {reason}")
    flat = ids.reshape(-1)
    rows = ROW_READERS[row_layout(packed)](packed, flat)  # [T, in] float32
    return rows.to(dtype).reshape(*ids.shape, packed.spec.in_features)


# ----- 8-bit activations (the oracle of the CPU backend's native kernel) -------------------------
#
# The ``cpu`` backend's native kernel (shardwise.kernels.cpu.native) multiplies the quantized
# weight by 8-bit activations with integer dot products, as llama.cpp's Q8_0/Q4_0 CPU paths do.
# Activations ``x [M, K]`` are cut into blocks of ``block`` columns (:func:`activation_block`: a
# divisor of the weight's group, so a block never straddles two groups) and each block becomes
# ``d = amax / 127`` and ``q = round_half_even(x * (127 / amax))`` (0 when amax = 0). With the
# weight stored unsigned, ``u = q_w + OFF`` (OFF = 128 for 8 bits, 8 for 4 bits, so that
# ``w = (u - (OFF + zero)) * scale``), the kernel computes, per activation row m, output n and
# group g:
#
#     y[m, n] = sum_g scale[n, g] * (sum_{b in g} d[m, b] * sum_{k in b} u[n, k] q[m, k])
#               - scale[n, g] * (OFF + zero[n, g]) * A[m, g]
#     A[m, g] = sum_{b in g} d[m, b] * sum_{k in b} q[m, k]
#
# in float32 (the integer sums exact), + bias, rounded to x's dtype. :func:`int8_activation_linear`
# is exactly this, in torch.

#: Activation block sizes of the 8-bit-activation path, largest first (llama.cpp's is 32).
ACTIVATION_BLOCKS = (32, 16, 8, 4)
#: The largest activation block used, by weight bits: 16 for 8-bit weights, whose error is then
#: mostly the activations' (SmolLM2-135M, int8 g32, fp32 compute: KL from fp32 0.0024 with
#: blocks of 16 against 0.0037 with 32, Q8_0's 0.0035; benchmarks/README.md, llama.cpp
#: section), 32 for 4-bit weights, whose own rounding dominates.
MAX_ACTIVATION_BLOCK = {8: 16, 4: 32}
#: Columns per 4-byte lane of the native kernel's packed weight, by bits (a block's multiple).
LANE_COLUMNS = {8: 4, 4: 8}
#: The offset making the stored weight unsigned (``u = q + OFF``), by bits.
UNSIGNED_OFFSET = {8: 128, 4: 8}


def activation_block(bits: int, group_size: int) -> int | None:
    """The activation block for a weight of ``bits`` and ``group_size``: the largest of
    :data:`ACTIVATION_BLOCKS` up to :data:`MAX_ACTIVATION_BLOCK` dividing the group that is a
    multiple of the kernel's lane (:data:`LANE_COLUMNS`); None when none is (e.g. 4 bits in
    groups of 36)."""
    lane, top = LANE_COLUMNS[bits], MAX_ACTIVATION_BLOCK[bits]
    return next((b for b in ACTIVATION_BLOCKS
                 if b <= top and group_size % b == 0 and b % lane == 0), None)


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (K a multiple of ``block``) → (q int8 [M, K], d float32 [M, K / block]):
    per block of ``block`` columns ``d = amax / 127`` and ``q = round(x * (127 / amax))``
    (round half to even; 0 for an all-zero block), computed in float32."""
    m, k = x.shape
    xb = x.float().reshape(m, k // block, block)
    amax = xb.abs().amax(-1)  # [M, K / block]
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).to(torch.int8).reshape(m, k)
    return q, amax / 127


def int8_activation_linear(x: torch.Tensor, qw: QuantizedWeight, block: int,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The native CPU kernel's math (comment above), in torch: ``x [M, K]`` times the quantized
    weight ``qw`` with activations quantized per ``block`` columns, + bias, → ``[M, N]`` in
    ``x.dtype``. The oracle its tests compare against; memory [M, N, K / block] float64."""
    m, k = x.shape
    n, size = qw.out_features, qw.group_size
    groups, per_group = k // size, size // block
    q, d = quantize_activations(x, block)
    u = int_weight(qw).double() + UNSIGNED_OFFSET[qw.bits]  # [N, K]
    qb = q.double().reshape(m, k // block, block)
    idot = torch.einsum("mbk,nbk->mnb", qb, u.reshape(n, k // block, block)).float()  # exact
    gacc = (idot * d[:, None, :]).reshape(m, n, groups, per_group).sum(-1)  # [M, N, G]
    a_sums = (d * qb.sum(-1).float()).reshape(m, groups, per_group).sum(-1)  # [M, G]
    zero = UNSIGNED_OFFSET[qw.bits] + (qw.zeros if qw.zeros is not None else 0)  # [N, G]
    y = (qw.scales * gacc).sum(-1) - (a_sums[:, None, :] * (qw.scales * zero)).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)

# ----- the op -----------------------------------------------------------------------------------


class QuantLinearKernel:
    """One backend's ``quant_linear``: ``prepack`` once at load, then call per step.

    Subclasses set ``backend`` and implement ``_pack(qw, device, dtype) -> (tensors, meta)`` and
    ``_linear(x2 [rows, in], packed, bias) -> [rows, out]``; they may refuse a spec in
    ``supports`` (the registry predicate), which ``prepack`` re-checks.
    """

    backend: str = BACKEND

    def supports(self, *, device_type: str, dtype: torch.dtype, **shape: Any) -> bool:
        """Registry predicate; the reference runs everything."""
        return True

    def unsupported_reason(self, *, device_type: str, dtype: torch.dtype | None,
                           **shape: Any) -> str | None:
        """Why :meth:`supports` refuses these inputs, in words for an error message (None when
        it takes them). Backends with constraints override it to name them (e.g. the group
        sizes they take)."""
        if self.supports(device_type=device_type, dtype=dtype, **shape):
            return None
        return (f"it does not take {shape} with {str(dtype).removeprefix('torch.')} "
                f"activations on {device_type}")

    def oracle(self, packed: PackedQuantWeight) -> Callable[..., torch.Tensor] | None:
        """``(x, packed, bias) -> y``: the torch math this kernel's calls on ``packed`` compute,
        when it is not the reference's (weight-only) ``quant_linear``; None here."""
        return None

    def prepare(self, meta: dict[str, Any]) -> None:
        """Make ready, eagerly, what calls on a weight packed with ``meta`` need (a weight made
        by :meth:`prepack` or loaded from a checkpoint in this layout): a compiled step traced
        later must find it ready. Nothing here."""

    def prepack(self, qw: QuantizedWeight, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> PackedQuantWeight:
        """``qw`` in this backend's layout on ``device`` for inputs of ``dtype``: call once per
        weight at load and keep the result; the call never repacks."""
        device = torch.device(device) if device is not None else qw.qweight.device
        if not self.supports(device_type=device.type, dtype=dtype, **qw.spec.as_shape()):
            raise KernelError(f"quant_linear backend {self.backend!r} cannot run {qw.spec} for "
                              f"{dtype} on {device.type}; pack with the implementation the "
                              "registry resolves for this spec")
        tensors, meta = self._pack(qw, device, dtype)
        return PackedQuantWeight(self.backend, qw.spec, dtype, tensors, meta)

    def __call__(self, x: torch.Tensor, packed: PackedQuantWeight,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in]`` times the packed weight (+ bias) → ``[..., out]`` in ``x.dtype``."""
        self._check_call(x, packed)
        spec = packed.spec
        y = self._linear(x.reshape(-1, spec.in_features), packed, bias)
        return y.reshape(*x.shape[:-1], spec.out_features)

    def _check_call(self, x: torch.Tensor, packed: PackedQuantWeight) -> None:
        if not isinstance(packed, PackedQuantWeight) or packed.backend != self.backend:
            got = getattr(packed, "backend", type(packed).__name__)
            raise KernelError(f"quant_linear ({self.backend}) was given a weight packed for "
                              f"{got!r}: pack with impl.fn.prepack of the implementation you "
                              "call")
        if x.shape[-1] != packed.spec.in_features:
            raise KernelError(f"quant_linear: x has {x.shape[-1]} features, the weight "
                              f"{packed.spec.in_features}")
        if packed.dtype is not None and x.dtype != packed.dtype:
            raise KernelError(f"quant_linear ({self.backend}): weight packed for "
                              f"{packed.dtype}, x is {x.dtype}; prepack for the compute dtype")

    def _pack(self, qw: QuantizedWeight, device: torch.device, dtype: torch.dtype | None):
        """Reference layout: the QuantizedWeight's own tensors, moved to ``device``."""
        qw = qw.to(device)
        tensors = {"qweight": qw.qweight, "scales": qw.scales}
        if qw.zeros is not None:
            tensors["zeros"] = qw.zeros
        return tensors, {}

    def _linear(self, x2: torch.Tensor, packed: PackedQuantWeight,
                bias: torch.Tensor | None) -> torch.Tensor:
        """Dequantize (float32), round to x.dtype, then F.linear in x.dtype."""
        w = dequantize_weight(unpacked(packed)).to(device=x2.device, dtype=x2.dtype)
        bias = bias.to(device=x2.device, dtype=x2.dtype) if bias is not None else None
        return F.linear(x2, w, bias)


def unpacked(packed: PackedQuantWeight) -> QuantizedWeight:
    """The QuantizedWeight a reference-packed weight holds."""
    t = packed.tensors
    return QuantizedWeight(t["qweight"], t["scales"], t.get("zeros"), packed.spec.bits,
                           packed.spec.group_size)


#: The reference implementation: ``quant_linear(x, packed, bias=None)`` plus ``.prepack``.
quant_linear = QuantLinearKernel()


# ----- quantized experts: ``quant_moe_mlp`` ---------------------------------------------------
#
# A Mixture-of-Experts layer's stacked expert weights ``[E, N, K]`` (``F.linear`` orientation per
# expert: gate_up ``[E, 2I, H]``, down ``[E, H, I]``) quantize row by row exactly as a linear's
# ``[E * N, K]`` would, so every expert has its own scales (per output row and group) and the
# format is the one above with a leading expert dimension. ``quant_moe_mlp`` is
# ``moe_grouped_mlp`` (shardwise.kernels.reference.moe: same routing contract, same activations,
# GPT-OSS's biases and clamp) over two such packed weights; an expert index equal to the packed
# expert count (``E_local``) marks a slot whose expert lives on another rank: it contributes
# nothing.


@dataclass(frozen=True, eq=False)
class PackedQuantExperts:
    """``experts`` quantized matrices of one spec in one backend's layout (made once by
    ``QuantMoEKernel.prepack``).

    backend: the backend whose ``quant_moe_mlp`` consumes it; spec: ONE expert's matrix
    (``in_features`` = K, ``out_features`` = N); experts: E; dtype: the compute dtype it was
    packed for (None: any); tensors: the backend's layout, every tensor with a leading ``[E]``
    dimension (described in that backend's module); meta: non-tensor settings of the layout.
    """

    backend: str
    spec: QuantSpec
    experts: int
    dtype: torch.dtype | None
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed tensors of all E experts."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def expert(self, e: int) -> dict[str, torch.Tensor]:
        """Expert ``e``'s tensors (views, no copy)."""
        return {name: t[e] for name, t in self.tensors.items()}


def quantize_experts(w: torch.Tensor, bits: int = 8, group_size: int | None = -1,
                     symmetric: bool = True) -> QuantizedWeight:
    """Quantize stacked expert weights ``w [E, N, K]`` as the 2-D ``[E * N, K]``: each expert
    row keeps its own scales (module format). ``QuantMoEKernel.prepack(qw, E, ...)`` packs the
    result."""
    if w.dim() != 3:
        raise QuantizationError(f"expected stacked expert weights [experts, out, in], got "
                                f"{tuple(w.shape)}")
    # one expert at a time: the float32 working copy is one expert's, not the layer's
    parts = [quantize_weight(w[e], bits, group_size, symmetric) for e in range(w.shape[0])]
    zeros = torch.cat([p.zeros for p in parts]) if not symmetric else None
    return QuantizedWeight(torch.cat([p.qweight for p in parts]),
                           torch.cat([p.scales for p in parts]), zeros, bits, parts[0].group_size)


def expert_spec(qw: QuantizedWeight, experts: int) -> QuantSpec:
    """One expert's :class:`QuantSpec` of ``qw`` holding ``experts`` stacked matrices."""
    if experts < 1 or qw.out_features % experts:
        raise QuantizationError(f"{qw.out_features} quantized rows do not split into {experts} "
                                f"experts")
    return QuantSpec(qw.bits, qw.group_size, qw.symmetric, qw.in_features,
                     qw.out_features // experts)


class QuantMoEKernel:
    """One backend's ``quant_moe_mlp``: ``prepack`` each stacked weight once at load, then call
    per step (contract: module comment above ``PackedQuantExperts``).

    Resolution: ``registry.resolve("quant_moe_mlp", accelerator, dtype, specs=(gate_up_spec,
    down_spec))``; a backend claims the pair only when it takes both specs. Subclasses set
    ``backend`` and implement ``_pack``, ``_mlp`` and ``dequantize``.
    """

    backend: str = BACKEND

    def supports(self, *, device_type: str, dtype: torch.dtype | None,
                 specs: tuple[QuantSpec, ...] | None = None, **_shape: Any) -> bool:
        """Registry predicate; the reference runs everything."""
        return self.unsupported_reason(device_type=device_type, dtype=dtype, specs=specs) is None

    def unsupported_reason(self, *, device_type: str, dtype: torch.dtype | None,
                           specs: tuple[QuantSpec, ...] | None = None,
                           **_shape: Any) -> str | None:
        """Why :meth:`supports` refuses (None when it takes them), in words."""
        return None

    def prepack(self, qw: QuantizedWeight, experts: int,
                device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> PackedQuantExperts:
        """``qw`` (:func:`quantize_experts` of ``[experts, N, K]``) in this backend's layout on
        ``device`` for activations of ``dtype``: once per weight, at load."""
        spec = expert_spec(qw, experts)
        device = torch.device(device) if device is not None else qw.qweight.device
        reason = self.unsupported_reason(device_type=device.type, dtype=dtype, specs=(spec,))
        if reason is not None:
            raise KernelError(f"quant_moe_mlp backend {self.backend!r} cannot run {spec} for "
                              f"{dtype} on {device.type}: {reason}; pack with the "
                              f"implementation the registry resolves for this spec")
        tensors, meta = self._pack(qw.to(device), experts, dtype)
        return PackedQuantExperts(self.backend, spec, experts, dtype, tensors, meta)

    def __call__(self, x: torch.Tensor, gate_up: PackedQuantExperts, down: PackedQuantExperts,
                 experts: torch.Tensor, weights: torch.Tensor, *, activation: str = "silu",
                 gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, clamp: float | None = None,
                 alpha: float = moe.GPT_OSS_ALPHA) -> torch.Tensor:
        """The routed experts' output ``[T, H]`` in ``x.dtype``: ``moe_grouped_mlp``'s contract
        with gate_up (spec K = H, N = 2I) and down (K = I, N = H) packed quantized; an expert
        index of ``E`` (the packed expert count) contributes nothing."""
        self._check_call(x, gate_up, down, experts, weights, activation, gate_up_bias,
                         down_bias, clamp)
        return self._mlp(x, gate_up, down, experts, weights, activation, gate_up_bias,
                         down_bias, clamp, alpha)

    def _check_call(self, x, gate_up, down, experts, weights, activation, gate_up_bias,
                    down_bias, clamp) -> None:
        for name, packed in (("gate_up", gate_up), ("down", down)):
            if not isinstance(packed, PackedQuantExperts) or packed.backend != self.backend:
                got = getattr(packed, "backend", type(packed).__name__)
                raise KernelError(f"quant_moe_mlp ({self.backend}) was given a {name} weight "
                                  f"packed for {got!r}: pack with impl.fn.prepack of the "
                                  "implementation you call")
            if packed.dtype is not None and x.dtype != packed.dtype:
                raise KernelError(f"quant_moe_mlp ({self.backend}): {name} packed for "
                                  f"{packed.dtype}, x is {x.dtype}; prepack for the compute "
                                  "dtype")
        gu, dn = gate_up.spec, down.spec
        if (gate_up.experts != down.experts or gu.out_features % 2 or x.dim() != 2
                or gu.in_features != x.shape[1] or dn.out_features != x.shape[1]
                or dn.in_features * 2 != gu.out_features):
            raise KernelError(f"quant_moe_mlp needs x [T, H], gate_up [E, 2I, H] and down "
                              f"[E, H, I]; got x {tuple(x.shape)}, gate_up {gate_up.experts} x "
                              f"[{gu.out_features}, {gu.in_features}], down {down.experts} x "
                              f"[{dn.out_features}, {dn.in_features}]")
        e, two_i, h = gate_up.experts, gu.out_features, gu.in_features
        moe.check_grouped_mlp(x, torch.empty(e, two_i, h, device="meta"),  # shapes only
                              torch.empty(e, h, two_i // 2, device="meta"), experts, weights,
                              activation, gate_up_bias, down_bias, clamp)

    def _pack(self, qw: QuantizedWeight, experts: int, dtype: torch.dtype | None):
        """Reference layout: the QuantizedWeight's tensors with a leading expert dimension."""
        tensors = {"qweight": qw.qweight, "scales": qw.scales}
        if qw.zeros is not None:
            tensors["zeros"] = qw.zeros
        return {n: t.reshape(experts, -1, *t.shape[1:]) for n, t in tensors.items()}, {}

    def dequantize(self, packed: PackedQuantExperts) -> torch.Tensor:
        """The float32 ``[E, N, K]`` weights the kernel computes with (exact here)."""
        t, spec = packed.tensors, packed.spec
        flat = {n: v.reshape(-1, *v.shape[2:]) for n, v in t.items()}
        qw = QuantizedWeight(flat["qweight"], flat["scales"], flat.get("zeros"), spec.bits,
                             spec.group_size)
        return dequantize_weight(qw).reshape(packed.experts, spec.out_features,
                                             spec.in_features)

    def _mlp(self, x, gate_up, down, experts, weights, activation, gate_up_bias, down_bias,
             clamp, alpha) -> torch.Tensor:
        """Dequantize every expert (float32, rounded to x.dtype), then the reference
        ``moe_grouped_mlp`` (float32 math; it skips the sentinel E, never matched)."""
        gu = self.dequantize(gate_up).to(x.dtype)
        dn = self.dequantize(down).to(x.dtype)
        return moe.moe_grouped_mlp(x, gu, dn, experts, weights, activation=activation,
                                   gate_up_bias=gate_up_bias, down_bias=down_bias, clamp=clamp,
                                   alpha=alpha)


#: The reference ``quant_moe_mlp(x, gate_up, down, experts, weights, ...)`` plus ``.prepack``.
quant_moe_mlp = QuantMoEKernel()


def prepack(qw: QuantizedWeight, device: torch.device | str | None = None,
            dtype: torch.dtype | None = None) -> PackedQuantWeight:
    """The reference's packed form of ``qw`` (its own tensors on ``device``)."""
    return quant_linear.prepack(qw, device, dtype)


OPS = {"quant_linear": quant_linear, "quant_moe_mlp": quant_moe_mlp}


def register(registry) -> None:
    """Define ``quant_linear`` with its reference implementation."""
    for op, fn in OPS.items():
        registry.register(op, BACKEND, fn)


# ----- example inputs (conformance suite) ---------------------------------------------------------

def _quant_linear_example(dtype: torch.dtype, device: torch.device) -> Example:
    """int4, asymmetric, groups of 32: the weight is packed by whichever backend resolves."""
    g = torch.Generator().manual_seed(11)
    qw = quantize_weight(torch.randn(48, 64, generator=g), bits=4, group_size=32,
                         symmetric=False)
    x, bias = torch.randn(3, 64, generator=g), torch.randn(48, generator=g)

    def bind(impl, args):  # each implementation runs on the weight packed its own way
        x_, qw_, bias_ = args
        return x_, impl.fn.prepack(qw_, x_.device, x_.dtype), bias_

    def expect(impl, args):  # a kernel declaring other numerics is held to them
        oracle = impl.fn.oracle(args[1])
        return None if oracle is None else oracle(*args)

    return Example((x.to(device, dtype), qw.to(device), bias.to(device, dtype)), {},
                   resolve=qw.spec.as_shape(), bind=bind, expect=expect)


def _quant_moe_mlp_example(dtype: torch.dtype, device: torch.device) -> Example:
    """int8 symmetric per channel, 4 experts of H 64, I 32, top-2; slot (2, 1) is another
    rank's expert (the sentinel 4): both weights packed by whichever backend resolves."""
    g = torch.Generator().manual_seed(12)
    gate_up = quantize_experts(torch.randn(4, 64, 64, generator=g) * 0.125, bits=8)
    down = quantize_experts(torch.randn(4, 64, 32, generator=g) * 0.18, bits=8)
    x = torch.randn(3, 64, generator=g)
    experts = torch.tensor([[0, 2], [3, 1], [2, 4]])
    weights = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.8, 0.2]])

    def bind(impl, args):
        x_, gu_, dn_, e_, w_ = args
        return (x_, impl.fn.prepack(gu_, 4, x_.device, x_.dtype),
                impl.fn.prepack(dn_, 4, x_.device, x_.dtype), e_, w_)

    def expect(impl, args):  # a kernel declaring other numerics is held to them
        oracle = getattr(impl.fn, "oracle", None)
        declared = oracle(args[1], args[2]) if oracle is not None else None
        return None if declared is None else declared(*args)

    specs = (expert_spec(gate_up, 4), expert_spec(down, 4))
    return Example((x.to(device, dtype), gate_up.to(device), down.to(device), experts.to(device),
                    weights.to(device)), {}, resolve={"specs": specs}, bind=bind, expect=expect)


EXAMPLES = {"quant_linear": _quant_linear_example, "quant_moe_mlp": _quant_moe_mlp_example}

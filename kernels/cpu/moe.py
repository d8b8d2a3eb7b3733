"""The ``cpu`` backend's MoE ops: ``moe_route`` and ``moe_grouped_mlp`` without host syncs, and
``quant_moe_mlp`` (quantized experts) on the native int8/int4 kernel (:class:`CpuQuantMoE`).

Contracts are those of ``shardwise.kernels.reference.moe`` (shapes, layouts, options, the
sentinel expert index E: a slot whose expert lives on another rank contributes nothing).

* moe_grouped_mlp (fp32, bf16) has two paths, both with static shapes and no host sync
  (no ``.item()``, ``nonzero`` or routing-dependent shape): dropless (every slot computed, one
  expert may take all of them) and capturable.

  - **Compiled decode** (under ``torch.compile``, i.e. the CPU graph strategy's captured step,
    with at most :data:`STREAMED_SLOTS_PER_EXPERT` token slots per local expert; in fp32
    always, since torch cannot trace an fp32 ``grouped_mm``): :func:`streamed_mlp`. Each
    slot's expert rows are dotted with its token in a form inductor turns into C++ reduction
    loops that read the stacked weights in place through the slot's expert index (no gathered
    copies), chunk by chunk so that slots of one expert share what the first read brought
    into cache: about one read of each routed expert's bytes per step. At 1-8 tokens it was
    1.25-2.2x as fast as ATen's grouped GEMM of 1-2 rows per expert, which is compute-bound on
    CPU (fp32 gains most; bf16 is bound by converting the rows).
  - **Compiled decode of one token** (batch 1): :func:`token_mlp`, the streamed path without
    its sort and chunks (top-k experts are distinct: nothing to share), each slot's expert one
    contiguous stream.
  - **Eager** (prompts, steps without graphs): the T*k token slots are sorted by expert
    (``argsort``, the permutation of ``moe_permute``), the per-expert slot counts become
    ``offs`` by a scatter-add and a cumsum on the device, and ``torch.nn.functional.grouped_mm``
    runs each expert's GEMM over its segment of the sorted slots, reading the stacked
    [E, 2I, H] / [E, H, I] weights in place (transposed views). Experts that get no slot are
    skipped inside the op; the sentinel's slots sort after every segment (no weights read) and
    are masked to 0. The activation is applied on the [T*k, 2I] intermediate, the k weights
    multiply the [T*k, H] result and an ``index_add_`` combines the slots into their tokens.
    Math in the input dtype (bf16 GEMMs accumulate in float32 inside the op); the combine in
    float32, rounded once. Sizes ``grouped_mm`` refuses (rows not 16-byte aligned) gather each
    slot's expert matrices (a copy: small shapes only).
* quant_moe_mlp (bf16 registered; natively packed experts take any float input): the native
  AVX512-VNNI kernel of ``quant_linear`` per expert matrix, **activations rounded to int8 per
  block of 32** (oracle ``int8_activation_moe_mlp``), else torch's packed kernels
  (:class:`CpuQuantMoE`); one opaque op in the compiled step (it reads the routing on the host).
* moe_route (fp32, bf16): the reference's own code (already sync-free and static in shape),
  registered as capturable.

Speed against the reference and HF's ``eager``/``grouped_mm`` experts, eager and compiled:
benchmarks/README.md, "MoE kernels" (``python benchmarks/kernel_moe.py``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from shardwise.errors import KernelError
from shardwise.kernels.reference import moe as ref
from shardwise.kernels.reference.quant import (LANE_COLUMNS, PackedQuantExperts,
                                               PackedQuantWeight, QuantizedWeight,
                                               QuantMoEKernel, dequantize_weight, expert_spec)

from . import DEVICE_TYPES, native
from . import quant as cpu_quant

BACKEND = "cpu"
MOE_DTYPES = frozenset({torch.float32, torch.bfloat16})
#: the most token slots (tokens × top-k) per local expert the compiled step gives
#: :func:`streamed_mlp` (decode batches) in bf16; more take the grouped GEMMs, whose rows per
#: expert then make them efficient (Mixtral-like, 1 thread: streamed 1.3x faster at 2 slots per
#: expert, even at 4, 0.68x at 8; fp32 streamed was still 1.3x faster at 8: benchmarks/README.md).
#: Ties go to the streamed path: a ``grouped_mm`` in the step makes the CPU graph strategy
#: compile it a second time with ATen's GEMMs as candidates (and every later capture with them)
STREAMED_SLOTS_PER_EXPERT = 4
#: dtypes whose ``grouped_mm`` torch.compile can trace (its meta kernel takes bf16 only)
GROUPED_MM_TRACES = frozenset({torch.bfloat16})
#: rows per chunk in :func:`slot_rows` (64 fp32 rows of H=1024: 256 KiB, within L2)
ROW_CHUNK = 64


def sorted_slots(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] in 0..E (E: the sentinel, another rank's expert) → (order [T*k] int64:
    slots sorted by expert, stable — the sentinel's slots last, after every segment; offs [E]
    int32: the end of each expert's segment in ``order``). Static shapes, no host sync."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, counts[:num_experts].cumsum(0, dtype=torch.int32)


def grouped_mm_fits(gate_up: torch.Tensor) -> bool:
    """``grouped_mm`` needs row strides of 16 bytes: H and I multiples of 16 / itemsize."""
    two_i, h = gate_up.shape[1:]
    size = gate_up.element_size()
    return (h * size) % 16 == 0 and (two_i // 2 * size) % 16 == 0


def _gathered_mlp(x, gate_up, down, experts, weights, activation, gate_up_bias, down_bias, clamp,
                  alpha) -> torch.Tensor:
    """Sizes ``grouped_mm`` refuses: each slot's expert matrices gathered ([T*k, 2I, H] — a
    copy, small shapes only) and one batched matmul. Static shapes, no host sync."""
    t, k = experts.shape
    n_local = gate_up.shape[0]
    here = experts < n_local  # [T, k]: False for the sentinel (another rank's expert)
    flat = experts.reshape(-1).clamp(max=n_local - 1)  # [T*k]: sentinel slots read any expert
    weights = torch.where(here, weights.float(), 0.0)  # ... and add nothing
    xs = x.to(gate_up.dtype).repeat_interleave(k, 0)[:, :, None]  # [T*k, H, 1]
    h = torch.bmm(gate_up[flat], xs)[..., 0]  # [T*k, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias.to(h.dtype)[flat]
    y = torch.bmm(down[flat], ref.glu(h, activation, clamp, alpha)[:, :, None])[..., 0]
    if down_bias is not None:
        y = y + down_bias.to(y.dtype)[flat]
    y = y.float().view(t, k, -1) * weights.float()[:, :, None]
    return y.sum(1).to(x.dtype)


def row_chunk(rows: int) -> int:
    """The rows of one expert the compiled loop streams for every slot before moving on: the
    largest of :data:`ROW_CHUNK`, 32, ... 1 dividing ``rows``."""
    chunk = ROW_CHUNK
    while rows % chunk:
        chunk //= 2
    return chunk


def slot_rows(w: torch.Tensor, slot_expert: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``out[s, n] = w[slot_expert[s], n, :] · v[s, :]``: w [E, N, K] (K contiguous),
    slot_expert [S] in 0..E-1, v [S, K] → [S, N] float32.

    Written for inductor: the product is over a [N/C, S, C] output (C = :func:`row_chunk`), so
    its C++ loops run over chunks of C rows (parallel), then the slots, then the rows of the
    chunk, then K (vectorized), with the expert index read in the loop: the weights are read
    in place, and slots of one expert (adjacent once sorted) find the chunk in cache — each
    expert's bytes come from memory about once per call. Eager it would materialise
    [N/C, S, C, K] (tests only)."""
    e, n, k = w.shape
    chunk = row_chunk(n)
    blocks = w.reshape(e, n // chunk, chunk, k).transpose(0, 1)  # [N/C, E, C, K]
    out = (blocks[:, slot_expert] * v[None, :, None, :]).sum(-1, dtype=torch.float32)
    return out.transpose(0, 1).reshape(v.shape[0], n)  # [S, N]


def streamed_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 experts: torch.Tensor, weights: torch.Tensor, activation: str = "silu",
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 clamp: float | None = None, alpha: float = ref.GPT_OSS_ALPHA) -> torch.Tensor:
    """The decode path under ``torch.compile`` (the CPU graph strategy): each token slot's
    expert rows dotted with its token (:func:`slot_rows`), which inductor makes into C++
    reduction loops reading the stacked weights in place through the slot's expert index —
    no gathered weight copies, and bandwidth-bound where ATen's grouped GEMM of a few rows
    per expert is compute-bound.

    The S = T*k slots are sorted by expert, so one expert's slots are adjacent. A sentinel slot
    (expert E: another rank's; sorted last) reads the rows of the last expert read before it
    (in cache) and is masked to 0; a call with no slot on this rank reads expert 0 for
    nothing (static shapes cannot skip it). Returns [T, H] in x.dtype; float32 sums; the
    activation is rounded to the weights' dtype as the grouped path does (eager: inductor keeps
    it in float32, which is closer to the reference)."""
    (t, k), (n_local, _, hidden) = experts.shape, gate_up.shape
    flat = experts.reshape(-1)  # [S]
    order = torch.argsort(flat, stable=True)  # [S]: slot ids by expert, the sentinel's last
    rank = torch.argsort(order)  # [S]: where each slot went
    slot_expert = flat[order]  # [S]
    here = slot_expert < n_local  # [S]
    read = torch.where(here, slot_expert, torch.where(here, slot_expert, 0).max())  # [S]
    # each token once per slot, sorted, float32: written by a scatter, which inductor always
    # writes out (a gather it would fold into the loop, converting x again for every row)
    xs = x.new_empty(flat.shape[0], hidden, dtype=torch.float32).index_copy_(
        0, rank, x.float().repeat_interleave(k, 0))  # [S, H]
    h = slot_rows(gate_up, read, xs)  # [S, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias.float()[read]
    # rank[order] is the identity, but inductor cannot see it: the indirect read makes it lay
    # the activation out [S, I] (contiguous along down's reduction), not in h's chunked order
    a = ref.glu(h[rank[order]], activation, clamp, alpha).to(gate_up.dtype)  # [S, I]
    y = slot_rows(down, read, a.float())  # [S, H]
    if down_bias is not None:
        y = y + down_bias.float()[read]
    y = torch.where(here[:, None], y, 0.0)[rank].view(t, k, hidden)  # [T, k, H], slot order
    return (y * weights.float()[:, :, None]).sum(1).to(x.dtype)


def token_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              experts: torch.Tensor, weights: torch.Tensor, activation: str = "silu",
              gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              clamp: float | None = None, alpha: float = ref.GPT_OSS_ALPHA) -> torch.Tensor:
    """The decode path under ``torch.compile`` for one token (batch 1): its k slots, each
    expert's whole [2I, H] then [H, I] matrix dotted with the token, read in place through the
    slot's expert index. x [1, H], experts / weights [1, k] → [1, H] in x.dtype.

    Top-k experts are distinct, so no two slots share an expert and :func:`streamed_mlp`'s
    sort and chunking (which let slots of one expert share a read) only cost here: inductor
    makes each product one reduction loop over the expert's rows, one long contiguous stream per
    slot. Measured (Mixtral-like H=1024 I=2048, fp32, 1 thread, CPU clock, on a machine at load
    ~10-15): 1.04-1.3x the streamed path under plain ``torch.compile``, 1.06x under the CPU
    graph strategy in one interleaved run and 0.95x in another (bf16 0.92x); on the whole
    Mixtral preset's decode step 1.035x (51.0 vs 52.8 ms CPU per step) — a small gain at best,
    both paths being bound by one core's streaming rate. A sentinel slot (another rank's expert) reads the
    highest-numbered local expert a slot of this token routed to (expert 0 where none is here)
    and is masked to 0. Float32 sums; the activation rounded to the weights' dtype as the other
    paths do. Eager it would materialise each slot's expert (tests only)."""
    n_local = gate_up.shape[0]
    flat = experts.reshape(-1)  # [k]
    here = flat < n_local  # [k]
    read = torch.where(here, flat, torch.where(here, flat, 0).max())  # [k]
    xs = x.float().expand(flat.shape[0], -1)  # [k, H]: the token once per slot
    h = (gate_up[read] * xs[:, None, :]).sum(-1, dtype=torch.float32)  # [k, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias.float()[read]
    a = ref.glu(h, activation, clamp, alpha).to(gate_up.dtype).float()  # [k, I]
    y = (down[read] * a[:, None, :]).sum(-1, dtype=torch.float32)  # [k, H]
    if down_bias is not None:
        y = y + down_bias.float()[read]
    scale = torch.where(here, weights.reshape(-1).float(), 0.0)  # [k]
    return (y * scale[:, None]).sum(0, keepdim=True).to(x.dtype)  # [1, H]


def moe_grouped_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    experts: torch.Tensor, weights: torch.Tensor, *, activation: str = "silu",
                    gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, clamp: float | None = None,
                    alpha: float = ref.GPT_OSS_ALPHA) -> torch.Tensor:
    """The routed experts' output; contract of the reference ``moe_grouped_mlp``: x [T, H],
    gate_up [E, 2I, H], down [E, H, I], experts (local ids, E the sentinel) and weights [T, k].
    Under ``torch.compile`` one token takes :func:`token_mlp`, other decode sizes
    :func:`streamed_mlp`, else two grouped GEMMs over
    the expert-sorted slots (the module docstring says which when). Returns [T, H] in
    x.dtype."""
    ref.check_grouped_mlp(x, gate_up, down, experts, weights, activation, gate_up_bias,
                          down_bias, clamp)
    if torch.compiler.is_compiling() and experts.shape[0] == 1:
        return token_mlp(x, gate_up, down, experts, weights, activation, gate_up_bias,
                         down_bias, clamp, alpha)
    if torch.compiler.is_compiling() and (
            experts.numel() <= STREAMED_SLOTS_PER_EXPERT * gate_up.shape[0]
            or gate_up.dtype not in GROUPED_MM_TRACES):
        return streamed_mlp(x, gate_up, down, experts, weights, activation, gate_up_bias,
                            down_bias, clamp, alpha)
    if not grouped_mm_fits(gate_up):
        return _gathered_mlp(x, gate_up, down, experts, weights, activation, gate_up_bias,
                             down_bias, clamp, alpha)
    k = experts.shape[1]
    dtype = gate_up.dtype
    order, offs = sorted_slots(experts, gate_up.shape[0])  # [T*k], [E]
    tokens = order // k  # [T*k]: the token of each sorted slot
    h = F.grouped_mm(x.to(dtype)[tokens], gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    slot_expert = experts.reshape(-1)[order]  # [T*k]
    here = slot_expert < gate_up.shape[0]  # [T*k]: False for the sentinel's slots (sorted
    # last, past every segment: grouped_mm leaves their rows unwritten, garbage to mask)
    slot_expert = slot_expert.clamp(max=gate_up.shape[0] - 1)
    if gate_up_bias is not None:
        h = h + gate_up_bias.to(dtype)[slot_expert]
    h = ref.glu(h, activation, clamp, alpha)  # [T*k, I]
    y = F.grouped_mm(h, down.transpose(1, 2), offs=offs)  # [T*k, H]
    if down_bias is not None:
        y = y + down_bias.to(dtype)[slot_expert]
    y = torch.where(here[:, None], y.float() * weights.reshape(-1)[order].float()[:, None], 0.0)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, y).to(x.dtype)


# ----- quantized experts: quant_moe_mlp on the native int8/int4 kernel --------------------------

#: activation dtypes ``quant_moe_mlp`` claims (as ``quant_linear``: an fp32 model casts to bf16)
QUANT_DTYPES = frozenset({torch.bfloat16})
#: the native layout's kind (``PackedQuantExperts.meta["kind"]``)
NATIVE = "native"


def native_reason(specs) -> str | None:
    """Why the native kernel cannot run the experts' (gate_up, down) specs here (None: it can):
    it does not build (or ``SHARDWISE_CPU_QUANT_KERNEL=torch``), or a matrix's group has no
    activation block (:func:`~shardwise.kernels.reference.quant.activation_block`)."""
    if not native.load():
        return "the native kernel is not in use here (its log line says why)"
    blocked = [s for s in specs if not cpu_quant.uses_native(s)]
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
    parts = [cpu_quant.unpack_native(_packed_expert(packed, e)) for e in range(packed.experts)]
    zeros = torch.cat([p.zeros for p in parts]) if parts[0].zeros is not None else None
    return QuantizedWeight(torch.cat([p.qweight for p in parts]),
                           torch.cat([p.scales for p in parts]), zeros, packed.spec.bits,
                           packed.spec.group_size)


def _native_linear(x: torch.Tensor, q, s, z, bias, e: int, bits: int, group: int, ablock: int,
                   n: int) -> torch.Tensor:
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
        h = _native_linear(rows, *gu, e, bits, gu_group, gu_ablock, 2 * inter)  # [M, 2I]
        a = ref.glu(h, activation, clamp, alpha).contiguous()  # [M, I] float32
        return _native_linear(a, *dn, e, bits, dn_group, dn_ablock, hidden)  # [M, H]

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
    weight-only kernels (:data:`shardwise.kernels.cpu.quant.quant_moe_mlp`, their rules).

    **Numerics (native)**: as the native linears, the activations entering each expert matrix
    are quantized to int8 per block of 32 columns (``amax / 127`` scales): the token for
    gate_up, the float32 GLU output for down. The oracle is that math in torch:
    :func:`shardwise.kernels.reference.moe.int8_activation_moe_mlp` (:meth:`oracle`); the
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
        if device_type not in DEVICE_TYPES or dtype not in QUANT_DTYPES:
            return cpu_quant.quant_moe_mlp.unsupported_reason(device_type=device_type,
                                                              dtype=dtype, specs=specs)
        why_not_native = native_reason(specs)
        if why_not_native is None:
            return None
        if native.load() and any(cpu_quant.uses_native(s) for s in specs):
            return f"{why_not_native} (both expert matrices must run on one kernel)"
        return cpu_quant.quant_moe_mlp.unsupported_reason(device_type=device_type, dtype=dtype,
                                                          specs=specs)

    def prepack(self, qw: QuantizedWeight, experts: int,
                device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> PackedQuantExperts:
        """The native layout (class docstring) where the native kernel takes this spec, else
        torch's packed kernels' layout (theirs, ``meta["kind"]`` int8/int4, for ``dtype``).
        The native layout is packed for any input dtype (``dtype`` None): float32, bf16 and
        fp16 activations go in as they are (each is quantized to int8 from float32 inside), so
        an fp32 model's experts take its fp32 activations, not a bf16 rounding of them."""
        if not cpu_quant.uses_native(expert_spec(qw, experts)):
            return cpu_quant.quant_moe_mlp.prepack(qw, experts, device, dtype)
        return dataclasses.replace(super().prepack(qw, experts, device, dtype), dtype=None)

    def _pack(self, qw: QuantizedWeight, experts: int, dtype: torch.dtype | None):
        n = qw.out_features // experts
        packs = [cpu_quant.quant_linear.prepack(ref.expert_rows(qw, e, n), qw.qweight.device,
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
            return cpu_quant.quant_moe_mlp.dequantize(packed)
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
            return ref.int8_activation_moe_mlp(x, _stacked_weight(gate_up),
                                               _stacked_weight(down), experts, weights, blocks,
                                               **kwargs)
        return native_math

    def _mlp(self, x, gate_up, down, experts, weights, activation, gate_up_bias, down_bias,
             clamp, alpha) -> torch.Tensor:
        kinds = (gate_up.meta.get("kind"), down.meta.get("kind"))
        if NATIVE not in kinds:  # torch's packed kernels
            return cpu_quant.quant_moe_mlp(x, gate_up, down, experts, weights,
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


def moe_route(logits: torch.Tensor, top_k: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference router (sync-free, static shapes): registered as capturable."""
    return ref.moe_route(logits, top_k, **kwargs)


#: op → (implementation, dtypes it is registered for)
REGISTERED = {
    "moe_grouped_mlp": (moe_grouped_mlp, MOE_DTYPES),
    "moe_route": (moe_route, MOE_DTYPES),
}
#: ops whose implementation may run inside the CPU graph strategy's compiled step
CAPTURABLE: frozenset[str] = frozenset({"moe_grouped_mlp", "moe_route"})


def register(registry) -> None:
    """Register the CPU MoE ops (fp32, bf16), capturable, and ``quant_moe_mlp`` (bf16,
    capturable: :class:`CpuQuantMoE`; registered after the ``quant`` family, it takes the
    place of that family's torch-kernels-only implementation, which it runs where the native
    kernel does not)."""
    for op, (fn, dtypes) in REGISTERED.items():
        registry.register(op, BACKEND, fn, dtypes=dtypes, device_types=DEVICE_TYPES,
                          capturable=op in CAPTURABLE)
    registry.register("quant_moe_mlp", BACKEND, quant_moe_mlp, dtypes=QUANT_DTYPES,
                      device_types=DEVICE_TYPES, supports=quant_moe_mlp.supports,
                      capturable=True)

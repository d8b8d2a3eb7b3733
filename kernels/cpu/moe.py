"""The ``cpu`` backend's MoE ops: ``moe_route`` and ``moe_grouped_mlp`` without host syncs.
Quantized experts (``quant_moe_mlp``, the ``quant`` family) are in
:mod:`shardwise.kernels.cpu.quant`.

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
  - **Compiled decode of one token** (batch 1): where the caller holds every expert
    (``sentinel=False``: one process), :func:`token_mlp`, the streamed path without its sort and
    chunks (top-k experts are distinct, nothing to share; each slot's expert one contiguous
    stream); else (expert parallelism: a slot's expert may be another rank's)
    :func:`sentinel_token_mlp`, each slot under its own ``torch.cond``, so a sentinel slot reads
    no weight at all. The branch is taken inside the captured graph (a scalar read on the host:
    no device to wait for on CPU); shapes stay static.
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
* moe_route (fp32, bf16): the reference's own code (already sync-free and static in shape),
  registered as capturable.

Speed against the reference and HF's ``eager``/``grouped_mm`` experts, eager and compiled:
benchmarks/README.md, "MoE kernels" (``python benchmarks/kernel_moe.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.kernels.reference import moe as ref

from . import DEVICE_TYPES

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


def _present(gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None
             ) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
    """(names, tensors) of the biases given: ``torch.cond`` operands are tensors only."""
    given = {"gate_up_bias": gate_up_bias, "down_bias": down_bias}
    names = tuple(n for n, b in given.items() if b is not None)
    return names, tuple(given[n] for n in names)


def _slot_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, expert: torch.Tensor,
              *biases: torch.Tensor, names: tuple[str, ...], activation: str,
              clamp: float | None, alpha: float) -> torch.Tensor:
    """One slot of one token: x [1, H], expert [1] (a local id) → its expert's output [1, H]
    float32, unweighted; ``biases``: the ones ``names`` names (gate_up_bias [E, 2I], down_bias
    [E, H]). The same reduction loops as :func:`token_mlp` (a branch of
    :func:`sentinel_token_mlp`)."""
    bias = dict(zip(names, biases))
    h = (gate_up[expert] * x.float()[:, None, :]).sum(-1, dtype=torch.float32)  # [1, 2I]
    if "gate_up_bias" in bias:
        h = h + bias["gate_up_bias"].float()[expert]
    a = ref.glu(h, activation, clamp, alpha).to(gate_up.dtype).float()  # [1, I]
    y = (down[expert] * a[:, None, :]).sum(-1, dtype=torch.float32)  # [1, H]
    if "down_bias" in bias:
        y = y + bias["down_bias"].float()[expert]
    return y


def _no_slot(x: torch.Tensor, *operands: torch.Tensor, **math) -> torch.Tensor:
    """A sentinel slot (another rank's expert): [1, H] zeros, no weight read."""
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device)


def sentinel_token_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                       experts: torch.Tensor, weights: torch.Tensor, activation: str = "silu",
                       gate_up_bias: torch.Tensor | None = None,
                       down_bias: torch.Tensor | None = None, clamp: float | None = None,
                       alpha: float = ref.GPT_OSS_ALPHA) -> torch.Tensor:
    """One token whose slots may name another rank's expert (the sentinel ``E_local``): each
    of its k slots under ``torch.cond`` — this rank's expert runs :func:`_slot_mlp`, the
    sentinel nothing, so no weight is read for it (:func:`token_mlp` reads some expert and
    masks it: at ep=2 and top-2 of 8 that is about half an expert's bytes per layer wasted).
    x [1, H], experts / weights [1, k] → [1, H] in x.dtype. Measured (H=1024, I=2048, 4 of 8
    experts here, fp32, 1 thread, CPU time, captured by the CPU graph strategy, interleaved,
    load ~6): both slots here 1429 vs 1424 us (token_mlp), one here 776 vs 1249, none 100 vs
    1205."""
    from functools import partial

    n_local = gate_up.shape[0]
    names, biases = _present(gate_up_bias, down_bias)
    math = dict(names=names, activation=activation, clamp=clamp, alpha=alpha)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [1, H]
    for slot in range(experts.shape[1]):
        expert = experts[0, slot:slot + 1]  # [1]
        y = torch.cond(expert[0] < n_local, partial(_slot_mlp, **math),
                       partial(_no_slot, **math),
                       (x, gate_up, down, expert.clamp(max=n_local - 1), *biases))
        out = out + y * weights[0, slot].float()
    return out.to(x.dtype)


def moe_grouped_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    experts: torch.Tensor, weights: torch.Tensor, *, activation: str = "silu",
                    gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, clamp: float | None = None,
                    alpha: float = ref.GPT_OSS_ALPHA, sentinel: bool = True) -> torch.Tensor:
    """The routed experts' output; contract of the reference ``moe_grouped_mlp``: x [T, H],
    gate_up [E, 2I, H], down [E, H, I], experts (local ids, E the sentinel) and weights [T, k];
    ``sentinel`` False: the caller holds every expert (no id is the sentinel), so one token
    takes :func:`token_mlp` without :func:`sentinel_token_mlp`'s branches (a sentinel id would
    still add nothing: token_mlp masks it).
    Under ``torch.compile`` one token takes one of those two, other decode sizes
    :func:`streamed_mlp`, else two grouped GEMMs over
    the expert-sorted slots (the module docstring says which when). Returns [T, H] in
    x.dtype."""
    ref.check_grouped_mlp(x, gate_up, down, experts, weights, activation, gate_up_bias,
                          down_bias, clamp)
    if torch.compiler.is_compiling() and experts.shape[0] == 1:
        return (sentinel_token_mlp if sentinel else token_mlp)(
            x, gate_up, down, experts, weights, activation, gate_up_bias, down_bias, clamp, alpha)
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
    """Register the CPU MoE ops (fp32, bf16), capturable. Quantized experts (``quant_moe_mlp``)
    are the ``quant`` family's: :mod:`shardwise.kernels.cpu.quant`."""
    for op, (fn, dtypes) in REGISTERED.items():
        registry.register(op, BACKEND, fn, dtypes=dtypes, device_types=DEVICE_TYPES,
                          capturable=op in CAPTURABLE)

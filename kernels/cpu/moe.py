"""The ``cpu`` backend's MoE ops: ``moe_route`` and ``moe_grouped_mlp`` without host syncs.

Contracts are those of ``shardwise.kernels.reference.moe`` (shapes, layouts, options).

* moe_grouped_mlp (fp32, bf16): one path for prefill and decode, with static shapes only: the
  T*k token slots are sorted by expert (``argsort``, the permutation of ``moe_permute``), the
  per-expert slot counts become ``offs`` by a scatter-add and a cumsum on the device, and
  ``torch.nn.functional.grouped_mm`` (public in torch 2.13, CPU included) runs each expert's
  GEMM over its segment of the sorted slots, reading the stacked [E, 2I, H] / [E, H, I] weights
  in place (transposed views, no copy). Experts that get no slot are skipped inside the op, so
  the bytes read are those of the experts hit. The activation is applied on the [T*k, 2I]
  intermediate, the k weights multiply the [T*k, H] result and an ``index_add_`` combines the
  slots into their tokens. No ``.item()``, ``nonzero`` or routing-dependent shape: dropless
  (every slot computed, one expert may take all of them) and capturable, so the same call serves
  prefill and the graph-captured decode step. The sentinel expert index E (another rank's
  expert, expert parallelism) sorts after every segment, so no GEMM reads weights for it, and
  its rows are masked to 0. Math in the input dtype (bf16 GEMMs accumulate in
  float32 inside the op); the combine in float32, rounded once.
* moe_route (fp32, bf16): the reference's own code (already sync-free and static in shape),
  registered as capturable.

Why registered where it is not faster: in fp32 the grouped path ties the reference at decode
(both read the same bytes with torch's GEMMs) and in bf16 it is about 2x faster; it ties HF's
``grouped_mm`` experts, which call the same torch op. It is registered in both dtypes for what
the reference cannot give: static shapes and no host sync, hence graph capture.

Speed against the reference and HF's ``eager``/``grouped_mm`` experts: benchmarks/README.md,
"MoE kernels" (``python benchmarks/kernel_moe.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.kernels.reference import moe as ref

from . import DEVICE_TYPES

BACKEND = "cpu"
MOE_DTYPES = frozenset({torch.float32, torch.bfloat16})


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


def moe_grouped_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    experts: torch.Tensor, weights: torch.Tensor, *, activation: str = "silu",
                    gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, clamp: float | None = None,
                    alpha: float = ref.GPT_OSS_ALPHA) -> torch.Tensor:
    """The routed experts' output by two grouped GEMMs over the expert-sorted slots; contract of
    the reference ``moe_grouped_mlp``: x [T, H], gate_up [E, 2I, H], down [E, H, I], experts and
    weights [T, k]. Returns [T, H] in x.dtype."""
    ref.check_grouped_mlp(x, gate_up, down, experts, weights, activation, gate_up_bias,
                          down_bias, clamp)
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
    """Register the CPU MoE ops (fp32, bf16), capturable."""
    for op, (fn, dtypes) in REGISTERED.items():
        registry.register(op, BACKEND, fn, dtypes=dtypes, device_types=DEVICE_TYPES,
                          capturable=op in CAPTURABLE)

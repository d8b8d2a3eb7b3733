"""Mixture-of-Experts (reference): ``moe_route``, ``moe_permute``, ``moe_grouped_mlp``.

Pure torch, clear over fast: the oracles every backend is tested against. T tokens, E experts,
each token sent to k of them; H the hidden size, I an expert's intermediate size.

* ``moe_route(logits [T, E], k)`` → (weights [T, k] fp32, experts [T, k] int64): softmax or
  sigmoid scoring, an optional correction bias (DeepSeek-V3: for the choice only), group-limited
  top-k, renormalisation and a scale.
* ``moe_permute(experts [T, k], E)`` → (order [T*k], counts [E], offsets [E+1]): the token slots
  sorted by expert (a stable sort, never one-hot masks), the prefill path's grouping.
* ``moe_grouped_mlp(x [T, H], gate_up [E, 2I, H], down [E, H, I], experts, weights)`` → [T, H]:
  each token's k experts' SwiGLU MLPs, weighted and summed (the routed experts only: a shared
  expert is a dense MLP outside the op). Under expert parallelism E is the experts this rank
  holds and ``experts`` are local indices; the index E (the sentinel) marks a slot whose expert
  lives on another rank: it contributes nothing, in every backend.

Expert weight layout is the one Hugging Face's ``MixtralExperts``, ``Qwen2MoeExperts``,
``Qwen3MoeExperts`` and ``DeepseekV3Experts`` store: ``gate_up_proj`` [E, 2I, H] (``F.linear``
orientation, the I gate rows first, then the I up rows), ``down_proj`` [E, H, I]. GPT-OSS stores
its experts transposed ([E, H, 2I], [E, I, H]) with gate and up interleaved (even/odd columns):
:func:`gpt_oss_layout` converts them (once, at load) to this layout.

Which path runs where: the reference's ``moe_grouped_mlp`` loops over experts with data-dependent
shapes (it is the oracle only). The CPU backend's implementation has two paths: prefill (many
tokens) sorts the token slots by expert (``moe_permute``) and runs one GEMM per expert segment;
decode (few tokens) is dropless and free of host synchronisation (no ``.item()``, ``nonzero``
or shape that depends on the routing), so a graph capture can take it — see
``shardwise.kernels.cpu.moe``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.errors import KernelError

from .example import randn

BACKEND = "reference"
SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu", "gelu")
#: GPT-OSS's ``swiglu_alpha``: the slope of its clamped SwiGLU's sigmoid
GPT_OSS_ALPHA = 1.702


# ----- routing --------------------------------------------------------------------------------


def _check_route(logits: torch.Tensor, top_k: int, scoring: str, bias, n_group: int,
                 topk_group: int) -> None:
    if logits.dim() != 2:
        raise KernelError(f"moe_route needs logits [tokens, experts], got {tuple(logits.shape)}")
    n_experts = logits.shape[1]
    if scoring not in SCORINGS:
        raise KernelError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not 1 <= top_k <= n_experts:
        raise KernelError(f"top_k must be in 1..{n_experts} (the experts), got {top_k}")
    if bias is not None and tuple(bias.shape) != (n_experts,):
        raise KernelError(f"bias must be [{n_experts}] (one per expert), got {tuple(bias.shape)}")
    if n_group < 1 or n_experts % n_group:
        raise KernelError(f"n_group must divide the {n_experts} experts, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise KernelError(f"topk_group must be in 1..n_group={n_group}, got {topk_group}")
    if n_group > 1 and n_experts // n_group < 2:
        raise KernelError(f"group-limited top-k ranks groups by their top-2 scores: each of the "
                          f"{n_group} groups needs at least 2 of the {n_experts} experts")
    if top_k > topk_group * (n_experts // n_group):
        raise KernelError(f"top_k={top_k} exceeds the experts of the {topk_group} chosen groups")


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice [T, E] → bool [T, E]: the experts of each token's best ``topk_group`` groups, a
    group scored by the sum of its two best experts (DeepSeek-V3)."""
    t, e = choice.shape
    group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
    best = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
    mask = torch.zeros(t, n_group, dtype=torch.bool, device=choice.device)
    mask.scatter_(1, best, True)
    return mask.repeat_interleave(e // n_group, dim=1)  # [T, E]


def moe_route(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax",
              bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
              renormalize: bool = False, scale: float = 1.0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router: which ``top_k`` experts each token goes to, with what weight.

    logits [T, E] (any float dtype; scored in float32). ``scoring`` "softmax" (Mixtral, Qwen-MoE)
    or "sigmoid" (DeepSeek-V3). ``bias`` [E] or None: added to the scores for the choice only,
    never to the weights (DeepSeek's ``e_score_correction_bias``). ``n_group``/``topk_group``:
    group-limited top-k — only the experts of the ``topk_group`` groups (of ``n_group`` equal
    groups) with the largest sum of their two best (biased) scores compete. ``renormalize``
    divides the k weights by their sum (+1e-20, as DeepSeek-V3); ``scale`` multiplies them
    (DeepSeek's ``routed_scaling_factor``).

    Returns (weights [T, k] float32, experts [T, k] int64), the k in descending order of the
    choice score (ties: the lower expert index first).
    """
    _check_route(logits, top_k, scoring, bias, n_group, topk_group)
    scores = logits.float().softmax(-1) if scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        choice = choice.masked_fill(~_group_mask(choice, n_group, topk_group), float("-inf"))
    experts = choice.topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, experts)  # [T, k]
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, experts


# ----- permutation ----------------------------------------------------------------------------


def moe_permute(experts: torch.Tensor, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token slots grouped by expert, by a stable sort (no one-hot masks).

    experts [T, k] int (a token's k choices). Returns ``order`` [T*k] int64: the flat slot
    indices (slot ``t * k + j`` is token t's j-th choice) sorted by expert, slots of one expert
    in token order; ``counts`` [E] int64: slots per expert; ``offsets`` [E+1] int64: expert e's
    slots are ``order[offsets[e]:offsets[e+1]]``. Token of a slot: ``order // k``.
    """
    if experts.dim() != 2:
        raise KernelError(f"moe_permute needs experts [tokens, k], got {tuple(experts.shape)}")
    flat = experts.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise KernelError(f"expert indices must be in 0..{num_experts - 1}, got "
                          f"{int(flat.min())}..{int(flat.max())}")
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).to(torch.int64)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=experts.device)
    offsets[1:] = counts.cumsum(0)
    return order, counts, offsets


# ----- the experts' MLPs ----------------------------------------------------------------------


def check_grouped_mlp(x, gate_up, down, experts, weights, activation, gate_up_bias, down_bias,
                      clamp) -> None:
    """Shapes and options of ``moe_grouped_mlp``: a named KernelError before any work."""
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise KernelError(f"moe_grouped_mlp needs x [T, H], gate_up [E, 2I, H], down [E, H, I]; "
                          f"got {tuple(x.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    e, two_i, h = gate_up.shape
    if two_i % 2 or h != x.shape[1] or tuple(down.shape) != (e, h, two_i // 2):
        raise KernelError(f"expert weights must be gate_up [E, 2I, H] (gate rows, then up rows) "
                          f"and down [E, H, I] for x [T, {x.shape[1]}]; got "
                          f"{tuple(gate_up.shape)}, {tuple(down.shape)} (GPT-OSS's layout: "
                          f"convert with gpt_oss_layout)")
    if experts.dim() != 2 or experts.shape[0] != x.shape[0] or weights.shape != experts.shape:
        raise KernelError(f"experts and weights must both be [T={x.shape[0]}, k], got "
                          f"{tuple(experts.shape)}, {tuple(weights.shape)}")
    if activation not in ACTIVATIONS:
        raise KernelError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if clamp is not None and (activation != "silu" or clamp <= 0):
        raise KernelError(f"clamp (GPT-OSS's clamped SwiGLU) needs activation='silu' and a "
                          f"limit > 0, got {activation!r}, {clamp!r}")
    if gate_up_bias is not None and tuple(gate_up_bias.shape) != (e, two_i):
        raise KernelError(f"gate_up_bias must be [{e}, {two_i}], got {tuple(gate_up_bias.shape)}")
    if down_bias is not None and tuple(down_bias.shape) != (e, h):
        raise KernelError(f"down_bias must be [{e}, {h}], got {tuple(down_bias.shape)}")


def check_expert_indices(experts: torch.Tensor, num_local: int) -> None:
    """experts [T, k] in 0..num_local (``num_local``: another rank's expert), else a named
    KernelError. Reads the indices on the host: the reference (the oracle) only."""
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) > num_local):
        raise KernelError(f"expert indices must be in 0..{num_local - 1} (the {num_local} experts "
                          f"held here) or {num_local} (an expert on another rank: contributes "
                          f"nothing); got {int(experts.min())}..{int(experts.max())}")


def glu(gate_up: torch.Tensor, activation: str = "silu", clamp: float | None = None,
        alpha: float = GPT_OSS_ALPHA) -> torch.Tensor:
    """[..., 2I] (gate, then up) → [..., I]: ``act(gate) * up``; with ``clamp`` GPT-OSS's
    clamped SwiGLU: gate ≤ clamp, |up| ≤ clamp, ``gate * sigmoid(alpha * gate) * (up + 1)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
        return gate * torch.sigmoid(alpha * gate) * (up + 1)
    return (F.silu(gate) if activation == "silu" else F.gelu(gate)) * up


def moe_grouped_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    experts: torch.Tensor, weights: torch.Tensor, *, activation: str = "silu",
                    gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, clamp: float | None = None,
                    alpha: float = GPT_OSS_ALPHA, sentinel: bool = True) -> torch.Tensor:
    """The routed experts' output: ``sum_j weights[t, j] * mlp_{experts[t, j]}(x[t])``.
    ``sentinel``: a hint, False when the caller holds every expert (no id is the sentinel); a
    kernel may take a shorter path then (the CPU backend's one-token decode), never another
    result: the sentinel still adds nothing. The reference computes the same either way.

    x [T, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I]; experts [T, k] int
    in 0..E, where ``E`` (= ``gate_up.shape[0]``, the experts held here) is the sentinel of a
    slot whose expert lives on another rank (expert parallelism): it contributes nothing;
    weights [T, k] (any float dtype); gate_up_bias [E, 2I] / down_bias [E, H] or None (GPT-OSS);
    ``mlp_e(x) = down_e @ glu(gate_up_e @ x + b) + b`` with :func:`glu` (``activation`` "silu"
    or "gelu", ``clamp``/``alpha`` GPT-OSS's clamped SwiGLU). Every slot is computed (dropless:
    a token's experts all run however many tokens an expert gets). Returns [T, H] in x.dtype;
    float32 math, rounded once.
    """
    check_grouped_mlp(x, gate_up, down, experts, weights, activation, gate_up_bias, down_bias,
                      clamp)
    check_expert_indices(experts, gate_up.shape[0])
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    xf, w = x.float(), weights.float()
    for e in range(gate_up.shape[0]):  # the sentinel E matches none: its slots add nothing
        tokens, slots = (experts == e).nonzero(as_tuple=True)  # the oracle may sync
        if not tokens.numel():
            continue
        h = xf[tokens] @ gate_up[e].float().T  # [n, 2I]
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].float()
        y = glu(h, activation, clamp, alpha) @ down[e].float().T  # [n, H]
        if down_bias is not None:
            y = y + down_bias[e].float()
        out.index_add_(0, tokens, y * w[tokens, slots, None])
    return out.to(x.dtype)


def expert_rows(qw, e: int, n: int):
    """Expert ``e``'s ``[n, K]`` ``QuantizedWeight`` of the stacked ``[E * n, K]`` one (views:
    ``quantize_experts`` gives each expert its own rows)."""
    from .quant import QuantizedWeight  # quant imports this module

    part = slice(e * n, (e + 1) * n)
    zeros = qw.zeros[part] if qw.zeros is not None else None
    return QuantizedWeight(qw.qweight[part], qw.scales[part], zeros, qw.bits, qw.group_size)


def int8_activation_moe_mlp(x: torch.Tensor, gate_up, down, experts: torch.Tensor,
                            weights: torch.Tensor, blocks: tuple[int, int], *,
                            activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                            down_bias: torch.Tensor | None = None, clamp: float | None = None,
                            alpha: float = GPT_OSS_ALPHA) -> torch.Tensor:
    """The CPU native quantized experts' math (8-bit activations), in torch: the oracle of
    ``quant_moe_mlp`` on natively packed experts (``shardwise.kernels.cpu.quant``).

    x [T, H]; gate_up / down: ``QuantizedWeight`` of the stacked experts ([E * 2I, H] and
    [E * H, I], each expert its own rows: ``quantize_experts``); experts [T, k] in 0..E (E: the
    sentinel, another rank's expert: nothing); weights [T, k]; blocks: the activation block of
    each matrix (``activation_block(bits, group)``). Per slot: ``h = int8_activation_linear(
    x[t], gate_up_e, blocks[0]) (+ b)`` — x in float32, quantized to int8 per block —, ``a =
    glu(h)`` in float32, ``y = int8_activation_linear(a, down_e, blocks[1]) (+ b)``; the slots'
    ``weights * y`` summed in float32, rounded once to x.dtype. Memory: one slot at a time."""
    from .quant import int8_activation_linear  # quant imports this module

    n_experts = gate_up.out_features // (2 * down.in_features)
    check_expert_indices(experts, n_experts)
    two_i, h = gate_up.out_features // n_experts, down.out_features // n_experts
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
    xf, w = x.float(), weights.float()
    for t, j in zip(*(experts < n_experts).nonzero(as_tuple=True)):  # the oracle may sync
        e = int(experts[t, j])
        hid = int8_activation_linear(xf[t, None], expert_rows(gate_up, e, two_i),
                                     blocks[0])  # [1, 2I]
        if gate_up_bias is not None:
            hid = hid + gate_up_bias[e].float()
        y = int8_activation_linear(glu(hid, activation, clamp, alpha), expert_rows(down, e, h),
                                   blocks[1])  # [1, H]
        if down_bias is not None:
            y = y + down_bias[e].float()
        out[t] += w[t, j] * y[0]
    return out.to(x.dtype)


def gpt_oss_layout(gate_up_proj: torch.Tensor, gate_up_proj_bias: torch.Tensor,
                   down_proj: torch.Tensor, down_proj_bias: torch.Tensor):
    """GPT-OSS's expert tensors → this family's layout: gate_up_proj [E, H, 2I] with gate/up
    interleaved (even/odd columns) → [E, 2I, H] gate rows then up rows; its bias [E, 2I] the
    same way; down_proj [E, I, H] → [E, H, I]; down_proj_bias [E, H] unchanged."""
    def deinterleave(t):  # [..., 2I] interleaved → [..., 2I] gate half then up half
        return torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
    return (deinterleave(gate_up_proj).transpose(1, 2).contiguous(),
            deinterleave(gate_up_proj_bias).contiguous(),
            down_proj.transpose(1, 2).contiguous(), down_proj_bias)


OPS = {"moe_route": moe_route, "moe_permute": moe_permute, "moe_grouped_mlp": moe_grouped_mlp}


def register(registry) -> None:
    """Define the MoE ops with their references."""
    for op, fn in OPS.items():
        registry.register(op, BACKEND, fn)


# ----- example inputs (conformance suite): op -> (dtype, device) -> (args, kwargs) ---------------

def _route_example(dtype, device):
    return (randn(5, 8, seed=31).to(device, dtype), 2), {"renormalize": True}


def _permute_example(dtype, device):
    experts = torch.tensor([[3, 1], [1, 0], [3, 2], [1, 3]], device=device)
    return (experts, 4), {}


def _grouped_mlp_example(dtype, device):
    x, gate_up, down = randn(3, 16, seed=32), randn(4, 24, 16, seed=33), randn(4, 16, 12, seed=34)
    experts = torch.tensor([[0, 2], [2, 3], [1, 2]], device=device)
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]], device=device)
    return (x.to(device, dtype), (gate_up * 0.2).to(device, dtype),
            (down * 0.2).to(device, dtype), experts, weights), {}


EXAMPLES = {"moe_route": _route_example, "moe_permute": _permute_example,
            "moe_grouped_mlp": _grouped_mlp_example}

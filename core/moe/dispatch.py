"""Expert-parallel dispatch: how the ranks of an ep group, each holding a share of the experts
(``plan.experts.range``), combine the routed experts' outputs.

Two paths, chosen by ``moe={"dispatch": ...}`` (:func:`resolve_dispatch`):

* **all_reduce** — every rank holds the same tokens (the engine broadcasts rank 0's inputs):
  each rank runs its own experts on every token (slots whose expert is on another rank carry
  the sentinel ``E_local`` and contribute nothing) and one all-reduce of [T, H] sums the ranks'
  partial outputs.
* **all_to_all** — tokens travel to their experts' ranks and back (DeepSpeed-MoE's dispatch):
  each rank sends its tokens to every ep rank with the expert indices local to that rank
  (sentinel for the experts it does not hold), the receiver runs its experts on what it got,
  and a second all-to-all returns each token's partial outputs to its owner, which sums them.
  When every rank holds the same tokens (``tokens="replicated"``) each rank first keeps only
  its share of them (T split over the ranks, padded to a multiple of ep) and an all-gather puts
  the [T, H] output back together; with ``tokens="local"`` (ranks holding different tokens:
  data-parallel attention, serving) the rank's own tokens travel and come back alone.

Both paths are dropless and have static shapes (no host synchronisation, no shape that depends
on the routing): the all-to-all buffers are sized for the worst case, every token to every rank
(T_local rows per rank), so a decode step stays capturable by a graph. ``auto`` picks
``all_reduce`` while the ranks hold the same tokens — one collective of [T, H] (on one node the
CPU communicator's shared-memory path) where the all-to-all path takes three (two all-to-alls
and an all-gather, each with a fixed cost far above these sizes' transfer; the all-to-all path
measured slower at every decode and prefill size tried on 2 CPU ranks) — and ``all_to_all``
when they hold their own.

Every collective goes through the :class:`~shardwise.Communicator` (the ep group), so a rank
dying inside the exchange makes the others fail with
:class:`~shardwise.errors.CollectiveError` within the collective timeout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..config import MOE_DISPATCHES
from ..errors import ConfigError
from ..layout import even_range

if TYPE_CHECKING:
    from ..communicator import Communicator

#: how the ranks hold their tokens: the same ones on every rank, or each its own
TOKEN_MODES = ("replicated", "local")

#: an experts module, called as ``experts(x [T, H], idx [T, k] local, weights [T, k]) → [T, H]``
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def resolve_dispatch(name: str, tokens: str = "replicated") -> str:
    """The dispatch path for ``moe={"dispatch": name}`` when the ranks hold their tokens as
    ``tokens`` says: ``"auto"`` → ``"all_reduce"`` for replicated tokens (the cheaper one
    there), ``"all_to_all"`` for local ones (all-reduce cannot serve ranks holding different
    tokens)."""
    if name not in MOE_DISPATCHES:
        raise ConfigError(f"moe dispatch must be one of {', '.join(MOE_DISPATCHES)}, got "
                          f"{name!r}")
    if tokens not in TOKEN_MODES:
        raise ConfigError(f"tokens must be one of {', '.join(TOKEN_MODES)}, got {tokens!r}")
    if name == "all_reduce" and tokens == "local":
        raise ConfigError("moe dispatch='all_reduce' sums the ranks' outputs for the same "
                          "tokens; ranks holding different tokens need dispatch='all_to_all' "
                          "(or 'auto')")
    if name == "auto":
        return "all_reduce" if tokens == "replicated" else "all_to_all"
    return name


def to_local(experts: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Global expert indices [T, k] → indices local to the rank holding experts
    ``[start, stop)``: ``e - start`` for its own, the sentinel ``stop - start`` (``E_local``)
    for another rank's. No host synchronisation."""
    local = experts - start
    count = stop - start
    return torch.where((local >= 0) & (local < count), local, torch.full_like(local, count))


def run_local(experts_module: Experts, x: torch.Tensor, experts: torch.Tensor,
              weights: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """This rank's experts ``[start, stop)`` on every token: x [T, H], experts [T, k] global,
    weights [T, k] → [T, H], the partial output (other ranks' slots contribute nothing: their
    index is the sentinel and their weight 0)."""
    local = to_local(experts, start, stop)
    mine = local < stop - start  # [T, k]
    return experts_module(x, local, weights * mine.to(weights.dtype))


class ExpertDispatch:
    """One ep rank's combination of the routed experts (see the module docstring).

    Args:
        ranges: every ep rank's experts ``[start, stop)`` (``plan.experts.ranges``).
        coord: this rank's ep coordinate.
        group: the ep group's communicator (``plan.ep.group``); None only at ep 1.
        dispatch: ``"auto"``, ``"all_reduce"`` or ``"all_to_all"`` (``moe=`` setting).
        tokens: ``"replicated"`` (every rank holds the same tokens: the engine's case) or
            ``"local"`` (each rank its own, the same number on every rank).

    Called as ``dispatch(experts_module, x [T, H], experts [T, k] global int64,
    weights [T, k]) → [T, H]``: the routed output of every expert for the tokens this rank
    holds, as one rank holding them all would compute it (summed in another order).
    """

    def __init__(self, ranges: tuple[tuple[int, int], ...], coord: int,
                 group: "Communicator | None", dispatch: str = "auto",
                 tokens: str = "replicated") -> None:
        self.ranges = tuple(tuple(r) for r in ranges)
        self.coord = coord
        self.size = len(self.ranges)
        self.path = resolve_dispatch(dispatch, tokens)
        self.tokens = tokens
        if self.size > 1 and (group is None or group.world_size != self.size):
            have = "no group" if group is None else f"a group of {group.world_size} ranks"
            raise ConfigError(f"expert dispatch over {self.size} ep ranks needs their "
                              f"communicator; got {have} (bind the plan first: Plan.bind)")
        if not 0 <= coord < self.size:
            raise ConfigError(f"ep coordinate {coord} is not one of {self.size} ep ranks")
        self.group = group

    @property
    def local_range(self) -> tuple[int, int]:
        """This rank's experts ``[start, stop)``."""
        return self.ranges[self.coord]

    def __call__(self, experts_module: Experts, x: torch.Tensor, experts: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        start, stop = self.local_range
        if self.size == 1:
            return experts_module(x, experts - start, weights)
        if self.path == "all_reduce":
            return self.group.all_reduce(run_local(experts_module, x, experts, weights, start,
                                                   stop))
        if self.tokens == "local":
            return self._exchange(experts_module, x, experts, weights)
        return self._replicated_all_to_all(experts_module, x, experts, weights)

    # ----- all-to-all ---------------------------------------------------------------------------

    def _replicated_all_to_all(self, experts_module: Experts, x: torch.Tensor,
                               experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every rank holds the same T tokens: each sends only its share (T padded to a
        multiple of ep, ``T_local`` rows each), then the shares' outputs are all-gathered."""
        t = x.shape[0]
        per = -(-t // self.size)  # T_local
        pad = per * self.size - t
        if pad:  # padding rows: expert 0 with weight 0 (computed, contribute nothing)
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            experts = torch.cat([experts, experts.new_zeros(pad, experts.shape[1])])
            weights = torch.cat([weights, weights.new_zeros(pad, weights.shape[1])])
        rows = slice(self.coord * per, (self.coord + 1) * per)
        mine = self._exchange(experts_module, x[rows], experts[rows], weights[rows])
        return self.group.all_gather(mine.contiguous(), dim=0)[:t]  # [T, H]

    def _exchange(self, experts_module: Experts, x: torch.Tensor, experts: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
        """This rank's tokens x [Tl, H] to every ep rank and back: [Tl, H] summed over the
        ranks' experts. Each destination's message is one byte row per token, the token's
        hidden state then its route (indices local to that rank, then weights, as float32:
        indices are exact there) — one all-to-all out, one back (each collective has a fixed
        cost far above these sizes' transfer)."""
        tl, k = experts.shape
        hidden = x.contiguous().view(torch.uint8)  # [Tl, H * bytes]
        messages = []
        for start, stop in self.ranges:  # per destination: indices local to it, sentinel else
            local = to_local(experts, start, stop)
            mine = (local < stop - start).to(torch.float32)
            route = torch.cat([local.to(torch.float32), weights.float() * mine], dim=1)
            messages.append(torch.cat([hidden, route.view(torch.uint8)], dim=1))
        received = self.group.all_to_all(torch.cat(messages))  # [ep * Tl, bytes]: each source's
        width = hidden.shape[1]
        recv_x = received[:, :width].contiguous().view(x.dtype)  # [ep * Tl, H]
        route = received[:, width:].contiguous().view(torch.float32)  # [ep * Tl, 2k]
        out = experts_module(recv_x, route[:, :k].to(torch.int64),
                             route[:, k:].to(weights.dtype))  # [ep * Tl, H]
        back = self.group.all_to_all(out.contiguous())  # chunk r: rank r's experts, my tokens
        return back.view(self.size, tl, -1).float().sum(0).to(out.dtype)  # [Tl, H]

def ep_ranges(total: int, ep: int) -> tuple[tuple[int, int], ...]:
    """Every ep rank's experts ``[start, stop)``: ``total`` over ``ep`` ranks, ±1, the larger
    counts first (the plan's split, :func:`shardwise.plan.split_experts`)."""
    return tuple(even_range(total, ep, r) for r in range(ep))


def all_to_all_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                       experts_module: Experts, expert_range: tuple[int, int], total: int,
                       group: "Communicator", tokens: str = "replicated") -> torch.Tensor:
    """The routed output [T, H] by the all-to-all path (:class:`ExpertDispatch`), for a caller
    holding this rank's experts ``expert_range`` of ``total`` over ``group`` (the ep group: its
    rank is the ep coordinate). x [T, H]; experts [T, k] global ids int64; weights [T, k]."""
    ranges = ep_ranges(total, group.world_size)
    coord = group.rank % group.world_size
    if tuple(expert_range) != ranges[coord]:
        raise ConfigError(f"ep rank {coord} of {group.world_size} holds experts "
                          f"{list(ranges[coord])} of {total} in the plan's split, not "
                          f"{list(expert_range)}")
    return ExpertDispatch(ranges, coord, group, "all_to_all", tokens)(
        experts_module, x, experts, weights)

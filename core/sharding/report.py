"""What sharding did: per sharded module its role, layout and weight shape before/after; the
modules left replicated; each rank's parameter bytes. ``engine.sharding`` is one of these."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ShardedModule:
    """One sharded module: ``role`` (e.g. ``"row"``), ``layout`` (e.g. ``"kv_heads"``),
    the weight shape of the whole model and of this rank's slice."""

    name: str
    role: str
    layout: str
    shape_before: tuple[int, ...]
    shape_after: tuple[int, ...]


@dataclass
class ShardReport:
    """The outcome of :func:`shardwise.sharding.shard_model` on one rank.

    Attributes:
        tp_size, rank: the tensor-parallel group size and this rank.
        source: where the plan came from (``injection_policy``, ``hf_tp_plan``,
            ``policy:<name>``, ``heuristic``).
        policy: the policy that supplied layouts/attributes (``generic`` when none is registered).
        sharded: module name → :class:`ShardedModule`, in model order (experts modules split
            by expert parallelism too, role ``"expert"``, shapes of their first parameter).
        replicated: names of modules holding parameters that every rank keeps whole.
        attention: attention module name → the attributes set on it (name → value).
        heads: (q heads, kv heads) this rank holds, when the model's head counts are known.
        param_bytes_before: parameter bytes of the whole model (tied weights once).
        param_bytes: this rank's parameter bytes after sharding.
        rank_param_bytes: every rank's parameter bytes, in rank order.
        notes: remarks (e.g. why the model's HF plan was not used).
        ep_size: the expert-parallel group size (1: every rank holds every expert).
    """

    tp_size: int
    rank: int
    source: str
    policy: str
    sharded: dict[str, ShardedModule] = field(default_factory=dict)
    replicated: list[str] = field(default_factory=list)
    attention: dict[str, dict[str, int]] = field(default_factory=dict)
    heads: tuple[int, int] | None = None
    param_bytes_before: int = 0
    param_bytes: int = 0
    rank_param_bytes: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ep_size: int = 1

    def roles(self) -> Counter:
        """Role name → number of modules with it."""
        return Counter(m.role for m in self.sharded.values())

    def summary(self) -> str:
        """A few human-readable lines (logged once, on rank 0, by ``init_inference``)."""
        mib = 1 << 20
        experts = f", expert parallel: ep_size={self.ep_size}" if self.ep_size > 1 else ""
        lines = [f"tensor parallel: tp_size={self.tp_size}{experts}, plan from {self.source}, "
                 f"policy {self.policy}"]
        roles = ", ".join(f"{n} {r}" for r, n in sorted(self.roles().items()))
        lines.append(f"  sharded {len(self.sharded)} modules ({roles})")
        for pattern, (role, layout, before, after, count) in _grouped(self.sharded).items():
            lines.append(f"    {pattern:<40} {role:<16} {layout:<28} {before} -> {after}"
                         f"{f'  x{count}' if count > 1 else ''}")
        reps = Counter(_generic(n) for n in self.replicated)
        lines.append(f"  replicated {len(self.replicated)} modules: "
                     + (", ".join(f"{p}" + (f" x{c}" if c > 1 else "") for p, c in reps.items())
                        or "none"))
        if self.heads:
            lines.append(f"  heads on rank {self.rank}: {self.heads[0]} q, {self.heads[1]} kv")
        per_rank = ", ".join(f"{b / mib:.2f}" for b in self.rank_param_bytes)
        lines.append(f"  parameters: {self.param_bytes_before / mib:.2f} MiB whole; "
                     f"per rank [{per_rank}] MiB")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _generic(name: str) -> str:
    """``model.layers.3.mlp`` → ``model.layers.*.mlp`` (to group repeated layers)."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _grouped(sharded: dict[str, ShardedModule]) -> dict[str, tuple]:
    out: dict[str, list] = {}
    for m in sharded.values():
        key = _generic(m.name)
        if key in out:
            out[key][4] += 1
        else:
            out[key] = [m.role, m.layout, tuple(m.shape_before), tuple(m.shape_after), 1]
    return {k: tuple(v) for k, v in out.items()}

"""Pure partition arithmetic: which slice of a dimension, and which heads, each rank keeps.

Nothing here touches a module or a process group, so every rule is unit-testable on a fake rank.

* :func:`even_sizes` / :func:`even_range`: split ``total`` units over ``parts`` ranks with counts
  differing by at most one (the larger counts first).
* :class:`HeadPartition`: the q-head and kv-head index ranges of one rank, computed once per model
  from ``(num_heads, num_kv_heads, head_dim, tp_size, rank)``. Grouped-query attention is split by
  whole kv groups; with fewer kv heads than ranks each kv head is replicated over the ranks that
  share it and those ranks split its q heads.
* :func:`head_split_problem` / :func:`working_head_tp_sizes` / :func:`divisors`: the "sizes that
  would work" that errors quote.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ShardingError

Range = tuple[int, int]  # [start, stop) along one dimension


def even_sizes(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` counts that differ by at most one, larger ones first
    (7 over 2 → [4, 3])."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def even_range(total: int, parts: int, index: int) -> Range:
    """The ``index``-th of :func:`even_sizes` as a [start, stop) range."""
    sizes = even_sizes(total, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def divisors(n: int, upto: int | None = None) -> list[int]:
    """Divisors of ``n`` (the tp sizes an even split of ``n`` allows), at most ``upto``."""
    upto = n if upto is None else min(n, upto)
    return [d for d in range(1, upto + 1) if n % d == 0]


# ----- heads --------------------------------------------------------------------------------------

def head_split_problem(num_heads: int, num_kv_heads: int, tp_size: int) -> str | None:
    """Why ``num_heads`` q heads / ``num_kv_heads`` kv heads cannot be split over ``tp_size``
    ranks by whole heads (None when they can). The rules:

    * kv heads >= ranks: kv heads split as evenly as possible, q heads follow whole kv groups;
    * kv heads < ranks: ``tp_size`` must be a multiple of the kv heads (the ranks sharing one kv
      head hold a copy of it) and each kv head must have at least as many q heads as sharers.
    """
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        return (f"{num_heads} attention heads with {num_kv_heads} kv heads is not a valid "
                f"grouped-query layout (q heads must be a multiple of kv heads)")
    if num_heads < tp_size:
        return f"{num_heads} heads cannot give each of {tp_size} ranks a whole head"
    if num_kv_heads >= tp_size:
        return None
    if tp_size % num_kv_heads:
        return (f"{num_kv_heads} kv heads cannot be shared by {tp_size} ranks in equal groups "
                f"(tp_size must be a multiple of the kv heads when it exceeds them)")
    sharers, groups = tp_size // num_kv_heads, num_heads // num_kv_heads
    if groups < sharers:
        return (f"each kv head serves {groups} q heads, too few for the {sharers} ranks "
                f"that would share it")
    return None


def working_head_tp_sizes(num_heads: int, num_kv_heads: int, upto: int = 64) -> list[int]:
    """The tp sizes (up to ``upto``) that :func:`head_split_problem` accepts."""
    return [n for n in range(1, upto + 1) if head_split_problem(num_heads, num_kv_heads, n) is None]


def _head_ranges(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> tuple[Range, Range]:
    """(q-head range, kv-head range) of ``rank``; assumes :func:`head_split_problem` is None."""
    groups = num_heads // num_kv_heads  # q heads per kv head
    if num_kv_heads >= tp_size:  # whole kv groups per rank: 9 q / 3 kv on 2 ranks → kv 2|1, q 6|3
        kv0, kv1 = even_range(num_kv_heads, tp_size, rank)
        return (kv0 * groups, kv1 * groups), (kv0, kv1)
    sharers = tp_size // num_kv_heads  # ranks holding a copy of one kv head (MQA: all of them)
    kv = rank // sharers
    q0, q1 = even_range(groups, sharers, rank % sharers)
    return (kv * groups + q0, kv * groups + q1), (kv, kv + 1)


@dataclass(frozen=True)
class HeadPartition:
    """The attention heads one rank keeps. Head counts come from the model config (through a
    policy's ``head_config``); ranges are [start, stop) head indices.

    Derived quantities (:meth:`quantity`, named in a policy's ``attention_attrs``):
    ``q_heads``, ``kv_heads``, ``kv_groups`` (q heads per kv head on this rank), ``head_dim``,
    ``q_width`` (= q_heads × head_dim), ``kv_width``, ``qkv_width`` (q + 2 kv widths).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp_size: int
    rank: int
    q_range: Range
    kv_range: Range

    @classmethod
    def compute(cls, num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int,
                rank: int) -> "HeadPartition":
        """Raises :class:`ShardingError` naming the head counts, tp_size and the tp sizes that
        would work when the heads cannot be split."""
        problem = head_split_problem(num_heads, num_kv_heads, tp_size)
        if problem:
            sizes = working_head_tp_sizes(num_heads, num_kv_heads, upto=max(num_heads, tp_size))
            raise ShardingError(
                f"cannot split attention with {num_heads} heads ({num_kv_heads} kv heads) over "
                f"tp_size={tp_size}: {problem}. tp sizes that would work: "
                f"{', '.join(map(str, sizes))}")
        q_range, kv_range = _head_ranges(num_heads, num_kv_heads, tp_size, rank)
        return cls(num_heads, num_kv_heads, head_dim, tp_size, rank, q_range, kv_range)

    @property
    def q_heads(self) -> int:
        return self.q_range[1] - self.q_range[0]

    @property
    def kv_heads(self) -> int:
        return self.kv_range[1] - self.kv_range[0]

    def quantity(self, name: str) -> int:
        """A per-rank quantity by name (see the class docstring)."""
        values = {
            "q_heads": self.q_heads, "kv_heads": self.kv_heads,
            "kv_groups": self.q_heads // self.kv_heads, "head_dim": self.head_dim,
            "q_width": self.q_heads * self.head_dim, "kv_width": self.kv_heads * self.head_dim,
            "qkv_width": (self.q_heads + 2 * self.kv_heads) * self.head_dim,
        }
        try:
            return values[name]
        except KeyError:
            raise ShardingError(f"unknown head quantity {name!r}; known: "
                                f"{', '.join(values)}") from None

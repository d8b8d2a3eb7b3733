"""What a tensor-parallel plan is made of, as plain data: roles, layouts, head counts and head
partitions, and the head-sliced forward arguments a policy names (docs/architecture.md, "One
plan").

This module is a leaf: it imports no other shardwise module but :mod:`shardwise.errors`, so both
:mod:`shardwise.policy` (whose data are these classes) and :mod:`shardwise.sharding` (which
applies them) import it without importing each other. ``shardwise.sharding.roles``,
``shardwise.sharding.partition`` and ``shardwise.sharding.errors`` re-export these names.

Partition arithmetic (nothing here touches a module or a process group, so every rule is
unit-testable on a fake rank):

* :func:`even_sizes` / :func:`even_range`: split ``total`` units over ``parts`` ranks with counts
  differing by at most one (the larger counts first).
* :class:`HeadCounts`: (num_heads, num_kv_heads, head_dim) as a policy reads them from a config.
* :class:`HeadPartition`: the q-head and kv-head index ranges of one rank, computed once per model
  from ``(num_heads, num_kv_heads, head_dim, tp_size, rank)``. Grouped-query attention is split by
  whole kv groups; with fewer kv heads than ranks each kv head is replicated over the ranks that
  share it and those ranks split its q heads.
* :func:`head_split_problem` / :func:`working_head_tp_sizes` / :func:`divisors`: the "sizes that
  would work" that errors quote.

Roles and layouts, both plain data. A **role** says which dimension of a module's weight is
split and which collective restores the full result:

=========================  =================================  ======================================
role                       weight split                       after forward
=========================  =================================  ======================================
``ColumnParallel``         output features (bias split too)   nothing: output stays split
``RowParallel``            input features                     all-reduce (sum); bias added once
``VocabParallelEmbedding`` vocabulary rows                    ids outside the slice → 0, all-reduce
``VocabParallelHead``      vocabulary rows of the LM head     all-gather: full logits on every rank
``Replicated``             nothing                            nothing
``ExpertParallel``         whole experts (dim 0), over ep     all-reduce or all-to-all (``moe``)
=========================  =================================  ======================================

A **layout** says which indices of the split dimension a rank keeps, as a list of [start, stop)
ranges (:meth:`Layout.ranges`). Adding a layout for a new fused format is adding a small class
here; the applier only ever asks for ranges.

* ``Even()`` — contiguous equal slices (size must divide by tp_size); ``Even(uneven=True)``
  allows counts differing by one (vocabularies).
* ``Heads("heads")`` / ``Heads("kv_heads")`` — [heads, head_dim]: the rank's q (or kv) heads.
* ``HeadBlocks("heads")`` — [heads, width], the width the size over the heads (not head_dim):
  multi-head latent attention's per-head widths.
* ``Fused(parts=(("q", "heads"), ("k", "kv_heads"), ("v", "kv_heads")))`` — parts concatenated
  along the dimension ([q | k | v], or ``(("gate", "even"), ("up", "even"))`` for [gate | up]);
  each part is split by its own unit and the rank keeps its slice of every part, in order.
* ``PerHeadInterleaved(per_head=3)`` — [heads, per_head, head_dim] (BLOOM/GPT-NeoX
  ``query_key_value``): the rank keeps whole head blocks.
* ``GroupedInterleaved(shared=2)`` — [kv_heads, q_per_kv + 2, head_dim] (Falcon
  ``query_key_value``): per kv group its q heads then k, v; the rank keeps its q heads of each of
  its groups and the groups' k, v.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from .errors import ConfigError


class ShardingError(ConfigError):
    """A tensor-parallel plan cannot be applied: a size that does not split, a module a plan names
    that does not exist, a model with nothing to shard, a world size that does not fit."""


class HeadCounts(NamedTuple):
    """A model's attention head counts, as a policy's ``head_config`` reads them."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


# ----- partition arithmetic -----------------------------------------------------------------------

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


HEAD_UNITS = ("heads", "kv_heads")


@dataclass(frozen=True)
class ShardContext:
    """What a layout needs to pick a rank's indices: the tp size, the rank, and the model's head
    partition for that rank (None when the model's head counts are unknown or do not split; a
    head layout then raises ``heads_error``)."""

    tp_size: int
    rank: int
    heads: HeadPartition | None = None
    heads_error: str = ""  # why the heads could not be partitioned, when they could not

    def require_heads(self, what: str) -> HeadPartition:
        if self.heads is None and self.heads_error:
            raise ShardingError(self.heads_error)
        if self.heads is None:
            raise ShardingError(
                f"{what} is split by attention heads, but the model's head counts are unknown "
                f"(no config attribute the policy's head_config names); give the model a config "
                f"with num_attention_heads or use an Even layout")
        return self.heads


# ----- layouts ------------------------------------------------------------------------------------

class Layout:
    """How a split dimension is organised. Subclasses implement :meth:`ranges`."""

    def ranges(self, size: int, ctx: ShardContext, what: str = "dimension") -> list[Range]:
        """The [start, stop) ranges of a dimension of ``size`` that ``ctx.rank`` keeps, in order.
        Raises :class:`ShardingError` (naming ``what``) when the size cannot be split."""
        raise NotImplementedError

    def describe(self) -> str:
        """A short name for reports."""
        return type(self).__name__


@dataclass(frozen=True)
class Even(Layout):
    """Contiguous slices: equal (size divisible by tp_size), or with ``uneven=True`` counts that
    differ by at most one."""

    uneven: bool = False

    def describe(self):
        return "even(uneven)" if self.uneven else "even"

    def ranges(self, size, ctx, what="dimension"):
        if size < ctx.tp_size or (size % ctx.tp_size and not self.uneven):
            raise ShardingError(
                f"{what} has size {size}, which does not split into {ctx.tp_size} equal parts "
                f"(it splits evenly into {', '.join(map(str, divisors(size, 64)))})")
        return [even_range(size, ctx.tp_size, ctx.rank)]


def _head_slice(unit: str, heads: HeadPartition) -> tuple[int, Range]:
    """(total heads, this rank's head range) for a head unit name."""
    if unit == "heads":
        return heads.num_heads, heads.q_range
    if unit == "kv_heads":
        return heads.num_kv_heads, heads.kv_range
    raise ShardingError(f"unknown head unit {unit!r}; use one of {HEAD_UNITS}")


@dataclass(frozen=True)
class Heads(Layout):
    """[heads, head_dim] along the dimension; the rank keeps its q heads (``"heads"``) or its kv
    heads (``"kv_heads"``) as computed by :class:`HeadPartition`."""

    unit: str = "heads"

    def describe(self):
        return self.unit

    def ranges(self, size, ctx, what="dimension"):
        heads = ctx.require_heads(what)
        total, (h0, h1) = _head_slice(self.unit, heads)
        _expect_size(size, total * heads.head_dim, what, f"{total} {self.unit} × head_dim "
                                                           f"{heads.head_dim}")
        return [(h0 * heads.head_dim, h1 * heads.head_dim)]


@dataclass(frozen=True)
class HeadBlocks(Layout):
    """[heads, width] along the dimension with a per-head width of its own, the dimension's size
    over the head count (not head_dim): multi-head latent attention's query and ``kv_b_proj``
    outputs ([heads, nope + rope], [heads, nope + v]) and its output projection's input
    ([heads, v]). The rank keeps its q heads (``"heads"``) or kv heads (``"kv_heads"``)."""

    unit: str = "heads"

    def describe(self):
        return f"{self.unit}(blocks)"

    def ranges(self, size, ctx, what="dimension"):
        heads = ctx.require_heads(what)
        total, (h0, h1) = _head_slice(self.unit, heads)
        if size % total:
            raise ShardingError(f"{what} has size {size}, which is not {total} {self.unit} of one "
                                f"width; the policy's layout or head_config does not fit this "
                                f"model")
        width = size // total
        return [(h0 * width, h1 * width)]


@dataclass(frozen=True)
class Fused(Layout):
    """Parts concatenated along the dimension, each ``(name, unit)`` with unit ``"heads"``,
    ``"kv_heads"`` (size = heads × head_dim) or ``"even"`` (the parts marked even share what the
    head parts leave, equally, and are split like :class:`Even`)."""

    parts: tuple[tuple[str, str], ...]

    def describe(self):
        return "fused[" + " | ".join(f"{name}:{unit}" for name, unit in self.parts) + "]"

    def ranges(self, size, ctx, what="dimension"):
        needs_heads = any(u in HEAD_UNITS for _, u in self.parts)
        heads = ctx.require_heads(what) if needs_heads else None
        fixed = sum(_head_slice(u, heads)[0] * heads.head_dim
                    for _, u in self.parts if u in HEAD_UNITS)
        n_even = sum(1 for _, u in self.parts if u == "even")
        rest = size - fixed
        if (n_even == 0 and rest) or (n_even and (rest <= 0 or rest % n_even)):
            names = " | ".join(n for n, _ in self.parts)
            raise ShardingError(f"{what} has size {size}, which does not fit the fused layout "
                                f"[{names}] (head parts take {fixed})")
        out, offset = [], 0
        for name, unit in self.parts:
            if unit in HEAD_UNITS:
                total, (h0, h1) = _head_slice(unit, heads)
                part, (a, b) = total * heads.head_dim, (h0 * heads.head_dim, h1 * heads.head_dim)
            elif unit == "even":
                part = rest // n_even
                [(a, b)] = Even().ranges(part, ctx, f"part {name!r} of {what}")
            else:
                raise ShardingError(f"unknown unit {unit!r} for part {name!r}; use heads, "
                                    f"kv_heads or even")
            out.append((offset + a, offset + b))
            offset += part
        return out


@dataclass(frozen=True)
class PerHeadInterleaved(Layout):
    """[heads, per_head, head_dim] along the dimension (e.g. [heads, 3 (q,k,v), head_dim] in
    BLOOM's and GPT-NeoX's ``query_key_value``): the rank keeps its heads' whole blocks.
    ``unit`` is ``"heads"`` or ``"kv_heads"``."""

    per_head: int = 3
    unit: str = "heads"

    def describe(self):
        return f"interleaved[{self.unit} x {self.per_head}]"

    def ranges(self, size, ctx, what="dimension"):
        heads = ctx.require_heads(what)
        total, (h0, h1) = _head_slice(self.unit, heads)
        block = self.per_head * heads.head_dim
        _expect_size(size, total * block, what, f"{total} {self.unit} × {self.per_head} × "
                                                f"head_dim {heads.head_dim}")
        return [(h0 * block, h1 * block)]


@dataclass(frozen=True)
class GroupedInterleaved(Layout):
    """[kv_heads, q heads per kv head + ``shared``, head_dim] along the dimension: each kv group's
    block holds its q heads, then ``shared`` heads the group's q heads all use (k and v).
    Falcon's ``query_key_value`` in all three of its forms: kv groups (new decoder
    architecture), one group ``[q heads | k | v]`` (multi-query, Falcon-7B), groups of one
    ``[heads, (q, k, v), head_dim]`` (multi-head). The rank keeps, in each of its kv groups, the
    rows of its own q heads and the group's shared rows; a group shared by several ranks (fewer
    kv heads than ranks) gives each of them its shared rows and a share of its q heads."""

    shared: int = 2

    def describe(self):
        return f"grouped[q_per_kv + {self.shared}]"

    def ranges(self, size, ctx, what="dimension"):
        heads = ctx.require_heads(what)
        group, d = heads.num_heads // heads.num_kv_heads, heads.head_dim  # q heads per kv head
        block = (group + self.shared) * d  # one kv group: [q_0 .. q_{group-1}, k, v] × head_dim
        _expect_size(size, heads.num_kv_heads * block, what,
                     f"{heads.num_kv_heads} kv heads × ({group} q heads + {self.shared}) × "
                     f"head_dim {d}")
        (q0, q1), out = heads.q_range, []
        for kv in range(*heads.kv_range):
            a, b = max(q0, kv * group) - kv * group, min(q1, (kv + 1) * group) - kv * group
            start = kv * block
            out += [(start + a * d, start + b * d), (start + group * d, start + block)]
        merged = [out[0]]  # adjacent ranges (whole groups) as one, to copy in fewer pieces
        for a, b in out[1:]:
            merged[-1:] = [(merged[-1][0], b)] if merged[-1][1] == a else [merged[-1], (a, b)]
        return merged


def _expect_size(size: int, expected: int, what: str, formula: str) -> None:
    if size != expected:
        raise ShardingError(f"{what} has size {size}, but its layout expects {expected} "
                            f"({formula}); the policy's layout or head_config does not fit "
                            f"this model")


# ----- roles --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Role:
    """Base of the roles. ``layout`` None means: the policy's layout for the module, else
    ``Even()``."""

    name: ClassVar[str] = "role"
    layout: Layout | None = None
    #: whether the role changes the module (Replicated does not)
    shards: ClassVar[bool] = True

    def describe(self) -> str:
        return self.name if self.layout is None else f"{self.name}({self.layout.describe()})"


@dataclass(frozen=True)
class ColumnParallel(Role):
    """Split output features; the output stays split (it feeds a :class:`RowParallel`)."""

    name: ClassVar[str] = "column"


@dataclass(frozen=True)
class RowParallel(Role):
    """Split input features; the partial outputs are summed with an all-reduce and the bias is
    added once (it is kept on rank 0 only)."""

    name: ClassVar[str] = "row"


@dataclass(frozen=True)
class VocabParallelEmbedding(Role):
    """Split the vocabulary rows of an embedding (counts may differ by one); ids outside a
    rank's slice give zeros, and an all-reduce assembles the embeddings."""

    name: ClassVar[str] = "vocab_embedding"
    layout: Layout | None = Even(uneven=True)


@dataclass(frozen=True)
class VocabParallelHead(Role):
    """Split the vocabulary rows of the output projection (LM head); the logits are all-gathered
    so every rank returns the full vocabulary. Tied to a :class:`VocabParallelEmbedding`, both
    keep the same slice and stay tied."""

    name: ClassVar[str] = "vocab_head"
    layout: Layout | None = Even(uneven=True)


@dataclass(frozen=True)
class Replicated(Role):
    """Every rank keeps the whole module."""

    name: ClassVar[str] = "replicated"
    shards: ClassVar[bool] = False


@dataclass(frozen=True)
class ExpertParallel(Role):
    """A Mixture-of-Experts experts module split by whole experts over the expert-parallel
    ranks: every parameter whose dim 0 holds the experts (the 3-D ``gate_up_proj`` [E, 2I, H]
    and ``down_proj`` [E, H, I], GPT-OSS's 2-D biases [E, 2I] / [E, H]) keeps the rank's range
    of experts (counts differing by at most one, the larger first: ``plan.experts.ranges``).
    The rank's routed outputs are summed over the ep group (all-reduce), or tokens travel to
    their experts' ranks (all-to-all): :mod:`shardwise.moe.dispatch`. Not a tensor-parallel
    role: the ep coordinate, not the tp one, picks the slice."""

    name: ClassVar[str] = "expert"
    layout: Layout | None = Even(uneven=True)


#: Role names accepted in string-valued plans (a user's ``{pattern: "colwise"}``), HF's
#: vocabulary included. Entries HF uses that shardwise cannot honour faithfully (e.g.
#: ``colwise_gather_output`` on a fused layer, ``rowwise_split_input``) are absent on purpose.
ROLE_NAMES: dict[str, type[Role]] = {
    "column": ColumnParallel, "colwise": ColumnParallel,
    "row": RowParallel, "rowwise": RowParallel,
    "vocab_embedding": VocabParallelEmbedding, "embedding_rowwise": VocabParallelEmbedding,
    "vocab_head": VocabParallelHead,
    "replicated": Replicated, "replicate": Replicated,
}


# ----- forward arguments holding every head's entry ---------------------------------------------

@dataclass(frozen=True)
class HeadSlicedInput:
    """One forward argument of a module that holds an entry per head of the whole model.

    Attributes:
        arg: the argument's name in the module's ``forward`` (found as a keyword, or at its
            position when passed positionally).
        dim: the dimension that holds the heads.
        folded: the dimension is batch and heads folded, heads inner (``b * heads + h``), as in
            BLOOM's ``alibi`` [batch * heads, 1, seq]; otherwise it holds the heads alone
            (Falcon's [batch, heads, 1, seq]).
        unit: ``"heads"`` (q heads) or ``"kv_heads"``.

    A ``None`` argument, or an unfolded head dimension of size 1 (a mask broadcast over the
    heads), passes through unchanged.
    """

    arg: str
    dim: int = 1
    folded: bool = False
    unit: str = "heads"

    def head_range(self, heads: HeadPartition) -> tuple[int, int, int]:
        """(total heads, first, stop) of the rank's heads in this argument."""
        if self.unit == "heads":
            return heads.num_heads, *heads.q_range
        if self.unit == "kv_heads":
            return heads.num_kv_heads, *heads.kv_range
        raise ShardingError(f"head-sliced argument {self.arg!r}: unknown unit {self.unit!r}; "
                            f"use heads or kv_heads")

    def take(self, value: Any, heads: HeadPartition) -> Any:
        """``value`` narrowed to the rank's heads (a contiguous copy; views of the shared tensor
        are not enough for forwards that ``view`` it)."""
        if not isinstance(value, torch.Tensor):
            return value
        total, h0, h1 = self.head_range(heads)
        dim = self.dim % value.dim()
        size = value.shape[dim]
        if not self.folded and size == 1:
            return value  # broadcast over the heads
        if self.folded and size % total == 0:
            grouped = value.unflatten(dim, (size // total, total))  # [.., batch, heads, ..]
            return grouped.narrow(dim + 1, h0, h1 - h0).flatten(dim, dim + 1).contiguous()
        if not self.folded and size == total:
            return value.narrow(dim, h0, h1 - h0).contiguous()
        layout = f"batch × {total} heads" if self.folded else f"{total} heads (or 1)"
        raise ShardingError(f"argument {self.arg!r} has shape {tuple(value.shape)}; dimension "
                            f"{self.dim} should hold {layout} (the policy's head_sliced_inputs "
                            f"does not fit this model)")

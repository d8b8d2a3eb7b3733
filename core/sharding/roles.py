"""Roles (what a module becomes under tensor parallelism) and layouts (how the split dimension is
organised), both plain data.

A **role** says which dimension of a module's weight is split and which collective restores the
full result:

=========================  =================================  ======================================
role                       weight split                       after forward
=========================  =================================  ======================================
``ColumnParallel``         output features (bias split too)   nothing: output stays split
``RowParallel``            input features                     all-reduce (sum); bias added once
``VocabParallelEmbedding`` vocabulary rows                    ids outside the slice → 0, all-reduce
``VocabParallelHead``      vocabulary rows of the LM head     all-gather: full logits on every rank
``Replicated``             nothing                            nothing
=========================  =================================  ======================================

A **layout** says which indices of the split dimension a rank keeps, as a list of [start, stop)
ranges (:meth:`Layout.ranges`). Adding a layout for a new fused format is adding a small class
here; the applier only ever asks for ranges.

* ``Even()`` — contiguous equal slices (size must divide by tp_size); ``Even(uneven=True)``
  allows counts differing by one (vocabularies).
* ``Heads("heads")`` / ``Heads("kv_heads")`` — [heads, head_dim]: the rank's q (or kv) heads.
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
from typing import ClassVar

from .errors import ShardingError
from .partition import HeadPartition, Range, divisors, even_range

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

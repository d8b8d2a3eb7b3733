"""Slots of one static KV cache, for continuous batching (``shardwise serve``).

``generate``'s :class:`~shardwise.inject.cache.StaticKVCache` holds one left-padded batch: every
sequence has the same length. A server's sequences join and leave at any step, so
:class:`SlotKVCache` gives each row of its buffers — a *slot* — its own length:

* **join / prefill**: a sequence takes a free slot (length 0) and its prompt is written into that
  row, in one or several chunks of any size (a chunk continues after the slot's cached tokens):
  :meth:`SlotKVCache.row` is the slot as a batch-1 cache, run through the model's usual
  prompt path.
* **decode**: one step appends one token to each active slot, each at its own position (its
  length; rotary and learned positions are that length too): :meth:`SlotKVCache.step` is a
  cache over the first ``bucket`` rows whose one-token forward writes row ``r`` at its own
  position (:class:`~shardwise.inject.cache.DecodeRows`). Rows of the bucket that hold no
  active sequence write to the *scratch* position — the buffers' last one, which therefore is
  never a token of a sequence (a slot holds ``max_tokens``, its buffers ``max_tokens + 1``) —
  and attend only to it; their results are dropped.
* **mixed step** (chunked prefill inside the decode batch): one forward appends one token to
  each decoding slot *and* a prompt chunk to each of some other slots (:meth:`SlotKVCache.mixed`,
  a :class:`SlotMixed` cache): the tokens are packed as one batch row, so the projections and
  MLPs run once over all of them, while attention is dispatched per part
  (:class:`~shardwise.inject.cache.MixedRows`): the decode tokens attend to their slots' cached
  ranges, each chunk causally to its slot's cache and itself. Run eagerly (its token count
  changes every step: nothing to capture); the decode-only steps keep their captured graphs.
* **leave**: :meth:`SlotKVCache.release` sets the slot's length to 0; it is reusable at once
  (its old keys are overwritten before they are read again).

With graph capture the decode step of each bucket is captured once (keyed by this cache and
the bucket, over views of the same buffers), so sequences joining and leaving only change the
step's input tensors: nothing is captured again. Slot caches are never "stale": they live as
long as their :class:`SlotKVCache` and do not retire (nor are retired by) ``generate``'s cache.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ConfigError
from .cache import RAISE_HINT, DecodeRows, KVBuffers, MaxTokensError, MixedRows, StaticKVCache


class SlotRow(StaticKVCache):
    """One slot as a batch-1 cache (a view of its row): a prompt chunk run with it is written
    after the slot's ``length`` cached tokens. Decoded eagerly (a one-token chunk is a decode
    step of one row), never through a captured graph."""

    def __init__(self, buffers: KVBuffers, length: int, capacity: int) -> None:
        super().__init__(buffers, None, -1)
        self.length, self.capacity = length, capacity

    def check_live(self) -> None:
        """Slot caches are never retired."""

    @property
    def graph_key(self) -> None:
        return None

    def reserve(self, n_new: int) -> int:
        if self.length + n_new > self.capacity:
            raise MaxTokensError(f"the slot holds {self.length} tokens and the next chunk has "
                                 f"{n_new}: more than a slot holds (max_tokens="
                                 f"{self.capacity}); {RAISE_HINT}")
        return self.length


class SlotStep(StaticKVCache):
    """The cache of one decode step over the first ``bucket`` rows of a :class:`SlotKVCache`:
    its one-token forward uses the per-row inputs ``rows`` (each row at its own position);
    ``longest``: the most tokens an active row holds before the step."""

    ragged = True

    def __init__(self, buffers: KVBuffers, rows: DecodeRows, key: object, longest: int) -> None:
        super().__init__(buffers, None, -1)
        self.rows, self._key, self.longest = rows, key, longest
        self.length = -1  # no one length: each row has its own

    def check_live(self) -> None:
        """Slot caches are never retired."""

    @property
    def graph_key(self) -> object:
        return self._key

    def decode_rows(self, position_ids: torch.Tensor) -> DecodeRows:
        return self.rows

    def reserve(self, n_new: int) -> int:
        if n_new != 1:
            raise MaxTokensError(f"a decode step over slots appends one token per slot, got "
                                 f"{n_new}")
        return 0  # each row's position is in ``rows``; the slot store checked they fit

    def advance(self, n_new: int) -> None:
        """The slot store counts each slot's tokens."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.longest


class SlotMixed(StaticKVCache):
    """The cache of one mixed forward over a :class:`SlotKVCache` (its :attr:`mixed` rows say
    which packed token goes where); the input is one batch row of ``mixed.tokens`` tokens.
    Run eagerly, never through a captured graph; the slot store counts each slot's tokens.
    ``longest``: the most tokens a slot of the forward holds before it."""

    def __init__(self, buffers: KVBuffers, mixed: MixedRows, longest: int) -> None:
        super().__init__(buffers, None, -1)
        self.mixed, self.longest = mixed, longest
        self.batch = 1  # the packed row
        self.length = -1  # no one length: each part has its own

    def check_live(self) -> None:
        """Slot caches are never retired."""

    @property
    def graph_key(self) -> None:
        return None

    def reserve(self, n_new: int) -> int:
        if n_new != self.mixed.tokens:
            raise MaxTokensError(f"a mixed step packs {self.mixed.tokens} tokens, the input "
                                 f"has {n_new}")
        return 0  # each part's positions are in ``mixed``; the slot store checked they fit

    def advance(self, n_new: int) -> None:
        """The slot store counts each slot's tokens."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.longest


class SlotKVCache:
    """``slots`` slots of ``max_tokens`` tokens each over one set of static KV buffers of
    ``rows`` ≥ ``slots`` rows (the batch bucket of ``slots``: a decode step runs over a bucket's
    rows; see the module docstring). ``lengths[slot]``: tokens in the slot (host ints)."""

    def __init__(self, stack, slots: int, rows: int, max_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if not 1 <= slots <= rows or max_tokens < 1:
            raise ConfigError(f"a slot cache needs at least one slot of at least one token "
                              f"(and rows for every slot), got {slots} slots over {rows} rows "
                              f"of max_tokens={max_tokens}")
        # one more position than a slot holds: the scratch position of idle rows
        self.buffers = stack._allocate(rows, dtype, device, positions=max_tokens + 1)
        self.slots, self.rows, self.capacity = slots, rows, max_tokens
        self.scratch = max_tokens
        self.device = device
        self.lengths = [0] * slots
        self._buckets: dict[int, KVBuffers] = {}  # bucket → view of its first rows (kept)

    def release_buffers(self) -> None:
        """Free the keys and values (the store is unusable afterwards)."""
        self.buffers.release()
        self._buckets.clear()

    # ----- checks (callers run them before any work, e.g. before telling other ranks) --------

    def check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot!r} is not one of the slots 0..{self.slots - 1}")

    def check_chunk(self, slot: int, n_new: int) -> None:
        """Raise unless ``n_new`` ≥ 1 more tokens fit ``slot`` (:class:`MaxTokensError`)."""
        self.check_slot(slot)
        if n_new < 1:
            raise ValueError("a prompt chunk needs at least one token")
        if self.lengths[slot] + n_new > self.capacity:
            raise MaxTokensError(f"slot {slot} holds {self.lengths[slot]} tokens and the chunk "
                                 f"has {n_new}: more than max_tokens={self.capacity}; "
                                 f"{RAISE_HINT}")

    def check_step(self, slots: Sequence[int]) -> None:
        """Raise unless a decode step can append one token to each of ``slots``: distinct,
        each holding at least one token and fewer than ``max_tokens``."""
        if not slots:
            raise ValueError("a decode step needs at least one slot")
        if len(set(slots)) != len(slots):
            raise ValueError(f"a decode step got a slot twice: {list(slots)}")
        for slot in slots:
            self.check_slot(slot)
            n = self.lengths[slot]
            if n == 0:
                raise ValueError(f"slot {slot} holds no tokens: prefill its prompt before "
                                 f"decoding it")
            if n >= self.capacity:
                raise MaxTokensError(f"slot {slot} holds {n} tokens, as many as a slot holds "
                                     f"(max_tokens={self.capacity}); {RAISE_HINT}")

    # ----- the caches of one forward ---------------------------------------------------------

    def row(self, slot: int) -> SlotRow:
        """Slot ``slot`` as a batch-1 cache after its cached tokens (for a prompt chunk)."""
        self.check_slot(slot)
        return SlotRow(self.buffers.row_range(slot, slot + 1), self.lengths[slot],
                       self.capacity)

    def step(self, slots: Sequence[int], bucket: int) -> SlotStep:
        """The cache of one decode step appending one token to each of ``slots`` (each <
        ``bucket``, the rows the step runs over; the other rows write to the scratch position
        and attend only to it). No ``slots``: every row idle (a warmup step)."""
        if slots:
            self.check_step(slots)
        if not max(slots, default=-1) < bucket <= self.rows:
            raise ValueError(f"a decode step over {bucket} rows cannot hold slots {list(slots)}")
        write = [self.scratch] * bucket
        positions = [0] * bucket
        starts = [self.scratch] * bucket
        for slot in slots:
            n = self.lengths[slot]
            write[slot], positions[slot], starts[slot] = n, n, 0
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        write_index = as_tensor(write)
        rows = DecodeRows(position_ids=as_tensor(positions)[:, None], write_index=write_index,
                          lengths=write_index + 1, starts=as_tensor(starts))
        longest = max((self.lengths[s] for s in slots), default=0)
        return SlotStep(self._bucket(bucket), rows, self.graph_key(bucket), longest)

    def check_mixed(self, slots: Sequence[int], chunks: Sequence[tuple[int, int]]) -> None:
        """Raise unless one mixed forward can append one token to each of ``slots`` (as
        :meth:`check_step`) and ``n`` ≥ 1 prompt tokens to each ``(slot, n)`` of ``chunks``
        (as :meth:`check_chunk`): at least one chunk, every slot at most once overall."""
        if not chunks:
            raise ValueError("a mixed step needs at least one prompt chunk (without one it is a "
                             "decode step)")
        self.check_step(slots)
        chunk_slots = [slot for slot, _ in chunks]
        twice = set(chunk_slots) & set(slots) or len(set(chunk_slots)) != len(chunk_slots)
        if twice:
            raise ValueError(f"a mixed step got a slot twice: decode slots {list(slots)}, "
                             f"chunk slots {chunk_slots}")
        for slot, n in chunks:
            self.check_chunk(slot, n)

    def mixed(self, slots: Sequence[int], chunks: Sequence[tuple[int, int]]) -> SlotMixed:
        """The cache of one mixed forward: one decode token for each of ``slots``, then
        ``n`` prompt tokens for each ``(slot, n)`` of ``chunks``, packed in that order (see
        :class:`~shardwise.inject.cache.MixedRows`). The decode part spans rows
        0 .. max(slots) (the others there write to the scratch position)."""
        self.check_mixed(slots, chunks)
        span = max(slots) + 1
        write, starts = [self.scratch] * span, [self.scratch] * span
        for slot in slots:
            write[slot], starts[slot] = self.lengths[slot], 0
        positions = [self.lengths[slot] for slot in slots]
        for slot, n in chunks:
            positions.extend(range(self.lengths[slot], self.lengths[slot] + n))
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        write_index = as_tensor(write)
        rows = MixedRows(slots=as_tensor(list(slots)), span=span, write_index=write_index,
                         lengths=write_index + 1, starts=as_tensor(starts),
                         chunks=tuple((slot, self.lengths[slot], n) for slot, n in chunks),
                         position_ids=as_tensor(positions)[None])
        longest = max(self.lengths[s] for s in [*slots, *(c for c, _ in chunks)])
        return SlotMixed(self.buffers, rows, longest)

    def graph_key(self, bucket: int) -> tuple:
        """The key of the decode step captured over this cache's first ``bucket`` rows."""
        return ("slots", id(self), bucket)

    def _bucket(self, bucket: int) -> KVBuffers:
        if bucket not in self._buckets:
            self._buckets[bucket] = self.buffers.row_range(0, bucket)
        return self._buckets[bucket]

    def advance(self, slot: int, n_new: int) -> None:
        """``n_new`` tokens were written to ``slot``."""
        self.lengths[slot] += n_new

    def release(self, slot: int) -> None:
        """Forget ``slot``'s tokens: reusable at once."""
        self.check_slot(slot)
        self.lengths[slot] = 0

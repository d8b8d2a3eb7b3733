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
  ranges, each chunk causally to its slot's cache and itself. Eagerly, any size; or
  **captured per chunk bucket** (:meth:`SlotKVCache.packed`, :class:`PackedRows`,
  :func:`packed_step`): one token for each of the cache's rows, then the chunks padded to a
  bucket of ``C`` tokens, so the shapes depend on the bucket only; keys and values are written
  by indexed puts, the decode rows attend as in the captured decode step, and the chunks
  through one op that reads the chunks' ranges from ``chunk_spans`` as it runs: the layer's
  ``attention_chunks`` kernel where it is capturable (it reads them inside the op: the CPU
  backend's native op, Triton's on CUDA), so any graph strategy can capture the step — CUDA
  graphs too; else the reference's ``chunks_by_prefill`` (``attention_prefill`` per chunk,
  from Python), which only a strategy whose captured code calls the op's Python at every
  replay (``replays_host_code``: the CPU's compiled steps) can capture. Padding tokens write
  only the scratch position.
* **leave**: :meth:`SlotKVCache.release` sets the slot's length to 0; it is reusable at once
  (its old keys are overwritten before they are read again).

With graph capture the decode step of each bucket is captured once (keyed by this cache and
the bucket, over views of the same buffers), so sequences joining and leaving only change the
step's input tensors: nothing is captured again. Slot caches are never "stale": they live as
long as their :class:`SlotKVCache` and do not retire (nor are retired by) ``generate``'s cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import ConfigError
from .cache import (RAISE_HINT, DecodeRows, KVBuffers, MaxTokensError, MixedRows, StaticKVCache,
                    write_rows)


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


class _SlotForward(StaticKVCache):
    """What the caches of one forward over several slots share (:class:`SlotStep`,
    :class:`SlotMixed`): views of the slot store's buffers that are never retired, with no one
    length (each slot has its own; the slot store counts them). ``longest``: the most tokens a
    slot of the forward holds before it."""

    def __init__(self, buffers: KVBuffers, longest: int) -> None:
        super().__init__(buffers, None, -1)
        self.longest = longest
        self.length = -1  # no one length: each slot has its own

    def check_live(self) -> None:
        """Slot caches are never retired."""

    def advance(self, n_new: int) -> None:
        """The slot store counts each slot's tokens."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.longest


class SlotStep(_SlotForward):
    """The cache of one decode step over the first ``bucket`` rows of a :class:`SlotKVCache`:
    its one-token forward uses the per-row inputs ``rows`` (each row at its own position)."""

    ragged = True

    def __init__(self, buffers: KVBuffers, rows: DecodeRows, key: object, longest: int,
                 part_keys: set | None = None, split: bool = False) -> None:
        super().__init__(buffers, longest)
        self.rows, self._key = rows, key
        self._part_keys = part_keys if part_keys is not None else set()
        #: whether pipeline stages run this step as micro-batches (:meth:`micro_batch_caches`)
        self.split = split

    @property
    def graph_key(self) -> object:
        return self._key

    def decode_rows(self, position_ids: torch.Tensor) -> DecodeRows:
        return self.rows

    def micro_batch_caches(self, sizes: Sequence[int]) -> list["SlotStep"] | None:
        """This step as consecutive groups of ``sizes`` rows (their sum: this step's rows),
        each the decode step of its rows (views of the same buffers): pipeline stages run
        them one behind the other, so independent sequences fill the stages
        (:class:`~shardwise.pipeline.schedule.CachedMicroBatches`); None when the step runs
        whole (not :attr:`split`). Each group's graph is keyed by this step's key and its
        rows, so it is captured once and replayed for every later step of the same rows (the
        slot store drops them with its own)."""
        if not self.split:
            return None
        if sum(sizes) != self.buffers.batch:
            raise ValueError(f"micro-batches of {list(sizes)} rows do not cover the step's "
                             f"{self.buffers.batch}")
        parts, start = [], 0
        for n in sizes:
            cut = slice(start, start + n)
            rows = DecodeRows(position_ids=self.rows.position_ids[cut],
                              write_index=self.rows.write_index[cut],
                              lengths=self.rows.lengths[cut], starts=self.rows.starts[cut])
            key = (self._key, start, n)
            self._part_keys.add(key)
            parts.append(SlotStep(self.buffers.row_range(start, start + n), rows, key,
                                  self.longest))
            start += n
        return parts

    def reserve(self, n_new: int) -> int:
        if n_new != 1:
            raise MaxTokensError(f"a decode step over slots appends one token per slot, got "
                                 f"{n_new}")
        return 0  # each row's position is in ``rows``; the slot store checked they fit


class SlotMixed(_SlotForward):
    """The cache of one mixed forward over a :class:`SlotKVCache`; the input is one batch row
    of ``tokens`` tokens. Eager: :attr:`mixed` (:class:`~shardwise.inject.cache.MixedRows`)
    says which packed token goes where. Captured (:meth:`SlotKVCache.packed`): ``replay``
    runs the forward through the captured step of its token bucket (:class:`PackedStep`)."""

    def __init__(self, buffers: KVBuffers, mixed: MixedRows | None, longest: int,
                 tokens: int, replay=None) -> None:
        super().__init__(buffers, longest)
        self.mixed, self.tokens = mixed, tokens
        #: ``replay(stack, x)``: the captured forward of the embeddings x [1, tokens, hidden]
        #: → the hidden states of its kept rows (None: eager)
        self.replay = replay
        self.batch = 1  # the packed row

    @property
    def graph_key(self) -> None:
        return None  # not a decode step: the stack's decode graphs never run it

    def reserve(self, n_new: int) -> int:
        if n_new != self.tokens:
            raise MaxTokensError(f"a mixed step packs {self.tokens} tokens, the input has "
                                 f"{n_new}")
        return 0  # each part's positions are in the step's rows; the slot store checked them


#: prompt chunks one captured mixed step carries at most (its head keeps one row for each)
PACKED_CHUNKS = 4


@dataclass
class PackedRows:
    """The static layout of one *captured* mixed step (:meth:`SlotKVCache.packed`): its
    ``R + C`` tokens are one batch row — first one token for each of the cache's first
    ``decode_rows`` (R) rows (a decoding slot's token, or for a row with none a token written
    to the scratch position and attending only to it, as an idle row of a decode step), then
    ``C`` prompt-chunk tokens (the chunk bucket: the chunks' tokens, then padding tokens
    written to the scratch position of row 0, their results zero). The shapes depend on R and
    C only, so one captured step serves every mix of slots and chunks of its bucket; where
    each token goes is in the tensors, read at run time:

    * ``position_ids`` [1, R + C]: each token's position in its own sequence (padding: 0);
    * ``write_index``/``lengths``/``starts`` [R]: the decode rows, as :class:`DecodeRows`;
    * ``chunk_rows``/``chunk_positions`` [C]: the row and position each chunk token is
      written at;
    * ``chunk_spans`` [PACKED_CHUNKS, 3]: ``(slot, past, n)`` of each chunk in packed order
      (``n`` = 0: no chunk), read at run time by the chunk attention op (the layer's
      ``attention_chunks`` kernel or ``chunks_by_prefill``: each chunk attends causally to
      its slot's ``past`` cached tokens and to itself, reading only that range).

    The layers call :meth:`attend` for their attention (``StepContext.mixed``)."""

    decode_rows: int
    position_ids: torch.Tensor
    write_index: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    chunk_rows: torch.Tensor
    chunk_positions: torch.Tensor
    chunk_spans: torch.Tensor
    _decode_ctx: object = None  # the decode rows' StepContext, made at the first layer

    def attend(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               ctx) -> torch.Tensor:
        """``layer``'s attention in the captured step: q [1, q_heads, R + C, d], k and v
        [1, kv_heads, R + C, d] → context [1, q_heads, R + C, d]. Every key and value is
        written first (indexed puts: no host sync), then the decode rows attend as in the
        captured decode step and the chunks through the layer's capturable
        ``attention_chunks`` kernel, else ``chunks_by_prefill`` (the reference module's)."""
        r = self.decode_rows
        k_cache, v_cache = ctx.cache.k[layer.slot], ctx.cache.v[layer.slot]  # [rows, h, P, d]

        def by_row(t: torch.Tensor) -> torch.Tensor:  # [1, h, R + C, d] → [R, h, 1, d]
            return t[0, :, :r].transpose(0, 1)[:, :, None]

        def chunk_part(t: torch.Tensor) -> torch.Tensor:  # [1, h, R + C, d] → [C, h, d]
            return t[0, :, r:].transpose(0, 1)

        write_rows(k_cache, self.write_index, by_row(k))  # rows 0 .. R - 1
        write_rows(v_cache, self.write_index, by_row(v))
        k_cache[self.chunk_rows, :, self.chunk_positions] = chunk_part(k)
        v_cache[self.chunk_rows, :, self.chunk_positions] = chunk_part(v)
        # q contiguous: the CPU decode op's fake kernel says its output is, and the real
        # op's output follows q's layout (a strided q made the compiled step assert)
        decoded = layer._captured_decode(by_row(q).contiguous(), k_cache[:r], v_cache[:r],
                                         self._decode_context(ctx))  # [R, hq, 1, d]
        kw, kernels = layer.attn_kw, layer.kernels
        if kernels.chunks_capturable:  # one op in the step, reading chunk_spans as it runs
            chunks = kernels.attention_chunks(
                q[:, :, r:], k_cache, v_cache, self.chunk_spans, scale=kw["scale"],
                window=kw.get("window"), alibi_slopes=kw.get("alibi_slopes"),
                sinks=kw.get("sinks"))  # [1, hq, C, d]
        else:
            chunks = torch.ops.shardwise.chunks_by_prefill(
                q[:, :, r:], k_cache, v_cache, self.chunk_spans,
                kernels.backends["attention_prefill"], kw["scale"], kw.get("window"),
                kw.get("alibi_slopes"), kw.get("sinks"))
        return torch.cat([decoded[:, :, 0].transpose(0, 1)[None], chunks], dim=2)

    def _decode_context(self, ctx):
        """The graph-safe decode context of the first R rows (one per step: its masks are
        built once and shared by the layers)."""
        if self._decode_ctx is None:
            from .layers import StepContext

            self._decode_ctx = StepContext(ctx.cache, past=-1, decode=True, graph_safe=True,
                                           write_index=self.write_index, lengths=self.lengths,
                                           starts=self.starts)
        return self._decode_ctx


def packed_step(stack, buffers: KVBuffers, decode_rows: int, head=None):
    """The function a graph strategy captures for the mixed steps of one chunk bucket over
    ``buffers`` (a :class:`SlotKVCache`'s): ``step(x, position_ids, write_index, lengths,
    starts, chunk_rows, chunk_positions, chunk_spans, keep)`` — the token embeddings x
    [1, R + C, hidden], the :class:`PackedRows` tensors and ``keep`` [R + PACKED_CHUNKS] —
    → the final hidden states of the kept positions [1, R + PACKED_CHUNKS, hidden] and, with
    ``head`` (the output head's own forward), their logits [1, R + PACKED_CHUNKS, vocab]."""
    from .layers import StepContext

    every_row = StaticKVCache(buffers, None, -1)

    def mixed_step(x, position_ids, write_index, lengths, starts, chunk_rows, chunk_positions,
                   chunk_spans, keep):
        rows = PackedRows(decode_rows, position_ids, write_index, lengths, starts, chunk_rows,
                          chunk_positions, chunk_spans)
        ctx = StepContext(every_row, past=-1, decode=False, mixed=rows)
        hidden = stack.run_layers(stack._embedded(ctx, x, position_ids), ctx)  # [1, T, hidden]
        kept = hidden.index_select(1, keep)
        return kept if head is None else (kept, head(kept))
    return mixed_step


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
        #: the graph keys of the steps' micro-batches (:meth:`SlotStep.micro_batch_caches`)
        self.part_keys: set = set()

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

    def step(self, slots: Sequence[int], bucket: int, split: bool = False) -> SlotStep:
        """The cache of one decode step appending one token to each of ``slots`` (each <
        ``bucket``, the rows the step runs over; the other rows write to the scratch position
        and attend only to it). No ``slots``: every row idle (a warmup step). ``split``: under
        pipeline stages with micro-batches, the step's rows run as micro-batches
        (:meth:`SlotStep.micro_batch_caches`), else whole."""
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
        return SlotStep(self._bucket(bucket), rows, self.graph_key(bucket), longest,
                        self.part_keys, split)

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
        return SlotMixed(self.buffers, rows, longest, rows.tokens)

    def packed(self, slots: Sequence[int], chunks: Sequence[tuple[int, int]], decode_rows: int,
               chunk_bucket: int) -> tuple[PackedRows, list[int], int]:
        """The inputs of one captured mixed step (:class:`PackedRows`) over the first
        ``decode_rows`` rows (covering every one of ``slots``) and ``chunk_bucket`` chunk tokens
        (at least the chunks' tokens; at most :data:`PACKED_CHUNKS` chunks), checked as
        :meth:`mixed`; no ``slots`` and no ``chunks``: every row idle and only padding (a
        warmup or capture step: it writes scratch positions only). Returns the rows, the
        packed positions whose logits the step keeps — the ``decode_rows`` decode tokens, then
        each chunk's final token (padding: 0), one list of ``decode_rows + PACKED_CHUNKS`` —
        and the most tokens a slot of it holds."""
        if slots or chunks:
            self.check_mixed(slots, chunks)
        chunk_tokens = sum(n for _, n in chunks)
        if not max(slots, default=-1) < decode_rows <= self.rows or \
                chunk_tokens > chunk_bucket or \
                len(chunks) > PACKED_CHUNKS:
            raise ValueError(f"a captured mixed step over {decode_rows} rows and {chunk_bucket} "
                             f"chunk tokens (at most {PACKED_CHUNKS} chunks) cannot hold slots "
                             f"{list(slots)} and chunks {list(chunks)}")
        write, starts = [self.scratch] * decode_rows, [self.scratch] * decode_rows
        positions = [0] * (decode_rows + chunk_bucket)
        for slot in slots:
            write[slot], starts[slot], positions[slot] = self.lengths[slot], 0, self.lengths[slot]
        rows_of = [0] * chunk_bucket  # padding: row 0's scratch position
        at = [self.scratch] * chunk_bucket
        spans = [[0, 0, 0] for _ in range(PACKED_CHUNKS)]
        keep = list(range(decode_rows)) + [0] * PACKED_CHUNKS
        start = 0
        for i, (slot, n) in enumerate(chunks):
            past = self.lengths[slot]
            rows_of[start:start + n] = [slot] * n
            at[start:start + n] = range(past, past + n)
            positions[decode_rows + start:decode_rows + start + n] = range(past, past + n)
            spans[i] = [slot, past, n]
            start += n
            keep[decode_rows + i] = decode_rows + start - 1
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        write_index = as_tensor(write)
        rows = PackedRows(decode_rows, position_ids=as_tensor(positions)[None],
                          write_index=write_index, lengths=write_index + 1,
                          starts=as_tensor(starts), chunk_rows=as_tensor(rows_of),
                          chunk_positions=as_tensor(at), chunk_spans=as_tensor(spans))
        longest = max((self.lengths[s] for s in [*slots, *(c for c, _ in chunks)]), default=0)
        return rows, keep, longest

    def packed_key(self, decode_rows: int, chunk_bucket: int) -> tuple:
        """The key of the mixed step captured over this cache's first ``decode_rows`` rows
        and ``chunk_bucket`` chunk tokens."""
        return ("slots-mixed", id(self), decode_rows, chunk_bucket)

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

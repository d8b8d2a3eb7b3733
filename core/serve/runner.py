"""The model side of ``shardwise serve``: :class:`SlotRunner`, a
:class:`~shardwise.serve.types.Runner` over the slots of one static KV cache of an injected
engine (:mod:`shardwise.inject.slots`).

Each call is one forward of the engine's own Hugging Face model (``engine.module``), so its
output head — and under tensor parallelism the head's hooks, e.g. the vocab all-gather — runs
as in ``generate``: a prompt chunk is a batch-1 forward over its slot's row; a decode step is
one forward over the smallest batch bucket covering the highest active slot (with graph
capture: that bucket's captured step, captured by :meth:`SlotRunner.warmup` before serving and
never again when sequences join or leave); a *mixed* step (:meth:`SlotRunner.mixed`) is one
forward carrying a decode token of each running slot and prompt chunks of others, packed in
one row (chunked prefill inside the decode batch: :mod:`shardwise.inject.slots`). With graphs
whose strategy replays host code (the CPU's compiled steps) a mixed step runs the captured step
of its chunk bucket (:attr:`SlotRunner.mixed_buckets`: the chunks padded up to one, the decode
part over every row; each bucket captured by :meth:`SlotRunner.warmup`); otherwise eagerly, any
size (the reason logged once, the steps counted in :attr:`SlotRunner.mixed_steps`).

Tensor parallelism and pipeline stages: every rank runs the same forwards (under stages, each
its own layers, the hidden states passed on between them). Rank 0's runner first sends each
operation to the other ranks through ``engine.communicator.broadcast`` — one int64 header
``[op, a, b, c]`` and, for init, prefill, decode and mixed steps, one int64 payload (the
``pipeline_split`` code and the mixed-step buckets; the tokens; the slots and the tokens; the
decode slots and tokens, each chunk's slot, size and ``last``, then the chunk tokens) — and the
other ranks run :func:`follow`, which receives and executes them until :meth:`SlotRunner.close`.
Under pipeline stages with micro-batches a decode step's rows may run as micro-batches one
behind the other through the stages (``pipeline_split``, decided per batch bucket by
:meth:`SlotRunner.warmup` from the measured step, the same on every rank). The communicator's
collectives time out, so a dead rank makes the others raise
:class:`~shardwise.errors.CollectiveError` within the collective timeout; rank 0's scheduler
calls :meth:`SlotRunner.heartbeat` while idle so that the followers' wait for the next operation
does not time out.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from typing import Any, Iterator, Sequence

import torch

from ..errors import ConfigError, ShardwiseError
from ..inject.cache import RAISE_HINT, StaticKVCache
from ..inject.injector import injected_stack
from ..inject.layers import InjectedModel
from ..graphs import progress
from ..inject.capture import DecodeGraphs
from ..inject.slots import PACKED_CHUNKS, PackedRows, SlotKVCache, SlotMixed, packed_step

log = logging.getLogger(__name__)

#: the chunk-token buckets of captured mixed steps (``SlotRunner(mixed_buckets=)``): prompt
#: chunks are cut to fill one (the scheduler), the rest of a prompt padded up to the smallest
#: that holds it
MIXED_BUCKETS = (8, 16, 32, 64)

# operations rank 0 sends (header[0])
INIT, PREFILL, DECODE, RELEASE, HEARTBEAT, WARMUP, CLOSE, MIXED = range(1, 9)
_OP_NAMES = {INIT: "init", PREFILL: "prefill", DECODE: "decode", RELEASE: "release",
             HEARTBEAT: "heartbeat", WARMUP: "warmup", CLOSE: "close", MIXED: "mixed"}
HEADER = 4  # int64 words of a header: op, then up to three arguments
#: ``pipeline_split="auto"`` splits a bucket's steps only when split they took under this
#: share of the whole step's time: splitting costs a read of the weights per micro-batch, and
#: an idle warm-up step timed 3 times is noisy (a 5-13% gain measured on tiny buckets did not
#: hold for real steps: benchmarks/README.md, "Serving over pipeline stages")
SPLIT_MARGIN = 0.9
#: ``pipeline_split`` on the wire (INIT's payload, first word)
_SPLIT_CODES = {False: 0, True: 1, "auto": 2}


def decoder_stack(engine: Any) -> InjectedModel:
    """The injected decoder stack of ``engine`` (:class:`ConfigError` when the engine was built
    without ``replace_with_kernel_inject`` or is an encoder)."""
    module = getattr(engine, "module", None)
    stack = injected_stack(module) if module is not None else None
    if stack is not None:
        return stack
    from ..inject.encoder import injected_encoder

    if module is not None and injected_encoder(module) is not None:
        raise ConfigError(f"{type(module).__name__} is an encoder: it generates no tokens, so "
                          f"there is nothing to serve with continuous batching (serve its "
                          f"embeddings instead)")
    raise ConfigError("continuous batching runs over the injected model's static KV cache: "
                      "build the engine with init_inference(..., "
                      "replace_with_kernel_inject=True)")


class SlotRunner:
    """``max_batch`` slots of ``max_tokens`` tokens each over an injected engine (see the module
    docstring); implements :class:`~shardwise.serve.types.Runner`.

    Args:
        engine: an :class:`~shardwise.InferenceEngine` built with
            ``replace_with_kernel_inject=True`` (a decoder).
        max_batch: slots (sequences running at once), ≥ 1.
        max_tokens: tokens one slot holds (prompt plus generated); default and maximum the
            engine's ``max_tokens``.
        mixed_buckets: the chunk-token buckets of the captured mixed steps (with graphs whose
            strategy can capture them; :attr:`mixed_buckets`), each captured by
            :meth:`warmup`: more buckets pad less and take longer to warm up.
        pipeline_split: under pipeline stages with micro-batches, whether a decode step's
            rows run as micro-batches one behind the other through the stages (independent
            sequences filling them) or whole: ``"auto"`` times both in :meth:`warmup` (at the
            power-of-two batch buckets, the smallest and the largest; the others take the
            choice of the largest timed below them) and splits only where split is faster by
            :data:`SPLIT_MARGIN` (each micro-batch reads the stage's weights again, so where a
            step's cost is its weights' bytes — decode at small batches — whole wins); True /
            False force it. Decided by :meth:`warmup` (rank 0's choice, sent to every rank:
            :attr:`split_buckets`); before it every step runs whole.

    Every method is called from one thread (the scheduler's). Logits are float32.
    """

    def __init__(self, engine: Any, max_batch: int, max_tokens: int | None = None, *,
                 mixed_buckets: Sequence[int] = MIXED_BUCKETS, pipeline_split: bool | str = "auto",
                 _follower: bool = False) -> None:
        stack = decoder_stack(engine)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be an int >= 1, got {max_batch!r}")
        limit = stack.max_tokens
        if max_tokens is None:
            max_tokens = limit
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or \
                not 1 <= max_tokens <= limit:
            raise ConfigError(f"max_tokens must be an int from 1 to the engine's max_tokens "
                              f"({limit}), got {max_tokens!r}; {RAISE_HINT}")
        self.engine, self.stack = engine, stack
        self.comm = engine.communicator
        self.leader = self.comm.rank == 0
        self.tp = self.comm.world_size > 1
        if self.tp and not self.leader and not _follower:
            raise ConfigError(f"rank {self.comm.rank}: under tensor parallelism only rank 0 "
                              f"drives a SlotRunner; the other ranks call "
                              f"shardwise.serve.runner.follow(engine)")
        self.max_batch, self.max_tokens = max_batch, max_tokens
        config = engine.module.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.vocab_size = int(text.vocab_size)
        self.device = engine.device
        mixed_buckets = _check_buckets(mixed_buckets)
        if pipeline_split not in _SPLIT_CODES:
            raise ConfigError(f"pipeline_split must be 'auto', True or False, got "
                              f"{pipeline_split!r}")
        if self.tp and self.leader:
            self._send(INIT, max_batch, max_tokens, len(mixed_buckets),
                       payload=[_SPLIT_CODES[pipeline_split], *mixed_buckets])
        self.strategy = stack.graphs.strategy if stack.graphs is not None else None
        weight = stack.parts.final_norm.weight
        self.cache = SlotKVCache(stack, max_batch, self._bucket(max_batch), max_tokens,
                                 weight.dtype, weight.device)
        self._cache_kw = "cache" if "cache" in inspect.signature(
            engine.module.forward).parameters else "past_key_values"
        #: the HF forward takes ``logits_to_keep`` (the head runs on the kept positions only)
        self._takes_keep = "logits_to_keep" in inspect.signature(
            engine.module.forward).parameters
        self.closed = False
        #: why this runner cannot run :meth:`mixed` steps (None: it can): the scheduler then
        #: alternates prefill calls and decode steps
        self.mixed_unsupported: str | None = stack.mixed_unsupported
        #: why mixed steps run eagerly here although decode steps replay graphs (None: they are
        #: captured, or nothing is: no graphs); logged once, and every such step is counted
        self.mixed_eager_reason = self._mixed_capture_refusal(mixed_buckets)
        #: the chunk-token buckets of the captured mixed steps (each step carries one token per
        #: row of the decode bucket, then a bucket's chunk tokens, padded), smallest first;
        #: empty: mixed steps run eagerly, any size
        self.mixed_buckets: tuple[int, ...] = () if self.mixed_eager_reason is not None or \
            self.strategy is None or self.mixed_unsupported is not None else mixed_buckets
        #: the most prompt chunks one mixed step carries (None: no limit)
        self.mixed_chunks: int | None = PACKED_CHUNKS if self.mixed_buckets else None
        #: mixed steps run so far: "captured" (a bucket's graph), "eager"
        self.mixed_steps = {"captured": 0, "eager": 0}
        self._packed: dict[int, Any] = {}  # chunk bucket → its captured mixed step
        if self.mixed_eager_reason is not None and self.mixed_unsupported is None:
            log.warning("shardwise serve: mixed steps run eagerly (%s); decode-only steps "
                        "replay their graphs", self.mixed_eager_reason)
        #: under tensor parallelism, the error of a step that failed once it had started (the
        #: ranks may be out of step: every later call is refused)
        self.failed: BaseException | None = None
        self.pipeline_split = pipeline_split
        stages = getattr(engine, "stages", None)
        #: micro-batches a decode step may be split into (1: no pipeline stages to fill)
        self.micro_batches = stages.micro_batches if stages is not None else 1
        #: batch bucket → whether its decode steps run as micro-batches (set by
        #: :meth:`warmup` under pipeline stages; absent: whole), with each variant's measured
        #: step in :attr:`split_seconds` (bucket → (whole, split) seconds, "auto" only)
        self.split_buckets: dict[int, bool] = {}
        self.split_seconds: dict[int, tuple[float, float]] = {}

    # ----- the Runner contract -------------------------------------------------------------------

    def prefill(self, slot: int, token_ids: Sequence[int], last: bool) -> torch.Tensor | None:
        """Append the prompt chunk ``token_ids`` (≥ 1 token) to ``slot``; with ``last`` the
        logits of its final token, float32 [vocab]. Raises
        :class:`~shardwise.inject.cache.MaxTokensError` (nothing written) when the slot would
        hold more than ``max_tokens``."""
        self._check_open()
        tokens = [int(t) for t in token_ids]
        self.cache.check_chunk(slot, len(tokens))
        with self._in_step():
            if self.tp:
                self._send(PREFILL, slot, len(tokens), int(bool(last)), payload=tokens)
            return self._prefill(slot, tokens, bool(last))

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """One step appending ``token_ids[i]`` to ``slots[i]`` → the next logits, float32
        [len(slots), vocab] (row i for ``slots[i]``)."""
        self._check_open()
        slots, tokens = [int(s) for s in slots], [int(t) for t in token_ids]
        if len(slots) != len(tokens):
            raise ValueError(f"decode takes one token per slot, got {len(slots)} slots and "
                             f"{len(tokens)} tokens")
        self.cache.check_step(slots)
        with self._in_step():
            if self.tp:
                self._send(DECODE, len(slots), payload=slots + tokens)
            return self._decode(slots, tokens)

    @property
    def supports_mixed(self) -> bool:
        """Whether :meth:`mixed` runs here (else :attr:`mixed_unsupported` says why)."""
        return self.mixed_unsupported is None

    def mixed(self, slots: Sequence[int], token_ids: Sequence[int],
              chunks: Sequence[tuple[int, Sequence[int], bool]]
              ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """One forward that is a decode step appending ``token_ids[i]`` to ``slots[i]`` AND
        a prompt chunk ``(slot, tokens, last)`` appended to each of ``chunks``' slots (chunked
        prefill inside the decode batch; the captured step of :meth:`mixed_bucket`'s bucket
        where there is one, else eager). Returns the decode logits, float32
        [len(slots), vocab] (as :meth:`decode`), and per chunk its final token's logits
        float32 [vocab] when ``last``, else None (as :meth:`prefill`). Every slot at most once;
        nothing is written when a check fails (:class:`ValueError`,
        :class:`~shardwise.inject.cache.MaxTokensError`). Raises
        :class:`~shardwise.errors.ConfigError` where :attr:`mixed_unsupported`."""
        self._check_open()
        if self.mixed_unsupported is not None:
            raise ConfigError(f"this engine cannot run mixed steps: {self.mixed_unsupported}; "
                              f"call prefill and decode separately")
        slots, tokens = [int(s) for s in slots], [int(t) for t in token_ids]
        if len(slots) != len(tokens):
            raise ValueError(f"mixed takes one decode token per slot, got {len(slots)} slots "
                             f"and {len(tokens)} tokens")
        parts = [(int(slot), [int(t) for t in ids], bool(last)) for slot, ids, last in chunks]
        self.cache.check_mixed(slots, [(slot, len(ids)) for slot, ids, _ in parts])
        with self._in_step():
            if self.tp:
                words = [w for slot, ids, last in parts for w in (slot, len(ids), int(last))]
                chunk_tokens = [t for _, ids, _ in parts for t in ids]
                self._send(MIXED, len(slots), len(parts), len(chunk_tokens),
                           payload=slots + tokens + words + chunk_tokens)
            return self._mixed(slots, tokens, parts)

    def release(self, slot: int) -> None:
        """Forget ``slot``'s tokens: a new sequence can take it at once."""
        self._check_open()
        self.cache.check_slot(slot)
        with self._in_step():
            if self.tp:
                self._send(RELEASE, slot)
            self.cache.release(slot)

    def length(self, slot: int) -> int:
        """Tokens in ``slot``."""
        self.cache.check_slot(slot)
        return self.cache.lengths[slot]

    def heartbeat(self) -> None:
        """Tell the other ranks rank 0 is alive (a no-op on one rank)."""
        self._check_open()
        with self._in_step():
            if self.tp:
                self._send(HEARTBEAT)

    def warmup(self) -> None:
        """Run (with graphs: capture) the decode step of every batch bucket up to
        ``max_batch`` once, and capture the mixed step of every chunk bucket
        (:attr:`mixed_buckets`), so serving never compiles mid-request. Slot contents are
        kept: the steps write only the scratch position."""
        self._check_open()
        with self._in_step():
            if self.tp:
                self._send(WARMUP)
            self._warmup()

    def close(self) -> None:
        """Stop: the other ranks leave :func:`follow`; the slot buffers and their captured
        steps are freed. Idempotent. After a failed step under tensor parallelism nothing is
        sent (the other ranks are gone or out of step: waiting on them would only add another
        collective timeout to the server's exit)."""
        if self.closed:
            return
        try:
            if self.tp and self.failed is None:
                self._send(CLOSE)
        finally:
            self._close()

    def buckets(self) -> list[int]:
        """The batch buckets decode steps run over (each one's step captured by warmup)."""
        return sorted({self._bucket(n) for n in range(1, self.max_batch + 1)})

    # ----- what every rank runs ------------------------------------------------------------------

    def _bucket(self, rows: int) -> int:
        """Rows a decode step over slots 0 .. rows - 1 runs over: the graph strategy's batch
        bucket (one captured step per bucket), or exactly ``rows`` when decoding eagerly."""
        return self.strategy.batch_bucket(rows) if self.strategy is not None else rows

    def _forward(self, ids: torch.Tensor, cache: StaticKVCache,
                 keep: int | torch.Tensor = 1) -> torch.Tensor:
        """The HF model's forward of ``ids`` [b, s] over ``cache`` → the logits of the kept
        positions [b, kept, vocab]: ``keep`` is HF's ``logits_to_keep`` (the last ``keep``
        positions, 0: all; or a tensor of positions), applied here where the model does not
        take it. The head's hooks run (tensor-parallel vocab gather)."""
        kw = {"logits_to_keep": keep} if self._takes_keep else {}
        with torch.inference_mode():
            out = self.engine.module(input_ids=ids, use_cache=True, **{self._cache_kw: cache},
                                     **kw)
        if self._takes_keep:
            return out.logits
        if isinstance(keep, torch.Tensor):
            return out.logits.index_select(1, keep)
        return out.logits[:, -keep:] if keep else out.logits

    def _prefill(self, slot: int, tokens: list[int], last: bool) -> torch.Tensor | None:
        ids = torch.tensor([tokens], dtype=torch.int64, device=self.device)
        logits = self._forward(ids, self.cache.row(slot))  # [1, 1, vocab]
        self.cache.advance(slot, len(tokens))
        return logits[0, -1].float() if last else None

    def _decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        bucket = self._bucket(max(slots) + 1)
        step = self.cache.step(slots, bucket, split=self.split_buckets.get(bucket, False))
        logits = self._forward(self._row_tokens(bucket, slots, tokens)[:, None].to(self.device),
                               step)
        self._advance(slots, [])
        return self._rows(logits[:, -1], slots)  # [bucket, vocab] → [len(slots), vocab]

    def _mixed(self, slots: list[int], tokens: list[int], parts: list[tuple[int, list[int], bool]]
               ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        chunk_tokens = sum(len(ids) for _, ids, _ in parts)
        bucket = self.mixed_bucket(chunk_tokens, len(parts))
        if bucket is None:
            decode_logits, chunk_logits = self._mixed_eager(slots, tokens, parts)
        else:
            decode_logits, chunk_logits = self._mixed_captured(slots, tokens, parts, bucket)
        self._advance(slots, parts)
        rows = iter(chunk_logits.float())
        return decode_logits.float(), [next(rows) if last else None for _, _, last in parts]

    def mixed_bucket(self, chunk_tokens: int, chunks: int = 1) -> int | None:
        """The chunk bucket of a captured mixed step carrying ``chunk_tokens`` prompt tokens in
        ``chunks`` chunks: the smallest of :attr:`mixed_buckets` that holds them, or None
        when the step runs eagerly (no buckets, more tokens than the largest, more chunks
        than :attr:`mixed_chunks`)."""
        if self.mixed_chunks is not None and chunks > self.mixed_chunks:
            return None
        return next((b for b in self.mixed_buckets if b >= chunk_tokens), None)

    def _mixed_eager(self, slots, tokens, parts) -> tuple[torch.Tensor, torch.Tensor]:
        """An eager mixed step (:class:`~shardwise.inject.cache.MixedRows`: every size) → the
        decode rows' logits [len(slots), vocab] and the final chunks' [lasts, vocab]."""
        self.mixed_steps["eager"] += 1
        cache = self.cache.mixed(slots, [(slot, len(ids)) for slot, ids, _ in parts])
        ids = torch.tensor([tokens + [t for _, chunk, _ in parts for t in chunk]],
                           dtype=torch.int64, device=self.device)  # [1, T]
        keep, end = list(range(len(slots))), len(slots)  # packed positions whose logits count
        for _, chunk, last in parts:
            end += len(chunk)
            if last:
                keep.append(end - 1)
        index = torch.tensor(keep, dtype=torch.int64, device=self.device)
        logits = self._forward(ids, cache, index)[0]  # [len(keep), vocab]
        return logits[:len(slots)], logits[len(slots):]

    def _mixed_captured(self, slots, tokens, parts, bucket: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixed step through the captured step of chunk bucket ``bucket`` (the decode part
        over every row of the slot cache: one captured step per bucket) → as
        :meth:`_mixed_eager`."""
        self.mixed_steps["captured"] += 1
        rows_n = self.cache.rows
        rows, keep, longest = self.cache.packed(
            slots, [(slot, len(ids)) for slot, ids, _ in parts], rows_n, bucket)
        ids = torch.zeros(1, rows_n + bucket, dtype=torch.int64)  # built on the host, moved once
        ids[0, :rows_n] = self._row_tokens(rows_n, slots, tokens)
        chunk = [t for _, ids_, _ in parts for t in ids_]
        ids[0, rows_n:rows_n + len(chunk)] = torch.tensor(chunk, dtype=torch.int64)
        keep_t = torch.tensor(keep, dtype=torch.int64, device=self.device)
        replay = functools.partial(self._replay_packed, bucket, rows, keep_t)
        cache = SlotMixed(self.cache.buffers, rows, longest, rows_n + bucket, replay=replay)
        # the step's hidden states are its kept rows already: keep every one (0)
        logits = self._forward(ids.to(self.device), cache, 0)[0]  # [rows + PACKED_CHUNKS, vocab]
        lasts = [i for i, (_, _, last) in enumerate(parts) if last]
        return self._rows(logits, slots), logits[rows_n + torch.tensor(lasts, dtype=torch.int64,
                                                                       device=logits.device)]

    def _replay_packed(self, bucket: int, rows: PackedRows, keep: torch.Tensor, stack: Any,
                       x: torch.Tensor) -> torch.Tensor:
        """The stack's mixed forward, answered by the captured step of ``bucket``: the
        embeddings x [1, T, hidden] → the kept rows' hidden states [1, kept, hidden]; the
        head's logits wait for the HF shell's head call (``HeadFromGraph``)."""
        graph = self._packed.get(bucket)
        if graph is None:  # warmup captures every bucket: only a runner used before warmup
            log.warning("shardwise serve: capturing the mixed step of chunk bucket %d while "
                        "serving (warmup() captures it before)", bucket)
            graph = self._capture_packed(bucket)
        out = graph(x, rows.position_ids, rows.write_index, rows.lengths, rows.starts,
                    rows.chunk_rows, rows.chunk_positions, rows.chunk_spans, keep)
        graphs = self.stack.graphs
        with torch.inference_mode(False):  # normal tensors: their version counter is tracked
            if graphs.head_forward is None:
                return out.clone()
            hidden, logits = out[0].clone(), out[1].clone()
        graphs.offer_logits(hidden, logits)  # the head call takes them
        return hidden

    def _capture_packed(self, bucket: int) -> Any:
        """Capture the mixed step of chunk bucket ``bucket`` (kept with the stack's graphs,
        freed with them or by :meth:`close`)."""
        graphs, rows_n = self.stack.graphs, self.cache.rows
        weight = self.stack.parts.final_norm.weight
        t = rows_n + bucket
        rows, keep, _ = self.cache.packed([], [], rows_n, bucket)  # every row idle
        x = torch.zeros(1, t, weight.shape[-1], dtype=weight.dtype, device=weight.device)
        fn = packed_step(self.stack, self.cache.buffers, rows_n, graphs.head_forward)
        with progress(f"capturing the mixed step of {rows_n} decode rows and {bucket} prompt "
                      f"tokens with {self.strategy.name}"):
            graph = self.strategy.capture(
                fn, x, rows.position_ids, rows.write_index, rows.lengths, rows.starts,
                rows.chunk_rows, rows.chunk_positions, rows.chunk_spans,
                torch.tensor(keep, dtype=torch.int64, device=weight.device))
        graphs._pending = None
        self._packed[bucket] = graphs.graphs[self.cache.packed_key(rows_n, bucket)] = graph
        return graph

    def _mixed_capture_refusal(self, buckets: Sequence[int]) -> str | None:
        """Why mixed steps cannot be captured while decode steps are (None: they can, or
        nothing is captured)."""
        graphs = self.stack.graphs
        if self.strategy is None or self.mixed_unsupported is not None:
            return None
        if not buckets:
            return "no mixed-step buckets were asked for (mixed_buckets=())"
        if type(graphs) is not DecodeGraphs:
            return (f"the decode step is captured by {type(graphs).__name__} (layer by layer), "
                    f"not as one step")
        kernels = self.stack.kernels
        if not self.strategy.replays_host_code and not kernels.chunks_capturable:
            return (f"the {self.strategy.name!r} graph strategy replays what it recorded, and "
                    f"this model's attention_chunks kernel "
                    f"({kernels.backends['attention_chunks']}) reads the prompt chunks' ranges "
                    f"on the host at each step")
        return None

    @staticmethod
    def _row_tokens(rows: int, slots: list[int], tokens: list[int]) -> torch.Tensor:
        """[rows] int64 on the host: ``tokens[i]`` at row ``slots[i]``, 0 in the idle rows."""
        ids = torch.zeros(rows, dtype=torch.int64)
        ids[slots] = torch.tensor(tokens, dtype=torch.int64)
        return ids

    @staticmethod
    def _rows(logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Rows ``slots`` of per-row logits [rows, vocab], float32."""
        index = torch.tensor(slots, dtype=torch.int64, device=logits.device)
        return logits.index_select(0, index).float()

    def _advance(self, slots: list[int], parts: list[tuple[int, list[int], bool]]) -> None:
        """One token was written to each of ``slots`` and each chunk's to its slot."""
        for slot in slots:
            self.cache.advance(slot, 1)
        for slot, chunk, _ in parts:
            self.cache.advance(slot, len(chunk))

    def _warmup(self) -> None:
        for bucket in self.buckets():
            ids = torch.zeros(bucket, 1, dtype=torch.int64, device=self.device)
            self._forward(ids, self.cache.step([], bucket))
        for bucket in self.mixed_buckets:
            if bucket not in self._packed:
                self._capture_packed(bucket)
        if self.micro_batches > 1:
            self._choose_splits()

    def _choose_splits(self, rounds: int = 3) -> None:
        """Every rank: whether each batch bucket's decode step runs as micro-batches
        (:attr:`split_buckets`). Forced: every bucket alike (each rank got the policy with
        INIT). ``"auto"``: measured at the power-of-two buckets, the smallest and the
        largest — an idle step of each, each variant once untimed (it captures), then
        ``rounds`` times, every rank running them together — and split where split took under
        :data:`SPLIT_MARGIN` of whole; a bucket between two measured ones takes the smaller
        one's choice. Rank 0's choice is broadcast, so every rank splits the same steps."""
        buckets = [b for b in self.buckets() if b >= 2]
        if self.pipeline_split != "auto":
            self.split_buckets = dict.fromkeys(buckets, bool(self.pipeline_split))
            return
        # the smallest and largest too: every bucket has a measured one at or below it
        ends = set(buckets[:1] + buckets[-1:])
        probes = sorted({b for b in buckets if b & (b - 1) == 0} | ends)
        self.split_seconds = {}
        for bucket in probes:
            ids = torch.zeros(bucket, 1, dtype=torch.int64, device=self.device)
            seconds = []
            for split in (False, True):
                self._forward(ids, self.cache.step([], bucket, split=split))
                start = time.perf_counter()
                for _ in range(rounds):
                    self._forward(ids, self.cache.step([], bucket, split=split))
                seconds.append((time.perf_counter() - start) / rounds)
            self.split_seconds[bucket] = (seconds[0], seconds[1])
        choice = [split < SPLIT_MARGIN * whole for whole, split in self.split_seconds.values()]
        if self.tp and probes:  # rank 0's choice on every rank
            flags = self.comm.broadcast(torch.tensor(choice, dtype=torch.int64,
                                                     device=self.device), src=0)
            choice = [bool(f) for f in flags.tolist()]
        measured = dict(zip(probes, choice))
        self.split_buckets = {b: measured[max(p for p in probes if p <= b)] for b in buckets}
        if self.leader:
            log.info("shardwise serve: decode steps over pipeline stages in %d micro-batches, "
                     "measured (split vs whole ms): %s", self.micro_batches, ", ".join(
                         f"{b} rows {'split' if measured[b] else 'whole'} "
                         f"({split * 1e3:.1f} vs {whole * 1e3:.1f})"
                         for b, (whole, split) in self.split_seconds.items()))

    def _close(self) -> None:
        self.closed = True
        graphs = self.stack.graphs
        if graphs is not None:
            for bucket in self.buckets():
                graphs.drop(self.cache.graph_key(bucket))
            for bucket in self._packed:
                graphs.drop(self.cache.packed_key(self.cache.rows, bucket))
            for key in self.cache.part_keys:  # pipeline micro-batches' steps
                graphs.drop(key)
        self._packed.clear()
        self.cache.release_buffers()

    def _check_open(self) -> None:
        if self.closed:
            raise ShardwiseError("this SlotRunner is closed")
        if self.failed is not None:
            raise ShardwiseError(f"an earlier step failed under tensor parallelism "
                                 f"({type(self.failed).__name__}: {self.failed}); the ranks may "
                                 f"be out of step, so this runner takes no more steps: restart "
                                 f"the server") from self.failed

    @contextlib.contextmanager
    def _in_step(self) -> Iterator[None]:
        """Around a step once its arguments are checked: under tensor parallelism, a failure
        from here on (a collective, the forward) leaves the ranks possibly out of step, so the
        runner refuses every later step (:attr:`failed`)."""
        try:
            yield
        except BaseException as exc:
            if self.tp:
                self.failed = exc
            raise

    # ----- the wire (tensor parallelism) ---------------------------------------------------------

    def _send(self, op: int, *args: int, payload: Sequence[int] = ()) -> None:
        """Rank 0: broadcast one operation (header, then the payload when it has one)."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = op
        header[1:1 + len(args)] = torch.tensor(args, dtype=torch.int64)
        self.comm.broadcast(header.to(self.device), src=0)
        if payload:
            self.comm.broadcast(torch.tensor(list(payload), dtype=torch.int64,
                                             device=self.device), src=0)


def _check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """``buckets`` as a sorted tuple of distinct ints ≥ 1 (ConfigError otherwise)."""
    if not isinstance(buckets, (list, tuple, set, frozenset)) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in buckets):
        raise ConfigError(f"mixed_buckets must be ints >= 1 (prompt tokens per captured mixed "
                          f"step), got {buckets!r}")
    return tuple(sorted(set(buckets)))


def _receive(engine: Any, n: int | None = None) -> list[int]:
    """Ranks ≠ 0: the next header from rank 0 (``n`` None), or a payload of ``n`` words."""
    buf = torch.zeros(HEADER if n is None else n, dtype=torch.int64, device=engine.device)
    return engine.communicator.broadcast(buf, src=0).tolist()


def follow(engine: Any) -> None:
    """On every rank but 0 under tensor parallelism: run the operations rank 0's
    :class:`SlotRunner` sends, until it closes. Raises
    :class:`~shardwise.errors.CollectiveError` when rank 0 dies or sends nothing within the
    collective timeout (its scheduler's heartbeats keep an idle server alive)."""
    decoder_stack(engine)
    if engine.communicator.rank == 0:
        raise ConfigError("follow(engine) runs on the ranks other than 0; rank 0 drives a "
                          "SlotRunner")
    op, max_batch, max_tokens, n_buckets = _receive(engine)
    if op != INIT:
        raise ShardwiseError(f"follow: rank 0 sent {_OP_NAMES.get(op, op)!r} before creating "
                             f"its SlotRunner")
    split, *buckets = _receive(engine, n_buckets + 1)
    policy = {code: value for value, code in _SPLIT_CODES.items()}[split]
    runner = SlotRunner(engine, max_batch, max_tokens, mixed_buckets=tuple(buckets),
                        pipeline_split=policy, _follower=True)
    try:
        while True:
            op, a, b, c = _receive(engine)
            if op == PREFILL:
                runner._prefill(a, _receive(engine, b), bool(c))
            elif op == DECODE:
                words = _receive(engine, 2 * a)
                runner._decode(words[:a], words[a:])
            elif op == MIXED:  # a decode slots, b chunks, c chunk tokens
                words = _receive(engine, 2 * a + 3 * b + c)
                slots, tokens, spec = words[:a], words[a:2 * a], words[2 * a:2 * a + 3 * b]
                chunk_tokens, parts = words[2 * a + 3 * b:], []
                for i in range(b):
                    slot, n, last = spec[3 * i:3 * i + 3]
                    parts.append((slot, chunk_tokens[:n], bool(last)))
                    chunk_tokens = chunk_tokens[n:]
                runner._mixed(slots, tokens, parts)
            elif op == RELEASE:
                runner.cache.release(a)
            elif op == WARMUP:
                runner._warmup()
            elif op == CLOSE:
                return
            elif op != HEARTBEAT:
                raise ShardwiseError(f"follow: unknown operation {op} from rank 0")
    finally:
        runner._close()

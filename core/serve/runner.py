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
one row (chunked prefill inside the decode batch: :mod:`shardwise.inject.slots`), run eagerly
(its token count changes every step) while decode-only steps keep their captured graphs.

Tensor parallelism: every rank runs the same forwards. Rank 0's runner first sends each
operation to the other ranks through ``engine.communicator.broadcast`` — one int64 header
``[op, a, b, c]`` and, for prefill, decode and mixed steps, one int64 payload (the tokens; the
slots and the tokens; the decode slots and tokens, each chunk's slot, size and ``last``, then
the chunk tokens) — and the other ranks run :func:`follow`, which receives and executes them until
:meth:`SlotRunner.close`. The communicator's collectives time out, so a dead rank makes the
others raise :class:`~shardwise.errors.CollectiveError` within the collective timeout; rank 0's
scheduler calls :meth:`SlotRunner.heartbeat` while idle so that the followers' wait for the
next operation does not time out.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Sequence

import torch

from ..errors import ConfigError, ShardwiseError
from ..inject.cache import RAISE_HINT, StaticKVCache
from ..inject.injector import injected_stack
from ..inject.layers import InjectedModel
from ..inject.slots import SlotKVCache

# operations rank 0 sends (header[0])
INIT, PREFILL, DECODE, RELEASE, HEARTBEAT, WARMUP, CLOSE, MIXED = range(1, 9)
_OP_NAMES = {INIT: "init", PREFILL: "prefill", DECODE: "decode", RELEASE: "release",
             HEARTBEAT: "heartbeat", WARMUP: "warmup", CLOSE: "close", MIXED: "mixed"}
HEADER = 4  # int64 words of a header: op, then up to three arguments


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

    Every method is called from one thread (the scheduler's). Logits are float32.
    """

    def __init__(self, engine: Any, max_batch: int, max_tokens: int | None = None, *,
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
        if self.tp and self.leader:
            self._send(INIT, max_batch, max_tokens)
        self.strategy = stack.graphs.strategy if stack.graphs is not None else None
        weight = stack.parts.final_norm.weight
        self.cache = SlotKVCache(stack, max_batch, self._bucket(max_batch), max_tokens,
                                 weight.dtype, weight.device)
        self._cache_kw = "cache" if "cache" in inspect.signature(
            engine.module.forward).parameters else "past_key_values"
        self._keep_kw = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(
            engine.module.forward).parameters else {}
        self.closed = False
        #: why this runner cannot run :meth:`mixed` steps (None: it can): the scheduler then
        #: alternates prefill calls and decode steps
        self.mixed_unsupported: str | None = stack.mixed_unsupported
        #: under tensor parallelism, the error of a step that failed once it had started (the
        #: ranks may be out of step: every later call is refused)
        self.failed: BaseException | None = None

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
        prefill inside the decode batch; eager). Returns the decode logits, float32
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
        ``max_batch`` once, so serving never compiles mid-request. Slot contents are kept:
        the steps write only the scratch position."""
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

    def _forward(self, ids: torch.Tensor, cache: StaticKVCache) -> torch.Tensor:
        """The HF model's forward of ``ids`` [b, s] over ``cache`` → the last position's logits
        [b, vocab] (the head's hooks run: tensor-parallel vocab gather)."""
        with torch.inference_mode():
            out = self.engine.module(input_ids=ids, use_cache=True,
                                     **{self._cache_kw: cache}, **self._keep_kw)
        return out.logits[:, -1]

    def _prefill(self, slot: int, tokens: list[int], last: bool) -> torch.Tensor | None:
        ids = torch.tensor([tokens], dtype=torch.int64, device=self.device)
        logits = self._forward(ids, self.cache.row(slot))
        self.cache.advance(slot, len(tokens))
        return logits[0].float() if last else None

    def _decode(self, slots: list[int], tokens: list[int]) -> torch.Tensor:
        bucket = self._bucket(max(slots) + 1)
        step = self.cache.step(slots, bucket)
        ids = torch.zeros(bucket, 1, dtype=torch.int64)
        ids[slots, 0] = torch.tensor(tokens, dtype=torch.int64)
        logits = self._forward(ids.to(self.device), step)  # [bucket, vocab]
        for slot in slots:
            self.cache.advance(slot, 1)
        index = torch.tensor(slots, dtype=torch.int64, device=logits.device)
        return logits.index_select(0, index).float()

    def _mixed(self, slots: list[int], tokens: list[int], parts: list[tuple[int, list[int], bool]]
               ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        cache = self.cache.mixed(slots, [(slot, len(ids)) for slot, ids, _ in parts])
        ids = torch.tensor([tokens + [t for _, chunk, _ in parts for t in chunk]],
                           dtype=torch.int64, device=self.device)  # [1, T]
        keep, end = list(range(len(slots))), len(slots)  # packed positions whose logits count
        for _, chunk, last in parts:
            end += len(chunk)
            if last:
                keep.append(end - 1)
        logits = self._forward_packed(ids, cache, keep)  # [len(keep), vocab]
        for slot in slots:
            self.cache.advance(slot, 1)
        for slot, chunk, _ in parts:
            self.cache.advance(slot, len(chunk))
        rows = iter(logits[len(slots):].float())
        return logits[:len(slots)].float(), [next(rows) if last else None
                                             for _, _, last in parts]

    def _forward_packed(self, ids: torch.Tensor, cache: StaticKVCache,
                        keep: list[int]) -> torch.Tensor:
        """The HF model's forward of one packed row ``ids`` [1, T] → the logits of the
        positions ``keep`` [len(keep), vocab] (the head runs on those only where the model
        takes ``logits_to_keep``)."""
        index = torch.tensor(keep, dtype=torch.int64, device=self.device)
        kw = {"logits_to_keep": index} if self._keep_kw else {}
        with torch.inference_mode():
            out = self.engine.module(input_ids=ids, use_cache=True, **{self._cache_kw: cache},
                                     **kw)
        logits = out.logits[0]
        return logits if self._keep_kw else logits.index_select(0, index)

    def _warmup(self) -> None:
        for bucket in self.buckets():
            ids = torch.zeros(bucket, 1, dtype=torch.int64, device=self.device)
            self._forward(ids, self.cache.step([], bucket))

    def _close(self) -> None:
        self.closed = True
        graphs = self.stack.graphs
        if graphs is not None:
            for bucket in self.buckets():
                graphs.drop(self.cache.graph_key(bucket))
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
    op, max_batch, max_tokens, _ = _receive(engine)
    if op != INIT:
        raise ShardwiseError(f"follow: rank 0 sent {_OP_NAMES.get(op, op)!r} before creating "
                             f"its SlotRunner")
    runner = SlotRunner(engine, max_batch, max_tokens, _follower=True)
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

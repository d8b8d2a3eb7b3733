"""The pieces of ``shardwise serve`` share these types: what a request asks for
(:class:`SamplingParams`, :class:`GenRequest`), what the scheduler hands back for it
(:class:`TokenEvent`, :class:`FinishEvent` through a :class:`SequenceHandle`), and the two
contracts between the layers (:class:`Runner`: the model side, one static KV cache of slots;
:class:`Backend`: what the HTTP layer submits to — the continuous-batching scheduler, or the
one-request-at-a-time Hugging Face baseline the load benchmark compares against).

Layers, top to bottom: ``api`` (HTTP, OpenAI bodies, text and stop strings) → ``Backend``
(``scheduler``: admission, chunked prefill, one decode step over every running sequence,
sampling) → ``Runner`` (``runner``: prefill a chunk into a slot, decode a step over slots; under
tensor parallelism rank 0's runner sends each step to the other ranks).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, Sequence

import torch

from ..errors import ShardwiseError


class QueueFullError(ShardwiseError, RuntimeError):
    """More requests than the server's queue holds (HTTP 429 with ``Retry-After``)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ServerUnhealthyError(ShardwiseError, RuntimeError):
    """The model side failed for every request (a rank died, a collective timed out): the
    server reports unhealthy and stops (HTTP 503)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its tokens (OpenAI's names and defaults).

    ``temperature`` 0 is greedy (argmax: token-for-token what ``generate`` gives alone);
    ``logprobs`` None returns none, k ≥ 0 returns the chosen token's log-probability and the k
    most likely ones; the penalties subtract ``presence_penalty`` once and
    ``frequency_penalty`` × count from the logit of every token already generated (OpenAI's
    definition: generated tokens only, not the prompt). ``seed`` makes a sampled sequence
    reproducible. ``stop`` strings are applied on the text by the HTTP layer, which then
    cancels the sequence."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenRequest:
    """One sequence to generate (a request with ``n`` > 1 is ``n`` of these, ``index`` 0..n-1,
    sequence ``index`` sampling with seed ``seed + index`` when a seed is given)."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    index: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, and with ``logprobs`` its log-probability and the top
    ``(token id, log-probability)`` pairs (most likely first)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class FinishEvent:
    """The sequence ended: ``reason`` is ``"stop"`` (an end-of-sequence token), ``"length"``
    (``max_tokens`` reached), ``"cancelled"`` (the client went away or a stop string matched),
    or ``"error"`` (``error`` says why; the other sequences go on).

    With ``"stop"`` the end-of-sequence token itself came as the last :class:`TokenEvent` (as
    ``generate`` returns it; it counts in ``completion_tokens``, and the text skips it as a special
    token). When the model side failed for every sequence, ``error`` is a
    :class:`ServerUnhealthyError` whose ``__cause__`` is the runner's exception."""

    reason: str
    error: BaseException | None = None


class SequenceHandle:
    """The HTTP side's view of one submitted sequence: an async stream of events that the
    scheduler's thread feeds (thread-safe), and ``cancel()`` (frees its slot at the next step).

    ``prompt_tokens`` / ``completion_tokens`` count for ``usage``; ``first_token_s`` is the time
    to first token once known."""

    def __init__(self, request: GenRequest, loop: asyncio.AbstractEventLoop | None) -> None:
        self.request = request
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.completion_tokens = 0
        self.first_token_s: float | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    def push(self, event: TokenEvent | FinishEvent) -> None:
        """Called from the scheduler's thread: hand ``event`` to the HTTP side's loop (one
        wake-up of the loop per call; :class:`EventBatch` delivers many events with one)."""
        self._count(event)
        if self.loop is None:
            self.queue.put_nowait(event)
        else:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def _count(self, event: TokenEvent | FinishEvent) -> None:
        if isinstance(event, TokenEvent):
            self.completion_tokens += 1

    def cancel(self) -> None:
        """Stop this sequence (client gone, stop string matched): its slot is freed at the
        scheduler's next step and a ``FinishEvent("cancelled")`` ends the stream."""
        self.cancelled.set()

    async def events(self) -> AsyncIterator[TokenEvent | FinishEvent]:
        """Every event up to and including the :class:`FinishEvent`."""
        while True:
            event = await self.queue.get()
            yield event
            if isinstance(event, FinishEvent):
                return


def _put_all(items: list[tuple[asyncio.Queue, TokenEvent | FinishEvent]]) -> None:
    """On a handle's event loop: every ``(queue, event)`` of one :meth:`EventBatch.flush`."""
    for queue, event in items:
        queue.put_nowait(event)


class EventBatch:
    """Events for many handles, handed to their event loops with ONE wake-up per loop per
    :meth:`flush` instead of one per event.

    Why: :meth:`SequenceHandle.push` wakes the handle's loop through
    ``loop.call_soon_threadsafe``, a write to the loop's self-pipe. The write releases the GIL,
    and getting it back waits for the thread that took it (the HTTP loop, busy with the
    previous tokens) — measured ~1 ms per event on a 2-core CPU with 8 streams, paid per token
    per stream by the scheduler's thread. The scheduler pushes a step's events here and
    flushes once per step: the cost is per step, not per token.

    Events of one handle keep their order (they are delivered in push order, and a flush
    delivers before any later one). Handles without a loop get theirs at once (tests drive the
    scheduler without an event loop). Not thread-safe: one producer thread.
    """

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list] = {}

    def push(self, handle: SequenceHandle, event: TokenEvent | FinishEvent) -> None:
        """Queue ``event`` for ``handle`` (delivered at the next :meth:`flush`)."""
        if handle.loop is None:
            handle.push(event)
            return
        handle._count(event)
        self._by_loop.setdefault(handle.loop, []).append((handle.queue, event))

    def flush(self) -> list[tuple[asyncio.AbstractEventLoop, BaseException]]:
        """Hand every queued event to its loop: one ``call_soon_threadsafe`` per loop. Returns
        the ``(loop, error)`` of loops that could not take theirs (closed), never raising: the
        caller logs them and goes on."""
        batches, self._by_loop = self._by_loop, {}
        failed = []
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except Exception as exc:  # its loop is closed: those clients are gone
                failed.append((loop, exc))
        return failed

    def __len__(self) -> int:
        return sum(len(items) for items in self._by_loop.values())


class Runner(Protocol):
    """The model side of continuous batching: ``max_batch`` slots of one static KV cache of
    ``max_tokens`` positions each (the prompt plus every generated token of a sequence must
    fit). Every call happens on the scheduler's one thread.

    Optional (the scheduler asks with ``getattr``): ``supports_mixed`` (bool),
    ``mixed_unsupported`` (why not, for the log) and ``mixed(slots, token_ids, chunks)``, one
    forward of the decode tokens and prompt chunks ``(slot, tokens, last)`` →
    (decode logits [len(slots), vocab], each chunk's last-token logits or None), as
    :meth:`shardwise.serve.runner.SlotRunner.mixed`; ``mixed_buckets`` (the chunk-token sizes
    its mixed steps are captured at: the scheduler cuts chunks to fill one) and
    ``mixed_chunks`` (the most chunks one mixed step carries, or None)."""

    max_batch: int
    max_tokens: int
    vocab_size: int

    def prefill(self, slot: int, token_ids: Sequence[int], last: bool) -> torch.Tensor | None:
        """Append ``token_ids`` (a prompt chunk, any length ≥ 1) to ``slot``'s cache; with
        ``last`` return the logits of the chunk's final token, float32 [vocab]."""

    def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """One decode step: append ``token_ids[i]`` to ``slots[i]`` for every i → the next
        logits, float32 [len(slots), vocab]."""

    def release(self, slot: int) -> None:
        """Forget ``slot``'s tokens (length 0): a new sequence can take it at once."""

    def length(self, slot: int) -> int:
        """Tokens in ``slot``'s cache."""

    def heartbeat(self) -> None:
        """Idle tick (tensor parallel: tells the other ranks rank 0 is alive, so their wait for
        the next step does not time out). A no-op on one rank."""

    def close(self) -> None:
        """Stop (tensor parallel: the other ranks leave their follow loop)."""


class Backend(Protocol):
    """What the HTTP layer submits sequences to."""

    #: tokens one sequence may hold (prompt + max_tokens), checked before submitting
    max_tokens: int

    def submit(self, request: GenRequest,
               loop: asyncio.AbstractEventLoop | None) -> SequenceHandle:
        """Queue ``request``; raises :class:`QueueFullError` when the queue is full and
        :class:`ServerUnhealthyError` when the model side has failed."""

    def healthy(self) -> bool:
        """False once the model side has failed (the server then exits)."""

    def stop(self, drain_s: float) -> None:
        """Stop accepting; let running sequences finish for up to ``drain_s`` seconds, cancel
        the rest, stop the runner."""


@dataclass
class ServeStats:
    """A snapshot for ``/metrics`` and ``/health``."""

    running: int = 0
    waiting: int = 0
    slots_in_use: int = 0
    slots: int = 0
    extra: dict = field(default_factory=dict)

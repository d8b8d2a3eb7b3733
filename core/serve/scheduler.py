"""The continuous-batching scheduler of ``shardwise serve``: a :class:`~shardwise.serve.types.Backend`
over a :class:`~shardwise.serve.types.Runner` (one static KV cache of ``max_batch`` slots).

One background thread makes every model call. Each iteration of its loop:

1. ends the cancelled sequences (their slot is released at once, ``FinishEvent("cancelled")``);
2. admits waiting sequences first in, first out into free slots, lowest slot first (so the
   runner's batch bucket stays small);
3. prefills prompt chunks under a per-iteration token budget: a long prompt is prefilled over
   several iterations while the running sequences keep decoding, and the logits of its final
   chunk give its first token. The budget is ``prefill_budget`` tokens while nothing decodes
   (time to first token first); while streams decode it is cut to what fits in the stall
   allowance — ``prefill_stall`` × the typical decode step (the median of the last
   ``RECENT_STEPS``), plus what this iteration's step is predicted to take less than that (a
   step over fewer rows: each row span's step time is measured), so that prefill + step stays
   within ``1 + prefill_stall`` typical steps — by the prefill cost fitted to the last calls
   (a per-call overhead plus a per-token time; a fit robust to a few slowed calls) (at least
   ``MIN_PREFILL_CHUNK`` tokens, so prompts always progress): a joining prompt delays the
   running streams' next token by a bounded fraction of a step instead of by its whole
   prefill. Where a call's overhead alone is more than half that allowance (a small model, or
   a GPU whose step is host-bound), and unless ``prefill_worth=False``, a chunk still takes at least as many tokens as the overhead's worth of time (overhead /
   per-token time): chunks of ``MIN_PREFILL_CHUNK`` tokens there would spend most of every
   prefill call on its overhead, and prompts would queue behind each other for hundreds of
   steps. The stall bound that holds is stated (and tested) at :func:`prefill_chunk_tokens`:
   the allowance, or two call overheads where those are more;
4. runs ONE ``runner.decode`` step over every decoding sequence and samples each with its own
   sampler (the plain greedy rows together: one ``argmax``, one device→host copy,
   :func:`~shardwise.serve.sampling.sample_rows`); a sequence ends on an end-of-sequence id
   (``"stop"``, the id itself is delivered) or after ``max_tokens`` tokens (``"length"``) and
   frees its slot for the next iteration.

**Mixed steps** (``mixed=True``, the default, where ``runner.supports_mixed``: chunked prefill
inside the decode batch, as vLLM and SGLang do): while sequences decode AND prompts wait to be
prefilled, steps 3 and 4 are ONE ``runner.mixed`` forward carrying every decoding sequence's
token and prompt chunks, so the running streams' next token waits for one forward instead of a
prefill call and then a decode step. The per-step token budget counts every token of that
forward: one per decoding sequence first, the rest to prompt chunks in admission order
(:func:`split_step_budget`, at least ``MIN_PREFILL_CHUNK``); while ``prefill_stall`` is set the
chunk tokens are further cut, as in step 3, to what fits the stall allowance by the cost the
chunk adds to a decode step, fitted to the last mixed steps (the step's time less the predicted
decode step of its rows). Where the runner captures its mixed steps per chunk-token bucket
(``runner.mixed_buckets``; ``runner.mixed_chunks`` chunks at most), the chunk tokens are then
cut to fill the largest bucket within that budget instead of spilling a few tokens into the next
bucket (:func:`split_step_budget`), and each step's cost is recorded at its bucket's size (what
the padded step computes). A runner without mixed steps (its ``mixed_unsupported`` says why,
logged once) gets steps 3 and 4 as above.

Delivery is per step, not per token: the events of a phase (the prefill's first tokens, the
decode step's tokens, the ends) go to the HTTP side's event loop in one wake-up
(:class:`~shardwise.serve.types.EventBatch`), and the metrics of a step are recorded at once
(:meth:`~shardwise.serve.metrics.ServeMetrics.observe_step`). Waking the loop once per token cost
the scheduler's thread a GIL hand-off per token per stream (~1 ms each with 8 streams on a
2-core CPU), which capped the tokens/s of many streams at that of a few.

Faults: an exception while sampling or handling one sequence ends that sequence only
(``FinishEvent("error", exc)``); an exception from the runner (prefill, decode, release,
heartbeat: e.g. a :class:`~shardwise.errors.CollectiveError` when a tensor-parallel rank died)
is fatal: every sequence ends with a :class:`~shardwise.serve.types.ServerUnhealthyError`,
:meth:`Scheduler.healthy` turns False, the loop ends and later submits are refused. When idle,
the loop sleeps on a condition and calls ``runner.heartbeat()`` every ``heartbeat_s`` seconds.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .metrics import ServeMetrics
from .sampling import sample_rows
from .types import (EventBatch, FinishEvent, GenRequest, QueueFullError, Runner, SamplingParams,
                    SequenceHandle, ServerUnhealthyError, ServeStats, TokenEvent)

log = logging.getLogger(__name__)

#: the fewest prompt tokens an iteration prefills while streams decode (prompts always progress)
MIN_PREFILL_CHUNK = 8
#: prefill calls the cost model (overhead + per token) is fitted over
PREFILL_FIT_CALLS = 32
#: decode steps whose median is the typical step (the prefill stall allowance's unit)
RECENT_STEPS = 64
#: ``prefill_stall``'s default: a running stream's gap while prompts join is held to twice the
#: typical step — the p99/p50 inter-token bound issue 16 asks of 8 streams, where the typical
#: gap is at least one step. 0.75 kept the p99/p50 at 1.4-1.6 and left joining prompts waiting
#: with their rows idle: on a 2-core EPYC, 1.0 gave 8 streams 15-20% more tokens/s and half
#: the time to first token, at p99/p50 1.6-1.7 (benchmarks/README.md, "The prefill stall
#: allowance's default").
DEFAULT_PREFILL_STALL = 1.0

#: ``factory(params, index, vocab_size)`` → an object with ``sample(logits[vocab]) -> TokenEvent``
SamplerFactory = Callable[[SamplingParams, int, int], Any]


def default_sampler_factory(params: SamplingParams, index: int, vocab_size: int) -> Any:
    """:class:`shardwise.serve.sampling.Sampler` (imported on first use)."""
    from .sampling import Sampler
    return Sampler(params, index, vocab_size)


class _RunnerFailed(Exception):
    """A runner call raised: the model side is broken for every sequence."""

    def __init__(self, call: str, error: BaseException) -> None:
        super().__init__(f"runner.{call} raised {type(error).__name__}: {error}")
        self.call = call
        self.error = error


@dataclass(eq=False)
class _Sequence:
    """The scheduler's state of one submitted sequence."""

    handle: SequenceHandle
    sampler: Any
    submitted_s: float
    slot: int | None = None          # its KV slot once admitted
    admitted_s: float = 0.0
    prefilled: int = 0               # prompt tokens already in the slot's cache
    next_token: int | None = None    # the last sampled token: the next decode step feeds it
    generated: int = 0
    last_token_s: float = 0.0

    @property
    def prompt(self) -> list[int]:
        return self.handle.request.prompt_ids

    @property
    def max_new(self) -> int:
        return self.handle.request.params.max_tokens

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)


class Scheduler:
    """Continuous batching over ``runner``'s slots (implements :class:`~shardwise.serve.types.Backend`).

    Args:
        runner: the model side (:class:`~shardwise.serve.types.Runner`); every call to it is made
            by this scheduler's thread (or by :meth:`step` when driven without one).
        eos_token_ids: token ids that end a sequence with reason ``"stop"``.
        max_waiting: sequences that may wait for a slot; one more is refused with
            :class:`~shardwise.serve.types.QueueFullError` (HTTP 429) and a retry-after estimate.
        prefill_budget: prompt tokens prefilled per iteration, over all sequences (≥ 1), the
            most ever; while other sequences decode, ``prefill_stall`` cuts it further.
        prefill_stall: while sequences decode, the prefill of one iteration may take at most
            this fraction of the typical decode step, plus what the iteration's own step saves
            against it (all measured as the server runs), bounding the running streams'
            inter-token gap to ``1 + prefill_stall`` typical steps (default
            :data:`DEFAULT_PREFILL_STALL`: twice the typical step); None: always
            ``prefill_budget``.
        prefill_worth: while sequences decode, a chunk still takes at least the tokens one
            prefill call's overhead is worth (see :func:`prefill_chunk_tokens`), even beyond
            ``prefill_stall``: fewer calls, longer gaps where a call's overhead is a large part
            of a step. False: the stall bound first.
        metrics: a :class:`~shardwise.serve.metrics.ServeMetrics` to record into, or None.
        heartbeat_s: when idle, ``runner.heartbeat()`` is called this often (seconds).
        sampler_factory: ``factory(params, index, vocab_size)`` making each sequence's sampler;
            :class:`shardwise.serve.sampling.Sampler` by default.
        join_timeout_s: how long :meth:`stop` waits for the loop beyond ``drain_s`` (one model call
            in flight) before giving up on it.
        mixed: prefill prompt chunks inside the decode step (``runner.mixed``; see the module
            docstring) where the runner supports it (``runner.supports_mixed``); False: prefill
            calls and decode steps alternate.
        release_threads: called on the thread that calls :meth:`start` (which built the
            model) before the loop's thread takes over, and on the loop's thread each time it
            goes idle: gives back the calling thread's host worker threads (the engine's
            ``accelerator.release_thread_pool``; on CPU torch's OpenMP pool: held, it slowed
            every step 1.9x). None: nothing to give back.

    Call :meth:`start` to run the loop on its thread.
    """

    def __init__(self, runner: Runner, *, eos_token_ids: Sequence[int] = (), max_waiting: int = 64,
                 prefill_budget: int = 512, metrics: ServeMetrics | None = None,
                 heartbeat_s: float = 5.0, sampler_factory: SamplerFactory | None = None,
                 join_timeout_s: float = 30.0,
                 prefill_stall: float | None = DEFAULT_PREFILL_STALL,
                 prefill_worth: bool = True, mixed: bool = True,
                 release_threads: Callable[[], None] | None = None) -> None:
        _check_positive("max_waiting", max_waiting, integer=True)
        _check_positive("prefill_budget", prefill_budget, integer=True)
        _check_positive("heartbeat_s", heartbeat_s)
        _check_positive("runner.max_batch", runner.max_batch, integer=True)
        _check_positive("runner.max_tokens", runner.max_tokens, integer=True)
        self.runner = runner
        #: tokens one sequence may hold (prompt + max_tokens)
        self.max_tokens = int(runner.max_tokens)
        self.max_batch = int(runner.max_batch)
        self.vocab_size = int(runner.vocab_size)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_waiting = max_waiting
        self.prefill_budget = prefill_budget
        if prefill_stall is not None:
            _check_positive("prefill_stall", prefill_stall)
        self.prefill_stall = prefill_stall
        self.prefill_worth = bool(prefill_worth)
        #: the last prefill calls' (tokens, seconds): a call costs about a + b × tokens
        self._prefill_calls: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=PREFILL_FIT_CALLS)
        #: the last decode steps' seconds: their median is the typical step (≈ the median
        #: inter-token gap; a median over a window, not a moving average, so that the short
        #: steps of a burst of joining prompts do not pull it down while the burst lasts)
        self._recent_steps: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        #: moving average of a decode step's seconds by its row span (highest slot + 1: the
        #: runner's batch bucket grows with it), to predict the step an iteration's prefill
        #: delays
        self._span_step_s: dict[int, float] = {}
        #: the last mixed steps' (chunk tokens, seconds beyond the predicted decode step)
        self._mixed_calls: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=PREFILL_FIT_CALLS)
        #: whether prompt chunks ride in the decode step (runner.mixed)
        self.mixed = bool(mixed) and bool(getattr(runner, "supports_mixed", False))

        if mixed and not self.mixed:
            why = getattr(runner, "mixed_unsupported", None) or \
                f"{type(runner).__name__} has no mixed steps"
            log.info("mixed steps off (%s): prompt chunks and decode steps alternate", why)
        self.heartbeat_s = float(heartbeat_s)
        self._release_threads = release_threads or (lambda: None)
        self._holds_threads = False                # the loop's thread stepped since it released
        self.metrics = metrics
        self.join_timeout_s = join_timeout_s
        self._sampler_factory = sampler_factory or default_sampler_factory
        #: this step's events, handed to the event loops at once (one wake-up per loop)
        self._events = EventBatch()
        #: this step's times to first token and inter-token gaps, recorded at once
        self._first_s: list[float] = []
        self._inter_s: list[float] = []

        self._cond = threading.Condition()         # guards the fields below; the loop waits on it
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []        # admitted (prefilling or decoding), in order
        self._free = list(range(self.max_batch))   # a heap: the lowest free slot is taken first
        self._healthy = True
        self._failure: ServerUnhealthyError | None = None
        self._accepting = True
        self._drain_until: float | None = None     # set by stop()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._last_model_call_s = time.monotonic()
        self._service_s: float | None = None       # moving average of admitted → finished
        self._record_load()

    # ---- Backend ----------------------------------------------------------------------------

    def submit(self, request: GenRequest,
               loop: asyncio.AbstractEventLoop | None) -> SequenceHandle:
        """Queue ``request``; its events arrive on the returned handle (on ``loop``).

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, ``max_tokens`` < 1, or
                prompt + ``max_tokens`` beyond the runner's ``max_tokens`` (checked before any work).
            QueueFullError: ``max_waiting`` sequences already wait for a slot.
            ServerUnhealthyError: the model side failed, or the scheduler is stopping.
        """
        self._check_request(request)
        sampler = self._sampler_factory(request.params, request.index, self.vocab_size)
        with self._cond:
            if not self._healthy:
                raise self._failure
            if not self._accepting:
                raise ServerUnhealthyError("the server is shutting down and takes no new requests; "
                                           "send the request to another server")
            if len(self._waiting) >= self.max_waiting:
                retry = self._retry_after_s()
                raise QueueFullError(
                    f"{len(self._waiting)} requests already wait for one of {self.max_batch} slots "
                    f"(max_waiting={self.max_waiting}); retry in about {retry:.0f} s",
                    retry_after_s=retry)
            handle = SequenceHandle(request, loop)
            self._waiting.append(_Sequence(handle, sampler, time.monotonic()))
            self._cond.notify_all()
        self._record_load()
        return handle

    def healthy(self) -> bool:
        """False once the model side has failed."""
        return self._healthy

    def start(self) -> "Scheduler":
        """Start the loop on its own thread (once)."""
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("the scheduler is already started")
            if self._drain_until is not None:
                raise RuntimeError("the scheduler was stopped; build a new one")
            self._thread = threading.Thread(target=self._loop, name="shardwise-scheduler",
                                            daemon=True)
            self._release_threads()  # this thread built the model; the loop's runs it
            self._thread.start()
        return self

    def stop(self, drain_s: float) -> None:
        """Stop accepting; let the sequences already submitted finish for up to ``drain_s``
        seconds, cancel the rest (``FinishEvent("cancelled")``), close the runner and join the
        loop's thread (waiting at most ``drain_s + join_timeout_s``). Idempotent."""
        drain_s = max(0.0, float(drain_s))
        with self._cond:
            self._accepting = False
            if self._drain_until is None:
                self._drain_until = time.monotonic() + drain_s
            thread = self._thread
            self._cond.notify_all()
        if thread is None:  # never started: nothing ran, end the queued ones here
            self._cancel_all()
            self._deliver()
            self._close_runner()
            return
        if thread is not threading.current_thread():
            thread.join(timeout=drain_s + self.join_timeout_s)
            if thread.is_alive():
                log.warning("the scheduler's loop did not end within %.1f s of stop(); a model "
                            "call is still running", drain_s + self.join_timeout_s)

    def stats(self) -> ServeStats:
        """Occupancy now (for ``/health`` and ``/metrics``)."""
        with self._cond:
            return ServeStats(running=len(self._running), waiting=len(self._waiting),
                              slots_in_use=self.max_batch - len(self._free), slots=self.max_batch,
                              extra={"healthy": self._healthy, "accepting": self._accepting})

    def step(self) -> bool:
        """Run one iteration of the loop on the calling thread — for a caller that drives the
        scheduler itself (tests) instead of :meth:`start`. Returns whether sequences remain."""
        if self._thread is not None:
            raise RuntimeError("the scheduler runs its own thread (start() was called); "
                               "step() is only for driving it without one")
        try:
            self._step()
        except _RunnerFailed as failure:
            self._fail(failure.error)
        except BaseException as exc:
            self._fail(exc)
            raise
        return self._has_work()

    # ---- the loop -----------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._wait_for_work():
                self._step()
        except _RunnerFailed as failure:
            log.error("the model side failed, serving ends: %s", failure)
            self._fail(failure.error)
        except BaseException as exc:  # a scheduler bug: every sequence still hears about it
            log.exception("the scheduler's loop failed")
            self._fail(exc)
        finally:
            self._close_runner()

    def _wait_for_work(self) -> bool:
        """Block until there is a step to run (True) or the loop should end (False); when idle,
        give back the loop thread's worker threads once (``release_threads``) and call
        ``runner.heartbeat()`` every ``heartbeat_s`` seconds."""
        while True:
            with self._cond:
                if self._has_work():
                    self._holds_threads = True
                    return True
                if self._drain_until is not None:
                    return False
                if not self._holds_threads:
                    idle_for = time.monotonic() - self._last_model_call_s
                    if idle_for < self.heartbeat_s:
                        self._cond.wait(self.heartbeat_s - idle_for)
                        continue
            if self._holds_threads:  # idle: another thread of this process may need the cores
                self._holds_threads = False
                self._release_threads()
                continue
            self._call("heartbeat")

    def _has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def _step(self) -> None:
        try:
            if self._drain_until is not None and time.monotonic() >= self._drain_until:
                self._cancel_all()
            self._finish_cancelled()
            self._admit()
            if not self._mixed_step():
                self._prefill()
                self._deliver()  # first tokens go out now, not after the decode step
                self._decode()
        finally:
            self._deliver()
        self._record_load()

    def _deliver(self) -> None:
        """Hand the events queued since the last call to their event loops (one wake-up per
        loop) and record the step's token metrics."""
        for loop, exc in self._events.flush():
            log.warning("could not deliver events to event loop %r (closed?): %r", loop, exc)
        if self.metrics is not None and (self._first_s or self._inter_s):
            self.metrics.observe_step(self._first_s, self._inter_s, time.monotonic())
        self._first_s, self._inter_s = [], []

    def _finish_cancelled(self) -> None:
        with self._cond:
            cancelled = [s for s in (*self._running, *self._waiting) if s.handle.cancelled.is_set()]
        for seq in cancelled:
            self._finish(seq, "cancelled")

    def _cancel_all(self) -> None:
        with self._cond:
            remaining = [*self._running, *self._waiting]
        for seq in remaining:
            self._finish(seq, "cancelled")

    def _admit(self) -> None:
        """Waiting sequences take free slots, first in first out, lowest slot first."""
        now = time.monotonic()
        with self._cond:
            while self._waiting and self._free:
                seq = self._waiting.popleft()
                seq.slot = heapq.heappop(self._free)
                seq.admitted_s = now
                self._running.append(seq)

    def _prefill(self) -> None:
        """Prefill prompt chunks, in admission order, until ``prefill_budget`` tokens are spent;
        a prompt's final chunk yields its first token."""
        budget, call_tokens = self._prefill_tokens()
        for seq in self._filling():
            if budget <= 0:
                return
            start = seq.prefilled
            n = min(len(seq.prompt) - start, budget)
            last = start + n == len(seq.prompt)
            began = time.perf_counter()
            logits = self._call("prefill", seq.slot, seq.prompt[start:start + n], last)
            self._prefill_calls.append((n, time.perf_counter() - began))
            budget -= n + call_tokens  # a further call pays its overhead out of the budget too
            self._prefilled(seq, n, logits, time.monotonic())

    def _prefill_tokens(self) -> tuple[int, int]:
        """This iteration's prefill budget in tokens (see the module docstring, step 3), and
        what one call's overhead is worth in tokens (0 while nothing decodes: time to first
        token first)."""
        decoding = any(s.decoding for s in self._running)
        if (not decoding or self.prefill_stall is None or not self._prefill_calls
                or not self._recent_steps):
            return self.prefill_budget, 0
        overhead_s, token_s = _linear_fit(self._prefill_calls)
        return (prefill_chunk_tokens(self.prefill_budget, self._stall_allowance_s(),
                                     overhead_s, token_s, worth=self.prefill_worth),
                math.ceil(overhead_s / token_s))

    def _stall_allowance_s(self) -> float:
        """Seconds this iteration's prefill may take: ``prefill_stall`` × the typical decode
        step, plus what this iteration's step is predicted to take less than the typical one
        (a step over fewer rows, e.g. while a burst of prompts is still being prefilled). So
        the running streams' gap — prefill plus step — stays within ``1 + prefill_stall``
        typical steps, the median gap, whatever the batch: p99/p50 of the inter-token latency
        is what the bound is for."""
        typical = _median(self._recent_steps)
        predicted = self._span_step_s.get(_span(self._running), typical)
        return self.prefill_stall * typical + max(0.0, typical - predicted)

    def _mixed_step(self) -> bool:
        """One ``runner.mixed`` forward: every decoding sequence's token and prompt chunks
        under the step's token budget (the module docstring); False (nothing run) unless
        mixed steps are on and sequences both decode and wait to be prefilled."""
        if not self.mixed:
            return False
        batch, filling = self._decoding(), self._filling()
        if not batch or not filling:
            return False
        sizes = split_step_budget(self._mixed_budget(len(batch)), len(batch),
                                  [len(s.prompt) - s.prefilled for s in filling],
                                  buckets=self._mixed_buckets, max_chunks=self._mixed_chunks)
        parts = [(seq, seq.prefilled, n) for seq, n in zip(filling, sizes)]
        chunks = [(seq.slot, seq.prompt[start:start + n], start + n == len(seq.prompt))
                  for seq, start, n in parts]
        began = time.perf_counter()
        logits, firsts = self._call("mixed", [s.slot for s in batch],
                                    [s.next_token for s in batch], chunks)
        self._note_mixed(batch, self._padded(sum(sizes)), time.perf_counter() - began)
        if len(firsts) != len(chunks):
            raise _RunnerFailed("mixed", RuntimeError(
                f"runner.mixed returned {len(firsts)} chunk results for {len(chunks)} chunks"))
        self._check_rows("mixed", logits, batch)
        now = time.monotonic()
        for (seq, _, n), first in zip(parts, firsts):
            self._prefilled(seq, n, first, now)
        self._accept_rows(batch, logits, now)
        return True

    @property
    def _mixed_buckets(self) -> tuple[int, ...]:
        """The chunk-token sizes the runner's mixed steps are captured at (asked at each step:
        chunks are cut to fill one)."""
        return tuple(getattr(self.runner, "mixed_buckets", ()) or ())

    @property
    def _mixed_chunks(self) -> int | None:
        """The most prompt chunks one of the runner's mixed steps carries (None: any)."""
        return getattr(self.runner, "mixed_chunks", None)

    def _padded(self, chunk_tokens: int) -> int:
        """The chunk tokens a mixed step of ``chunk_tokens`` prompt tokens computes: its
        bucket's (the smallest of the runner's ``mixed_buckets`` holding them), else itself."""
        return next((b for b in self._mixed_buckets if b >= chunk_tokens), chunk_tokens)

    def _note_mixed(self, batch: Sequence[_Sequence], chunk_tokens: int, took: float) -> None:
        """Record what a mixed step's chunks cost beyond the decode step of its rows."""
        if not self._recent_steps:
            return  # no decode step measured yet: nothing to compare with
        predicted = self._span_step_s.get(_span(batch), _median(self._recent_steps))
        self._mixed_calls.append((chunk_tokens, max(0.0, took - predicted)))

    def _mixed_budget(self, n_decode: int) -> int:
        """Tokens of this iteration's mixed step (decode tokens included): ``prefill_budget``,
        cut while ``prefill_stall`` is set to the decode tokens plus the chunk tokens whose
        added cost fits the stall allowance (fitted to the last mixed steps, else to the
        prefill calls; nothing measured yet: no cut)."""
        if self.prefill_stall is None or not self._recent_steps:
            return self.prefill_budget
        calls = self._mixed_calls if len({n for n, _ in self._mixed_calls}) > 1 else \
            self._prefill_calls
        if not calls:
            return self.prefill_budget
        overhead_s, token_s = _linear_fit(calls)
        chunk = prefill_chunk_tokens(self.prefill_budget, self._stall_allowance_s(), overhead_s,
                                     token_s, worth=self.prefill_worth)
        return min(self.prefill_budget, n_decode + chunk)

    def _decode(self) -> None:
        """One decode step over every decoding sequence (by slot), then sample each."""
        batch = self._decoding()
        if not batch:
            return
        began = time.perf_counter()
        logits = self._call("decode", [s.slot for s in batch], [s.next_token for s in batch])
        took = time.perf_counter() - began
        self._recent_steps.append(took)
        span = _span(batch)
        self._span_step_s[span] = _average(self._span_step_s.get(span), took)
        self._check_rows("decode", logits, batch)
        self._accept_rows(batch, logits, time.monotonic())

    def _decoding(self) -> list[_Sequence]:
        """The sequences a decode step runs (their prompts prefilled), by slot."""
        return sorted((s for s in self._running if s.decoding), key=lambda s: s.slot)

    def _filling(self) -> list[_Sequence]:
        """The admitted sequences whose prompts are still being prefilled, in admission order."""
        return [s for s in self._running if not s.decoding]

    def _prefilled(self, seq: _Sequence, n: int, logits: Any, now: float) -> None:
        """``n`` more of ``seq``'s prompt tokens are in its slot; after its final chunk
        ``logits`` (its last token's) give its first token."""
        seq.prefilled += n
        if self.metrics is not None:
            self.metrics.add_prompt_tokens(n)
        if seq.decoding:
            self._accept_isolated(seq, lambda: seq.sampler.sample(logits), now)

    @staticmethod
    def _check_rows(call: str, logits: Any, batch: Sequence[_Sequence]) -> None:
        if logits.shape[0] != len(batch):
            raise _RunnerFailed(call, RuntimeError(
                f"runner.{call} returned {logits.shape[0]} rows of logits for {len(batch)} "
                f"slots"))

    def _accept_rows(self, batch: Sequence[_Sequence], logits: Any, now: float) -> None:
        """Sample each of ``batch`` from its row of ``logits`` [len(batch), vocab] (the plain
        greedy rows together) and deliver it."""
        events = sample_rows([s.sampler for s in batch], logits)
        for seq, event in zip(batch, events):
            self._accept_isolated(seq, lambda event=event: _raise_or_return(event), now)

    def _accept_isolated(self, seq: _Sequence, sample: Callable[[], TokenEvent],
                         now: float) -> None:
        """Deliver ``seq``'s next token, ``sample()``; an error there ends ``seq`` only."""
        try:
            self._accept(seq, sample(), now)
        except _RunnerFailed:
            raise
        except Exception as exc:
            log.warning("request %s (index %d) failed: %r", seq.handle.request.id,
                        seq.handle.request.index, exc)
            self._finish(seq, "error", exc)

    def _accept(self, seq: _Sequence, event: TokenEvent, now: float) -> None:
        """``event``: the token sampled for ``seq``'s next position."""
        token = int(event.token_id)
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"the sampler chose token {token}, outside the vocabulary "
                             f"[0, {self.vocab_size})")
        first = seq.generated == 0
        since = now - (seq.submitted_s if first else seq.last_token_s)
        if first:
            seq.handle.first_token_s = since
        (self._first_s if first else self._inter_s).append(since)
        seq.generated += 1
        seq.last_token_s = now
        seq.next_token = token
        self._events.push(seq.handle, event)
        if token in self.eos_token_ids:
            self._finish(seq, "stop")
        elif seq.generated >= seq.max_new:
            self._finish(seq, "length")

    def _finish(self, seq: _Sequence, reason: str, error: BaseException | None = None) -> None:
        """End ``seq``: release its slot (free for the next iteration), tell its handle."""
        if seq.slot is not None:
            self._call("release", seq.slot)
        with self._cond:
            if seq.slot is not None:
                self._running.remove(seq)
                heapq.heappush(self._free, seq.slot)
                self._note_service_time(time.monotonic() - seq.admitted_s)
            elif seq in self._waiting:
                self._waiting.remove(seq)
        self._tell(seq, FinishEvent(reason, error))

    def _fail(self, cause: BaseException) -> None:
        """The model side failed: end every sequence with a ServerUnhealthyError; refuse more."""
        error = ServerUnhealthyError(
            f"the model side failed ({type(cause).__name__}: {cause}); every request was ended "
            "and the server must be restarted")
        error.__cause__ = cause
        with self._cond:
            self._healthy = False
            self._accepting = False
            self._failure = error
            ended = [*self._running, *self._waiting]
            self._running.clear()
            self._waiting.clear()
            self._cond.notify_all()
        for seq in ended:
            self._tell(seq, FinishEvent("error", error))
        self._deliver()
        self._record_load()

    def _tell(self, seq: _Sequence, event: FinishEvent) -> None:
        """Deliver the final event; a handle that cannot take it (its event loop closed) is
        logged, never allowed to stop the loop."""
        if self.metrics is not None:
            self.metrics.finish(event.reason)
        try:
            self._events.push(seq.handle, event)
        except Exception as exc:
            log.warning("could not deliver the end of request %s: %r", seq.handle.request.id, exc)

    def _close_runner(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        try:
            self.runner.close()
        except Exception:
            log.exception("runner.close() failed")

    def _call(self, name: str, *args: Any) -> Any:
        """Call ``runner.<name>(*args)``; any exception is the model side failing."""
        try:
            return getattr(self.runner, name)(*args)
        except Exception as exc:
            raise _RunnerFailed(name, exc) from exc
        finally:
            self._last_model_call_s = time.monotonic()

    # ---- helpers ------------------------------------------------------------------------------

    def _check_request(self, request: GenRequest) -> None:
        prompt, params = request.prompt_ids, request.params
        if len(prompt) == 0:
            raise ValueError(f"request {request.id}: the prompt is empty; send at least one token")
        if params.max_tokens < 1:
            raise ValueError(f"request {request.id}: max_tokens must be ≥ 1, got {params.max_tokens}")
        if len(prompt) + params.max_tokens > self.max_tokens:
            raise ValueError(
                f"request {request.id}: the prompt ({len(prompt)} tokens) + max_tokens "
                f"({params.max_tokens}) = {len(prompt) + params.max_tokens} tokens exceeds the "
                f"{self.max_tokens} tokens a sequence may hold; shorten the prompt or lower "
                "max_tokens (or serve with a larger --max-tokens)")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"request {request.id}: prompt token id {low if low < 0 else high} is "
                             f"outside the vocabulary [0, {self.vocab_size})")

    def _note_service_time(self, seconds: float) -> None:
        """Moving average of how long a sequence holds a slot (for the retry-after estimate)."""
        self._service_s = seconds if self._service_s is None else 0.8 * self._service_s + 0.2 * seconds

    def _retry_after_s(self) -> float:
        """About when a slot frees for one more waiting sequence: the queue ahead drains
        ``max_batch`` at a time, each round taking about one sequence's time in a slot."""
        rounds = math.ceil((len(self._waiting) + 1) / self.max_batch)
        return max(1.0, (self._service_s or 1.0) * rounds)

    def _record_load(self) -> None:
        if self.metrics is None:
            return
        stats = self.stats()
        self.metrics.set_load(stats.running, stats.waiting, stats.slots_in_use, stats.slots)


def prefill_chunk_tokens(budget: int, allowance_s: float, overhead_s: float,
                         token_s: float, *, worth: bool = True) -> int:
    """Prompt tokens one iteration prefills while streams decode, for a prefill call costing
    about ``overhead_s + token_s × tokens`` and ``allowance_s`` (``prefill_stall`` × a decode
    step) of stall allowed: the most tokens whose call fits the allowance, but at least
    ``MIN_PREFILL_CHUNK`` (prompts always progress) and at least the overhead's worth
    (``overhead_s / token_s`` tokens: smaller chunks would spend most of each call on its
    overhead), and at most ``budget``.

    The rule, as a bound on the stall (the predicted time of the iteration's prefill, every
    call of it: a call after the first pays its overhead's worth of tokens out of the same
    budget, so several calls cost no more than one call of all the tokens):
    ``min(cost(budget), max(allowance_s, 2 × overhead_s, cost(MIN_PREFILL_CHUNK)))`` where
    ``cost(n) = overhead_s + token_s × n``. So the allowance holds whenever one call's overhead
    is at most half of it and ``MIN_PREFILL_CHUNK`` tokens fit it; beyond, the iteration's
    prefill costs at most two overheads (or the smallest chunk), whichever is more: the
    running streams then wait longer than the allowance for the prompt to progress at all
    efficiently. With ``worth=False`` there is no overhead's-worth floor: the stall is at most
    ``min(cost(budget), max(allowance_s, cost(MIN_PREFILL_CHUNK)))`` — the inter-token bound
    first, at the price of more calls, each paying the overhead (on the 2-core CPU the
    default model's prefill call costs about as much as a decode step, so there the floor
    alone made a 2x inter-token gap)."""
    fits = int((allowance_s - overhead_s) / token_s)
    if not worth:  # the allowance first: a chunk's call may be mostly overhead
        return min(budget, max(MIN_PREFILL_CHUNK, fits))
    worth_tokens = int(overhead_s / token_s)  # tokens taking as long as one call's overhead
    return min(budget, max(MIN_PREFILL_CHUNK, fits, worth_tokens))


def split_step_budget(budget: int, n_decode: int, remaining: Sequence[int], *,
                      buckets: Sequence[int] = (), max_chunks: int | None = None) -> list[int]:
    """Prompt tokens of each waiting prompt (``remaining``: tokens each still has to
    prefill, in admission order) that one mixed step of ``budget`` tokens carries besides its
    ``n_decode`` decode tokens: the decode tokens first, the rest in admission order, at least
    ``MIN_PREFILL_CHUNK`` tokens in all (prompts always progress), in at most ``max_chunks``
    chunks. Prompts beyond the budget get nothing (they are left off the list).

    ``buckets``: the chunk-token sizes the runner's mixed steps are captured at (ascending). The
    chunk tokens are then cut to fill one — the largest bucket within the budget (the smallest
    where none is) — instead of spilling a few tokens into the next bucket, whose step would
    cost that bucket's padded size; fewer prompt tokens than the bucket are all taken (the
    runner pads them up)."""
    left = max(MIN_PREFILL_CHUNK, budget - n_decode)
    if buckets:
        left = max((b for b in buckets if b <= left), default=min(buckets))
    sizes = []
    for tokens in remaining:
        if left <= 0 or (max_chunks is not None and len(sizes) >= max_chunks):
            break
        sizes.append(min(tokens, left))
        left -= sizes[-1]
    return sizes


def _raise_or_return(event: TokenEvent | Exception) -> TokenEvent:
    """:func:`sample_rows`' result for one row: the event, or its error raised."""
    if isinstance(event, Exception):
        raise event
    return event


def _average(mean: float | None, sample: float, weight: float = 0.2) -> float:
    """Exponential moving average: ``sample`` weighs ``weight``; the first sample is the mean."""
    return sample if mean is None else (1 - weight) * mean + weight * sample


def _linear_fit(calls: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of seconds ≈ a + b × tokens over ``calls`` (a ≥ 0, b > 0), robust to outliers:
    b is the median of the slopes between calls of different sizes (Theil–Sen), a the median
    of ``seconds - b × tokens``. A served prefill call is now and then slowed by other work
    in the process (the HTTP side taking the GIL as a burst of requests arrives); least
    squares let such a call pull b towards 0, and a near-zero b made both the tokens that
    "fit" the allowance and the overhead's worth huge (whole prompts in one call: the
    inter-token tail). One chunk size seen so far (or no positive slope): no overhead
    known, b = seconds / tokens (pessimistic)."""
    n = [float(c[0]) for c in calls]
    t = [c[1] for c in calls]
    slopes = [(t[j] - t[i]) / (n[j] - n[i]) for i in range(len(n)) for j in range(i + 1, len(n))
              if n[j] != n[i]]
    b = _median(slopes) if slopes else 0.0
    if b <= 0:  # no spread of sizes (or noise swamped it)
        return 0.0, max(sum(t) / sum(n), 1e-9)
    return max(0.0, _median([y - b * x for x, y in zip(n, t)])), b


def _span(seqs: Sequence[_Sequence]) -> int:
    """Rows a decode step over the decoding ones of ``seqs`` spans: their highest slot + 1."""
    return max((s.slot for s in seqs if s.decoding), default=0) + 1


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _check_positive(name: str, value: Any, integer: bool = False) -> None:
    if integer and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")

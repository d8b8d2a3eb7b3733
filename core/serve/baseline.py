"""The baseline the load benchmark compares ``shardwise serve`` against: the plain Hugging Face
model served one request at a time.

:class:`HFSerialBackend` implements :class:`~shardwise.serve.types.Backend` with a FIFO queue
and one worker thread that runs ``model.generate`` for one request after the other: no batching,
no slots, no graphs — what serving a model with nothing but ``transformers`` gives. Tokens reach
the HTTP side as ``generate`` makes them (a transformers streamer), so time to first token and
inter-token latency are measured the same way as for the continuous-batching scheduler.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..errors import ConfigError, NotSupportedYetError
from .types import (FinishEvent, GenRequest, QueueFullError, SequenceHandle, ServeStats,
                    ServerUnhealthyError, TokenEvent)


@dataclass
class _Job:
    """A queued request: its handle and when it was submitted (``time.monotonic()`` seconds)."""

    handle: SequenceHandle
    submitted_s: float


class _HandleStreamer(BaseStreamer):
    """Pushes one :class:`TokenEvent` per token ``generate`` makes to ``handle``.

    ``generate`` first puts the prompt (``[1, prompt_len]``), then each new token (``[1]``);
    the prompt is skipped. Once the handle is cancelled nothing more is pushed (``generate``
    streams the token of the step whose stopping criterion saw the cancel)."""

    def __init__(self, handle: SequenceHandle, submitted_s: float, metrics=None) -> None:
        self.handle = handle
        self.submitted_s = submitted_s
        self.metrics = metrics
        self.prompt_seen = False
        self.last_token: int | None = None
        self.last_token_s = 0.0

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.handle.cancelled.is_set():
            return
        for token in value.reshape(-1).tolist():
            now = time.monotonic()
            first = self.handle.first_token_s is None
            since = now - (self.submitted_s if first else self.last_token_s)
            if first:
                self.handle.first_token_s = since
            if self.metrics is not None:
                self.metrics.observe_token(since, first, now)
            self.last_token, self.last_token_s = token, now
            self.handle.push(TokenEvent(token))

    def end(self) -> None:
        pass


class _Cancelled(StoppingCriteria):
    """Stops ``generate`` after the current token once the handle is cancelled."""

    def __init__(self, handle: SequenceHandle) -> None:
        self.handle = handle

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        # input_ids: [1, length] → one flag per row
        stop = self.handle.cancelled.is_set()
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


class HFSerialBackend:
    """A :class:`~shardwise.serve.types.Backend` serving a plain Hugging Face causal LM one
    request at a time.

    Args:
        model: a ``transformers`` causal LM (``generate`` is called on it as it is).
        tokenizer: its tokenizer (kept for the HTTP side; the backend itself works on ids).
        max_tokens: tokens one sequence may hold, prompt plus ``max_tokens`` of the request;
            at most the model's positions.
        max_waiting: requests that may wait behind the running one; one more is a
            :class:`~shardwise.serve.types.QueueFullError` (HTTP 429).
        eos_token_ids: tokens that end a sequence (``finish_reason`` "stop"); default: the
            model's ``generation_config.eos_token_id``.
        metrics: a :class:`~shardwise.serve.metrics.ServeMetrics` to record into (time to
            first token, inter-token latency, tokens, finishes, occupancy), or None.
        release_threads: called on the constructing thread before the worker takes over, and
            on the worker whenever its queue runs empty: gives back the calling thread's host
            worker threads (``accelerator.release_thread_pool``), as shardwise's scheduler
            does, so that neither backend's idle pool slows the other's steps when both serve
            from one process. None: nothing to give back.

    Requests run in arrival order. Greedy when ``temperature`` is 0, else sampling with the
    request's ``temperature`` and ``top_p`` (no top-k, as OpenAI), from seed ``seed + index``
    when a seed is given. ``logprobs`` and the presence/frequency penalties are not offered
    by plain ``generate`` and end the request with an error. A cancelled request stops at its
    next token; one still waiting never starts.
    """

    def __init__(self, model, tokenizer, max_tokens: int, max_waiting: int = 64, *,
                 eos_token_ids: Iterable[int] | None = None, metrics=None,
                 release_threads: Callable[[], None] | None = None) -> None:
        if max_tokens < 2:
            raise ConfigError(f"max_tokens must be at least 2 (a prompt token and a generated "
                              f"one), got {max_tokens}")
        if max_waiting < 0:
            raise ConfigError(f"max_waiting must be ≥ 0, got {max_waiting}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens)
        self.max_waiting = int(max_waiting)
        if eos_token_ids is None:
            eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
            eos_token_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.metrics = metrics
        self._waiting: collections.deque[_Job] = collections.deque()
        self._running: _Job | None = None
        self._lock = threading.Condition()
        self._accepting = True
        self._stopping = False
        self._failure: BaseException | None = None
        self._release_threads = release_threads or (lambda: None)
        self._worker = threading.Thread(target=self._work, name="hf-serial-backend", daemon=True)
        self._release_threads()
        self._worker.start()

    # ----- Backend ------------------------------------------------------------------------------

    def submit(self, request: GenRequest,
               loop: asyncio.AbstractEventLoop | None) -> SequenceHandle:
        """Queue ``request`` behind the others (see the class docstring)."""
        needed = len(request.prompt_ids) + request.params.max_tokens
        if not request.prompt_ids or needed > self.max_tokens:
            raise ConfigError(f"request {request.id}: prompt ({len(request.prompt_ids)} tokens) "
                              f"+ max_tokens ({request.params.max_tokens}) must be "
                              f"1..{self.max_tokens} tokens; shorten the prompt or lower "
                              f"max_tokens")
        handle = SequenceHandle(request, loop)
        job = _Job(handle, time.monotonic())
        with self._lock:
            if self._failure is not None:
                raise ServerUnhealthyError(f"the HF baseline's worker failed: {self._failure!r}")
            if not self._accepting:
                raise ServerUnhealthyError("the server is stopping; no new requests")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (the most this "
                                     f"server queues); retry later", retry_after_s=1.0)
            self._waiting.append(job)
            self._lock.notify_all()
        self._record_load()
        return handle

    def healthy(self) -> bool:
        return self._failure is None and self._worker.is_alive()

    def stop(self, drain_s: float) -> None:
        """Stop accepting; the running request may finish for up to ``drain_s`` seconds, then
        it and every waiting one end ``"cancelled"``; the worker thread ends."""
        deadline = time.monotonic() + max(drain_s, 0.0)
        with self._lock:
            self._accepting = False
            while self._waiting or self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._worker.is_alive():
                    break
                self._lock.wait(timeout=left)
            self._stopping = True
            for job in self._waiting:
                job.handle.cancel()
            if self._running is not None:
                self._running.handle.cancel()
            self._lock.notify_all()
        self._worker.join(timeout=max(drain_s, 0.0) + 30.0)

    def stats(self) -> ServeStats:
        """Running and waiting requests (one "slot": the single request ``generate`` runs)."""
        with self._lock:
            running = int(self._running is not None)
            return ServeStats(running=running, waiting=len(self._waiting),
                              slots_in_use=running, slots=1)

    # ----- the worker ---------------------------------------------------------------------------

    def _next(self) -> _Job | None:
        """The next request to run (None: stopping and nothing left); waits for one."""
        with self._lock:
            idle = not self._waiting
        if idle:
            self._release_threads()
        with self._lock:
            while not self._waiting and not self._stopping:
                self._lock.wait(timeout=1.0)
            if not self._waiting:
                return None
            job = self._running = self._waiting.popleft()
        self._record_load()
        return job

    def _work(self) -> None:
        try:
            while (job := self._next()) is not None:
                try:
                    self._serve(job)
                finally:
                    with self._lock:
                        self._running = None
                        self._lock.notify_all()
                    self._record_load()
        except BaseException as exc:  # noqa: BLE001 - reported through healthy()/submit
            self._failure = exc
            raise

    def _serve(self, job: _Job) -> None:
        """Run one request to its end and push its :class:`FinishEvent`."""
        handle = job.handle
        if handle.cancelled.is_set():
            self._finish(handle, FinishEvent("cancelled"))
            return
        try:
            streamer = self._generate(job)
        except Exception as exc:  # noqa: BLE001 - this request fails, the server goes on
            self._finish(handle, FinishEvent("error", error=exc))
            return
        if handle.cancelled.is_set():
            reason = "cancelled"
        elif streamer.last_token is not None and streamer.last_token in self.eos_token_ids:
            reason = "stop"
        else:
            reason = "length"
        self._finish(handle, FinishEvent(reason))

    def _finish(self, handle: SequenceHandle, event: FinishEvent) -> None:
        if self.metrics is not None:
            self.metrics.finish(event.reason)
        handle.push(event)

    def _record_load(self) -> None:
        if self.metrics is not None:
            stats = self.stats()
            self.metrics.set_load(stats.running, stats.waiting, stats.slots_in_use, stats.slots)

    def _generate(self, job: _Job) -> _HandleStreamer:
        """``model.generate`` on the request's prompt, streaming into its handle."""
        handle = job.handle
        request, params = handle.request, handle.request.params
        if params.logprobs is not None or params.presence_penalty or params.frequency_penalty:
            raise NotSupportedYetError(
                "the HF baseline serves greedy and temperature/top_p sampling only; logprobs and "
                "presence/frequency penalties need the shardwise scheduler")
        device = next(self.model.parameters()).device
        input_ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=device)
        streamer = _HandleStreamer(handle, job.submitted_s, self.metrics)
        if self.metrics is not None:
            self.metrics.add_prompt_tokens(len(request.prompt_ids))
        sampling = ({"do_sample": False} if params.greedy else
                    {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
                     "top_k": 0})
        pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        # the seed is set inside a fork of the CPU generator, so the process's own stream of
        # random numbers is left as it was (one worker thread: no other request samples here)
        with torch.inference_mode(), torch.random.fork_rng(devices=[]):
            if not params.greedy and params.seed is not None:
                torch.manual_seed(params.seed + request.index)
            self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                max_new_tokens=params.max_tokens, min_new_tokens=0,
                                eos_token_id=list(self.eos_token_ids) or None, pad_token_id=pad,
                                streamer=streamer,
                                stopping_criteria=StoppingCriteriaList([_Cancelled(handle)]),
                                **sampling)
        return streamer

"""The OpenAI-compatible HTTP layer of ``shardwise serve`` (FastAPI).

:func:`build_app` serves, over one :class:`ServeState`:

* ``GET /v1/models`` (and ``/v1/models/{id}``): the one served model.
* ``POST /v1/completions`` and ``POST /v1/chat/completions``: validated by
  :mod:`shardwise.serve.protocol`, one sequence per choice submitted to the backend; the text of
  each goes through an :class:`~shardwise.serve.detok.IncrementalDetokenizer` and a
  :class:`~shardwise.serve.detok.StopMatcher` (a matched stop string cancels the sequence,
  ``finish_reason`` "stop"). ``stream: true`` answers server-sent events (``data: {json}`` per
  chunk, ``data: [DONE]`` last; with ``stream_options.include_usage`` a final chunk with
  ``usage``). Every non-streamed answer carries ``usage``.
* ``POST /v1/embeddings`` when the state has an :class:`~shardwise.serve.embeddings.Embedder`.
* ``GET /health`` (200, or 503 once the backend has failed) and ``GET /metrics`` (Prometheus).

Failures, in OpenAI's error body: bad input 400 (malformed JSON included), unknown model 404, a
full queue 429 with ``Retry-After``, a sequence whose generation raised 500 (the other sequences
go on; mid-stream it is an ``error`` event), an unhealthy backend 503, anything else a route
raises 500 with the connection kept open (:class:`CrashTo500`). A client that goes away
(mid-stream or while waiting for a non-streamed answer) has its sequences cancelled at once, so
their slots free at the scheduler's next step.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .detok import IncrementalDetokenizer, StopMatcher
from .protocol import (APIError, GenerationJob, parse_chat, parse_completion,
                       parse_embeddings)
from .types import (Backend, FinishEvent, QueueFullError, SequenceHandle, ServerUnhealthyError,
                    TokenEvent)

log = logging.getLogger(__name__)


class ServeState:
    """What the app serves: the ``backend`` generating tokens (None for an encoder-only
    server), the ``tokenizer``, the ``model_name`` clients must send, ``max_context`` (the
    model's positions), ``metrics`` (``render() -> (bytes, content type)``; None: no
    ``/metrics``), and an ``embedder`` for ``/v1/embeddings``.

    ``event_timeout_s`` bounds the wait for each next token of a sequence (500 past it)."""

    def __init__(self, backend: Backend | None, tokenizer: Any, model_name: str,
                 max_context: int, metrics: Any, embedder: Any = None, *,
                 event_timeout_s: float = 300.0) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = int(max_context)
        self.metrics = metrics
        self.embedder = embedder
        self.event_timeout_s = event_timeout_s
        self.created = int(time.time())

    @property
    def capacity(self) -> int:
        """Tokens one sequence may hold: the smaller of the context and the backend's cache."""
        if self.backend is None:
            return self.max_context
        return min(self.max_context, int(self.backend.max_tokens))

    def healthy(self) -> bool:
        return self.backend is None or bool(self.backend.healthy())


# ----- one request's sequences -------------------------------------------------------------------

@dataclass
class Delta:
    """New output of one choice: ``text`` (safe to send: stop strings held back), the
    ``tokens`` it came from, ``offset`` (characters of the choice's text before it), and
    ``finish_reason`` once it ends."""

    index: int
    text: str
    tokens: list[TokenEvent] = field(default_factory=list)
    offset: int = 0
    finish_reason: str | None = None


class _TimedOut:
    """Put in a choice's event queue by its watchdog: no event came for ``event_timeout_s``."""


class _Choice:
    """One submitted sequence and its text so far (detokenizer → stop strings).

    The wait for each next event is bounded by ``event_timeout_s`` with ONE timer per choice
    (re-armed from the time of the last event when it fires), not an ``asyncio.wait_for`` per
    token, which wraps every ``queue.get()`` in a new task and a timer."""

    def __init__(self, index: int, handle: SequenceHandle, state: ServeState) -> None:
        self.index = index
        self.handle = handle
        self.timeout = state.event_timeout_s
        self.detok = IncrementalDetokenizer(state.tokenizer, handle.request.prompt_ids)
        self.stop = StopMatcher(handle.request.params.stop)
        self.tokens = 0  # generated tokens this choice consumed (usage)
        self.chars = 0  # characters of text emitted
        self.finished = False
        self._last_event_s = 0.0  # loop time of the last event taken
        self._timer: asyncio.TimerHandle | None = None

    async def deltas(self) -> AsyncIterator[Delta]:
        """Every non-empty delta up to the one carrying the finish reason."""
        loop = asyncio.get_running_loop()
        self._last_event_s = loop.time()
        self._timer = loop.call_at(self._last_event_s + self.timeout, self._watch, loop)
        try:
            while not self.finished:
                event = await self._next_event(loop)
                if isinstance(event, TokenEvent):
                    delta = self._on_token(event)
                else:
                    delta = self._on_finish(event)
                self.finished = delta.finish_reason is not None
                self.chars += len(delta.text)
                if delta.text or delta.tokens or self.finished:
                    yield delta
        finally:
            self._timer.cancel()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer: time out the wait when no event came for ``timeout`` seconds, else
        re-arm for ``timeout`` after the last one."""
        deadline, now = self._last_event_s + self.timeout, loop.time()
        if not self.handle.queue.empty():  # no wait now: the reader is behind, not starved
            deadline = max(deadline, now + self.timeout)
        elif now >= deadline:
            self.handle.queue.put_nowait(_TimedOut())
            return
        self._timer = loop.call_at(deadline, self._watch, loop)

    async def _next_event(self, loop: asyncio.AbstractEventLoop) -> TokenEvent | FinishEvent:
        queue = self.handle.queue
        event = queue.get_nowait() if not queue.empty() else await queue.get()
        self._last_event_s = loop.time()
        if isinstance(event, _TimedOut):
            self.handle.cancel()
            raise APIError(500, f"no token for {self.timeout:g} s; the request was cancelled",
                           type="server_error", code="timeout")
        return event

    def _on_token(self, event: TokenEvent) -> Delta:
        self.tokens += 1
        text, matched = self.stop.feed(self.detok.add(event.token_id))
        if matched:
            self.handle.cancel()  # the scheduler frees the slot at its next step
        return Delta(self.index, text, [event], self.chars, "stop" if matched else None)

    def _on_finish(self, event: FinishEvent) -> Delta:
        if event.reason == "error" and isinstance(event.error, ServerUnhealthyError):
            raise APIError(503, f"the model side failed: {event.error}", type="server_error",
                           code="unhealthy")
        if event.reason == "error":
            raise APIError(500, f"generation failed: {type(event.error).__name__}: "
                           f"{event.error}", type="server_error", code="generation_error")
        if event.reason == "cancelled":
            raise APIError(503, "the server cancelled this request (it is stopping or the "
                           "client went away)", type="server_error", code="cancelled")
        text, matched = self.stop.feed(self.detok.flush())
        if matched:
            return Delta(self.index, text, [], self.chars, "stop")
        return Delta(self.index, text + self.stop.flush(), [], self.chars, event.reason)


class _Generation:
    """The choices of one request: submitted together, merged into one stream of deltas,
    cancelled together (also when the client disconnects)."""

    def __init__(self, state: ServeState, job: GenerationJob, prefix: str) -> None:
        self.state = state
        self.job = job
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices: list[_Choice] = []
        self.by_index: dict[int, _Choice] = {}
        self._watcher: asyncio.Task | None = None

    def submit(self, request: Request) -> None:
        """Submit every choice (429 / 503 cancel those already in) and watch the client."""
        loop = asyncio.get_running_loop()
        try:
            for index, seq in self.job.requests(self.id):
                self.choices.append(_Choice(index, self.state.backend.submit(seq, loop),
                                            self.state))
        except QueueFullError as exc:
            self.cancel()
            raise APIError(429, f"{exc}; retry later", type="rate_limit_error",
                           code="queue_full",
                           headers={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))})
        except ServerUnhealthyError as exc:
            self.cancel()
            raise APIError(503, str(exc), type="server_error", code="unhealthy") from None
        except ValueError as exc:  # the backend's own check of the request (vocabulary, length)
            self.cancel()
            raise APIError(400, str(exc), code="invalid_value") from None
        self.by_index = {c.index: c for c in self.choices}
        self._watcher = asyncio.create_task(self._watch(request))

    async def _watch(self, request: Request) -> None:
        """Cancel every sequence as soon as the client disconnects (the body is read, so the
        next ASGI message is the disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.cancel()

    def cancel(self) -> None:
        for choice in self.choices:
            if not choice.finished:
                choice.handle.cancel()

    def close(self) -> None:
        """The answer is done (or abandoned): stop watching, cancel what still runs."""
        if self._watcher is not None:
            self._watcher.cancel()
        self.cancel()

    async def deltas(self) -> AsyncIterator[Delta]:
        """Deltas of all choices as they come; raises the first choice's error. One choice
        (``n`` = 1, the common case) is read directly; several are merged through a queue."""
        if len(self.choices) == 1:
            try:  # closed with this generator: the choice's timer stops at once, not at GC
                async with contextlib.aclosing(self.choices[0].deltas()) as deltas:
                    async for delta in deltas:
                        yield delta
            finally:
                self.close()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                async for delta in choice.deltas():
                    queue.put_nowait(delta)
                queue.put_nowait(None)
            except Exception as exc:  # noqa: BLE001 - handed to the reader
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p) for p in self.job.prompts)
        completion = sum(c.tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}


# ----- OpenAI response objects -------------------------------------------------------------------

TokenText = Callable[[int], str]


def completion_logprobs(token_text: TokenText, deltas: list[Delta]) -> dict[str, list]:
    """The completions API's logprobs: ``tokens``, ``token_logprobs``, ``top_logprobs``
    (a {token: logprob} dict per position), ``text_offset``; ``token_text(id)`` is a token's
    own text (leading space included)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for delta in deltas:
        for event in delta.tokens:
            out["tokens"].append(token_text(event.token_id))
            out["token_logprobs"].append(event.logprob)
            out["top_logprobs"].append({token_text(t): lp for t, lp in event.top_logprobs or ()})
            out["text_offset"].append(delta.offset)
    return out


def _chat_token(token_text: TokenText, token_id: int, logprob: float | None) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_text: TokenText, deltas: list[Delta]) -> dict[str, list]:
    """The chat API's logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for delta in deltas:
        for event in delta.tokens:
            entry = _chat_token(token_text, event.token_id, event.logprob)
            entry["top_logprobs"] = [_chat_token(token_text, t, lp)
                                     for t, lp in event.top_logprobs or ()]
            content.append(entry)
    return {"content": content}


def _choice(choice: _Choice, job: GenerationJob, deltas: list[Delta],
            streaming: bool) -> dict[str, Any]:
    """One choice of a response (``deltas``: all of it) or of a stream chunk (one delta)."""
    text = "".join(d.text for d in deltas)
    reason = deltas[-1].finish_reason if deltas else None
    logprobs = None
    if job.params.logprobs is not None:
        build = chat_logprobs if job.kind == "chat" else completion_logprobs
        logprobs = build(choice.detok.token_text, deltas)
    if job.kind == "completion":
        return {"index": choice.index, "text": text, "logprobs": logprobs,
                "finish_reason": reason}
    body = {"delta": {"content": text}} if streaming else {
        "message": {"role": "assistant", "content": text}}
    return {"index": choice.index, **body, "logprobs": logprobs, "finish_reason": reason}


def _envelope(gen: _Generation, streaming: bool) -> dict[str, Any]:
    kind = {("completion", False): "text_completion", ("completion", True): "text_completion",
            ("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk"}
    return {"id": gen.id, "object": kind[gen.job.kind, streaming], "created": gen.created,
            "model": gen.state.model_name}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


# ----- handlers ----------------------------------------------------------------------------------

async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc}); send a JSON object",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got "
                       f"{type(body).__name__}", code="invalid_json")
    return body


def _need_backend(state: ServeState) -> None:
    if state.backend is None:
        raise APIError(400, f"the model '{state.model_name}' is an encoder: it only serves "
                       f"/v1/embeddings", param="model", code="model_not_generative")


async def _generate(request: Request, state: ServeState, job: GenerationJob,
                    prefix: str) -> Response:
    gen = _Generation(state, job, prefix)
    gen.submit(request)
    deltas = gen.deltas()
    if job.stream:
        try:  # the first delta before the headers: a failed prefill is still a plain 500
            first = await anext(deltas)
        except StopAsyncIteration:
            first = None
        return StreamingResponse(_stream(gen, deltas, first), media_type="text/event-stream")
    per_choice: dict[int, list[Delta]] = {c.index: [] for c in gen.choices}
    async for delta in deltas:
        per_choice[delta.index].append(delta)
    choices = [_choice(c, job, per_choice[c.index], streaming=False) for c in gen.choices]
    return JSONResponse({**_envelope(gen, False), "choices": choices, "usage": gen.usage()})


async def _stream(gen: _Generation, deltas: AsyncIterator[Delta],
                  first: Delta | None) -> AsyncIterator[str]:
    """Server-sent events of a streamed answer (an ``error`` event if a sequence fails)."""
    job, envelope = gen.job, _envelope(gen, True)
    try:
        if job.kind == "chat":  # OpenAI's first chunk per choice: the role
            for choice in gen.choices:
                yield _sse({**envelope, "choices": [{
                    "index": choice.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]})
        delta = first
        while delta is not None:
            choice = gen.by_index[delta.index]
            yield _sse({**envelope, "choices": [_choice(choice, job, [delta], streaming=True)]})
            delta = await anext(deltas, None)
        if job.include_usage:
            yield _sse({**envelope, "choices": [], "usage": gen.usage()})
    except APIError as exc:
        yield _sse(exc.body())
    finally:
        await deltas.aclose()
        gen.close()
    yield "data: [DONE]\n\n"


def _encode_vector(vector: Any, fmt: str) -> list[float] | str:
    if fmt == "base64":  # little-endian float32, as OpenAI sends
        return base64.b64encode(vector.float().contiguous().numpy().astype("<f4")
                                .tobytes()).decode("ascii")
    return vector.float().tolist()


async def _embeddings(state: ServeState, body: dict[str, Any]) -> dict[str, Any]:
    job = parse_embeddings(body, tokenizer=state.tokenizer, model_name=state.model_name,
                           capacity=state.max_context)
    if state.embedder is None:
        raise APIError(400, f"the model '{state.model_name}' is not an encoder: it has no "
                       f"embeddings (serve an encoder such as BERT for /v1/embeddings)",
                       param="model", code="model_not_encoder")
    vectors = await asyncio.wrap_future(state.embedder.submit(job.inputs))  # [n, hidden]
    tokens = sum(len(ids) for ids in job.inputs)
    data = [{"object": "embedding", "index": i,
             "embedding": _encode_vector(v, job.encoding_format)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": state.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _model_card(state: ServeState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "shardwise"}


class CrashTo500:
    """ASGI middleware: an exception a route raises before its response starts becomes
    OpenAI's 500 body, logged with its traceback. (An ``exception_handler(Exception)`` answers
    the same body but from Starlette's outermost middleware, which re-raises after sending it,
    so uvicorn closes the connection: a client's pooled keep-alive connection then resets on
    its next request.) After the response started, the exception goes on to the server."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:
                raise
            log.exception("%s %s raised", scope.get("method"), scope.get("path"))
            body = APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                            type="server_error").body()
            await JSONResponse(body, status_code=500)(scope, receive, send)


def build_app(state: ServeState) -> FastAPI:
    """The FastAPI app serving ``state`` (see the module docstring for the routes)."""
    app = FastAPI(title="shardwise serve", docs_url=None, redoc_url=None)
    app.state.serve = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    app.add_middleware(CrashTo500)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != state.model_name:
            raise APIError(404, f"the model '{model_id}' does not exist; this server serves "
                           f"'{state.model_name}'", param="model", code="model_not_found")
        return _model_card(state)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _json_body(request)
        _need_backend(state)
        job = parse_completion(body, tokenizer=state.tokenizer, model_name=state.model_name,
                               capacity=state.capacity)
        return await _generate(request, state, job, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _json_body(request)
        _need_backend(state)
        job = parse_chat(body, tokenizer=state.tokenizer, model_name=state.model_name,
                         capacity=state.capacity)
        return await _generate(request, state, job, "chatcmpl")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        return await _embeddings(state, await _json_body(request))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = state.healthy()
        return JSONResponse({"status": "ok" if ok else "unhealthy"},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            raise APIError(404, "this server keeps no metrics", code="no_metrics")
        body, content_type = state.metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    return app

"""The OpenAI-compatible HTTP layer (``shardwise.serve.api``) through the real ``openai`` client
against uvicorn on 127.0.0.1 (tests/serve_harness.py).

Part 1 runs the app over :class:`FakeBackend` (types.Backend, deterministic tokens, no model): the
routes, response and stream shapes, ``n``, ``stop``, ``logprobs``, ``usage``, every kind of bad
input (400 naming the parameter, 404, malformed JSON), 429 with ``Retry-After``, a failing
sequence (500, the others go on), an unhealthy backend (503), and a client disconnecting
mid-stream (its sequence is cancelled). Part 2 runs the real stack (scheduler + slot runner on a
tiny injected Llama with the SmolLM2 tokenizer) and embeddings on a tiny BERT.

Fake tokens, with the tiny word-level tokenizer (``"t7"`` is id 7): choice ``i`` of a prompt
ending in id ``last`` generates ids ``3 + (last - 3 + 1 + k + 7 i) % 253`` for k = 0, 1, …, so
"t5 t6" continues " t7 t8 t9 …". A prompt containing ``t13`` fails before its first token,
``t14`` after it; ``t15`` is refused by submit (ValueError), ``t16`` crashes it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading

import httpx2
import openai
import pytest
import torch

from shardwise.serve.api import ServeState, build_app
from shardwise.serve.types import (FinishEvent, GenRequest, QueueFullError, SequenceHandle,
                                   ServerUnhealthyError, TokenEvent)
from models import tiny_tokenizer
from serve_harness import openai_client, serving

MODEL = "tiny-fake"
FAIL_AT_START, FAIL_AFTER_ONE, REFUSED, CRASH = 13, 14, 15, 16
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}t3{% endif %}")


def fake_token(last: int, k: int, index: int) -> int:
    return 3 + (last - 3 + 1 + k + 7 * index) % 253


def fake_text(last: int, count: int, index: int = 0) -> str:
    """What the fake generates after a prompt ending in ``last`` (leading space included)."""
    return "".join(f" t{fake_token(last, k, index)}" for k in range(count))


class FakeBackend:
    """types.Backend without a model: each sequence runs on its own thread and pushes
    :func:`fake_token` ids (with logprobs when asked) until ``max_tokens`` or cancellation.
    ``full`` / ``unhealthy`` make submit refuse; ``step_s`` paces the tokens."""

    def __init__(self, max_tokens: int = 64) -> None:
        self.max_tokens = max_tokens
        self.full = False
        self.unhealthy = False
        self.step_s = 0.0
        self.handles: list[SequenceHandle] = []
        self.submitted = threading.Event()

    def submit(self, request: GenRequest, loop) -> SequenceHandle:
        if self.unhealthy:
            raise ServerUnhealthyError("the fake model side failed")
        if self.full:
            raise QueueFullError("the queue is full (64 waiting)", retry_after_s=2.5)
        if REFUSED in request.prompt_ids:
            raise ValueError(f"prompt token id {REFUSED} is outside the model's vocabulary")
        if CRASH in request.prompt_ids:
            raise RuntimeError("the fake backend's submit crashed")
        handle = SequenceHandle(request, loop)
        self.handles.append(handle)
        threading.Thread(target=self._run, args=(handle,), daemon=True).start()
        self.submitted.set()
        return handle

    def _run(self, handle: SequenceHandle) -> None:
        request = handle.request
        for k in range(request.params.max_tokens):
            if handle.cancelled.wait(self.step_s) or handle.cancelled.is_set():
                return handle.push(FinishEvent("cancelled"))
            if (FAIL_AT_START in request.prompt_ids and k == 0) or (
                    FAIL_AFTER_ONE in request.prompt_ids and k == 1):
                return handle.push(FinishEvent("error", RuntimeError("fake kernel fault")))
            handle.push(self._event(request, k))
        handle.push(FinishEvent("length"))

    @staticmethod
    def _event(request: GenRequest, k: int) -> TokenEvent:
        token = fake_token(request.prompt_ids[-1], k, request.index)
        top = request.params.logprobs
        if top is None:
            return TokenEvent(token)
        lp = -0.5 - 0.25 * (k % 3)
        return TokenEvent(token, lp, tuple((3 + (token - 3 + j) % 253, lp - j)
                                           for j in range(top)))

    def healthy(self) -> bool:
        return not self.unhealthy

    def stop(self, drain_s: float) -> None:
        for handle in self.handles:
            handle.cancel()


class FakeMetrics:
    def render(self) -> tuple[bytes, str]:
        return b"serve_fake_total 1.0\n", "text/plain; version=0.0.4; charset=utf-8"


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture
def fake(tokenizer):
    """(backend, server, openai client) over a fresh :class:`FakeBackend`; max_context 48."""
    backend = FakeBackend()
    state = ServeState(backend, tokenizer, MODEL, max_context=48, metrics=FakeMetrics(),
                       event_timeout_s=10.0)
    with serving(build_app(state)) as server:
        yield backend, server, openai_client(server, timeout=20.0)
    backend.stop(0)


# ----- part 1: the HTTP layer over a fake backend ------------------------------------------------

def test_models_health_metrics(fake):
    backend, server, client = fake
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    assert httpx2.get(f"{server.url}/health").status_code == 200
    metrics = httpx2.get(f"{server.url}/metrics")
    assert metrics.status_code == 200 and b"serve_fake_total 1.0" in metrics.content
    assert metrics.headers["content-type"].startswith("text/plain")
    backend.unhealthy = True
    assert httpx2.get(f"{server.url}/health").status_code == 503


def test_completion_text_usage_and_length(fake):
    _, _, client = fake
    out = client.completions.create(model=MODEL, prompt="t5 t6", max_tokens=4)
    assert out.object == "text_completion" and out.model == MODEL
    [choice] = out.choices
    assert choice.text == fake_text(6, 4) and choice.finish_reason == "length"
    assert choice.index == 0 and choice.logprobs is None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) \
        == (2, 4, 6)


def test_completion_default_max_tokens_fills_the_capacity(fake):
    backend, _, client = fake
    backend.max_tokens = 20  # smaller than max_context 48: the cache bounds a sequence
    out = client.completions.create(model=MODEL, prompt="t5 t6 t7")
    assert out.usage.completion_tokens == 17 and out.choices[0].finish_reason == "length"


def test_completion_token_id_prompts_and_a_batch_of_prompts(fake):
    _, _, client = fake
    out = client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2)
    assert out.choices[0].text == fake_text(6, 2)
    out = client.completions.create(model=MODEL, prompt=["t5", "t9 t10"], max_tokens=2, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [fake_text(5, 2, 0), fake_text(5, 2, 1),
                                             fake_text(10, 2, 0), fake_text(10, 2, 1)]
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 8


def test_chat_non_stream(fake):
    _, _, client = fake
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "t20"},
                               {"role": "user", "content": [{"type": "text", "text": "t5"}]}],
        max_completion_tokens=3, user="someone")
    assert out.object == "chat.completion"
    [choice] = out.choices
    # the template gives "t20 t5 t3": 3 prompt tokens, generation continues after t3
    assert choice.message.role == "assistant" and choice.message.content == fake_text(3, 3)
    assert choice.finish_reason == "length" and out.usage.prompt_tokens == 3


def test_n_choices_are_indexed(fake):
    _, _, client = fake
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                 "content": "t5"}],
                                         max_tokens=2, n=3, seed=4, temperature=1.0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.message.content for c in out.choices] == [fake_text(3, 2, i) for i in range(3)]
    assert out.usage.completion_tokens == 6


def test_stop_string_ends_the_choice_and_cancels_its_sequence(fake):
    backend, _, client = fake
    out = client.completions.create(model=MODEL, prompt="t5 t6", max_tokens=30,
                                    stop=["t9", "never"])
    assert out.choices[0].text == " t7 t8 " and out.choices[0].finish_reason == "stop"
    assert backend.handles[-1].cancelled.is_set()
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, stop="t6",
                                                 messages=[{"role": "user", "content": "t1"}],
                                                 max_tokens=30))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " t4 t5 " and chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_shape(fake):
    _, _, client = fake
    out = client.completions.create(model=MODEL, prompt="t5 t6", max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    # a token's own text keeps its leading space (detok.IncrementalDetokenizer.token_text)
    assert lp.tokens == [" t7", " t8", " t9"]
    assert lp.token_logprobs == [-0.5, -0.75, -1.0]
    assert lp.top_logprobs == [{" t7": -0.5, " t8": -1.5}, {" t8": -0.75, " t9": -1.75},
                               {" t9": -1.0, " t10": -2.0}]
    assert len(lp.text_offset) == 3 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[0] == 0


def test_chat_logprobs_shape_streaming_and_not(fake):
    _, _, client = fake
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "t5"}], max_tokens=2,
                  logprobs=True, top_logprobs=1)
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [
        (" t4", -0.5, list(b" t4")), (" t5", -0.75, list(b" t5"))]
    assert [[(x.token, x.logprob) for x in t.top_logprobs] for t in content] == [
        [(" t4", -0.5)], [(" t5", -0.75)]]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(" t4", -0.5), (" t5", -0.75)]
    no_top = client.chat.completions.create(**{**kwargs, "top_logprobs": None})
    assert [t.top_logprobs for t in no_top.choices[0].logprobs.content] == [[], []]


def test_completion_stream_with_usage(fake):
    _, _, client = fake
    chunks = list(client.completions.create(model=MODEL, prompt="t5 t6", max_tokens=4,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == fake_text(6, 4)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == 2
    no_usage = list(client.completions.create(model=MODEL, prompt="t5", max_tokens=2,
                                              stream=True))
    assert all(c.choices for c in no_usage)


def test_chat_stream_n2_role_first_then_content(fake):
    _, _, client = fake
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "t5"}], max_tokens=3, n=2,
        stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert "".join(ch.delta.content or "" for ch in mine) == fake_text(3, 3, i)
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6


def _error(excinfo) -> dict:
    return excinfo.value.body if isinstance(excinfo.value.body, dict) else {}


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"echo": True}, "echo"),
    ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"), ({"banana": 1}, "banana"),
    ({"temperature": 2.5}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"),
    ({"n": 1000}, "n"), ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"seed": 1.5}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": 5}, "stop"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 47}, "max_tokens"), ({"stream_options": {"include_usage": True}},
                                         "stream_options"),
    ({"prompt": "t5 " * 48}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": [5, 999]}, "prompt"),
])
def test_completion_bad_input_is_400_naming_the_parameter(fake, extra, param):
    backend, _, client = fake
    body = {"prompt": "t5 t6", "max_tokens": 2, **extra}
    prompt = body.pop("prompt")
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.completions.create(model=MODEL, prompt=prompt, extra_body=body)
    error = _error(excinfo)
    assert error.get("param") == param and param in error["message"], error
    assert error.get("type") == "invalid_request_error"
    assert backend.handles == []  # refused before any work


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"), ({"response_format": {"type": "json_object"}},
                                               "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"), ({"parallel_tool_calls": True},
                                                    "parallel_tool_calls"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 30},
                                            "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "wizard", "content": "t5"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": []}, "messages"),
])
def test_chat_bad_input_is_400_naming_the_parameter(fake, extra, param):
    backend, _, client = fake
    body = {"messages": [{"role": "user", "content": "t5"}], "max_tokens": 2, **extra}
    messages = body.pop("messages")
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL, messages=messages, extra_body=body)
    error = _error(excinfo)
    assert error.get("param") == param and param in error["message"], error
    assert backend.handles == []


def test_unknown_model_is_404(fake):
    backend, _, client = fake
    with pytest.raises(openai.NotFoundError) as excinfo:
        client.completions.create(model="gpt-9", prompt="t5", max_tokens=2)
    assert _error(excinfo)["param"] == "model" and "gpt-9" in _error(excinfo)["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", max_tokens=2,
                                       messages=[{"role": "user", "content": "t5"}])
    assert backend.handles == []


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_json_is_400(fake, raw):
    _, server, _ = fake
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
        response = httpx2.post(f"{server.url}{path}", content=raw,
                               headers={"Content-Type": "application/json"}, timeout=10)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "JSON" in error["message"]


def test_embeddings_without_an_encoder_is_400(fake):
    _, _, client = fake
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.embeddings.create(model=MODEL, input="t5")
    assert "not an encoder" in _error(excinfo)["message"]


def test_queue_full_is_429_with_retry_after(fake):
    backend, server, client = fake
    backend.full = True
    with pytest.raises(openai.RateLimitError) as excinfo:
        client.completions.create(model=MODEL, prompt="t5", max_tokens=2)
    assert excinfo.value.response.headers["retry-after"] == "3"
    assert _error(excinfo)["code"] == "queue_full"
    backend.full = False
    assert client.completions.create(model=MODEL, prompt="t5", max_tokens=2).choices


def test_unhealthy_backend_is_503(fake):
    backend, _, client = fake
    backend.unhealthy = True
    with pytest.raises(openai.InternalServerError) as excinfo:
        client.completions.create(model=MODEL, prompt="t5", max_tokens=2)
    assert excinfo.value.status_code == 503


def test_backend_refusal_is_400_and_a_crash_is_an_openai_500(fake):
    _, _, client = fake
    with pytest.raises(openai.BadRequestError, match="outside the model's vocabulary"):
        client.completions.create(model=MODEL, prompt="t5 t15", max_tokens=2)
    with pytest.raises(openai.InternalServerError) as excinfo:
        client.completions.create(model=MODEL, prompt="t5 t16", max_tokens=2)
    assert "submit crashed" in _error(excinfo)["message"]
    assert _error(excinfo)["type"] == "server_error"
    assert client.completions.create(model=MODEL, prompt="t5", max_tokens=2).choices


def test_a_crash_keeps_the_connection_open(fake):
    """A handler that raises gets its 500 on a connection that stays usable: clients pool
    keep-alive connections, and one the server closed after answering resets the client's next
    request (CI saw ``Connection reset by peer`` right after the crash test's 500)."""
    _, server, _ = fake
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        for prompt, status in (("t5 t16", 500), ("t5", 200), ("t5 t16", 500), ("t5", 200)):
            conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                         body=json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}))
            response = conn.getresponse()
            body = json.loads(response.read())
            assert response.status == status, body
            assert response.getheader("connection", "").lower() != "close"
            if status == 500:
                assert body["error"]["type"] == "server_error"
                assert "submit crashed" in body["error"]["message"]
    finally:
        conn.close()


def test_a_failing_sequence_is_500_and_the_others_go_on(fake):
    backend, _, client = fake
    backend.step_s = 0.01
    results: dict[str, object] = {}

    def good():
        results["good"] = client.completions.create(model=MODEL, prompt="t5", max_tokens=30)

    thread = threading.Thread(target=good)
    thread.start()
    assert backend.submitted.wait(10)
    for prompt in ("t5 t13", "t5 t14"):
        with pytest.raises(openai.InternalServerError) as excinfo:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
        assert excinfo.value.status_code == 500
        assert "fake kernel fault" in _error(excinfo)["message"]
    with pytest.raises(openai.InternalServerError):  # fails before its first token: plain 500
        client.completions.create(model=MODEL, prompt="t13", max_tokens=5, stream=True)
    with pytest.raises(openai.APIError, match="fake kernel fault"):  # mid-stream: error event
        list(client.completions.create(model=MODEL, prompt="t14", max_tokens=5, stream=True))
    thread.join(20)
    assert results["good"].choices[0].text == fake_text(5, 30)
    assert client.completions.create(model=MODEL, prompt="t5", max_tokens=2).choices


def test_event_timeout_bounds_each_wait_not_the_whole_answer(tokenizer):
    """event_timeout_s bounds the wait for each next event: a stream whose tokens keep coming
    outlives it many times over, a stalled one is a 500 (code "timeout") and is cancelled."""
    backend = FakeBackend()
    state = ServeState(backend, tokenizer, MODEL, max_context=48, metrics=FakeMetrics(),
                       event_timeout_s=0.4)
    with serving(build_app(state)) as server:
        client = openai_client(server, timeout=20.0)
        backend.step_s = 0.1  # 12 tokens: ~1.2 s, three timeouts long, never 0.4 s apart
        paced = client.completions.create(model=MODEL, prompt="t5", max_tokens=12, stream=True)
        assert "".join(c.choices[0].text for c in paced if c.choices) == fake_text(5, 12)
        paced = client.completions.create(model=MODEL, prompt="t5", max_tokens=12)
        assert paced.choices[0].text == fake_text(5, 12)
        backend.step_s = 3.0  # stalled: no event within 0.4 s
        with pytest.raises(openai.InternalServerError) as excinfo:
            client.completions.create(model=MODEL, prompt="t5", max_tokens=2)
        assert _error(excinfo)["code"] == "timeout"
        assert backend.handles[-1].cancelled.wait(5)
    backend.stop(0)


def test_client_disconnect_mid_stream_cancels_the_sequence(fake):
    backend, _, client = fake
    backend.step_s = 0.05  # 40 tokens: about 2 s of stream left when the client leaves
    stream = client.completions.create(model=MODEL, prompt="t5", max_tokens=40, stream=True)
    first = next(iter(stream))
    assert first.choices[0].text
    stream.close()
    handle = backend.handles[-1]
    assert handle.cancelled.wait(5), "the server did not cancel the abandoned sequence"
    assert handle.completion_tokens < 40


def test_closing_a_one_choice_stream_closes_its_choice_and_cancels_at_once(tokenizer):
    # the n = 1 path reads the choice's generator directly: closing the answer's stream (what
    # the streaming response does when the client goes away) must close that generator too,
    # its event timer included, and cancel the sequence, before the event loop runs again
    from shardwise.serve.api import _Generation
    from shardwise.serve.protocol import parse_completion

    class Quiet:
        async def receive(self):  # a client that neither sends nor leaves
            await asyncio.Event().wait()

    async def leave_after_first():
        backend = FakeBackend()
        backend.step_s = 0.05
        state = ServeState(backend, tokenizer, MODEL, max_context=48, metrics=None)
        job = parse_completion({"model": MODEL, "prompt": "t5", "max_tokens": 40, "stream": True},
                               tokenizer=tokenizer, model_name=MODEL, capacity=48)
        gen = _Generation(state, job, "cmpl")
        gen.submit(Quiet())
        deltas = gen.deltas()
        assert (await anext(deltas)).text == " t6"
        await deltas.aclose()
        choice = gen.choices[0]
        closed_at_once = (choice._timer.cancelled(), choice.handle.cancelled.is_set())
        while not isinstance(await choice.handle.queue.get(), FinishEvent):
            pass  # the fake's thread ends the sequence while this loop still runs
        return closed_at_once

    assert asyncio.run(leave_after_first()) == (True, True)


def test_client_disconnect_while_waiting_cancels_non_streamed(fake, tokenizer):
    backend, server, _ = fake
    backend.step_s = 0.05

    async def leave_early():
        async with httpx2.AsyncClient(timeout=10) as http:
            request = asyncio.create_task(http.post(
                f"{server.url}/v1/completions",
                json={"model": MODEL, "prompt": "t5", "max_tokens": 40}))
            await asyncio.to_thread(backend.submitted.wait, 10)
            request.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(leave_early())
    assert backend.handles[-1].cancelled.wait(5)
    assert backend.handles[-1].completion_tokens < 40


def test_protocol_max_tokens_default_and_json_roundtrip(tokenizer):
    from shardwise.serve.protocol import parse_completion
    job = parse_completion(json.loads('{"model": "m", "prompt": "t5 t6", "seed": 3, '
                                      '"stop": "x", "user": "u"}'),
                           tokenizer=tokenizer, model_name="m", capacity=10)
    assert job.prompts == [[5, 6]] and job.params.max_tokens == 8
    assert job.params.seed == 3 and job.params.stop == ("x",)
    [(choice, request)] = job.requests("r")
    assert choice == 0 and request.prompt_ids == [5, 6] and request.index == 0


def test_embeddings_tensor_roundtrip():
    from shardwise.serve.embeddings import mean_pool
    hidden = torch.tensor([[[1.0, 0.0], [3.0, 4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    # mean of the two real rows = (2, 2) → normalised (0.7071, 0.7071); the padded row ignored
    assert torch.allclose(mean_pool(hidden, mask), torch.tensor([[0.5 ** 0.5, 0.5 ** 0.5]]))


# ----- part 2: the real pieces --------------------------------------------------------------------

def _hf_sentence_embeddings(model: torch.nn.Module, inputs: list[list[int]]) -> torch.Tensor:
    """sentence-transformers' mean pooling written out on the plain HF model, one input at a
    time (no padding at all): mean of the last hidden state, L2-normalised → [n, hidden]."""
    base = model.base_model
    rows = []
    with torch.no_grad():
        for ids in inputs:
            hidden = base(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [seq, hidden]
            rows.append(torch.nn.functional.normalize(hidden.mean(0), dim=0))
    return torch.stack(rows)


@pytest.mark.parametrize("head", ["masked_lm", "base"])
def test_embeddings_on_an_injected_bert_match_hf_mean_pooling(head):
    import copy

    import numpy as np

    import shardwise
    from models import tiny_encoder
    from shardwise.serve.embeddings import Embedder

    model = tiny_encoder("bert", seed=3, head=head)
    reference = copy.deepcopy(model)
    engine = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)
    tok = tiny_tokenizer()
    embedder = Embedder(engine, tok)
    ran_on = set()  # every forward on the embedder's one worker thread (one OpenMP pool)
    engine.module.register_forward_pre_hook(lambda *_: ran_on.add(threading.get_ident()))
    state = ServeState(None, tok, "tiny-bert", max_context=64, metrics=None, embedder=embedder)
    texts = ["t5 t6 t7 t8 t9", "t40", "t7 t100 t200"]  # different lengths: padded together
    expected = _hf_sentence_embeddings(reference, [tok(t)["input_ids"] for t in texts])
    with serving(build_app(state)) as server:
        client = openai_client(server)
        as_base64 = client.embeddings.create(model="tiny-bert", input=texts)  # client default
        as_float = client.embeddings.create(model="tiny-bert", input=[[5, 6, 7]],
                                            encoding_format="float")
        with pytest.raises(openai.BadRequestError, match="encoder"):
            client.completions.create(model="tiny-bert", prompt="t5", max_tokens=2)
        with pytest.raises(openai.BadRequestError) as excinfo:
            client.embeddings.create(model="tiny-bert", input="t5", dimensions=8)
        assert _error(excinfo)["param"] == "dimensions"
    got = torch.tensor(np.array([d.embedding for d in as_base64.data]), dtype=torch.float32)
    assert [d.index for d in as_base64.data] == [0, 1, 2]
    assert got.shape == (3, reference.config.hidden_size)
    assert torch.allclose(got.norm(dim=1), torch.ones(3), atol=1e-5)
    assert torch.allclose(got, expected, atol=2e-5), (got - expected).abs().max()
    assert torch.allclose(torch.tensor(as_float.data[0].embedding),
                          _hf_sentence_embeddings(reference, [[5, 6, 7]])[0], atol=2e-5)
    assert as_base64.usage.prompt_tokens == 5 + 1 + 3
    assert len(ran_on) == 1 and threading.get_ident() not in ran_on
    embedder.close()


@pytest.fixture(scope="module")
def smol_tokenizer():
    """SmolLM2's tokenizer (vocab 49152, a chat template), read from the embedded GGUF file
    without loading the 135M model's weights (~5 s)."""
    from transformers import AutoTokenizer

    from shardwise.models import default_model_path

    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def real_stack(smol_tokenizer):
    """(plain HF reference, stack, server, async client factory): a tiny random Llama with
    SmolLM2's vocabulary, injected, served by the real scheduler over 8 slots of 96 tokens."""
    import copy

    import transformers

    from families import family
    from shardwise.serve.server import build_stack

    spec = dict(family("llama").config)
    config = getattr(transformers, spec.pop("cls"))(**{**spec, "vocab_size": 49152,
                                                        "max_position_embeddings": 256})
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference = copy.deepcopy(model)
    stack = build_stack(model, smol_tokenizer, max_batch=8, max_tokens=96, name="tiny-llama",
                        device="cpu", replace_with_kernel_inject=True)
    try:
        with serving(build_app(stack.state)) as server:
            yield reference, stack, server
    finally:
        stack.scheduler.stop(5.0)


def _greedy_alone(reference, ids: list[int], max_tokens: int, eos: tuple[int, ...]) -> list[int]:
    """HF ``generate`` of one prompt on its own, greedy → the new token ids."""
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 eos_token_id=list(eos), pad_token_id=eos[0])
    return out[0, len(ids):].tolist()


def test_16_concurrent_requests_each_equal_its_offline_greedy_output(real_stack,
                                                                     smol_tokenizer):
    from serve_harness import async_openai_client

    reference, stack, server = real_stack
    tok, eos = smol_tokenizer, tuple(stack.scheduler.eos_token_ids)
    prompts = [f"Request {i}: " + "the quick brown fox jumps " * (i % 5) + f"over dog {i}"
               for i in range(12)]
    chats = [[{"role": "user", "content": f"Tell me about number {i}."}] for i in range(4)]
    max_tokens = 10

    async def ask(client, i):
        if i < len(prompts):
            kwargs = dict(model="tiny-llama", prompt=prompts[i], max_tokens=max_tokens,
                          temperature=0)
            if i % 2:
                chunks = [c async for c in await client.completions.create(stream=True,
                                                                            **kwargs)]
                return "".join(c.choices[0].text for c in chunks if c.choices)
            return (await client.completions.create(**kwargs)).choices[0].text
        out = await client.chat.completions.create(model="tiny-llama", temperature=0,
                                                   messages=chats[i - len(prompts)],
                                                   max_tokens=max_tokens)
        return out.choices[0].message.content

    async def all_at_once():
        client = async_openai_client(server)
        return await asyncio.gather(*(ask(client, i) for i in range(16)))

    got = asyncio.run(all_at_once())
    ids = [tok(p)["input_ids"] for p in prompts] + [
        tok(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False)["input_ids"] for c in chats]
    expected = [tok.decode(_greedy_alone(reference, p, max_tokens, eos),
                           skip_special_tokens=True) for p in ids]
    assert all(expected), "the reference generated no text: the comparison would be empty"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"request {i}: served {g!r}, generate alone gave {e!r}"


def test_seed_reproduces_a_sampled_completion(real_stack):
    reference, stack, server = real_stack
    client = openai_client(server)
    kwargs = dict(model="tiny-llama", prompt="Once upon a time", max_tokens=12,
                  temperature=1.0, n=2)
    first = client.completions.create(seed=7, **kwargs)
    again = client.completions.create(seed=7, **kwargs)
    other = client.completions.create(seed=8, **kwargs)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert texts[0] != texts[1], "choice 1 samples with seed + 1: it should differ"
    assert texts != [c.text for c in other.choices]
    assert first.usage.completion_tokens == again.usage.completion_tokens


def _finished(server, reason: str) -> float:
    """``shardwise_requests_finished{reason=...}`` from the server's ``GET /metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx2.get(f"{server.url}/metrics", timeout=10).text
    for family_ in text_string_to_metric_families(text):
        for sample in family_.samples:
            if sample.name == "shardwise_requests_finished_total" and \
                    sample.labels.get("reason") == reason:
                return sample.value
    raise AssertionError(f"no shardwise_requests_finished{{reason={reason!r}}} in /metrics")


def test_disconnect_and_stop_strings_cancel_real_sequences(real_stack):
    import time

    reference, stack, server = real_stack
    client = openai_client(server)
    before = _finished(server, "cancelled")
    stream = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=90,
                                       temperature=0, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away after its first token
    # the scheduler frees the slot (and counts the cancellation) at its next step, with no
    # other request to drive it: wait for it, bounded
    deadline = time.monotonic() + 10
    while (_finished(server, "cancelled") < before + 1 or stack.scheduler.stats().slots_in_use)\
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _finished(server, "cancelled") == before + 1
    assert stack.scheduler.stats().slots_in_use == 0
    other = client.completions.create(model="tiny-llama", prompt="Hi there", max_tokens=20,
                                      temperature=0)
    assert other.usage.completion_tokens == 20 or other.choices[0].finish_reason == "stop"
    assert stack.scheduler.stats().running == 0
    # a stop string taken from the greedy text itself ends that choice early
    full = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=12,
                                     temperature=0).choices[0].text
    cut = full[len(full) // 2:len(full) // 2 + 3]
    stopped = client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=12,
                                        temperature=0, stop=[cut]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == full[:full.index(cut)]


def test_real_queue_full_is_429_then_the_queued_request_is_served():
    import time

    from models import tiny_causal_lm
    from shardwise.serve.server import build_stack

    tok = tiny_tokenizer()
    stack = build_stack(tiny_causal_lm("llama", seed=5), tok, max_batch=1, max_tokens=32,
                        max_waiting=1, name="tiny", start=False, device="cpu",
                        replace_with_kernel_inject=True)
    try:
        with serving(build_app(stack.state)) as server:
            client = openai_client(server)
            results = {}
            queued = threading.Thread(target=lambda: results.setdefault(
                "out", client.completions.create(model="tiny", prompt="t5 t6", max_tokens=4,
                                                 temperature=0)))
            queued.start()  # the scheduler is not started: it waits in the queue
            deadline = time.monotonic() + 10
            while stack.scheduler.stats().waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            with pytest.raises(openai.RateLimitError) as excinfo:
                client.completions.create(model="tiny", prompt="t7", max_tokens=4)
            assert int(excinfo.value.response.headers["retry-after"]) >= 1
            stack.scheduler.start()
            queued.join(20)
            out = results["out"]
            assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in (
                "length", "stop")
    finally:
        stack.scheduler.stop(5.0)

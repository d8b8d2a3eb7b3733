"""The load benchmark's baseline, :class:`shardwise.serve.baseline.HFSerialBackend`: a plain HF
model served one request at a time. Checked on a tiny fixed-seed Llama: greedy streams equal
``generate``, requests never overlap and run in arrival order, seeds reproduce, cancel stops a
running request between tokens and a waiting one before it starts, the queue is bounded."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from models import prompt_ids, tiny_causal_lm
from shardwise.errors import ConfigError
from shardwise.serve.baseline import HFSerialBackend
from shardwise.serve.metrics import ServeMetrics
from shardwise.serve.types import (FinishEvent, GenRequest, QueueFullError, SamplingParams,
                                   ServerUnhealthyError, TokenEvent)

#: every wait in these tests ends within this many seconds
TIMEOUT_S = 30.0
EOS = 2  # the tiny Llama's eos id


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm("llama", seed=0)


def request(rid: str, prompt: list[int], max_tokens: int = 12, **params) -> GenRequest:
    params.setdefault("temperature", 0.0)
    return GenRequest(id=rid, prompt_ids=prompt, params=SamplingParams(max_tokens=max_tokens,
                                                                       **params))


def prompt(seed: int, length: int = 8) -> list[int]:
    # ids 3.. (0-2 are unk/bos/eos)
    return (prompt_ids(1, length, vocab=250, seed=seed)[0] + 3).tolist()


async def collect(handle) -> tuple[list[int], FinishEvent]:
    """The token ids and the finish event of one handle (bounded wait)."""
    tokens: list[int] = []

    async def run():
        async for event in handle.events():
            if isinstance(event, TokenEvent):
                tokens.append(event.token_id)
            else:
                return event

    finish = await asyncio.wait_for(run(), TIMEOUT_S)
    return tokens, finish


def reference(model, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy ``generate`` for ``ids`` alone: the new token ids (stops at eos, as served)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=EOS, pad_token_id=EOS)
    return out[0, len(ids):].tolist()


class Gate:
    """A forward pre-hook on the model (this instance only): the ``hold_at``-th forward call
    signals ``reached`` and waits for ``release``, so a test acts while a request is running."""

    def __init__(self, model, hold_at: int = 1) -> None:
        self.calls = 0
        self.hold_at = hold_at
        self.reached = threading.Event()
        self.release = threading.Event()
        self.hook = model.register_forward_pre_hook(self._pre)

    def _pre(self, module, args):
        self.calls += 1
        if self.calls == self.hold_at:
            self.reached.set()
            assert self.release.wait(TIMEOUT_S), "the test never released the gate"

    def remove(self) -> None:
        self.release.set()
        self.hook.remove()


def test_greedy_streams_equal_generate_and_requests_run_one_at_a_time(model):
    prompts = [prompt(1, 5), prompt(2, 9), prompt(3, 14)]
    active, log = [0], []
    original = model.generate

    def counting_generate(*args, **kwargs):  # instance-scoped: records overlap and order
        active[0] += 1
        log.append((kwargs["input_ids"][0].tolist(), active[0]))
        try:
            return original(*args, **kwargs)
        finally:
            active[0] -= 1

    metrics = ServeMetrics()

    async def main():
        backend = HFSerialBackend(model, None, max_tokens=64, metrics=metrics)
        loop = asyncio.get_running_loop()
        handles = [backend.submit(request(f"r{i}", p, max_tokens=12), loop)
                   for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(collect(h) for h in handles))
        backend.stop(drain_s=5.0)
        return handles, results

    model.generate = counting_generate
    try:
        handles, results = asyncio.run(main())
    finally:
        del model.generate
    assert [ids for ids, _ in log] == prompts  # arrival order
    assert max(depth for _, depth in log) == 1  # never two generate calls at once
    for p, h, (tokens, finish) in zip(prompts, handles, results):
        expected = reference(model, p, 12)
        assert tokens == expected
        assert finish.reason == ("stop" if expected[-1] == EOS else "length")
        assert h.completion_tokens == len(tokens) and h.first_token_s > 0
    value = metrics.registry.get_sample_value
    generated = sum(len(tokens) for tokens, _ in results)
    assert value("shardwise_generation_tokens_total") == generated
    assert value("shardwise_prompt_tokens_total") == sum(map(len, prompts))
    assert value("shardwise_time_to_first_token_seconds_count") == len(prompts)
    assert value("shardwise_inter_token_latency_seconds_count") == generated - len(prompts)
    finished = {r: value("shardwise_requests_finished_total", {"reason": r})
                for r in ("stop", "length")}
    assert sum(finished.values()) == len(prompts)
    assert value("shardwise_requests_running") == 0 and value("shardwise_kv_slots_capacity") == 1


def test_seeded_sampling_reproduces(model):
    async def main():
        backend = HFSerialBackend(model, None, max_tokens=64, eos_token_ids=())
        loop = asyncio.get_running_loop()
        params = dict(max_tokens=16, temperature=1.5, top_p=0.95)
        runs = [backend.submit(request(f"s{i}", prompt(4), seed=seed, **params), loop)
                for i, seed in enumerate((7, 7, 8))]
        results = await asyncio.gather(*(collect(h) for h in runs))
        backend.stop(drain_s=5.0)
        return [tokens for tokens, _ in results]

    a, b, c = asyncio.run(main())
    assert a == b and len(a) == 16
    assert a != c


def test_cancel_stops_running_request_between_tokens_and_waiting_one_before_start(model):
    gate = Gate(model, hold_at=3)  # forward 1: the prompt, 2: the second token, 3: held

    async def main():
        backend = HFSerialBackend(model, None, max_tokens=64, eos_token_ids=())
        loop = asyncio.get_running_loop()
        running = backend.submit(request("a", prompt(5), max_tokens=40), loop)
        waiting = backend.submit(request("b", prompt(6), max_tokens=40), loop)
        first = await asyncio.wait_for(running.queue.get(), TIMEOUT_S)
        assert isinstance(first, TokenEvent)
        assert await asyncio.to_thread(gate.reached.wait, TIMEOUT_S)
        running.cancel()
        waiting.cancel()
        gate.release.set()
        rest, finish_a = await collect(running)
        tokens_b, finish_b = await collect(waiting)
        backend.stop(drain_s=5.0)
        return [first.token_id] + rest, finish_a, tokens_b, finish_b

    try:
        tokens_a, finish_a, tokens_b, finish_b = asyncio.run(main())
    finally:
        gate.remove()
    assert finish_a.reason == "cancelled" and 1 <= len(tokens_a) <= 3  # not the 40 asked for
    assert finish_b.reason == "cancelled" and tokens_b == []
    assert gate.calls == 3  # the held step was the last: b never ran a forward


def test_queue_is_bounded_and_bad_requests_are_refused(model):
    gate = Gate(model, hold_at=1)

    async def main():
        backend = HFSerialBackend(model, None, max_tokens=32, max_waiting=1)
        loop = asyncio.get_running_loop()
        with pytest.raises(ConfigError, match="max_tokens"):
            backend.submit(request("long", prompt(7, 20), max_tokens=13), loop)
        running = backend.submit(request("a", prompt(7), max_tokens=4), loop)
        assert await asyncio.to_thread(gate.reached.wait, TIMEOUT_S)  # a is running
        waiting = backend.submit(request("b", prompt(8), max_tokens=4), loop)
        with pytest.raises(QueueFullError, match="waiting") as full:
            backend.submit(request("c", prompt(9), max_tokens=4), loop)
        assert full.value.retry_after_s > 0
        assert backend.stats().running == 1 and backend.stats().waiting == 1
        gate.release.set()
        results = [await collect(running), await collect(waiting)]
        backend.stop(drain_s=5.0)
        with pytest.raises(ServerUnhealthyError, match="stopping"):
            backend.submit(request("late", prompt(9), max_tokens=4), loop)
        return results

    try:
        results = asyncio.run(main())
    finally:
        gate.remove()
    assert [finish.reason for _, finish in results] == [
        "stop" if tokens[-1] == EOS else "length" for tokens, _ in results]

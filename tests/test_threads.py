"""Threads sharing one injected engine (one static KV cache): concurrent use is either a clear
``ConcurrentUseError`` or safely serialized, never wrong tokens.

Deterministic: the interleavings are forced with events (a forward hook or a streamer that
pauses one thread at a chosen point), not raced; every wait has a timeout so a bug fails
instead of hanging.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import shardwise
from shardwise.inject import ConcurrentUseError
from models import prompt_ids, tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")

WAIT = 60  # seconds; only reached when something is broken
NEW = 6
GEN = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def engine():
    return shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                    replace_with_kernel_inject=True)


@pytest.fixture(scope="module")
def expected(engine):
    """Single-threaded results the threaded runs must match: logits and greedy tokens of two
    prompts."""
    a, b = prompt_ids(seed=1), prompt_ids(seed=2)
    with torch.no_grad():
        return {"a": a, "b": b, "logits_a": engine.module(a).logits,
                "tokens_a": engine.generate(a, **GEN), "tokens_b": engine.generate(b, **GEN)}


class Pause:
    """Stops the thread that reaches it until :attr:`go` is set; :attr:`reached` says it got
    there."""

    def __init__(self) -> None:
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self) -> None:
        self.reached.set()
        assert self.go.wait(WAIT), "the test never released the paused thread"


class PauseAfterFirstToken(BaseStreamer):
    """A streamer pausing ``generate`` after its first new token (the prompt is put first):
    the sequence's cache is live and more forwards are to come."""

    def __init__(self, pause: Pause) -> None:
        self.pause, self.puts = pause, 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.pause()

    def end(self):
        pass


class Worker(threading.Thread):
    """Runs ``fn`` and keeps its result or exception."""

    def __init__(self, fn, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self) -> None:
        try:
            with torch.no_grad():
                self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            self.error = exc

    def finish(self):
        self.join(WAIT)
        assert not self.is_alive(), f"thread {self.name} did not finish"
        return self


@pytest.mark.parametrize("via_engine", [False, True], ids=["bare-forward", "engine-call"])
def test_a_forward_overlapping_another_threads_forward_is_refused(engine, expected, via_engine):
    """Thread A is stopped inside its forward (a hook on the embedding, which the injected
    stack calls); a forward of thread B then raises at once, and A's logits are untouched."""
    pause = Pause()
    embed = engine.module.get_input_embeddings()
    handle = embed.register_forward_hook(
        lambda *args: pause() if threading.current_thread().name == "A" else None)
    try:
        run = (lambda: engine(input_ids=expected["a"])) if via_engine else \
            (lambda: engine.module(expected["a"]))
        a = Worker(lambda: run().logits, "A")
        a.start()
        assert pause.reached.wait(WAIT)
        with pytest.raises(ConcurrentUseError, match="one engine per thread") as info:
            with torch.no_grad():
                engine.module(expected["b"])
        assert "'A'" in str(info.value)
        pause.go.set()
        a.finish()
    finally:
        handle.remove()
    assert a.error is None and torch.equal(a.result, expected["logits_a"])


def test_a_sequence_reclaimed_by_another_thread_stops_with_a_clear_error(engine, expected):
    """Bare HF generate in two threads: A pauses between decode steps, B runs a whole generate
    (its prompt re-claims the one static cache, with B's correct tokens); A's next step then
    raises naming both threads instead of decoding from B's keys."""
    pause = Pause()
    a = Worker(lambda: engine.module.generate(
        expected["a"], streamer=PauseAfterFirstToken(pause), **GEN), "A")
    a.start()
    assert pause.reached.wait(WAIT)
    with torch.no_grad():
        tokens_b = engine.module.generate(expected["b"], **GEN)
    assert torch.equal(tokens_b, expected["tokens_b"])
    pause.go.set()
    a.finish()
    assert isinstance(a.error, ConcurrentUseError), a.error
    message = str(a.error)
    assert "'A'" in message and "MainThread" in message and "lock around each generate" in message


def test_a_bare_forward_during_engine_generate_is_refused(engine, expected):
    """engine.generate holds the model for the whole generate: another thread's bare forward
    between its steps raises, and the generate finishes with the right tokens."""
    pause = Pause()
    a = Worker(lambda: engine.generate(expected["a"], streamer=PauseAfterFirstToken(pause),
                                       **GEN), "A")
    a.start()
    assert pause.reached.wait(WAIT)
    with pytest.raises(ConcurrentUseError, match="'A' is generating"):
        with torch.no_grad():
            engine.module.generate(expected["b"], **GEN)
    pause.go.set()
    a.finish()
    assert a.error is None and torch.equal(a.result, expected["tokens_a"])


def announce_waiting(guard, monkeypatch, thread: str) -> threading.Event:
    """Wrap ``guard``'s session lock so the returned event is set when ``thread`` starts
    waiting on it."""
    waiting = threading.Event()
    real_lock = guard.session_lock

    class Announcing:
        def __enter__(self):
            if threading.current_thread().name == thread:
                waiting.set()
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

    monkeypatch.setattr(guard, "session_lock", Announcing())
    return waiting


def test_engine_generate_from_two_threads_is_serialized(engine, expected, monkeypatch):
    """Two threads calling engine.generate: B waits for A's whole generate (A is paused
    mid-generate while B is at the session lock), then both have their single-threaded
    tokens."""
    pause = Pause()
    b_waiting = announce_waiting(engine._stack._guard, monkeypatch, "B")
    a = Worker(lambda: engine.generate(expected["a"], streamer=PauseAfterFirstToken(pause),
                                       **GEN), "A")
    a.start()
    assert pause.reached.wait(WAIT)
    b = Worker(lambda: engine.generate(expected["b"], **GEN), "B")
    b.start()
    assert b_waiting.wait(WAIT)
    b.join(0.3)  # A holds the session: B must still be waiting for it, not running or failed
    assert b.is_alive() and b.result is None and b.error is None
    pause.go.set()
    a.finish(), b.finish()
    assert a.error is None and b.error is None, (a.error, b.error)
    assert torch.equal(a.result, expected["tokens_a"])
    assert torch.equal(b.result, expected["tokens_b"])


def test_close_waits_for_another_threads_generate(monkeypatch):
    """engine.close() in thread B while thread A is mid-generate: B waits for A's whole
    generate (A keeps its single-threaded tokens), then gives the model back; calls after
    that are refused by name."""
    from shardwise.engine import EngineClosedError

    model = tiny_causal_lm("llama")
    engine = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)
    a_ids = prompt_ids(seed=1)
    expected = engine.generate(a_ids, **GEN)
    pause = Pause()
    b_waiting = announce_waiting(engine._stack._guard, monkeypatch, "B")
    a = Worker(lambda: engine.generate(a_ids, streamer=PauseAfterFirstToken(pause), **GEN), "A")
    a.start()
    assert pause.reached.wait(WAIT)
    b = Worker(engine.close, "B")
    b.start()
    assert b_waiting.wait(WAIT)
    b.join(0.3)  # A holds the session: the close must still be waiting
    assert b.is_alive() and b.result is None and b.error is None
    assert type(model.model).__name__ == "InjectedModel"
    pause.go.set()
    a.finish(), b.finish()
    assert a.error is None and b.error is None, (a.error, b.error)
    assert torch.equal(a.result, expected)
    assert b.result is model and type(model.model).__name__ == "LlamaModel"
    with pytest.raises(EngineClosedError):
        engine.generate(a_ids, **GEN)


def test_close_during_another_threads_bare_forward_is_refused_and_changes_nothing():
    """Thread A is inside a bare forward (engine.module, no session): close() from another
    thread raises ConcurrentUseError at once and leaves the engine open and injected; once A
    is done, close works."""
    model = tiny_causal_lm("llama")
    engine = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)
    pause = Pause()
    handle = model.get_input_embeddings().register_forward_hook(
        lambda *args: pause() if threading.current_thread().name == "A" else None)
    a = Worker(lambda: engine.module(prompt_ids()).logits, "A")
    a.start()
    try:
        assert pause.reached.wait(WAIT)
        with pytest.raises(ConcurrentUseError, match="'A'"):
            engine.close()
        assert type(model.model).__name__ == "InjectedModel"
    finally:
        pause.go.set()
        a.finish()
        handle.remove()
    assert a.error is None
    engine.generate(prompt_ids(), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert engine.close() is model and type(model.model).__name__ == "LlamaModel"

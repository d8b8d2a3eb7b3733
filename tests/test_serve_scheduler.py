"""The continuous-batching scheduler (``shardwise.serve.scheduler``) and the server's Prometheus
metrics (``shardwise.serve.metrics``).

Most tests drive the scheduler against :class:`FakeRunner`, whose next-token logits are a
deterministic function of the token history held in each slot: a sequence's greedy output equals
what it gives alone only if every chunk and step went to the right slot. The runner records its
calls, so the tests can check when sequences join and leave, how prompts are chunked, and which
slot each one takes. Scheduling tests drive the loop one iteration at a time (``step()``); fault,
stop and heartbeat tests run its thread.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from shardwise.errors import CollectiveError
from shardwise.serve.metrics import ServeMetrics
from shardwise.serve.scheduler import Scheduler
from shardwise.serve.types import (FinishEvent, GenRequest, QueueFullError, SamplingParams,
                                   ServerUnhealthyError, TokenEvent)

VOCAB = 32
#: every wait on the scheduler's thread is bounded by this (on a loaded 2-core CPU a tiny
#: model's eager step took up to ~0.6 s: 10 s timed the 8-sequence test out)
WAIT_S = 30.0


def next_token(history: list[int]) -> int:
    """The fake model: the next token depends on every token before it and on its position."""
    return (sum((i + 1) * t for i, t in enumerate(history)) * 7 + len(history) * 3) % VOCAB


def alone(prompt: list[int], n: int) -> list[int]:
    """What greedy decoding of ``prompt`` alone gives for ``n`` tokens."""
    history, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(history))
        history.append(out[-1])
    return out


def one_hot(token: int) -> torch.Tensor:
    logits = torch.zeros(VOCAB)
    logits[token] = 10.0
    return logits


class FakeRunner:
    """A :class:`~shardwise.serve.types.Runner` over per-slot token histories; ``calls`` records
    ``("prefill", slot, n_tokens, last)``, ``("decode", slots)``, ``("release", slot)``,
    ``("heartbeat",)`` and ``("close",)``; ``fail_on`` makes one kind of call raise."""

    def __init__(self, max_batch: int = 4, max_tokens: int = 64, decode_s: float = 0.0,
                 fail_on: str | None = None, fail_after: int = 0) -> None:
        self.max_batch, self.max_tokens, self.vocab_size = max_batch, max_tokens, VOCAB
        self.slots: list[list[int]] = [[] for _ in range(max_batch)]
        self.calls: list[tuple] = []
        self.decode_s = decode_s               # simulated compute time of one decode step
        self.fail_on, self.fail_after = fail_on, fail_after
        self.heartbeats = threading.Semaphore(0)
        self.closed = threading.Event()
        self.thread_ids: set[int] = set()

    def _record(self, *call) -> None:
        self.thread_ids.add(threading.get_ident())
        self.calls.append(call)
        if call[0] == self.fail_on:
            if sum(c[0] == self.fail_on for c in self.calls) > self.fail_after:
                raise CollectiveError("rank 1 did not answer within 5 s (it died?)")

    def prefill(self, slot, token_ids, last):
        self._record("prefill", slot, len(token_ids), last)
        assert len(token_ids) >= 1
        self.slots[slot].extend(token_ids)
        assert len(self.slots[slot]) <= self.max_tokens
        return one_hot(next_token(self.slots[slot])) if last else None

    def decode(self, slots, token_ids):
        self._record("decode", tuple(slots))
        assert len(set(slots)) == len(slots)
        if self.decode_s:
            time.sleep(self.decode_s)
        rows = []
        for slot, token in zip(slots, token_ids):
            assert self.slots[slot], f"decode into empty slot {slot}"
            self.slots[slot].append(token)
            assert len(self.slots[slot]) <= self.max_tokens
            rows.append(one_hot(next_token(self.slots[slot])))
        return torch.stack(rows)

    def release(self, slot):
        self._record("release", slot)
        self.slots[slot] = []

    def length(self, slot):
        return len(self.slots[slot])

    def heartbeat(self):
        self._record("heartbeat")
        self.heartbeats.release()

    def close(self):
        self._record("close")
        self.closed.set()

    def prefills(self, slot=None):
        return [c for c in self.calls if c[0] == "prefill" and (slot is None or c[1] == slot)]


class Greedy:
    """A stand-in for ``shardwise.serve.sampling.Sampler`` (the scheduling tests' samplers):
    argmax, or with ``explode`` a sampler that raises on every call."""

    def __init__(self, params, index, vocab_size, explode=False):
        assert vocab_size == VOCAB
        self.explode = explode

    def sample(self, logits):
        assert logits.shape == (VOCAB,) and logits.dtype == torch.float32
        if self.explode:
            raise RuntimeError("sampler blew up")
        return TokenEvent(int(logits.argmax()))


def greedy(params, index, vocab_size):
    return Greedy(params, index, vocab_size)


def request(rid: str, prompt: list[int], max_tokens: int) -> GenRequest:
    return GenRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0))


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 5 + 3 * i) % VOCAB for i in range(n)]


def drain(handle) -> list:
    """Events already delivered to a handle submitted with ``loop=None`` (step() driving)."""
    events = []
    while not handle.queue.empty():
        events.append(handle.queue.get_nowait())
    return events


def tokens(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def finish(events) -> FinishEvent:
    assert isinstance(events[-1], FinishEvent), events
    return events[-1]


def run_steps(scheduler, limit: int = 500) -> int:
    for n in range(1, limit + 1):
        if not scheduler.step():
            return n
    raise AssertionError(f"still busy after {limit} steps")


async def collect(handle) -> list:
    async def all_events():
        return [e async for e in handle.events()]
    return await asyncio.wait_for(all_events(), WAIT_S)


def run_threaded(scheduler, requests):
    """Submit ``requests`` to a started scheduler from an event loop; every handle's events."""
    async def main():
        loop = asyncio.get_running_loop()
        handles = [scheduler.submit(r, loop) for r in requests]
        return await asyncio.gather(*(collect(h) for h in handles))
    return asyncio.run(main())


# ---- scheduling ---------------------------------------------------------------------------------

def test_concurrent_sequences_each_equal_their_output_alone():
    runner = FakeRunner(max_batch=3)
    sched = Scheduler(runner, sampler_factory=greedy, prefill_budget=7)
    shapes = [(5, 9), (12, 4), (1, 7), (20, 11), (3, 1), (9, 14), (16, 6)]  # (prompt, max_tokens)
    reqs = [request(f"r{i}", prompt(p, i), m) for i, (p, m) in enumerate(shapes)]
    handles = [sched.submit(r, None) for r in reqs]
    run_steps(sched)
    for req, handle in zip(reqs, handles):
        events = drain(handle)
        assert tokens(events) == alone(req.prompt_ids, req.params.max_tokens), req.id
        assert finish(events).reason == "length"
        assert handle.completion_tokens == req.params.max_tokens
        assert handle.first_token_s is not None and handle.first_token_s >= 0
    assert all(len(s) == 0 for s in runner.slots)           # every slot released
    assert sched.stats().slots_in_use == 0 and sched.stats().running == 0
    assert max(len(c[1]) for c in runner.calls if c[0] == "decode") == 3


def test_a_finished_sequence_frees_its_slot_for_a_waiting_one_at_the_next_step():
    runner = FakeRunner(max_batch=2)
    sched = Scheduler(runner, sampler_factory=greedy)
    short = sched.submit(request("short", prompt(4, 1), 2), None)
    long = sched.submit(request("long", prompt(4, 2), 6), None)
    queued = sched.submit(request("queued", prompt(3, 3), 3), None)

    # step 1: short and long prefill into slots 0 and 1 (first token each), one decode step:
    # short has its 2 tokens and leaves; queued still waits (no slot was free at admission)
    sched.step()
    assert finish(drain(short)).reason == "length"
    assert runner.calls[-1] == ("release", 0)
    assert sched.stats().waiting == 1 and sched.stats().running == 1
    assert runner.prefills(slot=0) == [("prefill", 0, 4, True)]

    # step 2: queued joins in slot 0 while long keeps decoding in slot 1
    mark = len(runner.calls)
    sched.step()
    assert runner.calls[mark] == ("prefill", 0, 3, True)
    assert ("decode", (0, 1)) in runner.calls[mark:]
    assert sched.stats().waiting == 0
    run_steps(sched)
    assert tokens(drain(long)) == alone(prompt(4, 2), 6)
    assert tokens(drain(queued)) == alone(prompt(3, 3), 3)


def test_long_prompt_is_prefilled_in_chunks_while_the_others_decode():
    runner = FakeRunner(max_batch=2)
    sched = Scheduler(runner, sampler_factory=greedy, prefill_budget=4)
    running = sched.submit(request("running", prompt(2, 1), 12), None)
    long = sched.submit(request("long", prompt(11, 2), 3), None)
    run_steps(sched)

    # step 1 spends 2 of the budget on running's prompt and the other 2 on long's first chunk;
    # then 4, and the final 1 (3 chunks over 3 steps)
    assert [c[2:] for c in runner.prefills(slot=1)] == [(2, False), (4, False), (4, False), (1, True)]
    chunks = [i for i, c in enumerate(runner.calls) if c[0] == "prefill" and c[1] == 1]
    for before, after in zip(chunks, chunks[1:]):
        assert ("decode", (0,)) in runner.calls[before:after], "running stalled during a prefill"
    per_step = [c for c in runner.calls if c[0] == "prefill"]
    assert all(c[2] <= 4 for c in per_step)
    assert tokens(drain(running)) == alone(prompt(2, 1), 12)
    assert tokens(drain(long)) == alone(prompt(11, 2), 3)


class TimedRunner(FakeRunner):
    """FakeRunner whose prefill takes ``token_s`` per prompt token and a decode step
    ``decode_s`` (real sleeps: the scheduler measures both)."""

    def __init__(self, token_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.token_s = token_s

    def prefill(self, slot, token_ids, last):
        time.sleep(self.token_s * len(token_ids))
        return super().prefill(slot, token_ids, last)


def test_prefill_chunks_shrink_to_a_fraction_of_a_decode_step_while_streams_decode():
    # 2 ms a prompt token, 40 ms a step, stall 0.75: while a stream decodes, a chunk is about
    # 0.75 * 40 / 2 = 15 tokens (sleeps only overrun: 8..20); with nothing decoding, the
    # whole budget (a first prompt in one chunk: time to first token first)
    runner = TimedRunner(token_s=0.002, max_batch=2, max_tokens=128, decode_s=0.04)
    sched = Scheduler(runner, sampler_factory=greedy, prefill_budget=64, prefill_stall=0.75)
    first = sched.submit(request("first", prompt(40, 1), 30), None)
    sched.step()
    assert runner.prefills(slot=0) == [("prefill", 0, 40, True)]
    joining = sched.submit(request("joining", prompt(90, 2), 2), None)
    run_steps(sched)
    chunks = [c[2] for c in runner.prefills(slot=1)]
    assert sum(chunks) == 90 and len(chunks) > 2, chunks
    assert all(8 <= n <= 20 for n in chunks[:-1]), chunks
    assert tokens(drain(first)) == alone(prompt(40, 1), 30)
    assert tokens(drain(joining)) == alone(prompt(90, 2), 2)


class OverheadRunner(TimedRunner):
    """TimedRunner whose every prefill call also costs ``call_s`` (a forward's fixed cost)."""

    def __init__(self, call_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.call_s = call_s

    def prefill(self, slot, token_ids, last):
        time.sleep(self.call_s)
        return super().prefill(slot, token_ids, last)


def test_prefill_chunks_are_worth_their_call_overhead():
    # 30 ms a call + 1 ms a token, 40 ms a step, stall 0.75: the allowance (30 ms) holds no
    # token beyond the overhead, so the old rule gave 8-token chunks (11 calls for 90 tokens,
    # 79 % of the time overhead); a chunk now takes the overhead's worth, ~30 tokens
    runner = OverheadRunner(call_s=0.03, token_s=0.001, max_batch=2, max_tokens=160,
                            decode_s=0.04)
    sched = Scheduler(runner, sampler_factory=greedy, prefill_budget=64, prefill_stall=0.75)
    first = sched.submit(request("first", prompt(40, 1), 40), None)
    sched.step()
    joining = sched.submit(request("joining", prompt(90, 2), 2), None)
    run_steps(sched)
    chunks = [c[2] for c in runner.prefills(slot=1)]
    assert sum(chunks) == 90 and len(chunks) <= 5, chunks
    assert all(n >= 16 for n in chunks[1:-1]), chunks
    assert tokens(drain(first)) == alone(prompt(40, 1), 40)
    assert tokens(drain(joining)) == alone(prompt(90, 2), 2)


@pytest.mark.parametrize("budget,allowance_s,overhead_s,token_s", [
    (512, 0.030, 0.002, 0.001),     # small overhead: the allowance holds
    (512, 0.030, 0.030, 0.001),     # overhead = the allowance: two overheads
    (512, 0.030, 0.0, 0.0005),      # no overhead
    (512, 0.004, 0.001, 0.001),     # nothing fits: the smallest chunk
    (16, 0.300, 0.001, 0.001),      # the budget caps it
    (512, 0.020, 0.050, 0.0001),    # overhead well above the allowance (a host-bound GPU)
])
def test_prefill_chunk_rule_bounds_the_stall(budget, allowance_s, overhead_s, token_s):
    from shardwise.serve.scheduler import MIN_PREFILL_CHUNK, prefill_chunk_tokens

    def cost(n):
        return overhead_s + token_s * n

    n = prefill_chunk_tokens(budget, allowance_s, overhead_s, token_s)
    assert min(budget, MIN_PREFILL_CHUNK) <= n <= budget
    bound = min(cost(budget), max(allowance_s, 2 * overhead_s, cost(MIN_PREFILL_CHUNK)))
    assert cost(n) <= bound + 1e-12, (n, cost(n), bound)
    if 2 * overhead_s <= allowance_s and cost(MIN_PREFILL_CHUNK) <= allowance_s:
        assert cost(n) <= allowance_s + 1e-12  # the allowance itself holds
    if n < budget:  # and the chunk is the largest the bound allows, not merely small
        assert cost(n + 1) > bound - 1e-12


@pytest.mark.parametrize("budget,allowance_s,overhead_s,token_s", [
    (512, 0.041, 0.035, 0.00095),   # the 2-core CPU's default model: overhead ~0.85 allowance
    (512, 0.030, 0.002, 0.001),
    (512, 0.004, 0.001, 0.001),     # nothing fits: the smallest chunk
    (16, 0.300, 0.001, 0.001),      # the budget caps it
])
def test_without_the_overhead_floor_the_allowance_bounds_the_stall(budget, allowance_s,
                                                                   overhead_s, token_s):
    from shardwise.serve.scheduler import MIN_PREFILL_CHUNK, prefill_chunk_tokens

    def cost(n):
        return overhead_s + token_s * n

    n = prefill_chunk_tokens(budget, allowance_s, overhead_s, token_s, worth=False)
    assert min(budget, MIN_PREFILL_CHUNK) <= n <= budget
    bound = min(cost(budget), max(allowance_s, cost(MIN_PREFILL_CHUNK)))
    assert cost(n) <= bound + 1e-12, (n, cost(n), bound)
    if n < budget:
        assert cost(n + 1) > bound - 1e-12
    with_floor = prefill_chunk_tokens(budget, allowance_s, overhead_s, token_s)
    assert with_floor >= n
    if 2 * overhead_s > allowance_s and budget > n:  # where the floor acts, it is larger
        assert cost(with_floor) > allowance_s


class Clock:
    """A virtual clock for the scheduler module (its ``time``): runner calls advance it."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def now(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds


class ClockRunner(FakeRunner):
    """FakeRunner whose prefill call costs ``overhead_s + token_s × tokens`` and whose decode
    step ``step_s`` on a virtual :class:`Clock` (exact: the scheduler's fit is exact)."""

    def __init__(self, clock: Clock, overhead_s: float, token_s: float, step_s: float,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.clock, self.overhead_s, self.token_s, self.step_s = clock, overhead_s, token_s, step_s

    def prefill(self, slot, token_ids, last):
        self.clock.sleep(self.overhead_s + self.token_s * len(token_ids))
        return super().prefill(slot, token_ids, last)

    def decode(self, slots, token_ids):
        self.clock.sleep(self.step_s)
        return super().decode(slots, token_ids)

    def stalls(self) -> list[float]:
        """The prefill time of each iteration while streams decode (calls between two steps)."""
        out, current, decoding = [], 0.0, False
        for call in self.calls:
            if call[0] == "decode":
                if decoding and current:
                    out.append(current)
                current, decoding = 0.0, True
            elif call[0] == "prefill":
                current += self.overhead_s + self.token_s * call[2]
        return out


@pytest.mark.parametrize("overhead_s,bound_s,shared", [(0.002, 0.030, True),
                                                      (0.025, 0.050, False)])
def test_an_iteration_prefilling_several_prompts_keeps_the_stall_bound(monkeypatch, overhead_s,
                                                                       bound_s, shared):
    # step 40 ms, stall 0.75: allowance 30 ms. Three prompts join at once, so one iteration
    # prefills the end of one prompt and the start of the next: each further call pays its
    # overhead out of the budget, and the iteration's prefill stays within the stated bound
    # (the allowance; two overheads where those are more, and then a chunk of the overhead's
    # worth leaves no budget for a second call)
    import shardwise.serve.scheduler as scheduler_module

    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", type("T", (), {
        "perf_counter": staticmethod(clock.now), "monotonic": staticmethod(clock.now)}))
    runner = ClockRunner(clock, overhead_s, 0.001, 0.04, max_batch=5, max_tokens=200)
    sched = Scheduler(runner, sampler_factory=greedy, prefill_budget=512, prefill_stall=0.75)
    first = [sched.submit(request(f"s{i}", prompt(n, i), 60), None)
             for i, n in enumerate((40, 24))]  # prefilled while nothing decodes: two sizes
    sched.step()
    joining = [sched.submit(request(f"j{i}", prompt(n, 5 + i), 3), None)
               for i, n in enumerate((45, 50, 35))]
    run_steps(sched)
    stalls = runner.stalls()
    assert stalls and max(stalls) <= bound_s + 1e-9, stalls
    calls_per_iteration = []
    for call in runner.calls:
        if call[0] == "decode":
            calls_per_iteration.append(0)
        elif call[0] == "prefill" and calls_per_iteration:
            calls_per_iteration[-1] += 1
    assert (max(calls_per_iteration) >= 2) == shared  # an iteration prefilled two prompts
    for handle, (i, n) in zip(first, enumerate((40, 24))):
        assert tokens(drain(handle)) == alone(prompt(n, i), 60)
    for handle, (i, n) in zip(joining, enumerate((45, 50, 35))):
        assert tokens(drain(handle)) == alone(prompt(n, 5 + i), 3)


def test_the_prefill_cost_fit_is_not_pulled_by_a_few_slowed_calls():
    # 20 ms a call + 0.5 ms a token, exact but for the 3 calls of 8 tokens, slowed by 30 ms
    # (the HTTP side holding the GIL as requests arrive): least squares read 35 ms + 0.19 ms a
    # token from these, so "the overhead's worth" became 187 tokens (a 128-token prompt in
    # one call while the streams wait); the fit ignores the outliers
    from shardwise.serve.scheduler import _linear_fit, prefill_chunk_tokens

    sizes = [8, 16, 24, 32, 40, 48, 56, 64] * 3
    calls = [(n, 0.020 + 0.0005 * n + (0.030 if i < 3 else 0.0))
             for i, n in enumerate(sorted(sizes))]
    overhead_s, token_s = _linear_fit(calls)
    assert overhead_s == pytest.approx(0.020, rel=1e-6)
    assert token_s == pytest.approx(0.0005, rel=1e-6)
    chunk = prefill_chunk_tokens(512, 0.040, overhead_s, token_s)
    assert 0.020 + 0.0005 * chunk <= 0.040 + 1e-9
    # one size only: no overhead known, the per-token time pessimistic
    assert _linear_fit([(16, 0.032), (16, 0.030)]) == (0.0, pytest.approx(0.031 / 16))


class SpanClockRunner(ClockRunner):
    """ClockRunner whose decode step costs ``base_s + row_s`` per row of its span (the
    highest slot + 1), as a batch bucket's step grows with its rows."""

    def __init__(self, clock: Clock, base_s: float, row_s: float, **kwargs) -> None:
        super().__init__(clock, step_s=0.0, **kwargs)
        self.base_s, self.row_s = base_s, row_s

    def decode(self, slots, token_ids):
        self.clock.sleep(self.base_s + self.row_s * (max(slots) + 1))
        return super().decode(slots, token_ids)

    def step_gaps(self) -> list[float]:
        """Seconds from the end of each decode step to the end of the next: a decoding
        stream's gap between two tokens (the prefill between them plus the step)."""
        gaps, current, started = [], 0.0, False
        for call in self.calls:
            if call[0] == "prefill":
                current += self.overhead_s + self.token_s * call[2]
            elif call[0] == "decode":
                current += self.base_s + self.row_s * (max(call[1]) + 1)
                if started:
                    gaps.append(current)
                current, started = 0.0, True
        return gaps


def test_a_smaller_step_lends_its_saving_to_the_prefill_and_gaps_stay_bounded(monkeypatch):
    # a step costs 10 ms + 5 ms a row of its span; prefill 10 ms a call + 1 ms a token; stall
    # 0.5. Six streams decode over slots 0-5 (55 ms steps, typical), then slots 1-5 free and
    # two prompts join: a step over 1 row (15 ms) leaves the prefill its 40 ms saving on top
    # of 0.5 × typical — bigger chunks than a full step allows — and every gap of a stream
    # (prefill + step) stays within (1 + 0.5) × the typical step
    import shardwise.serve.scheduler as scheduler_module

    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", type("T", (), {
        "perf_counter": staticmethod(clock.now), "monotonic": staticmethod(clock.now)}))
    runner = SpanClockRunner(clock, 0.010, 0.005, overhead_s=0.010, token_s=0.001,
                             max_batch=6, max_tokens=256)
    sched = Scheduler(runner, sampler_factory=greedy, prefill_budget=512, prefill_stall=0.5)
    long = sched.submit(request("long", prompt(8, 0), 120), None)
    short = [sched.submit(request(f"s{i}", prompt(4 + i, i + 1), 12), None) for i in range(5)]
    for _ in range(14):  # everything prefilled, then 12 full steps: the short ones end
        sched.step()
    joined_at = len(runner.calls)
    joining = [sched.submit(request(f"j{i}", prompt(n, 10 + i), 2), None)
               for i, n in enumerate((120, 100))]
    run_steps(sched)
    chunks = [c[2] for c in runner.calls[joined_at:] if c[0] == "prefill"]
    assert sum(chunks) == 220
    assert max(chunks) > (0.5 * 0.055 - 0.010) / 0.001, chunks  # more than a full step allows
    gaps = runner.step_gaps()
    assert len(gaps) > 100 and max(gaps) <= 1.5 * 0.055 + 1e-9, max(gaps)
    assert tokens(drain(long)) == alone(prompt(8, 0), 120)
    for i, handle in enumerate(short):
        assert tokens(drain(handle)) == alone(prompt(4 + i, i + 1), 12)
    for handle, (i, n) in zip(joining, enumerate((120, 100))):
        assert tokens(drain(handle)) == alone(prompt(n, 10 + i), 2)


@pytest.mark.parametrize("worth", [True, False])
def test_prefill_worth_false_keeps_every_stall_within_the_allowance(monkeypatch, worth):
    # step 40 ms, stall 0.75 (30 ms), a call 25 ms + 1 ms a token: with the overhead's-worth
    # floor a chunk is ~25 tokens (~50 ms stalls); without it, 8 tokens (33 ms: the smallest
    # chunk) — more calls for the same prompt
    import shardwise.serve.scheduler as scheduler_module

    clock = Clock()
    monkeypatch.setattr(scheduler_module, "time", type("T", (), {
        "perf_counter": staticmethod(clock.now), "monotonic": staticmethod(clock.now)}))
    runner = ClockRunner(clock, 0.025, 0.001, 0.04, max_batch=2, max_tokens=200)
    sched = Scheduler(runner, sampler_factory=greedy, prefill_budget=512, prefill_stall=0.75,
                      prefill_worth=worth)
    first = [sched.submit(request("s0", prompt(40, 0), 60), None)]
    sched.step()
    sched.submit(request("warm", prompt(24, 1), 1), None)  # a second call size for the fit
    for _ in range(3):
        sched.step()
    joined_at, stalled = len(runner.calls), len(runner.stalls())  # the fit has two sizes now
    joining = sched.submit(request("j", prompt(100, 2), 2), None)
    run_steps(sched)
    chunks = [c[2] for c in runner.calls[joined_at:] if c[0] == "prefill"]
    stalls = runner.stalls()[stalled:]
    if worth:
        assert min(chunks[:-1]) >= 20 and max(stalls) > 0.045, (chunks, stalls)
    else:
        assert max(chunks) <= 8 and max(stalls) <= 0.033 + 1e-9, (chunks, stalls)
    assert tokens(drain(first[0])) == alone(prompt(40, 0), 60)
    assert tokens(drain(joining)) == alone(prompt(100, 2), 2)


def test_lowest_free_slot_is_taken_first():
    runner = FakeRunner(max_batch=4)
    sched = Scheduler(runner, sampler_factory=greedy)
    for i, n in enumerate([8, 2, 8]):           # slots 0, 1, 2; slot 1 finishes first
        sched.submit(request(f"r{i}", prompt(3, i), n), None)
    sched.step()
    sched.step()
    assert ("release", 1) in runner.calls and runner.slots[3] == []
    sched.submit(request("late", prompt(3, 9), 2), None)
    sched.step()
    assert runner.prefills()[-1][:2] == ("prefill", 1)   # slot 1, not the never-used slot 3
    run_steps(sched)


def test_cancel_frees_the_slot_at_the_next_step():
    runner = FakeRunner(max_batch=1)
    sched = Scheduler(runner, sampler_factory=greedy)
    victim = sched.submit(request("victim", prompt(3, 1), 40), None)
    queued_cancelled = sched.submit(request("gone", prompt(3, 2), 4), None)
    next_one = sched.submit(request("next", prompt(3, 3), 4), None)
    sched.step()
    victim.cancel()
    queued_cancelled.cancel()
    mark = len(runner.calls)
    sched.step()
    assert runner.calls[mark] == ("release", 0)
    assert runner.calls[mark + 1] == ("prefill", 0, 3, True)   # "next" took the freed slot
    victim_events = drain(victim)
    assert finish(victim_events).reason == "cancelled"
    assert tokens(victim_events) == alone(prompt(3, 1), 40)[:2]
    assert drain(queued_cancelled) == [FinishEvent("cancelled")]
    run_steps(sched)
    assert tokens(drain(next_one)) == alone(prompt(3, 3), 4)
    assert not any(c[0] == "prefill" and c[2] == 3 and c[1] != 0 for c in runner.calls)


def test_a_sampler_raising_ends_only_its_sequence():
    runner = FakeRunner(max_batch=3)
    bad_prompt = prompt(4, 7)

    def factory(params, index, vocab_size):
        return Greedy(params, index, vocab_size, explode=params.max_tokens == 13)

    sched = Scheduler(runner, sampler_factory=factory)
    good = [sched.submit(request(f"g{i}", prompt(5, i), 6), None) for i in range(2)]
    bad = sched.submit(request("bad", bad_prompt, 13), None)
    run_steps(sched)
    bad_events = drain(bad)
    assert bad_events[0].reason == "error" and "sampler blew up" in str(bad_events[0].error)
    for i, handle in enumerate(good):
        assert tokens(drain(handle)) == alone(prompt(5, i), 6)
    assert ("release", 2) in runner.calls and sched.healthy()


def test_eos_token_finishes_with_stop_and_is_delivered():
    ref = alone(prompt(6, 4), 10)
    eos = ref[3]
    cut = ref.index(eos) + 1
    runner = FakeRunner()
    sched = Scheduler(runner, sampler_factory=greedy, eos_token_ids=[eos])
    handle = sched.submit(request("r", prompt(6, 4), 10), None)
    run_steps(sched)
    events = drain(handle)
    assert tokens(events) == ref[:cut] and finish(events).reason == "stop"


def test_the_default_sampler_is_the_serve_sampler_seeded_per_sequence():
    runner = FakeRunner(max_batch=4)
    sched = Scheduler(runner)                       # shardwise.serve.sampling.Sampler
    greedy_req = request("greedy", prompt(5, 1), 8)
    seeded = [GenRequest(f"s{i}", prompt(5, 2), SamplingParams(max_tokens=8, temperature=2.0,
                                                               seed=11, logprobs=1))
              for i in range(2)]
    handles = [sched.submit(r, None) for r in (greedy_req, *seeded)]
    run_steps(sched)
    greedy_events, *seeded_events = [drain(h) for h in handles]
    assert tokens(greedy_events) == alone(prompt(5, 1), 8)
    assert tokens(seeded_events[0]) == tokens(seeded_events[1])   # same seed, same index
    assert all(e.logprob is not None for e in seeded_events[0][:-1])


# ---- admission ----------------------------------------------------------------------------------

def test_queue_full_is_refused_with_a_retry_estimate():
    sched = Scheduler(FakeRunner(max_batch=1), sampler_factory=greedy, max_waiting=2)
    for i in range(2):
        sched.submit(request(f"r{i}", prompt(3, i), 4), None)
    with pytest.raises(QueueFullError, match="max_waiting=2") as info:
        sched.submit(request("one-too-many", prompt(3, 9), 4), None)
    assert info.value.retry_after_s >= 1.0
    assert sched.stats().waiting == 2
    sched.step()                                     # one admitted: room in the queue again
    sched.submit(request("now-fits", prompt(3, 9), 4), None)


def test_requests_that_cannot_fit_are_refused_before_any_work():
    runner = FakeRunner(max_tokens=16)
    sched = Scheduler(runner, sampler_factory=greedy)
    with pytest.raises(ValueError, match=r"\(10 tokens\) \+ max_tokens \(7\) = 17 .* 16 tokens"):
        sched.submit(request("long", prompt(10, 1), 7), None)
    with pytest.raises(ValueError, match="prompt is empty"):
        sched.submit(request("empty", [], 4), None)
    with pytest.raises(ValueError, match="max_tokens must be"):
        sched.submit(request("zero", prompt(3, 1), 0), None)
    with pytest.raises(ValueError, match=r"token id 32 is outside the vocabulary \[0, 32\)"):
        sched.submit(request("oov", [1, VOCAB], 4), None)
    sched.submit(request("fits", prompt(10, 1), 6), None)   # exactly 16
    assert runner.calls == [] and sched.stats().waiting == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="prefill_budget"):
        Scheduler(FakeRunner(), prefill_budget=0)
    with pytest.raises(ValueError, match="max_waiting"):
        Scheduler(FakeRunner(), max_waiting=1.5)
    with pytest.raises(ValueError, match="heartbeat_s"):
        Scheduler(FakeRunner(), heartbeat_s=0)


# ---- the thread: faults, stop, heartbeat ----------------------------------------------------------

def test_runs_on_its_own_thread_and_matches_each_alone():
    runner = FakeRunner(max_batch=4)
    sched = Scheduler(runner, sampler_factory=greedy, prefill_budget=8).start()
    reqs = [request(f"r{i}", prompt(3 + 2 * i, i), 4 + i) for i in range(8)]
    results = run_threaded(sched, reqs)
    for req, events in zip(reqs, results):
        assert tokens(events) == alone(req.prompt_ids, req.params.max_tokens)
    sched.stop(drain_s=1.0)
    assert runner.closed.is_set()
    assert runner.thread_ids.isdisjoint({threading.get_ident()})   # never the caller's thread
    assert len(runner.thread_ids) == 1


def test_a_step_wakes_the_event_loop_once_not_once_per_token():
    """Events reach the HTTP side's loop batched: at most two wake-ups per step (the prefill's
    first tokens, then the decode step's tokens and ends), however many streams run; every
    stream still gets its own tokens in order."""
    runner = FakeRunner(max_batch=4, decode_s=0.005)
    sched = Scheduler(runner, sampler_factory=greedy, prefill_budget=64).start()
    reqs = [request(f"r{i}", prompt(3 + i, i), 12) for i in range(4)]
    wakeups = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):  # this loop only (instance attribute)
            wakeups.append(threading.get_ident())
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted
        handles = [sched.submit(r, loop) for r in reqs]
        return await asyncio.gather(*(collect(h) for h in handles))

    results = asyncio.run(main())
    sched.stop(drain_s=1.0)
    for req, events in zip(reqs, results):
        assert tokens(events) == alone(req.prompt_ids, 12) and finish(events).reason == "length"
    steps = sum(c[0] == "decode" for c in runner.calls) + 1   # + the step of the first prefills
    events = sum(len(e) for e in results)                     # 4 x (12 tokens + the end)
    assert events == 52 and len(wakeups) <= 2 * steps < events, (len(wakeups), steps)


@pytest.mark.parametrize("fail_on", ["decode", "prefill"])
def test_a_runner_failure_makes_the_scheduler_unhealthy_and_ends_every_sequence(fail_on):
    runner = FakeRunner(max_batch=2, fail_on=fail_on, fail_after=2)
    sched = Scheduler(runner, sampler_factory=greedy, prefill_budget=2).start()
    reqs = [request(f"r{i}", prompt(4, i), 20) for i in range(4)]   # two run, two wait
    results = run_threaded(sched, reqs)
    for events in results:
        end = finish(events)
        assert end.reason == "error" and isinstance(end.error, ServerUnhealthyError)
        assert isinstance(end.error.__cause__, CollectiveError)
        assert "rank 1 did not answer" in str(end.error)
    assert not sched.healthy() and not sched.stats().extra["healthy"]
    with pytest.raises(ServerUnhealthyError, match="model side failed"):
        sched.submit(request("after", prompt(3, 1), 2), None)
    assert runner.closed.wait(WAIT_S)
    sched.stop(drain_s=0)


def test_the_builders_thread_pool_is_released_at_start_and_the_loops_when_idle():
    """release_threads runs on the starting thread before the loop takes over, then on the
    loop's thread once per idle period (after work, not on every heartbeat or wake-up)."""
    released = []
    runner = FakeRunner(max_batch=2)
    sched = Scheduler(runner, sampler_factory=greedy, heartbeat_s=0.01,
                      release_threads=lambda: released.append(threading.get_ident()))
    sched.start()
    assert released[0] == threading.get_ident()
    time.sleep(0.1)                                        # idle before any work: nothing held
    assert len(released) == 1
    for round_ in range(2):
        run_threaded(sched, [request(f"r{round_}", prompt(3, round_), 4)])
        deadline = time.monotonic() + WAIT_S
        while len(released) < 2 + round_ and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)                                   # several heartbeats: still one release
        assert len(released) == 2 + round_
    loop_thread, = runner.thread_ids
    assert released[1:] == [loop_thread, loop_thread]
    sched.stop(drain_s=1.0)


def test_heartbeat_while_idle_and_its_failure_is_fatal():
    runner = FakeRunner(fail_on="heartbeat", fail_after=3)
    sched = Scheduler(runner, sampler_factory=greedy, heartbeat_s=0.02).start()
    started = time.monotonic()
    for _ in range(3):
        assert runner.heartbeats.acquire(timeout=WAIT_S)
    assert time.monotonic() - started >= 2 * 0.02          # paced, not a busy loop
    assert runner.closed.wait(WAIT_S)                       # the 4th heartbeat raised: loop ended
    assert not sched.healthy()
    assert [c[0] for c in runner.calls] == ["heartbeat"] * 4 + ["close"]
    sched.stop(drain_s=0)


def test_stop_lets_running_sequences_finish_within_the_drain():
    runner = FakeRunner(max_batch=2)
    sched = Scheduler(runner, sampler_factory=greedy).start()
    reqs = [request(f"r{i}", prompt(3, i), 5) for i in range(3)]

    async def main():
        loop = asyncio.get_running_loop()
        handles = [sched.submit(r, loop) for r in reqs]
        await asyncio.to_thread(sched.stop, 5.0)
        with pytest.raises(ServerUnhealthyError, match="shutting down"):
            sched.submit(request("late", prompt(3, 1), 2), loop)
        return await asyncio.gather(*(collect(h) for h in handles))

    for req, events in zip(reqs, asyncio.run(main())):
        assert finish(events).reason == "length"
        assert tokens(events) == alone(req.prompt_ids, 5)
    assert runner.calls[-1] == ("close",)


def test_stop_cancels_what_the_drain_did_not_finish():
    runner = FakeRunner(max_batch=2, max_tokens=256, decode_s=0.005)
    sched = Scheduler(runner, sampler_factory=greedy).start()
    reqs = [request(f"r{i}", prompt(3, i), 200) for i in range(3)]

    async def main():
        loop = asyncio.get_running_loop()
        handles = [sched.submit(r, loop) for r in reqs]
        first = await asyncio.wait_for(handles[0].queue.get(), WAIT_S)   # decoding has begun
        started = time.monotonic()
        await asyncio.to_thread(sched.stop, 0.05)
        stop_s = time.monotonic() - started
        return [[first, *await collect(handles[0])]] + [await collect(h) for h in handles[1:]], stop_s

    results, stop_s = asyncio.run(main())
    assert stop_s < 2.0
    for req, events in zip(reqs, results):
        assert finish(events).reason == "cancelled"
        got = tokens(events)
        assert len(got) < 200 and got == alone(req.prompt_ids, len(got))
    assert runner.closed.is_set() and all(len(s) == 0 for s in runner.slots)


def test_stop_before_start_cancels_the_queue():
    runner = FakeRunner()
    sched = Scheduler(runner, sampler_factory=greedy)
    handle = sched.submit(request("r", prompt(3, 1), 4), None)
    sched.stop(drain_s=1.0)
    assert drain(handle) == [FinishEvent("cancelled")]
    assert runner.calls == [("close",)]
    with pytest.raises(RuntimeError, match="stopped"):
        sched.start()


# ---- metrics ------------------------------------------------------------------------------------

def test_metrics_record_the_load_latencies_and_tokens():
    metrics = ServeMetrics()
    runner = FakeRunner(max_batch=2)
    sched = Scheduler(runner, sampler_factory=greedy, metrics=metrics)
    handles = [sched.submit(request(f"r{i}", prompt(4 + i, i), 3 + i), None) for i in range(3)]
    sched.step()
    assert metrics.running._value.get() == 2 and metrics.waiting._value.get() == 1
    assert metrics.slots_in_use._value.get() == 2 and metrics.slots_capacity._value.get() == 2
    handles[2].cancel()
    run_steps(sched)
    body, content_type = metrics.render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    for series in ["shardwise_requests_running 0.0", "shardwise_requests_waiting 0.0",
                   "shardwise_kv_slots_in_use 0.0", "shardwise_kv_slots_capacity 2.0",
                   "shardwise_prompt_tokens_total 9.0",             # 4 + 5 (the third never ran)
                   "shardwise_generation_tokens_total 7.0",         # 3 + 4
                   'shardwise_requests_finished_total{reason="length"} 2.0',
                   'shardwise_requests_finished_total{reason="cancelled"} 1.0',
                   'shardwise_requests_finished_total{reason="error"} 0.0',
                   "shardwise_time_to_first_token_seconds_count 2.0",
                   "shardwise_inter_token_latency_seconds_count 5.0",  # 7 tokens - 2 first
                   'shardwise_time_to_first_token_seconds_bucket{le="0.001"}',
                   "shardwise_generation_tokens_per_second 0.7"]:   # 7 tokens / 10 s window
        assert series in text, series


def test_tokens_per_second_is_over_the_recent_window():
    metrics = ServeMetrics(window_s=2.0)
    metrics.add_generation_tokens(10, now=100.0)
    metrics.add_generation_tokens(6, now=101.5)
    assert metrics.recent_tokens_per_second(now=101.9) == 8.0
    assert metrics.recent_tokens_per_second(now=103.0) == 3.0      # the first 10 fell out
    assert metrics.recent_tokens_per_second(now=104.0) == 0.0


def test_each_metrics_instance_has_its_own_registry():
    a, b = ServeMetrics(), ServeMetrics()
    a.add_prompt_tokens(5)
    assert b"shardwise_prompt_tokens_total 0.0" in b.render()[0]


# ---- integration: the real runner over an injected Llama ------------------------------------------

@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "recorded-graphs"])
def test_eight_concurrent_greedy_sequences_over_slot_runner_each_equal_hf_generate_alone(graphs):
    """8 sequences of different prompt lengths and max_tokens over 4 slots (so they join and
    leave, and the longer prompts are prefilled in chunks of ``prefill_budget``, alone or inside
    decode steps: mixed steps) through the real
    ``SlotRunner`` and ``Sampler``: each is token-for-token HF ``generate`` of its prompt alone.
    ``recorded-graphs``: the steps replay graphs that replay only what they recorded
    (RecordedReplay, a CUDA graph's semantics), the mixed ones captured per chunk bucket."""
    import shardwise
    from graph_doubles import RecordedReplay
    from models import prompt_ids, tiny_causal_lm
    from shardwise.accelerators.cpu import CpuAccelerator
    from shardwise.serve.runner import SlotRunner

    ref = tiny_causal_lm("llama")
    original = CpuAccelerator.graph_strategy
    if graphs:
        CpuAccelerator.graph_strategy = lambda self: RecordedReplay()
    try:
        engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                          replace_with_kernel_inject=True, max_tokens=64,
                                          enable_graph=graphs)
    finally:
        CpuAccelerator.graph_strategy = original
    runner = SlotRunner(engine, max_batch=4, max_tokens=64, mixed_buckets=(8, 16))
    if graphs:
        runner.warmup()
    chunks = []                                             # (slot, tokens, last) per prefill
    real_prefill = runner.prefill

    def recording_prefill(slot, token_ids, last):
        chunks.append((slot, len(token_ids), last))
        return real_prefill(slot, token_ids, last)

    real_mixed = runner.mixed

    def recording_mixed(slots, token_ids, parts):          # chunks inside decode steps
        chunks.extend((slot, len(ids), last) for slot, ids, last in parts)
        return real_mixed(slots, token_ids, parts)

    runner.prefill = recording_prefill                      # this instance only
    runner.mixed = recording_mixed
    eos = ref.generation_config.eos_token_id                # tiny Llama: 2, which greedy hits
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    sched = Scheduler(runner, eos_token_ids=eos_ids, prefill_budget=16).start()  # H2's Sampler
    shapes = [(3, 10), (17, 4), (8, 16), (30, 7), (1, 12), (12, 9), (5, 20), (21, 5)]
    reqs = [GenRequest(f"r{i}", prompt_ids(1, p, seed=i)[0].tolist(),
                       SamplingParams(max_tokens=m, temperature=0.0))
            for i, (p, m) in enumerate(shapes)]
    try:
        results = run_threaded(sched, reqs)
    finally:
        sched.stop(drain_s=1.0)
    for req, events in zip(reqs, results):
        n = req.params.max_tokens
        with torch.no_grad():
            expected = ref.generate(torch.tensor([req.prompt_ids]), max_new_tokens=n,
                                    do_sample=False, pad_token_id=0)[0, len(req.prompt_ids):]
        expected = expected.tolist()
        assert tokens(events) == expected, req.id
        assert finish(events).reason == ("stop" if expected[-1] in eos_ids else "length"), req.id
    assert {finish(events).reason for events in results} == {"stop", "length"}  # both paths ran
    assert any(not last for _, _, last in chunks) and max(n for _, n, _ in chunks) <= 16
    assert sum(last for _, _, last in chunks) == 8 and {s for s, _, _ in chunks} == {0, 1, 2, 3}
    if graphs:
        assert runner.mixed_steps["captured"] > 0 and runner.mixed_steps["eager"] == 0

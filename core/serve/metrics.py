"""Prometheus metrics of ``shardwise serve`` (``GET /metrics``), on ``prometheus_client``.

Every :class:`ServeMetrics` has its own ``CollectorRegistry`` unless one is passed in, so several
servers (or tests) in one process never collide on metric names. The scheduler records into it;
the HTTP layer serves :meth:`ServeMetrics.render`.

Series (Prometheus naming: ``shardwise_`` prefix, base units in the name, ``_total`` on counters):

- ``shardwise_requests_running``, ``shardwise_requests_waiting`` — sequences holding a KV slot /
  queued for one;
- ``shardwise_kv_slots_in_use``, ``shardwise_kv_slots_capacity`` — slots of the static KV cache;
- ``shardwise_time_to_first_token_seconds`` — histogram, submit → first generated token;
- ``shardwise_inter_token_latency_seconds`` — histogram, between consecutive tokens of a sequence;
- ``shardwise_prompt_tokens_total``, ``shardwise_generation_tokens_total`` — counters;
- ``shardwise_requests_finished_total{reason}`` — counter by finish reason (stop, length,
  cancelled, error);
- ``shardwise_generation_tokens_per_second`` — generated tokens per second over the last
  ``window_s`` seconds (computed when scraped).
"""

from __future__ import annotations

import collections
import threading
import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

#: latency buckets from 1 ms to 10 s (decode steps on a GPU are ~1-20 ms, CPU tens of ms, a TTFT
#: behind a queue can reach seconds)
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                     0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)

#: every reason a :class:`~shardwise.serve.types.FinishEvent` can carry
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class ServeMetrics:
    """The server's Prometheus series, recorded by the scheduler (thread-safe).

    Args:
        registry: where the series are registered; a fresh ``CollectorRegistry`` when None.
        window_s: the recent window ``shardwise_generation_tokens_per_second`` averages over.
    """

    def __init__(self, registry: CollectorRegistry | None = None, window_s: float = 10.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0 seconds, got {window_s}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self.window_s = window_s
        r = self.registry
        self.running = Gauge("shardwise_requests_running",
                             "Sequences holding a KV slot (prefilling or decoding).", registry=r)
        self.waiting = Gauge("shardwise_requests_waiting",
                             "Sequences queued for a KV slot.", registry=r)
        self.slots_in_use = Gauge("shardwise_kv_slots_in_use",
                                  "KV cache slots held by a sequence.", registry=r)
        self.slots_capacity = Gauge("shardwise_kv_slots_capacity",
                                    "KV cache slots in all (the runner's max batch).", registry=r)
        self.ttft = Histogram("shardwise_time_to_first_token_seconds",
                              "Time from submit to a sequence's first generated token.",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("shardwise_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a sequence.",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("shardwise_prompt_tokens",
                                     "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("shardwise_generation_tokens",
                                         "Tokens generated.", registry=r)
        self.finished = Counter("shardwise_requests_finished",
                                "Sequences finished, by reason.", ["reason"], registry=r)
        for reason in FINISH_REASONS:  # every reason shows (as 0) before it first happens
            self.finished.labels(reason=reason)
        self.tokens_per_second = Gauge("shardwise_generation_tokens_per_second",
                                       f"Tokens generated per second over the last {window_s:g} s.",
                                       registry=r)
        self.tokens_per_second.set_function(self.recent_tokens_per_second)
        self._lock = threading.Lock()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()  # (time, tokens)

    def set_load(self, running: int, waiting: int, slots_in_use: int, slots: int) -> None:
        """The scheduler's occupancy after a step."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.slots_in_use.set(slots_in_use)
        self.slots_capacity.set(slots)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def observe_token(self, since_s: float, first: bool, now: float | None = None) -> None:
        """One generated token, ``since_s`` seconds after its request was submitted (``first``:
        the time to first token) or after the request's previous token; ``now``: as in
        :meth:`add_generation_tokens`."""
        (self.observe_first_token if first else self.observe_inter_token)(since_s)
        self.add_generation_tokens(1, now)

    def observe_step(self, first_s: list[float], inter_s: list[float],
                     now: float | None = None) -> None:
        """The tokens of one scheduler step at once: ``first_s`` the times to first token of the
        sequences that got their first, ``inter_s`` the gaps since the previous token of the
        others (one counter increment and one entry of the recent window per step, not per
        token)."""
        for seconds in first_s:
            self.ttft.observe(seconds)
        for seconds in inter_s:
            self.itl.observe(seconds)
        if first_s or inter_s:
            self.add_generation_tokens(len(first_s) + len(inter_s), now)

    def add_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def add_generation_tokens(self, n: int, now: float | None = None) -> None:
        """``n`` tokens generated at ``now`` (``time.monotonic()`` when None)."""
        self.generation_tokens.inc(n)
        now = time.monotonic() if now is None else now
        with self._lock:
            self._recent.append((now, n))
            self._forget_before(now - self.window_s)

    def finish(self, reason: str) -> None:
        self.finished.labels(reason=reason).inc()

    def recent_tokens_per_second(self, now: float | None = None) -> float:
        """Generated tokens per second over the last ``window_s`` seconds."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._forget_before(now - self.window_s)
            return sum(n for _, n in self._recent) / self.window_s

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, for ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _forget_before(self, t: float) -> None:
        while self._recent and self._recent[0][0] < t:
            self._recent.popleft()

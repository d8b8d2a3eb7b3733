"""Timed text generation: ``generate`` (HF's, or an engine's: on an injected decoder
shardwise's own decode loop) with per-token wall-clock times, shared by ``shardwise generate``
and the benchmark.

Times come from a ``transformers`` streamer: ``generate`` (and shardwise's loop, which calls it
alike) hands it the prompt once before the prefill and then each step's new tokens as soon as
they are on the host (``tokens.cpu()``, which waits for the device), so the gaps between calls
are the real per-step latencies.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers.generation.streamers import BaseStreamer


@dataclass
class TokenTimings:
    """Wall-clock times of one ``generate`` call.

    Attributes:
        prefill_s: time to first token: from the prompt reaching ``generate``'s loop to the first
            new token on the host (the prefill forward plus the first token's selection).
        per_token_s: latency of each later decode step, one entry per token after the first.
        batch_size: sequences generated together (each step yields one token per sequence).
    """

    prefill_s: float
    per_token_s: list[float] = field(default_factory=list)
    batch_size: int = 1

    @property
    def new_tokens(self) -> int:
        """Decode steps taken, the first (prefill) step included."""
        return len(self.per_token_s) + 1

    @property
    def median_s(self) -> float | None:
        """Median decode latency per step in seconds (None when only one token was generated)."""
        return statistics.median(self.per_token_s) if self.per_token_s else None

    @property
    def tokens_per_s(self) -> float | None:
        """Decode throughput: tokens produced per second after the first, all sequences counted."""
        total = sum(self.per_token_s)
        return len(self.per_token_s) * self.batch_size / total if total > 0 else None

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON output."""
        return {"prefill_s": self.prefill_s, "per_token_s": list(self.per_token_s),
                "median_s": self.median_s, "tokens_per_s": self.tokens_per_s,
                "new_tokens": self.new_tokens, "batch_size": self.batch_size}

    def summary(self) -> str:
        """One human-readable line: prefill, median ms/token and tokens/s."""
        line = f"prefill {self.prefill_s * 1e3:.1f} ms"
        if self.median_s is None:
            return line + " | decode: n/a (1 token generated)"
        return (line + f" | decode {self.median_s * 1e3:.2f} ms/token (median of "
                f"{len(self.per_token_s)}) | {self.tokens_per_s:.1f} tokens/s")


class TokenTimer(BaseStreamer):
    """A streamer that records ``time.perf_counter()`` at every ``put``; the first is the prompt."""

    def __init__(self, synchronize: Callable[[], None] | None = None) -> None:
        self.times: list[float] = []
        self.batch_size = 1
        self._synchronize = synchronize  # waits for queued device work before each time

    def put(self, value: torch.Tensor) -> None:
        if not self.times:
            self.batch_size = value.shape[0] if value.dim() > 1 else 1
        if self._synchronize is not None:
            self._synchronize()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def timings(self) -> TokenTimings:
        """The recorded times as :class:`TokenTimings` (needs the prompt and one token)."""
        if len(self.times) < 2:
            raise RuntimeError("generate produced no token; nothing was timed")
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return TokenTimings(gaps[0], gaps[1:], self.batch_size)


def timed_generate(model, inputs: dict[str, torch.Tensor],
                   synchronize: Callable[[], None] | None = None,
                   **gen_kwargs: Any) -> tuple[torch.Tensor, TokenTimings]:
    """Run ``model.generate(**inputs, **gen_kwargs)`` and time it token by token.

    Args:
        model: a model with HF ``generate`` (e.g. ``engine.module``), or an engine (its
            ``generate``: on an injected decoder, shardwise's own decode loop, which calls the
            streamer as HF's does); ``inputs`` must already be on its device. An injected
            model is held for the whole call (its generate session), so timed generates from
            several threads run one after another.
        inputs: ``input_ids`` and optionally ``attention_mask`` (a ``BatchEncoding`` works).
        synchronize: waits for the device before each timestamp (``accelerator.synchronize``),
            so asynchronous devices are timed honestly.
        **gen_kwargs: passed to ``generate`` (``max_new_tokens``, ``do_sample``, ...); beam
            search is not supported (HF cannot stream it).

    Returns:
        The output ids (prompt included, as ``generate`` returns them) and the timings.
    """
    from .inject.layers import generation_session

    if synchronize is not None:
        synchronize()  # start from an idle device
    timer = TokenTimer(synchronize)
    # an injected model's cache: one generate at a time (an engine's generate holds it itself)
    session = generation_session(model) if isinstance(model, torch.nn.Module) \
        else contextlib.nullcontext()
    with session:
        output = model.generate(**inputs, streamer=timer, **gen_kwargs)
    return output, timer.timings()

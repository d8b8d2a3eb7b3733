"""Sentence embeddings from an encoder engine, for ``POST /v1/embeddings``.

:class:`Embedder` runs the engine's forward on a padded batch and pools the encoder's last
hidden state as sentence-transformers' default does: the mean over the real tokens (the
attention mask), then L2-normalised.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Sequence

import torch
from torch import nn


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """hidden [batch, seq, width], mask [batch, seq] (1 = real token) → the L2-normalised
    mean of each row's real positions, float32 [batch, width]."""
    weights = mask.to(torch.float32).unsqueeze(-1)  # [batch, seq, 1]
    summed = (hidden.to(torch.float32) * weights).sum(dim=1)
    mean = summed / weights.sum(dim=1).clamp(min=1e-9)
    return nn.functional.normalize(mean, p=2, dim=-1)


class Embedder:
    """Embeds token-id lists with ``engine`` (an :class:`~shardwise.InferenceEngine` over an
    encoder: ``BertModel``, ``BertForMaskedLM``, …; its base model's output 0 is the last
    hidden state). Calls from several threads run one after another (one forward at a time).
    The HTTP layer calls :meth:`submit`, which runs :meth:`embed` on the embedder's one worker
    thread: every request's forward on the same thread, so torch's OpenMP runtime keeps one
    worker pool for them (a thread pool's many threads each made their own, and past the
    cores' count libgomp throttles every parallel region).

    ``batch_size`` inputs are padded and run together (bounds the padded batch's memory).
    ``release_threads`` is called once, on the constructing thread (which built the engine),
    before the worker takes over (``accelerator.release_thread_pool``); None: nothing."""

    def __init__(self, engine: Any, tokenizer: Any, batch_size: int = 32,
                 release_threads: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = 0 if pad is None else int(pad)
        module = engine.module
        #: the bare encoder inside a task head (BertForMaskedLM.bert); the module itself if bare
        self.encoder = getattr(module, "base_model", module)
        self._lock = threading.Lock()
        self._worker = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="shardwise-embedder")
        if release_threads is not None:
            release_threads()

    def submit(self, inputs: Sequence[Sequence[int]]) -> concurrent.futures.Future:
        """:meth:`embed` of ``inputs`` on the embedder's worker thread (its future)."""
        return self._worker.submit(self.embed, inputs)

    def close(self) -> None:
        """Let the worker thread end once the embeddings submitted are done."""
        self._worker.shutdown(wait=False)

    @property
    def hidden_size(self) -> int:
        return int(self.engine.module.config.hidden_size)

    def embed(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Token ids of each input (each non-empty) → float32 [len(inputs), hidden], each row
        the masked mean of the last hidden state, L2-normalised."""
        if not inputs or any(len(ids) == 0 for ids in inputs):
            raise ValueError("embed() needs at least one input and no empty input")
        out = [self._batch(inputs[i:i + self.batch_size])
               for i in range(0, len(inputs), self.batch_size)]
        return torch.cat(out)

    def _batch(self, inputs: Sequence[Sequence[int]]) -> torch.Tensor:
        width = max(len(ids) for ids in inputs)
        ids = torch.full((len(inputs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(inputs), width), dtype=torch.long)
        for row, seq in enumerate(inputs):  # right padding
            ids[row, :len(seq)] = torch.tensor(list(seq), dtype=torch.long)
            mask[row, :len(seq)] = 1
        hidden = self._last_hidden(ids, mask)  # [batch, width, hidden]
        return mean_pool(hidden.cpu(), mask)

    def _last_hidden(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The engine's forward (inputs moved and, under TP, broadcast by the engine); the
        encoder's output caught by a hook scoped to this call."""
        caught: list[torch.Tensor] = []

        def catch(module: nn.Module, args: Any, output: Any) -> None:
            caught.append(output[0])

        with self._lock:
            hook = self.encoder.register_forward_hook(catch)
            try:
                self.engine(input_ids=ids, attention_mask=mask)
            finally:
                hook.remove()
        return caught[0]

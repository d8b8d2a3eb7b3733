"""The static KV cache of injected models: preallocated per layer, written in place.

:class:`KVBuffers` holds, per layer, ``k`` and ``v`` tensors ``[batch, kv_heads, max_tokens,
head_dim]`` on the model's device (this rank's kv heads under tensor parallelism), allocated once
per batch size (with graphs: per batch bucket, a cache then using its first ``batch`` rows) and
reused across ``generate`` calls, so decode shapes never change (which is what graph capture
needs). :class:`StaticKVCache` is the ``transformers`` :class:`~transformers.Cache`
that ``generate`` carries between steps: a cursor (tokens written, the first valid position of each
left-padded sequence) over the buffers. Only the newest cache object of a model is live: starting a
new sequence (a forward without a shardwise cache) retires the previous one, and using a retired
one is an error rather than silently reading overwritten keys.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..errors import ShardwiseError

#: How users raise the capacity, quoted by every capacity error.
RAISE_HINT = ("raise it with init_inference(..., max_tokens=N) (DeepSpeed alias max_out_tokens); "
              "the cache holds the prompt plus every generated token")


class MaxTokensError(ShardwiseError, ValueError):
    """A prompt or a generation needs more tokens than the static KV cache holds."""


class StaleCacheError(ShardwiseError, RuntimeError):
    """A shardwise cache from an earlier sequence was passed back after a new one started."""


class KVBuffers:
    """Preallocated keys and values of every layer (see the module docstring)."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_tokens: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (batch, kv_heads, max_tokens, head_dim)
        # never inference tensors (even when the first forward runs in inference mode): those
        # could not be written by a later forward under no_grad
        with torch.inference_mode(False):
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.batch, self.max_tokens = batch, max_tokens
        self.dtype, self.device = dtype, device

    def matches(self, batch: int, dtype: torch.dtype, device: torch.device) -> bool:
        return self.batch == batch and self.dtype == dtype and self.device == device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class StaticKVCache(Cache):
    """``transformers`` cache over :class:`KVBuffers` (see the module docstring).

    Supports what ``generate`` asks of a cache: ``get_seq_length``, ``reorder_cache`` (beam
    search: the buffers are permuted along the batch in place), ``crop`` (assisted decoding).
    ``update`` is never called: the injected layers write with the ``kv_cache_write`` kernel.
    """

    is_compileable = False  # generate must not build 4-d masks for it: the layers need none

    def __init__(self, buffers: KVBuffers, owner: "object", generation: int,
                 batch: int | None = None) -> None:
        super().__init__(layers=[])
        self.buffers = buffers
        #: sequences this cache holds: the buffers' first ``batch`` rows (the buffers may have
        #: more: a captured graph's batch bucket, the extra rows padding)
        self.batch = buffers.batch if batch is None else batch
        if not 0 < self.batch <= buffers.batch:
            raise ShardwiseError(f"a cache of {self.batch} sequences over buffers of "
                                 f"{buffers.batch}")
        rows = slice(0, self.batch)
        self.k = buffers.k if self.batch == buffers.batch else [t[rows] for t in buffers.k]
        self.v = buffers.v if self.batch == buffers.batch else [t[rows] for t in buffers.v]
        self.length = 0  # tokens written (same for every sequence: left padding, not ragged)
        self.starts: torch.Tensor | None = None  # [batch] first real token, None: no padding
        self._owner, self._generation = owner, generation

    # ----- shardwise ---------------------------------------------------------------------------

    def check_live(self) -> None:
        if getattr(self._owner, "_cache_generation", None) != self._generation:
            raise StaleCacheError(
                "this shardwise KV cache belongs to an earlier sequence: an injected model keeps "
                "one static cache, and a newer prompt has overwritten it. Start again from the "
                "prompt (generate() does this by itself)")

    def reserve(self, n_new: int) -> int:
        """Check ``n_new`` more tokens fit; returns the first position they are written at."""
        start, cap = self.length, self.buffers.max_tokens
        if start + n_new > cap:
            what = (f"the prompt has {n_new} tokens" if start == 0 else
                    f"generation reached {start} tokens and the next step needs {start + n_new}")
            raise MaxTokensError(f"{what}, more than the static KV cache holds (max_tokens="
                                 f"{cap}); {RAISE_HINT}")
        return start

    # ----- the transformers Cache interface ----------------------------------------------------

    def __len__(self) -> int:
        return len(self.buffers.k)

    def __repr__(self) -> str:
        return (f"StaticKVCache(layers={len(self)}, batch={self.batch}, "
                f"length={self.length}, max_tokens={self.buffers.max_tokens})")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.buffers.max_tokens

    @property
    def max_cache_len(self) -> int:
        return self.buffers.max_tokens

    @property
    def max_batch_size(self) -> int:
        return self.batch

    @property
    def is_initialized(self) -> bool:
        return True

    def update(self, *args, **kwargs):
        raise ShardwiseError("StaticKVCache is written by shardwise's injected layers only; an "
                             "un-injected module cannot use it")

    def reset(self) -> None:
        self.length, self.starts = 0, None

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: drop that many from the end)."""
        self.check_live()
        keep = self.length + max_length if max_length < 0 else max_length
        self.length = max(0, min(self.length, keep))

    @torch.no_grad()
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: sequence ``b`` continues beam ``beam_idx[b]`` (in-place permutation)."""
        self.check_live()
        idx = beam_idx.to(self.buffers.device)
        n = self.length
        for t in (*self.k, *self.v):
            t[:, :, :n].copy_(t[:, :, :n].index_select(0, idx))
        if self.starts is not None:
            self.starts = self.starts.index_select(0, idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ShardwiseError("the injected static KV cache cannot be expanded after the prompt; "
                             "pass the expanded batch to generate() instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ShardwiseError("the injected static KV cache cannot drop sequences mid-generation")

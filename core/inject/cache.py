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

Threads: the one static cache is why two threads must not generate on one injected model at
the same time (each would overwrite the other's keys). :class:`~shardwise.inject.InjectedModel`
refuses overlapping forwards and a forward of another thread while a ``generate`` session is
held (``engine.generate`` holds one, so engine calls from several threads run one after
another), and a cache re-claimed by another thread's new sequence says so
(:class:`ConcurrentUseError`): never silently wrong tokens.

Memory: the cache's bytes (:func:`kv_cache_bytes`) are checked against the device's free memory
at ``init_inference`` (one sequence) and before each allocation (the batch asked for), a
:class:`KVCacheMemoryError` naming the ``max_tokens`` that would fit.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch
from transformers.cache_utils import Cache

from ..errors import ConfigError, ShardwiseError

#: How users raise the capacity, quoted by every capacity error.
RAISE_HINT = ("raise it with init_inference(..., max_tokens=N) (DeepSpeed alias max_out_tokens); "
              "the cache holds the prompt plus every generated token")


class MaxTokensError(ShardwiseError, ValueError):
    """A prompt or a generation needs more tokens than the static KV cache holds."""


class StaleCacheError(ShardwiseError, RuntimeError):
    """A shardwise cache from an earlier sequence was passed back after a new one started."""


class ConcurrentUseError(ShardwiseError, RuntimeError):
    """Two threads used one injected model (one static KV cache) at the same time."""


#: What every concurrency error tells the user to do.
THREADS_HINT = ("an injected model holds ONE static KV cache, so two threads cannot generate on "
                "it at the same time: use one engine per thread, or call engine.generate (it "
                "serializes callers), or hold a lock around each generate")


class KVCacheMemoryError(ConfigError):
    """The static KV cache would not fit the device's free memory."""


def kv_cache_bytes(num_layers: int, batch: int, kv_heads: int, max_tokens: int, head_dim: int,
                   dtype: torch.dtype, tensors: int = 2) -> int:
    """Bytes of a static cache: layers × 2 (k, v) × batch × kv heads × max_tokens × head_dim ×
    the dtype's size (kv heads: this rank's under tensor parallelism). ``tensors``: 1 for a
    latent cache, whose one tensor is both keys and values (:mod:`shardwise.inject.mla`)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * tensors * batch * kv_heads * max_tokens * head_dim * itemsize


def free_memory_of(free_memory: Callable[[int], int] | None, device: torch.device) -> int | None:
    """``free_memory(index)`` of ``device`` (an accelerator's method); None when it cannot say."""
    if free_memory is None:
        return None
    try:
        return int(free_memory(device.index or 0))
    except NotImplementedError:  # a plugin without memory queries: nothing to check against
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_kv_fits(need: int, free: int, *, batch: int, max_tokens: int, where: str) -> None:
    """Raise :class:`KVCacheMemoryError` unless a cache of ``need`` bytes (``batch`` sequences of
    ``max_tokens``) fits in ``free`` bytes."""
    if need > free:
        raise kv_memory_error(need, free, batch=batch, max_tokens=max_tokens, where=where)


def kv_memory_error(need: int, free: int | None, *, batch: int, max_tokens: int, where: str,
                    refused: bool = False) -> KVCacheMemoryError:
    """The error for a cache of ``need`` bytes that does not fit (``refused``: the allocator
    failed although ``free`` looked enough): the bytes, the free memory and the ``max_tokens``
    that would fit."""
    per_token = max(1, need // max_tokens)  # one token position over every layer and sequence
    seqs = "one sequence" if batch == 1 else f"a batch of {batch}"
    have = ("cannot tell its free memory" if free is None else
            f"has {free} bytes free ({_gib(free)})")
    fits = "" if free is None else (f"; at most max_tokens={free // per_token} would fit (less "
                                    f"in practice: activations need room too)")
    refusal = "the allocator refused it: " if refused else ""
    return KVCacheMemoryError(
        f"the static KV cache for {seqs} of max_tokens={max_tokens} needs {need} bytes "
        f"({_gib(need)}: layers x 2 (k, v; 1 for a latent cache) x kv heads x head_dim x "
        f"max_tokens x batch x dtype size); "
        f"{refusal}{where} {have}{fits}. Lower it with init_inference(..., max_tokens=N) "
        f"(DeepSpeed alias max_out_tokens)"
        + ("" if batch == 1 else " or generate with a smaller batch"))


class KVBuffers:
    """Preallocated keys and values of every layer (see the module docstring). ``values=False``:
    one tensor per layer that is keys and values at once (``v`` is ``k``: multi-head latent
    attention's latent cache, :mod:`shardwise.inject.mla`)."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_tokens: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 values: bool = True) -> None:
        shape = (batch, kv_heads, max_tokens, head_dim)
        # never inference tensors (even when the first forward runs in inference mode): those
        # could not be written by a later forward under no_grad
        with torch.inference_mode(False):
            self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
                      if values else self.k)
        self.batch, self.max_tokens = batch, max_tokens
        self.dtype, self.device = dtype, device

    def row_range(self, start: int, stop: int) -> "KVBuffers":
        """Rows ``start .. stop - 1`` of these keys and values, as buffers of their own (views,
        no copy: a write through them is a write to these buffers)."""
        view = object.__new__(KVBuffers)
        view.k = [t[start:stop] for t in self.k]
        view.v = view.k if self.v is self.k else [t[start:stop] for t in self.v]
        view.batch, view.max_tokens = stop - start, self.max_tokens
        view.dtype, view.device = self.dtype, self.device
        return view

    def release(self) -> None:
        """Let go of the keys and values (every layer's; in place, so a cache sharing these
        lists loses them too): their memory is freed once no view of them is held."""
        self.k.clear()
        self.v.clear()

    def matches(self, batch: int, dtype: torch.dtype, device: torch.device) -> bool:
        return self.batch == batch and self.dtype == dtype and self.device == device

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every cache tensor once (a latent cache's ``v`` is its ``k``)."""
        return list(self.k) if self.v is self.k else [*self.k, *self.v]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass
class DecodeRows:
    """Per-sequence inputs of one decode step (one new token per row): ``position_ids``
    [rows, 1] int64, ``write_index`` [rows] int64 (the cache position each row's new key and
    value are written at), ``lengths`` [rows] int64 (valid cache positions per row, the new token
    included) and ``starts`` [rows] int64 or None (each row's first valid position; None: 0).
    A left-padded batch has one write position for every row; the slots of
    :mod:`shardwise.inject.slots` each their own."""

    position_ids: torch.Tensor
    write_index: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor | None


@dataclass
class MixedRows:
    """What one *mixed* forward carries (continuous batching's chunked prefill inside the
    decode batch, :meth:`~shardwise.inject.slots.SlotKVCache.mixed`): its ``T`` tokens are
    packed as one batch row ``[1, T]`` — first one decode token for each of ``len(slots)``
    slots, then the prompt chunks, each continuing its own slot after its cached tokens.

    * decode part, over the cache's first ``span`` rows (the rows holding no decoding slot
      write to the scratch position and attend only to it, as in a decode step):
      ``slots`` [n_decode] int64 (the row of each decode token, in packed order),
      ``write_index``/``lengths``/``starts`` [span] int64 (per row: where its new key is
      written, its valid range after the write — :class:`DecodeRows`' meaning);
    * ``chunks``: ``(slot, past, n)`` per prompt chunk, in packed order (``n`` tokens written
      at positions ``past .. past + n - 1`` of row ``slot``, attending causally to the row's
      ``past`` cached tokens and to the chunk);
    * ``position_ids`` [1, T] int64: each token's position in its own sequence.
    """

    slots: torch.Tensor
    span: int
    write_index: torch.Tensor
    lengths: torch.Tensor
    starts: torch.Tensor
    chunks: tuple[tuple[int, int, int], ...]
    position_ids: torch.Tensor

    @property
    def n_decode(self) -> int:
        """Decode tokens at the front of the packed row."""
        return int(self.slots.shape[0])

    @property
    def tokens(self) -> int:
        """Every token of the packed row (``T``)."""
        return self.n_decode + sum(n for _, _, n in self.chunks)


def write_rows(cache: torch.Tensor, index: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Write one token per row in place, each row at its own position, without a host sync
    (graph-safe): ``cache`` [rows, heads, max_tokens, d], ``index`` [rows] int64, ``new``
    [rows, heads, 1, d] → ``cache`` with ``cache[r, :, index[r]] = new[r, :, 0]``.

    An indexed put, not ``scatter_``: inductor keeps an ``index_put_`` on a graph input in
    place, while it lowers ``scatter_`` to a copy of the whole cache written back after the
    write (every layer, every step: at a 1024-token cache more bytes than the layer's int4
    weights)."""
    rows = torch.arange(new.shape[0], device=cache.device)
    cache[rows, :, index] = new[:, :, 0]  # advanced indices on dims 0, 2: [rows, heads, d]
    return cache


class StaticKVCache(Cache):
    """``transformers`` cache over :class:`KVBuffers` (see the module docstring).

    Supports what ``generate`` asks of a cache: ``get_seq_length``, ``reorder_cache`` (beam
    search: the buffers are permuted along the batch in place), ``crop`` (assisted decoding).
    ``update`` is never called: the injected layers write with the ``kv_cache_write`` kernel.
    """

    is_compileable = False  # generate must not build 4-d masks for it: the layers need none
    #: True for a cache whose rows hold sequences of different lengths (each one-token forward
    #: is then a decode step with the cache's own :meth:`decode_rows`)
    ragged = False
    #: a mixed forward's packed rows (:class:`MixedRows`); None: a plain prompt or decode step
    mixed: MixedRows | None = None

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
        self.v = (self.k if buffers.v is buffers.k else  # a latent cache: keys = values
                  buffers.v if self.batch == buffers.batch else [t[rows] for t in buffers.v])
        self.length = 0  # tokens written (same for every sequence: left padding, not ragged)
        self.starts: torch.Tensor | None = None  # [batch] first real token, None: no padding
        self._owner, self._generation = owner, generation
        #: (ident, name) of the thread whose forward started this sequence
        self.thread = (threading.get_ident(), threading.current_thread().name)

    # ----- shardwise ---------------------------------------------------------------------------

    def check_live(self) -> None:
        if getattr(self._owner, "_cache_generation", None) != self._generation:
            newest = getattr(self._owner, "_cache_thread", None)
            if newest is not None and newest[0] != self.thread[0]:
                raise ConcurrentUseError(
                    f"the KV cache of the sequence thread {self.thread[1]!r} is generating was "
                    f"re-claimed by thread {newest[1]!r}, which started another sequence on "
                    f"the same injected model; the keys this sequence needs are overwritten, so "
                    f"it stops here rather than produce wrong tokens. {THREADS_HINT}")
            raise StaleCacheError(
                "this shardwise KV cache belongs to an earlier sequence: an injected model keeps "
                "one static cache, and a newer prompt has overwritten it. Start again from the "
                "prompt (generate() does this by itself)")

    def split_rows(self, sizes: list[int]) -> list["StaticKVCache"]:
        """Caches of consecutive row ranges of this one (``sizes`` rows each, adding up to
        :attr:`batch`), each over views of these buffers (a write through one is a write
        here) and live as long as this one: what each micro-batch of a pipeline stage carries
        (:mod:`shardwise.pipeline.schedule`). Each keeps its own length and padding starts."""
        if sum(sizes) != self.batch or any(n < 1 for n in sizes):
            raise ShardwiseError(f"row ranges {sizes} do not split a cache of {self.batch} "
                                 f"sequences")
        out, start = [], 0
        for n in sizes:
            out.append(StaticKVCache(self.buffers.row_range(start, start + n), self._owner,
                                     self._generation))
            start += n
        return out

    def reserve(self, n_new: int) -> int:
        """Check ``n_new`` more tokens fit; returns the first position they are written at."""
        start, cap = self.length, self.buffers.max_tokens
        if start + n_new > cap:
            what = (f"the prompt has {n_new} tokens" if start == 0 else
                    f"generation reached {start} tokens and the next step needs {start + n_new}")
            raise MaxTokensError(f"{what}, more than the static KV cache holds (max_tokens="
                                 f"{cap}); {RAISE_HINT}")
        return start

    @property
    def graph_key(self) -> object | None:
        """Which captured decode graph serves this cache (its buffers' row count: the batch
        bucket); None: decode eagerly."""
        return self.buffers.batch

    def decode_rows(self, position_ids: torch.Tensor) -> DecodeRows:
        """The per-row inputs of a decode step after ``length`` cached tokens (every row writes
        at ``length``), ``position_ids`` [batch, 1] as the forward computed them."""
        device = position_ids.device
        return DecodeRows(position_ids=position_ids,
                          write_index=torch.full((self.batch,), self.length, dtype=torch.int64,
                                                 device=device),
                          lengths=torch.full((self.batch,), self.length + 1, dtype=torch.int64,
                                             device=device),
                          starts=self.starts)

    def advance(self, n_new: int) -> None:
        """``n_new`` tokens were written after the cached ones."""
        self.length += n_new

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
        for t in (self.k if self.v is self.k else (*self.k, *self.v)):  # each tensor once
            t[:, :, :n].copy_(t[:, :, :n].index_select(0, idx))
        if self.starts is not None:
            self.starts = self.starts.index_select(0, idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise ShardwiseError("the injected static KV cache cannot be expanded after the prompt; "
                             "pass the expanded batch to generate() instead")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise ShardwiseError("the injected static KV cache cannot drop sequences mid-generation")

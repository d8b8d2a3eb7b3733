"""KV cache (reference): ``kv_cache_write``, new keys/values into a preallocated cache.

Cache layout: ``[batch, kv_heads, max_tokens, d]``; sequence ``b`` holds its valid tokens at
positions ``starts[b] .. lengths[b] - 1`` (see :mod:`.attention`, which reads them) and anything
(even NaN) outside them. A write past ``max_tokens`` (or before 0) raises KernelError and writes
nothing. Helpers (not ops): :func:`write_starts`, :func:`check_cache_write` (checks every backend
shares).
"""

from __future__ import annotations

import torch

from shardwise.errors import KernelError

from .example import randn

BACKEND = "reference"


def write_starts(positions: int | torch.Tensor, batch: int, n_new: int, max_tokens: int,
                 ) -> list[int]:
    """Start position per sequence of a cache write, as host ints, checked to fit the cache.

    Raises KernelError naming the sequence when ``start < 0`` or ``start + n_new > max_tokens``.
    (A tensor of positions is read back to the host: a device sync on GPUs.)
    """
    if isinstance(positions, torch.Tensor):
        if positions.shape != (batch,) or positions.dtype not in (torch.int32, torch.int64):
            raise KernelError(f"positions must be an int or an int32/int64 tensor [batch={batch}]"
                              f", got {positions.dtype} {tuple(positions.shape)}")
        starts = [int(p) for p in positions.tolist()]
    else:
        starts = [int(positions)] * batch
    for b, start in enumerate(starts):
        if start < 0 or start + n_new > max_tokens:
            raise KernelError(
                f"kv_cache_write past the cache: sequence {b} writes positions {start}.."
                f"{start + n_new - 1} but the cache holds max_tokens={max_tokens}; allocate a "
                f"larger cache or stop generating at max_tokens")
    return starts


def check_cache_write(k_cache, v_cache, k_new, v_new) -> None:
    """Validate cache and new-token shapes for kv_cache_write."""
    if k_cache.shape != v_cache.shape or k_new.shape != v_new.shape or k_cache.dim() != 4 or \
            k_new.dim() != 4 or k_new.shape[:2] != k_cache.shape[:2] or \
            k_new.shape[3] != k_cache.shape[3]:
        raise KernelError(f"kv_cache_write takes caches [batch, kv_heads, max_tokens, d] and new "
                          f"k, v [batch, kv_heads, n_new, d]; got caches {tuple(k_cache.shape)}, "
                          f"{tuple(v_cache.shape)} and new {tuple(k_new.shape)}, "
                          f"{tuple(v_new.shape)}")


def kv_cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor, positions: int | torch.Tensor, *,
                   check: bool = True) -> None:
    """Write new keys/values into the caches in place.

    k_cache, v_cache: [batch, kv_heads, max_tokens, d]; k_new, v_new: [batch, kv_heads, n_new,
    d] (n_new = 1 when decoding, the chunk length in prefill). positions: the first cache
    position of each sequence's new tokens, an int for all or a [batch] int tensor; token t of
    sequence b lands at ``positions[b] + t``. A write past max_tokens (or before 0) raises
    KernelError and writes nothing. ``check=False`` lets a backend skip that host-side check
    (no device sync, e.g. inside CUDA-graph capture); the reference always checks.
    """
    check_cache_write(k_cache, v_cache, k_new, v_new)
    n_new = k_new.shape[2]
    starts = write_starts(positions, k_cache.shape[0], n_new, k_cache.shape[2])
    for b, start in enumerate(starts):
        k_cache[b, :, start:start + n_new] = k_new[b]
        v_cache[b, :, start:start + n_new] = v_new[b]


OPS = {"kv_cache_write": kv_cache_write}


def register(registry) -> None:
    """Define the cache op with its reference."""
    for op, fn in OPS.items():
        registry.register(op, BACKEND, fn)


# ----- example inputs (conformance suite): op -> (dtype, device) -> (args, kwargs) ---------------

def _cache_write_example(dtype, device):
    k_cache, v_cache = torch.zeros(2, 2, 10, 16), torch.zeros(2, 2, 10, 16)
    k_new, v_new = randn(2, 2, 3, 16, seed=22), randn(2, 2, 3, 16, seed=23)
    positions = torch.tensor([0, 6], device=device)
    return ((k_cache.to(device, dtype), v_cache.to(device, dtype), k_new.to(device, dtype),
             v_new.to(device, dtype), positions), {})


EXAMPLES = {"kv_cache_write": _cache_write_example}

"""The ``cpu`` backend's KV-cache write: one op per cache.

Contracts are those of ``shardwise.kernels.reference.kv_cache`` (cache layout, positions, bounds).
Only what measured faster than the reference is registered (``REGISTERED``), per dtype; the
speed-ups, their command and machine are in benchmarks/README.md, "CPU kernels against the
reference":

* kv_cache_write (fp32, bf16, fp16): one slice copy per cache when all sequences start at the
  same position, else one ``index_put_`` (faster in every case, most when the positions
  agree).
"""

from __future__ import annotations

import torch

from shardwise.kernels.reference import kv_cache as ref

from . import DEVICE_TYPES, DTYPES

BACKEND = "cpu"


def kv_cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor, positions: int | torch.Tensor, *,
                   check: bool = True) -> None:
    """Write new keys/values into the caches in place with one op per cache; contract of the
    reference ``kv_cache_write`` (always checked: on CPU the check costs no device sync)."""
    ref.check_cache_write(k_cache, v_cache, k_new, v_new)
    n_new = k_new.shape[2]
    starts = ref.write_starts(positions, k_cache.shape[0], n_new, k_cache.shape[2])
    if not starts:
        return
    if min(starts) == max(starts):
        k_cache[:, :, starts[0]:starts[0] + n_new] = k_new
        v_cache[:, :, starts[0]:starts[0] + n_new] = v_new
        return
    # rows [batch, 1], cols [batch, n_new]: advanced indices on dims 0 and 2 put them first, so
    # the indexed view is [batch, n_new, kv_heads, d]
    rows = torch.arange(len(starts), device=k_cache.device)[:, None]
    cols = torch.tensor(starts, device=k_cache.device)[:, None] + torch.arange(
        n_new, device=k_cache.device)
    k_cache[rows, :, cols] = k_new.transpose(1, 2)
    v_cache[rows, :, cols] = v_new.transpose(1, 2)


#: op → (implementation, dtypes it is registered for): only what measured faster.
REGISTERED = {"kv_cache_write": (kv_cache_write, DTYPES)}
#: ops whose implementation may run inside the CPU graph strategy's compiled step
CAPTURABLE: frozenset[str] = frozenset()


def register(registry) -> None:
    """Register the CPU cache write for the dtypes it won."""
    for op, (fn, dtypes) in REGISTERED.items():
        registry.register(op, BACKEND, fn, dtypes=dtypes, device_types=DEVICE_TYPES,
                          capturable=op in CAPTURABLE)

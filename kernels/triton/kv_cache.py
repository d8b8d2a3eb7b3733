"""kv_cache_write as one Triton launch for k and v (CUDA).

Contract is that of ``shardwise.kernels.reference.kv_cache``, with one difference on invalid
input: ``kv_cache_write(check=False)`` (no device sync, for graph capture) drops the out-of-range
tokens instead of raising; it never writes outside the caches. Importing this module imports
triton; it is imported by ``register`` of the triton backend only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardwise.kernels.reference import kv_cache as ref

from . import DEVICE_TYPES, DTYPES
from .common import same_device, strides

BACKEND = "triton"


@triton.jit
def _kv_write_kernel(KN, VN, KC, VC, POS, start, n_new, max_tokens, n_kv, head_dim,
                     skn_b, skn_h, skn_t, skn_d, svn_b, svn_h, svn_t, svn_d,
                     skc_b, skc_h, skc_t, skc_d, svc_b, svc_h, svc_t, svc_d,
                     HAS_POS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b * kv head, token tile): copy BLOCK_T new tokens of k and v into the caches.
    Tokens that would land outside 0..max_tokens-1 are dropped (the host check raises first)."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // n_kv, bh % n_kv
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    first = start
    if HAS_POS:
        first = tl.load(POS + b).to(tl.int64)
    pos = first + t
    ok = (t < n_new) & (pos >= 0) & (pos < max_tokens)
    dims = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (dims < head_dim)[None, :]
    k = tl.load(KN + b * skn_b + h * skn_h + t[:, None] * skn_t + dims[None, :] * skn_d,
                mask=mask)
    v = tl.load(VN + b * svn_b + h * svn_h + t[:, None] * svn_t + dims[None, :] * svn_d,
                mask=mask)
    tl.store(KC + b * skc_b + h * skc_h + pos[:, None] * skc_t + dims[None, :] * skc_d,
             k.to(KC.dtype.element_ty), mask=mask)
    tl.store(VC + b * svc_b + h * svc_h + pos[:, None] * svc_t + dims[None, :] * svc_d,
             v.to(VC.dtype.element_ty), mask=mask)


def kv_cache_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor, positions: int | torch.Tensor, *,
                   check: bool = True) -> None:
    """Write new keys/values into the caches in one launch; contract of the reference.

    ``check=True`` raises KernelError for a write past the cache before writing anything (a
    device sync when ``positions`` is a tensor); ``check=False`` skips that (graph capture) and
    the kernel drops out-of-range tokens instead.
    """
    ref.check_cache_write(k_cache, v_cache, k_new, v_new)
    same_device(k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new,
                 positions=positions if isinstance(positions, torch.Tensor) else None)
    batch, n_kv, max_tokens, head_dim = k_cache.shape
    n_new = k_new.shape[2]
    if check or not isinstance(positions, torch.Tensor):
        ref.write_starts(positions, batch, n_new, max_tokens)  # ints: checked at no cost
    if k_new.numel() == 0:
        return
    has_pos = isinstance(positions, torch.Tensor)
    block_t = min(16, triton.next_power_of_2(n_new))
    _kv_write_kernel[(batch * n_kv, triton.cdiv(n_new, block_t))](
        k_new, v_new, k_cache, v_cache, positions if has_pos else k_new,
        0 if has_pos else int(positions), n_new, max_tokens, n_kv, head_dim,
        *strides(k_new), *strides(v_new), *strides(k_cache), *strides(v_cache),
        HAS_POS=has_pos, BLOCK_T=block_t, BLOCK_D=triton.next_power_of_2(head_dim))


OPS = {"kv_cache_write": kv_cache_write}


def register(registry) -> None:
    """Register the cache-write kernel for CUDA in fp32/fp16/bf16."""
    for op, fn in OPS.items():
        registry.register(op, BACKEND, fn, dtypes=DTYPES, device_types=DEVICE_TYPES)

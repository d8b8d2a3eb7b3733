"""Rotary embedding as one Triton launch for q and k (CUDA).

Contract (layouts, styles, partial rotary, broadcast cos/sin) is that of
``shardwise.kernels.reference.rotary``, whose check the launcher runs. Math is float32 inside
the kernel; results are rounded to the input dtype once. Importing this module imports triton;
it is imported by ``register`` of the triton backend only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardwise.kernels.reference import rotary as ref

from . import DEVICE_TYPES, DTYPES
from .common import strides

BACKEND = "triton"


@triton.jit
def _rotary_heads(X, O, x_off, o_off, sx_h, sx_d, so_h, so_d, n_heads, d1, d2, pair_mask, c, s,
                  pass_cols, pass_mask, BLOCK_H: tl.constexpr, HAS_PASS: tl.constexpr):
    """Rotate the pairs (d1, d2) of every head of one token; copy the pass-through dims.

    x_off/o_off: offsets of the token's head 0; d1, d2, c, s: [BLOCK_HALF] pair dims and angles.
    """
    heads = tl.arange(0, BLOCK_H)
    m = (heads < n_heads)[:, None] & pair_mask[None, :]  # [BLOCK_H, BLOCK_HALF]
    xh = X + x_off + heads[:, None] * sx_h
    oh = O + o_off + heads[:, None] * so_h
    x1 = tl.load(xh + d1[None, :] * sx_d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xh + d2[None, :] * sx_d, mask=m, other=0.0).to(tl.float32)
    dtype = O.dtype.element_ty
    tl.store(oh + d1[None, :] * so_d, (x1 * c[None, :] - x2 * s[None, :]).to(dtype), mask=m)
    tl.store(oh + d2[None, :] * so_d, (x2 * c[None, :] + x1 * s[None, :]).to(dtype), mask=m)
    if HAS_PASS:
        pm = (heads < n_heads)[:, None] & pass_mask[None, :]
        rest = tl.load(xh + pass_cols[None, :] * sx_d, mask=pm, other=0.0)
        tl.store(oh + pass_cols[None, :] * so_d, rest, mask=pm)


@triton.jit
def _rotary_kernel(Q, K, QO, KO, COS, SIN, seq_len, n_q, n_kv, half, head_dim,
                   sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d,
                   sqo_b, sqo_h, sqo_t, sqo_d, sko_b, sko_h, sko_t, sko_d,
                   sc_b, sc_t, sc_i, ss_b, ss_t, ss_i,
                   INTERLEAVED: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, HAS_PASS: tl.constexpr):
    """One program per token (batch b, position t): all q heads and all k heads of it."""
    row = tl.program_id(0).to(tl.int64)
    b, t = row // seq_len, row % seq_len
    i = tl.arange(0, BLOCK_HALF)
    pair_mask = i < half
    c = tl.load(COS + b * sc_b + t * sc_t + i * sc_i, mask=pair_mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + b * ss_b + t * ss_t + i * ss_i, mask=pair_mask, other=0.0).to(tl.float32)
    if INTERLEAVED:  # GPT-J: pairs (2i, 2i + 1)
        d1, d2 = 2 * i, 2 * i + 1
    else:  # Llama / NeoX rotate_half: pairs (i, i + half)
        d1, d2 = i, i + half
    pass_cols = 2 * half + tl.arange(0, BLOCK_PASS)
    pass_mask = pass_cols < head_dim
    _rotary_heads(Q, QO, b * sq_b + t * sq_t, b * sqo_b + t * sqo_t, sq_h, sq_d, sqo_h, sqo_d,
                  n_q, d1, d2, pair_mask, c, s, pass_cols, pass_mask, BLOCK_HQ, HAS_PASS)
    _rotary_heads(K, KO, b * sk_b + t * sk_t, b * sko_b + t * sko_t, sk_h, sk_d, sko_h, sko_d,
                  n_kv, d1, d2, pair_mask, c, s, pass_cols, pass_mask, BLOCK_HKV, HAS_PASS)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
           style: str = "half") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding in one launch for q and k; contract of the reference ``rotary``.

    q: [batch, q_heads, seq, d], k: [batch, kv_heads, seq, d] (any strides; outputs keep the
    layout); cos, sin: [batch | 1, seq, rotary_dim/2] or [seq, rotary_dim/2].
    """
    rotary_dim = ref.check_rotary(q, k, cos, sin, style)
    batch, n_q, seq, head_dim = q.shape
    cos, sin = (t.expand(batch, seq, rotary_dim // 2) for t in (cos, sin))  # stride 0 broadcast
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0:
        return qo, ko
    n_pass = head_dim - rotary_dim
    _rotary_kernel[(batch * seq,)](
        q, k, qo, ko, cos, sin, seq, n_q, k.shape[1], rotary_dim // 2, head_dim,
        *strides(q), *strides(k), *strides(qo), *strides(ko), *strides(cos),
        *strides(sin), INTERLEAVED=style == "interleaved",
        BLOCK_HQ=triton.next_power_of_2(n_q), BLOCK_HKV=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
        BLOCK_PASS=triton.next_power_of_2(max(n_pass, 1)), HAS_PASS=n_pass > 0)
    return qo, ko


OPS = {"rotary": rotary}


def register(registry) -> None:
    """Register the rotary kernel for CUDA in fp32/fp16/bf16."""
    for op, fn in OPS.items():
        registry.register(op, BACKEND, fn, dtypes=DTYPES, device_types=DEVICE_TYPES)

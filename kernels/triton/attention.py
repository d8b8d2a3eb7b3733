"""Attention Triton kernels for CUDA: attention_prefill (flash-attention style),
attention_decode (split-K / flash-decoding) and attention_chunks (a served mixed step's prompt
chunks, each token a decode query of the same kernels over its slot's row).

Contracts (shapes, masks, GQA, ALiBi, sliding windows, attention sinks, zero rows) are those of
``shardwise.kernels.reference.attention``; every launcher validates with the reference's checks.
A sink is one more "key" of score ``sinks[h]`` and value 0: prefill starts each row's streaming
softmax from it (running max ``sinks[h]``, sum 1), decode adds it once, in the reduction of the
splits.
Math is float32 inside the kernels; results are rounded to the input dtype once. Attention
matmuls run on tensor cores in fp16/bf16 (the probabilities are rounded to the value dtype before
``P @ V``, as every flash kernel does) and in exact IEEE float32 for fp32 inputs (no TF32).

Importing this module imports triton; it is imported by ``register`` of the triton backend only.
Under ``TRITON_INTERPRET=1`` (CPU tests) dots are done in float32, because the interpreter's
bf16 ``tl.dot`` is wrong; the operands are rounded exactly as on a GPU first.

Differences from the reference on invalid input (checking would need a device sync): decode
clamps ``starts``/``lengths`` to ``0..max_tokens`` instead of raising; it never reads outside
the tensors. (``kv_cache_write`` is in :mod:`.kv_cache`.)
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from shardwise.errors import KernelError
from shardwise.kernels.reference import attention as ref

from . import DEVICE_TYPES, DTYPES
from .common import same_device, strides

BACKEND = "triton"
#: Largest head_dim the attention kernels hold in one tile.
MAX_HEAD_DIM = 256
#: Decode: fewest cache tokens one split handles (splitting finer costs more in the reduction).
MIN_SPLIT_TOKENS = 128
#: Decode: programs to aim for per streaming multiprocessor, so one sequence fills the GPU.
PROGRAMS_PER_SM = 2
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ----- shared device helpers ------------------------------------------------------------------


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """a @ b with a float32 result; IEEE float32 operands when F32 (fp32 inputs, interpreter)."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def _online_softmax_step(s, m, l, acc, v, F32: tl.constexpr):
    """One key tile of the streaming softmax.

    s: [M, N] float32 scores (-inf where not visible); m, l: [M] running max and sum; acc: [M, D]
    running unnormalized output; v: [N, D] the tile's values. A row with no visible key so far
    keeps m = -inf, l = 0, acc = 0 (its exponent is taken against 0 instead of -inf: no NaN).
    """
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)  # [M]
    p = tl.exp(s - m_safe[:, None])  # [M, N]
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32)  # p rounded like on a GPU
    return m_new, l, acc


def _dot_f32(dtype: torch.dtype) -> bool:
    """Whether kernels must do their dots in IEEE float32 (see module docstring)."""
    return _INTERPRET or dtype == torch.float32


def _block_d(head_dim: int) -> int:
    """Tile width along head_dim: a power of two, at least 16 (tl.dot's minimum)."""
    if not 0 < head_dim <= MAX_HEAD_DIM:
        raise KernelError(f"triton attention kernels take head_dim 1..{MAX_HEAD_DIM}, got "
                          f"{head_dim}; use the reference")
    return max(16, triton.next_power_of_2(head_dim))


def supports_head_dim(*, device_type: str, dtype: torch.dtype, head_dim: int | None = None,
                      **_shape) -> bool:
    """Shape predicate for ``resolve(..., head_dim=)``: the kernels hold a head in one tile."""
    return head_dim is None or 0 < head_dim <= MAX_HEAD_DIM


# ----- prefill: flash attention ---------------------------------------------------------------


@triton.jit
def _prefill_kernel(Q, K, V, O, MASK, KPOS, SLOPES, SINKS, q_len, kv_len, n_q, group, head_dim,
                    scale,
                    window, sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t,
                    sv_d, so_b, so_h, so_t, so_d, sm_b, sm_t, skp_b, skp_t,
                    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ALIBI: tl.constexpr,
                    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, F32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (batch, q head) x BLOCK_M queries, streaming over the key tiles its
    queries may see: up to the last query (causal) and from the first query's window on. With
    sinks each row starts from the head's sink (max = sink, sum = 1, output 0)."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // n_q, bh % n_q
    kvh = h // group
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    qmask = (offs_m < q_len)[:, None] & dmask[None, :]
    q = tl.load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + dims[None, :] * sq_d,
                mask=qmask, other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = offs_m + (kv_len - q_len)  # causal: bottom-right aligned
    lo = 0
    hi = kv_len
    if CAUSAL:
        hi = tl.minimum(kv_len, (tl.program_id(1) + 1) * BLOCK_M + kv_len - q_len)
    if HAS_WINDOW:  # tiles wholly before the first query's window are skipped (tile-aligned)
        lo = tl.maximum(0, tl.program_id(1) * BLOCK_M + kv_len - q_len - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h).to(tl.float32)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the sink: a key of score sinks[h] and value 0, seen by every query
        m = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINKS + h).to(tl.float32)
        l = l + 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * sk_b + kvh * sk_h + dims[None, :] * sk_d
    v_base = V + b * sv_b + kvh * sv_h + dims[None, :] * sv_d
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < kv_len
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_base + offs_n[:, None] * sk_t, mask=kvmask, other=0.0)  # [BLOCK_N, D]
        s = _dot(q, tl.trans(k), F32) * scale  # [BLOCK_M, BLOCK_N]
        visible = nmask[None, :] & (offs_m < q_len)[:, None]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:  # the query's window: keys q_pos - window < j
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        if HAS_MASK:
            keep = tl.load(MASK + b * sm_b + offs_n * sm_t, mask=nmask, other=0) != 0
            visible = visible & keep[None, :]
        if HAS_ALIBI:
            if HAS_MASK:  # BLOOM's positions: valid keys before this one
                kpos = tl.load(KPOS + b * skp_b + offs_n * skp_t, mask=nmask, other=0)
            else:
                kpos = offs_n
            s = s + slope * kpos.to(tl.float32)[None, :]
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(v_base + offs_n[:, None] * sv_t, mask=kvmask, other=0.0)
        m, l, acc = _online_softmax_step(s, m, l, acc, v, F32)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # rows with no visible key: 0
    tl.store(O + b * so_b + h * so_h + offs_m[:, None] * so_t + dims[None, :] * so_d,
             out.to(O.dtype.element_ty), mask=qmask)


def _prefill_config(q_len: int, kv_len: int, block_d: int, dtype: torch.dtype,
                    device: torch.device):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Tiles shrink to the sequence for tiny inputs
    off the GPU (the interpreter pays per element of a padded tile); float32 tiles are smaller
    so their shared memory (IEEE dots stage 4-byte operands) fits ~99 KB SMs (sm_86/89)."""
    if device.type != "cuda":
        return (max(16, min(64, triton.next_power_of_2(q_len))),
                max(16, min(64, triton.next_power_of_2(kv_len))), 4, 1)
    if dtype == torch.float32:
        return (64, 32, 4, 1) if block_d <= 128 else (32, 32, 4, 1)
    if block_d <= 64:
        return 64, 64, 4, 3
    return (128, 64, 8, 2) if block_d <= 128 else (64, 32, 8, 1)


def _prefill_mask(key_padding_mask, alibi_slopes, batch, kv_len, device):
    """(mask, key positions) for the kernel: uint8 [batch, kv_len] and int32 [batch, kv_len]
    (the latter only for ALiBi with a mask), or None."""
    if key_padding_mask is None:
        return None, None
    mask = key_padding_mask
    mask = mask.view(torch.uint8) if mask.dtype == torch.bool else (mask != 0).view(torch.uint8)
    kpos = None
    if alibi_slopes is not None:
        kpos = ref.alibi_key_positions(key_padding_mask, batch, kv_len, device).to(torch.int32)
    return mask, kpos


def attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      key_padding_mask: torch.Tensor | None = None,
                      alibi_slopes: torch.Tensor | None = None,
                      scale: float | None = None, window: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Flash-attention prefill; contract of the reference ``attention_prefill``.

    q: [batch, q_heads, q_len, d]; k, v: [batch, kv_heads, kv_len, d] (any strides);
    key_padding_mask [batch, kv_len]; alibi_slopes [q_heads]; window: sliding window or None
    (key tiles before a query tile's windows are not read); sinks [q_heads] or None. Returns
    a contiguous [batch, q_heads, q_len, d] in q.dtype.
    """
    group = ref.check_attention(q, k, v)
    ref.check_prefill(q, k, causal, key_padding_mask, alibi_slopes, window, sinks)
    batch, n_q, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    has_window = window is not None and window < kv_len  # else it hides no key
    block_d = _block_d(head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    mask, kpos = _prefill_mask(key_padding_mask, alibi_slopes, batch, kv_len, q.device)
    slopes = alibi_slopes.float().contiguous() if alibi_slopes is not None else None
    sink_logits = sinks.float().contiguous() if sinks is not None else None
    block_m, block_n, warps, stages = _prefill_config(q_len, kv_len, block_d, q.dtype,
                                                       q.device)
    mask_strides = mask.stride() if mask is not None else (0, 0)
    kpos_strides = kpos.stride() if kpos is not None else (0, 0)
    _prefill_kernel[(batch * n_q, triton.cdiv(q_len, block_m))](
        q, k, v, out, mask if mask is not None else q, kpos if kpos is not None else q,
        slopes if slopes is not None else q, sink_logits if sink_logits is not None else q,
        q_len, kv_len, n_q, group, head_dim,
        head_dim ** -0.5 if scale is None else scale, window if has_window else 0,
        *strides(q), *strides(k), *strides(v), *strides(out), *mask_strides,
        *kpos_strides, CAUSAL=causal, HAS_MASK=mask is not None, HAS_ALIBI=slopes is not None,
        HAS_WINDOW=has_window, HAS_SINKS=sink_logits is not None, F32=_dot_f32(q.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, num_warps=warps, num_stages=stages)
    return out


# ----- decode: split-K flash decoding ---------------------------------------------------------


@triton.jit
def _decode_split_kernel(Q, K, V, LEN, STARTS, ROWS, SLOPES, M_OUT, L_OUT, ACC, max_tokens,
                         group, head_dim, chunk, scale, sq_b, sq_h, sq_d, sk_b, sk_h, sk_t, sk_d,
                         sv_b, sv_h, sv_t, sv_d, n_q, n_splits,
                         HAS_STARTS: tl.constexpr, HAS_ROWS: tl.constexpr,
                         HAS_ALIBI: tl.constexpr, F32: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, kv head, split): the ``group`` query heads of one kv head over cache tokens
    [split * chunk, (split + 1) * chunk) ∩ [starts[b], lengths[b]) of cache row b (with
    ``HAS_ROWS``: of row ``rows[b]``, a query of a prompt chunk). Writes the split's running
    max m, sum l ([batch, q_heads, splits]) and unnormalized output ([batch, q_heads, splits,
    d])."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = b
    if HAS_ROWS:
        row = tl.load(ROWS + b).to(tl.int64)
    length = tl.minimum(tl.load(LEN + b).to(tl.int32), max_tokens)  # never past the cache
    start = split * chunk
    if HAS_STARTS:  # never before the sequence's first valid token (nor before 0)
        start = tl.maximum(start, tl.load(STARTS + b).to(tl.int32))
    end = tl.minimum(split * chunk + chunk, length)
    heads = kvh * group + tl.arange(0, BLOCK_H)  # [BLOCK_H] query heads; rows >= group: padding
    hmask = tl.arange(0, BLOCK_H) < group
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + dims[None, :] * sq_d,
                mask=hmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    slope = tl.zeros([BLOCK_H], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(SLOPES + heads, mask=hmask, other=0.0).to(tl.float32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = K + row * sk_b + kvh * sk_h + dims[None, :] * sk_d
    v_base = V + row * sv_b + kvh * sv_h + dims[None, :] * sv_d
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end  # positions >= length are never loaded
        kvmask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_base + offs_n[:, None] * sk_t, mask=kvmask, other=0.0)
        s = _dot(q, tl.trans(k), F32) * scale  # [BLOCK_H, BLOCK_N]
        if HAS_ALIBI:
            s = s + slope[:, None] * offs_n.to(tl.float32)[None, :]
        s = tl.where(nmask[None, :], s, float("-inf"))
        v = tl.load(v_base + offs_n[:, None] * sv_t, mask=kvmask, other=0.0)
        m, l, acc = _online_softmax_step(s, m, l, acc, v, F32)
    part = (b * n_q + heads) * n_splits + split  # [BLOCK_H] index into [batch, q_heads, splits]
    tl.store(M_OUT + part, m, mask=hmask)
    tl.store(L_OUT + part, l, mask=hmask)
    tl.store(ACC + part[:, None] * head_dim + dims[None, :], acc,
             mask=hmask[:, None] & dmask[None, :])


@triton.jit
def _decode_reduce_kernel(M_IN, L_IN, ACC, O, SINKS, n_q, n_splits, head_dim, so_b, so_h, so_d,
                          HAS_SINKS: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """Program (b, q head): combine the splits' partial softmaxes into the output row; with
    sinks the head's sink joins the denominator here, once."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    smask = splits < n_splits
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    part = (b * n_q + h) * n_splits + splits  # [BLOCK_S]
    m = tl.load(M_IN + part, mask=smask, other=float("-inf"))
    l = tl.load(L_IN + part, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits: 0
    acc = tl.load(ACC + part[:, None] * head_dim + dims[None, :],
                  mask=smask[:, None] & dmask[None, :], other=0.0)
    den = tl.sum(w * l, 0)
    if HAS_SINKS:  # a key of score sink and value 0: the denominator only
        den = den + tl.exp(sink - m_max)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(den == 0.0, 1.0, den)  # length 0: zeros
    tl.store(O + b * so_b + h * so_h + dims * so_d, out.to(O.dtype.element_ty), mask=dmask)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(batch: int, kv_heads: int, max_tokens: int, block_n: int,
                  device: torch.device, num_splits: int | None = None) -> tuple[int, int]:
    """(splits, chunk): how many programs share each sequence's cache, and the cache tokens each
    handles (a multiple of ``block_n``). Depends only on shapes, so a captured graph stays valid.

    Aims at ``PROGRAMS_PER_SM`` programs per SM over batch x kv_heads x splits, with at least
    ``MIN_SPLIT_TOKENS`` tokens a split; ``num_splits`` overrides (tests force several splits).
    """
    if num_splits is None:
        sms = _sm_count(device.index or 0) if device.type == "cuda" else 4
        want = triton.cdiv(PROGRAMS_PER_SM * sms, batch * kv_heads)
        num_splits = min(want, triton.cdiv(max_tokens, max(MIN_SPLIT_TOKENS, block_n)))
    num_splits = max(1, min(num_splits, triton.cdiv(max_tokens, block_n)))
    chunk = triton.cdiv(triton.cdiv(max_tokens, num_splits), block_n) * block_n
    return triton.cdiv(max_tokens, chunk), chunk


def _decode_stages(dtype: torch.dtype, device: torch.device) -> int:
    """Pipelining depth of the decode loop: float32 tiles stay single-buffered (shared memory)."""
    return 2 if device.type == "cuda" and dtype != torch.float32 else 1


def _decode_block_n(max_tokens: int, device: torch.device) -> int:
    if device.type == "cuda":
        return 64
    return max(16, min(32, triton.next_power_of_2(max_tokens)))


def _window_starts(lengths: torch.Tensor, starts: torch.Tensor | None, window: int | None,
                   max_tokens: int) -> torch.Tensor | None:
    """The first cache position each sequence's new token sees, [batch] on the device:
    ``max(starts, min(lengths, max_tokens) - window)`` (device ops only: no sync, graph-safe;
    may be negative, the kernel starts at 0 then). ``starts`` as is without a window that
    could hide a token (``window >= max_tokens``)."""
    if window is None or window >= max_tokens:
        return starts
    first = lengths.clamp(max=max_tokens) - window  # [batch]: the query sits at lengths - 1
    return first if starts is None else torch.maximum(starts, first)


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, *, alibi_slopes: torch.Tensor | None = None,
                     scale: float | None = None, starts: torch.Tensor | None = None,
                     window: int | None = None, sinks: torch.Tensor | None = None,
                     num_splits: int | None = None,
                     block_n: int | None = None) -> torch.Tensor:
    """Split-K decode attention; contract of the reference ``attention_decode``.

    q: [batch, q_heads, 1, d]; k_cache, v_cache: [batch, kv_heads, max_tokens, d] (any
    strides); lengths, starts: [batch] int32/int64 on the device (not checked, so no device
    sync and it can be captured in a CUDA graph: positions outside max(starts, 0) ..
    min(lengths, max_tokens) - 1 are simply not read). window: sliding window or None, applied
    by raising the starts on the device (:func:`_window_starts`; splits wholly before a
    window do no work). sinks: [q_heads] or None, added in the reduction of the splits.
    ``num_splits``/``block_n`` override the split heuristic (:func:`decode_splits`) and the key
    tile. Returns [batch, q_heads, 1, d].
    """
    ref.check_decode(q, k_cache, v_cache, lengths, starts)
    _check_decode_options(q, window, alibi_slopes, sinks, lengths=lengths, starts=starts,
                          k_cache=k_cache, v_cache=v_cache)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return _decode(q, out, k_cache, v_cache, lengths, starts, None, alibi_slopes=alibi_slopes,
                   scale=scale, window=window, sinks=sinks, num_splits=num_splits,
                   block_n=block_n)


def _check_decode_options(q: torch.Tensor, window: int | None,
                          alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
                          **tensors: torch.Tensor | None) -> None:
    """The reference's checks of the options, and every tensor on q's device."""
    ref.check_window(window)
    ref.check_sinks(sinks, q.shape[1], alibi_slopes)
    same_device(q, sinks=sinks, **tensors)
    if alibi_slopes is not None and alibi_slopes.shape != (q.shape[1],):
        raise KernelError(f"alibi_slopes must be [q_heads={q.shape[1]}], got "
                          f"{tuple(alibi_slopes.shape)}")


def _decode(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            lengths: torch.Tensor, starts: torch.Tensor | None, rows: torch.Tensor | None, *,
            alibi_slopes, scale, window, sinks, num_splits, block_n) -> torch.Tensor:
    """Launch the split and reduce kernels: query b ([batch, q_heads, 1, d], any strides)
    attends to cache row b (``rows``: row ``rows[b]``) over its range; written into ``out``
    (q's shape, any strides), which is returned."""
    batch, n_q, _, head_dim = q.shape
    n_kv, max_tokens = k_cache.shape[1:3]
    block_d = _block_d(head_dim)
    if out.numel() == 0 or max_tokens == 0:
        return out.zero_()
    group = n_q // n_kv
    starts = _window_starts(lengths, starts, window, max_tokens)
    block_n = block_n or _decode_block_n(max_tokens, q.device)
    splits, chunk = decode_splits(batch, n_kv, max_tokens, block_n, q.device, num_splits)
    m = torch.empty(batch, n_q, splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(batch, n_q, splits, head_dim, dtype=torch.float32, device=q.device)
    slopes = alibi_slopes.float().contiguous() if alibi_slopes is not None else m
    q_str = (q.stride(0), q.stride(1), q.stride(3))
    _decode_split_kernel[(batch, n_kv, splits)](
        q, k_cache, v_cache, lengths, starts if starts is not None else lengths,
        rows if rows is not None else lengths, slopes, m, l, acc, max_tokens, group, head_dim,
        chunk, head_dim ** -0.5 if scale is None else scale,
        *q_str, *strides(k_cache), *strides(v_cache), n_q, splits,
        HAS_STARTS=starts is not None, HAS_ROWS=rows is not None,
        HAS_ALIBI=alibi_slopes is not None,
        F32=_dot_f32(q.dtype), BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=block_d, num_warps=4, num_stages=_decode_stages(q.dtype, q.device))
    sink_logits = sinks.float().contiguous() if sinks is not None else m
    _decode_reduce_kernel[(batch, n_q)](
        m, l, acc, out, sink_logits, n_q, splits, head_dim, out.stride(0), out.stride(1),
        out.stride(3), HAS_SINKS=sinks is not None, BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=block_d)
    return out


# ----- a served mixed step's prompt chunks: one decode query per chunk token ------------------


@triton.jit
def _chunk_tables_kernel(SPANS, ROWS, LENS, n_chunks, tokens, rows, BLOCK: tl.constexpr):
    """Program over ``BLOCK`` packed chunk tokens: from spans [chunks, 3] of (slot, past, n),
    the cache row each token reads (ROWS) and how many of its positions (LENS: its own
    position + 1, causal; 0 for padding and for spans outside the cache's rows)."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = tl.zeros([BLOCK], tl.int64)
    length = tl.zeros([BLOCK], tl.int64)
    first = tl.zeros([1], tl.int64)  # the chunk's first packed token
    for j in range(n_chunks):
        slot = tl.load(SPANS + j * 3)
        past = tl.load(SPANS + j * 3 + 1)
        n = tl.load(SPANS + j * 3 + 2)
        inside = (t >= first) & (t < first + n) & (slot >= 0) & (slot < rows) & (past >= 0)
        row = tl.where(inside, slot, row)
        length = tl.where(inside, past + (t - first) + 1, length)
        first += tl.maximum(n, 0)
    mask = t < tokens
    tl.store(ROWS + t, row, mask=mask)
    tl.store(LENS + t, length, mask=mask)


def attention_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     spans: torch.Tensor, *, scale: float | None = None,
                     window: int | None = None, alibi_slopes: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None, num_splits: int | None = None,
                     block_n: int | None = None) -> torch.Tensor:
    """A served mixed step's prompt chunks; contract of the reference ``attention_chunks``.

    q: [1, q_heads, tokens, d]; caches [rows, kv_heads, max_tokens, d]; spans [chunks, 3] int64
    on the device, read there (no device sync: the op can be captured in a CUDA graph and
    replayed with other spans). Each chunk token is one query of the split-K decode kernels
    over its slot's row and its own position + 1 tokens (causal: the chunk's keys are already
    in the cache); a small kernel first turns the spans into each token's row and length.
    Differs from the reference on invalid spans as decode does: nothing is raised, a span
    outside the cache's rows gives zeros, lengths are clamped to max_tokens.
    """
    ref.check_chunk_shapes(q, k_cache, v_cache, spans)
    _check_decode_options(q, window, alibi_slopes, sinks, spans=spans, k_cache=k_cache,
                          v_cache=v_cache)
    tokens = q.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    rows = torch.empty(tokens, dtype=torch.int64, device=q.device)
    lengths = torch.empty_like(rows)
    block = min(128, max(16, triton.next_power_of_2(tokens)))
    _chunk_tables_kernel[(triton.cdiv(tokens, block),)](
        spans.contiguous(), rows, lengths, spans.shape[0], tokens, k_cache.shape[0], BLOCK=block)

    def by_token(t: torch.Tensor) -> torch.Tensor:  # [1, h, tokens, d] → [tokens, h, 1, d]
        return t[0].transpose(0, 1)[:, :, None]

    _decode(by_token(q), by_token(out), k_cache, v_cache, lengths, None, rows,
            alibi_slopes=alibi_slopes, scale=scale, window=window, sinks=sinks,
            num_splits=num_splits, block_n=block_n)
    return out


OPS = {"attention_prefill": attention_prefill, "attention_decode": attention_decode,
       "attention_chunks": attention_chunks}
#: read their ranges on the device: a CUDA graph replays them with new lengths or spans
CAPTURABLE = frozenset({"attention_decode", "attention_chunks"})


def register(registry) -> None:
    """Register the attention kernels for CUDA in fp32/fp16/bf16; they hold one head per tile, so
    they refuse head_dim > MAX_HEAD_DIM when resolved with ``head_dim=``."""
    for op, fn in OPS.items():
        registry.register(op, BACKEND, fn, dtypes=DTYPES, device_types=DEVICE_TYPES,
                          supports=supports_head_dim,
                          capturable=op in CAPTURABLE)

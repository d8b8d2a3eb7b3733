"""The ``cpu`` backend's attention: ATen's fused attention on CPU tensors.

Contracts are those of ``shardwise.kernels.reference.attention`` (shapes, GQA, masks, ALiBi, sliding
windows, zero rows). Only what measured faster than the reference is registered (``REGISTERED``),
per dtype; the speed-ups, their command and machine are in benchmarks/README.md, "CPU kernels
against the reference":

* attention_prefill (fp32, bf16): ``F.scaled_dot_product_attention`` (ATen's flash kernel for CPU,
  GQA via ``enable_gqa``, no [.., q_len, kv_len] float32 scores): faster in fp32 and bf16 (ALiBi and
  sliding windows included). fp16 is not registered: not reliably faster at 128 tokens. Causal
  without mask/ALiBi/window uses ``is_causal``; a causal prompt chunk after cached tokens
  (bottom-right, with or without a window) and nothing else, the reference's bool mask; otherwise
  one additive float32 mask carries the causal/padding/sliding-window ``-inf`` and the ALiBi bias.
  The bias is taken relative to the query's own key position (softmax is shift-invariant per row, so
  this equals BLOOM's absolute bias) to keep it small near the diagonal. Query rows with no visible
  key are computed unmasked, then zeroed.
* attention_decode (fp32, bf16, fp16): the same kernel on each sequence's valid cache range
  (one call when all ranges agree, else one per sequence; a sliding window shortens the ranges),
  with the query heads of a kv head as its query rows; positions outside a range are never
  read; ATen's fused kernel on those ranges is many times faster than the reference in every
  dtype. Registered as
  capturable: under ``torch.compile`` (the CPU graph strategy) it is the custom op
  ``shardwise::cpu_attention_decode``, opaque to the compiler, so the compiled decode step still
  reads each sequence's ranges from ``lengths``/``starts`` at run time instead of attending,
  masked, over the whole static cache.
* attention_chunks (fp32, bf16, fp16): a served mixed step's prompt chunks, packed in one row
  (``shardwise.inject.slots.PackedRows``): the native op ``cpu_chunk_attention`` runs each chunk
  token as a decode query over its slot's cache row (the decode kernel's loops, no mask built, no
  Python at replay); without the extension, this backend's ``attention_prefill`` per chunk in the
  reference's opaque op ``shardwise::chunks_by_prefill``. Both capturable. Before it, the mixed step
  called ``attention_prefill`` per chunk and layer from a Python op at every replay
  (benchmarks/README.md, "The decode and chunk attention kernels").
* Attention sinks (all three ops): the same flash kernel also gives each row's log-sum-exp ``lse``
  (ATen's private CPU entry point, through ``shardwise._torch_private``); a sink adds
  ``exp(sink)`` to the row's denominator ``exp(lse)``, so the output is scaled by
  ``sigmoid(lse - sink)`` per row: no scores materialised, the keys still read once. That entry
  point has no GQA flag: the ``group`` query heads of a kv head become its query rows (their
  mask rows repeated), as decode does anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise import _torch_private as private
from shardwise.kernels.cpu import native
from shardwise.kernels.reference import attention as ref

from . import DEVICE_TYPES, DTYPES

BACKEND = "cpu"


def attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      key_padding_mask: torch.Tensor | None = None,
                      alibi_slopes: torch.Tensor | None = None,
                      scale: float | None = None, window: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill through ATen's fused attention; contract of the reference ``attention_prefill``.

    q: [batch, q_heads, q_len, d]; k, v: [batch, kv_heads, kv_len, d]; key_padding_mask
    [batch, kv_len]; alibi_slopes [q_heads]; window: sliding window or None; sinks [q_heads]
    or None. Returns [batch, q_heads, q_len, d].
    """
    group = ref.check_attention(q, k, v)
    ref.check_prefill(q, k, causal, key_padding_mask, alibi_slopes, window, sinks)
    q_len, kv_len = q.shape[2], k.shape[2]
    if window is not None and window >= kv_len:
        window = None  # covers every key a causal query sees: no restriction
    if key_padding_mask is None and alibi_slopes is None and window is None and sinks is None \
            and (q_len == kv_len or not causal):
        return _sdpa(q, k, v, None, causal and q_len > 1, scale, group)
    if causal and key_padding_mask is None and alibi_slopes is None and sinks is None:
        # a prompt chunk after cached tokens (bottom-right causal, maybe windowed): no query
        # row is empty, so SDPA takes the bool mask as it is, without the empty-row check and
        # the additive bias built below (benchmarks/README.md, "The chunks' attention mask")
        visible = ref.visible_keys(1, q_len, kv_len, True, None, q.device, window)
        return _sdpa(q, k, v, visible, False, scale, group)
    visible = ref.visible_keys(q.shape[0], q_len, kv_len, causal, key_padding_mask, q.device,
                               window)
    dead = ~visible.any(-1, keepdim=True)  # [batch, 1, q_len, 1]: rows that see no key
    if key_padding_mask is not None:  # (only a mask can hide a query's own key)
        visible = visible | dead  # computed unmasked (finite), zeroed below
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=q.device)
    bias.masked_fill_(~visible, float("-inf"))
    if alibi_slopes is not None:
        bias = bias + _alibi_bias(alibi_slopes, key_padding_mask, q.shape[0], q_len, kv_len,
                                  q.device)
    if sinks is not None:
        out = _sdpa_sinks(q, k, v, bias, scale, group, sinks)
    else:
        out = _sdpa(q, k, v, bias, False, scale, group)
    return out.masked_fill_(dead, 0.0) if key_padding_mask is not None else out


def _alibi_bias(slopes, key_padding_mask, batch, q_len, kv_len, device) -> torch.Tensor:
    """ALiBi bias [batch, q_heads, q_len, kv_len] float32, relative to each query's own key
    position (a per-row shift of BLOOM's absolute bias: same softmax, smaller numbers)."""
    pos = ref.alibi_key_positions(key_padding_mask, batch, kv_len, device).float()  # [b, kv]
    q_pos = pos[:, kv_len - q_len:]  # [batch, q_len]: queries are the last q_len positions
    rel = pos[:, None, :] - q_pos[:, :, None]  # [batch, q_len, kv_len]
    return slopes.float()[None, :, None, None] * rel[:, None]


def _sdpa(q, k, v, mask, causal, scale, group):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          scale=scale, enable_gqa=group > 1)


def _sdpa_sinks(q, k, v, bias, scale, group, sinks):
    """Attention with sinks: q [b, q_heads, L, d], k, v [b, kv_heads, n, d], ``bias`` float32
    [b, 1 or q_heads, L, n] (-inf: hidden), sinks [q_heads] → [b, q_heads, L, d] in q.dtype.

    Each kv head's ``group`` query heads are its query rows ([b, kv_heads, group * L, d]); the
    flash kernel's log-sum-exp ``lse`` then scales each row by ``sigmoid(lse - sink)``
    (= exp(lse) / (exp(lse) + exp(sink))).
    """
    b, q_heads, q_len, d = q.shape
    kv_heads, n = k.shape[1], k.shape[2]
    rows = q.reshape(b, kv_heads, group * q_len, d)  # query head h = kv head h // group
    if bias.shape[1] == 1:  # [b, 1, L, n]: the same mask rows for every head of a group
        bias = bias[:, :, None].expand(b, 1, group, q_len, n).reshape(b, 1, group * q_len, n)
    else:  # [b, q_heads, L, n] (ALiBi): per head
        bias = bias.reshape(b, kv_heads, group * q_len, n)
    out, lse = private.sdpa_cpu_with_lse(rows, k, v, bias, scale)
    keep = torch.sigmoid(lse.reshape(b, q_heads, q_len) - sinks.float()[None, :, None])
    return (out.reshape(b, q_heads, q_len, d).float() * keep[..., None]).to(q.dtype)


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, *, alibi_slopes: torch.Tensor | None = None,
                     scale: float | None = None, starts: torch.Tensor | None = None,
                     window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode through ATen's fused attention on each valid cache range; contract of the
    reference ``attention_decode``: q [batch, q_heads, 1, d], caches [batch, kv_heads,
    max_tokens, d], lengths and starts [batch], window: sliding window or None, sinks
    [q_heads] or None. Returns [batch, q_heads, 1, d]. Where the native extension builds, its C++
    op (scores and softmax in float32); else ATen's fused attention per range. Under
    ``torch.compile`` either is one opaque custom op (the ranges are host ints read from
    ``lengths``/``starts``: a graph break if traced)."""
    compiling = torch.compiler.is_compiling()
    if _native_decode():  # C++: a few us a call where the Python op below costs ~50
        if not compiling:  # eagerly, the reference's checks and errors first
            ref.check_decode(q, k_cache, v_cache, lengths, starts)
            ref.check_sinks(sinks, q.shape[1], alibi_slopes)
            ref.decode_ranges(lengths, starts, k_cache.shape[2], ref.check_window(window))
        return torch.ops.shardwise_native.cpu_attention_decode(
            q, k_cache, v_cache, lengths, starts, alibi_slopes, scale, window, sinks)
    if compiling:
        return torch.ops.shardwise.cpu_attention_decode(q, k_cache, v_cache, lengths, starts,
                                                        alibi_slopes, scale, window, sinks)
    return _attention_decode(q, k_cache, v_cache, lengths, alibi_slopes, scale, starts, window,
                             sinks)


def _native_decode() -> bool:
    """Whether the native decode op (``kernels/cpu/native/attention.cpp``) is usable, building
    the extension on the first eager call. While a step is traced it reads what the build gave
    (a global dynamo reads as a constant): the CPU graph strategy builds it before any capture,
    and its precompiled steps are keyed by it (:func:`native.key_text`)."""
    if torch.compiler.is_compiling():
        return native.LOADED
    return native.load(respect_choice=False)


@torch.library.custom_op("shardwise::cpu_attention_decode", mutates_args=(), device_types="cpu")
def _decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               lengths: torch.Tensor, starts: torch.Tensor | None,
               alibi_slopes: torch.Tensor | None, scale: float | None,
               window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`attention_decode` as an op the compiler calls without tracing into it (``sinks``
    last and optional: callers written before it keep working). Its output is contiguous
    whatever ``q``'s strides, as its fake kernel says."""
    return _attention_decode(q, k_cache, v_cache, lengths, alibi_slopes, scale, starts, window,
                             sinks).contiguous()


@_decode_op.register_fake
def _(q, k_cache, v_cache, lengths, starts, alibi_slopes, scale, window, sinks=None):
    return q.new_empty(q.shape)  # contiguous [batch, q_heads, 1, d], as the real op returns


def _attention_decode(q, k_cache, v_cache, lengths, alibi_slopes, scale, starts, window,
                      sinks=None):
    group = ref.check_decode(q, k_cache, v_cache, lengths, starts)
    ref.check_sinks(sinks, q.shape[1], alibi_slopes)
    ranges = ref.decode_ranges(lengths, starts, k_cache.shape[2], ref.check_window(window))
    if ranges and len(set(ranges)) == 1 and ranges[0][1] > ranges[0][0]:  # one call for all
        return _decode_range(q, k_cache, v_cache, *ranges[0], alibi_slopes, scale, group, sinks)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for b, (s, n) in enumerate(ranges):
        if n > s:
            out[b:b + 1] = _decode_range(q[b:b + 1], k_cache[b:b + 1], v_cache[b:b + 1], s, n,
                                         alibi_slopes, scale, group, sinks)
    return out


def _decode_range(q, k_cache, v_cache, s, n, alibi_slopes, scale, group, sinks=None):
    """Attention of q over cache positions s..n-1 (views: nothing outside them is read).

    The ``group`` query heads of a kv head become that head's query rows ([batch, kv_heads,
    group, d]): one matrix product per kv head reads its keys once (faster than
    ``enable_gqa``: benchmarks/README.md, "CPU kernels against the reference"). A 4-d bias
    keeps ATen on its fused kernel (3-d falls back to math). With ``sinks`` the same kernel's
    log-sum-exp scales each head's row (see :func:`_sdpa_sinks`).
    """
    batch, q_heads, _, d = q.shape
    kv_heads = q_heads // group
    bias = None
    if alibi_slopes is not None:  # relative to the newest token: slope * (j - (n - 1))
        rel = torch.arange(s + 1 - n, 1, device=q.device, dtype=torch.float32)  # [n - s]
        bias = (alibi_slopes.float()[:, None] * rel).view(1, kv_heads, group, n - s)
    rows = q.reshape(batch, kv_heads, group, d)
    if sinks is not None:
        out, lse = private.sdpa_cpu_with_lse(rows, k_cache[:, :, s:n], v_cache[:, :, s:n], bias,
                                             scale)
        keep = torch.sigmoid(lse.reshape(batch, q_heads) - sinks.float())  # [batch, q_heads]
        return (out.reshape(batch, q_heads, 1, d).float() * keep[:, :, None, None]).to(q.dtype)
    out = F.scaled_dot_product_attention(rows, k_cache[:, :, s:n], v_cache[:, :, s:n],
                                         attn_mask=bias, scale=scale)
    return out.view(batch, q_heads, 1, d)


def attention_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     spans: torch.Tensor, *, scale: float | None = None,
                     window: int | None = None, alibi_slopes: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A served mixed step's prompt chunks; contract of the reference ``attention_chunks``: q
    [1, q_heads, tokens, d], caches [rows, kv_heads, max_tokens, d], spans [chunks, 3] int64
    ``(slot, past, n)``. Where the native extension builds, its C++ op (each chunk token a
    decode query over its slot's row, the decode kernel's loops); else this backend's
    ``attention_prefill`` per chunk (the reference's ``chunks_by_prefill``). Either is one
    opaque op under ``torch.compile``, reading
    ``spans`` at run time, so a captured mixed step calls it with no Python."""
    if _native_decode():
        if not torch.compiler.is_compiling():  # eagerly, the reference's checks and errors first
            ref.check_chunks(q, k_cache, v_cache, spans)
            ref.check_sinks(sinks, q.shape[1], alibi_slopes)
            ref.check_window(window)
        return torch.ops.shardwise_native.cpu_chunk_attention(q, k_cache, v_cache, spans,
                                                              alibi_slopes, scale, window, sinks)
    return torch.ops.shardwise.chunks_by_prefill(q, k_cache, v_cache, spans, BACKEND, scale,
                                                 window, alibi_slopes, sinks)

#: op → (implementation, dtypes it is registered for): only what measured faster.
REGISTERED = {
    "attention_prefill": (attention_prefill, frozenset({torch.float32, torch.bfloat16})),
    "attention_decode": (attention_decode, DTYPES),
    "attention_chunks": (attention_chunks, DTYPES),
}
#: ops whose implementation may run inside the CPU graph strategy's compiled step
CAPTURABLE = frozenset({"attention_decode", "attention_chunks"})


def register(registry) -> None:
    """Register the CPU attention kernels that beat the reference, each for the dtypes it won."""
    for op, (fn, dtypes) in REGISTERED.items():
        registry.register(op, BACKEND, fn, dtypes=dtypes, device_types=DEVICE_TYPES,
                          capturable=op in CAPTURABLE)

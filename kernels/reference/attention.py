"""Attention (reference): prefill and decode softmax attention, GQA/MQA, ALiBi, sliding windows,
attention sinks.

Pure torch, clear over fast; they are the oracles every backend is tested against. All math is
done in float32 and each result is rounded to the input dtype once, at the end.

Layouts (any strides are accepted; ``d`` = head_dim):

* q: ``[batch, q_heads, q_len, d]``; k, v: ``[batch, kv_heads, kv_len, d]``.
* Grouped-query attention: ``q_heads`` is a multiple of ``kv_heads`` and query head ``h`` reads
  key/value head ``h // (q_heads // kv_heads)`` (HF's ``repeat_kv``). MQA is ``kv_heads == 1``.
* KV cache: ``[batch, kv_heads, max_tokens, d]``, preallocated; sequence ``b`` holds its valid
  tokens at positions ``starts[b] .. lengths[b] - 1`` (starts default 0; > 0 keeps a
  left-padded prompt's pads in front) and anything (even NaN) outside them.
* A query row that may see no key at all (e.g. a left-padding query under a padding mask, or a
  sequence of length 0) gives zeros, never NaN.
* Sliding-window (local) attention, ``window=w``: the query at position ``p`` sees only keys
  ``j`` with ``p - w < j <= p`` (its ``w`` latest positions, itself included; HF's
  ``sliding_window``, GPT-Neo's local layers). Positions are cache/sequence indices, pads
  included, as HF's masks count them.
* Attention sinks, ``sinks=[q_heads]``: a learned logit per query head that joins each row's
  softmax denominator and nothing else (GPT-OSS's ``sinks``, HF ``eager_attention_forward``:
  the scores ``[.., kv_len]`` get one more column holding ``sinks[h]``, the softmax runs over
  ``kv_len + 1`` columns and the last is dropped). In the logits' units (after the scale), not
  scaled; a row that sees no key still gives zeros. Not with ALiBi (a KernelError): softmax
  ignores a per-row shift of the scores, which lets backends take the ALiBi bias relative to
  the query, but a sink's share would change with it; no model has both.

Ops (registered by :func:`register`): ``attention_prefill``, ``attention_decode``,
``attention_chunks`` (a served mixed step's prompt chunks, packed in one row, each over its own
cache row; :func:`chunks_by_prefill` is the same through any backend's prefill, as an opaque
custom op). Helpers (not ops): :func:`alibi_slopes`, :func:`alibi_key_positions`, and the
checks every backend shares.
The cache is written by ``kv_cache_write`` (:mod:`.kv_cache`), rotary and activations live in
:mod:`.rotary` and :mod:`.activations`.
"""

from __future__ import annotations

import math

import torch

from shardwise.errors import KernelError

from .example import randn

BACKEND = "reference"

# ----- helpers shared with the backends --------------------------------------------------------


def alibi_slopes(num_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """ALiBi slopes ``[num_heads]`` float32, as BLOOM (``_get_alibi_slopes``) and the ALiBi paper
    define them, including the interleaved extra slopes when ``num_heads`` is not a power of 2."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = torch.pow(torch.tensor(base, device=device),
                       torch.arange(1, 1 + closest, device=device, dtype=torch.int32))
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        extra = min(closest, num_heads - closest)
        powers = torch.arange(1, 1 + 2 * extra, 2, device=device, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(torch.tensor(extra_base, device=device), powers)])
    return slopes.float()


def alibi_key_positions(key_padding_mask: torch.Tensor | None, batch: int, kv_len: int,
                        device: torch.device) -> torch.Tensor:
    """Key positions the ALiBi bias multiplies, ``[batch, kv_len]`` int64.

    Without a mask the key index; with a key padding mask the number of valid keys before the key
    (``(cumsum(mask) - 1) * mask``, BLOOM's ``build_alibi_tensor``), so a left-padded sequence
    counts from its first real token. Softmax is shift-invariant, so both agree whenever a row's
    valid keys are contiguous; they differ only for masks with holes, where this follows BLOOM.
    """
    if key_padding_mask is None:
        return torch.arange(kv_len, device=device).expand(batch, kv_len)
    mask = key_padding_mask.long()
    return (mask.cumsum(-1) - 1) * mask


def check_gqa(q_heads: int, kv_heads: int) -> int:
    """Query heads per key/value head; raises KernelError unless ``kv_heads`` divides them."""
    if kv_heads <= 0 or q_heads % kv_heads:
        raise KernelError(f"grouped-query attention needs q_heads ({q_heads}) to be a multiple "
                          f"of kv_heads ({kv_heads})")
    return q_heads // kv_heads


def check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate q/k/v layouts for attention; returns the GQA group size."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or \
            q.shape[-1] != k.shape[-1]:
        raise KernelError(f"attention takes q [batch, q_heads, q_len, d] and k, v [batch, "
                          f"kv_heads, kv_len, d]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                          f"v {tuple(v.shape)}")
    return check_gqa(q.shape[1], k.shape[1])


def check_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 lengths: torch.Tensor, starts: torch.Tensor | None = None) -> int:
    """Validate decode inputs (one query token per sequence); returns the GQA group size."""
    group = check_attention(q, k_cache, v_cache)
    if q.shape[2] != 1:
        raise KernelError(f"attention_decode takes one query token per sequence, q [batch, "
                          f"q_heads, 1, d]; got {tuple(q.shape)} (use attention_prefill)")
    for name, t in (("lengths", lengths), ("starts", starts)):
        if t is not None and (t.shape != (q.shape[0],) or
                              t.dtype not in (torch.int32, torch.int64)):
            raise KernelError(f"{name} must be an int32/int64 tensor [batch={q.shape[0]}], got "
                              f"{t.dtype} {tuple(t.shape)}")
    return group


def decode_ranges(lengths: torch.Tensor, starts: torch.Tensor | None, max_tokens: int,
                  window: int | None = None) -> list[tuple[int, int]]:
    """Each sequence's cache range ``(start, length)`` the new token attends to, as host ints.

    Checked to satisfy ``0 <= start <= length <= max_tokens`` (KernelError otherwise); then a
    sliding ``window`` raises each start to ``length - window`` (the query is at ``length - 1``).
    """
    ends = [int(n) for n in lengths.tolist()]
    firsts = [int(s) for s in starts.tolist()] if starts is not None else [0] * len(ends)
    bad = [(s, n) for s, n in zip(firsts, ends) if not 0 <= s <= n <= max_tokens]
    if bad:
        raise KernelError(f"decode needs 0 <= starts <= lengths <= max_tokens={max_tokens}; "
                          f"got (start, length) {bad}")
    if window is not None:
        firsts = [max(s, n - window) for s, n in zip(firsts, ends)]
    return list(zip(firsts, ends))


def check_window(window: int | None, causal: bool = True) -> int | None:
    """Validate a sliding window (an int >= 1, only with causal attention); returns it."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise KernelError(f"window must be an int >= 1 (keys a query sees, itself included) or "
                          f"None, got {window!r}")
    if not causal:
        raise KernelError("a sliding window needs causal=True (it bounds how far back a query "
                          "looks)")
    return window


def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """[batch, kv_heads, n, d] → [batch, kv_heads * group, n, d] (HF's repeat_kv)."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def visible_keys(batch: int, q_len: int, kv_len: int, causal: bool,
                 key_padding_mask: torch.Tensor | None, device,
                 window: int | None = None) -> torch.Tensor:
    """Which keys each query may attend to, bool ``[batch, 1, q_len, kv_len]``.

    Causal alignment is bottom-right: query ``i`` sits at position ``kv_len - q_len + i`` (a
    prompt chunk after ``kv_len - q_len`` earlier tokens) and sees keys ``j <= that``; with a
    ``window`` (causal only) also ``j > that - window``.
    """
    visible = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool, device=device)
    if causal:
        q_pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)  # [q_len, 1]
        k_pos = torch.arange(kv_len, device=device)[None, :]  # [1, kv_len]
        visible = visible & (k_pos <= q_pos)
        if window is not None:
            visible = visible & (k_pos > q_pos - window)
    if key_padding_mask is not None:
        visible = visible & key_padding_mask.bool()[:, None, None, :]
    return visible


def check_sinks(sinks: torch.Tensor | None, q_heads: int,
                alibi: torch.Tensor | None = None) -> None:
    """Validate attention sinks: None or a floating tensor [q_heads], not with ALiBi slopes
    (module docstring); KernelError otherwise."""
    if sinks is None:
        return
    if alibi is not None:
        raise KernelError("attention sinks do not combine with ALiBi slopes (a sink's share "
                          "depends on where ALiBi's positions start, which the backends leave "
                          "free); pass one or the other")
    if not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (q_heads,) or \
            not sinks.is_floating_point():
        what = (f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor)
                else type(sinks).__name__)
        raise KernelError(f"sinks must be a float tensor [q_heads={q_heads}] (one logit per "
                          f"query head) or None, got {what}")


def check_prefill(q, k, causal, key_padding_mask, alibi, window=None, sinks=None) -> None:
    """Validate the optional prefill arguments."""
    check_window(window, causal)
    check_sinks(sinks, q.shape[1], alibi)
    batch, q_heads, q_len = q.shape[:3]
    kv_len = k.shape[2]
    if causal and q_len > kv_len:
        raise KernelError(f"causal attention needs q_len ({q_len}) <= kv_len ({kv_len}): "
                          f"queries are the last q_len of the kv_len positions")
    if key_padding_mask is not None and key_padding_mask.shape != (batch, kv_len):
        raise KernelError(f"key_padding_mask must be [batch, kv_len] = {(batch, kv_len)}, got "
                          f"{tuple(key_padding_mask.shape)}")
    if alibi is not None and alibi.shape != (q_heads,):
        raise KernelError(f"alibi_slopes must be [q_heads={q_heads}], got {tuple(alibi.shape)}")


# ----- ops ------------------------------------------------------------------------------------


def attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      key_padding_mask: torch.Tensor | None = None,
                      alibi_slopes: torch.Tensor | None = None,
                      scale: float | None = None, window: int | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention over a prompt (or a prompt chunk after cached tokens).

    q: [batch, q_heads, q_len, d]; k, v: [batch, kv_heads, kv_len, d] with q_len <= kv_len when
    causal (bottom-right aligned: query i is token kv_len - q_len + i). GQA/MQA as the module
    docstring. key_padding_mask: [batch, kv_len] bool or 0/1 (true = a real token), or None.
    alibi_slopes: [q_heads] float or None; adds ``slope[h] * key_position`` to the scores, with
    key positions as BLOOM (:func:`alibi_key_positions`). scale: default ``d ** -0.5``.
    window: int >= 1 or None, causal only: query at position p sees keys p - window < j <= p
    (sliding-window attention; combines with the padding mask and ALiBi).
    sinks: [q_heads] float or None: each head's sink logit joins the softmax denominator
    (module docstring).
    Returns [batch, q_heads, q_len, d] in q.dtype; query rows that see no key are zero.
    """
    group = check_attention(q, k, v)
    check_prefill(q, k, causal, key_padding_mask, alibi_slopes, window, sinks)
    batch, _, q_len, d = q.shape
    kv_len = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    kf, vf = _repeat_kv(k.float(), group), _repeat_kv(v.float(), group)  # [b, q_heads, kv, d]
    scores = q.float() @ kf.transpose(-1, -2) * scale  # [batch, q_heads, q_len, kv_len]
    if alibi_slopes is not None:
        pos = alibi_key_positions(key_padding_mask, batch, kv_len, q.device).float()
        scores = scores + alibi_slopes.float()[None, :, None, None] * pos[:, None, None, :]
    visible = visible_keys(batch, q_len, kv_len, causal, key_padding_mask, q.device, window)
    probs = softmax_with_sinks(scores.masked_fill(~visible, float("-inf")), sinks)
    probs = torch.where(visible.any(-1, keepdim=True), probs, 0.0)  # no key: 0, not NaN
    return (probs @ vf).to(q.dtype)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 ``scores`` [batch, q_heads, q_len, kv_len] (``-inf``
    where hidden), with each head's sink logit ``sinks`` [q_heads] as one more column that is
    dropped after (None: the plain softmax). A row that sees no key: all mass on the sink (its
    probabilities are 0), without a sink NaN (the caller zeroes it)."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)  # [b, h, q_len, 1]
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


def attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, *, alibi_slopes: torch.Tensor | None = None,
                     scale: float | None = None, starts: torch.Tensor | None = None,
                     window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One new query token per sequence attending over its cached keys/values.

    q: [batch, q_heads, 1, d]; k_cache, v_cache: [batch, kv_heads, max_tokens, d];
    lengths: [batch] int32/int64, the valid tokens of each sequence including the new one
    (already written with kv_cache_write). starts: [batch] int32/int64 or None (0): the first
    valid position, for a left-padded prompt written to the cache as is (its pads are
    positions 0 .. starts[b] - 1). window: int >= 1 or None, sliding-window attention: the
    query (position lengths[b] - 1) sees positions from max(starts[b], lengths[b] - window).
    Only positions from that first one to lengths[b] - 1 are ever read.
    alibi_slopes: [q_heads] or None (key position = cache index). scale: default ``d ** -0.5``.
    sinks: [q_heads] float or None, attention sinks (module docstring).
    Returns [batch, q_heads, 1, d] in q.dtype; a sequence with no valid token gives zeros.
    """
    check_decode(q, k_cache, v_cache, lengths, starts)
    check_sinks(sinks, q.shape[1], alibi_slopes)
    ranges = decode_ranges(lengths, starts, k_cache.shape[2], check_window(window))
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for b, (s, n) in enumerate(ranges):
        if n > s:  # slice the valid range: what lies outside it is never touched
            out[b] = attention_prefill(q[b:b + 1], k_cache[b:b + 1, :, s:n],
                                       v_cache[b:b + 1, :, s:n], causal=False,
                                       alibi_slopes=alibi_slopes, scale=scale,
                                       sinks=sinks)[0]
    return out


def check_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 spans: torch.Tensor) -> list[tuple[int, int, int]]:
    """The ``(slot, past, n)`` of each chunk of :func:`attention_chunks`' ``spans`` (host ints,
    empty ones dropped); KernelError for shapes or spans that do not fit."""
    check_chunk_shapes(q, k_cache, v_cache, spans)
    rows, max_tokens, tokens = k_cache.shape[0], k_cache.shape[2], q.shape[2]
    chunks = [(slot, past, n) for slot, past, n in spans.tolist() if n != 0]
    if any(not (0 <= slot < rows and past >= 0 and n > 0 and past + n <= max_tokens)
           for slot, past, n in chunks) or sum(n for _, _, n in chunks) > tokens:
        raise KernelError(f"spans {chunks} do not fit {rows} cache rows of {max_tokens} "
                          f"positions and {tokens} query tokens")
    return chunks


def check_chunk_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       spans: torch.Tensor) -> None:
    """KernelError unless :func:`attention_chunks`' arguments have its shapes and dtypes (the
    spans' values are not read: no device sync)."""
    if q.dim() != 4 or q.shape[0] != 1 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape \
            or q.shape[-1] != k_cache.shape[-1]:
        raise KernelError(f"attention_chunks takes q [1, q_heads, tokens, d] (the chunks' tokens "
                          f"as one row) and caches [rows, kv_heads, max_tokens, d]; got q "
                          f"{tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    check_gqa(q.shape[1], k_cache.shape[1])
    if spans.dim() != 2 or spans.shape[1] != 3 or spans.dtype != torch.int64:
        raise KernelError(f"spans must be an int64 tensor [chunks, 3] of (slot, past, n), got "
                          f"{tuple(spans.shape)} {spans.dtype}")


def each_chunk(prefill, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               spans: torch.Tensor, **kw) -> torch.Tensor:
    """:func:`attention_chunks` through ``prefill`` (an ``attention_prefill`` implementation):
    one causal call per chunk over its slot's first ``past + n`` positions; ``kw``: scale,
    window, alibi_slopes, sinks (None: not passed)."""
    chunks = check_chunks(q, k_cache, v_cache, spans)
    kw = {name: value for name, value in kw.items() if value is not None or name == "scale"}
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    start = 0
    for slot, past, n in chunks:
        seen = slice(0, past + n)
        out[:, :, start:start + n] = prefill(q[:, :, start:start + n],
                                             k_cache[slot:slot + 1, :, seen],
                                             v_cache[slot:slot + 1, :, seen], causal=True, **kw)
        start += n
    return out


def attention_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     spans: torch.Tensor, *, scale: float | None = None,
                     window: int | None = None, alibi_slopes: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Prompt chunks of several sequences, packed in one row, each attending causally to its own
    cache row (a served mixed step's chunks, ``shardwise.inject.slots.PackedRows``).

    q: [1, q_heads, tokens, d]: the chunks' tokens in ``spans`` order, then padding; k_cache,
    v_cache: [rows, kv_heads, max_tokens, d] with the chunks' keys and values already written;
    spans: [chunks, 3] int64 ``(slot, past, n)`` (n = 0: no chunk). Token i of a chunk attends to
    positions 0 .. past + i of row ``slot`` (with ``window``, the last ``window`` of them), as
    :func:`attention_prefill` with ``causal=True`` over those positions; ALiBi and sinks as
    there. Returns [1, q_heads, tokens, d]; padding tokens zero.
    """
    return each_chunk(attention_prefill, q, k_cache, v_cache, spans, scale=scale, window=window,
                      alibi_slopes=alibi_slopes, sinks=sinks)


@torch.library.custom_op("shardwise::chunks_by_prefill", mutates_args=())
def chunks_by_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      spans: torch.Tensor, backend: str, scale: float | None,
                      window: int | None, alibi_slopes: torch.Tensor | None,
                      sinks: torch.Tensor | None) -> torch.Tensor:
    """:func:`attention_chunks` through ``backend``'s registered ``attention_prefill`` (one
    call per chunk, :func:`each_chunk`), as an op a graph strategy calls without tracing into
    it, so that it reads ``spans`` on the host at every replay: a captured mixed step's chunks
    where the layer's ``attention_chunks`` kernel is not capturable, and the CPU backend's
    where its native extension does not build."""
    from shardwise.kernel_registry import registry

    error = registry.load_backend(backend)  # (loaded once: a dict lookup after the first call)
    if error:
        raise KernelError(f"chunks_by_prefill: kernel backend {backend!r} is not usable: {error}")
    prefill = registry.implementations("attention_prefill")[backend]
    return each_chunk(prefill, q, k_cache, v_cache, spans, scale=scale, window=window,
                      alibi_slopes=alibi_slopes, sinks=sinks)


@chunks_by_prefill.register_fake
def _(q, k_cache, v_cache, spans, backend, scale, window, alibi_slopes, sinks):
    return q.new_empty(q.shape)


OPS = {"attention_prefill": attention_prefill, "attention_decode": attention_decode,
       "attention_chunks": attention_chunks}


def register(registry) -> None:
    """Define the attention ops with their references."""
    for op, fn in OPS.items():
        registry.register(op, BACKEND, fn)


# ----- example inputs (conformance suite): op -> (dtype, device) -> (args, kwargs) ---------------
# Small GQA shapes (4 query heads over 2 kv heads, head_dim 16) with ragged lengths, ALiBi,
# padding and sliding windows, so a backend that mishandles any of them fails the suite.

def _prefill_example(dtype, device):
    q, k, v = randn(2, 4, 6, 16, seed=16), randn(2, 2, 6, 16, seed=17), randn(2, 2, 6, 16, seed=18)
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]], device=device)  # second sequence left-padded
    return ((q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)),
            {"causal": True, "key_padding_mask": mask,
             "alibi_slopes": alibi_slopes(4, device=device),
             "window": 4})  # queries 4, 5 of sequence 0 lose keys; sequence 1's lost are pads


def _decode_example(dtype, device):
    q = randn(2, 4, 1, 16, seed=19)
    k, v = randn(2, 2, 12, 16, seed=20), randn(2, 2, 12, 16, seed=21)
    k[1, :, 7:] = float("nan")  # past sequence 1's length: must never be read
    k[0, :, :4] = float("nan")  # window 8: sequence 0 sees 4..11 only, sequence 1 all 7 tokens
    lengths = torch.tensor([12, 7], device=device)
    return ((q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), lengths),
            {"window": 8})


def _chunks_example(dtype, device):
    q = randn(1, 4, 8, 16, seed=22)  # two chunks (5 and 2 tokens), one padding token
    k, v = randn(3, 2, 12, 16, seed=23), randn(3, 2, 12, 16, seed=24)
    k[2, :, 7:], v[2, :, 7:] = float("nan"), float("nan")  # past row 2's chunk: never read
    k[1, :, 8:], v[1, :, 8:] = float("nan"), float("nan")  # past row 1's
    k[0], v[0] = float("nan"), float("nan")  # no chunk's row
    spans = torch.tensor([[2, 2, 5], [1, 6, 2], [0, 0, 0]], device=device)
    return ((q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), spans),
            {"window": 6})


EXAMPLES = {"attention_prefill": _prefill_example, "attention_decode": _decode_example,
            "attention_chunks": _chunks_example}

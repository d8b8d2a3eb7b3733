"""The ``hpu`` backend's prompt attention on the bridge's ``FusedSDPA``
(``hpex/kernels/FusedSDPA.py``: ``FusedSDPA.apply(q, k, v, attn_mask, dropout_p, is_causal,
scale, ...)``; grouped-query heads are grouped inside it).

Which call: a full causal prompt without padding (q_len == kv_len) passes ``is_causal=True``;
otherwise the reference's visibility (bottom-right causal alignment, padding) goes in as an
additive mask in q's dtype (0 or the dtype's minimum), the form optimum-habana passes, and query
rows that see no key are zeroed as the reference does. ALiBi, sliding windows and sinks have no
FusedSDPA argument: those calls run the reference. ``attention_decode`` stays the reference (its
per-sequence lengths are read inside the captured decode step)."""

from __future__ import annotations

from functools import partial

import torch

from shardwise.kernels.reference import attention as ref

from . import DEVICE_TYPES, DTYPES

BACKEND = "hpu"


def attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      key_padding_mask: torch.Tensor | None = None,
                      alibi_slopes: torch.Tensor | None = None, scale: float | None = None,
                      window: int | None = None, sinks: torch.Tensor | None = None,
                      hpex) -> torch.Tensor:
    """Prompt attention; contract of ``shardwise.kernels.reference.attention_prefill``.

    q: [batch, q_heads, q_len, d]; k, v: [batch, kv_heads, kv_len, d]. Returns [batch, q_heads,
    q_len, d] in q.dtype."""
    if alibi_slopes is not None or window is not None or sinks is not None:
        return ref.attention_prefill(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                                     alibi_slopes=alibi_slopes, scale=scale, window=window,
                                     sinks=sinks)
    ref.check_attention(q, k, v)
    ref.check_prefill(q, k, causal, key_padding_mask, None)
    batch, _, q_len, d = q.shape
    kv_len = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    if key_padding_mask is None and (not causal or q_len == kv_len):
        return hpex.FusedSDPA.apply(q, k, v, None, 0.0, causal, scale).to(q.dtype)
    visible = ref.visible_keys(batch, q_len, kv_len, causal, key_padding_mask, q.device)
    mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)  # [batch, 1, q, kv]
    mask.masked_fill_(~visible, torch.finfo(q.dtype).min)
    out = hpex.FusedSDPA.apply(q, k, v, mask, 0.0, False, scale).to(q.dtype)
    return out * visible.any(-1, keepdim=True).to(q.dtype)  # rows with no key: 0


def register(registry, hpex) -> None:
    """Register ``attention_prefill`` for HPU in bf16/fp32/fp16."""
    fn = partial(attention_prefill, hpex=hpex)
    fn.__module__ = __name__
    registry.register("attention_prefill", BACKEND, fn, dtypes=DTYPES,
                      device_types=DEVICE_TYPES)

"""The ``hpu`` backend's rotary embedding on the bridge's helper
(``hpex/kernels/RotaryPosEmbeddingHelper.py``: ``apply_rotary_pos_emb(p, cos, sin, position_ids,
offset, mode)``, one ``torch.ops.hpu.rotary_pos_embedding``), BLOCKWISE for Llama/NeoX's
``rotate_half`` pairs and PAIRWISE for GPT-J's interleaved pairs.

The helper takes full-width tables broadcastable to ``p`` (``[batch|1, 1, seq, rotary_dim]``);
shardwise's tables hold one angle per pair (``[batch|, seq, rotary_dim / 2]``), so they are
widened here. They stay float32, and the helper then computes in float32 (its
``match_data_types``), rounded to the input dtype once, as the reference does."""

from __future__ import annotations

from functools import partial

import torch

from shardwise.kernels.reference.rotary import check_rotary

from . import DEVICE_TYPES, DTYPES

BACKEND = "hpu"


def _full_table(t: torch.Tensor, style: str) -> torch.Tensor:
    """[seq, half] or [batch, seq, half] → [batch|1, 1, seq, 2 * half] in the helper's layout:
    halves side by side (BLOCKWISE) or each angle twice in a row (PAIRWISE)."""
    t = t[None] if t.dim() == 2 else t  # [batch|1, seq, half]
    wide = torch.cat([t, t], -1) if style == "half" else t.repeat_interleave(2, -1)
    return wide[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode, rotary_dim: int,
            hpex) -> torch.Tensor:
    """x [batch, heads, seq, d]: its first ``rotary_dim`` dims rotated, the rest passed through."""
    rotated = hpex.apply_rotary_pos_emb(x[..., :rotary_dim], cos, sin, None, 0, mode)
    return torch.cat([rotated.to(x.dtype), x[..., rotary_dim:]], -1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
           style: str = "half", hpex) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k; contract of ``shardwise.kernels.reference.rotary``."""
    rotary_dim = check_rotary(q, k, cos, sin, style)
    mode = (hpex.RotaryPosEmbeddingMode.BLOCKWISE if style == "half"
            else hpex.RotaryPosEmbeddingMode.PAIRWISE)
    c, s = _full_table(cos.float(), style), _full_table(sin.float(), style)
    return (_rotate(q, c, s, mode, rotary_dim, hpex), _rotate(k, c, s, mode, rotary_dim, hpex))


def register(registry, hpex) -> None:
    """Register ``rotary`` for HPU in bf16/fp32/fp16."""
    fn = partial(rotary, hpex=hpex)
    fn.__module__ = __name__
    registry.register("rotary", BACKEND, fn, dtypes=DTYPES, device_types=DEVICE_TYPES)

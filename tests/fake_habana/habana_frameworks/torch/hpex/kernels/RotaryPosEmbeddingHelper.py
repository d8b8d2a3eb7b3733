"""Stand-in for ``habana_frameworks/torch/hpex/kernels/RotaryPosEmbeddingHelper.py``:
``apply_rotary_pos_emb(p, cos, sin, position_ids, offset, mode)`` and the mode enum. Where the
bridge calls ``torch.ops.hpu.rotary_pos_embedding`` this computes the formulas its docstring
gives: BLOCKWISE ``p * cos + rotate_half(p) * sin``, PAIRWISE ``p * cos + rotate_every_two(p) *
sin``. Dtypes as the bridge's ``match_data_types``: float32 anywhere makes the math float32 (and
the result), otherwise cos/sin take p's dtype."""

from enum import Enum
from typing import Tuple

import torch


class RotaryPosEmbeddingMode(Enum):
    BLOCKWISE = 0
    PAIRWISE = 1


def match_data_types(input: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if any(dtype is torch.float32 for dtype in [input.dtype, cos.dtype, sin.dtype]):
        return input.to(torch.float32), cos.to(torch.float32), sin.to(torch.float32)
    return input, cos.to(input.dtype), sin.to(input.dtype)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(p: torch.Tensor, *args) -> torch.Tensor:
    cos, sin = args[0], args[1]
    position_ids = args[2] if len(args) > 2 else None
    offset = args[3] if len(args) > 3 else 0
    mode = args[4] if len(args) > 4 else RotaryPosEmbeddingMode.BLOCKWISE
    p, cos, sin = match_data_types(p, cos, sin)
    if position_ids is not None:  # as the bridge's recalculate_params
        cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
        sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    elif offset:
        cos, sin = cos[..., offset:offset + p.shape[-2], :], sin[..., offset:offset + p.shape[-2], :]
    rotate = _rotate_half if mode == RotaryPosEmbeddingMode.BLOCKWISE else _rotate_every_two
    return p * cos + rotate(p) * sin


class RotaryPosEmbeddingHelperV1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, cos, sin, offset):
        return apply_rotary_pos_emb(p, cos, sin, None, offset, RotaryPosEmbeddingMode.BLOCKWISE)


class RotaryPosEmbeddingHelperV2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, cos, sin, position_ids):
        return apply_rotary_pos_emb(p, cos, sin, position_ids, 0,
                                    RotaryPosEmbeddingMode.BLOCKWISE)

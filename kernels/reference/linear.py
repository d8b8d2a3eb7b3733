"""Torch reference of the CPU 16-bit blocked linear (``kernels/cpu/native/half.cpp``): its
test oracle."""

from __future__ import annotations

import torch


def blocked_linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None,
                   n: int) -> torch.Tensor:
    """x [M, K] (bf16 / fp16, or fp32 under a 16-bit weight) times the weight laid out in
    column blocks ``blocked`` [Nb, K, block] (block ``j`` = output columns ``[j*block,
    (j+1)*block)``, the last zero-padded), plus ``bias`` [n] → [M, n] in x's dtype: products
    and sums in fp32, the bias added in fp32, rounded once (the contract of ``F.linear``'s
    16-bit GEMMs); an fp32 x is not rounded at all (the weight widened exactly)."""
    nb, k, block = blocked.shape
    mat2 = blocked.float().transpose(0, 1).reshape(k, nb * block)[:, :n]  # [K, n]
    out = x.float() @ mat2
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)

"""Rotary position embedding (reference): the ``rotary`` op and its angle table.

Pure torch, clear over fast: the oracle every backend is tested against. Math in float32, each
result rounded to the input dtype once, at the end. Layouts: q ``[batch, q_heads, seq, d]``, k
``[batch, kv_heads, seq, d]`` (any strides); cos/sin one angle per rotated pair (:func:`rotary`).

Op (registered by :func:`register`): ``rotary``. Helpers (not ops): :func:`rotary_cos_sin`,
:func:`check_rotary` (the validation every backend shares).
"""

from __future__ import annotations

import torch

from shardwise.errors import KernelError

from .example import randn

BACKEND = "reference"
ROTARY_STYLES = ("half", "interleaved")


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, base: float = 10000.0,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary angle table for integer ``positions`` (any shape, e.g. [batch, seq] or [seq]).

    Returns ``(cos, sin)``, each float32 ``[*positions.shape, rotary_dim // 2]``: entry ``i`` is
    the angle ``position * base ** (-2i / rotary_dim)`` of rotation pair ``i``, computed as HF's
    Llama/NeoX/GPT-J rotary embeddings do (no rope scaling: for scaled ropes take HF's own cos/sin
    and keep their first half, see :func:`rotary`).
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise KernelError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device)
    inv_freq = 1.0 / (base ** (exponents.float() / rotary_dim))  # [rotary_dim // 2]
    angles = positions.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def check_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 style: str) -> int:
    """Validate rotary inputs (see :func:`rotary`); returns rotary_dim."""
    if style not in ROTARY_STYLES:
        raise KernelError(f"rotary style must be one of {ROTARY_STYLES}, got {style!r}")
    rotary_dim = 2 * cos.shape[-1]
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise KernelError(f"rotary takes q [batch, q_heads, seq, d] and k [batch, kv_heads, seq, "
                          f"d]; got {tuple(q.shape)} and {tuple(k.shape)}")
    if cos.shape != sin.shape or cos.dim() not in (2, 3) or cos.shape[-2] != q.shape[2] or (
            cos.dim() == 3 and cos.shape[0] not in (1, q.shape[0])):
        raise KernelError(f"cos/sin must be [seq, rotary_dim/2] or [batch, seq, rotary_dim/2] "
                          f"for q {tuple(q.shape)}; got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if not 0 < rotary_dim <= q.shape[-1]:
        raise KernelError(f"rotary_dim 2 * cos.shape[-1] = {rotary_dim} exceeds head_dim "
                          f"{q.shape[-1]} (cos/sin are one angle per rotated pair)")
    return rotary_dim


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
           style: str = "half") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding of q and k (out of place).

    q: [batch, q_heads, seq, d]; k: [batch, kv_heads, seq, d] (any strides).
    cos, sin: [batch, seq, rotary_dim // 2] or [seq, rotary_dim // 2], one angle per rotated pair
    (:func:`rotary_cos_sin` builds them; HF Llama/NeoX's duplicated ``[..., rotary_dim]`` tables
    are ``cat(c, c)``: pass ``cos[..., :rotary_dim // 2]``). The first ``rotary_dim`` dims are
    rotated, the rest pass through (GPT-NeoX ``rotary_pct``, GPT-J ``rotary_dim``).
    style: "half" pairs dims (i, i + rotary_dim/2) (Llama/NeoX ``rotate_half``); "interleaved"
    pairs (2i, 2i + 1) (GPT-J ``rotate_every_two``).
    Returns (q_out, k_out) in the inputs' shapes and dtypes.
    """
    check_rotary(q, k, cos, sin, style)
    c, s = (t.float()[..., None, :, :] for t in (cos, sin))  # [batch|1, 1, seq, rotary_dim/2]
    return _rotate(q, c, s, style), _rotate(k, c, s, style)


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, style: str) -> torch.Tensor:
    """One tensor of :func:`rotary`: pairs (x1, x2) → (x1 c - x2 s, x2 c + x1 s)."""
    half = c.shape[-1]
    xf = x.float()
    rot, rest = xf[..., :2 * half], xf[..., 2 * half:]
    if style == "half":
        x1, x2 = rot[..., :half], rot[..., half:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    out = torch.cat([o1, o2], -1) if style == "half" else torch.stack([o1, o2], -1).flatten(-2)
    return torch.cat([out, rest], -1).to(x.dtype)


OPS = {"rotary": rotary}


def register(registry) -> None:
    """Define the rotary op with its reference."""
    for op, fn in OPS.items():
        registry.register(op, BACKEND, fn)


# ----- example inputs (conformance suite): op -> (dtype, device) -> (args, kwargs) ---------------
# 4 query heads over 2 kv heads, head_dim 16, interleaved pairs on 8 of 16 dims (partial rotary).

def _rotary_example(dtype, device):
    q, k = randn(2, 4, 5, 16, seed=11), randn(2, 2, 5, 16, seed=12)
    cos, sin = rotary_cos_sin(torch.arange(5), rotary_dim=8)  # partial rotary: 8 of 16 dims
    return ((q.to(device, dtype), k.to(device, dtype), cos.to(device), sin.to(device)),
            {"style": "interleaved"})


EXAMPLES = {"rotary": _rotary_example}

"""MoE experts as Triton kernels (CUDA): ``moe_grouped_mlp`` by per-slot gathered GEMVs.

Contract of ``shardwise.kernels.reference.moe.moe_grouped_mlp``: x [T, H], gate_up [E, 2I, H]
(gate rows, then up rows), down [E, H, I], experts and weights [T, k]; optional expert biases and
GPT-OSS's clamped SwiGLU; the expert index E marks a slot whose expert lives on another rank
(it contributes nothing: its programs load no weights and store zeros). Two launches, each
program one token slot (token t's j-th choice) and a block of output rows, reading its expert's
rows in place through the expert index on the device: (1) gate and up rows · x[t], bias,
activation → a float32 [T*k, I] buffer; (2) down rows · that, bias, × the slot's weight →
float32 [T*k, H]; the k slots of a token are summed and rounded to x's dtype once. Static
shapes, no host sync: dropless and capturable — the decode path. Each slot reads its expert's
weights itself, so at prefill (many tokens per expert) the weights are read once per slot:
correct, not fast. Importing this module imports triton; it is imported by ``register`` of the
triton backend only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shardwise.kernels.reference import moe as ref

from . import DEVICE_TYPES, DTYPES
from .common import same_device

BACKEND = "triton"
_BLOCK_N = 32  # output rows per program
_BLOCK_K = 64  # reduction columns per step
_SILU, _GELU, _CLAMPED = 0, 1, 2


@triton.jit
def _gate_up_kernel(X, GU, GUB, EXP, A, H, I, E, stride_x, stride_ge, stride_gn, stride_be,
                    limit, alpha, TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (slot, row block): act(gate · x + b) * (up · x + b) for BLOCK_N of the I rows.
    A slot whose expert is the sentinel E (another rank's) loads nothing and stores act(0) * 0
    = 0."""
    s = tl.program_id(0).to(tl.int64)
    t = s // TOP_K
    e = tl.load(EXP + s).to(tl.int64)
    here = e < E
    e = tl.where(here, e, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < tl.where(here, I, 0)  # no rows for the sentinel
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    base = GU + e * stride_ge
    for k0 in range(0, H, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        c_mask = cols < H
        xv = tl.load(X + t * stride_x + cols, mask=c_mask, other=0.0).to(tl.float32)
        mask = n_mask[:, None] & c_mask[None, :]
        wg = tl.load(base + n[:, None] * stride_gn + cols[None, :], mask=mask, other=0.0)
        wu = tl.load(base + (n[:, None] + I) * stride_gn + cols[None, :], mask=mask, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
    if HAS_BIAS:
        acc_g += tl.load(GUB + e * stride_be + n, mask=n_mask, other=0.0).to(tl.float32)
        acc_u += tl.load(GUB + e * stride_be + I + n, mask=n_mask, other=0.0).to(tl.float32)
    if ACT == 2:  # GPT-OSS: gate <= limit, |up| <= limit, gate * sigmoid(alpha gate) * (up + 1)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        a = g * tl.sigmoid(alpha * g) * (u + 1.0)
    elif ACT == 1:  # gelu (erf)
        a = 0.5 * acc_g * (1.0 + tl.math.erf(acc_g * 0.7071067811865476)) * acc_u
    else:  # silu
        a = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(A + s * I + n, a, mask=n < I)


@triton.jit
def _down_kernel(A, D, DB, EXP, W, Y, H, I, E, stride_de, stride_dm, stride_be,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (slot, row block): weight * (down · a + b) for BLOCK_N of the H rows; 0 for a
    slot whose expert is the sentinel E (another rank's: nothing loaded)."""
    s = tl.program_id(0).to(tl.int64)
    e = tl.load(EXP + s).to(tl.int64)
    here = e < E
    e = tl.where(here, e, 0)
    m = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < tl.where(here, H, 0)  # no rows for the sentinel
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    base = D + e * stride_de
    for k0 in range(0, I, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        c_mask = cols < I
        av = tl.load(A + s * I + cols, mask=c_mask, other=0.0)
        wd = tl.load(base + m[:, None] * stride_dm + cols[None, :],
                     mask=m_mask[:, None] & c_mask[None, :], other=0.0)
        acc += tl.sum(wd.to(tl.float32) * av[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(DB + e * stride_be + m, mask=m_mask, other=0.0).to(tl.float32)
    acc *= tl.where(here, tl.load(W + s), 0.0)
    tl.store(Y + s * H + m, acc, mask=m < H)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A unit stride along the last dim (copies only if needed)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def moe_grouped_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    experts: torch.Tensor, weights: torch.Tensor, *, activation: str = "silu",
                    gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, clamp: float | None = None,
                    alpha: float = ref.GPT_OSS_ALPHA) -> torch.Tensor:
    """The routed experts' output, two launches over the T*k slots; contract of the reference.
    Returns [T, H] in x.dtype."""
    ref.check_grouped_mlp(x, gate_up, down, experts, weights, activation, gate_up_bias,
                          down_bias, clamp)
    same_device(x, gate_up=gate_up, down=down, experts=experts, weights=weights,
                gate_up_bias=gate_up_bias, down_bias=down_bias)
    (t, h), k = x.shape, experts.shape[1]
    inter = gate_up.shape[1] // 2
    out = torch.zeros(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    x, gate_up, down = _rows(x), _rows(gate_up), _rows(down)
    exp = experts.reshape(-1).contiguous()  # [T*k]
    w = weights.reshape(-1).float().contiguous()  # [T*k]
    gub = _rows(gate_up_bias) if gate_up_bias is not None else gate_up
    db = _rows(down_bias) if down_bias is not None else down
    act = _CLAMPED if clamp is not None else (_GELU if activation == "gelu" else _SILU)
    a = torch.empty(t * k, inter, dtype=torch.float32, device=x.device)
    _gate_up_kernel[(t * k, triton.cdiv(inter, _BLOCK_N))](
        x, gate_up, gub, exp, a, h, inter, gate_up.shape[0], x.stride(0), gate_up.stride(0),
        gate_up.stride(1), gub.stride(0), float(clamp or 0.0), float(alpha), TOP_K=k,
        HAS_BIAS=gate_up_bias is not None, ACT=act, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K)
    y = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
    _down_kernel[(t * k, triton.cdiv(h, _BLOCK_N))](
        a, down, db, exp, w, y, h, inter, down.shape[0], down.stride(0), down.stride(1),
        db.stride(0), HAS_BIAS=down_bias is not None, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K)
    return y.view(t, k, h).sum(1).to(x.dtype)


def register(registry) -> None:
    """Register ``moe_grouped_mlp`` for CUDA in fp32/fp16/bf16 (capturable: no host sync)."""
    registry.register("moe_grouped_mlp", BACKEND, moe_grouped_mlp, dtypes=DTYPES,
                      device_types=DEVICE_TYPES, capturable=True)

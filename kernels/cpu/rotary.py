"""The ``cpu`` backend's rotary: out of place without temporaries.

Contracts are those of ``shardwise.kernels.reference.rotary`` (layouts, styles, partial rotary).
Only what measured faster than the reference is registered (``REGISTERED``), per dtype; the
speed-ups, their command and machine are in benchmarks/README.md, "CPU kernels against the
reference":

* rotary (fp32, bf16, fp16): out of place into one ``empty_like`` buffer with
  ``mul``/``addcmul_`` on views (fp32), or float32 math per half (bf16/fp16), no
  ``cat``/``stack`` temporaries. Inside a compiled CPU step of a wide enough model
  (:func:`~shardwise.kernels.cpu.native.in_compiled_step`) the native op ``cpu_rotary``
  (``native/elementwise.cpp``: the reference's float32 math, bit for bit).
"""

from __future__ import annotations

import torch

from shardwise.kernels.reference import rotary as ref

from . import DEVICE_TYPES, DTYPES, native

BACKEND = "cpu"


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
           style: str = "half") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding without temporaries; contract of the reference ``rotary``.

    q: [batch, q_heads, seq, d]; k: [batch, kv_heads, seq, d]; cos, sin: [batch | 1, seq,
    rotary_dim/2] or [seq, rotary_dim/2]. Returns (q_out, k_out) in the inputs' layouts.
    """
    ref.check_rotary(q, k, cos, sin, style)
    if native.in_compiled_step("rotary", q.shape[1] * q.shape[3]):
        # cos, sin as the op takes them, float [batch | 1, seq, r/2]: no-ops for the step's own
        # tables (contiguous float32 [b, s, r/2], made once per step)
        c, s = (t.float().reshape(-1, *t.shape[-2:]).contiguous() for t in (cos, sin))
        return torch.ops.shardwise_native.cpu_rotary(q, k, c, s, style == "interleaved")
    c, s = (t.float()[..., None, :, :] for t in (cos, sin))  # [batch|1, 1, seq, rotary_dim/2]
    return _rotate(q, c, s, style), _rotate(k, c, s, style)


def _pairs(x: torch.Tensor, half: int, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the two members of each rotated pair: [..., half] each."""
    if style == "half":
        return x[..., :half], x[..., half:2 * half]
    return x[..., 0:2 * half:2], x[..., 1:2 * half:2]


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, style: str) -> torch.Tensor:
    """(x1, x2) → (x1 c - x2 s, x2 c + x1 s) written straight into the output's views."""
    if torch.compiler.is_compiling():  # out= into strided views does not trace; the compiler
        return ref._rotate(x, c, s, style)  # fuses the reference's plain form into one loop
    half = c.shape[-1]
    out = torch.empty_like(x)
    x1, x2 = _pairs(x, half, style)
    o1, o2 = _pairs(out, half, style)
    if x.dtype == torch.float32:
        torch.mul(x1, c, out=o1).addcmul_(x2, s, value=-1.0)
        torch.mul(x2, c, out=o2).addcmul_(x1, s)
    else:  # float32 math, one rounding per output, like the reference
        x1f, x2f = x1.float(), x2.float()
        o1.copy_(torch.mul(x1f, c).addcmul_(x2f, s, value=-1.0))
        o2.copy_(x2f.mul_(c).addcmul_(x1f, s))
    if 2 * half < x.shape[-1]:
        out[..., 2 * half:] = x[..., 2 * half:]
    return out


#: op → (implementation, dtypes it is registered for): only what measured faster.
REGISTERED = {"rotary": (rotary, DTYPES)}
#: ops whose implementation may run inside the CPU graph strategy's compiled step
CAPTURABLE: frozenset[str] = frozenset()


def register(registry) -> None:
    """Register the CPU rotary for the dtypes it won."""
    for op, (fn, dtypes) in REGISTERED.items():
        registry.register(op, BACKEND, fn, dtypes=dtypes, device_types=DEVICE_TYPES,
                          capturable=op in CAPTURABLE)

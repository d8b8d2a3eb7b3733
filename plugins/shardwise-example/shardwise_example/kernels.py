"""The ``example`` kernel backend: this plugin's own implementation of ``rms_norm``.

shardwise imports this module (entry-point group ``shardwise.kernels``) the first time an op is
resolved for an accelerator that lists ``"example"`` in ``kernel_backends``, and calls
:func:`register`. Every implementation must match the torch reference in
``shardwise.kernels.reference`` (same signature, same outputs within the dtype's tolerance); the
conformance suite checks it. Ops this backend does not register fall back to the reference.
"""

from __future__ import annotations

import torch

#: The plugin-API version this backend was written for; shardwise refuses a mismatch.
PLUGIN_API_VERSION = 1
BACKEND = "example"
DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual-add then RMSNorm; returns ``(normalised, new_residual)`` in ``x.dtype``.

    The mean square is taken in float32 whatever the input dtype, as the reference does.
    """
    h = x if residual is None else torch.add(x, residual)
    h32 = h.to(torch.float32)
    mean_square = torch.mean(h32 * h32, dim=-1, keepdim=True)
    normalised = h32 * torch.rsqrt(mean_square + eps)
    return normalised.to(x.dtype) * weight.to(x.dtype), h


def _supports(device_type: str, dtype: torch.dtype, **shape) -> bool:
    """Extra shape checks would go here (e.g. a hidden size limit of a fused kernel)."""
    return True


def register(registry) -> None:
    """Register this backend's implementations (called once, on first use)."""
    registry.register("rms_norm", BACKEND, rms_norm, dtypes=DTYPES, device_types=("cpu",),
                      supports=_supports)

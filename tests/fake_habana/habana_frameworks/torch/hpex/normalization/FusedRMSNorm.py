"""Stand-in for ``habana_frameworks/torch/hpex/normalization/FusedRMSNorm.py``:
``FusedRMSNorm.apply(data_in, gamma, eps, use_stages=True, bwd_mode=0)``. Where the bridge calls
``torch.ops.hpu.rms_norm`` this computes ``data_in / sqrt(mean(data_in**2) + eps) * gamma`` in
float32 and returns data_in's dtype. Inference only: no backward."""

from enum import Enum

import torch


class RmsNormBwdMode(Enum):
    DEFAULT = 0
    STATIC_CASE_GC_SLICE_ENABLED = 1


class FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, data_in, gamma, eps, use_stages=True, bwd_mode=0):
        x = data_in.float()
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return (x * inv * gamma.float()).to(data_in.dtype)

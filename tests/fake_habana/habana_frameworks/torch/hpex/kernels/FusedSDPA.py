"""Stand-in for ``habana_frameworks/torch/hpex/kernels/FusedSDPA.py``: ``FusedSDPA`` with the
bridge's forward signature; where the bridge calls ``torch.ops.hpu.sdpa_recomp_fwd`` /
``sdpa_fwd`` this computes softmax(q k^T * scale + mask) v in float32 and returns q's dtype.

As the bridge: ``scale`` defaults to ``1 / sqrt(d)``; a 2-D ``attn_mask`` [Nt, Ns] is expanded to
the batch; grouped-query inputs (``kv_heads`` not in ``(q_heads, 1)``) are grouped, one kv head
broadcasts. A bool mask keeps the True positions, a float mask is added to the scores.
``is_causal`` is the lower triangle of [Nt, Ns] (torch's convention; the bridge documents it for
Nt == Ns). Inference only: no backward."""

import math

import torch


def _sdpa(q, k, v, attn_mask, is_causal, scale):
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    if q.dim() == 4 and k.shape[1] not in (q.shape[1], 1):  # grouped-query attention
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q.float() @ k.float().transpose(-1, -2) * scale  # [..., Nt, Ns]
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            attn_mask = attn_mask.expand(q.shape[0], *([1] * (q.dim() - 3)), *attn_mask.shape)
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    if is_causal:
        nt, ns = scores.shape[-2:]
        keep = torch.ones(nt, ns, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


class FusedSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                softmax_mode="None", recompute_mode=None, valid_seq_len=None,
                seq_padding_type="left", return_dropout_mask=False, return_attn_probs=False,
                window_size=(-1, -1), sink=None):
        if dropout_p:
            raise AssertionError("the stand-in's FusedSDPA is inference only (dropout_p=0)")
        return _sdpa(q, k, v, attn_mask, is_causal, scale)

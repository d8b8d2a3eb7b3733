"""Rotary, activation, attention and KV-cache kernels on CPU: the torch reference vs the ``cpu``
backend's implementation (each op's two implementations as the registry holds them).

    python benchmarks/kernel_attention.py --threads 2 --repeats 50

Shapes are those of a ~1B Llama (32 query / 4 key-value heads of 64, MLP 5632) and GPT-2's MLP
(3072), for a 128-token prompt, a 16-token prompt chunk after 80 cached tokens (a served prompt
joining in chunks; also at SmolLM2-135M's 9 / 3 heads) and for decode steps (batch 1 and 8, ragged
cache lengths around 1-2k of a 2048-token cache); and SmolLM2's served step: 8 decode rows of ~110
tokens and a captured mixed step's chunk (``attention_chunks``) in 8 slots of 513. For every case it
prints the median time per call (µs) of the reference and of the cpu implementation, calls
interleaved so machine noise hits both alike, their ratio, and which backend the registry resolves
on CPU (``cpu`` only where it won).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from shardwise.accelerators.cpu import CpuAccelerator
from shardwise.kernel_registry import registry
from shardwise.kernels.reference.attention import alibi_slopes
from shardwise.kernels.reference.rotary import rotary_cos_sin

sys.path.insert(0, str(Path(__file__).parent))
from kernel_norms import median_us  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, MAX_TOKENS = 32, 4, 64, 2048


def _qkv(batch, seq, dtype, kv_len=None):
    """q [batch, 32, seq, 64]; k, v [batch, 4, kv_len, 64], as views of [batch, seq, heads, d]
    (the layout a projection produces)."""
    kv_len = kv_len or seq

    def heads(n, length):
        return torch.randn(batch, length, n, HEAD_DIM, dtype=dtype).transpose(1, 2)

    return heads(Q_HEADS, seq), heads(KV_HEADS, kv_len), heads(KV_HEADS, kv_len)


def _cases(dtype):
    """(op, label, args, kwargs) for every benchmarked call."""
    g = torch.Generator().manual_seed(0)
    q, k, v = _qkv(1, 128, dtype)
    cos, sin = rotary_cos_sin(torch.arange(128), HEAD_DIM)
    qd, kd, _ = _qkv(8, 1, dtype)
    cos_d, sin_d = rotary_cos_sin(torch.randint(0, 2000, (8, 1), generator=g), HEAD_DIM)
    mask = torch.ones(2, 128, dtype=torch.bool)
    mask[1, :40] = False  # a left-padded second prompt
    q2, k2, v2 = _qkv(2, 128, dtype)
    slopes = alibi_slopes(Q_HEADS)
    caches = [torch.randn(8, KV_HEADS, MAX_TOKENS, HEAD_DIM, dtype=dtype) for _ in range(2)]
    ragged = torch.randint(1000, 2000, (8,), generator=g)
    mlp = torch.randn(128, 2 * 5632, dtype=dtype)
    gelu_x, gelu_b = torch.randn(128, 3072, dtype=dtype), torch.randn(3072, dtype=dtype)
    new1 = [torch.randn(8, KV_HEADS, 1, HEAD_DIM, dtype=dtype) for _ in range(2)]
    new128 = [torch.randn(1, KV_HEADS, 128, HEAD_DIM, dtype=dtype) for _ in range(2)]
    c1 = [c[:1] for c in caches]
    qc, kc, vc = _qkv(1, 16, dtype, kv_len=96)  # a served prompt's chunk after 80 cached tokens
    # the same chunk at SmolLM2-135M's heads (9 query / 3 key-value), the served default model's
    qs, ks, vs = (torch.randn(1, n, length, HEAD_DIM, dtype=dtype) for n, length in
                  ((9, 16), (3, 96), (3, 96)))
    # SmolLM2's served step (8 slots of 513 positions): decode rows ~60-160 tokens long, and a
    # 16-token chunk after 80 cached tokens of slot 5 (a captured mixed step's attention_chunks)
    q9, slots = torch.randn(8, 9, 1, HEAD_DIM, dtype=dtype), \
        [torch.randn(8, 3, 513, HEAD_DIM, dtype=dtype) for _ in range(2)]
    served = torch.randint(60, 160, (8,), generator=g)
    spans = torch.tensor([[5, 80, 16], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    return [
        ("rotary", "prefill 1x128", (q, k, cos, sin), {}),
        ("rotary", "decode 8x1", (qd, kd, cos_d, sin_d), {}),
        ("rotary", "gptj interleaved 1x128 r=32",
         (q, k, cos[:, :16], sin[:, :16]), {"style": "interleaved"}),
        ("bias_gelu", "128x3072", (gelu_x, gelu_b), {}),
        ("bias_gelu", "128x3072 tanh", (gelu_x, gelu_b), {"approximate": "tanh"}),
        ("bias_relu", "128x3072 (OPT)", (gelu_x, gelu_b), {}),
        ("bias_relu", "8x3072 no bias", (gelu_x[:8],), {}),
        ("silu_and_mul", "128x5632", (mlp,), {}),
        ("silu_and_mul", "8x5632", (mlp[:8],), {}),
        ("attention_prefill", "causal 1x128", (q, k, v), {}),
        ("attention_prefill", "causal+pad 2x128", (q2, k2, v2), {"key_padding_mask": mask}),
        ("attention_prefill", "alibi+pad 2x128", (q2, k2, v2),
         {"key_padding_mask": mask, "alibi_slopes": slopes}),
        ("attention_prefill", "window 32 1x128", (q, k, v), {"window": 32}),
        ("attention_prefill", "chunk 16 after 80", (qc, kc, vc), {}),
        ("attention_prefill", "chunk 16 after 80 window 32", (qc, kc, vc), {"window": 32}),
        ("attention_prefill", "chunk 16 after 80, 9/3 heads", (qs, ks, vs), {}),
        ("attention_decode", "b=1 len 1500", (qd[:1], *c1, torch.tensor([1500])), {}),
        ("attention_decode", "b=8 ragged", (qd, *caches, ragged), {}),
        ("attention_decode", "b=8 same len", (qd, *caches, torch.full((8,), 1500)), {}),
        ("attention_decode", "b=8 ragged alibi", (qd, *caches, ragged),
         {"alibi_slopes": slopes}),
        ("attention_decode", "b=8 ragged window 512", (qd, *caches, ragged), {"window": 512}),
        ("attention_decode", "b=8 ragged ~110, 9/3 heads", (q9, *slots, served), {}),
        ("attention_chunks", "chunk 16 after 80, 9/3 heads", (qs, *slots, spans), {}),
        ("kv_cache_write", "decode b=8 ragged", (*caches, *new1, ragged), {}),
        ("kv_cache_write", "decode b=8 same pos", (*caches, *new1, 1500), {}),
        ("kv_cache_write", "prefill b=1 n=128", (*c1, *new128, 0), {}),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    acc = CpuAccelerator()
    error = registry.load_backend("cpu")
    if error:
        sys.exit(f"the cpu kernel backend did not load: {error}")
    print(f"threads={torch.get_num_threads()} torch {torch.__version__}")
    for dtype in (getattr(torch, name) for name in args.dtypes):
        for op, label, call_args, kwargs in _cases(dtype):
            impls = registry.implementations(op)
            fns = [impls["reference"].fn, impls["cpu"].fn]
            t_ref, t_cpu = median_us([lambda f=f: f(*call_args, **kwargs) for f in fns],
                                     args.repeats, warmup=3)
            resolved = registry.resolve(op, acc, dtype).backend
            print(f"{str(dtype)[6:]:9s} {op:17s} {label:29s} reference {t_ref:9.1f} us  "
                  f"cpu {t_cpu:9.1f} us  {t_ref / t_cpu:5.2f}x  resolves to {resolved}")


if __name__ == "__main__":
    main()

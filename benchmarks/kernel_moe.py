"""MoE experts at decode shapes: ``moe_grouped_mlp`` (reference, ``cpu``) vs HF's experts.

    python benchmarks/kernel_moe.py --threads 2 --tokens 1 8 --hidden 1024 --inter 2816

For each dtype and token count: median µs per call of HF's ``MixtralExperts`` with its ``eager``
and ``grouped_mm`` experts implementations, the torch reference and the ``cpu`` backend (calls
interleaved so machine noise hits all alike), all on the same weights and routing (a softmax
router, top-k, renormalised), and the GB/s of expert bytes read per call: the distinct experts
hit × 3·H·I·itemsize (gate, up and down), the bytes a dropless MoE layer must read. A plain
``sum`` over all stacked expert weights gives the machine's read bandwidth for comparison.
"""

from __future__ import annotations

import argparse

import torch
from timing import median_us

from shardwise.kernels.cpu import moe as cpu_moe
from shardwise.kernels.reference import moe as ref


def hf_experts(hidden, inter, n_experts, top_k, dtype, implementation):
    """HF's MixtralExperts (random weights, ``dtype``) running ``implementation``."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=n_experts,
                        num_experts_per_tok=top_k)
    cfg._experts_implementation = implementation
    experts = MixtralExperts(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return experts.to(dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    for dtype in (getattr(torch, d) for d in args.dtypes):
        eager = hf_experts(h, i, e, k, dtype, "eager")
        grouped = hf_experts(h, i, e, k, dtype, "grouped_mm")
        grouped.load_state_dict(eager.state_dict())
        gate_up, down = eager.gate_up_proj.detach(), eager.down_proj.detach()
        t_sum = median_us([lambda: (gate_up.sum(), down.sum())], args.repeats)[0]
        all_bytes = (gate_up.numel() + down.numel()) * gate_up.element_size()
        print(f"{str(dtype)[6:]} threads={torch.get_num_threads()} H={h} I={i} E={e} k={k}: "
              f"read bandwidth (sum over all experts) {all_bytes / t_sum / 1e3:.1f} GB/s")
        for tokens in args.tokens:
            g = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, h, generator=g).to(dtype)
            weights, experts = ref.moe_route(torch.randn(tokens, e, generator=g), k,
                                              renormalize=True)
            read = len(experts.unique()) * all_bytes // e  # bytes of the experts hit
            calls = {
                "hf-eager": lambda: eager(x, experts, weights.to(dtype)),
                "hf-grouped_mm": lambda: grouped(x, experts, weights.to(dtype)),
                "reference": lambda: ref.moe_grouped_mlp(x, gate_up, down, experts, weights),
                "cpu": lambda: cpu_moe.moe_grouped_mlp(x, gate_up, down, experts, weights),
            }
            with torch.no_grad():
                times = median_us(list(calls.values()), args.repeats)
            line = "  ".join(f"{name} {t:9.0f} us {read / t / 1e3:5.1f} GB/s"
                             for name, t in zip(calls, times))
            print(f"  tokens={tokens:3d} experts hit={len(experts.unique())}: {line}  "
                  f"cpu vs eager {times[0] / times[3]:.2f}x, vs grouped_mm "
                  f"{times[1] / times[3]:.2f}x")


if __name__ == "__main__":
    main()

"""MoE experts at decode shapes: ``moe_grouped_mlp`` (reference, ``cpu`` eager and compiled) vs
HF's experts.

    python benchmarks/kernel_moe.py --threads 1 --tokens 1 8 --hidden 1024 --inter 2816

For each dtype and token count: median µs per call of HF's ``MixtralExperts`` with its ``eager``
and ``grouped_mm`` experts implementations, the torch reference, the ``cpu`` backend called
eagerly (its grouped-GEMM path: prompts, steps without graphs) and the ``cpu`` backend captured
by the CPU graph strategy (``CpuCompileStrategy``, the compiled decode step's path:
``sentinel_token_mlp`` for one token (``token_mlp`` with every expert here), else
``streamed_mlp``; at one token ``streamed-graph`` and
``token-graph`` are ``streamed_mlp`` and ``token_mlp`` captured the same way, the paths one
token took before: ``token_mlp`` reads an expert for a slot of another rank's and masks it,
``sentinel_token_mlp`` reads none for it), calls interleaved so machine noise hits all alike, all on the same weights
and routing (a softmax router, top-k, renormalised). GB/s is over the expert bytes read per
call: the distinct experts hit × 3·H·I·itemsize (gate, up and down), the bytes a dropless MoE
layer must read; ``%copy`` compares it with the machine's copy bandwidth, measured by a copy
of a 256 MiB buffer (read + write, as ``shardwise bench``'s probe counts it) timed interleaved
with the calls, on the same clock. ``--local-experts N`` times one expert-parallel
rank holding the first N experts: slots routed elsewhere carry the sentinel index N (HF's
columns, which run every expert, are left out); ``--seed`` picks another routing (at one token
and ``--local-experts 4`` of 8, top-2: seeds give both, one or none of the slots here).

``--quant int8 int4`` adds the quantized experts (``quant_moe_mlp``: int8 per channel, int4 groups
of 128, quantized from the same weights, bf16 input) captured the same way, each on the native
AVX512-VNNI kernel (``int8-native-graph``: 8-bit activations) and on torch's packed weight-only
kernels (``int8-torch-graph``: the path before), interleaved with the rest; their GB/s is over
their own packed bytes (scales included).

``--clock cpu`` times with the process's CPU time instead of the wall clock: on a shared machine
it leaves out the time the benchmark waited for a core (it still counts the memory bandwidth
others take); wall clock is the default.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from shardwise.kernels.cpu import moe as cpu_moe
from shardwise.kernels.cpu import native
from shardwise.kernels.cpu import quant as cpu_quant
from shardwise.kernels.reference import moe as ref
from shardwise.kernels.reference.quant import quantize_experts
from timing import CLOCKS, median_us


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


def captured(gate_up, down, x, experts, weights, fn=None):
    """The cpu backend's moe_grouped_mlp (or ``fn``, same arguments) as the CPU graph strategy
    captures it (x, routing as the graph's inputs, the expert weights read in place)."""
    from shardwise.accelerators.cpu_graphs import CpuCompileStrategy

    fn = fn or cpu_moe.moe_grouped_mlp

    def step(x, experts, weights):
        return fn(x, gate_up, down, experts, weights)

    graph = CpuCompileStrategy().capture(step, x, experts, weights)
    return lambda: graph(x, experts, weights)


#: --quant format → (bits, group size)
QUANT_FORMATS = {"int8": (8, -1), "int4": (4, 128)}


def quantized_experts(gate_up, down, formats):
    """{"int8-native": (kernel, (gate_up, down) packed for it, bytes per expert), ...} for each
    format in ``formats``, on the native kernel (where it builds) and torch's packed kernels."""
    kernels = {"native": cpu_quant.quant_moe_mlp} if native.load() else {}
    kernels["torch"] = cpu_quant.torch_quant_moe_mlp
    out = {}
    for fmt in formats:
        bits, group = QUANT_FORMATS[fmt]
        qws = [quantize_experts(w.float(), bits, group) for w in (gate_up, down)]
        for name, kernel in kernels.items():
            pair = tuple(kernel.prepack(qw, gate_up.shape[0], "cpu", torch.bfloat16)
                         for qw in qws)
            out[f"{fmt}-{name}"] = (kernel, pair, sum(p.nbytes for p in pair) / gate_up.shape[0])
    return out


def copy_probe(nbytes: int = 256 << 20):
    """A copy of an ``nbytes`` buffer (past the last-level cache) and the bytes it moves."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    return (lambda: dst.copy_(src)), 2 * nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--local-experts", type=int, default=None,
                    help="time one expert-parallel rank holding the first N experts")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0,
                    help="another routing (with --local-experts: which slots are this rank's)")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
    ap.add_argument("--no-compiled", action="store_true", help="skip the captured cpu column")
    ap.add_argument("--quant", nargs="*", choices=tuple(QUANT_FORMATS), default=[],
                    help="add the quantized experts, native and torch's kernels, captured")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    copy, copy_bytes = copy_probe()
    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    local = args.local_experts or e
    rows = []
    for dtype in (getattr(torch, d) for d in args.dtypes):
        eager = hf_experts(h, i, e, k, dtype, "eager")
        grouped = hf_experts(h, i, e, k, dtype, "grouped_mm")
        grouped.load_state_dict(eager.state_dict())
        gate_up, down = eager.gate_up_proj.detach(), eager.down_proj.detach()
        mine_gu, mine_down = gate_up[:local], down[:local]  # this rank's experts
        expert_bytes = 3 * h * i * gate_up.element_size()
        quantized = quantized_experts(mine_gu, mine_down, args.quant)
        for tokens in args.tokens:
            g = torch.Generator().manual_seed(tokens + args.seed)
            x = torch.randn(tokens, h, generator=g).to(dtype)
            weights, experts = ref.moe_route(torch.randn(tokens, e, generator=g), k,
                                              renormalize=True)
            mine = torch.where(experts < local, experts, local)  # local ids, the sentinel
            hit = len(mine[mine < local].unique())
            calls = {} if local != e else {  # HF's run every expert: not one rank's share
                "hf-eager": lambda: eager(x, experts, weights.to(dtype)),
                "hf-grouped_mm": lambda: grouped(x, experts, weights.to(dtype))}
            calls |= {
                "reference": lambda: ref.moe_grouped_mlp(x, mine_gu, mine_down, mine, weights),
                "cpu": lambda: cpu_moe.moe_grouped_mlp(x, mine_gu, mine_down, mine, weights),
            }
            if not args.no_compiled:
                every = local == e  # as the MoE block says to the kernel: no sentinel id
                calls["cpu-graph"] = captured(
                    mine_gu, mine_down, x, mine, weights,
                    partial(cpu_moe.moe_grouped_mlp, sentinel=False) if every else None)
                if tokens == 1:  # the paths one token took before (and token_mlp: ep=1's)
                    calls["streamed-graph"] = captured(mine_gu, mine_down, x, mine, weights,
                                                       cpu_moe.streamed_mlp)
                    calls["token-graph"] = captured(mine_gu, mine_down, x, mine, weights,
                                                    cpu_moe.token_mlp)
            for name, (kernel, pair, _) in quantized.items():
                calls[f"{name}-graph"] = captured(*pair, x.bfloat16(), mine, weights, kernel)
            calls["copy"] = copy
            with torch.no_grad():
                times = dict(zip(calls, (t / 1e6 for t in median_us(
                    list(calls.values()), args.repeats, warmup=3, clock=clock))))
            copy_gbps = copy_bytes / times.pop("copy") / 1e9
            per_expert = {f"{name}-graph": b for name, (_, _, b) in quantized.items()}
            rows.append((dtype, tokens, hit, copy_gbps, {
                name: (t, hit * per_expert.get(name, expert_bytes) / t / 1e9)
                for name, t in times.items()}))
    print(f"threads={torch.get_num_threads()} H={h} I={i} E={e} k={k}"
          f"{f' local experts={local}' if local != e else ''} clock={args.clock}")
    for dtype, tokens, hit, copy_gbps, cols in rows:
        line = "  ".join(f"{name} {t * 1e6:8.0f} us {gbps:5.1f} GB/s {gbps / copy_gbps:4.0%}"
                         for name, (t, gbps) in cols.items())
        best = "cpu-graph" if "cpu-graph" in cols else "cpu"
        ratios = ", ".join(f"vs {name} {cols[name][0] / cols[best][0]:.2f}x"
                           for name in ("hf-eager", "hf-grouped_mm", "cpu", "streamed-graph",
                                        "token-graph")
                           if name in cols and name != best)
        for fmt in args.quant:  # native vs torch's kernels, both captured
            if f"{fmt}-native-graph" in cols:
                ratios += (f", {fmt} native vs torch "
                           f"{cols[f'{fmt}-torch-graph'][0] / cols[f'{fmt}-native-graph'][0]:.2f}x"
                           f" (vs {best} {cols[best][0] / cols[f'{fmt}-native-graph'][0]:.2f}x)")
        print(f"{str(dtype)[6:]:8s} tokens={tokens:3d} experts hit={hit} copy "
              f"{copy_gbps:.1f} GB/s: {line}  {best} {ratios}")


if __name__ == "__main__":
    main()

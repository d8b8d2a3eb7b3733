"""Kernel injection composed with tensor parallelism on 2 gloo ranks: the injected layers run on
the sharded weights and the row-parallel all-reduce still happens (through the sharding hooks and
the engine's communicator), so TP=2 + injection gives HF's logits and tokens.

All cases run in ONE pair of processes (module-scoped fixture). Tolerances about 2× the max
measured over every case (``pytest -s`` prints each; under load, x86-64, torch 2.13):
* fp32: logits within ``FP32_ATOL`` = 7e-7 of HF, on the prompt and along HF's 32-token greedy
  continuation (measured ≤ 3.6e-7 and ≤ 4.2e-7, falcon-7heads-mqa: the row-parallel all-reduce
  sums the two ranks' partial products), and identical greedy tokens.
  With ``weight_dtype`` (16-bit weights under fp32 compute) the reference is the fp32 model with
  its weights rounded once (tests/test_weight_dtype.py), to the same tolerance.
* bf16: logits along HF's continuation within ``BF16_ATOL`` = 0.016 of HF bf16 (measured ≤
  0.0078, bloom; 0.0039 to 0.0059 for the rest) and teacher-forced agreement (tests/models.py)
  ≥ ``MIN_FORCED_AGREEMENT`` = 0.9 (measured ≥ 0.97, gptj; 1.0 for the rest).
"""

from __future__ import annotations

import pytest
import torch

import shardwise
from families import families
from models import (MIN_FORCED_AGREEMENT, prompt_ids, rounded_copy, teacher_forced_agreement,
                    tiny_causal_lm)
from tp_harness import TP, with_random_biases, case, digest, table_fixture

FP32_ATOL = 7e-7
BF16_ATOL = 0.016
NEW = 32
FAMILIES = families(kind="causal", inject=2, uneven_heads=False)  # tests/families.py
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inject_case(rank: int, arch: str, dtype: torch.dtype, graphs: str | None = None,
                 fuse: bool = True, weight_dtype: torch.dtype | None = None) -> dict:
    import os

    from shardwise.accelerators.cpu import CpuAccelerator
    from shardwise.inject.fuse import FUSE_ENV

    original = CpuAccelerator.graph_strategy
    if graphs == "replay":  # an accelerating strategy on CPU tensors (see test_inject.py)
        from graph_doubles import ReplayOnCpu

        CpuAccelerator.graph_strategy = lambda self: ReplayOnCpu()
    os.environ[FUSE_ENV] = "1" if fuse else "0"  # fused q|k|v and gate|up, or not
    try:
        return _run_case(rank, arch, dtype, graphs, weight_dtype)
    finally:
        CpuAccelerator.graph_strategy = original
        os.environ.pop(FUSE_ENV)


def _run_case(rank: int, arch: str, dtype: torch.dtype, graphs: str | None,
              weight_dtype: torch.dtype | None = None) -> dict:
    from shardwise.inject import InjectedModel
    from shardwise.inject.injector import injected_stack

    ref = with_random_biases(tiny_causal_lm(arch)).to(dtype)
    if weight_dtype is not None:  # the oracle: the fp32 model with its weights rounded once
        ref = rounded_copy(ref, weight_dtype)
    model = with_random_biases(tiny_causal_lm(arch))
    ids = prompt_ids(batch=2, length=8, vocab=ref.config.vocab_size)
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref_logits, ref_tokens = ref(ids).logits.float(), ref.generate(ids, **gen)
    engine = shardwise.init_inference(model, device="cpu", dtype=dtype,
                                      replace_with_kernel_inject=True,
                                      enable_graph=graphs is not None,
                                      weight_dtype=weight_dtype, **TP)
    mine = ids if rank == 0 else torch.zeros_like(ids)  # the engine broadcasts rank 0's inputs
    logits = engine(input_ids=mine).logits.float()
    tokens = engine.generate(mine, **gen)
    with torch.no_grad():  # teacher forcing: HF's continuation [2, 8 + 32], one forward each
        forced_ref = ref(ref_tokens).logits.float()
    forced_in = ref_tokens if rank == 0 else torch.zeros_like(ref_tokens)
    forced_logits = engine(input_ids=forced_in).logits.float()
    stack = injected_stack(model)
    from shardwise.inject.fuse import fusion_report

    return dict(fused=fusion_report(stack),max_abs=(logits - ref_logits).abs().max().item(),
                forced=teacher_forced_agreement(forced_ref, forced_logits, ids.shape[1]),
                forced_max_abs=(forced_logits - forced_ref).abs().max().item(),
                tokens_equal=torch.equal(tokens, ref_tokens), digest=digest(logits),
                injected=isinstance(stack, InjectedModel),
                local_q_heads=stack.parts.layers[0].q_heads,
                graphs=stack.graphs is not None,
                compiles=getattr(getattr(stack.graphs, "strategy", None), "compiles", None),
                buckets=sorted(stack.graphs.buckets()) if stack.graphs else None)


CASES = {f"{arch}-{name}": (arch, dtype, None) for arch in FAMILIES
         for name, dtype in DTYPES.items()}
# uneven heads (7 over 2 ranks: 4 | 3): per-head fused qkv, multi-query with its kv head on both
for _arch in families(inject=2, uneven_heads=True):
    CASES[f"{_arch}-fp32"] = (_arch, torch.float32, None)
CASES["llama-fp32-graphs-replay"] = ("llama", torch.float32, "replay")
CASES["bloom-fp32-graphs-replay"] = ("bloom", torch.float32, "replay")  # ALiBi per rank
CASES["gpt_neo-fp32-graphs-replay"] = ("gpt_neo", torch.float32, "replay")  # local windows
# the CPU graph strategy itself: each rank compiles its step, all-reduces as an opaque op
CASES["gpt2-fp32-graphs-compiled"] = ("gpt2", torch.float32, "compiled")
CASES["llama-fp32-graphs-compiled"] = ("llama", torch.float32, "compiled")
# 16-bit weights under fp32 compute (weight_dtype), each rank its shards: the rounded fp32 model
CASES["llama-fp32-bf16-weights-graphs-compiled"] = ("llama", torch.float32, "compiled", True,
                                                    torch.bfloat16)
# fused q|k|v and gate|up (on by default: every case above with separate projections runs them
# fused, each rank over its own shards) against the unfused projections
CASES["llama-fp32-unfused"] = ("llama", torch.float32, None, False)
CASES["qwen2-bf16-unfused"] = ("qwen2", torch.bfloat16, None, False)
#: families whose q, k, v (and gate, up) are separate linears: fused in both layers per rank
SEPARATE_QKV = {"llama", "llama-7heads", "llama-gqa-6q3kv", "mistral", "qwen2", "opt", "gptj",
                "gpt_neo", "mistral-sw4", "qwen2-sw4"}


ranks = table_fixture(_inject_case, CASES, "inject_tp")


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_injection_matches_hf(ranks, name):
    r0, r1 = case(ranks, name)
    arch, dtype, graphs, *fuse = CASES[name]
    fuse = fuse[:1]
    assert r0["injected"] and r1["injected"]
    fused = arch in SEPARATE_QKV and fuse != [False]
    assert r0["fused"]["q|k|v"] == r1["fused"]["q|k|v"] == (2 if fused else 0), r0["fused"]
    heads = 7 if "7heads" in arch else 4  # the rank's whole heads: 2 | 2 or 4 | 3
    assert (r0["local_q_heads"], r1["local_q_heads"]) == ((heads + 1) // 2, heads // 2)
    assert r0["digest"] == r1["digest"]  # every rank returns the same logits
    print(f"{name}: max |logit diff| prompt {r0['max_abs']:.2e}, along HF's continuation "
          f"{r0['forced_max_abs']:.2e}; teacher-forced agreement {r0['forced']:.3f}")
    if dtype == torch.float32:
        assert r0["max_abs"] < FP32_ATOL, r0["max_abs"]
        assert r0["forced_max_abs"] < FP32_ATOL, r0["forced_max_abs"]
        assert r0["tokens_equal"] and r1["tokens_equal"]
    else:
        assert r0["forced_max_abs"] < BF16_ATOL, r0["forced_max_abs"]
        assert r0["forced"] >= MIN_FORCED_AGREEMENT, r0["forced"]
    assert r0["graphs"] == r1["graphs"] == (graphs is not None)
    if graphs == "compiled":  # the init trial (batch 1) and batch 2; none as lengths grew
        assert r0["compiles"] == r1["compiles"] == 2 and r0["buckets"] == [1, 2]

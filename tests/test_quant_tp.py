"""Quantization under tensor parallelism (2 gloo ranks, one process pair for every case): each
rank quantizes its own shards after sharding (scales follow their rows), the row-parallel
all-reduce hooks keep working on the QuantLinear that replaced the module, both ranks compute the
same logits, and parity with the fp32 single-process model holds within families.QUANT_BOUNDS
(test_quant's bounds at TP=1)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import shardwise
from families import QUANT_BOUNDS as BOUNDS, families, family
from models import logit_parity as parity, prompt_ids, tiny_causal_lm
from tp_harness import TP, case, digest, run_cases, run_pair

CASES = [(arch, bits) for arch in families(quant_bits=True) for bits in family(arch).quant_bits]


def quant_case(rank: int, arch: str, bits: int) -> dict:
    from shardwise.quant import QuantLinear

    ref, model = tiny_causal_lm(arch), tiny_causal_lm(arch)
    ids = prompt_ids(batch=2, length=16)
    with torch.no_grad():
        ref_logits = ref(ids).logits
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16,
                                      quant={"weight": {"num_bits": bits}}, **TP)
    mine = ids if rank == 0 else torch.zeros_like(ids)
    logits = engine(input_ids=mine).logits
    rel, agree = parity(ref_logits, logits)
    tokens = engine.generate(mine[:1, :8], max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    rows = [n for n, s in engine.sharding.sharded.items() if s.role == "row"]
    row_quantized = [n for n in rows if isinstance(model.get_submodule(n), QuantLinear)]
    row_hooked = [n for n in row_quantized if model.get_submodule(n)._forward_hooks]
    report = engine.quantization
    return dict(rel=rel, agree=agree, digest=digest(logits.float()), tokens=tokens.tolist(),
                rows=len(rows), row_quantized=len(row_quantized), row_hooked=len(row_hooked),
                layers=report.layers_quantized, backends=report.backends(),
                bytes_before=report.bytes_before, bytes_after=report.bytes_after)


#: (arch, weight bits) whose output head, tied to the input embeddings, is quantized too
TIED_CASES = [("gpt2", 8), ("gpt2", 4)]


def tied_case(rank: int, arch: str, bits: int) -> dict:
    """The vocab-parallel head and embedding share one table per rank: quantized once."""
    from shardwise.quant import QuantLinear
    from shardwise.quant.tied import QuantEmbedding

    ref, model = tiny_causal_lm(arch), tiny_causal_lm(arch)
    ids = prompt_ids(batch=2, length=16)
    with torch.no_grad():
        ref_logits = ref(ids).logits
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16,
                                      quant={"weight": {"num_bits": bits}, "lm_head": True},
                                      **TP)
    mine = ids if rank == 0 else torch.zeros_like(ids)
    logits = engine(input_ids=mine).logits
    rel, agree = parity(ref_logits, logits)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return dict(rel=rel, agree=agree, digest=digest(logits.float()),
                head=isinstance(head, QuantLinear), head_rows=head.out_features,
                embed=isinstance(embed, QuantEmbedding) and embed.head is head,
                embed_hooked=bool(embed._forward_pre_hooks) and bool(embed._forward_hooks),
                vocab=ref.get_input_embeddings().weight.shape[0])


def replicas_case(folder: str) -> dict:
    """Two ranks without tensor parallelism are two replicas of the model: a quantized
    checkpoint they save holds one rank file (tp 1), and each reads that file back (rank 1 used
    to look for a file of its own and was refused)."""
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu", dtype=torch.bfloat16,
                                      quant={"weight": {"num_bits": 8}})
    path = engine.save_checkpoint(folder)
    loaded = shardwise.init_inference(None, checkpoint=path, device="cpu", dtype=torch.bfloat16)
    ids = prompt_ids(batch=1, length=8)
    return dict(saved=engine.generate(ids, **kw).tolist(), loaded=loaded.generate(ids, **kw).tolist())


def _run_all(rank: int, folder: str) -> dict:
    cases = {f"{a}-int{b}": (lambda a=a, b=b: quant_case(rank, a, b)) for a, b in CASES}
    cases.update({f"tied-{a}-int{b}": (lambda a=a, b=b: tied_case(rank, a, b))
                  for a, b in TIED_CASES})
    cases["replicas"] = lambda: replicas_case(folder)
    return run_cases(rank, cases)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("quant_tp_replicas") / "saved")
    return run_pair(partial(_run_all, folder=folder), tmp_path_factory.mktemp("quant_tp"))


def test_replicas_read_a_tp1_quantized_checkpoint(ranks):
    first, second = case(ranks, "replicas")
    assert first["loaded"] == first["saved"] == second["loaded"] == second["saved"]


@pytest.mark.parametrize("arch,bits", CASES)
def test_tp2_quantized_parity(ranks, arch, bits):
    r0, r1 = case(ranks, f"{arch}-int{bits}")
    print(f"{arch} int{bits} tp2: rel {r0['rel']:.4f} agree {r0['agree']:.2f} "
          f"bytes {r0['bytes_before']} -> {r0['bytes_after']} ({r0['seconds']:.1f} s)")
    assert r0["digest"] == r1["digest"] and r0["tokens"] == r1["tokens"]  # ranks agree
    max_rel, min_agree = BOUNDS[bits]
    assert r0["rel"] <= max_rel and r0["agree"] >= min_agree, (r0["rel"], r0["agree"])
    assert r0["rows"] > 0 and r0["row_quantized"] == r0["rows"] == r0["row_hooked"]
    assert {b for kinds in r0["backends"].values() for b in kinds} == {"cpu"}
    assert r0["bytes_after"] < r0["bytes_before"]


@pytest.mark.parametrize("arch,bits", TIED_CASES)
def test_tp2_tied_head_is_quantized_once_per_rank(ranks, arch, bits):
    """Each rank holds its vocab slice of the tied table once, quantized; the embedding keeps
    the vocab-parallel mask / all-reduce hooks; ranks agree and parity holds."""
    r0, r1 = case(ranks, f"tied-{arch}-int{bits}")
    print(f"{arch} int{bits} tied head tp2: rel {r0['rel']:.4f} agree {r0['agree']:.2f}")
    assert r0["digest"] == r1["digest"]
    for r in (r0, r1):
        assert r["head"] and r["embed"] and r["embed_hooked"]
        assert r["head_rows"] * 2 == r["vocab"]  # this rank's vocab slice
    max_rel, min_agree = BOUNDS[bits]
    assert r0["rel"] <= max_rel and r0["agree"] >= min_agree, (r0["rel"], r0["agree"])

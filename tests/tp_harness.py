"""Shared harness for tensor-parallel parity tests on 2 gloo ranks.

``hf_case(rank, arch)`` runs one tiny HF architecture (tests/models.py) through init_inference with
tp_size=2 on the calling rank and returns what the tests assert on: max logit difference against
the single-process model, greedy/sampled tokens, digests to compare ranks, and the sharding report.
``run_cases(rank, cases)`` runs a table of such cases in one process pair, each recording its own
result or error; ``case(ranks, name)`` fetches one case's results from both ranks.
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback
from functools import partial

import pytest
import torch
from torch import nn

import shardwise
from distributed import run_ranks
from models import prompt_ids, tiny_causal_lm

TP = {"tensor_parallel": {"tp_size": 2}}
NEW_TOKENS = 32
#: fp32 logits, TP=2 vs the single-process model: about 2× the max measured over every causal
#: family in test_tp*.py (≤ 3.6e-7, falcon-7heads-mqa; the rest ≤ 3e-7: the all-reduce sums the
#: ranks' partial products in another order; ``pytest -s`` prints each; under load, x86-64)
ATOL = 7e-7


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]


def _expected_rank_bytes(ref: nn.Module, report) -> int:
    """Whole-model bytes minus half of what the sharded modules split (row biases stay whole)."""
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    split, seen = 0, set()
    for name, info in report.sharded.items():
        for pname, p in ref.get_submodule(name).named_parameters(recurse=False):
            if id(p) in seen or (pname == "bias" and info.role == "row"):
                continue
            seen.add(id(p))
            split += p.numel() * p.element_size()
    return total - split // 2


def with_random_biases(model: nn.Module) -> nn.Module:
    """HF initialises biases to zero, which would hide a bias added twice or split wrongly."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def hf_case(rank: int, arch: str, injection_policy=None, even: bool = True,
             attention: str | None = None) -> dict:
    ref, model = (with_random_biases(tiny_causal_lm(arch)) for _ in range(2))
    if attention:  # eager attention reads num_key_value_groups; SDPA infers it from shapes
        for m in (ref, model):
            m.set_attn_implementation(attention)
    vocab = ref.config.vocab_size
    ids = prompt_ids(batch=2, length=8, vocab=vocab)
    gen = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
               pad_token_id=0)
    with torch.no_grad():
        ref_logits = ref(ids).logits
        ref_tokens = ref.generate(ids, **gen)
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      injection_policy=injection_policy, **TP)
    mine = ids if rank == 0 else torch.zeros_like(ids)  # the engine broadcasts rank 0's inputs
    logits = engine(input_ids=mine).logits
    tokens = engine.generate(mine, **gen)
    with torch.no_grad():  # hooks live on the modules: the bare HF generate works too
        module_tokens = model.generate(ids, **dict(gen, max_new_tokens=8, min_new_tokens=8))
    sampled = engine.generate(mine, max_new_tokens=8, do_sample=True, pad_token_id=0)
    report = engine.sharding
    return dict(
        max_abs=(logits - ref_logits).abs().max().item(), shape=list(logits.shape),
        tokens_equal=torch.equal(tokens, ref_tokens),
        module_tokens_equal=torch.equal(module_tokens, ref_tokens[:, :ids.shape[1] + 8]),
        digest=digest(logits), tokens=tokens.tolist(), sampled=sampled.tolist(),
        source=report.source, roles=dict(report.roles()), heads=report.heads,
        rank_bytes=report.rank_param_bytes, counted_bytes=sum(
            p.numel() * p.element_size() for p in model.parameters()),
        expected_bytes=_expected_rank_bytes(ref, report) if even else None,
        tied=_tied(model), summary=report.summary())


def _tied(model: nn.Module):
    out, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return None if out is None else out.weight is emb.weight


def run_cases(rank: int, cases: dict) -> dict:
    """Run every case (name -> zero-argument callable) on this rank; errors are recorded."""
    os.environ.pop("OMP_NUM_THREADS", None)  # let the accelerator split the cores between ranks,
    shardwise.get_accelerator("cpu").configure_process(rank, 2)  # now: the references run first
    out = {}
    for name, run in cases.items():
        start = time.perf_counter()
        try:
            out[name] = {"ok": True, **run(), "seconds": time.perf_counter() - start}
        except Exception as exc:
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "trace": traceback.format_exc()}
    return out


def run_table(rank: int, fn, table: dict) -> dict:
    """:func:`run_cases` over a table of cases: name -> args, each run as ``fn(rank, *args)``."""
    return run_cases(rank, {name: partial(fn, rank, *args) for name, args in table.items()})


def table_fixture(fn, table: dict, tag: str, deadline_s: float = 240, case_dirs: bool = False):
    """A module-scoped fixture running every case of ``table`` (see :func:`run_table`) in ONE
    pair of ranks; its value is each rank's results (read them with :func:`case`).
    ``case_dirs``: each case gets one more argument, a directory of its own that both ranks
    share (e.g. an offload store)."""
    @pytest.fixture(scope="module")
    def ranks(tmp_path_factory):
        cases = table
        if case_dirs:
            root = tmp_path_factory.mktemp(f"{tag}-cases")
            cases = {name: (*args, str(root / name)) for name, args in table.items()}
        return run_pair(partial(run_table, fn=fn, table=cases), tmp_path_factory.mktemp(tag),
                        deadline_s=deadline_s)
    return ranks


def run_pair(run_all, tmp_dir, deadline_s: float = 240) -> list[dict]:
    """Run ``run_all(rank)`` on 2 gloo ranks; each rank's returned dict, in rank order."""
    results = run_ranks(run_all, 2, tmp_dir, deadline_s=deadline_s)
    for res in results:
        assert res["ok"], res.get("trace", res["error"])
    return [res["value"] for res in results]


def case(ranks, name) -> tuple[dict, dict]:
    """Results of case ``name`` on rank 0 and rank 1 (failing if either raised)."""
    if name not in ranks[0]:
        pytest.fail(f"case {name!r} was not run: add it to the module's case table "
                    f"(ran: {', '.join(ranks[0])})")
    r0, r1 = ranks[0][name], ranks[1][name]
    for r in (r0, r1):
        assert r["ok"], r.get("trace", r.get("error"))
    return r0, r1


def pipeline_beam_case(arch: str, micro_batches: int, **init_kw) -> dict:
    """Beam search (3 beams over 2 prompts: 6 rows) at PP=2 with ``micro_batches`` against HF:
    HF reorders the batch's cache every step, across the micro-batches' rows, and the stages'
    caches must follow. ``init_kw``: further ``init_inference`` keywords (e.g. injection)."""
    ref, model = tiny_causal_lm(arch), tiny_causal_lm(arch)
    ids = prompt_ids(batch=2, length=8, vocab=ref.config.vocab_size)
    gen = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
               num_beams=3)
    with torch.no_grad():
        ref_tokens = ref.generate(ids, **gen)
    engine = shardwise.init_inference(
        model, device="cpu", dtype=torch.float32,
        pipeline_parallel={"pp_size": 2, "micro_batches": micro_batches}, **init_kw)
    tokens = engine.generate(ids, **gen)
    steps = engine.pipeline_stats.steps
    engine.close()
    return dict(tokens_equal=torch.equal(tokens, ref_tokens), tokens=tokens.tolist(), steps=steps)


def assert_parity(ranks, name, label: str = "TP=2", atol: float = ATOL) -> tuple[dict, dict]:
    """Case ``name`` matches the single-process model on both ranks (logits within ``atol``, greedy
    tokens from engine.generate and module.generate), and the ranks agree bit for bit. Returns
    both ranks' results."""
    r0, r1 = case(ranks, name)
    print(f"{name} {label} fp32: max |logit diff| {max(r0['max_abs'], r1['max_abs']):.2e}")
    for r in (r0, r1):
        assert r["max_abs"] < atol, (f"{name}: logits differ by {r['max_abs']:.2e}\n"
                                     f"{r.get('summary', '')}")
        assert r["tokens_equal"], f"{name}: {NEW_TOKENS} greedy tokens differ from HF's"
        assert r["module_tokens_equal"], f"{name}: engine.module.generate differs from HF's"
    assert r0["digest"] == r1["digest"], "ranks returned different logits"
    assert r0["tokens"] == r1["tokens"]
    assert r0["sampled"] == r1["sampled"], "sampling drew different tokens on the two ranks"
    return r0, r1

"""Expert parallelism over part of the world: several expert groups (4 gloo ranks, ep_size=2).

Each expert group is ``ep`` consecutive ranks (0-1 and 2-3) holding every expert once, so each
expert is held by two ranks (``ep_coord = rank mod 2``); every rank holds the same tokens, and
each group's all-reduce gives its ranks the whole MoE output. Cases, all in ONE start of 4
processes (tiny models, so the ranks' start-up dominates):

* ``tp4`` — attention split by heads over the 4 ranks (tp=4), the experts by ep=2: Mixtral;
* ``tp1`` — the dense parts replicated on 4 ranks, the experts by ep=2: Qwen2-MoE (a shared
  expert with its gate) and DeepSeek-V3 (shared experts, grouped sigmoid router, a leading dense
  layer);
* ``tp4-all-to-all`` — Mixtral with tokens sent to their experts' ranks inside each group;
* ``save-tp4`` — the tp=4 ep=2 engine saves its checkpoint (4 rank files, each with its rank's
  experts) and the same sizes load it back, each rank reading only what it holds;
* ``quant-tp4`` — int8 experts (fp32 compute) saved and loaded back at tp=4 ep=2 bit for bit.

Against HF in fp32: logits within :data:`ATOL` and 16 greedy tokens identical on every rank;
``close()`` gives every experts module back whole (gathered over the 4 ranks).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

import shardwise
from distributed import run_ranks
from models import prompt_ids, tiny_causal_lm

WORLD = 4
EP = 2
NEW = 16
ATOL = 1e-4
GEN = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
#: name → (family, init_inference settings)
CASES = {
    "tp4-mixtral": ("mixtral", dict(tensor_parallel={"tp_size": 4})),
    "tp1-qwen2_moe": ("qwen2_moe", {}),
    "tp1-deepseek_v3": ("deepseek_v3", {}),
    "tp4-all-to-all-mixtral": ("mixtral", dict(tensor_parallel={"tp_size": 4},
                                               moe={"ep_size": EP, "dispatch": "all_to_all"})),
}

pytestmark = pytest.mark.slow


def _experts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from shardwise.quant.experts import expert_modules

    return {n: model.get_submodule(n) for n in expert_modules(model)}


def _reference(arch: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ref = tiny_causal_lm(arch)
    with torch.no_grad():
        return ref(ids).logits, ref.generate(ids, **GEN)


def _parity_case(arch: str, settings: dict) -> dict:
    """``arch`` at ep=2 of 4 ranks (and ``settings``) against HF; what the rank holds; what
    close() gives back."""
    ids = prompt_ids(batch=2, length=8)
    want, want_tokens = _reference(arch, ids)
    model = tiny_causal_lm(arch)
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      **{"moe": {"ep_size": EP}, **settings})
    logits, tokens = engine(input_ids=ids).logits, engine.generate(ids, **GEN)
    held = sorted({m.gate_up_proj.shape[0] for m in _experts(model).values()})
    result = dict(max_abs=(logits - want).abs().max().item(),
                  tokens_equal=torch.equal(tokens, want_tokens), held=held,
                  range=list(engine.plan.experts.range), ep_group=list(engine.plan.ep.group.ranks))
    engine.close()
    original = tiny_causal_lm(arch)
    result["back_equal"] = all(
        torch.equal(m.gate_up_proj, original.get_submodule(n).gate_up_proj)
        and torch.equal(m.down_proj, original.get_submodule(n).down_proj)
        for n, m in _experts(model).items())
    return result


def _save_case(root: Path, quant: dict | None) -> dict:
    """Mixtral at tp=4 ep=2 (``quant``: its int8 experts and linears, fp32 compute) saves
    itself; the same sizes load it back from the checkpoint."""
    sizes = dict(tensor_parallel={"tp_size": 4}, moe={"ep_size": EP})
    ids = prompt_ids(batch=2, length=8)
    saver = shardwise.init_inference(tiny_causal_lm("mixtral"), device="cpu",
                                     dtype=torch.float32, quant=quant, **sizes)
    logits, tokens = saver(input_ids=ids).logits, saver.generate(ids, **GEN)
    path = root / ("quant" if quant else "float")
    saver.save_checkpoint(path)
    loaded = shardwise.init_inference(None, checkpoint=str(path), device="cpu", **sizes)
    unique = {id(t): t for t in loaded.module.state_dict(keep_vars=True).values()}
    return dict(logits_equal=torch.equal(loaded(input_ids=ids).logits, logits),
                tokens_equal=torch.equal(loaded.generate(ids, **GEN), tokens),
                bytes_read=loaded.checkpoint_load.bytes_read,
                held_bytes=sum(t.numel() * t.element_size() for t in unique.values()),
                files=len(list(path.glob("*.safetensors"))))


def _all_cases(rank: int, root: str) -> dict:
    import time
    import traceback

    shardwise.get_accelerator("cpu").configure_process(rank, WORLD)
    cases = {name: partial(_parity_case, arch, settings)
             for name, (arch, settings) in CASES.items()}
    cases["save-tp4"] = partial(_save_case, Path(root), None)
    cases["quant-tp4"] = partial(_save_case, Path(root), {"weight": {"num_bits": 8}})
    out = {}
    for name, run in cases.items():
        start = time.perf_counter()
        try:
            out[name] = {"ok": True, **run(), "seconds": time.perf_counter() - start}
        except Exception as exc:  # recorded: the test names the case and its trace
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "trace": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_groups")
    results = run_ranks(_all_cases, WORLD, tmp_path_factory.mktemp("ranks"), str(root),
                        deadline_s=600)
    for r in results:
        assert r["ok"], r.get("trace", r["error"])
    return [r["value"] for r in results]


def _case(ranks, name: str) -> list[dict]:
    out = [r[name] for r in ranks]
    for r in out:
        assert r["ok"], r.get("trace", r.get("error"))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_two_expert_groups_of_two_ranks_match_hf(ranks, name):
    """Every rank gives HF's logits and greedy tokens; rank r holds ep coordinate r mod 2's
    experts (half of them), its expert group is its pair of consecutive ranks; close() gives
    the experts back whole."""
    arch, _ = CASES[name]
    total = {m.gate_up_proj.shape[0] for m in _experts(tiny_causal_lm(arch)).values()}.pop()
    halves = [[0, total // 2], [total // 2, total]]
    for rank, r in enumerate(_case(ranks, name)):
        assert r["max_abs"] < ATOL, (rank, r["max_abs"])
        assert r["tokens_equal"], rank
        assert r["range"] == halves[rank % EP] and r["held"] == [total // 2]
        assert r["ep_group"] == [rank - rank % EP + c for c in range(EP)]
        assert r["back_equal"], rank


@pytest.mark.parametrize("name", ["save-tp4", "quant-tp4"])
def test_a_checkpoint_saved_with_two_expert_groups_loads_back_at_its_sizes(ranks, name):
    """Saved at tp=4 ep=2 (float, and int8 packed experts): 4 rank files; loaded back at the
    same sizes every rank computes the saver's logits and tokens bit for bit, reading exactly
    the tensors it holds."""
    for rank, r in enumerate(_case(ranks, name)):
        assert r["logits_equal"] and r["tokens_equal"], (rank, r)
        assert r["bytes_read"] == r["held_bytes"], (rank, r)
        assert r["files"] == WORLD

"""Tensor parallelism end to end on 2 gloo ranks: TP=2 logits match the plain single-process HF
model, greedy tokens are identical, every rank returns the same outputs, and each rank holds about
half of the sharded weights.

All cases run in ONE pair of processes (a module-scoped fixture) to keep the file fast; each case
records its own result or error, and each test asserts on one case.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise
from families import families
from models import prompt_ids, tiny_causal_lm
from tp_harness import TP, assert_parity, case, digest, hf_case, run_cases, run_pair


#: OddNet's outputs (fp32, larger than the HF models' logits): measured ≤ 7.2e-7 at TP=2
ODD_ATOL = 1.5e-6


# ----- a model no heuristic or policy knows: odd names, no config ---------------------------------

class OddBlock(nn.Module):
    """Attention + MLP with names nothing in shardwise has heard of."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.norm_a, self.norm_b = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mix_a, self.mix_b, self.mix_c = (nn.Linear(width, width) for _ in range(3))
        self.squash = nn.Linear(width, width)  # row-parallel: after attention
        self.widen = nn.Linear(width, 3 * width)
        self.narrow = nn.Linear(3 * width, width)  # row-parallel: after the MLP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm_a(x)
        q, k, v = (p(h).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, heads, s, hd]
                   for p in (self.mix_a, self.mix_b, self.mix_c))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.squash(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.narrow(nn.functional.gelu(self.widen(self.norm_b(x))))


class OddNet(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 64) -> None:
        super().__init__()
        self.lookup = nn.Embedding(vocab, width)
        self.stack = nn.ModuleList(OddBlock(width) for _ in range(2))
        self.readout = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.lookup(ids)
        for block in self.stack:
            x = block(x)
        return self.readout(x)


def odd_net(seed: int = 0) -> OddNet:
    torch.manual_seed(seed)
    return OddNet().eval()


# ----- what each rank runs ------------------------------------------------------------------------

def _odd_case(rank: int) -> dict:
    ref, model = odd_net(), odd_net()
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        expected = ref(ids)
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      injection_policy={OddBlock: ("squash", "narrow")}, **TP)
    out = engine(ids if rank == 0 else torch.zeros_like(ids))
    return dict(max_abs=(out - expected).abs().max().item(), digest=digest(out),
                source=engine.sharding.source, roles=dict(engine.sharding.roles()),
                squash_in=model.stack[0].squash.in_features)


def _missing_module_case(rank: int) -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    try:
        shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                 injection_policy={LlamaDecoderLayer: ("self_attn.o_prj",)}, **TP)
    except shardwise.ConfigError as exc:
        return {"error": str(exc)}
    return {"error": None}


def _cases(rank: int) -> dict:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {
        "llama": lambda: hf_case(rank, "llama"),
        # its 1 kv head is replicated on both ranks, so not half the bytes
        "mistral": lambda: hf_case(rank, "mistral", even=False, attention="eager"),
        "qwen2": lambda: hf_case(rank, "qwen2"),
        "gpt2": lambda: hf_case(rank, "gpt2"),
        "opt": lambda: hf_case(rank, "opt"),
        "llama-7heads": lambda: hf_case(rank, "llama-7heads", even=False),
        "llama-gqa-6q3kv": lambda: hf_case(rank, "llama-gqa-6q3kv", even=False),
        "llama-injection-policy": lambda: hf_case(
            rank, "llama", {LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}),
        "odd-injection-policy": lambda: _odd_case(rank),
        "missing-module": lambda: _missing_module_case(rank),
    }


def _run_all(rank: int) -> dict:
    return run_cases(rank, _cases(rank))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_pair(_run_all, tmp_path_factory.mktemp("tp"))


# ----- the tests ----------------------------------------------------------------------------------

#: the model types whose TP=2 families (tests/families.py) this file runs, and a user's policy
MODEL_TYPES = ("llama", "mistral", "qwen2", "gpt2", "opt")
PARITY = [*families(tp=True, model_type=MODEL_TYPES), "llama-injection-policy"]


@pytest.mark.slow
@pytest.mark.parametrize("name", PARITY)
def test_tp2_matches_the_single_process_model(ranks, name):
    assert_parity(ranks, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*families(tp_even=True, model_type=MODEL_TYPES),
                                  "llama-injection-policy"])
def test_each_rank_holds_half_of_the_sharded_weights(ranks, name):
    r0, r1 = case(ranks, name)
    assert r0["rank_bytes"] == r1["rank_bytes"]
    for rank, r in enumerate((r0, r1)):
        assert r["rank_bytes"][rank] == r["counted_bytes"]  # the report counts what is there
        assert r["counted_bytes"] == r["expected_bytes"], r["summary"]


@pytest.mark.slow
def test_plan_sources_roles_and_ties(ranks):
    by = {name: case(ranks, name)[0] for name in PARITY}
    assert by["llama"]["source"] == "hf_tp_plan"
    assert by["gpt2"]["source"] == "policy:gpt2" and by["opt"]["source"] == "policy:opt"
    assert by["llama-injection-policy"]["source"] == "injection_policy"
    assert by["llama"]["roles"] == {"column": 10, "row": 4, "vocab_embedding": 1,
                                    "vocab_head": 1}
    assert by["llama-injection-policy"]["roles"] == {"column": 10, "row": 4}  # blocks only
    assert by["gpt2"]["tied"] is True and by["opt"]["tied"] is True  # still one Parameter
    assert by["mistral"]["heads"] == [2, 1]  # one kv head, replicated; q heads split
    heads = [case(ranks, "llama-7heads")[r]["heads"] for r in (0, 1)]
    assert heads == [[4, 4], [3, 3]]
    gqa = [case(ranks, "llama-gqa-6q3kv")[r]["heads"] for r in (0, 1)]
    assert gqa == [[4, 2], [2, 1]]  # whole kv groups: 2|1 kv heads, 4|2 q heads


@pytest.mark.slow
def test_user_plan_on_a_model_nothing_knows(ranks):
    r0, r1 = case(ranks, "odd-injection-policy")
    print(f"odd-injection-policy TP=2 fp32: max |diff| {max(r0['max_abs'], r1['max_abs']):.2e}")
    assert r0["max_abs"] < ODD_ATOL and r1["max_abs"] < ODD_ATOL
    assert r0["digest"] == r1["digest"]
    assert r0["roles"] == {"column": 8, "row": 4}
    assert r0["squash_in"] == 32


@pytest.mark.slow
def test_plan_naming_a_missing_module_fails_on_every_rank(ranks):
    for r in case(ranks, "missing-module"):
        assert r["error"] and "'self_attn.o_prj'" in r["error"]
        assert "o_proj" in r["error"]  # lists the block's real linears


def test_tp_without_enough_ranks_fails_before_any_work(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = tiny_causal_lm("llama")
    before = model.model.layers[0].self_attn.q_proj.weight.clone()
    with pytest.raises(shardwise.ConfigError, match=r"tp_size=2 needs 2 ranks.*WORLD_SIZE"):
        shardwise.init_inference(model, device="cpu", mp_size=2)
    assert not torch.distributed.is_initialized()
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, before)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(shardwise.ConfigError, match="does not fit a world of 3"):
        shardwise.init_inference(model, device="cpu", tensor_parallel={"tp_size": 2})

"""Mixture-of-Experts checkpoints: the stacked 3-D expert layout and the older one-tensor-per-expert
layouts (Mixtral's ``block_sparse_moe.experts.N.w1/w2/w3``, Qwen-MoE's
``mlp.experts.N.gate_proj/up_proj/down_proj``), loaded through transformers' own conversion
mapping; a checkpoint whose expert count is not the config's is a named error before any weight
is read; a rank keeping a range of experts reads only their tensors.

Every load is checked against ``from_pretrained`` of the same directory: fp32 logits within 1e-4
and 16 greedy tokens identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import shardwise
from shardwise.checkpoint import CheckpointError, ExpertCountError, build_index, describe
from shardwise.checkpoint.conversions import key_map, select
from shardwise.checkpoint.sources import Reader
from models import prompt_ids

NEW = 16
ATOL = 1e-4
GEN = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=256, max_position_embeddings=256, num_experts_per_tok=2)
#: tiny MoE models: name → (config class, kwargs, the config attribute holding the expert count)
MOE = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=4),
                "num_local_experts"),
    # a leading dense layer (mlp_only_layers) and a shared expert with its gate
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, num_experts=6,
                                         mlp_only_layers=[0]), "num_experts"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32,
                                         num_experts=5), "num_experts"),
}
#: save_pretrained's default writes the older per-expert layout (transformers reverts its
#: conversion); save_original_format=False writes the stacked 3-D tensors as the model holds them
LAYOUTS = {"per_expert": {}, "stacked": {"save_original_format": False},
           "per_expert_sharded": {"max_shard_size": "40KB"}}

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_moe(arch: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    cls, kwargs, _ = MOE[arch]
    config = getattr(transformers, cls)(**_COMMON, **{**kwargs, **overrides})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def save_moe(arch: str, path: Path, layout: str = "per_expert") -> Path:
    tiny_moe(arch).save_pretrained(path, **LAYOUTS[layout])
    return path


def parity(path: Path, dtype=torch.float32, ref_dir: Path | None = None, **kwargs) -> dict:
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir or path, dtype=dtype).eval()
    ids = prompt_ids(batch=2, length=8, vocab=ref.config.vocab_size)
    with torch.no_grad():
        want, want_tokens = ref(ids).logits, ref.generate(ids, **GEN)
    engine = shardwise.init_inference(None, checkpoint=str(path), device="cpu", dtype=dtype,
                                      **kwargs)
    logits, tokens = engine(input_ids=ids).logits, engine.generate(ids, **GEN)
    return dict(max_abs=(logits.float() - want.float()).abs().max().item(),
                tokens_equal=torch.equal(tokens, want_tokens), engine=engine,
                bytes_read=engine.checkpoint_load.bytes_read)


def weight_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def expert_keys(path: Path) -> list[str]:
    return [k for f in weight_files(path) for k in load_file(f) if ".experts." in k]


def rewrite(path: Path, edit) -> None:
    """Rewrite every weight file of ``path`` with ``edit(tensors) -> tensors`` (a single-file
    checkpoint: the per-layout tests edit the unsharded save)."""
    (file,) = weight_files(path)
    save_file(edit(load_file(file)), str(file), metadata={"format": "pt"})


def no_reads(monkeypatch) -> None:
    """Any read of tensor data fails the test (the checks must come from the headers)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the checkpoint was checked")
    monkeypatch.setattr(Reader, "read", refuse)


# ----- layouts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", list(MOE))
def test_moe_layouts_load_like_from_pretrained(tmp_path, arch, layout):
    path = save_moe(arch, tmp_path / arch, layout)
    keys = expert_keys(path)
    stacked = [k for k in keys if k.endswith(("gate_up_proj", "down_proj"))]
    assert (len(stacked) == len(keys)) == (layout == "stacked"), keys[:4]  # the layout written
    r = parity(path)
    assert r["max_abs"] < ATOL, f"logits differ by {r['max_abs']:.2e}"
    assert r["tokens_equal"], f"{NEW} greedy tokens differ from from_pretrained's"
    param_bytes = sum(p.numel() * p.element_size() for p in r["engine"].module.parameters())
    assert r["bytes_read"] == param_bytes  # every tensor read once, nothing else (tied head)


def test_bf16_from_a_per_expert_fp32_checkpoint(tmp_path):
    r = parity(save_moe("mixtral", tmp_path / "m"), dtype=torch.bfloat16)
    assert r["max_abs"] < 0.05 and r["tokens_equal"], r["max_abs"]
    experts = r["engine"].module.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.bfloat16


def test_shardwise_save_of_a_per_expert_load_is_stacked(tmp_path):
    """engine.save_checkpoint writes the model's stacked tensors, which load back as well."""
    src = save_moe("qwen2_moe", tmp_path / "hf")
    engine = shardwise.init_inference(None, checkpoint=str(src), device="cpu",
                                      dtype=torch.float32)
    engine.save_checkpoint(tmp_path / "sw")
    (rank_file,) = weight_files(tmp_path / "sw")
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(rank_file))
    r = parity(tmp_path / "sw", ref_dir=src)
    assert r["max_abs"] < ATOL and r["tokens_equal"]


# ----- a rank's experts only --------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_an_expert_range_reads_only_its_experts_tensors(tmp_path, arch):
    """transformers' converter builds experts [1, 3) from those experts' tensors alone: equal to
    the same rows of the whole tensor, and exactly their bytes read."""
    path = save_moe(arch, tmp_path / arch)
    model = tiny_moe(arch)
    index = build_index(describe(path))
    composite = key_map(model, index.keys()).composite
    name = "model.layers.1.mlp.experts.gate_up_proj"
    entry = composite[name]
    assert entry.stack_dim == 0 and entry.count() == MOE[arch][1].get(
        "num_local_experts", MOE[arch][1].get("num_experts"))
    with Reader(index) as reader:
        def load(key):
            return reader.read(key, None, None, None)
        whole = entry.build(load)
        before = reader.bytes_read
        part = entry.build(load, select([(1, 3)]))
        read = reader.bytes_read - before
    torch.testing.assert_close(whole, model.get_parameter(name).detach(), rtol=0, atol=0)
    torch.testing.assert_close(part, whole[1:3], rtol=0, atol=0)
    assert read == part.numel() * part.element_size()


# ----- bad input: named, before any weight is read ----------------------------------------------

@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_expert_count_differing_from_the_config(tmp_path, monkeypatch, arch, layout):
    path = save_moe(arch, tmp_path / arch, layout)
    attr = MOE[arch][2]
    config = json.loads((path / "config.json").read_text())
    saved = config[attr]
    config[attr] = saved - 1
    (path / "config.json").write_text(json.dumps(config))
    no_reads(monkeypatch)
    with pytest.raises(ExpertCountError, match=rf"holds {saved} experts .* has {saved - 1}.*"
                                               rf"do not belong together"):
        shardwise.init_inference(None, checkpoint=str(path), device="cpu")


def test_user_model_with_other_expert_count(tmp_path, monkeypatch):
    path = save_moe("mixtral", tmp_path / "m", "stacked")
    with torch.device("meta"):
        model = tiny_moe("mixtral", num_local_experts=6)
    no_reads(monkeypatch)
    with pytest.raises(ExpertCountError, match=r"holds 4 experts .* has 6"):
        shardwise.init_inference(model, checkpoint=str(path), device="cpu")


def test_missing_expert_tensor_is_named(tmp_path, monkeypatch):
    path = save_moe("mixtral", tmp_path / "m")
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rewrite(path, lambda t: {k: v for k, v in t.items() if k != gone})
    no_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"incomplete: 4 key\(s\) match .*w1.*, 3 key"):
        shardwise.init_inference(None, checkpoint=str(path), device="cpu")


def test_expert_numbered_wrong_is_named(tmp_path, monkeypatch):
    """Experts 0-3 and 9 (4 missing, 9 added): as many tensors as experts, misnumbered."""
    path = save_moe("qwen3_moe", tmp_path / "q")
    five = MOE["qwen3_moe"][1]["num_experts"]
    rewrite(path, lambda t: {k.replace(f".experts.{five - 1}.", ".experts.9."): v
                             for k, v in t.items()})
    no_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"numbered 0, 1, 2, 3, … .* not 0 … 4"):
        shardwise.init_inference(None, checkpoint=str(path), device="cpu")


def test_per_expert_shapes_that_do_not_build_the_parameter(tmp_path, monkeypatch):
    path = save_moe("mixtral", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 48  # the experts' tensors are [32, 64]
    (path / "config.json").write_text(json.dumps(config))
    no_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"build .*gate_up_proj.* as \[4, 64, 64\] .* has "
                                              r"\[4, 96, 64\]"):
        shardwise.init_inference(None, checkpoint=str(path), device="cpu")

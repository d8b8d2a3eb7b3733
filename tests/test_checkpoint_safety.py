"""Checkpoint loading on untrusted or unusual input (issue 13): the class the config names is
built, reads stay inside the checkpoint's folder, malformed descriptions, headers and configs
are named errors, integer tensors never load into float parameters, a re-save is atomic, and a
failed load leaves nothing of its own behind. Tiny models, one process."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
import transformers

import shardwise
from models import prompt_ids, tiny_causal_lm, tiny_encoder
from shardwise.checkpoint import CheckpointError

pytestmark = pytest.mark.usefixtures("one_thread")


def save_hf(arch: str, path: Path, **kwargs) -> Path:
    tiny_causal_lm(arch).save_pretrained(path, **kwargs)
    return path


def load(path, **kwargs) -> shardwise.InferenceEngine:
    return shardwise.init_inference(None, checkpoint=str(path), device="cpu", **kwargs)


def logits(engine, ids):
    with torch.no_grad():
        return engine(input_ids=ids).logits


# ----- 1. the class the config names --------------------------------------------------------------

def test_a_bare_encoder_directory_builds_the_class_its_config_names(tmp_path):
    """A sentence-transformers style BERT directory (architectures: ["BertModel"], no MLM head):
    built as BertModel, not as a causal-LM head with missing keys."""
    tiny_encoder("bert", head="base").save_pretrained(tmp_path / "bert")
    assert json.loads((tmp_path / "bert" / "config.json").read_text())["architectures"] == \
        ["BertModel"]
    engine = load(tmp_path / "bert")
    assert type(engine.module) is transformers.BertModel
    ref = transformers.BertModel.from_pretrained(tmp_path / "bert").eval()
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        want = ref(input_ids=ids).last_hidden_state
        got = engine(input_ids=ids).last_hidden_state
    assert (got - want).abs().max() < 1e-5


def test_the_model_class_can_be_passed_as_model(tmp_path):
    path = save_hf("llama", tmp_path / "llama")
    ids = prompt_ids(batch=1, length=6)
    ref = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    for cls in (transformers.LlamaForCausalLM, transformers.AutoModelForCausalLM):
        engine = shardwise.init_inference(cls, checkpoint=str(path), device="cpu")
        assert type(engine.module) is transformers.LlamaForCausalLM
        assert (logits(engine, ids) - ref(ids).logits).abs().max() < 1e-5
    with pytest.raises(CheckpointError, match="BertModel.*BertConfig.*LlamaConfig"):
        shardwise.init_inference(transformers.BertModel, checkpoint=str(path), device="cpu")
    with pytest.raises(shardwise.ConfigError, match="model class 'Linear' is not a transformers"):
        shardwise.init_inference(torch.nn.Linear, checkpoint=str(path), device="cpu")


@pytest.mark.parametrize("names", [["os"], ["__class__"], ["AutoConfig"], ["LlamaConfig"], [3],
                                   "LlamaForCausalLM", []])
def test_architectures_that_name_no_model_class_fall_back_to_auto(tmp_path, names):
    """Only model classes transformers exports are built; anything else (a module, a config, a
    dunder, a non-string) is never looked up further: the Auto classes decide."""
    path = save_hf("llama", tmp_path / "llama")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = names
    (path / "config.json").write_text(json.dumps(config))
    assert type(load(path).module) is transformers.LlamaForCausalLM


def test_architectures_naming_a_class_of_another_config_is_refused(tmp_path):
    path = save_hf("llama", tmp_path / "llama")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*GPT2Config.*LlamaConfig"):
        load(path)


# ----- 2. reads stay inside the checkpoint's folder --------------------------------------------

@pytest.fixture
def outside(tmp_path) -> Path:
    """A real weights file outside the checkpoint folder (what an escape would read)."""
    other = save_hf("llama", tmp_path / "secret")
    return other / "model.safetensors"


def _refused(fn, *args, **kwargs) -> str:
    with pytest.raises(CheckpointError, match="outside the checkpoint folder") as err:
        fn(*args, **kwargs)
    return str(err.value)


def _same_message_if_absent(outside: Path, fn, *args, **kwargs) -> None:
    """The refusal reveals neither the outside file's existence nor its size."""
    present = _refused(fn, *args, **kwargs)
    assert str(outside.stat().st_size) not in present and "does not exist" not in present
    outside.rename(outside.with_suffix(".gone"))
    assert _refused(fn, *args, **kwargs) == present


def test_an_index_weight_map_escaping_the_folder_is_refused(tmp_path, outside):
    path = save_hf("llama", tmp_path / "ckpt", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../secret/model.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    _same_message_if_absent(outside, load, path)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "base_dir"])
def test_a_description_naming_files_elsewhere_is_refused(tmp_path, outside, how):
    path = save_hf("llama", tmp_path / "ckpt")
    body = {"type": "ds_model", "checkpoints": ["model.safetensors"]}
    if how == "dotdot":
        body["checkpoints"] = ["../secret/model.safetensors"]
    elif how == "absolute":
        body["checkpoints"] = [str(outside)]
    else:
        body["base_dir"] = str(outside.parent)
    (path / "d.json").write_text(json.dumps(body))
    _same_message_if_absent(outside, load, path / "d.json")


def test_the_callers_base_dir_is_trusted(tmp_path):
    weights = save_hf("llama", tmp_path / "weights")
    desc = tmp_path / "elsewhere" / "d.json"
    desc.parent.mkdir()
    (desc.parent / "config.json").write_text((weights / "config.json").read_text())
    desc.write_text(json.dumps({"type": "ds_model", "checkpoints": ["model.safetensors"]}))
    ref = transformers.AutoModelForCausalLM.from_pretrained(weights).eval()
    ids = prompt_ids(batch=1, length=5)
    engine = load(desc, base_dir=str(weights))
    assert (logits(engine, ids) - ref(ids).logits).abs().max() < 1e-5
    # a base_dir inside the description's folder is not "elsewhere"
    inner = save_hf("llama", desc.parent / "inner")
    desc.write_text(json.dumps({"type": "ds_model", "base_dir": "inner",
                                "checkpoints": ["model.safetensors"]}))
    assert (logits(load(desc), ids) - ref(ids).logits).abs().max() < 1e-5
    assert inner.is_dir()


@pytest.mark.parametrize("victim", ["model.safetensors", "config.json"])
def test_a_symlink_out_of_the_folder_is_refused(tmp_path, outside, victim):
    path = save_hf("llama", tmp_path / "ckpt")
    (path / victim).unlink()
    (path / victim).symlink_to(outside.parent / victim)
    _same_message_if_absent(outside.parent / victim, load, path)


def test_symlinks_inside_the_folder_and_a_linked_folder_load(tmp_path):
    path = save_hf("llama", tmp_path / "ckpt")
    (path / "model.safetensors").rename(path / "real.safetensors")
    (path / "model.safetensors").symlink_to("real.safetensors")
    (tmp_path / "link").symlink_to(path)
    ids = prompt_ids(batch=1, length=5)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert (logits(load(tmp_path / "link"), ids) - ref(ids).logits).abs().max() < 1e-5


def test_the_hugging_face_cache_layout_loads(tmp_path):
    """hub snapshots hold symlinks to ../../blobs/<hash>: the one sanctioned way out."""
    src = save_hf("llama", tmp_path / "src")
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(src.iterdir())):
        f.rename(repo / "blobs" / f"blob{i}")
        (snap / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    assert type(load(snap).module) is transformers.LlamaForCausalLM


# ----- 3. malformed input: named errors -----------------------------------------------------------

@pytest.mark.parametrize("extra, message", [
    ({"base_dir": 3}, "base_dir must be a string"),
    ({"base_dir": ["a"]}, "base_dir must be a string"),
    ({"checkpoints": {"tp": "model.safetensors"}}, r"'checkpoints'\['tp'\] must be a list"),
    ({"type": "shardwise", "version": 1, "tp_size": 1, "shards": ["x"]},
     "shards must be an object"),
    ({"type": "shardwise", "version": 1, "tp_size": True}, "tp_size must be a positive integer"),
    ({"save_id": 5}, "save_id must be a string"),
    ({"dtype": ["float32"]}, "dtype must be a string"),
])
def test_description_fields_of_the_wrong_type(tmp_path, extra, message):
    path = save_hf("llama", tmp_path / "ckpt")
    body = {"type": "ds_model", "checkpoints": ["model.safetensors"], **extra}
    (path / "d.json").write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match=message):
        load(path / "d.json")


@pytest.mark.parametrize("entry, message", [
    ({"dim": 5, "size": 64, "ranges": [[[0, 64]]]}, "dim 5, which is out of range"),
    ({"dim": -1, "size": 64, "ranges": [[[0, 64]]]}, "must have dim"),
    ({"dim": 0, "size": 64, "ranges": [[[0, 80]]]}, "must have dim"),
    ({"dim": 0, "size": 64, "ranges": ["ab"]}, "must have dim"),
    ({"dim": 0, "size": True, "ranges": [[[0, 64]]]}, "must have dim"),
])
def test_malformed_shard_entries(tmp_path, entry, message):
    path = save_hf("llama", tmp_path / "hf")
    load(path, save_mp_checkpoint_path=str(tmp_path / "sw"))
    desc = tmp_path / "sw" / "shardwise_checkpoint.json"
    body = json.loads(desc.read_text())
    body["shards"] = {"model.norm.weight": entry}
    desc.write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match=message):
        load(tmp_path / "sw")


def _write_safetensors(path: Path, header, data: bytes) -> None:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _f32(offsets, shape=(2,)):
    return {"dtype": "F32", "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize("header, data, message", [
    ([1, 2], b"", "header is not a JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, b"", "nested too deeply"),
    ({"__metadata__": [1]}, b"", "__metadata__ must map strings to strings"),
    ({"a": _f32((0, 8)), "b": _f32((4, 12))}, bytes(12), "overlap"),
    ({"a": _f32((0, 8)), "b": _f32((12, 20))}, bytes(20), "gap"),
    ({"a": _f32((4, 12))}, bytes(12), "gap"),
    ({"a": _f32((0, 8))}, bytes(16), "8 bytes after the last tensor"),
    ({"a": _f32((0, 8), shape=(-1, -2))}, bytes(8), "malformed"),
    ({"a": _f32((0, 8), shape=(2.0,))}, bytes(8), "malformed"),
    ({"a": "x"}, b"", "malformed"),
], ids=["array", "deep", "metadata", "overlap", "gap", "gap-first", "trailing", "negative-dims",
        "float-dims", "entry-string"])
def test_malformed_safetensors_headers(tmp_path, header, data, message):
    from shardwise.checkpoint.sources import safetensors_header

    path = tmp_path / "t.safetensors"
    _write_safetensors(path, header, data)
    with pytest.raises(CheckpointError, match=message):
        safetensors_header(path)


def test_well_formed_headers_still_read(tmp_path):
    from safetensors.torch import save_file

    from shardwise.checkpoint.sources import safetensors_header

    path = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(3), "b": torch.zeros(0, 2), "c": torch.ones(2, dtype=torch.int8)},
              path, metadata={"k": "v"})
    tensors, meta = safetensors_header(path)
    assert sorted(tensors) == ["a", "b", "c"] and meta == {"k": "v"}


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", "{\"model_type\": \"no-such-model\"}"])
def test_a_config_that_is_not_a_model_config_is_named(tmp_path, text):
    path = save_hf("llama", tmp_path / "ckpt")
    (path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json"):
        load(path)


# ----- 4. dtype kinds -----------------------------------------------------------------------------

def test_an_integer_tensor_is_not_loaded_into_a_float_parameter(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_hf("llama", tmp_path / "ckpt")
    state = load_file(path / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight"
    state[key] = torch.ones_like(state[key], dtype=torch.int32)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{key!r} is int32 in the checkpoint.*float"):
        load(path)


# ----- 5. atomic re-save --------------------------------------------------------------------------

def _engine(tmp_path, seed):
    path = tmp_path / f"hf{seed}"
    tiny_causal_lm("llama", seed=seed).save_pretrained(path)
    return load(path)


@pytest.mark.parametrize("where", ["rank file", "description"])
def test_an_interrupted_resave_keeps_the_old_checkpoint(tmp_path, monkeypatch, where):
    from safetensors import torch as st

    old, new, out = _engine(tmp_path, 0), _engine(tmp_path, 1), tmp_path / "out"
    ids = prompt_ids(batch=1, length=5)
    old.save_checkpoint(out)
    want_old, want_new = logits(old, ids), logits(new, ids)

    real_save = st.save_file

    def interrupted(tensors, filename, metadata=None):  # a hundred bytes, then the crash
        real_save(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(Path(filename).read_bytes()[:100])
        raise KeyboardInterrupt
    if where == "rank file":
        monkeypatch.setattr(st, "save_file", interrupted)
    else:
        real = Path.write_text
        monkeypatch.setattr(Path, "write_text", lambda self, text, *a, **k: (
            real(self, text[:10], *a, **k), (_ for _ in ()).throw(KeyboardInterrupt())))
    with pytest.raises(KeyboardInterrupt):
        new.save_checkpoint(out)
    monkeypatch.undo()
    assert torch.equal(logits(load(out), ids), want_old)
    new.save_checkpoint(out)
    assert torch.equal(logits(load(out), ids), want_new)
    named = json.loads((out / "shardwise_checkpoint.json").read_text())["checkpoints"]
    assert sorted(p.name for p in out.glob("rank*")) == sorted(named), "stale files removed"
    old.save_checkpoint(out)  # and back: the plain name is free again
    assert torch.equal(logits(load(out), ids), want_old)
    assert sorted(p.name for p in out.iterdir()) == \
        ["config.json", "rank00-of-01.safetensors", "shardwise_checkpoint.json"]


# ----- 6. messages --------------------------------------------------------------------------------

def test_a_meta_model_without_a_checkpoint_says_how_to_load_it():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, vocab_size=256)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    with pytest.raises(shardwise.ConfigError, match="meta device") as err:
        shardwise.init_inference(model, device="cpu")
    assert "not supported" not in str(err.value) and "checkpoint=" in str(err.value)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_bin_with_pickled_objects_is_refused_not_corrupted(tmp_path):
    path = save_hf("llama", tmp_path / "bin")
    state = {k: v.contiguous() for k, v in
             transformers.AutoModelForCausalLM.from_pretrained(path).state_dict().items()}
    marker = tmp_path / "pwned"
    state["evil"] = _Evil(str(marker))
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError) as err:
        load(path)
    text = str(err.value)
    assert "refused" in text and "pickled objects other than tensors" in text
    assert "never unpickled" in text and "safetensors" in text
    assert "truncated" not in text and "corrupted" not in text
    assert not marker.exists()


# ----- 7. a failed load leaves nothing of the loader's behind -------------------------------------

def _failing_reads(monkeypatch, after: int):
    from shardwise.checkpoint import sources

    calls, real = [], sources.Reader.read

    def failing(self, *args):
        calls.append(1)
        if len(calls) > after:
            raise OSError("disk went away")
        return real(self, *args)
    monkeypatch.setattr(sources.Reader, "read", failing)


def _meta_model(path):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(path))


def _structure(model):
    return [(n, type(m)) for n, m in model.named_modules()]


def test_a_failed_quantize_while_reading_load_can_be_retried(tmp_path, monkeypatch):
    from shardwise.checkpoint import load_checkpoint
    from shardwise.quant import Quantizer, QuantLinear

    path = save_hf("llama", tmp_path / "hf")
    model = _meta_model(path)
    before = _structure(model)
    spec = {"weight": {"num_bits": 8}}
    accel = shardwise.get_accelerator("cpu")

    def quantizer():
        return Quantizer.for_model(model, spec, accel, torch.bfloat16,
                                   device="cpu").reading_hook()
    _failing_reads(monkeypatch, after=8)
    with pytest.raises(OSError, match="disk went away"):
        load_checkpoint(model, path, dtype=torch.bfloat16, hooks=[quantizer()])
    assert _structure(model) == before, "no QuantLinear left behind"
    assert all(p.is_meta for p in model.parameters())
    monkeypatch.undo()
    report = load_checkpoint(model, path, dtype=torch.bfloat16, hooks=[quantizer()])
    assert report.results["shardwise.quant"].layers and any(isinstance(m, QuantLinear) for m in model.modules())


def test_a_failed_quantized_checkpoint_load_removes_its_shells(tmp_path, monkeypatch):
    from shardwise.checkpoint import load_checkpoint

    path = save_hf("llama", tmp_path / "hf")
    load(path, dtype=torch.bfloat16, quant={"weight": {"num_bits": 8}},
         save_mp_checkpoint_path=str(tmp_path / "q"))
    model = _meta_model(path)
    before = _structure(model)
    _failing_reads(monkeypatch, after=3)
    with pytest.raises(OSError, match="disk went away"):
        load_checkpoint(model, tmp_path / "q", dtype=torch.bfloat16)
    assert _structure(model) == before
    monkeypatch.undo()
    assert load_checkpoint(model, tmp_path / "q", dtype=torch.bfloat16).results["shardwise.quant"]

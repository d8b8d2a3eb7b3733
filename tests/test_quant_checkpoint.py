"""Quantized checkpoints (issue #7): a quantized engine's ``save_checkpoint`` loads back without
re-quantizing, bit for bit, at tp 1 and 2; ``init_inference(None, checkpoint=..., quant=...)``
quantizes each weight as its slice is read, bit-identically to loading then quantizing; quant
settings that differ from the saved ones, another tp size or dtype, and corrupt or mismatched
quantized checkpoints fail with a named error before any weight is read.

The 2-rank cases run in one pair of gloo processes (a module-scoped fixture); each compares the
engines inside the ranks and returns booleans and digests.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers

import shardwise
from shardwise.kernels.cpu import native
from families import families
from models import prompt_ids, tiny_causal_lm
from shardwise.checkpoint import CheckpointError
from shardwise.errors import ConfigError
from shardwise.inject.injector import injected_stack
from shardwise.quant import QuantLinear, quantize_model
from tp_harness import TP, with_random_biases, case, run_cases, run_pair

BF16 = torch.bfloat16
SPECS = {
    "int8": {"weight": {"num_bits": 8}},
    "int8-asym-g32": {"weight": {"num_bits": 8, "group_size": 32, "q_type": "asymmetric"}},
    "int4-sym": {"weight": {"num_bits": 4, "q_type": "symmetric"}},
    "int4-asym-g32": {"weight": {"num_bits": 4, "group_size": 32, "q_type": "asymmetric"}},
}
ARCHS = families(core=True)  # nn.Linear and transformers Conv1D (tied head)
GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


pytestmark = pytest.mark.usefixtures("one_thread")


# ----- helpers (also run inside the ranks) --------------------------------------------------------

def save_hf(arch: str, path: Path) -> Path:
    """A tiny fp32 model (random biases too) written by save_pretrained."""
    with_random_biases(tiny_causal_lm(arch)).save_pretrained(path)
    return path


def load(path, **kwargs) -> shardwise.InferenceEngine:
    return shardwise.init_inference(None, checkpoint=str(path), device="cpu", **kwargs)


def state_differences(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of state-dict entries (every parameter and QuantLinear buffer) and QuantLinear
    settings that differ between ``a`` and ``b`` in key, dtype or bits; [] when identical."""
    sa, sb = a.state_dict(), b.state_dict()
    out = sorted(set(sa) ^ set(sb))
    out += [k for k in sa.keys() & sb.keys()
            if sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k])]
    qa = {n: m for n, m in a.named_modules() if isinstance(m, QuantLinear)}
    qb = {n: m for n, m in b.named_modules() if isinstance(m, QuantLinear)}
    out += [f"QuantLinear {n}" for n in sorted(set(qa) ^ set(qb))]
    out += [f"{n} settings" for n in qa.keys() & qb.keys()
            if (qa[n].spec, qa[n].backend, qa[n].compute_dtype, qa[n].meta, qa[n].source)
            != (qb[n].spec, qb[n].backend, qb[n].compute_dtype, qb[n].meta, qb[n].source)]
    return out


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


@contextlib.contextmanager
def no_quantization():
    """Fail if anything quantizes a weight meanwhile (a saved checkpoint must load as is)."""
    from shardwise.quant import transform

    real = transform.quantize_weight

    def refuse(*args, **kwargs):
        raise AssertionError("a saved quantized checkpoint was quantized again")
    transform.quantize_weight = refuse
    try:
        yield
    finally:
        transform.quantize_weight = real


def load_then_quantize(path, spec: dict, dtype: torch.dtype = BF16,
                       **kwargs) -> shardwise.InferenceEngine:
    """The reference: load in full precision, then quantize (what step 6 does after loading),
    then inject when ``replace_with_kernel_inject`` (step 7 adopts the quantized linears)."""
    from shardwise.inject import inject_model

    inject = kwargs.pop("replace_with_kernel_inject", False)
    engine = load(path, dtype=dtype, **kwargs)
    engine.quantization = quantize_model(engine.module, spec, engine.accelerator, dtype,
                                         plan=engine.plan)
    if inject:
        plan = engine.plan  # the heads this rank holds, as init_inference injects them
        stack = inject_model(engine.module, engine.accelerator, dtype, None,
                             policy=plan.found_policy, heads=plan.heads if plan.sharded else None)
        engine._stack = stack.to(engine.device)
    return engine


@contextlib.contextmanager
def count_reads(monkeypatch):
    """Yield a list that grows by one per tensor read from a checkpoint file."""
    from shardwise.checkpoint import sources

    calls, real = [], sources.Reader.read

    def counting(self, *args):
        calls.append(args[0])
        return real(self, *args)
    monkeypatch.setattr(sources.Reader, "read", counting)
    yield calls


# ----- (a) tp 1: save a quantized engine, load it back as saved ----------------------------------

@pytest.mark.parametrize("spec_name", list(SPECS))
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_engine_round_trips_bit_identically(tmp_path, arch, spec_name):
    spec = SPECS[spec_name]
    model = with_random_biases(tiny_causal_lm(arch))
    if spec_name == "int8":  # DeepSpeed's spelling
        saver = shardwise.init_inference(model, device="cpu", dtype=torch.int8)
    else:
        saver = shardwise.init_inference(model, device="cpu", dtype=BF16, quant=spec)
    ids = prompt_ids(batch=2, length=8)
    logits, tokens = saver(input_ids=ids).logits, saver.generate(ids, **GEN)
    saver.save_checkpoint(tmp_path / "q")

    desc = json.loads((tmp_path / "q" / "shardwise_checkpoint.json").read_text())
    entry = desc["extensions"]["shardwise.quant"]  # opaque to the checkpoint package
    assert "quant" not in desc
    assert entry["config"] == saver.config.quant and entry["dtype"] == "bfloat16"
    assert sorted(entry["layers"]) == sorted(saver.quantization.layers)
    with no_quantization():
        loaded = load(tmp_path / "q", dtype=BF16, quant=spec)
    assert state_differences(saver.module, loaded.module) == []
    assert torch.equal(loaded(input_ids=ids).logits, logits)
    assert torch.equal(loaded.generate(ids, **GEN), tokens)
    mine, theirs = loaded.quantization, saver.quantization
    assert mine.layers_quantized == theirs.layers_quantized and mine.backends() == theirs.backends()
    assert mine.bytes_after == theirs.bytes_after and mine.config == theirs.config


def test_user_built_meta_model_loads_a_quantized_checkpoint(tmp_path):
    saver = load(save_hf("llama", tmp_path / "hf"), dtype=BF16, quant=SPECS["int4-asym-g32"])
    saver.save_checkpoint(tmp_path / "q")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "q")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with no_quantization():
        loaded = shardwise.init_inference(model, checkpoint=str(tmp_path / "q"), device="cpu")
    assert loaded.dtype == BF16  # dtype unset: the saved compute dtype
    assert state_differences(saver.module, loaded.module) == []
    ids = prompt_ids(batch=2, length=8)
    assert torch.equal(loaded(input_ids=ids).logits, saver(input_ids=ids).logits)


@pytest.fixture(scope="module")
def int8_checkpoint(tmp_path_factory):
    """A tp=1 llama checkpoint saved from an int8 engine (and its engine)."""
    root = tmp_path_factory.mktemp("int8")
    saver = load(save_hf("llama", root / "hf"), dtype=BF16, quant=SPECS["int8"])
    saver.save_checkpoint(root / "q")
    return root / "q", saver


def test_no_quant_adopts_the_saved_settings_with_one_log_line(int8_checkpoint, caplog):
    path, saver = int8_checkpoint
    with caplog.at_level(logging.INFO, logger="shardwise"), no_quantization():
        loaded = load(path)
    lines = [r.getMessage() for r in caplog.records if "loading them as saved" in r.getMessage()]
    assert len(lines) == 1 and "int8 symmetric, per-channel" in lines[0], lines
    assert loaded.config.quant == saver.config.quant
    assert loaded.quantization.config == saver.quantization.config
    assert state_differences(saver.module, loaded.module) == []
    with no_quantization():  # the saved settings spelt again are fine
        load(path, quant={"weight": {"num_bits": 8, "q_type": "symmetric"}})


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(quant=SPECS["int4-sym"]), CheckpointError,
     r"quantized as int8 symmetric, per-channel .* but quant= asks for int4 .* omit quant="),
    (dict(quant={"weight": {"num_bits": 8, "group_size": 32}}), CheckpointError,
     r"asks for int8 symmetric, groups of 32"),
    (dict(dtype=torch.float32), CheckpointError,
     r"packed for bfloat16 compute, not float32; load it with dtype=torch.bfloat16"),
    (dict(tensor_parallel={"tp_size": 2}), CheckpointError,
     r"saved at tp_size=1; packed quantized weights cannot be merged or split for tp_size=2: "
     r"load it at tp_size=1, or save the model unquantized"),
])
def test_loading_a_quantized_checkpoint_otherwise_than_saved_is_refused(
        int8_checkpoint, monkeypatch, kwargs, error, match):
    with count_reads(monkeypatch) as reads:
        with pytest.raises(error, match=match):
            load(int8_checkpoint[0], **kwargs)
    assert reads == [], "refused before any weight was read"


# ----- bad input: corrupt or mismatched quantized checkpoints -------------------------------------

def _rewrite_rank_file(path: Path, edit) -> None:
    """Rewrite ``path`` after ``edit(tensors, metadata)`` changed them in place."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors, metadata)
    save_file(tensors, str(path), metadata=metadata)


def _edit_description(key: str, value):
    def edit(root: Path) -> None:
        desc = json.loads((root / "shardwise_checkpoint.json").read_text())
        desc["extensions"]["shardwise.quant"][key] = value
        (root / "shardwise_checkpoint.json").write_text(json.dumps(desc))
    return edit


def _edit_manifest(change):
    def edit(root: Path) -> None:
        def apply(tensors, metadata):
            entries = json.loads(metadata["shardwise_extensions"])
            change(entries["shardwise.quant"])
            metadata["shardwise_extensions"] = json.dumps(entries)
        _rewrite_rank_file(root / "rank00-of-01.safetensors", apply)
    return edit


def _drop_manifest(root: Path) -> None:
    _rewrite_rank_file(root / "rank00-of-01.safetensors",
                       lambda tensors, metadata: metadata.pop("shardwise_extensions"))


def _shrink_scales(root: Path) -> None:
    def apply(tensors, metadata):
        key = "model.layers.0.mlp.up_proj.scales"
        tensors[key] = tensors[key][:-1].clone()
    _rewrite_rank_file(root / "rank00-of-01.safetensors", apply)


def _smaller_config(root: Path) -> None:
    config = json.loads((root / "config.json").read_text())
    config["intermediate_size"] = 96
    (root / "config.json").write_text(json.dumps(config))


def _drop_layer(manifest: dict) -> None:
    manifest["layers"].pop("model.layers.1.mlp.down_proj")


def _break_spec(manifest: dict) -> None:
    manifest["layers"]["model.layers.0.self_attn.q_proj"]["spec"] = [3, 64]


@pytest.mark.parametrize("corrupt, match", [
    (_edit_description("format", "gptq"), r"'shardwise.quant' entry has format 'gptq'"),
    (_edit_description("config", {"weight": {"num_bits": 5}}),
     r"'shardwise.quant' settings are invalid \(quant num_bits must be the integer 4 or 8"),
    (_drop_manifest, r"rank00-of-01.safetensors has no 'shardwise.quant' entry in its metadata"),
    (_edit_manifest(_drop_layer), r"disagrees with the description's 'shardwise.quant' entry"),
    (_edit_manifest(_break_spec), r"entry of layer 'model.layers.0.self_attn.q_proj' is "
                                  r"malformed \(spec \[3, 64\]\)"),
    # the layout (and so the scales' dtype and shape) is the packing kernel's: native or torch's
    (_shrink_scales, r"tensor 'model.layers.0.mlp.up_proj.scales' is (\w+) \[[0-9, ]+\], its "
                     r"'shardwise.quant' entry says \1 \[[0-9, ]+\]"),
    (_smaller_config, r"quantized layer 'model.layers.0.mlp.gate_proj' is \[out, in\] = "
                      r"\[128, 64\] .* but \[96, 64\] .* in the model built from the config"),
])
def test_corrupt_or_mismatched_quantized_checkpoint_is_named_before_reading(
        int8_checkpoint, tmp_path, monkeypatch, corrupt, match):
    import shutil

    root = tmp_path / "bad"
    shutil.copytree(int8_checkpoint[0], root)
    corrupt(root)
    with count_reads(monkeypatch) as reads:
        with pytest.raises(CheckpointError, match=match):
            load(root)
    assert reads == [], "the error came before any weight was read"


def _to_the_layout_before_extensions(root: Path) -> None:
    """Rewrite a checkpoint as shardwise wrote quantized ones before the ``extensions`` section:
    the description's ``"quant"`` entry and each rank file's ``"shardwise_quant"`` manifest."""
    desc = json.loads((root / "shardwise_checkpoint.json").read_text())
    desc["quant"] = desc.pop("extensions")["shardwise.quant"]
    (root / "shardwise_checkpoint.json").write_text(json.dumps(desc))

    def apply(tensors, metadata):
        entries = json.loads(metadata.pop("shardwise_extensions"))
        metadata["shardwise_quant"] = json.dumps(entries["shardwise.quant"])
    _rewrite_rank_file(root / "rank00-of-01.safetensors", apply)


def test_a_quantized_checkpoint_in_the_layout_before_extensions_still_loads(
        int8_checkpoint, tmp_path):
    import shutil

    root = tmp_path / "old"
    shutil.copytree(int8_checkpoint[0], root)
    _to_the_layout_before_extensions(root)
    assert "extensions" not in json.loads((root / "shardwise_checkpoint.json").read_text())
    saver = int8_checkpoint[1]
    with no_quantization():
        loaded = load(root)
    assert loaded.config.quant == saver.config.quant
    assert state_differences(saver.module, loaded.module) == []
    ids = prompt_ids(batch=2, length=8)
    assert torch.equal(loaded(input_ids=ids).logits, saver(input_ids=ids).logits)


def test_extension_data_no_package_provides_is_refused_by_name(int8_checkpoint, tmp_path,
                                                               monkeypatch):
    import shutil

    root = tmp_path / "other"
    shutil.copytree(int8_checkpoint[0], root)
    desc = json.loads((root / "shardwise_checkpoint.json").read_text())
    desc["extensions"]["acme.sparsity"] = {"format": 1}
    (root / "shardwise_checkpoint.json").write_text(json.dumps(desc))
    with count_reads(monkeypatch) as reads:
        with pytest.raises(CheckpointError, match=r"carries data of the extension "
                                                  r"'acme.sparsity', which no installed package"):
            load(root)
    assert reads == []


def test_quantized_checkpoint_errors_are_their_own_class(int8_checkpoint):
    from shardwise.quant.checkpoint import QuantizedCheckpointError

    with pytest.raises(QuantizedCheckpointError) as err:  # a CheckpointError (and ConfigError)
        load(int8_checkpoint[0], quant=SPECS["int4-sym"])
    assert isinstance(err.value, CheckpointError) and isinstance(err.value, ConfigError)


def test_the_checkpoint_package_knows_nothing_about_quantization():
    """No module of shardwise.checkpoint imports shardwise.quant, and no quant function takes
    an exception class to raise (each layer raises its own)."""
    import ast
    import inspect

    import shardwise.checkpoint
    from shardwise.quant import checkpoint as qckpt, transform

    folder = Path(shardwise.checkpoint.__file__).parent
    for file in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert "quant" not in (node.module or ""), (file.name, node.module)
            elif isinstance(node, ast.Import):
                assert not any("quant" in a.name for a in node.names), file.name
    for module in (qckpt, transform):
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            for param in inspect.signature(fn).parameters.values():
                assert "Exception" not in str(param.annotation) and param.name != "error", \
                    f"{module.__name__}.{name}({param.name})"


# ----- (b) tp 1: quantize while reading -----------------------------------------------------------

@pytest.mark.parametrize("spec_name", ["int8", "int4-asym-g32", "int8-asym-g32"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_while_reading_equals_load_then_quantize(tmp_path, monkeypatch, arch, spec_name):
    from shardwise.checkpoint import loader

    spec, path = SPECS[spec_name], save_hf(arch, tmp_path / "hf")
    want = load_then_quantize(path, spec)
    assigned = []
    real_assign = loader._assign
    monkeypatch.setattr(loader, "_assign", lambda model, name, *a: (
        assigned.append(name), real_assign(model, name, *a)))
    engine = load(path, dtype=BF16, quant=spec)
    quantized = set(engine.quantization.layers)
    assert quantized and quantized == set(want.quantization.layers)
    # every quantized layer's float weight went to the quantizer, never into the model
    assert not [n for n in assigned if n.rpartition(".")[0] in quantized], assigned
    assert state_differences(want.module, engine.module) == []
    ids = prompt_ids(batch=2, length=8)
    assert torch.equal(engine(input_ids=ids).logits, want(input_ids=ids).logits)
    mine, theirs = engine.quantization, want.quantization
    assert (mine.bytes_before, mine.bytes_after) == (theirs.bytes_before, theirs.bytes_after)
    assert mine.source == theirs.source and mine.backends() == theirs.backends()


def test_quantize_while_reading_joins_a_bias_read_before_its_weight(tmp_path, monkeypatch):
    """The per-tensor hook sees tensors in file order: a bias read before its weight (another
    shard file, or sorted first) is held and joined to the QuantLinear made from the weight."""
    from shardwise.checkpoint import loader

    path = save_hf("gpt2", tmp_path / "hf")  # Conv1D projections, every one with a bias
    want = load_then_quantize(path, SPECS["int8"])
    monkeypatch.setattr(loader, "_first_file", lambda index, key: (not key.endswith("bias"), key))
    engine = load(path, dtype=BF16, quant=SPECS["int8"])
    assert state_differences(want.module, engine.module) == []
    ids = prompt_ids(batch=2, length=8)
    assert torch.equal(engine(input_ids=ids).logits, want(input_ids=ids).logits)


def test_quant_settings_that_do_not_fit_fail_before_reading(tmp_path, monkeypatch):
    from shardwise.kernels.cpu import native

    monkeypatch.setenv(native.ENV, "torch")  # int4 in groups of 16: slow with torch's kernels
    path = save_hf("llama", tmp_path / "hf")
    with count_reads(monkeypatch) as reads:
        with pytest.raises(ConfigError, match=r"q_groups=3 does not divide layer "
                                              r"'model.layers.0.self_attn.q_proj'"):
            load(path, dtype=BF16, quant={"weight": {"num_bits": 8, "q_groups": 3}})
        with pytest.raises(ConfigError, match=r"int4 needs a group size that is a multiple of "
                                              r"32 .* 'allow_slow_kernels': True"):
            load(path, dtype=torch.float32, quant={"weight": {"num_bits": 4, "group_size": 16}})
    assert reads == []


def test_an_fp32_model_quantized_while_reading_runs_bf16_kernels_and_round_trips(tmp_path):
    """fp32 model, int4: the quantized layers are packed for the bf16 CPU kernels, biases and the
    rest stay fp32, and the engine's checkpoint reloads bit for bit in fp32."""
    path = save_hf("gpt2", tmp_path / "hf")  # biases: they stay fp32, added after the cast
    spec = SPECS["int4-asym-g32"]
    engine = load(path, dtype=torch.float32, quant=spec)
    compute = torch.float32 if native.load() else BF16  # native: fp32 in place; torch: bf16
    assert {layer.compute_dtype for layer in engine.quantization.layers.values()} == {compute}
    q = engine.module.transformer.h[0].attn.c_attn
    assert isinstance(q, QuantLinear) and q.compute_dtype == compute
    assert q.bias.dtype == torch.float32
    want = load_then_quantize(path, spec, dtype=torch.float32)
    assert state_differences(want.module, engine.module) == []
    engine.save_checkpoint(tmp_path / "q")
    loaded = load(tmp_path / "q")
    assert loaded.dtype == torch.float32 and state_differences(engine.module, loaded.module) == []
    assert loaded.module.transformer.h[0].attn.c_attn.bias.dtype == torch.float32
    ids = prompt_ids(batch=2, length=8)
    assert torch.equal(loaded(input_ids=ids).logits, engine(input_ids=ids).logits)


# ----- save_quantized / load_quantized files: safetensors + a JSON manifest, never a pickle -------

def quantized_file(tmp_path: Path, arch: str = "llama") -> tuple[torch.nn.Module, Path]:
    from shardwise.quant import save_quantized

    model = with_random_biases(tiny_causal_lm(arch))
    quantize_model(model, SPECS["int4-asym-g32"], shardwise.get_accelerator("cpu"), torch.float32)
    return model, Path(save_quantized(model, tmp_path / "q.safetensors"))


def test_a_crafted_pickle_file_is_refused_and_its_code_never_runs(tmp_path):
    """A torch.save file whose unpickling would run code (here: create a folder) is refused by
    load_quantized without being unpickled; torch.load(weights_only=False) would run it."""
    from shardwise.quant import load_quantized

    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            import os

            return os.makedirs, (str(marker),)

    model = tiny_causal_lm("llama")
    for name in ("q.pt", "q.safetensors"):  # whatever the suffix says
        torch.save({"manifest": Payload(), "state_dict": {}}, tmp_path / name)
        with pytest.raises(ConfigError, match=r"torch.save \(pickle\) file.*not loaded, because "
                                              r"unpickling a file can run arbitrary code"):
            load_quantized(model, tmp_path / name)
        assert not marker.exists()
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    torch.load(tmp_path / "q.pt", weights_only=False)  # the payload is real: unpickling runs it
    assert marker.exists()


def _rewrite_file(path: Path, edit) -> None:
    """``edit(tensors, metadata)`` on the safetensors file ``path``, written back."""
    _rewrite_rank_file(path, edit)


def _edit_header(key: str, change):
    def apply(tensors, metadata):
        value = json.loads(metadata[key])
        value = change(value) or value
        metadata[key] = json.dumps(value)
    return apply


def _layer(name: str, field: str, value):
    def change(manifest):
        manifest["layers"][name][field] = value
    return _edit_header("manifest", change)


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit, match", [
    (lambda t, m: m.pop("manifest"), r"not a shardwise quantized file .*keys \['aliases', "
                                     r"'format'\]"),
    (lambda t, m: m.update(format="other"), r"not a shardwise quantized file \(format 'other'"),
    (lambda t, m: m.update(manifest="{not json"), r"'manifest' header is not valid JSON"),
    (_edit_header("manifest", lambda info: info.update(config={"weight": {"num_bits": "4"}})),
     r"quantization settings are invalid \(quant num_bits must be the integer 4 or 8, got str"),
    (_edit_header("manifest", lambda info: info.update(dtype="load")),
     r"quantization settings are invalid"),
    (_edit_header("manifest", lambda info: info.update(extra=1)),
     r"unknown quantization manifest keys \['extra'\]"),
    (_layer(Q, "spec", [4.0, 32, False, 64, 64]), r"layer '.*q_proj' is malformed \(spec"),
    (_layer(Q, "spec", [4, 32, "no", 64, 64]), r"layer '.*q_proj' is malformed \(spec"),
    (_layer(Q, "meta", {"kind": ["int4"]}), r"is malformed \(meta"),
    (_layer(Q, "source", "pickle"), r"is malformed \(source 'pickle'\)"),
    (_layer(Q, "compute_dtype", "load"), r"is malformed \(dtype or tensor entry"),
    (_layer(Q, "tensors", {"qweight": [[64, 32], 7]}), r"is malformed \(tensor "),
    (_layer(Q, "bias", [64.5]), r"is malformed \(bias shape"),
    (lambda t, m: m.update(aliases=json.dumps({"lm_head.weight": "nowhere"})),
     r"'aliases' must map state-dict keys to stored tensors"),
    (lambda t, m: t.update({f"{Q}.qweight": t[f"{Q}.qweight"].to(torch.int8)}),
     r"tensor '.*q_proj.qweight' is I8 .*manifest\) needs uint8"),
    (lambda t, m: t.update({"model.norm.weight": torch.ones(63)}),
     r"tensor 'model.norm.weight' is F32 \[63\], the model .* needs \[64\]"),
    (lambda t, m: t.pop("model.norm.weight"), r"missing \['model.norm.weight'\]"),
])
def test_a_malformed_quantized_file_is_named_and_leaves_the_model_alone(tmp_path, edit, match):
    from shardwise.quant import load_quantized

    _, path = quantized_file(tmp_path)
    _rewrite_file(path, edit)
    model = tiny_causal_lm("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=match):
        load_quantized(model, path)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_quantized_file_for_another_shape_is_refused_before_any_change(tmp_path):
    from shardwise.quant import load_quantized

    _, path = quantized_file(tmp_path)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256))
    with pytest.raises(ConfigError, match=r"saved layer 'model.layers.0.mlp.gate_proj' is "
                                          r"\[out, in\] = \[128, 64\], the model's is \[96, 64\]"):
        load_quantized(other, path)
    assert not any(isinstance(m, QuantLinear) for m in other.modules())


def test_kernel_injection_runs_on_weights_quantized_while_reading(tmp_path, monkeypatch):
    """The loader quantizes as it reads, injection adopts the quantized linears: the same packed
    weights and the same logits as load, quantize, inject in one process."""
    from shardwise.checkpoint import loader

    path = save_hf("llama", tmp_path / "hf")
    seen = []
    real = loader.load_checkpoint
    monkeypatch.setattr(shardwise.engine._checkpoint, "load_checkpoint", lambda *a, **k: (
        seen.append(k.get("hooks")), real(*a, **k))[1])
    engine = load(path, dtype=BF16, quant=SPECS["int8"], replace_with_kernel_inject=True)
    assert seen[0] and engine.quantization.layers_quantized == 14
    assert injected_stack(engine.module) is not None
    want = load_then_quantize(path, SPECS["int8"], replace_with_kernel_inject=True)
    mine = engine.module.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in want.module.state_dict().items()
               if k.endswith(("qweight", "scales")))
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))
    assert torch.equal(engine(input_ids=ids).logits, want(input_ids=ids).logits)


def test_a_quantized_checkpoint_loads_under_kernel_injection(int8_checkpoint):
    """Saved packed weights loaded with injection: bit-identical weights (not re-quantized), and
    the saving engine's logits within the bf16 kernels' rounding."""
    path, saver = int8_checkpoint
    with no_quantization():
        engine = load(path, replace_with_kernel_inject=True, max_tokens=64)
    assert state_differences(saver.module, engine.module) == []
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        diff = (engine(input_ids=ids).logits.float() - saver(input_ids=ids).logits.float())
    assert diff.abs().max() < 0.05


def test_standalone_loader_quantizes_while_reading_into_a_meta_model(tmp_path):
    from shardwise.checkpoint import load_checkpoint
    from shardwise.quant import Quantizer

    path = save_hf("gpt2", tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    cpu = shardwise.get_accelerator("cpu")
    quantizer = Quantizer.for_model(model, SPECS["int8"], cpu, BF16, device="cpu")
    report = load_checkpoint(model, path, dtype=BF16, hooks=[quantizer.reading_hook()])
    assert report.results["shardwise.quant"].layers_quantized == 8
    assert not any(p.is_meta for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {BF16}
    want = load_then_quantize(path, SPECS["int8"])
    assert state_differences(want.module, model) == []


# ----- tp 2: one pair of processes ----------------------------------------------------------------

PAIR_CASES = [(arch, spec) for arch in ARCHS for spec in ("int8", "int4-asym-g32")]


def pair_case(rank: int, root: Path, arch: str, spec_name: str) -> dict:
    """Quantize while reading at tp 2 (vs load-then-quantize), save it, load it back at tp 2."""
    spec, hf, saved = SPECS[spec_name], root / f"hf-{arch}", root / f"q2-{arch}-{spec_name}"
    ids = prompt_ids(batch=2, length=8)
    mine = ids if rank == 0 else torch.zeros_like(ids)  # the engine broadcasts rank 0's
    want = load_then_quantize(hf, spec, **TP)
    engine = load(hf, dtype=BF16, quant=spec, **TP)
    logits = engine(input_ids=mine).logits
    read_diff = state_differences(want.module, engine.module)
    read_logits = torch.equal(want(input_ids=mine).logits, logits)
    engine.save_checkpoint(saved)
    with no_quantization():
        loaded = load(saved, **TP)  # no quant=: the saved settings
    again = loaded(input_ids=mine).logits
    rows = [n for n, s in loaded.sharding.sharded.items() if s.role == "row"]
    return dict(read_diff=read_diff, read_logits_equal=read_logits,
                read_bytes=[engine.quantization.bytes_before, engine.quantization.bytes_after],
                want_bytes=[want.quantization.bytes_before, want.quantization.bytes_after],
                load_diff=state_differences(engine.module, loaded.module),
                load_logits_equal=torch.equal(again, logits), digest=digest(again),
                tokens=loaded.generate(mine, **GEN).tolist(),
                layers=len(loaded.quantization.layers), quant=loaded.config.quant,
                rows_hooked=all(isinstance(loaded.module.get_submodule(n), QuantLinear)
                                and loaded.module.get_submodule(n)._forward_hooks for n in rows))


def _pair_cases(rank: int, root: str) -> dict:
    return run_cases(rank, {f"{a}-{s}": partial(pair_case, rank, Path(root), a, s)
                            for a, s in PAIR_CASES})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("qckpt_tp2")
    for arch in ARCHS:
        save_hf(arch, root / f"hf-{arch}")
    return root, run_pair(partial(_pair_cases, root=str(root)), tmp_path_factory.mktemp("p"))


@pytest.mark.parametrize("arch,spec_name", PAIR_CASES)
def test_tp2_quantize_while_reading_equals_load_then_quantize(pair, arch, spec_name):
    for r in case(pair[1], f"{arch}-{spec_name}"):
        assert r["read_diff"] == [] and r["read_logits_equal"]
        assert r["read_bytes"] == r["want_bytes"]


@pytest.mark.parametrize("arch,spec_name", PAIR_CASES)
def test_tp2_quantized_checkpoint_round_trips_bit_identically(pair, arch, spec_name):
    root, ranks = pair
    r0, r1 = case(ranks, f"{arch}-{spec_name}")
    for r in (r0, r1):
        assert r["load_diff"] == [] and r["load_logits_equal"] and r["rows_hooked"]
        assert r["quant"] == shardwise.InferenceConfig.build(quant=SPECS[spec_name]).quant
    assert r0["digest"] == r1["digest"] and r0["tokens"] == r1["tokens"]  # the ranks agree
    assert r0["layers"] == r1["layers"] > 0  # (each rank equal to its own saver: its own file)
    desc = json.loads((root / f"q2-{arch}-{spec_name}" / "shardwise_checkpoint.json").read_text())
    assert desc["tp_size"] == 2 and desc["extensions"]["shardwise.quant"]["config"] == r0["quant"]


def test_tp2_quantized_checkpoint_at_tp1_is_refused(pair, monkeypatch):
    with count_reads(monkeypatch) as reads:
        with pytest.raises(CheckpointError, match=r"saved at tp_size=2; .* load it at tp_size=2"):
            load(pair[0] / "q2-llama-int8")
    assert reads == []

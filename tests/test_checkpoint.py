"""Checkpoint loading shard by shard (``init_inference(None, checkpoint=...)``) and sharded
checkpoint saving/resharding, on 1 process and 2 (and once 4) gloo ranks.

Every load is checked against the plain HF model (``from_pretrained`` of the same directory):
fp32 logits within 1e-4 and 16 greedy tokens identical. The multi-rank work runs in one pair of
processes (a module-scoped fixture), preceded by one 4-rank run that saves a tp=4 checkpoint.
"""

from __future__ import annotations

import gc
import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers

import shardwise
from shardwise.checkpoint import CheckpointError
from shardwise.communicator import LocalCommunicator
from families import families
from models import prompt_ids, tiny_causal_lm
from tp_harness import with_random_biases, case, run_cases, run_pair

ARCHS = families(checkpoint=1)  # read at TP=1 (and at TP=2)
TP2_ARCHS = families(checkpoint=2)  # ARCHS and llama-7heads (uneven heads): read at TP=2
NEW = 16
ATOL = 1e-4
GEN = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)


def save_hf(arch: str, path: Path, **kwargs) -> Path:
    """A tiny model (random biases too) written by save_pretrained."""
    model = with_random_biases(tiny_causal_lm(arch))
    model.save_pretrained(path, **kwargs)
    return path


def parity(path: Path, rank: int = 0, dtype=torch.float32, **kwargs) -> dict:
    """Load ``path`` through init_inference and compare with from_pretrained of ``ref_dir``."""
    ref_dir = kwargs.pop("ref_dir", path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=dtype).eval()
    ids = prompt_ids(batch=2, length=8, vocab=ref.config.vocab_size)
    with torch.no_grad():
        want, want_tokens = ref(ids).logits, ref.generate(ids, **GEN)
    engine = shardwise.init_inference(None, checkpoint=str(path), device="cpu", dtype=dtype,
                                      **kwargs)
    mine = ids if rank == 0 else torch.zeros_like(ids)
    logits, tokens = engine(input_ids=mine).logits, engine.generate(mine, **GEN)
    load = engine.checkpoint_load
    return dict(max_abs=(logits.float() - want.float()).abs().max().item(),
                tokens_equal=torch.equal(tokens, want_tokens), bytes_read=load.bytes_read,
                param_bytes=sum(p.numel() * p.element_size() for p in engine.module.parameters()),
                full_bytes=sum(p.numel() * p.element_size() for p in ref.parameters()),
                dtypes=sorted({str(p.dtype) for p in engine.module.parameters()}),
                summary=load.summary())


def assert_parity(r: dict, atol: float = ATOL) -> None:
    assert r["max_abs"] < atol, f"logits differ by {r['max_abs']:.2e}"
    assert r["tokens_equal"], f"{NEW} greedy tokens differ from the plain HF model's"


pytestmark = pytest.mark.usefixtures("one_thread")


# ----- one process --------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_hf_directory_matches_from_pretrained(tmp_path, arch, layout):
    kwargs = {"max_shard_size": "20KB"} if layout == "sharded" else {}
    path = save_hf(arch, tmp_path / arch, **kwargs)
    if layout == "sharded":
        assert (path / "model.safetensors.index.json").is_file()
    r = parity(path)
    assert_parity(r)
    assert r["bytes_read"] == r["full_bytes"], "every tensor is read once (tied ones too)"


def test_bin_checkpoint_loads_with_a_warning(tmp_path):
    path = save_hf("llama", tmp_path / "bin")
    state = {k: v.contiguous() for k, v in
             transformers.AutoModelForCausalLM.from_pretrained(path).state_dict().items()}
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")
    with pytest.warns(UserWarning, match=r"\.bin files cannot be read slice by slice"):
        assert_parity(parity(path))


def test_description_file_with_base_dir_argument(tmp_path):
    path = save_hf("opt", tmp_path / "weights", max_shard_size="20KB")
    files = sorted(p.name for p in path.glob("model-*.safetensors"))
    desc = tmp_path / "elsewhere" / "ckpt.json"
    desc.parent.mkdir()
    desc.write_text(json.dumps({"type": "ds_model", "version": 1.0, "checkpoints": files}))
    shutil.copy(path / "config.json", desc.parent / "config.json")
    assert_parity(parity(desc, base_dir=str(path), ref_dir=path))
    tp_form = {"type": "ds_model", "checkpoints": {"non_tp": files[:1], "tp": files[1:]},
               "base_dir": str(path)}
    desc.write_text(json.dumps(tp_form))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        _load(desc)  # the description's own base_dir may not lead out of its folder …
    assert_parity(parity(desc, base_dir=str(path), ref_dir=path))  # … the caller's may
    shutil.copytree(path, desc.parent / "weights")
    tp_form["base_dir"] = "weights"  # a subfolder of the description's is inside
    desc.write_text(json.dumps(tp_form))
    assert_parity(parity(desc, ref_dir=path))


def test_bf16_from_fp32_checkpoint(tmp_path):
    path = save_hf("llama", tmp_path / "fp32")
    r = parity(path, dtype=torch.bfloat16)
    assert r["dtypes"] == ["torch.bfloat16"]
    assert r["max_abs"] < 2e-2 and r["tokens_equal"]  # buffers are cast to bf16 too (step 6)
    assert r["bytes_read"] == r["full_bytes"] * 2, "read in fp32, converted on the way"
    engine = _load(path, dtype=torch.bfloat16)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    mine = engine.module.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in ref.state_dict().items() if k in mine)


@pytest.mark.parametrize("how", ["meta-device", "init_empty_weights"])
def test_user_built_meta_model_gets_real_buffers(tmp_path, how):
    from accelerate import init_empty_weights

    path = save_hf("llama", tmp_path / "llama")
    config = transformers.AutoConfig.from_pretrained(path)
    with (torch.device("meta") if how == "meta-device" else init_empty_weights()):
        model = transformers.AutoModelForCausalLM.from_config(config)
    engine = shardwise.init_inference(model, checkpoint=str(path), device="cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    inv = engine.module.model.rotary_emb.inv_freq
    assert not inv.is_meta and torch.equal(inv, ref.model.rotary_emb.inv_freq)
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        assert (engine(input_ids=ids).logits - ref(ids).logits).abs().max() < ATOL


def test_save_then_load_at_tp1_reads_the_rank_file(tmp_path):
    path = save_hf("gpt2", tmp_path / "hf")
    engine = shardwise.init_inference(None, checkpoint=str(path), device="cpu",
                                      save_mp_checkpoint_path=str(tmp_path / "sw"))
    desc = json.loads((tmp_path / "sw" / "shardwise_checkpoint.json").read_text())
    assert desc["type"] == "shardwise" and desc["tp_size"] == 1 and desc["shards"] == {}
    assert_parity(parity(tmp_path / "sw", ref_dir=path))
    assert engine.save_checkpoint(tmp_path / "again").endswith("shardwise_checkpoint.json")


# ----- bad input ----------------------------------------------------------------------------------

def _load(path, **kwargs):
    return shardwise.init_inference(None, checkpoint=str(path), device="cpu", **kwargs)


def test_missing_shard_file_is_named(tmp_path):
    path = save_hf("llama", tmp_path / "m", max_shard_size="20KB")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"do not exist: .*{victim.name}"):
        _load(path)


def test_truncated_and_corrupted_files(tmp_path):
    path = save_hf("llama", tmp_path / "t")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated"):
        _load(path)
    (path / "model.safetensors").write_bytes(data[:8] + b"#" * 50 + data[58:])
    with pytest.raises(CheckpointError, match="corrupted safetensors header"):
        _load(path)
    (path / "model.safetensors").write_bytes(b"\x00")
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        _load(path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    path = save_hf("llama", tmp_path / "s")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape "
                                              r"\[128, 64\] in the checkpoint but \[96, 64\]"):
        _load(path)


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_hf("llama", tmp_path / "k")
    state = load_file(path / "model.safetensors")
    state.pop("model.norm.weight")
    state["model.extra.weight"] = torch.zeros(2)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing keys \(1\): model.norm.weight.*"
                                              r"unexpected keys \(1\): model.extra.weight"):
        _load(path)


@pytest.mark.parametrize("body, message", [
    ({"type": "megatron", "checkpoints": ["a"]}, "checkpoint type 'megatron'"),
    ({"type": "shardwise", "version": 9, "checkpoints": ["a"], "tp_size": 1}, "version 9"),
    ({"type": "ds_model", "checkpoints": ["nope.safetensors"]}, "nope.safetensors"),
    ({"type": "ds_model", "checkpoints": ["a"], "colour": 1}, "unknown field"),
])
def test_bad_descriptions(tmp_path, body, message):
    desc = tmp_path / "d.json"
    desc.write_text(json.dumps(body))
    (tmp_path / "a").write_bytes(b"")
    with pytest.raises(CheckpointError, match=message):
        _load(desc)


def test_failed_read_leaves_no_usable_model(tmp_path, monkeypatch):
    from shardwise.checkpoint import sources

    path = save_hf("llama", tmp_path / "f")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(path))
    calls = []

    def failing(self, *args):
        calls.append(1)
        if len(calls) > 5:
            raise OSError("disk went away")
        return real(self, *args)
    real = sources.Reader.read
    monkeypatch.setattr(sources.Reader, "read", failing)
    with pytest.raises(OSError, match="disk went away"):
        shardwise.init_inference(model, checkpoint=str(path), device="cpu")
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(shardwise.ConfigError, match="meta device"):
        shardwise.init_inference(model, device="cpu")


def test_config_fields(tmp_path):
    with pytest.raises(shardwise.ConfigError, match="base_dir .* needs checkpoint"):
        shardwise.InferenceConfig.build(base_dir=str(tmp_path))
    with pytest.raises(shardwise.ConfigError, match="checkpoint must be"):
        shardwise.InferenceConfig.build(checkpoint=3)


# ----- several ranks ------------------------------------------------------------------------------

class _RankView(LocalCommunicator):
    """Rank ``rank`` of a ``world``-rank group, seen from one process (collectives are not
    needed to write one rank's file; the save id is fixed)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world

    def broadcast(self, tensor, src=0):
        return torch.tensor([0x5EED, 1])  # the save id; the plain rank-file names are free

    def barrier(self):
        pass


def save_tp4(hf_dir: Path, out: Path) -> None:
    """A tp=4 checkpoint written rank by rank in this process. Sound: a rank's file holds its
    sliced state dict, and ``apply_shards`` slices with exactly ``slice_all`` (the hooks it adds
    do not touch weights), so each file equals what rank r of a 4-process run writes."""
    from shardwise.checkpoint import save_checkpoint
    from shardwise.sharding import prepare_for, slice_all

    for rank in range(4):
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
        prepared = prepare_for(model, None, 4)
        slice_all(prepared, rank)
        save_checkpoint(model, out, prepared=prepared, communicator=_RankView(rank, 4))


def _pair_cases(rank: int, root: str) -> dict:
    root = Path(root)
    tp2 = {"tensor_parallel": {"tp_size": 2}}
    cases = {f"hf-{a}": partial(parity, root / f"hf-{a}", rank, **tp2)
             for a in TP2_ARCHS}
    cases["from-tp1"] = partial(parity, root / "sw1-llama-7heads", rank,
                                ref_dir=root / "hf-llama-7heads", **tp2)
    cases["from-tp4"] = partial(parity, root / "sw4-gpt2", rank, ref_dir=root / "hf-gpt2", **tp2)
    for a in ("llama-7heads", "qwen2"):  # save at tp=2 (uneven heads too), then read it back
        cases[f"save-{a}"] = partial(parity, root / f"hf-{a}", rank, **tp2,
                                     save_mp_checkpoint_path=str(root / f"sw2-{a}"))
        cases[f"same-{a}"] = partial(parity, root / f"sw2-{a}", rank, ref_dir=root / f"hf-{a}",
                                     **tp2)
    return run_cases(rank, cases)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    for arch in TP2_ARCHS:
        sharded = {"max_shard_size": "20KB"} if arch == "llama" else {}
        save_hf(arch, root / f"hf-{arch}", **sharded)
    _load(root / "hf-llama-7heads", save_mp_checkpoint_path=str(root / "sw1-llama-7heads"))
    save_tp4(root / "hf-gpt2", root / "sw4-gpt2")
    ranks = run_pair(partial(_pair_cases, root=str(root)), tmp_path_factory.mktemp("p"))
    return root, ranks


@pytest.mark.slow
@pytest.mark.parametrize("name", [*(f"hf-{a}" for a in TP2_ARCHS), "from-tp1",
                                  "from-tp4", "save-llama-7heads", "save-qwen2",
                                  "same-llama-7heads", "same-qwen2"])
def test_tp2_loads_match_from_pretrained(world, name):
    for r in case(world[1], name):
        assert_parity(r)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt"])
def test_each_rank_reads_about_half(world, arch):
    for r in case(world[1], f"hf-{arch}"):
        assert r["bytes_read"] < 0.75 * r["full_bytes"], r["summary"]
        assert r["bytes_read"] == r["param_bytes"] or arch == "opt", r["summary"]


@pytest.mark.slow
def test_same_tp_reads_only_its_own_rank_file_slices(world):
    for r in case(world[1], "same-qwen2"):
        assert r["bytes_read"] <= r["param_bytes"], r["summary"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-7heads", "qwen2"])
def test_tp2_checkpoint_merges_to_tp1(world, name):
    root = world[0]
    desc = json.loads((root / f"sw2-{name}" / "shardwise_checkpoint.json").read_text())
    assert desc["tp_size"] == 2 and len(desc["checkpoints"]) == 2 and desc["shards"]
    assert_parity(parity(root / f"sw2-{name}", ref_dir=root / f"hf-{name}"))


@pytest.mark.slow
def test_rank_files_that_disagree(world, tmp_path):
    root = world[0]
    mixed = tmp_path / "mixed"
    shutil.copytree(root / "sw2-qwen2", mixed)
    other = json.loads((root / "sw2-llama-7heads" / "shardwise_checkpoint.json").read_text())
    name = other["checkpoints"][1]
    shutil.copy(root / "sw2-llama-7heads" / name, mixed / name)
    with pytest.raises(CheckpointError, match="belongs to another save.*rank files disagree"):
        _load(mixed)


def test_standalone_loader_with_progress_and_summary(tmp_path, capsys):
    from shardwise.checkpoint import load_checkpoint

    path = save_hf("qwen2", tmp_path / "q", max_shard_size="20KB")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(path))
    report = load_checkpoint(model, path, dtype=torch.bfloat16, progress=True)
    err = capsys.readouterr().err
    assert "loading" in err and "GB/s" in err and report.files > 1
    assert all(p.dtype == torch.bfloat16 and not p.is_meta for p in model.parameters())


# ----- the slice reader: positional reads, never a memory map ----------------------------------

def _reader_for(path: Path):
    from shardwise.checkpoint.sources import CheckpointIndex, Piece, Reader, safetensors_header

    tensors, _ = safetensors_header(path)
    index = CheckpointIndex({k: [Piece(i)] for k, i in tensors.items()},
                            {k: i.shape for k, i in tensors.items()},
                            {k: i.dtype for k, i in tensors.items()}, {})
    return Reader(index)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool,
           *[d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None]]


@pytest.mark.parametrize("stage, run", [(1 << 20, 1 << 20), (64, 1 << 20), (64, 16), (1, 1)])
def test_chunked_slices_equal_full_reads(tmp_path, monkeypatch, stage, run):
    """Row, column and middle-dim slices (one and several ranges, converted or not), read in
    chunks through a tiny staging buffer, equal slicing the fully loaded tensor, bit for bit."""
    from safetensors.torch import load_file, save_file

    from shardwise.checkpoint import preads

    monkeypatch.setattr(preads, "STAGE_BYTES", stage)
    monkeypatch.setattr(preads, "RUN_BYTES", run)
    g = torch.Generator().manual_seed(0)
    state = {}
    for i, dtype in enumerate(_DTYPES):
        for shape in [(37, 53), (5, 12, 7), (9,), ()]:
            x = torch.randn(shape, generator=g) * 50
            state[f"t{i}-{len(shape)}"] = x.to(dtype)
    state["empty"] = torch.zeros(0, 4)
    path = tmp_path / "t.safetensors"
    save_file(state, path)
    full = load_file(path)
    with _reader_for(path) as reader:
        for key, x in full.items():
            for out in (None, torch.bfloat16, torch.float32, torch.float16):
                want_dtype = out if out is not None and x.is_floating_point() else x.dtype
                got = reader.read(key, None, None, out)
                assert got.dtype == want_dtype and torch.equal(got, x.to(want_dtype)), key
                for dim in range(x.dim()):
                    n = x.shape[dim]
                    cases = [[(0, n)], [(1, n // 2 + 1)], [(n // 3, n), (0, 1)]]
                    for ranges in cases if n >= 3 else cases[:1]:
                        got = reader.read(key, dim, ranges, out)
                        want = torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim)
                        assert got.is_contiguous() and got.dtype == want_dtype
                        assert torch.equal(got, want.to(want_dtype)), (key, dim, ranges, out)
        assert reader.bytes_read > 0


def test_reader_never_maps_the_checkpoint(tmp_path, monkeypatch):
    """Loading (tp=1, fp32 and bf16) neither memory-maps nor safe_opens a checkpoint file, and no
    file of it is in /proc/self/maps while reading; the weights equal from_pretrained's."""
    import mmap
    import safetensors

    from shardwise.checkpoint import sources

    path = save_hf("llama", tmp_path / "nomap", max_shard_size="20KB")
    refs = {d: {k: v.clone() for k, v in  # clones: from_pretrained's tensors map the files
                transformers.AutoModelForCausalLM.from_pretrained(path, dtype=d)
                .state_dict().items()} for d in (torch.float32, torch.bfloat16)}
    gc.collect()

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint reader must not memory-map files")
    monkeypatch.setattr(mmap, "mmap", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(torch, "from_file", refuse, raising=False)
    real, maps = sources.Reader._slice, Path("/proc/self/maps")

    def mapped() -> list[str]:
        text = maps.read_text() if maps.exists() else ""
        return [line for line in text.splitlines() if str(path) in line]
    assert not mapped(), "the reference models' mappings are gone before loading"
    seen = []

    def watching(self, info, *args):
        out = real(self, info, *args)
        seen.extend(mapped())
        return out
    monkeypatch.setattr(sources.Reader, "_slice", watching)
    for dtype, ref in refs.items():
        engine = _load(path, dtype=dtype)
        mine = engine.module.state_dict()
        assert all(torch.equal(mine[k], v) for k, v in ref.items() if k in mine)
    assert not seen, seen


def test_file_truncated_after_its_header_was_read(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(64, 64)}, path)
    with _reader_for(path) as reader:
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size - 100)
        with pytest.raises(CheckpointError, match="t.safetensors is truncated"):
            reader.read("a", 1, [(32, 64)], None)

"""Mixture-of-Experts checkpoints: the stacked 3-D expert layout and the older one-tensor-per-expert
layouts (Mixtral's ``block_sparse_moe.experts.N.w1/w2/w3``, Qwen-MoE's
``mlp.experts.N.gate_proj/up_proj/down_proj``), loaded through transformers' own conversion
mapping; a checkpoint whose expert count is not the config's is a named error before any weight
is read; a rank keeping a range of experts reads only their tensors.

Every load is checked against ``from_pretrained`` of the same directory: fp32 logits within 1e-4
and 16 greedy tokens identical. The families are the registry's MoE families (tests/families.py:
``moe=1`` read on one process, ``moe=2`` also at ep=2 on 2 gloo ranks).
"""

from __future__ import annotations

import gc
import json
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import shardwise
from shardwise.checkpoint import CheckpointError, ExpertCountError, build_index, describe
from shardwise.checkpoint.conversions import key_map, select
from shardwise.checkpoint.sources import Reader
from shardwise.policy import GenericPolicy
from families import families, family
from models import prompt_ids
from tp_harness import case, run_cases, run_pair

NEW = 16
ATOL = 1e-4
GEN = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
MOE_ARCHS = families(moe=1)  # every MoE family: its checkpoints read on one process
EP_ARCHS = families(moe=2)  # read at ep=2 too (2 gloo ranks)
#: save_pretrained's default writes the older per-expert layout (transformers reverts its
#: conversion); save_original_format=False writes the stacked 3-D tensors as the model holds them
LAYOUTS = {"per_expert": {}, "stacked": {"save_original_format": False},
           "per_expert_sharded": {"max_shard_size": "40KB"}}

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_moe(arch: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """The registry's tiny ``arch`` (its config changed by ``overrides``), weights from ``seed``."""
    spec = {**family(arch).config, **overrides}
    config = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def save_moe(arch: str, path: Path, layout: str = "per_expert", **overrides) -> Path:
    tiny_moe(arch, **overrides).save_pretrained(path, **LAYOUTS[layout])
    return path


def expert_attr(config: dict) -> str:
    """The config attribute holding the expert count (the names shardwise's policies read)."""
    return next(a for a in GenericPolicy.moe_config["num_experts"] if a in config)


def expert_count(arch: str) -> int:
    return family(arch).config[expert_attr(family(arch).config)]


def state_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors a checkpoint holds for ``model``: its parameters and persistent
    buffers (DeepSeek-V3's router correction bias), tied ones once."""
    unique = {id(t): t for t in model.state_dict(keep_vars=True).values()}
    return sum(t.numel() * t.element_size() for t in unique.values())


def experts_held(model: torch.nn.Module) -> int:
    """Experts in the last MoE layer's experts module (dim 0 of its stacked parameters)."""
    held = [p.shape[0] for n, p in model.named_parameters() if p.dim() == 3 and ".experts." in n]
    return held[-1]


def has_per_expert_layout(arch: str) -> bool:
    """Whether transformers converts ``arch``'s checkpoints from one tensor per expert (else
    save_pretrained writes the stacked tensors whatever it is asked)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    with torch.device("meta"):
        model = tiny_moe(arch)
    return any(isinstance(t, WeightConverter) for t in get_model_conversion_mapping(model))


def parity(path: Path, dtype=torch.float32, ref_dir: Path | None = None, **kwargs) -> dict:
    """Load ``path`` through init_inference and compare with from_pretrained of ``ref_dir``."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir or path, dtype=dtype).eval()
    ids = prompt_ids(batch=2, length=8, vocab=ref.config.vocab_size)
    with torch.no_grad():
        want, want_tokens = ref(ids).logits, ref.generate(ids, **GEN)
    engine = shardwise.init_inference(None, checkpoint=str(path), device="cpu", dtype=dtype,
                                      **kwargs)
    logits, tokens = engine(input_ids=ids).logits, engine.generate(ids, **GEN)
    return dict(max_abs=(logits.float() - want.float()).abs().max().item(),
                tokens_equal=torch.equal(tokens, want_tokens), engine=engine,
                bytes_read=engine.checkpoint_load.bytes_read,
                param_bytes=state_bytes(engine.module),
                experts_held=experts_held(engine.module),
                summary=engine.checkpoint_load.summary())


def assert_parity(r: dict, atol: float = ATOL) -> None:
    assert r["max_abs"] < atol, f"logits differ by {r['max_abs']:.2e}"
    assert r["tokens_equal"], f"{NEW} greedy tokens differ from from_pretrained's"


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
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_layouts_load_like_from_pretrained(tmp_path, arch, layout):
    path = save_moe(arch, tmp_path / arch, layout)
    keys = expert_keys(path)
    stacked = [k for k in keys if ".experts." in k and not k.split(".experts.")[1][0].isdigit()]
    per_expert = layout != "stacked" and has_per_expert_layout(arch)
    assert (len(stacked) < len(keys)) == per_expert, keys[:4]  # the layout written
    r = parity(path)
    assert_parity(r)
    assert r["bytes_read"] == r["param_bytes"]  # every tensor read once, nothing else


def test_per_expert_bin_checkpoint(tmp_path):
    """A pytorch_model.bin in the per-expert layout (older Mixtral releases) loads the same."""
    path = save_moe("mixtral", tmp_path / "bin")
    (file,) = weight_files(path)
    torch.save(load_file(file), path / "pytorch_model.bin")
    file.unlink()
    with pytest.warns(UserWarning, match=r"\.bin files cannot be read slice by slice"):
        assert_parity(parity(path))


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
    assert_parity(parity(tmp_path / "sw", ref_dir=src))


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_an_injected_engine_saves_the_models_own_layout(tmp_path, arch):
    """The MoE step may hold the experts in the kernels' layout (GPT-OSS's are converted in
    place): engine.save_checkpoint still writes the layout the model is built with, so the
    checkpoint loads like the original one."""
    src = save_moe(arch, tmp_path / "hf")
    engine = shardwise.init_inference(None, checkpoint=str(src), device="cpu",
                                      dtype=torch.float32, replace_with_kernel_inject=True)
    engine.save_checkpoint(tmp_path / "sw")
    assert_parity(parity(tmp_path / "sw", ref_dir=src))


# ----- a rank's experts only --------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_an_expert_range_reads_only_its_experts_tensors(tmp_path, arch):
    """transformers' converter builds experts [1, 3) from those experts' tensors alone: equal to
    the same rows of the whole tensor, and exactly their bytes read; built in place (copied
    into, or read straight into its slots converted to bf16: the loader's path) the same."""
    path = save_moe(arch, tmp_path / arch)
    model = tiny_moe(arch)
    index = build_index(describe(path))
    composite = key_map(model, index.keys()).composite
    name = "model.layers.1.mlp.experts.gate_up_proj"
    entry = composite[name]
    assert entry.stack_dim == 0 and entry.count() == expert_count(arch)
    with Reader(index) as reader:
        def load(key):
            return reader.read(key, None, None, None)
        whole = entry.build(load)  # transformers' own operations
        before = reader.bytes_read
        part = entry.build(load, select([(1, 3)]))
        read = reader.bytes_read - before
        placed = entry.build(load, select([(1, 3)]), index.shapes)  # in place: the same values
        before = reader.bytes_read
        filled = entry.build(load, select([(1, 3)]), index.shapes,  # read straight into place
                             (reader.read_into, torch.bfloat16))
        filled_read = reader.bytes_read - before
    torch.testing.assert_close(whole, model.get_parameter(name).detach(), rtol=0, atol=0)
    torch.testing.assert_close(part, whole[1:3], rtol=0, atol=0)
    torch.testing.assert_close(placed, part, rtol=0, atol=0)
    torch.testing.assert_close(filled, part.to(torch.bfloat16), rtol=0, atol=0)
    assert read == filled_read == part.numel() * part.element_size()


@pytest.mark.parametrize("cat", [1, -1, -3])
def test_in_place_and_per_range_builds_follow_the_converters_dims(cat):
    """A stack then a concatenation (along dim 1, the last, or -3: the stacked dim itself) built
    in place and per expert range gives what transformers' operations give on the whole, sliced;
    only a concatenation along a known other dim lets a range be built from its entries."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    from shardwise.checkpoint.conversions import Composite

    conv = WeightConverter(["experts.*.a", "experts.*.b"], "experts.ab",
                           operations=[MergeModulelist(dim=0), Concatenate(dim=cat)])
    g = torch.Generator().manual_seed(0)
    tensors = {f"experts.{e}.{p}": torch.randn(3, 2, generator=g)
               for e in range(4) for p in ("a", "b")}
    entry = Composite("experts.ab", conv, {
        "experts.*.a": [f"experts.{e}.a" for e in range(4)],
        "experts.*.b": [f"experts.{e}.b" for e in range(4)]})
    shapes = {"norm.weight": (7, 7, 7), **{k: tuple(v.shape) for k, v in tensors.items()}}
    whole = entry.build(tensors.__getitem__)  # transformers' operations
    assert entry.stack_dim == (0 if cat == 1 else None)
    torch.testing.assert_close(entry.build(tensors.__getitem__, shapes=shapes), whole,
                               rtol=0, atol=0)
    if entry.stack_dim == 0:
        got = entry.build(tensors.__getitem__, select([(1, 3)]), shapes)
        torch.testing.assert_close(got, whole[1:3], rtol=0, atol=0)


# ----- bad input: named, before any weight is read ----------------------------------------------

@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_expert_count_differing_from_the_config(tmp_path, monkeypatch, arch, layout):
    path = save_moe(arch, tmp_path / arch, layout)
    config = json.loads((path / "config.json").read_text())
    attr = expert_attr(config)
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
    """The last expert renumbered past the count: as many tensors as experts, misnumbered."""
    path = save_moe("qwen3_moe", tmp_path / "q")
    n = expert_count("qwen3_moe")
    rewrite(path, lambda t: {k.replace(f".experts.{n - 1}.", f".experts.{n + 5}."): v
                             for k, v in t.items()})
    no_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"numbered 0, 1, 2, 3, … .* not 0 … {n - 1}"):
        shardwise.init_inference(None, checkpoint=str(path), device="cpu")


def test_per_expert_shapes_that_do_not_build_the_parameter(tmp_path, monkeypatch):
    path = save_moe("mixtral", tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    e, i, h = config["num_local_experts"], config["intermediate_size"], config["hidden_size"]
    config["intermediate_size"] = i + 16  # the experts' tensors are [i, h]
    (path / "config.json").write_text(json.dumps(config))
    no_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"build .*gate_up_proj.* as \[{e}, {2 * i}, {h}\] "
                                              rf".* has \[{e}, {2 * i + 32}, {h}\]"):
        shardwise.init_inference(None, checkpoint=str(path), device="cpu")


# ----- expert parallelism on 2 gloo ranks: one pair of processes runs every case -----------------

EP2 = {"moe": {"ep_size": 2}}
#: a model whose experts dominate its bytes (48 MiB of experts, ~3 MiB else, fp32): what a rank
#: holds at ep=2 is about half of it, so its peak memory while loading shows what it read
RSS_MODEL = dict(hidden_size=256, intermediate_size=1024, num_local_experts=8)
#: an expert count ep=2 splits unevenly (3 + 2)
UNEVEN = dict(num_experts=5)
#: the loader's peak above the parameters a rank holds: one expert's tensor read at a time (1 MiB
#: here; a per-expert layout is built in place) plus allocator and bookkeeping slack; measured
#: 1-7 MiB (per-expert) and ≤ 0.3 MiB (stacked) on a shared 2-core machine, the loader alone or
#: all of init_inference
RSS_SLACK = 8 << 20


def _vm_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field_name}")


def _plain(r: dict) -> dict:
    """A parity result without its engine (the rank results travel as JSON)."""
    return {k: v for k, v in r.items() if k != "engine"}


def _ep_parity(path: Path, **kwargs) -> dict:
    return _plain(parity(path, **{**EP2, **kwargs}))


def _loader_alone(path: Path):
    """A callable loading ``path`` at ep=2 with the loader alone (the plan's slices), returning
    (the model, the load report)."""
    from shardwise.checkpoint import load_checkpoint, skeleton
    from shardwise.plan import build_plan

    desc = describe(path)
    model = skeleton(None, desc, torch.float32)  # parameters on meta: nothing allocated
    plan = build_plan(model, ep_size=2)
    return lambda: (model, load_checkpoint(model, desc, prepared=plan.sharding, rank=plan.rank))


def _engine(path: Path):
    """A callable building the ep=2 engine from ``path`` (every step of init_inference)."""
    def build():
        engine = shardwise.init_inference(None, checkpoint=str(path), device="cpu",
                                          dtype=torch.float32, **EP2)
        return engine.module, engine.checkpoint_load
    return build


def _peak_load(how, path: Path, warm_up: Path) -> dict:
    """This rank's peak resident memory while loading ``path`` at ep=2 (``how``: the loader
    alone or init_inference; VmHWM reset to the current RSS first), against the bytes of the
    parameters it holds after. The same load of a tiny checkpoint of the same layout runs first,
    so the process's one-time costs (imports, torch's thread pool) are not counted."""
    from shardwise.accelerators.cpu import return_freed_memory

    how(warm_up)()
    load = how(path)
    gc.collect()
    return_freed_memory()  # earlier cases' freed heap back to the system: new pages count
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _vm_kib("VmRSS")
    model, report = load()
    peak = (_vm_kib("VmHWM") - base) << 10
    return dict(peak=peak, held=state_bytes(model), bytes_read=report.bytes_read,
                whole=report.bytes_before)


def _loaded_slices(path: Path) -> dict:
    """``path`` loaded at ep=2 by the loader alone, each tensor compared with from_pretrained's:
    equal, or (an experts module's) equal to its rows [start, stop) of this rank's experts."""
    from shardwise.checkpoint import load_checkpoint, skeleton
    from shardwise.plan import build_plan

    desc = describe(path)
    model = skeleton(None, desc, torch.float32)
    plan = build_plan(model, ep_size=2)
    load_checkpoint(model, desc, prepared=plan.sharding, rank=plan.rank)
    start, stop = plan.experts.range
    ref = dict(transformers.AutoModelForCausalLM.from_pretrained(path).state_dict())
    sliced, wrong = [], []
    for name, tensor in model.state_dict().items():
        want = ref[name]
        if any(name.startswith(s.name + ".") for s in plan.sharding.experts):
            want = want[start:stop]
            sliced.append(name)
        if tensor.shape != want.shape or not torch.equal(tensor, want):
            wrong.append(name)
    return dict(sliced=sliced, wrong=wrong, range=[start, stop])


def _save_at_ep2(path: Path, out: Path) -> dict:
    """An ep=2 engine built from ``path`` saves itself to ``out`` (its parity at ep=2 is
    test_moe_ep.py's); what the rank holds."""
    engine = shardwise.init_inference(None, checkpoint=str(path), device="cpu",
                                      dtype=torch.float32, save_mp_checkpoint_path=str(out), **EP2)
    return dict(experts_held=experts_held(engine.module))


def _pair_cases(rank: int, root: str) -> dict:
    root = Path(root)
    cases = {f"rss-{name}-{layout}": partial(_peak_load, how, root / f"rss-{layout}",
                                             root / f"mixtral-{layout}")
             for layout in ("per_expert", "stacked")  # first: a process with little history
             for name, how in (("loader", _loader_alone), ("engine", _engine))}
    for arch in EP_ARCHS:
        for layout in ("per_expert", "stacked"):
            cases[f"ep2-{arch}-{layout}"] = partial(_ep_parity, root / f"{arch}-{layout}")
    for arch in MOE_ARCHS:
        cases[f"slices-{arch}"] = partial(_loaded_slices, root / f"{arch}-per_expert")
        cases[f"save-ep2-{arch}"] = partial(_save_at_ep2, root / f"{arch}-per_expert",
                                            root / f"sw-ep2-{arch}")
    cases["ep2tp2-mixtral"] = partial(_ep_parity, root / "mixtral-per_expert",
                                      tensor_parallel={"tp_size": 2})
    cases["save-ep2"] = partial(_ep_parity, root / "uneven",  # experts split 3 + 2
                                save_mp_checkpoint_path=str(root / "sw-ep2"))
    cases["same-ep2"] = partial(_ep_parity, root / "sw-ep2", ref_dir=root / "uneven")
    cases["tp2-from-ep2"] = lambda: _plain(parity(
        root / "sw-ep2", ref_dir=root / "uneven", tensor_parallel={"tp_size": 2}))
    cases["ep2-from-ep1"] = partial(_ep_parity, root / "sw-ep1", ref_dir=root / "mixtral-stacked")
    return run_cases(rank, cases)


@pytest.fixture(scope="module")
def ep_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    for arch in MOE_ARCHS:
        for layout in ("per_expert", "stacked") if arch in EP_ARCHS else ("per_expert",):
            save_moe(arch, root / f"{arch}-{layout}", layout)
    save_moe("qwen3_moe", root / "uneven", **UNEVEN)
    ep1 = shardwise.init_inference(None, checkpoint=str(root / "mixtral-stacked"), device="cpu",
                                   dtype=torch.float32)
    ep1.save_checkpoint(root / "sw-ep1")
    ep1.close()
    for layout in ("per_expert", "stacked"):
        save_moe("mixtral", root / f"rss-{layout}", layout, **RSS_MODEL)
    ranks = run_pair(partial(_pair_cases, root=str(root)), tmp_path_factory.mktemp("p"),
                     deadline_s=420)
    return root, ranks


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
@pytest.mark.parametrize("arch", EP_ARCHS)
def test_ep2_reads_only_its_experts(ep_world, arch, layout):
    """Each rank holds and reads its experts only (of the stacked tensors, or of the per-expert
    ones), the dense parts whole; the two ranks' experts together give from_pretrained's output."""
    total = expert_count(arch)
    r0, r1 = case(ep_world[1], f"ep2-{arch}-{layout}")
    assert (r0["experts_held"], r1["experts_held"]) == ((total + 1) // 2, total // 2)
    for r in (r0, r1):
        assert_parity(r)
        assert r["bytes_read"] == r["param_bytes"], r["summary"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_ep2_loader_reads_every_familys_expert_rows(ep_world, arch):
    """For every MoE family (GPT-OSS's expert biases and DeepSeek-V3's per-expert layout too):
    the loader alone at ep=2 gives each rank exactly its rows of every experts-module tensor
    and every other tensor whole, as from_pretrained has them."""
    r0, r1 = case(ep_world[1], f"slices-{arch}")
    for r in (r0, r1):
        assert r["sliced"] and not r["wrong"], r
    assert r0["range"][1] == r1["range"][0] and r0["range"][0] == 0
    assert r1["range"][1] == expert_count(arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_every_familys_ep2_checkpoint_loads_on_one_rank(ep_world, arch):
    """save_checkpoint of an ep=2 engine of every MoE family (its experts as the MoE step holds
    them: GPT-OSS's converted to the kernels' layout) merges back on one process into what
    from_pretrained gives."""
    root = ep_world[0]
    held = [r["experts_held"] for r in case(ep_world[1], f"save-ep2-{arch}")]
    assert sum(held) == expert_count(arch)
    r = parity(root / f"sw-ep2-{arch}", ref_dir=root / f"{arch}-per_expert")
    assert_parity(r)
    assert r["experts_held"] == expert_count(arch)


@pytest.mark.slow
def test_ep2_checkpoint_with_another_expert_count(ep_world, monkeypatch):
    """A sharded (ep=2) checkpoint of 5 experts into a model built with 4: named from the
    description and headers, before any weight is read."""
    with torch.device("meta"):
        model = tiny_moe("qwen3_moe", num_experts=UNEVEN["num_experts"] - 1)
    no_reads(monkeypatch)
    with pytest.raises(ExpertCountError, match=r"holds 5 experts .* has 4"):
        shardwise.init_inference(model, checkpoint=str(ep_world[0] / "sw-ep2"), device="cpu")


@pytest.mark.slow
def test_ep2_with_tp2(ep_world):
    for r in case(ep_world[1], "ep2tp2-mixtral"):
        assert_parity(r)
        assert r["bytes_read"] == r["param_bytes"], r["summary"]


@pytest.mark.slow
def test_ep2_checkpoint_saves_each_ranks_experts(ep_world):
    """save_checkpoint of an ep=2 engine: one file per rank with its experts, described as dim-0
    slices of the whole tensors (3 + 2 of 5 experts)."""
    root = ep_world[0]
    for r in case(ep_world[1], "save-ep2"):
        assert_parity(r)
    desc = json.loads((root / "sw-ep2" / "shardwise_checkpoint.json").read_text())
    assert desc["tp_size"] == 2 and desc["ep_size"] == 2 and len(desc["checkpoints"]) == 2
    entry = desc["shards"]["model.layers.1.mlp.experts.gate_up_proj"]
    assert (entry["dim"], entry["size"], entry["ranges"]) == (0, 5, [[[0, 3]], [[3, 5]]])
    for rank, held in ((0, 3), (1, 2)):
        tensors = load_file(root / "sw-ep2" / desc["checkpoints"][rank])
        assert tensors["model.layers.1.mlp.experts.down_proj"].shape[0] == held


@pytest.mark.slow
@pytest.mark.parametrize("name", ["same-ep2", "tp2-from-ep2", "ep2-from-ep1"])
def test_ep_checkpoints_reshard(ep_world, name):
    """An ep=2 checkpoint at ep=2 (each rank reads its own file's experts), at tp=2 with every
    expert on both ranks (merged from both files), and a one-rank save read at ep=2."""
    for r in case(ep_world[1], name):
        assert_parity(r)
        if name != "tp2-from-ep2":
            assert r["bytes_read"] == r["param_bytes"], r["summary"]


@pytest.mark.slow
def test_ep2_checkpoint_merges_to_one_rank(ep_world):
    root = ep_world[0]
    r = parity(root / "sw-ep2", ref_dir=root / "uneven")
    assert_parity(r)
    assert r["experts_held"] == UNEVEN["num_experts"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
@pytest.mark.parametrize("how", ["loader", "engine"])
def test_ep2_peak_memory_is_own_experts_plus_replicated(ep_world, how, layout):
    """Per-rank peak RSS while loading ≈ the parameters the rank holds (its experts + the
    replicated parts) plus one expert's tensor and allocator slack, well under the whole model:
    for the loader alone and for the whole init_inference. The measure is the process's VmHWM
    (reset before the load), so it is real memory."""
    for r in case(ep_world[1], f"rss-{how}-{layout}"):
        mib = {k: round(v / 2**20, 1) for k, v in r.items()
               if isinstance(v, int) and not isinstance(v, bool)}
        print(f"rss {how} {layout}: {mib}")
        assert r["bytes_read"] == r["held"] < 0.6 * r["whole"], mib
        assert r["peak"] <= r["held"] + RSS_SLACK, mib
        assert r["peak"] < 0.75 * r["whole"], mib

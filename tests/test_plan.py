"""The resolved plan (shardwise.plan): its fields on one and two ranks, the dimension checks, the
one policy lookup per init, engine.plan; sharding's recorded undo (weights all-gathered back);
no import-time cycle in the package."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import shardwise
from distributed import run_ranks
from models import prompt_ids, tiny_causal_lm
from shardwise.errors import ConfigError, NotSupportedYetError
from shardwise.layout import ColumnParallel, RowParallel, ShardingError
from shardwise.plan import ParallelismNotSupportedError, build_plan, check_dims


# ----- fields ------------------------------------------------------------------------------------

def test_plan_on_one_rank_holds_the_policy_all_heads_and_the_roles_without_sharding():
    model = tiny_causal_lm("llama")  # 4 q heads, 2 kv heads, head_dim 16
    plan = build_plan(model)
    assert (plan.world, plan.rank) == (1, 0)
    assert [(d.name, d.size, d.coord, d.group) for d in plan.dims.values()] == [
        ("pp", 1, 0, None), ("dp", 1, 0, None), ("tp", 1, 0, None), ("ep", 1, 0, None)]
    assert plan.policy.name == "llama" and plan.policy_registered and not plan.sharded
    assert tuple(plan.head_counts) == (4, 2, 16)
    assert (plan.heads.q_range, plan.heads.kv_range) == ((0, 4), (0, 2))
    assert plan.sharding is None
    roles = plan.roles
    assert isinstance(roles["model.layers.0.self_attn.q_proj"], ColumnParallel)
    assert isinstance(roles["model.layers.1.mlp.down_proj"], RowParallel)
    assert plan.roles_source == "hf_tp_plan"
    text = repr(plan)
    assert "world=1" in text and "policy: llama" in text and "heads: 4 of 4 q" in text


@pytest.mark.parametrize("rank, q, kv", [(0, (0, 2), (0, 1)), (1, (2, 4), (1, 2))])
def test_plan_for_a_rank_of_two_holds_its_coordinate_heads_and_every_ranks_slices(rank, q, kv):
    model = tiny_causal_lm("llama")
    plan = build_plan(model, tp_size=2, world=2, rank=rank)
    assert (plan.tp.size, plan.tp.coord, plan.tp.group) == (2, rank, None)  # bound later
    assert plan.sharded and plan.dp.size == plan.pp.size == plan.ep.size == 1
    assert (plan.heads.q_range, plan.heads.kv_range) == (q, kv)
    assert plan.heads is plan.head_split.partitions[rank]
    assert plan.sharding.tp_size == 2 and plan.sharding.heads == list(plan.head_split.partitions)
    assert plan.roles is plan.sharding.roles
    spec = next(s for s in plan.sharding.specs if s.name == "model.layers.0.self_attn.k_proj")
    assert spec.ranges == [[(0, 16)], [(16, 32)]]  # one kv head of 16 each
    assert "tp=2 (coord" in repr(plan) and "sharding: " in repr(plan)


def test_a_model_without_a_registered_policy_gets_the_generic_one_and_says_so():
    model = tiny_causal_lm("llama")
    model.config.model_type = "not-a-family"
    plan = build_plan(model, tp_size=2, world=2, rank=0)
    assert plan.policy.name == "generic" and not plan.policy_registered
    assert plan.found_policy is None
    assert any("no policy registered" in n for n in plan.notes)


def test_a_model_no_plan_fits_has_no_roles_on_one_rank_and_the_plan_says_why():
    plan = build_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert plan.roles is None and plan.heads is None and plan.head_counts is None
    assert "nothing to shard" in plan.roles_source
    assert "roles: none (no tensor-parallel plan fits the model" in repr(plan)
    with pytest.raises(ShardingError, match="nothing to shard"):  # under TP it is an error
        build_plan(torch.nn.Sequential(torch.nn.Linear(4, 4)), tp_size=2, world=2, rank=0)


# ----- dimension checks ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(world=1, rank=0, tp=2), ShardingError, "needs 2 ranks"),
    (dict(world=3, rank=0, tp=2), ShardingError, "tp sizes that fit a world of 3: 1, 3"),
    (dict(world=4, rank=0, tp=2, ep=4, max_ep=8), ParallelismNotSupportedError,
     r"ep_size=4 with tp_size=2 and 2 data-parallel replicas.*ep sizes that would work: 1, 2 "
     r"\(or tp_size=1"),
    (dict(world=8, rank=0, tp=2, pp=2, dp=4), ShardingError,
     r"2 × 2 × 4 = 16, not the world of 8 ranks; .*dp_size would be 2 \(or launch 16 ranks\)"),
    (dict(world=1, rank=0, ep=2), ShardingError,
     r"ep_size=2 needs 2 ranks .*this process runs alone.*torchrun --nproc-per-node 2"),
    (dict(world=4, rank=0, tp=4, ep=3), ShardingError,
     "ep_size=3 must divide tp × dp = 4.*ep sizes that would work: 1, 2, 4"),
    (dict(world=6, rank=0, tp=4, pp=1, dp=1), ShardingError,
     r"tp_size=4 does not divide the world of 6.*would .*: 1, 2, 3, 6"),
    (dict(world=4, rank=0, tp=2, dp=3), ShardingError, r"2 × 3 = 6, not the world of 4"),
    (dict(world=4, rank=0, tp=2, dp=0), ConfigError, "dp_size must be an integer >= 1"),
    (dict(world=2, rank=0, tp=0), ConfigError, "tp_size must be an integer >= 1"),
    (dict(world=2, rank=2, tp=2), ConfigError, "rank 2 is not a rank of a world of 2"),
])
def test_bad_sizes_are_named_with_the_sizes_that_would_work(kwargs, error, match):
    with pytest.raises(error, match=match):
        check_dims(**kwargs)


def test_not_supported_yet_is_a_sharding_and_a_config_error():
    assert issubclass(ParallelismNotSupportedError, ShardingError)
    assert issubclass(ParallelismNotSupportedError, NotSupportedYetError)
    assert issubclass(ParallelismNotSupportedError, ConfigError)


@pytest.mark.parametrize("tp, rank, coords", [
    (1, 1, dict(dp=(2, 1), tp=(1, 0), ep=(2, 1))),  # ep alone: dense parts replicated
    (2, 1, dict(dp=(1, 0), tp=(2, 1), ep=(2, 1))),  # ep with tp: heads by tp, experts by ep
])
def test_expert_parallelism_is_carved_out_of_the_worlds_ranks(tp, rank, coords):
    dims = check_dims(world=2, rank=rank, tp=tp, ep=2)
    assert {n: (dims[n].size, dims[n].coord) for n in coords} == coords


@pytest.mark.parametrize("tp", [1, 4])
def test_an_ep_group_smaller_than_the_world_makes_several_expert_groups(tp):
    """world 4, ep 2 (tp 4: heads over all 4; tp 1: dense parts replicated): expert groups of 2
    consecutive ranks, rank r holding ep coordinate r mod 2's experts (tests/test_moe_ep_groups.py
    runs them)."""
    for rank in range(4):
        plan = build_plan(_meta_model(_moe_config("mixtral")), moe=_moe(ep_size=2), world=4,
                          rank=rank, tp_size=tp)
        assert (plan.ep.size, plan.ep.coord) == (2, rank % 2)
        assert plan.experts.range == ((0, 2), (2, 4))[rank % 2]  # 4 experts over 2
        assert plan.dim_ranks("ep") == [(0, 1), (2, 3)]


@pytest.mark.parametrize("sizes, layout", [
    # world 8 = pp 2 × dp 2 × tp 2: rank = (pp_coord × dp + dp_coord) × tp + tp_coord
    (dict(tp=2, pp=2), dict(tp=[(0, 1), (2, 3), (4, 5), (6, 7)],
                            pp=[(0, 4), (1, 5), (2, 6), (3, 7)],
                            inputs=[(0, 1, 4, 5), (2, 3, 6, 7)])),
    # tp 2 × dp 4: four TP groups, each its own inputs
    (dict(tp=2), dict(tp=[(0, 1), (2, 3), (4, 5), (6, 7)],
                      inputs=[(0, 1), (2, 3), (4, 5), (6, 7)])),
    # pp 2 × dp 4 (tp 1): four pipelines of two stages
    (dict(pp=2), dict(pp=[(0, 4), (1, 5), (2, 6), (3, 7)],
                      inputs=[(0, 4), (1, 5), (2, 6), (3, 7)])),
])
def test_data_parallel_replicas_are_groups_of_their_own(sizes, layout):
    """Replicas of a TP group or of a pipeline: every group (tp, pp, the engine's input
    broadcast) lies inside one replica; the replica of a rank is its dp coordinate's ranks."""
    model = tiny_causal_lm("llama")
    pipeline = (shardwise.pipeline.parse_pipeline({"pp_size": sizes["pp"]})
                if "pp" in sizes else None)
    for rank in range(8):
        plan = build_plan(model, world=8, rank=rank, tp_size=sizes.get("tp", 1),
                          pipeline=pipeline)
        tp, pp = sizes.get("tp", 1), sizes.get("pp", 1)
        assert plan.dp.size == 8 // (tp * pp) and plan.dp.coord == (rank // tp) % plan.dp.size
        for name, groups in layout.items():
            got = plan.input_ranks() if name == "inputs" else plan.dim_ranks(name)
            assert got == groups, name
        mine = [g for g in plan.input_ranks() if rank in g]
        assert len(mine) == 1 and all(
            (r // tp) % plan.dp.size == plan.dp.coord for r in mine[0])
        assert not plan.replicas_share_inputs


def test_explicit_dp_size_is_checked_against_the_world():
    model = tiny_causal_lm("llama")
    plan = build_plan(model, world=4, rank=3, tp_size=2, dp_size=2)
    assert (plan.tp.size, plan.dp.size, plan.dp.coord, plan.tp.coord) == (2, 2, 1, 1)
    with pytest.raises(ShardingError, match=r"2 × 2 × 3 = 12.*not the world of 4 ranks; .*"
                                            r"dp_size would be 1"):
        build_plan(model, world=4, rank=0, tp_size=2, dp_size=3,
                   pipeline=shardwise.pipeline.parse_pipeline({"pp_size": 2}))


@pytest.mark.parametrize("tp, ep, shared", [(1, 2, True), (1, 4, True), (2, 2, False),
                                            (4, 2, False)])
def test_replicas_share_inputs_only_when_their_ranks_form_expert_groups(tp, ep, shared):
    """tp 1 with ep: the expert groups span replicas, which then run on the same inputs (rank 0's,
    as before); under tp the expert group lies inside a tp group and replicas stay apart."""
    for rank in range(8):
        plan = build_plan(_meta_model(_moe_config("mixtral")), moe=_moe(ep_size=ep), world=8,
                          rank=rank, tp_size=tp)
        assert plan.replicas_share_inputs is shared
        assert plan.input_ranks() == ([tuple(range(8))] if shared else
                                      [tuple(range(g * tp, (g + 1) * tp))
                                       for g in range(8 // tp)])
        assert plan.ep.coord == rank % ep


def test_tp1_in_a_larger_world_is_independent_replicas_with_their_coordinates():
    dims = check_dims(world=4, rank=3, tp=1)
    assert (dims["dp"].size, dims["dp"].coord, dims["tp"].coord) == (4, 3, 0)
    assert all(d.group is None for d in dims.values())


# ----- engine.plan and the one lookup ------------------------------------------------------------

def test_engine_plan_is_the_one_plan_and_the_policy_is_looked_up_once(monkeypatch):
    import shardwise.plan
    import shardwise.policy

    calls = []
    real = shardwise.policy.policy_for

    def counting(model):
        calls.append(type(model).__name__)
        return real(model)
    monkeypatch.setattr(shardwise.policy, "policy_for", counting)
    monkeypatch.setattr(shardwise.plan, "policy_for", counting)
    model = tiny_causal_lm("llama")
    engine = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True)
    assert calls == ["LlamaForCausalLM"]
    assert engine.plan.policy.name == "llama" and engine.plan.tp.size == 1
    assert "Plan(world=1" in repr(engine.plan)
    logits = engine(prompt_ids()).logits
    assert torch.isfinite(logits).all()


def test_quantization_reads_the_plan_and_looks_nothing_up(monkeypatch):
    """With quant (inject on too), the policy is looked up once, by the plan; quantization takes
    the plan's roles — and when the plan has none (no plan fits), every linear but the head,
    saying why, without choosing a plan again."""
    import shardwise.plan
    import shardwise.policy
    import shardwise.quant.transform as quant_transform

    calls = []
    real = shardwise.policy.policy_for

    def counting(model):
        calls.append(type(model).__name__)
        return real(model)

    chosen = []

    def no_second_choice(*args, **kwargs):  # (quant_targets catches what a choice raises)
        chosen.append(args)
        raise AssertionError("quantization chose a plan again")
    monkeypatch.setattr(shardwise.policy, "policy_for", counting)
    monkeypatch.setattr(shardwise.plan, "policy_for", counting)
    monkeypatch.setattr(quant_transform, "choose_plan", no_second_choice)
    quant = {"weight": {"num_bits": 8}}
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu", quant=quant,
                                      replace_with_kernel_inject=True)
    assert calls == ["LlamaForCausalLM"]
    assert engine.quantization.layers and engine.plan.roles is not None

    def no_roles(plan, model, found):
        plan.roles, plan.roles_source = None, "no tensor-parallel plan fits the model: test"
    monkeypatch.setattr(shardwise.plan, "_roles_at_one_rank", no_roles)
    model = tiny_causal_lm("llama")
    engine = shardwise.init_inference(model, device="cpu", quant=quant)
    linears = [n for n, m in model.named_modules() if type(m).__name__ == "QuantLinear"]
    assert engine.plan.roles is None and linears and not chosen
    assert engine.quantization.source == "all linears (no tensor-parallel plan fits the model: test)"


# ----- two ranks: the bound plan, and sharding undone by all-gathers -----------------------------

def _two_ranks(rank: int) -> dict:
    from shardwise.communicator import create_communicator
    from shardwise.ledger import Ledger
    from shardwise.sharding import shard_model

    model = tiny_causal_lm("llama")
    ids = prompt_ids()
    with torch.no_grad():
        before = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sizes = {n: (m.in_features, m.out_features) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    attrs = {n: dict(vars(m)).get("num_key_value_groups") for n, m in model.named_modules()
             if n.endswith("self_attn")}
    comm = create_communicator(shardwise.get_accelerator("cpu"))
    ledger = Ledger(model)
    with ledger.recording():
        report = shard_model(model, communicator=comm)
    sharded_shape = tuple(model.model.layers[0].self_attn.q_proj.weight.shape)
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    # as engine.close() does: the snapshot lets go of the replaced weights, so the recorded
    # undos (all-gathers) are what rebuilds them
    dropped = ledger.drop_replaced()
    ledger.give_back()
    with torch.no_grad():
        after = model(ids).logits
    same = all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    out = {
        "dropped": dropped, "undos": len([u for u in ledger.undos if "all-gathered" in u]),
        "sharded_shape": sharded_shape, "hooks_while_sharded": hooks,
        "hooks_after": sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
                           for m in model.modules()),
        "weights_equal": same,
        "sizes_equal": sizes == {n: (m.in_features, m.out_features)
                                 for n, m in model.named_modules()
                                 if isinstance(m, torch.nn.Linear)},
        "attrs_equal": attrs == {n: dict(vars(m)).get("num_key_value_groups")
                                 for n, m in model.named_modules() if n.endswith("self_attn")},
        "logits_equal": torch.equal(before, after), "sharded_modules": len(report.sharded),
        "marker_gone": not hasattr(model, "_shardwise_shard_report"),
    }
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                      tensor_parallel={"tp_size": 2})
    plan = engine.plan
    out["plan"] = (plan.tp.size, plan.tp.coord, plan.tp.group is engine.communicator,
                   plan.heads.q_range, plan.sharding.tp_size)
    return out


def test_two_ranks_bind_the_tp_group_and_sharding_undoes_by_gathering(tmp_path):
    results = run_ranks(_two_ranks, 2, tmp_path, deadline_s=240)
    for rank, result in enumerate(results):
        assert result["ok"], result.get("trace") or result["error"]
        value = result["value"]
        assert value["dropped"] > 0 and value["undos"] == value["sharded_modules"]
        assert value["sharded_shape"] == [32, 64] and value["hooks_while_sharded"] > 0
        assert value["hooks_after"] == 0
        assert value["weights_equal"] and value["sizes_equal"] and value["attrs_equal"]
        assert value["logits_equal"] and value["marker_gone"]
        assert value["plan"] == [2, rank, True, [2 * rank, 2 * rank + 2], 2]


# ----- the cast's recorded undo ------------------------------------------------------------------

def test_cast_and_move_records_a_cast_back_that_says_it_is_lossy():
    from shardwise.ledger import Ledger
    from shardwise.transforms import cast_and_move

    model = tiny_causal_lm("llama")
    weight = model.lm_head.weight
    original = weight.detach().clone()
    ints = {n: b.dtype for n, b in model.named_buffers() if not b.is_floating_point()}
    ledger = Ledger(model)
    with ledger.recording():
        cast_and_move(model, torch.device("cpu"), torch.bfloat16)
    [what] = ledger.undos
    assert "lossy" in what and "float32 -> bfloat16" in what
    assert weight.dtype == torch.bfloat16 and model.config.dtype == torch.bfloat16
    assert ledger.drop_replaced() > 0  # as init_inference does: one copy of the weights
    ledger.give_back()  # the undo casts back from what the model holds now
    assert weight.dtype == torch.float32 and model.lm_head.weight is weight
    assert model.config.dtype == torch.float32
    assert torch.equal(weight, original.bfloat16().float())  # the rounding stays
    assert {n: b.dtype for n, b in model.named_buffers() if not b.is_floating_point()} == ints


def test_a_widening_cast_back_is_not_called_lossy():
    from shardwise.ledger import Ledger
    from shardwise.transforms import cast_and_move

    model = tiny_causal_lm("llama", dtype=torch.bfloat16)
    ledger = Ledger(model)
    with ledger.recording():
        cast_and_move(model, torch.device("cpu"), torch.float32)
    [what] = ledger.undos
    assert "lossy" not in what and "float32" in what


# ----- no import-time cycle --------------------------------------------------------------------

_IMPORT_EACH_FIRST = textwrap.dedent("""
    import importlib, pkgutil, sys
    import torch, transformers  # third-party, loaded once: only shardwise is re-imported
    import shardwise

    def shardwise_modules():
        out = []
        for info in pkgutil.walk_packages(shardwise.__path__, "shardwise."):
            if not info.name.endswith("__main__"):  # runs the CLI when imported
                out.append(info.name)
        return sorted(out)

    names = shardwise_modules()
    failures = []
    for name in names:
        for key in [k for k in sys.modules if k == "shardwise" or k.startswith("shardwise.")]:
            del sys.modules[key]
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("shardwise"):
                continue  # an optional third-party runtime (a device's), not a cycle
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    print(len(names))
    print("\\n".join(failures))
""")


def test_every_module_imports_first_in_a_fresh_package():
    """Each shardwise module imported first (the package's modules cleared before each): a
    cycle shows up as a module that needs another one half-initialised."""
    run = subprocess.run([sys.executable, "-c", _IMPORT_EACH_FIRST], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    count, *failures = run.stdout.strip().split("\n")
    assert int(count) > 40
    assert [f for f in failures if f] == []


def _module_level_imports(path) -> set[str]:
    """The shardwise modules a file imports at module level (not inside functions or
    ``if TYPE_CHECKING``), as absolute names."""
    import ast

    tree = ast.parse(path.read_text())
    package = "shardwise" + ("." + ".".join(path.parent.relative_to(_CORE).parts)
                             if path.parent != _CORE else "")
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {n for n in out if n.startswith("shardwise")}


_CORE = __import__("pathlib").Path(shardwise.__file__).parent


def test_policy_and_sharding_do_not_import_each_other_and_layout_is_a_leaf():
    policy = _module_level_imports(_CORE / "policy.py")
    assert not any(n.startswith("shardwise.sharding") for n in policy), policy
    for path in (_CORE / "sharding").glob("*.py"):
        imports = _module_level_imports(path)
        assert not any(n.startswith(("shardwise.policy", "shardwise.plan")) for n in imports), (
            path.name, imports)
    layout = _module_level_imports(_CORE / "layout.py")
    assert layout <= {"shardwise.errors", "shardwise.errors.ConfigError"}, layout


# ----- Mixture-of-Experts facts and the moe= checks ----------------------------------------------

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
#: name → (config class, its MoE settings, expected (experts, top-k, shared, MoE layers))
_MOE_CONFIGS = {
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, num_local_experts=4,
                                      num_experts_per_tok=2), (4, 2, 0, (0, 1))),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_hidden_layers=4, num_experts=6,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=64,
                                         decoder_sparse_step=2, mlp_only_layers=[3]),
                  (6, 2, 1, (1,))),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         mlp_only_layers=[0]), (8, 2, 0, (1, 2))),
    "deepseek_v3": ("DeepseekV3Config", dict(num_hidden_layers=3, n_routed_experts=8,
                                             num_experts_per_tok=2, n_shared_experts=1,
                                             moe_intermediate_size=32, first_k_dense_replace=1,
                                             n_group=2, topk_group=1, q_lora_rank=32,
                                             kv_lora_rank=16, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16),
                    (8, 2, 1, (1, 2), (2, 1))),
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=2, num_local_experts=4,
                                     num_experts_per_tok=2, head_dim=16,
                                     layer_types=["sliding_attention", "full_attention"]),
                (4, 2, 0, (0, 1))),
}


def _moe_config(name: str):
    import transformers
    cls, extra, _ = _MOE_CONFIGS[name]
    return getattr(transformers, cls)(**{**_TINY, **extra})


def _meta_model(config):
    """The model's structure without weights (the plan reads only the config and modules)."""
    import transformers
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", sorted(_MOE_CONFIGS))
def test_moe_facts_are_read_from_each_familys_config_and_match_its_layers(name):
    model = _meta_model(_moe_config(name))
    plan = build_plan(model)
    total, top_k, shared, layers, *groups = _MOE_CONFIGS[name][2]
    e = plan.experts
    assert (e.total, e.top_k, e.shared, e.moe_layers) == (total, top_k, shared, layers)
    assert e.groups == (groups[0] if groups else None)  # DeepSeek's group-limited top-k
    assert (e.range, e.ranges) == ((0, total), ((0, total),))
    # the layers the facts call MoE are the ones HF built with routed experts
    built = tuple(i for i, layer in enumerate(model.model.layers)
                  if hasattr(getattr(layer, "mlp", None), "experts"))
    assert built == layers
    assert f"experts: {total} per layer, top-{top_k}" in repr(plan)
    assert f", {shared} shared, {len(layers)} MoE layers; this rank [0, {total})" in repr(plan)


def test_a_dense_model_has_no_expert_plan():
    assert build_plan(tiny_causal_lm("llama")).experts is None


@pytest.mark.parametrize("total, ep, sizes", [
    (10, 4, (3, 3, 2, 2)), (8, 2, (4, 4)), (3, 3, (1, 1, 1)), (7, 1, (7,))])
def test_experts_split_plus_minus_one_over_the_ep_ranks(total, ep, sizes):
    from shardwise.plan import Dim, ExpertPlan, split_experts
    from shardwise.policy import MoEFacts
    ranges = split_experts(total, ep)
    assert tuple(b - a for a, b in ranges) == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(ranges[r][1] == ranges[r + 1][0] for r in range(ep - 1))
    last = ExpertPlan.compute(MoEFacts(total, 2, 0, (0,)), Dim("ep", ep, ep - 1))
    assert last.range == ranges[-1] and last.ranges == ranges


def _moe(**kwargs):
    from shardwise.config import InferenceConfig
    return InferenceConfig.build(moe=kwargs or True).moe


@pytest.mark.parametrize("name, moe, world, error, match", [
    ("mixtral", dict(ep_size=8), 8, ShardingError,
     "ep_size=8 is larger than the 'mixtral' model's 4 experts.*would work here: 1, 2, 4"),
    ("mixtral", dict(ep_size=3), 4, ShardingError,
     "ep_size=3 must divide tp × dp = 4.*ep sizes that would work: 1, 2, 4$"),
    ("mixtral", dict(ep_size=3), 8, ShardingError,  # 8 divides 8, but the model has 4 experts
     "ep_size=3 must divide tp × dp = 8.*ep sizes that would work: 1, 2, 4$"),
    ("mixtral", dict(moe_experts=[8]), 1, ConfigError,
     r"moe_experts=\[8\] but the 'mixtral' model has 4 experts per MoE layer; give "
     r"moe_experts=4"),
    ("mixtral", dict(type="residual"), 1, ConfigError,
     "type='residual' does not match the 'mixtral' model: it has no shared expert, a "
     "'standard' MoE; give type='standard'"),
    ("qwen2_moe", dict(type="standard"), 1, ConfigError,
     r"type='standard' does not match the 'qwen2_moe' model: it has 1 shared expert\(s\), a "
     r"'residual' MoE"),
])
def test_bad_moe_input_gets_its_own_error_before_not_supported_yet(name, moe, world, error,
                                                                    match):
    from shardwise.config import MoEConfigError
    with pytest.raises(error, match=match) as info:
        build_plan(_meta_model(_moe_config(name)), moe=_moe(**moe), world=world, rank=0)
    if error is ConfigError:
        assert isinstance(info.value, MoEConfigError)


def test_moe_on_a_dense_model_names_the_model_type():
    from shardwise.config import MoEConfigError
    with pytest.raises(MoEConfigError, match="is for Mixture-of-Experts models, but the 'llama' "
                                             "model has no experts.*remove moe="):
        build_plan(tiny_causal_lm("llama"), moe=_moe())
    with pytest.raises(MoEConfigError, match="ep_size=2 is for Mixture-of-Experts"):
        build_plan(tiny_causal_lm("llama"), ep_size=2, world=2, rank=0)


def test_matching_moe_settings_build_the_plan():
    plan = build_plan(_meta_model(_moe_config("qwen2_moe")),
                      moe=_moe(ep_size=1, moe_experts=6, type="residual"))
    assert plan.ep.size == 1 and plan.experts.total == 6 and plan.experts.shared == 1


def test_init_inference_with_moe_ep1_leaves_a_tiny_mixtral_exact():
    import transformers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_moe_config("mixtral")).eval()
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    engine = shardwise.init_inference(model, moe={"ep_size": 1}, device="cpu")
    assert engine.plan.experts.ranges == ((0, 4),)
    with torch.no_grad():
        assert torch.equal(engine(input_ids=ids).logits, expected)


def test_bad_moe_fails_init_inference_before_any_work():
    from shardwise.config import MoEConfigError
    model = tiny_causal_lm("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MoEConfigError, match="'llama' model has no experts"):
        shardwise.init_inference(model, moe={"ep_size": 1}, device="cpu")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ----- expert parallelism: the experts modules split by whole experts ---------------------------

@pytest.mark.parametrize("name", sorted(_MOE_CONFIGS))
@pytest.mark.parametrize("tp", [1, 2])
def test_ep2_splits_every_experts_module_by_whole_experts(name, tp):
    model = _meta_model(_moe_config(name))
    total, _, _, layers, *_ = _MOE_CONFIGS[name][2]
    first = -(-total // 2)
    for rank in (0, 1):
        plan = build_plan(model, tp_size=tp, moe=_moe(ep_size=2), world=2, rank=rank)
        assert plan.ep.size == 2 and plan.ep.coord == rank and plan.tp.size == tp
        assert plan.experts.range == ((0, first), (first, total))[rank]
        shards = plan.shards
        assert shards is plan.sharding and shards.ep_size == 2 and shards.ep_coord(rank) == rank
        assert [s.name for s in shards.experts] == [f"model.layers.{i}.mlp.experts"
                                                    for i in layers]
        spec = shards.experts[0]
        assert spec.ranges == ((0, first), (first, total))
        params = dict(spec.module.named_parameters(recurse=False))
        assert set(spec.params) == set(params)  # GPT-OSS's biases [E, X] too
        assert all(p.shape[0] == total for p in params.values())
        if tp == 1:  # the dense parts stay whole on both ranks
            assert shards.specs == [] and shards.tp_size == 1
        else:
            assert shards.specs and shards.tp_size == 2
    assert "experts modules: " in repr(plan) and "split over 2 ep ranks" in repr(plan)


def test_expert_param_ranges_are_the_ep_ranks_experts_for_loaders():
    from shardwise.sharding.specs import expert_param_ranges
    plan = build_plan(_meta_model(_moe_config("gpt_oss")), moe=_moe(ep_size=2), world=2, rank=1)
    spec = plan.shards.experts[0]
    assert expert_param_ranges(spec, 1) == {p: (0, [(2, 4)]) for p in spec.params}
    assert "gate_up_proj_bias" in spec.params


def test_without_expert_parallelism_nothing_is_split_at_tp1():
    plan = build_plan(_meta_model(_moe_config("mixtral")), moe=_moe(), world=1, rank=0)
    assert plan.shards is None and not plan.ep.enabled


def test_an_experts_module_that_does_not_hold_whole_experts_is_named():
    from shardwise.sharding.specs import prepare_experts
    model = _meta_model(_moe_config("mixtral"))
    experts = model.model.layers[1].mlp.experts
    experts.scale = torch.nn.Parameter(torch.ones(3, device="meta"))  # dim 0 is not the experts
    with pytest.raises(ShardingError, match=r"experts module 'model.layers.1.mlp.experts' "
                                            r"\(MixtralExperts\) cannot be split by whole "
                                            r"experts.*scale \(3,\)"):
        prepare_experts(model, None, 4, (0, 1), ((0, 2), (2, 4)))
    with pytest.raises(ShardingError, match=r"one experts module per MoE layer \(3 layers"):
        prepare_experts(_meta_model(_moe_config("mixtral")), None, 4, (0, 1, 2),
                        ((0, 2), (2, 4)))

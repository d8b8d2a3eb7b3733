"""InferenceConfig: DeepSpeed names accepted, every field used or rejected, one merge rule."""

import json

import pytest
import torch

import shardwise
from shardwise.config import NOT_YET_SUPPORTED, InferenceConfig, parse_dtype


@pytest.mark.parametrize("spelling,expected", [
    (torch.float16, torch.float16), ("fp16", torch.float16), ("half", torch.float16),
    ("torch.bfloat16", torch.bfloat16), ("BF16", torch.bfloat16), ("float32", torch.float32),
    ("auto", "auto"), (None, None)])
def test_dtype_spellings(spelling, expected):
    assert parse_dtype(spelling) == expected


def test_bad_dtype_lists_the_valid_names():
    with pytest.raises(shardwise.ConfigError, match="bf16.*fp16"):
        InferenceConfig.build(dtype="float8")


def test_deepspeed_aliases_map_onto_fields():
    cfg = InferenceConfig.build(mp_size=1, enable_cuda_graph=False, max_out_tokens=1024,
                                tensor_parallel={"tp_size": 1, "enabled": True})
    assert (cfg.tp_size, cfg.enable_graph, cfg.max_tokens) == (1, False, 1024)
    assert InferenceConfig.build(data_parallel_size=2).dp_size == 2
    assert InferenceConfig.build().dp_size is None  # the world's remainder


def test_tensor_parallel_spellings_agree():
    for kwargs in ({"mp_size": 2}, {"tensor_parallel": {"tp_size": 2}}, {"tp_size": 2},
                   {"tensor_parallel": 2}):
        assert InferenceConfig.build(**kwargs).tp_size == 2
    assert InferenceConfig.build(tensor_parallel={"tp_size": 2, "enabled": False}).tp_size == 1


def test_unknown_field_suggests_the_closest_name():
    with pytest.raises(shardwise.ConfigError, match="did you mean 'replace_with_kernel_inject'"):
        InferenceConfig.build(replace_with_kernel_injection=True)
    with pytest.raises(shardwise.ConfigError, match="unknown tensor_parallel field"):
        InferenceConfig.build(tensor_parallel={"tp": 2})


def test_an_unlanded_feature_is_rejected_by_name(monkeypatch):
    # every feature has landed today; the table stays for the next one
    monkeypatch.setitem(NOT_YET_SUPPORTED, "max_tokens", "the static KV cache")
    with pytest.raises(shardwise.NotSupportedYetError,
                       match="max_tokens=64 asks for the static KV cache.*not support yet"):
        InferenceConfig.build(max_out_tokens=64)
    assert InferenceConfig.build().max_tokens == 1024  # the default is never rejected


def test_config_file_and_kwargs_merge(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"dtype": "bf16", "device": "cpu"}))
    cfg = InferenceConfig.build(str(path), dtype=torch.bfloat16, comm_timeout=30)
    assert (cfg.device, cfg.dtype, cfg.comm_timeout) == ("cpu", torch.bfloat16, 30)


def test_config_and_kwarg_disagreeing_is_an_error(tmp_path):
    with pytest.raises(shardwise.ConfigError, match="'dtype' is .* in the config but .* keyword"):
        InferenceConfig.build({"dtype": "fp16"}, dtype="bf16")
    with pytest.raises(shardwise.ConfigError, match="given twice"):
        InferenceConfig.build(mp_size=1, tensor_parallel={"tp_size": 2})


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens": 0}, "positive integer"), ({"tp_size": 1.5}, "positive integer"),
    ({"enable_graph": "yes"}, "must be bool"), ({"device": 3}, "must be str or None"),
    ({"comm_timeout": -1}, "positive, finite number of seconds"),
    ({"dp_size": 0}, r"dp_size must be a positive integer .*world = pp_size × tp_size × dp_size"),
    ({"dp_size": True}, "dp_size must be a positive integer"),
    ({"fuse_projections": "no"}, "fuse_projections must be bool or None"),
    ({"fuse_projections": False}, "fuse_projections=False fuses .* needs replace_with_kernel")])
def test_malformed_values(kwargs, match):
    with pytest.raises(shardwise.ConfigError, match=match):
        InferenceConfig.build(**kwargs)


def test_config_file_errors(tmp_path):
    with pytest.raises(shardwise.ConfigError, match="does not exist"):
        InferenceConfig.build(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(shardwise.ConfigError, match="not valid JSON"):
        InferenceConfig.build(str(bad))


# ----- moe= (DeepSpeed's DeepSpeedMoEConfig names) -------------------------------------------------

def test_moe_accepts_deepspeeds_names_and_spellings():
    from shardwise.config import MoESettings
    cfg = InferenceConfig.build(moe={"enabled": True, "ep_size": 2, "moe_experts": [8],
                                     "type": "standard", "ep_mp_group": None, "ep_group": None})
    assert cfg.moe == MoESettings(ep_size=2, num_experts=(8,), type="standard")
    alias = InferenceConfig.build(moe={"num_experts": 8, "moe_type": "residual"}).moe
    assert alias == MoESettings(ep_size=1, num_experts=(8,), type="residual")
    assert InferenceConfig.build(moe=True).moe == MoESettings()
    for off in (None, False, {"enabled": False}):
        assert InferenceConfig.build(moe=off).moe is None
    again = InferenceConfig.build(cfg)  # an InferenceConfig round-trips through build
    assert again.moe == cfg.moe and cfg.to_dict()["moe"]["ep_size"] == 2


def test_moe_dispatch_is_auto_unless_named():
    assert InferenceConfig.build(moe={"ep_size": 2}).moe.dispatch == "auto"
    assert InferenceConfig.build(moe={"dispatch": "auto"}).moe.dispatch == "auto"
    for name in ("all_reduce", "all_to_all", "auto"):
        assert InferenceConfig.build(moe={"ep_size": 2, "dispatch": name}).moe.dispatch == name


def test_moe_in_the_config_and_as_a_keyword_merge_by_meaning():
    same = InferenceConfig.build({"moe": {"ep_size": 2}}, moe={"enabled": True, "ep_size": 2})
    assert same.moe.ep_size == 2
    with pytest.raises(shardwise.ConfigError, match="'moe' is .*ep_size=2.* in the config but "
                                                    ".*ep_size=4.* as a keyword"):
        InferenceConfig.build({"moe": {"ep_size": 2}}, moe={"ep_size": 4})


@pytest.mark.parametrize("moe,match", [
    ({"ep_group": object()}, "ep_group= takes a process group; shardwise makes its "
                             "expert-parallel groups itself.*remove ep_group and give ep_size"),
    ({"expert_group": object()}, "remove expert_group"),
    ({"ep_mp_group": object()}, "remove ep_mp_group"),
    ({"ep_size": 0}, "moe ep_size must be a positive integer, got 0"),
    ({"ep_size": True}, "moe ep_size must be a positive integer"),
    ({"type": "pyramid"}, "moe type must be one of standard, residual, got 'pyramid'"),
    ({"moe_experts": [8, 0]}, r"moe_experts \(num_experts\) must be a positive integer"),
    ({"ep_sz": 2}, r"unknown moe field\(s\) \['ep_sz'\]; valid: .*'ep_size'"),
    ({"enabled": False, "ep_size": 2}, "enabled=False but sets other fields"),
    ({"moe_experts": 8, "num_experts": 4}, "given twice with different values"),
    ({"dispatch": "alltoall"}, "moe dispatch must be one of auto, all_reduce, all_to_all, got "
                               "'alltoall'"),
    ({"dispatch": "all_to_all"}, "dispatch='all_to_all' says how the ranks of an expert-parallel "
                                 "group .* ep_size=1 has no such group; give ep_size > 1"),
    ("ep2", "moe must be True, None or a dict"),
])
def test_malformed_moe_is_a_named_config_error(moe, match):
    from shardwise.config import MoEConfigError
    with pytest.raises(MoEConfigError, match=match):
        InferenceConfig.build(moe=moe)
    assert issubclass(MoEConfigError, shardwise.ConfigError)

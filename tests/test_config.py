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
    ({"comm_timeout": -1}, "positive, finite number of seconds")])
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

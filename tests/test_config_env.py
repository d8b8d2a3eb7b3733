"""Malformed config values, config files and torchrun/shardwise environment variables are each a
ConfigError naming the field or variable, the bad value and what is accepted (never a raw
TypeError/ValueError/AttributeError from deep inside), raised by ``InferenceConfig.build`` or
before any process group exists."""

from __future__ import annotations

import json
import math

import pytest
import torch

import shardwise
from shardwise.communicator import (DEFAULT_TIMEOUT_S, TIMEOUT_ENV, create_communicator,
                                    env_world, resolve_timeout, world_size_from_env)
from shardwise.config import SEED_RANGE, InferenceConfig
from shardwise.errors import ConfigError

RANK_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    """No timeout or rank variables inherited from the shell running the tests."""
    for name in (TIMEOUT_ENV, *RANK_VARS):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ----- comm_timeout and $SHARDWISE_COMM_TIMEOUT ------------------------------------------------

@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, False, -1, 0, "30"],
                         ids=repr)
def test_bad_comm_timeout_is_named(clean_env, value):
    with pytest.raises(ConfigError) as info:
        InferenceConfig.build(comm_timeout=value)
    message = str(info.value)
    assert message.startswith("comm_timeout must be a positive, finite number of seconds")
    assert message.endswith(f"got {value!r}")


def test_good_comm_timeouts_pass(clean_env):
    assert InferenceConfig.build(comm_timeout=0.5).comm_timeout == 0.5
    assert resolve_timeout(12) == 12.0 and resolve_timeout(None) == DEFAULT_TIMEOUT_S


@pytest.mark.parametrize("raw", ["abc", "nan", "inf", "-5", "0", "1e999"])
def test_bad_timeout_variable_is_named_at_build(clean_env, raw):
    clean_env.setenv(TIMEOUT_ENV, raw)
    with pytest.raises(ConfigError) as info:
        InferenceConfig.build()  # comm_timeout unset: the variable is what would be used
    assert f"{TIMEOUT_ENV}={raw!r} must be a positive, finite number" in str(info.value)
    assert "unset it" in str(info.value)
    # an explicit comm_timeout does not read the variable
    assert InferenceConfig.build(comm_timeout=9).comm_timeout == 9


def test_timeout_variable_is_read(clean_env):
    clean_env.setenv(TIMEOUT_ENV, " 2.5 ")
    assert resolve_timeout(None) == 2.5


# ----- seed ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [SEED_RANGE[0] - 1, SEED_RANGE[1] + 1, 2**70, True, 1.0, "7"],
                         ids=repr)
def test_seed_outside_what_torch_accepts_is_named(seed):
    with pytest.raises(ConfigError) as info:
        InferenceConfig.build(seed=seed)
    assert "seed must be None or an integer from -2**63 to 2**64 - 1" in str(info.value)
    assert str(info.value).endswith(f"got {seed!r}")


@pytest.mark.parametrize("seed", [SEED_RANGE[0], SEED_RANGE[1], 0, None])
def test_seed_bounds_are_torchs(seed):
    assert InferenceConfig.build(seed=seed).seed == seed
    if seed is not None:
        torch.manual_seed(seed)  # the accepted range is exactly torch's


# ----- config files -------------------------------------------------------------------------------

@pytest.mark.parametrize("content, kind", [("[1, 2]", "array"), ('"bf16"', "string"),
                                           ("3", "number"), ("null", "null"),
                                           ("true", "boolean")])
def test_config_file_holding_no_object_is_named(tmp_path, content, kind):
    path = tmp_path / "ds.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        InferenceConfig.build(str(path))
    message = str(info.value)
    assert f"config file {str(path)!r} holds a JSON {kind}" in message
    assert "one object of config fields" in message


def test_config_file_that_is_a_directory_or_binary(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        InferenceConfig.build(str(tmp_path))
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        InferenceConfig.build(binary)


def test_config_keys_must_be_strings():
    with pytest.raises(ConfigError, match="field names must be strings, got 1"):
        InferenceConfig.build({1: "cpu"})


def test_config_file_object_still_works(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"mp_size": 1, "seed": 3}))
    assert InferenceConfig.build(path).seed == 3


# ----- WORLD_SIZE / RANK / LOCAL_RANK / LOCAL_WORLD_SIZE --------------------------------------

@pytest.mark.parametrize("env, message", [
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' must be an integer >= 1"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be an integer >= 1"),
    ({"WORLD_SIZE": "2.0"}, "WORLD_SIZE='2.0' must be an integer >= 1"),
    ({"WORLD_SIZE": "2", "RANK": "x"}, "RANK='x' must be an integer >= 0"),
    ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK='-1' must be an integer >= 0"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is not a rank of WORLD_SIZE=2: ranks are 0 .. 1"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4 is more than WORLD_SIZE=2"),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"},
     "LOCAL_RANK=2 is not a local rank of LOCAL_WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "one"}, "LOCAL_RANK='one' must be an integer >= 0"),
])
def test_bad_rank_variables_are_named(clean_env, env, message):
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        env_world()
    assert message in str(info.value)
    # every path that reads them fails the same way, before any process group exists
    with pytest.raises(ConfigError, match=message.split(" ")[0]):
        world_size_from_env()
    with pytest.raises(ConfigError, match=message.split(" ")[0]):
        create_communicator(shardwise.get_accelerator("cpu"))
    assert not torch.distributed.is_initialized()


def test_tp_check_reports_a_bad_world_size_by_name(clean_env):
    clean_env.setenv("WORLD_SIZE", "many")
    with pytest.raises(ConfigError, match="WORLD_SIZE='many' must be an integer >= 1"):
        shardwise.init_inference(torch.nn.Linear(4, 4), device="cpu", tp_size=2)


def test_good_rank_variables(clean_env):
    assert env_world().world_size == 1 and world_size_from_env() == 1
    clean_env.setenv("RANK", "5")  # without WORLD_SIZE the process runs alone: not read
    assert env_world() == env_world({})
    for name, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1",
                        "LOCAL_WORLD_SIZE": "2"}.items():
        clean_env.setenv(name, value)
    world = env_world()
    assert (world.world_size, world.rank, world.local_rank, world.local_world_size) == (4, 3, 1, 2)

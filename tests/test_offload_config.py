"""offload= (ZeRO-Inference) settings: DeepSpeed's offload_param names parsed or refused by name,
the config round trip, and the checks against the machine and the model that run before the
engine changes (or writes) anything."""

from __future__ import annotations

import enum
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.accelerator import Accelerator
from shardwise.accelerators.cpu import CpuAccelerator
from shardwise.config import InferenceConfig
from shardwise.errors import ConfigError
from shardwise.offload.config import (OffloadConfig, OffloadError, check_offload,
                                      check_ring_fits, check_space, parse_offload)

GIB = 1 << 30


class DeviceMemoryDouble(Accelerator):
    """An accelerator with memory of its own (tensors of type ``meta`` stand for ones in it) whose
    free memory the test sets; records the device index it was asked about."""

    name = "double"
    device_type = "meta"

    def __init__(self, free: int = 64 * GIB) -> None:
        self.free = free
        self.asked: list[int] = []

    def free_memory(self, index: int = 0) -> int:
        self.asked.append(index)
        return self.free


class SilentMemoryDouble(Accelerator):
    """An accelerator with memory of its own that does not report its free memory."""

    name = "silent"
    device_type = "meta"


def _nvme(path, **extra) -> OffloadConfig:
    return parse_offload({"device": "nvme", "nvme_path": str(path), **extra})


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create files in: a read-only one, or (as root, who
    writes anywhere mode bits allow) sysfs, where file creation is refused to everyone."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        return ro
    return Path("/sys")


# ----- parse_offload: DeepSpeed's offload_param names ---------------------------------------------

def test_deepspeeds_names_are_read_into_the_settings(tmp_path):
    settings = parse_offload({"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3,
                              "pin_memory": False})
    assert settings == OffloadConfig("nvme", str(tmp_path), 3, False)
    assert parse_offload({"device": "cpu"}) == OffloadConfig("cpu", None, 4, True)  # defaults


def test_none_and_device_none_turn_offload_off():
    assert parse_offload(None) is None
    assert parse_offload({"device": "none"}) is None
    assert parse_offload({"device": "none", "buffer_count": 4, "nvme_path": None}) is None


def test_an_offload_config_is_validated_again_and_kept():
    settings = OffloadConfig("cpu", buffer_count=2)
    assert parse_offload(settings) == settings
    with pytest.raises(OffloadError, match="buffer_count must be an integer >= 2.*got 1"):
        parse_offload(OffloadConfig("cpu", buffer_count=1))  # built by hand, held to the rules


def test_deepspeeds_device_enum_and_path_objects_are_read(tmp_path):
    class OffloadDeviceEnum(str, enum.Enum):  # how DeepSpeed spells the device
        none = "none"
        nvme = "nvme"

    settings = parse_offload({"device": OffloadDeviceEnum.nvme, "nvme_path": tmp_path})
    assert (settings.device, settings.nvme_path) == ("nvme", str(tmp_path))
    assert type(settings.device) is str and type(settings.nvme_path) is str
    assert parse_offload({"device": OffloadDeviceEnum.none}) is None
    home = parse_offload({"device": "nvme", "nvme_path": "~/weights"}).nvme_path
    assert home == os.path.join(os.path.expanduser("~"), "weights")


@pytest.mark.parametrize("key,value,why", [
    ("buffer_size", 100_000_000, "sizes each ring slot from the largest unit"),
    ("max_in_cpu", 1_000_000_000, "keeps everything it does not stream"),
])
def test_deepspeed_keys_shardwise_does_not_take_are_refused_with_why(key, value, why):
    with pytest.raises(OffloadError, match=f"offload {key}={value} is DeepSpeed's.*{why}.*"
                                           f"Remove {key}"):
        parse_offload({"device": "cpu", key: value})
    assert parse_offload({"device": "cpu", key: None}) == OffloadConfig("cpu")  # nothing asked


def test_an_unknown_key_is_refused_listing_the_known_ones():
    with pytest.raises(OffloadError, match="unknown offload field 'ratio' \\(valid: device, "
                                           "nvme_path, buffer_count, pin_memory: DeepSpeed's"):
        parse_offload({"device": "cpu", "ratio": 0.5})
    with pytest.raises(OffloadError, match="unknown offload field 'path'; did you mean "
                                           "'nvme_path'\\? \\(valid: device, nvme_path"):
        parse_offload({"device": "nvme", "path": "/tmp"})


@pytest.mark.parametrize("value,match", [
    ("nvme", "offload must be None or a dict like .*got str 'nvme'"),
    (True, "offload must be None or a dict .*got bool True"),
    ({}, "offload needs a device: .*valid devices: cpu, nvme, none"),
    ({"device": "gpu"}, "offload device must be one of cpu, nvme or 'none' .*got 'gpu'"),
    ({"device": "nvme"}, "device 'nvme' keeps the weights in files under nvme_path: give "
                         "nvme_path=DIR"),
    ({"device": "nvme", "nvme_path": ""}, "nvme_path must be a directory path .*got ''"),
    ({"device": "nvme", "nvme_path": 3}, "nvme_path must be a directory path .*got 3"),
    ({"device": "cpu", "nvme_path": "/tmp"}, "nvme_path='/tmp' is used only by device 'nvme'.*"
                                             "Drop nvme_path, or set device='nvme'"),
    ({"device": "cpu", "buffer_count": 1}, "buffer_count must be an integer >= 2 .*got 1"),
    ({"device": "cpu", "buffer_count": 0}, "buffer_count must be an integer >= 2 .*got 0"),
    ({"device": "cpu", "buffer_count": True}, "buffer_count must be an integer >= 2 .*got True"),
    ({"device": "cpu", "buffer_count": 4.0}, "buffer_count must be an integer >= 2 .*got 4.0"),
    ({"device": "cpu", "buffer_count": "4"}, "buffer_count must be an integer >= 2 .*got '4'"),
    ({"device": "cpu", "pin_memory": 1}, "pin_memory must be True or False, got int 1"),
    ({"device": "cpu", "pin_memory": "yes"}, "pin_memory must be True or False, got str 'yes'"),
    ({"device": "none", "nvme_path": "/tmp"}, "says device='none' \\(no offload\\) but sets "
                                              "nvme_path; drop offload, or pick device"),
    ({"device": "none", "buffer_count": 8, "pin_memory": False},
     "but sets buffer_count, pin_memory;"),
])
def test_malformed_settings_are_refused_with_the_fix(value, match):
    with pytest.raises(OffloadError, match=match):
        parse_offload(value)


def test_offload_errors_are_config_errors():
    assert issubclass(OffloadError, ConfigError) and issubclass(OffloadError, ValueError)


# ----- InferenceConfig.offload --------------------------------------------------------------------

def test_the_config_field_and_its_deepspeed_alias_agree(tmp_path):
    spec = {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3}
    cfg = InferenceConfig.build(offload=spec)
    assert cfg.offload == OffloadConfig("nvme", str(tmp_path), 3, True)
    assert InferenceConfig.build(offload_param=spec).offload == cfg.offload
    assert InferenceConfig.build({"offload_param": spec}).offload == cfg.offload
    assert InferenceConfig.build().offload is None
    assert InferenceConfig.build(offload={"device": "none"}).offload is None


def test_the_config_round_trips_through_its_dict_and_itself(tmp_path):
    cfg = InferenceConfig.build(offload={"device": "nvme", "nvme_path": str(tmp_path),
                                         "pin_memory": False})
    plain = cfg.to_dict()
    assert plain["offload"] == {"device": "nvme", "nvme_path": str(tmp_path),
                                "buffer_count": 4, "pin_memory": False}
    assert InferenceConfig.build(plain).offload == cfg.offload
    assert InferenceConfig.build(cfg).offload == cfg.offload


def test_offload_in_the_config_and_as_a_keyword_merge_by_meaning():
    same = InferenceConfig.build({"offload": {"device": "cpu"}},
                                 offload_param=OffloadConfig("cpu", buffer_count=4))
    assert same.offload == OffloadConfig("cpu")
    with pytest.raises(ConfigError, match="'offload' is .*buffer_count=4.* in the config but "
                                          ".*buffer_count=2.* as a keyword"):
        InferenceConfig.build({"offload": {"device": "cpu"}},
                              offload={"device": "cpu", "buffer_count": 2})
    with pytest.raises(ConfigError, match="'offload' is given twice with different values"):
        InferenceConfig.build(offload={"device": "cpu"},
                              offload_param={"device": "cpu", "pin_memory": False})


@pytest.mark.parametrize("graph", [{"enable_graph": True}, {"enable_cuda_graph": True}])
def test_offload_with_graphs_is_left_to_the_init_check(graph):
    """Whether graphs go with offload depends on the accelerator's graph strategy (captured per
    layer, between the ring's waits): the config takes the pair, :func:`check_offload`
    decides; without injection, injection's message says graphs need it."""
    cfg = InferenceConfig.build(offload={"device": "cpu"}, replace_with_kernel_inject=True,
                                **graph)
    assert cfg.enable_graph and cfg.offload == OffloadConfig("cpu")
    with pytest.raises(ConfigError, match="needs replace_with_kernel_inject=True"):
        InferenceConfig.build(offload={"device": "cpu"}, **graph)


def test_bad_offload_in_the_config_is_refused_at_build():
    with pytest.raises(OffloadError, match="give nvme_path=DIR"):
        InferenceConfig.build(offload_param={"device": "nvme"})
    with pytest.raises(OffloadError, match="unknown offload field 'buffers'; did you mean "
                                           "'buffer_count'"):
        InferenceConfig.build({"offload": {"device": "cpu", "buffers": 3}})
    with pytest.raises(ConfigError, match="unknown keyword field 'offload_params'; did you mean "
                                          "'offload_param'"):
        InferenceConfig.build(offload_params={"device": "cpu"})


def test_validate_normalises_a_field_set_directly():
    cfg = InferenceConfig(offload={"device": "cpu", "buffer_count": 2})
    cfg.validate()
    assert cfg.offload == OffloadConfig("cpu", buffer_count=2)


# ----- the device fact ----------------------------------------------------------------------------

def test_only_the_cpu_computes_in_host_memory():
    from shardwise.accelerators.cuda import CudaAccelerator
    from shardwise.accelerators.hpu import HpuAccelerator

    assert CpuAccelerator.computes_in_host_memory is True
    assert Accelerator.computes_in_host_memory is False  # the default a plugin inherits
    assert CudaAccelerator.computes_in_host_memory is False
    assert HpuAccelerator.computes_in_host_memory is False


# ----- check_offload: the machine and the model, before any change -------------------------------

def _cpu_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))


def test_nvme_on_the_cpu_with_a_host_model_passes_and_leaves_nothing(tmp_path):
    check_offload(_nvme(tmp_path), CpuAccelerator(), _cpu_model(), torch.device("cpu"),
                  enable_graph=False)
    assert list(tmp_path.iterdir()) == []  # the write test's file is gone


def test_graphs_pass_the_check_with_the_default_strategy(tmp_path):
    check_offload(_nvme(tmp_path), CpuAccelerator(), None, torch.device("cpu"),
                  enable_graph=True)  # the default CPU strategy reads weights as inputs


@pytest.mark.parametrize("choice", ["frozen", "onednn", "inductor"])
def test_a_strategy_that_copies_the_weights_is_refused_naming_it(choice, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CPU_GRAPHS", choice)
    with pytest.raises(OffloadError, match="keeps its own copy of the weights in its captured "
                                           "code \\(weight_binding='copies'\\).*"
                                           "default graph strategy"):
        check_offload(_nvme(tmp_path), CpuAccelerator(), None, torch.device("cpu"),
                      enable_graph=True)
    monkeypatch.setenv("SHARDWISE_CPU_GRAPHS", "eager")  # captures nothing: nothing to refuse
    check_offload(_nvme(tmp_path), CpuAccelerator(), None, torch.device("cpu"),
                  enable_graph=True)


def test_a_missing_nvme_path_is_refused(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(OffloadError, match=f"nvme_path '{missing}' does not exist; create the "
                                           f"directory"):
        check_offload(_nvme(missing), CpuAccelerator(), None, torch.device("cpu"),
                      enable_graph=False)
    assert not missing.exists()  # refused, never created


def test_an_nvme_path_that_is_a_file_is_refused(tmp_path):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"x")
    with pytest.raises(OffloadError, match=f"nvme_path '{file}' is not a directory; give the "
                                           f"directory"):
        check_offload(_nvme(file), CpuAccelerator(), None, torch.device("cpu"),
                      enable_graph=False)


def test_an_unwritable_nvme_path_is_refused(tmp_path):
    ro = _unwritable_dir(tmp_path)
    with pytest.raises(OffloadError, match=f"nvme_path '{ro}' is not writable \\(.+\\); give a "
                                           f"directory this process can create files in"):
        check_offload(_nvme(ro), CpuAccelerator(), None, torch.device("cpu"),
                      enable_graph=False)


def test_the_cpu_tier_is_refused_where_compute_is_in_host_memory():
    with pytest.raises(OffloadError, match="the 'cpu' accelerator computes in host memory: the "
                                           "weights are already there. Use offload=.*'nvme'.*"
                                           "from disk, or drop offload"):
        check_offload(OffloadConfig("cpu"), CpuAccelerator(), _cpu_model(),
                      torch.device("cpu"), enable_graph=False)


def test_the_cpu_tier_streams_a_host_model_to_a_device_with_memory():
    check_offload(OffloadConfig("cpu"), DeviceMemoryDouble(), _cpu_model(),
                  torch.device("meta"), enable_graph=False)
    check_offload(OffloadConfig("cpu"), DeviceMemoryDouble(), None, torch.device("meta"),
                  enable_graph=False)  # built from a checkpoint


def test_a_model_wholly_on_the_device_is_refused():
    on_device = nn.Sequential(nn.Linear(256, 1024, device="meta"), nn.Linear(1024, 256,
                                                                              device="meta"))
    with pytest.raises(OffloadError, match="every parameter of the model is on meta already "
                                           "\\(2.00 MiB\\); load the model on the CPU .*or on the"
                                           " meta device with checkpoint="):
        check_offload(OffloadConfig("cpu"), DeviceMemoryDouble(), on_device,
                      torch.device("meta"), enable_graph=False)


def test_a_model_partly_on_the_device_is_streamed():
    partly = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, device="meta"))
    check_offload(OffloadConfig("cpu"), DeviceMemoryDouble(), partly, torch.device("meta"),
                  enable_graph=False)


def test_a_meta_model_on_the_cpu_is_the_checkpoint_start(tmp_path):
    # on a host-memory device, weights on meta (to come from checkpoint=) or on cpu both stream
    meta = nn.Linear(8, 8, device="meta")
    check_offload(_nvme(tmp_path), CpuAccelerator(), meta, torch.device("cpu"),
                  enable_graph=False)


def test_the_check_reads_any_spelling_and_nothing_is_nothing_to_check():
    with pytest.raises(OffloadError, match="computes in host memory"):
        check_offload({"device": "cpu"}, CpuAccelerator(), None, torch.device("cpu"),
                      enable_graph=False)
    for off in (None, {"device": "none"}):
        check_offload(off, CpuAccelerator(), None, torch.device("cpu"), enable_graph=True)


def test_the_check_holds_a_hand_built_config_to_the_rules():
    with pytest.raises(OffloadError, match="device 'nvme' keeps the weights in files under "
                                           "nvme_path"):
        check_offload(OffloadConfig("nvme"), CpuAccelerator(), None, torch.device("cpu"),
                      enable_graph=False)


# ----- check_space: the disk holds the repacked weights, checked before writing -------------------

def test_space_enough_passes(tmp_path):
    check_space(_nvme(tmp_path), 1 << 20)
    check_space(OffloadConfig("cpu"), 1 << 60)  # the cpu tier writes no files


def test_too_little_space_is_refused_with_both_sizes_before_writing(tmp_path):
    need = shutil.disk_usage(tmp_path).free + 3 * (1 << 40)  # 3 TiB more than there is
    with pytest.raises(OffloadError) as err:
        check_space(_nvme(tmp_path), need)
    text = str(err.value)
    assert f"nvme_path '{tmp_path}' has " in text and " GiB free, but the repacked" in text
    assert f"weights need {need / GIB:.2f} GiB ({need} bytes): free space there or pick " \
           f"another nvme_path" in text
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_space_on_a_missing_path_is_refused(tmp_path):
    with pytest.raises(OffloadError, match="does not exist"):
        check_space(_nvme(tmp_path / "gone"), 1)


# ----- check_ring_fits: K slots of the largest unit in the device's free memory ------------------

def test_a_ring_that_fits_passes_and_asks_the_device_it_runs_on():
    acc = DeviceMemoryDouble(free=4 * GIB)
    check_ring_fits(acc, torch.device("cuda", 1), "model.layers.0", GIB, 4)  # exactly fits
    assert acc.asked == [1]


def test_a_ring_too_large_is_refused_naming_the_largest_unit_and_bytes():
    acc = DeviceMemoryDouble(free=3 * GIB)
    with pytest.raises(OffloadError) as err:
        check_ring_fits(acc, torch.device("meta"), "model.layers.7", GIB + 4096, 3)
    text = str(err.value)
    assert "the offload ring does not fit meta: 3 slots of the largest unit 'model.layers.7' " \
           in text
    assert f"(1.00 GiB, {GIB + 4096} bytes each) need 3.00 GiB ({3 * (GIB + 4096)} bytes) " \
           f"but 3.00 GiB ({3 * GIB} bytes) is free; lower buffer_count (at least 2)" in text
    assert acc.asked == [0]  # an unindexed device: device 0


def test_the_ring_check_skips_host_memory_and_silent_devices():
    check_ring_fits(CpuAccelerator(), torch.device("cpu"), "model.layers.0", 1 << 60, 4)
    check_ring_fits(SilentMemoryDouble(), torch.device("meta"), "model.layers.0", 1 << 60, 4)


"""Offload from ``checkpoint=`` under pipeline stages, in one process: what a stage writes and
under which identity (the 2-rank load itself is in tests/test_pipeline_compose.py).

* :func:`shardwise.offload.stages.replaced_modules` / :func:`stage_units`: a stage's units are
  its own modules (GPT-2's tied head, read by the first stage as its embedding's table, is not
  one of its units), renumbered from 0.
* The store's identity: both stages share one fingerprint (the split is in it) and each has
  a shard of its own (its stage and units); another split is another store group, listed as
  stale by the new one and never read; without stages the identity is what it was.
* The config accepts ``offload=`` with ``checkpoint=`` and ``pipeline_parallel``.
"""

from __future__ import annotations

from pathlib import Path

import torch

import shardwise
from models import tiny_causal_lm
from shardwise.moe.block import decoder_layers
from shardwise.offload.checkpoint import checkpoint_fingerprint, checkpoint_units
from shardwise.offload.stages import replaced_modules, stage_identity, stage_units
from shardwise.offload.store import DiskStore, layout_unit
from shardwise.pipeline.stages import StagePlan
from shardwise.policy import policy_for


def _stages(bounds, coord: int, tied: bool) -> StagePlan:
    return StagePlan(bounds=tuple(bounds), coord=coord, ranks=tuple(range(len(bounds))),
                     costs=(0,) * len(bounds), source="split", tied=tied)


class _Desc:
    """The checkpoint description's fields the fingerprint reads."""

    def __init__(self, folder: Path) -> None:
        self.source = folder
        self.files = sorted(folder.glob("*.safetensors"))


def _units(model, stages):
    layers = decoder_layers(model, policy_for(model))
    replaced = replaced_modules(model, layers, stages)
    return replaced, stage_units(checkpoint_units(model, policy_for(model)), replaced)


def test_each_stage_writes_only_its_own_modules_tied_head_included():
    model = tiny_causal_lm("gpt2")
    n = len(decoder_layers(model, policy_for(model)))
    bounds = [(0, 1), (1, n)]
    replaced0, first = _units(model, _stages(bounds, 0, tied=True))
    replaced1, last = _units(model, _stages(bounds, 1, tied=True))
    assert [u.name for u in first] == ["transformer.wte", "transformer.h.0"]
    assert [u.name for u in last] == [f"transformer.h.{i}" for i in range(1, n)] + ["lm_head"]
    assert [u.index for u in first] == list(range(len(first)))
    assert [u.index for u in last] == list(range(len(last)))
    assert "lm_head" in replaced0 and "transformer.wte" in replaced1  # kept by the other end
    assert "transformer.h.0" in replaced1 and "transformer.h.0" not in replaced0


def test_stages_share_a_fingerprint_have_own_shards_and_another_split_is_stale(tmp_path):
    folder = tmp_path / "ckpt"
    tiny_causal_lm("llama").save_pretrained(folder)
    model = tiny_causal_lm("llama")
    n = len(decoder_layers(model, policy_for(model)))
    assert n >= 2
    desc = _Desc(folder)

    def identity(bounds, coord):
        stages = _stages(bounds, coord, tied=False)
        _, units = _units(model, stages)
        return checkpoint_fingerprint(desc, dtype=torch.float32, rank=0, tp_size=1,
                                      units=units, stage=stage_identity(stages))

    split = [(0, 1), (1, n)]
    (fp0, shard0), (fp1, shard1) = identity(split, 0), identity(split, 1)
    assert fp0 == fp1 and "units" not in fp0 and fp0["pp"]["bounds"] == [list(b) for b in split]
    assert shard0 != shard1 and (shard0["stage"], shard1["stage"]) == (0, 1)
    assert shard0["units"] == ["model.embed_tokens", "model.layers.0"]
    (tmp_path / "blobs").mkdir()
    first, second = DiskStore(tmp_path / "blobs", fp0, shard0), \
        DiskStore(tmp_path / "blobs", fp1, shard1)
    assert first.group == second.group and first.path != second.path
    entry = layout_unit(0, "model.embed_tokens", [("weight", torch.ones(4, 8))])
    first.write_unit(entry, [torch.ones(4, 8)])
    first.finish([entry])  # a finished store of this split on disk
    assert first.complete([entry])
    other = [(0, n - 1), (n - 1, n)] if n > 2 else [(0, 2)]
    fp_other, shard_other = identity(other, 0)
    moved = DiskStore(tmp_path / "blobs", fp_other, shard_other)
    assert moved.group != first.group and first.group in moved.stale
    assert not moved.complete([entry])  # the old split's blobs are never taken


def test_without_stages_the_identity_is_unchanged(tmp_path):
    folder = tmp_path / "ckpt"
    tiny_causal_lm("llama").save_pretrained(folder)
    model = tiny_causal_lm("llama")
    units = checkpoint_units(model, policy_for(model))
    fp, shard = checkpoint_fingerprint(_Desc(folder), dtype=torch.float32, rank=0, tp_size=1,
                                       units=units)
    assert shard is None and fp["units"] == [u.name for u in units] and "pp" not in fp


def test_offload_with_checkpoint_and_stages_is_accepted_by_the_config():
    cfg = shardwise.InferenceConfig.build(pipeline_parallel={"pp_size": 2}, checkpoint="/x",
                                          offload={"device": "nvme", "nvme_path": "/tmp/b"})
    assert cfg.pipeline_parallel.pp_size == 2 and cfg.checkpoint == "/x"

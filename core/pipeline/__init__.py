"""Pipeline-parallel inference: ``shardwise.pipeline`` (docs/architecture.md, "Pipeline stages").

``init_inference(model, pipeline_parallel={"pp_size": P})`` on P ranks cuts the decoder layers
into P contiguous stages (balanced by weight bytes read per step, or the user's ``split``); each
rank keeps its stage's layers, the first stage the embedding, the last the head; hidden states
travel between stages by point-to-point sends and the last stage's output is broadcast, so
``engine.module``, ``engine.generate`` and HF ``generate`` give the same outputs on every rank.

Modules: :mod:`.config` (the ``pipeline_parallel=`` field), :mod:`.stages` (where the cuts go;
planning only), :mod:`.transform` (the step that applies them, recorded in the ledger),
:mod:`.schedule` (micro-batches through the stages for the engine's forward, and their bubble),
:mod:`.quant` (a stage's weight quantization, the output head's part with ``lm_head``: the last
stage's head, a tied table's copy on the first stage).
Kernel injection composes: the injected stack runs its stage's layers between the receive and the
send of this rank's :class:`StageLink` (docs/pipeline.md, "With kernel injection").
"""

from .config import PipelineConfigError, PipelineSettings, parse_pipeline
from .stages import StagePlan, balanced_bounds, measured_split, plan_stages, rebalanced_split
from .schedule import PipelineStats, run_micro_batches, split_inputs
from .transform import (PipelineReport, RemoteEmbedding, RemoteHead, RemoteLayer, StageClock,
                        StageLink, apply_stages)

__all__ = ["PipelineConfigError", "PipelineSettings", "parse_pipeline", "StagePlan",
           "balanced_bounds", "measured_split", "plan_stages", "rebalanced_split",
           "PipelineReport", "RemoteEmbedding", "RemoteHead", "RemoteLayer", "StageClock",
           "StageLink", "apply_stages", "PipelineStats", "run_micro_batches", "split_inputs"]

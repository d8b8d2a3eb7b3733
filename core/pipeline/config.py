"""The ``pipeline_parallel=`` config field: parsed and checked on its own (the model-dependent
checks — ``pp_size`` against the layer count, a ``split`` against the layers — are the plan's:
:func:`shardwise.pipeline.stages.plan_stages`).

``pipeline_parallel={"pp_size": P}`` cuts the decoder layers into P contiguous stages balanced by
weight bytes read per step; ``"split": [n_0, ..., n_{P-1}]`` gives the layer count of each stage instead
(docs/architecture.md, "Pipeline stages"). This module imports nothing of shardwise but its
errors, so :mod:`shardwise.config` can load it eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ConfigError, NotSupportedYetError

#: keys accepted inside ``pipeline_parallel={...}``
PIPELINE_KEYS = ("pp_size", "split", "micro_batches", "enabled")


class PipelineConfigError(ConfigError):
    """A ``pipeline_parallel=`` setting that is malformed or does not fit the model (the message
    says the fix)."""


@dataclass(frozen=True)
class PipelineSettings:
    """``pipeline_parallel=``, validated.

    Attributes:
        pp_size: pipeline stages (ranks along the pipeline dimension).
        split: decoder layers per stage, first stage first (None: balanced by weight bytes
            read per step).
        micro_batches: how many micro-batches the engine's forward splits a batch into, so the
            stages overlap (:mod:`shardwise.pipeline.schedule`; 1: the batch whole).
    """

    pp_size: int = 1
    split: tuple[int, ...] | None = None
    micro_batches: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"pp_size": self.pp_size, "micro_batches": self.micro_batches,
                "split": list(self.split) if self.split is not None else None}


def parse_pipeline(value: Any) -> PipelineSettings | None:
    """``pipeline_parallel=`` as :class:`PipelineSettings`: None, ``{"enabled": False}`` or
    ``pp_size`` 1 → None (no pipeline); an int → that ``pp_size``; a dict of
    :data:`PIPELINE_KEYS`.

    Raises:
        PipelineConfigError: an unknown key, a ``pp_size`` or ``micro_batches`` that is not a
            positive integer, ``micro_batches`` > 1 with one stage, or a ``split`` that is not
            a list of ``pp_size`` positive integers.
    """
    if value is None or isinstance(value, PipelineSettings):
        return _off_when_trivial(value)
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"pp_size": value}
    if not isinstance(value, Mapping):
        raise PipelineConfigError(f"pipeline_parallel must be a dict like {{'pp_size': 2}} "
                                  f"(optionally with 'split': layers per stage), got "
                                  f"{type(value).__name__} {value!r}")
    unknown = [k for k in value if k not in PIPELINE_KEYS]
    if unknown:
        raise PipelineConfigError(f"unknown pipeline_parallel field(s) {unknown}; valid: "
                                  f"{list(PIPELINE_KEYS)}")
    if value.get("enabled", True) is False:
        return None
    pp = value.get("pp_size", 1)
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise PipelineConfigError(f"pipeline_parallel pp_size must be a positive integer (the "
                                  f"number of stages), got {pp!r}")
    micro = value.get("micro_batches", 1)
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise PipelineConfigError(f"pipeline_parallel micro_batches must be a positive integer "
                                  f"(micro-batches per forward), got {micro!r}")
    return _off_when_trivial(PipelineSettings(pp, _parse_split(value.get("split"), pp), micro))


def _off_when_trivial(settings: PipelineSettings | None) -> PipelineSettings | None:
    """None for one stage (a one-stage split is the whole model); micro-batches there would
    do nothing, so they are refused rather than ignored."""
    if settings is None or settings.pp_size > 1:
        return settings
    if settings.micro_batches > 1:
        raise PipelineConfigError(f"pipeline_parallel micro_batches={settings.micro_batches} "
                                  f"overlap pipeline stages, but pp_size=1 has one stage; give "
                                  f"pp_size > 1 or drop micro_batches")
    return None


def _parse_split(split: Any, pp: int) -> tuple[int, ...] | None:
    if split is None:
        return None
    if (not isinstance(split, (list, tuple))
            or any(isinstance(n, bool) or not isinstance(n, int) for n in split)):
        raise PipelineConfigError(f"pipeline_parallel split must be a list of layer counts, one "
                                  f"per stage (e.g. [3, 5] for pp_size=2), got {split!r}")
    if len(split) != pp:
        raise PipelineConfigError(f"pipeline_parallel split {list(split)} has {len(split)} "
                                  f"entries but pp_size={pp}: give one layer count per stage")
    if any(n < 1 for n in split):
        raise PipelineConfigError(f"pipeline_parallel split {list(split)}: every stage needs at "
                                  f"least one layer")
    return tuple(split)


def check_with_other_fields(cfg: Any) -> None:
    """Refuse the settings that do not compose with ``pipeline_parallel`` yet (each named), so
    none of them is silently dropped on some stage. ``quant=`` and ``checkpoint=`` compose (each
    rank quantizes, or reads, its stage's layers only), and so does kernel injection of a
    decoder (each rank's injected stack runs its stage's layers over a static KV cache of
    those layers) or of an encoder; ``save_mp_checkpoint_path`` saves each stage's layers
    (injected ones too; quantized stages as one quantized checkpoint; under
    ``tensor_parallel`` gathered whole on each stage's tp rank 0, not with ``quant`` or
    injection); ``quant``'s ``lm_head`` composes
    (the last stage quantizes the head; a tied table is quantized alike on the first stage:
    :mod:`shardwise.pipeline.quant`); ``offload=`` composes, with a model handed in or with
    ``checkpoint=`` (each rank streams its stage's modules; loading, it reads only its stage's
    tensors into a blob shard of its own: :mod:`shardwise.offload.stages`)."""
    if cfg.pipeline_parallel is None:
        return
    if cfg.save_mp_checkpoint_path and cfg.tp_size > 1 and (
            cfg.quant is not None or cfg.replace_with_kernel_inject):
        what = "quant=" if cfg.quant is not None else "replace_with_kernel_inject"
        raise NotSupportedYetError(
            f"save_mp_checkpoint_path with pipeline_parallel and tensor_parallel saves the "
            f"stages' tensors gathered whole, which {what} does not support yet; drop {what} "
            f"(or tensor_parallel) for the saving run (the saved folder loads with it)")

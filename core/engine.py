"""``init_inference`` and the engine it returns."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .accelerator import Accelerator
from .communicator import Communicator, create_communicator
from .config import InferenceConfig
from .errors import ConfigError, NotSupportedYetError, ShardwiseError
from .launch.startup_check import check_ranks_agree, fingerprint
from .ledger import Ledger, NotRestorableError, RestoreError  # noqa: F401 (re-exported)
from .plan import Plan, build_plan
from .plugins import get_accelerator
from . import checkpoint as _checkpoint, sharding, transforms

log = logging.getLogger(__name__)


class InferenceEngine:
    """A model prepared for inference on one accelerator.

    Attributes:
        module: the user's model, transformed in place (HF ``generate``/``pipeline`` still work).
        config: the validated :class:`InferenceConfig`.
        accelerator: the resolved :class:`~shardwise.Accelerator`.
        communicator: the :class:`~shardwise.Communicator` (local at world size 1).
        device: the ``torch.device`` the module runs on.
        dtype: the compute dtype.
        sharding: the :class:`~shardwise.sharding.ShardReport` under tensor parallelism (what
            was sharded and how, what stayed replicated, each rank's parameter bytes), else None.
        quantization: the :class:`~shardwise.quant.QuantReport` with ``quant=`` / ``dtype=int8``
            (model bytes before/after, layers quantized, backend per layer kind), else None.
        plan: the :class:`~shardwise.plan.Plan` the engine was built with, resolved once at the
            start of ``init_inference``: the world and per parallel dimension (pp, dp, tp, ep)
            its size, this rank's coordinate and process group; the policy; the head
            counts and this rank's head partition; the roles of every linear; under
            ``pipeline_parallel`` every stage's layers (``plan.stages``).

    Threads: an injected model holds one static KV cache, so :meth:`generate` and
    :meth:`__call__` of an injected engine run one thread at a time (callers wait); using
    ``engine.module`` from several threads at once raises
    :class:`~shardwise.inject.cache.ConcurrentUseError` rather than mixing their caches.

    Closing: :meth:`close` (or ``with shardwise.init_inference(...) as engine:``) frees the
    graphs, the KV cache and the communicator's shared memory, and gives the model back as it
    was handed in (quantized layers dequantized).
    """

    quantization = None
    #: the :class:`~shardwise.pipeline.PipelineReport` under ``pipeline_parallel`` (this rank's
    #: stage, its layers and parameter bytes), else None
    stages = None
    @property
    def pipeline_stats(self):
        """The :class:`~shardwise.pipeline.schedule.PipelineStats` of the last micro-batched
        forward (per-stage busy time, the bubble against ``(P − 1) / (P − 1 + M)``); None
        without ``pipeline_parallel`` micro-batches or before the first such call."""
        return self.stages.stats if self.stages is not None else None

    #: the :class:`~shardwise.offload.OffloadReport` with ``offload=`` (the ring, its stats), else
    #: None
    offload = None
    #: the record of the model as handed in (:meth:`close` gives it back); None for an engine
    #: built from a checkpoint with ``model=None``, and once closed
    _ledger: Ledger | None = None
    _closed = False

    def __init__(self, module: nn.Module, config: InferenceConfig, accelerator: Accelerator,
                 communicator: Communicator, device: torch.device, dtype: torch.dtype,
                 sharding: "sharding.ShardReport | None" = None,
                 plan: Plan | None = None) -> None:
        self.module = module
        self.config = config
        self.accelerator = accelerator
        self.communicator = communicator
        self.device = device
        self.dtype = dtype
        self.sharding = sharding
        self.plan = plan

    @torch.inference_mode()
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward on inputs moved to the engine's device (under tensor or
        pipeline parallelism, rank 0's tensor inputs are broadcast so every rank computes the
        same; with data-parallel replicas, each replica's first rank's inputs within the
        replica: replicas run on their own inputs)."""
        self._check_open()
        with self._session():
            if self.stages is not None:  # micro-batches through the stages, when configured
                return self.stages.call(self.module, self._inputs(args), self._inputs(kwargs))
            return self.module(*self._inputs(args), **self._inputs(kwargs))

    @torch.inference_mode()
    def generate(self, *args: Any, shardwise_fast_loop: bool = True, **kwargs: Any) -> Any:
        """``module.generate`` with tensor inputs moved to the engine's device (and broadcast
        from rank 0 under tensor or pipeline parallelism; from each data-parallel replica's
        first rank within the replica). On an injected engine, calls from several
        threads run one after another (the static KV cache serves one generate at a time).

        On an injected decoder (without pipeline stages; under tensor parallelism every rank
        runs it alike) a call whose every setting shardwise's own decode loop implements runs
        that loop (:mod:`shardwise.inject.decode_loop`): the prompt through the model's forward,
        then the injected decode step — with graphs, the captured step and its head's logits —
        called directly each token, the next token chosen on the device. It returns the tensor
        ``module.generate`` returns and calls a streamer as it does: greedy or sampling with
        ``max_new_tokens``/``max_length``, ``min_new_tokens``/``min_length``,
        ``eos_token_id``, ``pad_token_id``, ``temperature``/``top_k``/``top_p``,
        ``attention_mask`` (left padding), ``streamer``. Any other setting — in the call or in
        the model's ``generation_config`` (``repetition_penalty``, ``num_beams``,
        ``logits_processor``, ``output_scores``, ``return_dict_in_generate=True``, ...) — runs
        ``module.generate`` unchanged.

        Args:
            shardwise_fast_loop: False runs ``module.generate`` even where shardwise's loop
                could (e.g. to compare the two in one process).
        """
        self._check_open()
        with self._session():
            if self.stages is not None:  # micro-batches in flight, measured
                return self.stages.generate(self.module, self._inputs(args),
                                            self._inputs(kwargs))
            args, kwargs = self._inputs(args), self._inputs(kwargs)
            if shardwise_fast_loop and self._stack is not None:
                from .inject import decode_loop

                plan = decode_loop.plan_loop(self.module, self._stack, args, kwargs)
                if not isinstance(plan, str):
                    return decode_loop.run_loop(self.module, self._stack, plan)
                log.debug("shardwise: generate runs Hugging Face's loop (%s)", plan)
            return self.module.generate(*args, **kwargs)

    #: the injected decoder stack (its generate session serializes threads), if any
    _stack = None

    def _session(self) -> contextlib.AbstractContextManager:
        """The injected stack's generate session (see :meth:`InjectedModel.session
        <shardwise.inject.InjectedModel.session>`); a no-op context without one."""
        return self._stack.session() if self._stack is not None else contextlib.nullcontext()

    def close(self) -> nn.Module | None:
        """End the engine and give the model back as it was handed to ``init_inference``.

        Steps: the captured graphs and the static KV cache are freed; every patch the engine
        recorded (:mod:`shardwise.ledger`) is undone, newest first — graph capture's output
        head and the weights' graph layout, the injected stack (the HF modules come back),
        quantized linears (back to ``nn.Linear``), the cast, the tensor-parallel hooks and
        slices (the shards are all-gathered back) — then the record taken before the first
        change puts back the structure: the same module, parameter and buffer objects, hooks,
        attributes and ``config`` values (hooks or attributes added to the model while the
        engine ran go too); last, the communicator frees its shared-memory
        segment (the process group stays). Memory held one copy of the weights meanwhile:
        the weights are rebuilt from what the engine ran on.

        What comes back: module types, parameter names, shapes, dtypes and devices as handed
        in, and outputs equal to the original model's. Weights come back bit for bit after
        injection, graphs and tensor parallelism. **Quantized layers come back dequantized**
        (their weights carry the int8/int4 rounding, within the quantization error of the
        originals), and weights cast to a lower precision come back cast up (the rounding
        stays); a log line says so. A model loaded from a checkpoint into your meta model
        comes back on meta.

        Under tensor parallelism every rank calls ``close()`` (the all-gathers are
        collectives). ``with shardwise.init_inference(...) as engine:`` calls it on leaving the
        block, an exception included. An :meth:`generate` running in another thread finishes
        first (close waits for it); any use of the engine afterwards raises
        :class:`EngineClosedError` (``engine.module`` is the given-back model).

        Returns:
            the model as handed in, or None for an engine built from a checkpoint with
            ``model=None`` (nothing to give back; the engine is closed all the same). Calling
            it again returns the same (or raises the same error).

        Raises:
            NotRestorableError: naming each weight that cannot be given back as handed in (a
                step changed it without recording how to undo it); the rest of the model is
                back and the engine is closed.
            RestoreError: naming each recorded change whose undo failed.
        """
        if self._closed:
            return self._closed_result()
        # another thread's engine.generate finishes first (a bare forward running in another
        # thread is a ConcurrentUseError, and the engine stays open)
        with self._session():
            if self._closed:  # by another thread's close while this one waited
                return self._closed_result()
            self._closed = True  # whatever happens below, this engine is done
            ledger, self._ledger = self._ledger, None
            undone = len(ledger.undos) if ledger is not None else 0
            try:
                self._free_runtime()
                if ledger is not None:
                    ledger.give_back()
                self._given_back = ledger.root if ledger is not None else None
            except Exception as exc:
                self._close_error = exc
                raise
            finally:
                self._release(ledger)
        if self._given_back is not None:
            self._log_given_back(undone)
        return self._given_back

    _given_back: nn.Module | None = None
    _close_error: Exception | None = None

    def _closed_result(self) -> nn.Module | None:
        """What :meth:`close` returns (or raises) once the engine is closed."""
        if self._close_error is not None:
            raise self._close_error
        return self._given_back

    def _release(self, ledger: Ledger | None) -> None:
        """After giving back: the communicator's buffers, the engine's references, the
        ledger's record, and the memory freed by all that."""
        self.communicator.release_buffers()
        if self.offload is not None:  # after give_back: its undo reads the units back
            self.offload.close()
        self.checkpoint_load = self._stack = None
        if ledger is not None:
            ledger.release()
        self.accelerator.release_cached_memory()  # the freed graphs, buffers and layouts

    def _free_runtime(self) -> None:
        """Free what the engine allocated beside the model: the injected stack's captured
        graphs and static KV buffers (a cache object still held elsewhere is retired)."""
        if self._stack is not None:
            self._stack.free_cache()

    def _log_given_back(self, undone: int) -> None:
        model = self._given_back
        lossy = []
        if self.quantization is not None:
            lossy.append(f"its {self.quantization.layers_quantized} quantized linears come back "
                         f"dequantized (their weights carry the quantization rounding, not the "
                         f"original values)")
        floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if floats and self.dtype not in floats and self.dtype.is_floating_point and any(
                torch.finfo(self.dtype).bits < torch.finfo(d).bits for d in floats):
            lossy.append(f"weights run in {str(self.dtype).removeprefix('torch.')} come back "
                         f"cast up (that rounding stays)")
        log.info("shardwise: engine closed; %s given back (%d recorded changes undone)%s",
                 type(model).__name__, undone, "; " + "; ".join(lossy) if lossy else "")

    def __enter__(self) -> "InferenceEngine":
        self._check_open()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        """Close the engine; an exception from the block propagates, and a failing close
        then does not mask it (its error is added to it as a note)."""
        if exc is None:
            self.close()
            return False
        try:
            self.close()
        except Exception as failed:  # the block's exception is the one to see
            exc.add_note(f"engine.close() on leaving the block also failed: "
                         f"{type(failed).__name__}: {failed}")
        return False

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this engine is closed (engine.close() gave the model "
                                    "back); build a new one with shardwise.init_inference")

    def save_checkpoint(self, path: str | os.PathLike) -> str:
        """Write the loaded model as a sharded checkpoint (every rank calls it): one safetensors
        file per rank plus ``shardwise_checkpoint.json``, loadable at any tp size with
        ``init_inference(None, checkpoint=path, ...)``. Returns the description's path.

        A pipeline engine (``pipeline_parallel=``) writes a Hugging Face sharded checkpoint
        instead, each stage its own layers' file (:func:`~shardwise.checkpoint.saver.
        save_stages_checkpoint`), and returns the index's path: injected stages save their HF
        tensors; quantized stages save one shardwise quantized checkpoint of the whole model
        (tp size 1, gathered on the first stage, which holds it in host memory while writing).
        Stages that are also tensor-parallel gather their split tensors whole on each stage's
        tp rank 0, which writes the stage's file (quantized or injected ones are refused by
        name before anything is gathered); with data-parallel replicas the first replica
        writes and every rank returns the same path.

        A quantized engine (``quant=`` / ``dtype=torch.int8``) saves its weights as they run:
        each rank file holds that rank's packed weights, scales and zero points bit for bit plus
        its layer manifest, and the description records the quant settings and compute dtype.
        Such a checkpoint loads without re-quantizing, bit-identically, at the same tp size
        only (packed layouts cannot be merged or split: to change the tp size, save an engine
        built without ``quant=`` and quantize while loading)."""
        self._check_open()
        if self.offload is not None:
            raise ConfigError(_OFFLOAD_SAVE_REFUSAL)
        if self.stages is not None:  # each stage writes its own layers' file
            return str(self._save_stages(path))
        prepared = self.plan.sharding if self.sharding is not None and self.plan else None
        return str(_checkpoint.save_checkpoint(self.module, path, prepared=prepared,
                                               communicator=self.communicator))

    def _save_stages(self, path: str | os.PathLike) -> Any:
        """:meth:`save_checkpoint` of a pipeline engine: the stages write their files
        (:func:`~shardwise.checkpoint.saver.save_stages_checkpoint`); with data-parallel
        replicas of the pipeline the first replica writes and the others wait for it (every
        rank returns the same path)."""
        from .checkpoint.saver import check_stages_target, save_stages_checkpoint

        plan = self.plan
        if plan is not None and plan.ep.enabled:
            raise NotSupportedYetError(
                f"saving a checkpoint from pipeline stages whose experts are split by expert "
                f"parallelism (ep_size={plan.ep.size}) is not supported yet; save from an "
                f"engine with pipeline_parallel and without moe ep_size (the saved folder "
                f"loads with it)")
        if plan is None or (plan.dp.size == 1 and not plan.tp.enabled):
            return save_stages_checkpoint(self.module, path, self.stages, self.communicator)
        if plan.tp.enabled:
            self._check_tp_stages_save()
        check_stages_target(self.module, self.stages, Path(path))  # on every rank: none waits
        written = None
        with _whole_stage(self.module, plan) as writer:  # tp: the stage's tp rank 0 holds it
            if writer and plan.dp.coord == 0:  # the first replica's pipeline of tp rank 0s
                written = save_stages_checkpoint(self.module, path, self.stages,
                                                 self.stages.communicator)
            # the others wait until its files are complete, and return the path rank 0 returns
            return _broadcast_text(str(written) if written is not None else "",
                                   self.communicator)

    def _check_tp_stages_save(self) -> None:
        """Pipeline stages split by tensor parallelism save their HF tensors whole (gathered on
        each stage's tp rank 0); quantized or injected stages keep layouts the gather does not
        know: refused by name before anything is gathered or written."""
        what = ("quantized" if self.quantization is not None else
                "kernel-injected" if self.config.replace_with_kernel_inject else None)
        if what is not None:
            raise NotSupportedYetError(
                f"saving a checkpoint from {what} pipeline stages split by tensor parallelism "
                f"(tp_size={self.plan.tp.size}) is not supported yet; save from an engine with "
                f"the same pipeline_parallel and tensor_parallel but without "
                f"{'quant=' if what == 'quantized' else 'replace_with_kernel_inject'} (the "
                f"saved folder loads with it), or without tensor_parallel")

    def _inputs(self, value: Any) -> Any:
        value = self._to_device(value)
        group = self._input_group()
        if (self.sharding is not None or self.stages is not None) and group.world_size > 1:
            value = _broadcast_tensors(value, group)
        return value

    def _input_group(self) -> Communicator:
        """The ranks whose inputs are one: this rank's data-parallel replica (its TP group, or
        its pipeline's pp × tp ranks), the world without replicas (``plan.inputs``)."""
        group = getattr(self.plan, "inputs", None)
        return group if group is not None else self.communicator

    def _to_device(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.device)
        if isinstance(value, dict):
            return type(value)({k: self._to_device(v) for k, v in value.items()})
        if isinstance(value, (list, tuple)):
            return type(value)(self._to_device(v) for v in value)
        if hasattr(value, "to") and hasattr(value, "keys"):  # transformers BatchEncoding
            return value.to(self.device)
        return value

    def __repr__(self) -> str:
        return (f"InferenceEngine({type(self.module).__name__} on {self.device}, "
                f"dtype={str(self.dtype).removeprefix('torch.')}, "
                f"world={self.communicator.world_size})")


class EngineClosedError(ShardwiseError, RuntimeError):
    """The engine was closed (``engine.close()`` or the end of its ``with`` block)."""


#: Most tensor dims ``_broadcast_tensors`` sends (the shape travels in a fixed-size tensor).
_MAX_DIMS = 8


def _broadcast_tensors(value: Any, comm: Communicator) -> Any:
    """``value`` with every tensor replaced by rank 0's (shape, then data). Every rank must pass
    the same structure with the same dtypes; only contents and shapes may differ."""
    if isinstance(value, torch.Tensor):
        if value.dim() > _MAX_DIMS:
            raise ConfigError(f"engine inputs have at most {_MAX_DIMS} dims under tensor "
                              f"parallelism, got {value.dim()}")
        shape = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64, device=value.device)
        shape[0] = value.dim()
        shape[1:1 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
        comm.broadcast(shape, src=0)
        dims = shape[1:1 + int(shape[0])].tolist()
        out = value.contiguous() if comm.rank == 0 else value.new_empty(dims)  # never in place
        return comm.broadcast(out, src=0)
    if isinstance(value, dict):
        return type(value)({k: _broadcast_tensors(v, comm) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_broadcast_tensors(v, comm) for v in value)
    if hasattr(value, "keys") and hasattr(value, "data") and isinstance(value.data, dict):
        value.data = _broadcast_tensors(value.data, comm)  # transformers BatchEncoding
    return value


@contextlib.contextmanager
def _whole_stage(model: nn.Module, plan: Plan):
    """Under tensor parallelism, this stage's split tensors whole on its tp rank 0 for the
    block (each gathered over the stage's tp group: every tp rank takes part; the slices come
    back after); yields whether this rank holds its stage whole (tp rank 0, or no tp)."""
    if not plan.tp.enabled:
        yield True
        return
    live = {id(m) for m in model.modules()}
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id → (parameter, its slice)
    for spec in plan.sharding.specs:
        if id(spec.module) not in live:
            continue  # another stage's module, replaced by a stand-in
        for name, whole in _gathered(spec, plan.tp.group):
            param = getattr(spec.module, name)
            if plan.tp.coord == 0 and id(param) not in kept:  # a tied one once
                kept[id(param)] = (param, param.data)
                param.data = whole
    try:
        yield plan.tp.coord == 0
    finally:
        for param, data in kept.values():
            param.data = data


def _gathered(spec, group: Communicator) -> list[tuple[str, torch.Tensor]]:
    """``(parameter name, whole tensor)`` of ``spec``'s module, gathered over the tp
    ``group``: the weight along its split dim; a column-parallel bias along its ranges; a
    row-parallel bias is whole on tp rank 0 already (zeros elsewhere)."""
    from .sharding.apply import gather_whole
    from .layout import RowParallel

    module = spec.module
    out = [("weight", gather_whole(module.weight.detach(), spec.dim, spec.ranges, spec.size,
                                   group))]
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor) and not isinstance(spec.role, RowParallel):
        out.append(("bias", gather_whole(bias.detach(), 0, spec.ranges, spec.size, group)))
    return out


def _broadcast_text(text: str, comm: Communicator) -> str:
    """Rank 0's ``text`` on every rank (its UTF-8 length first, then its bytes)."""
    data = text.encode()
    size = comm.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0)
    buf = (torch.tensor(list(data), dtype=torch.uint8) if comm.rank == 0
           else torch.zeros(int(size), dtype=torch.uint8))
    return comm.broadcast(buf, src=0).numpy().tobytes().decode()


def _plan_step(model: nn.Module, cfg: InferenceConfig) -> Plan:
    """Step 2, before any process group or weight work: the :class:`~shardwise.plan.Plan` —
    the world's dimensions checked against ``tp_size``, the policy looked up, the heads split,
    the sharding plan chosen and every rank's slices computed (all errors surface here)."""
    return build_plan(model, tp_size=cfg.tp_size, injection_policy=cfg.injection_policy,
                      moe=cfg.moe, pipeline=cfg.pipeline_parallel, dp_size=cfg.dp_size)


def _seed(cfg: InferenceConfig) -> None:
    several = cfg.tp_size > 1 or cfg.pipeline_parallel is not None
    seed = cfg.seed if cfg.seed is not None else (0 if several else None)
    if seed is not None:
        torch.manual_seed(seed)  # every device's default generator


def init_inference(model: nn.Module, config: InferenceConfig | dict | str | None = None,
                   **kwargs: Any) -> InferenceEngine:
    """Prepare ``model`` for inference and return an :class:`InferenceEngine`.

    Args:
        model: a Hugging Face ``PreTrainedModel`` (or any ``nn.Module``) with real weights. It is
            transformed in place and available as ``engine.module``. With ``checkpoint=...`` it
            may be on the meta device (``with torch.device("meta"):`` or accelerate's
            ``init_empty_weights()`` around ``from_config``) or None (built from the
            checkpoint's config.json); each rank then reads only its slices of the checkpoint.
        config: an :class:`InferenceConfig`, a dict of its fields, or a JSON file path.
        **kwargs: config fields, DeepSpeed names included (``mp_size``, ``tensor_parallel``,
            ``enable_cuda_graph``, ``max_out_tokens``). A field given both here and in
            ``config`` must agree.

    With ``tp_size=N`` (run under torchrun with N ranks) the model is split in place from a plan
    (``injection_policy``, else the model's HF tp_plan, a family policy, a heuristic; see
    :mod:`shardwise.sharding`); ``engine.sharding`` reports what was split.

    With ``pipeline_parallel={"pp_size": P}`` (P ranks) each rank keeps one stage of the decoder
    layers (the first the embedding, the last the head), hidden states go point-to-point from
    stage to stage and the last stage's outputs are broadcast, so every rank returns the same;
    ``engine.stages`` reports this rank's stage, ``engine.pipeline_stats`` the bubble of the
    last micro-batched forward (``"micro_batches": M``). See :mod:`shardwise.pipeline`.

    Quantization and checkpoints (``engine.quantization`` reports either way):

    * ``checkpoint=`` a full-precision checkpoint with ``quant=``: each quantized weight is
      quantized as soon as this rank's slice of it is read, so the full-precision model never
      sits in memory; the result is bit-identical to loading, then quantizing (kernel injection
      then runs on the quantized linears).
    * ``checkpoint=`` a quantized checkpoint (``engine.save_checkpoint`` of a quantized engine):
      its packed weights are loaded as saved, never re-quantized. Without ``quant=`` the saved
      settings are adopted (one log line); ``quant=`` equal to them is accepted; ``quant=`` with
      other settings is a :class:`~shardwise.checkpoint.CheckpointError` (re-quantizing would
      compound the rounding: quantize from the full-precision checkpoint instead). The tp size
      and the compute dtype must be the saved ones (``dtype`` unset takes the saved one).

    Failure leaves the model as handed in: every transform's settings (sharding plan, ``quant``
    against each layer, injection, the KV cache against the device's free memory) are checked
    before the first in-place change, and a :class:`~shardwise.ledger.Ledger` opened before it
    restores the model (modules, hooks, instance forwards, attributes, tensors: bit for bit, no
    collective) if any later step fails, so a retry starts from the same model. Each step
    records its patches in that ledger as it makes them, a replaced weight with the undo that
    rebuilds it from what the model then holds; at the end of a successful init the ledger
    lets go of the original weights the model no longer holds (memory holds one copy), and
    ``engine.close()`` — or leaving ``with shardwise.init_inference(...) as engine:`` — undoes
    every patch and gives the model back (see :meth:`InferenceEngine.close`).

    Raises:
        ConfigError: an unknown or malformed field, or a feature not supported yet (named).
        ShardingError: tp_size does not fit the world, or the model cannot be split as planned
            (a ConfigError, raised before any process group or weight work).
        PluginError: an unknown, broken or unavailable device (with the reason).
        UnsupportedDtypeError: a dtype the device cannot run.
        CheckpointError: a missing, corrupt or mismatched checkpoint, or a quantized one loaded
            otherwise than saved (above); named, before any weight is read.
        KVCacheMemoryError: (a ConfigError) the static KV cache of ``max_tokens`` for one
            sequence exceeds the device's free memory (the message names the bytes, the free
            memory and the ``max_tokens`` that would fit).
    """
    cfg = InferenceConfig.build(config, **kwargs)
    if not isinstance(model, nn.Module):  # None (built from the checkpoint) or an error below
        return _build_engine(model, cfg)
    ledger = Ledger(model)  # before the first in-place change: a failure gives it all back
    with ledger.rollback_on_error(), ledger.recording():
        engine = _build_engine(model, cfg)
    _keep_ledger(engine, ledger)
    engine.accelerator.release_cached_memory()  # the replaced weights the ledger let go of
    return engine


def _build_engine(model: nn.Module | None, cfg: InferenceConfig) -> InferenceEngine:
    """:func:`init_inference`'s steps: every check first, then the in-place transforms."""
    desc = _checkpoint.describe(cfg.checkpoint, cfg.base_dir) if cfg.checkpoint else None
    if _saved_quantized(desc):
        _saved_quant_settings(cfg, desc)  # before any model, process group or weight work
    if desc is not None:  # 4. (skeleton): the user's meta model or the checkpoint's config
        model = _checkpoint.skeleton(model, desc, _build_dtype(cfg.dtype))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module (e.g. from "
                          f"AutoModelForCausalLM.from_pretrained), got {type(model).__name__}")
    accelerator = get_accelerator(cfg.device)  # 1. resolve; it vetoes the dtype below
    dtype = transforms.resolve_dtype(accelerator, cfg.dtype, model)
    if desc is None:
        transforms.check_materialized(model)
    plan = _plan_step(model, cfg)  # 2. every split decided and checked, before any group
    communicator = create_communicator(accelerator, cfg.comm_timeout)  # 3.
    # 3b. every rank runs the same software, model and settings (one all-gather; named errors)
    check_ranks_agree(communicator, fingerprint(model, cfg))
    plan.bind(communicator)
    device = accelerator.device(communicator.local_rank if accelerator.device_count() > 1 else None)
    _check_later_steps(model, cfg, accelerator, dtype, device, plan, desc)
    _seed(cfg)
    prepared = plan.shards  # every rank's slices under TP, and its experts under EP
    loaded = None
    if desc is not None:  # 4. each rank reads only its slices, straight onto its device
        loaded = _load_step(model, cfg, accelerator, dtype, device, plan, desc,
                            _stage_rank(plan, communicator))
    report = None
    if prepared is not None:
        report = sharding.apply_shards(  # 5. (the loader already sliced the weights) in the
            prepared, plan.tp.group or communicator,  # tp group (one stage's ranks under pp)
            sliced=loaded.sliced if loaded else None,
            bytes_before=loaded.bytes_before if loaded else None)
        if communicator.rank == 0:
            log.info("shardwise: %s", report.summary())
    stages = _pipeline_step(model, plan, communicator, dtype, cfg.pipeline_parallel,
                            rebuild=loaded is None)  # 5b. this rank's stage
    quant_report = _quantize_and_cast(model, cfg, accelerator, dtype, device, plan,
                                      loaded)  # 6.
    moe_report = _moe_step(model, cfg, accelerator, dtype, plan)  # 6b. before injection
    injected = None
    if cfg.replace_with_kernel_inject:  # 7. adopts the linears as they are (sharded, quantized)
        from .inject import inject_model

        injected = inject_model(model, accelerator, dtype, _max_tokens(cfg),
                                policy=plan.found_policy, heads=_injected_heads(plan),
                                fuse_projections=cfg.fuse_projections)
        # its own new tensors (ALiBi slopes); units loaded straight into blobs stay on meta
        transforms.move_and_cast(injected, device, dtype, keep_meta=_loaded_offloaded(loaded))
    offload = _offload_step(model, cfg, accelerator, dtype, device, plan, injected,
                            loaded)  # 7b.
    if cfg.enable_graph:  # 8. (the config requires injection for it)
        _no_grad_parameters(model)
        if offload is not None:  # one graph per layer (and ring slot), the ring's waits between
            from .offload.graphs import enable_offload_graphs

            enable_offload_graphs(model, accelerator, offload)
        else:
            from .inject import enable_graphs

            enable_graphs(model, accelerator, cfg.weight_dtype)
    log.info("shardwise: %s on %s (%s)", type(model).__name__, device, dtype)
    engine = InferenceEngine(model, cfg, accelerator, communicator, device, dtype, report,
                             plan=plan)
    engine.quantization = quant_report
    engine.stages = stages
    engine.moe = moe_report
    engine.offload = offload
    engine.checkpoint_load = loaded
    engine._stack = injected if hasattr(injected, "session") else None
    if cfg.save_mp_checkpoint_path:
        engine.save_checkpoint(cfg.save_mp_checkpoint_path)
    return engine


def _pipeline_step(model: nn.Module, plan: Plan, communicator: Communicator,
                   dtype: torch.dtype, pipeline, rebuild: bool = True):
    """Step 5b under pipeline parallelism (before the cast and quantization: the other stages'
    modules are never cast or quantized): this rank keeps its stage's layers, the rest become
    stand-ins, and the hooks that move hidden states between stages are installed
    (:func:`shardwise.pipeline.apply_stages`; ``rebuild`` False after a checkpoint load, which
    left the other stages' tensors unread). Returns its
    :class:`~shardwise.pipeline.PipelineReport`, or None without stages."""
    if plan.stages is None:
        return None
    from .moe.block import decoder_layers
    from .pipeline import apply_stages

    report = apply_stages(model, decoder_layers(model, plan.policy), plan.stages,
                          plan.pp.group, dtype, micro_batches=pipeline.micro_batches,
                          rebuild=rebuild)
    log.info("shardwise: rank %d: %s", communicator.rank, report.summary())
    return report


def _runs_moe_step(cfg: InferenceConfig, plan: Plan) -> bool:
    """Whether the MoE step runs: the model is Mixture-of-Experts and its blocks must leave HF's
    forward — kernel injection (the injected layer calls the block; graphs capture it), expert
    parallelism (ep > 1: this rank's experts, then the ep all-reduce) or quantization (the
    quantized experts honour the experts-module contract the block calls). Otherwise the HF
    blocks run as they are (``moe={"ep_size": 1}`` alone changes nothing)."""
    if plan.experts is None:
        return False
    if cfg.replace_with_kernel_inject or plan.ep.enabled:
        return True
    return cfg.quant is not None and plan.policy.moe is not None


def _moe_step(model: nn.Module, cfg: InferenceConfig, accelerator: Accelerator,
              dtype: torch.dtype, plan: Plan):
    """Step 6b (after quantization, before injection; see :func:`_runs_moe_step`): every MoE
    block of the plan gets the generic forward on the moe kernels, this rank's experts only
    (:func:`shardwise.moe.install_moe`). Returns its :class:`~shardwise.moe.MoEReport`, or
    None when the step does not run."""
    if not _runs_moe_step(cfg, plan):
        return None
    from .moe import install_moe

    dispatch = getattr(cfg.moe, "dispatch", None) or "all_reduce"
    return install_moe(model, plan, accelerator, dtype, dispatch=dispatch)


def _load_step(model: nn.Module, cfg: InferenceConfig, accelerator: Accelerator,
               dtype: torch.dtype, device: torch.device, plan: Plan,
               desc: "_checkpoint.Description", rank: int):
    """Step 4: each rank reads only its slices of the checkpoint, straight onto its device
    (quantized while read with ``quant``). With ``offload=`` each unit goes to its blob as
    soon as it is read and back to meta (:func:`shardwise.offload.checkpoint.load_to_store`):
    the whole model is never resident; the offload step then binds the units to the ring.
    Under pipeline stages a rank reads only its stage's tensors (and writes only its stage's
    units, into a blob shard of its own: :mod:`shardwise.offload.stages`)."""
    hooks = _reading_hooks(model, cfg, accelerator, dtype, device, plan, desc)
    experts = plan.experts.total if plan.experts is not None else None
    skip = _other_stages(model, plan)
    if cfg.offload is None:
        return _checkpoint.load_checkpoint(model, desc, prepared=plan.shards, rank=rank,
                                           device=device, dtype=dtype, hooks=hooks,
                                           experts=experts, skip_modules=skip)
    from .offload.checkpoint import checkpoint_units, load_to_store

    units, dropped, stage = checkpoint_units(model, plan.policy), skip, None
    if plan.stages is not None:  # this stage's units only, in a blob shard of its own
        from .moe.block import decoder_layers
        from .offload.stages import replaced_modules, stage_identity, stage_units

        dropped = replaced_modules(model, decoder_layers(model, plan.policy), plan.stages)
        units, stage = stage_units(units, dropped), stage_identity(plan.stages)
    return load_to_store(model, desc, cfg.offload, units=units,
                         prepared=plan.shards, rank=rank, tp_size=plan.tp.size, device=device,
                         dtype=dtype, hooks=hooks, experts=experts, quant=cfg.quant,
                         pinned=accelerator.pinned_host_buffer if cfg.offload.pin_memory else None,
                         skip_modules=skip, dropped_modules=dropped, stage=stage)


def _stage_rank(plan: Plan, communicator: Communicator) -> int:
    """The rank whose slices this rank reads: under tensor parallelism its tp coordinate (the
    stage's slices are planned per tp rank; an expert group lies inside a tp group, so
    ``tp_coord mod ep`` is its ep coordinate), else its rank within its pipeline stage (the
    world's rank without stages: its ep coordinate is that ``mod ep``); 0 where nothing is
    split (replicas each read the whole model: a checkpoint saved at tp 1 has rank 0's file
    only)."""
    if plan.shards is None:
        return 0
    if plan.tp.enabled:
        return plan.tp.coord
    return communicator.rank % (communicator.world_size // plan.pp.size)


def _other_stages(model: nn.Module, plan: Plan) -> tuple[str, ...]:
    """The modules whose checkpoint tensors this rank does not read: the ones other pipeline
    stages run (:func:`shardwise.pipeline.stages.foreign_modules`); none without stages."""
    if plan.stages is None:
        return ()
    from .moe.block import decoder_layers
    from .pipeline.stages import foreign_modules

    return foreign_modules(model, decoder_layers(model, plan.policy), plan.stages)


def _written_store(loaded):
    """The offload store step 4 wrote the units into, straight from the checkpoint (they are
    on meta until the offload step binds them), or None."""
    from .offload.checkpoint import HOOK_NAME

    return loaded.results.get(HOOK_NAME) if loaded is not None else None


def _loaded_offloaded(loaded) -> bool:
    """Whether step 4 wrote the units straight into offload blobs (:func:`_written_store`)."""
    return _written_store(loaded) is not None


def _offload_step(model: nn.Module, cfg: InferenceConfig, accelerator: Accelerator,
                  dtype: torch.dtype, device: torch.device, plan: Plan, injected, loaded):
    """Step 7b with ``offload=`` (after injection, before graphs): the units' weights repacked
    into the store (or a complete one reused; or, when the checkpoint was loaded straight into
    blobs, that store as written), the resident copies freed, the ring and its hooks installed
    (:func:`shardwise.offload.offload_model`). Returns its
    :class:`~shardwise.offload.OffloadReport`, or None without ``offload``."""
    if cfg.offload is None:
        return None
    from .offload import offload_model

    written = _written_store(loaded)
    quant = cfg.quant.to_dict() if hasattr(cfg.quant, "to_dict") else repr(cfg.quant)
    report = offload_model(model, cfg.offload, accelerator, device, plan, stack=injected,
                           fingerprint_extra={"dtype": str(dtype), "quant": quant,
                                              "inject": bool(cfg.replace_with_kernel_inject)},
                           written=written)
    log.info("shardwise: %s", report.summary())
    return report


def _max_tokens(cfg: InferenceConfig) -> int | None:
    """The static KV cache's capacity asked for (None: the injector's default)."""
    return None if cfg.max_tokens == InferenceConfig.max_tokens else cfg.max_tokens


def _injected_heads(plan: Plan):
    """The head partition the injected layers hold: the plan's under TP, all heads else."""
    return plan.heads if plan.sharded else None


def _no_grad_parameters(model: nn.Module) -> None:
    """``requires_grad=False`` on every parameter before graph capture, as a model loaded from
    a checkpoint has them: a captured step guards on the flag, so without this the same model
    handed in from HF and loaded by ``checkpoint=`` would never share a saved compiled step.
    The ledger gives the user's parameters their flags back on ``close()``."""
    for param in model.parameters():
        param.requires_grad_(False)


def _check_later_steps(model: nn.Module, cfg: InferenceConfig, accelerator: Accelerator,
                       dtype: torch.dtype, device: torch.device, plan: Plan,
                       desc: "_checkpoint.Description | None") -> None:
    """The settings of steps 6-7, checked before the first in-place change (the plan, step 2,
    and the loader's header checks check their own): ``quant`` against every
    layer as each rank will hold it (all ranks' slices, so every rank fails alike), and
    injection — policy, model settings, head counts, kernels and the static KV cache of one
    sequence against the device's free memory."""
    if cfg.quant is not None and not _saved_quantized(desc):
        from .quant import check_fits

        prepared = plan.sharding if plan.sharded else None
        for rank in range(plan.tp.size):
            check_fits(model, cfg.quant, accelerator, dtype, prepared=prepared, rank=rank,
                       plan=plan, device=device)
    if _runs_moe_step(cfg, plan):
        from .moe import check_moe

        check_moe(model, plan, accelerator, dtype)
    if cfg.replace_with_kernel_inject:
        from .inject.injector import check_injection

        check_injection(model, accelerator, dtype, _max_tokens(cfg), device,
                        policy=plan.found_policy, heads=_injected_heads(plan))
    if cfg.enable_graph:  # a device that cannot capture in its current mode says so now
        strategy = accelerator.graph_strategy()
        if cfg.weight_dtype is not None:
            _check_weight_dtype(cfg.weight_dtype, dtype, strategy)
    if plan.stages is not None:  # every pipeline stage's weights against the free memory
        from .inject.cache import free_memory_of
        from .moe.block import decoder_layers
        from .pipeline.stages import check_stages_fit

        check_stages_fit(model, decoder_layers(model, plan.policy), plan.stages, dtype, device,
                         free_memory_of(accelerator.free_memory, device), plan.tp.size)
    if cfg.offload is not None:
        from .offload.config import check_offload

        check_offload(cfg.offload, accelerator, model, device, enable_graph=cfg.enable_graph)
        if cfg.save_mp_checkpoint_path:
            raise ConfigError(_OFFLOAD_SAVE_REFUSAL)


#: why an offloaded engine does not save a checkpoint (its units hold ring slots, not weights)
_OFFLOAD_SAVE_REFUSAL = (
    "an offloaded engine cannot save a checkpoint: its layers' tensors are views of the ring "
    "slots they stream through, not the weights; save from an engine built without offload= "
    "(the same settings otherwise), or keep the repacked store under nvme_path, which later "
    "inits with the same model and settings reuse")


def _keep_ledger(engine: InferenceEngine, ledger: Ledger) -> None:
    """Keep ``ledger`` for :meth:`InferenceEngine.close`, holding one copy of the weights: the
    original weights the model no longer holds (sharded, quantized, cast, laid out anew) are
    let go of, since their recorded undos rebuild them at close."""
    freed = ledger.drop_replaced()
    if freed:
        log.debug("shardwise: %d bytes of replaced weights let go of (close() rebuilds them)",
                  freed)
    engine._ledger = ledger


def _saved_quant_settings(cfg: InferenceConfig, desc: "_checkpoint.Description") -> None:
    """A quantized checkpoint: refuse another tp size, and set ``cfg.quant`` to the saved
    settings (adopted when ``quant=`` is not given; ``quant=`` with other settings is an error:
    see :func:`shardwise.quant.checkpoint.adopt_saved_quant`)."""
    from .quant.checkpoint import settings_for_checkpoint

    ep_size = cfg.moe.ep_size if cfg.moe is not None else 1  # a wrong split: refused now
    cfg.quant = settings_for_checkpoint(desc, cfg.quant, cfg.tp_size, ep_size=ep_size)


def _check_weight_dtype(weight_dtype: torch.dtype, dtype: torch.dtype, strategy) -> None:
    """``weight_dtype`` needs an fp32 compute dtype (known once resolved) and a graph strategy
    that keeps weights in it (:func:`~shardwise.inject.capture.check_weight_dtype`)."""
    from .config import check_weight_dtype_compute
    from .inject.capture import check_weight_dtype

    check_weight_dtype_compute(weight_dtype, dtype)
    check_weight_dtype(strategy, weight_dtype)


def _saved_quantized(desc: "_checkpoint.Description | None") -> bool:
    """Whether ``desc`` carries quantized layers (the ``shardwise.quant`` extension's data)."""
    if desc is None or not desc.extensions:
        return False
    from .quant.checkpoint import EXTENSION

    return EXTENSION in desc.extensions


def _reading_hooks(model: nn.Module, cfg: InferenceConfig, accelerator: Accelerator,
                   dtype: torch.dtype, device: torch.device, plan: Plan,
                   desc: "_checkpoint.Description") -> list:
    """Step 6 folded into step 4: with ``quant`` and a full-precision checkpoint, the
    per-tensor hook the loader calls as each weight slice is read
    (:meth:`~shardwise.quant.Quantizer.reading_hook`: the same layers and settings step 6 would
    quantize). Empty when there is nothing to quantize while reading. Kernel injection (step 7)
    then adopts the quantized linears as it adopts float ones."""
    if cfg.quant is None or _saved_quantized(desc):
        return []
    from .quant import Quantizer

    return [Quantizer.for_model(model, cfg.quant, accelerator, dtype, device=device,
                                plan=plan).reading_hook()]


def _quantize_and_cast(model: nn.Module, cfg: InferenceConfig, accelerator: Accelerator,
                       dtype: torch.dtype, device: torch.device, plan: Plan, loaded):
    """Step 6: the loader's QuantReport when it quantized (or loaded quantized weights), else
    :func:`_quantize_step`; the rest of the model is cast and moved either way."""
    report = None
    if loaded is not None and loaded.results:
        from .quant.checkpoint import EXTENSION

        report = loaded.results.get(EXTENSION)  # the reading hook's or the saved layers'
    if report is None:
        report = _quantize_step(model, cfg, accelerator, dtype, device, plan)
        if report is not None:
            return report  # quantize_model cast and moved the rest
    else:
        from .quant import quantize_model_experts

        # the reader quantized the linears; MoE experts (3-D weights, read whole: this rank's
        # after sharding) are quantized now
        quantize_model_experts(model, report, accelerator, dtype, device)
        log.info("shardwise: %s", report.summary())
    transforms.cast_and_move(model, device, dtype, keep_meta=_loaded_offloaded(loaded))
    return report


def _quantize_step(model: nn.Module, cfg: InferenceConfig, accelerator: Accelerator,
                   dtype: torch.dtype, device: torch.device, plan: Plan):
    """Step 6 with ``quant``: quantize the plan's linears (each rank its own shards, after
    sharding, so scales follow their rows) and cast/move the rest; None without ``quant``."""
    if cfg.quant is None:
        return None
    if plan.stages is not None:  # this stage's linears; with lm_head its part of the head
        from .pipeline.quant import quantize_stage

        report = quantize_stage(model, cfg.quant, accelerator, dtype, device, plan)
        log.info("shardwise: %s", report.summary())
        return report
    from .quant import quantize_model

    report = quantize_model(model, cfg.quant, accelerator, dtype, device=device,
                            plan=plan)
    log.info("shardwise: %s", report.summary())
    return report


def _build_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The dtype a skeleton is built in: the requested one (``None``/``"auto"``: the
    checkpoint's own, from its config)."""
    return dtype if isinstance(dtype, torch.dtype) else None

"""Running the matrix in this process: load each model once, time the plain Hugging Face
baseline on it, then each shardwise variant: ``init_inference`` transforms a copy of the model
in place (the last variant transforms the model itself), and shardwise is timed on it.

The baseline runs first, on the loaded model, because shardwise transforms in place (injection
replaces modules); with one shardwise variant both share one copy of the weights, with several
at most two copies live at once. Every failure (loading, the engine, a cell) becomes a
``failed`` record with its error, and the run goes on.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
from dataclasses import asdict
from functools import partial
from typing import Any, Callable, Iterable, NamedTuple

import torch
import torch.distributed as dist

from ..accelerator import Accelerator, dtype_name
from ..config import parse_dtype
from ..generation import timed_generate
from ..transforms import model_dtype
from .offload import OffloadMeter, process_memory
from .plan import Cell, ModelSpec, Plan, Variant, is_baseline
from .presets import build_preset
from .roofline import (RoutingCounter, active_parameters, expert_modules, moe_decode_bytes,
                       nonembedding_parameters, weight_bytes)

#: Text the prompt is cut from (repeated as needed) when the model has a tokenizer.
PROMPT_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had taught him. From the lamp room he could see the fishing boats returning "
    "across the bay, their lanterns swaying with the swell, and beyond them the dark line of "
    "the storm that the radio had promised since morning. He trimmed the wick, wound the clock "
    "that turned the great lens, and wrote the time and the weather in the log. ")

Progress = Any  # a tqdm bar, or anything with update(n) and set_description(str)


def record(spec: ModelSpec, variant: str, cell: Cell, **fields: Any) -> dict[str, Any]:
    """A run record: one variant on one cell of one model (raw samples, no figures yet)."""
    base = {"model": spec.name, "model_kind": spec.kind, "variant": variant,
            "baseline": is_baseline(variant), **asdict(cell), "status": "ok", "error": None,
            "dtype": None, "kernel_dtype": None, "world_size": 1, "weight_bytes": None,
            "nonembedding_params": None, "active_params": None, "decode_bytes": None,
            "decode_bytes_method": None,
            "peak_memory_bytes": None, "samples": {"warmup": [], "repeats": []}}
    base.update(fields)
    return base


def error_text(exc: BaseException) -> str:
    """``Type: message`` of an exception, for a failed record."""
    return f"{type(exc).__name__}: {exc}"


def load(spec: ModelSpec, dtype: torch.dtype | None, seed: int):
    """``(model, tokenizer)`` of ``spec`` in ``dtype`` (None: its own); presets have no tokenizer.
    Loaders' own progress bars are silenced (the bench shows one display)."""
    if spec.kind == "preset":
        return build_preset(spec.name, dtype, seed), None
    from ..models import load_model

    gguf = str(spec.path).endswith(".gguf")
    with quiet_loader_bars():
        # a GGUF file is read in its own dtype and cast after: asked for another dtype,
        # transformers warns about packed-weight kernels that the dequantizing path never uses
        model, tokenizer = load_model(spec.path, None if gguf else dtype)
    if gguf and dtype is not None:
        model.to(dtype=dtype)
    return model, tokenizer


@contextlib.contextmanager
def quiet_loader_bars():
    """Silence transformers' progress bars while loading: its weight-loading bars (its own
    switch) and the GGUF converter's, which calls tqdm directly (swapped for a disabled tqdm
    in that module for the duration, then put back)."""
    from functools import partial

    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    gguf = _gguf_module()
    original = getattr(gguf, "tqdm", None)
    try:
        hf_logging.disable_progress_bar()
        if original is not None:
            gguf.tqdm = partial(tqdm, disable=True)
        yield
    finally:
        if original is not None:
            gguf.tqdm = original
        if was_enabled:
            hf_logging.enable_progress_bar()


def _gguf_module():
    """transformers' GGUF loading module, or None where this transformers has none."""
    try:
        from transformers import modeling_gguf_pytorch_utils
    except ImportError:
        return None
    return modeling_gguf_pytorch_utils


def make_inputs(tokenizer, vocab_size: int, cell: Cell, seed: int = 0) -> dict[str, torch.Tensor]:
    """``input_ids`` (batch × prompt_len) and an all-ones ``attention_mask``: the prompt text
    tokenized, repeated and cut to length (row ``i`` starting at its ``i``-th token), or
    fixed-seed random ids without a tokenizer. The rows differ so that an MoE model routes
    them as it would different requests (identical rows all pick the same experts)."""
    if tokenizer is not None:
        ids = tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
        need = cell.prompt_len + cell.batch
        text = ids * (need // len(ids) + 1)
        input_ids = torch.tensor([text[i:i + cell.prompt_len] for i in range(cell.batch)])
    else:
        gen = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, vocab_size, (cell.batch, cell.prompt_len), generator=gen)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def generation_kwargs(model, new_tokens: int) -> dict[str, Any]:
    """Greedy decoding of exactly ``new_tokens`` tokens (end-of-sequence suppressed until then)."""
    gen_config = getattr(model, "generation_config", None)
    pad = getattr(gen_config, "pad_token_id", None)
    if pad is None:
        eos = getattr(gen_config, "eos_token_id", None)
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    return {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
            "pad_token_id": pad}


def check_positions(model, cell: Cell) -> None:
    """Refuse a cell longer than the model's position table (it would fail mid-run)."""
    from ..models import max_positions

    limit = max_positions(getattr(model, "config", None))
    if limit is not None and cell.prompt_len + cell.new_tokens > limit:
        raise ValueError(f"prompt {cell.prompt_len} + new tokens {cell.new_tokens} exceed the "
                         f"model's {limit} positions; use shorter --prompt-len/--new-tokens")


def time_generate(generate_on: Any, inputs: dict, kwargs: dict, new_tokens: int,
                  accelerator: Accelerator) -> dict:
    """One timed ``generate`` (on a model or an engine): ``{"prefill_s", "per_token_s"}``;
    fails if it stopped before ``new_tokens``."""
    _, timings = timed_generate(generate_on, inputs, accelerator.synchronize, **kwargs)
    if timings.new_tokens != new_tokens:
        raise RuntimeError(f"generate produced {timings.new_tokens} tokens, not {new_tokens}")
    return {"prefill_s": timings.prefill_s, "per_token_s": list(timings.per_token_s)}


def measure_cell(generate_on: Any, model, inputs: dict, cell: Cell, plan: Plan,
                 accelerator: Accelerator, progress: Progress, rec: dict,
                 meter: OffloadMeter | None = None, stages: Any = None) -> dict:
    """Fill ``rec`` with warm-up and repeat samples, the peak memory of this cell and the bytes
    a decode step reads (for an MoE model, the experts routed to during the timed repeats are
    counted: see :func:`~.roofline.moe_decode_bytes`); with a ``meter`` (an offloading
    variant), ``rec["offload"]``: what the engine streamed during the timed repeats and the
    process's peak RSS over the cell; with ``stages`` (the engine's pipeline report, --pp),
    ``rec["pipeline"]``: every stage's busy time and bubble over the timed repeats' forwards
    (:meth:`~shardwise.pipeline.PipelineReport.finish_steps`)."""
    check_positions(model, cell)
    kwargs = generation_kwargs(model, cell.new_tokens)
    accelerator.reset_peak_memory()
    if meter is not None:
        meter.start_cell()
    counter = RoutingCounter(model)
    for phase, count in (("warmup", plan.warmup), ("repeats", plan.repeats)):
        if phase == "repeats" and meter is not None:
            meter.start_timed()
        if phase == "repeats" and stages is not None:
            stages.start_steps()
        with counter if phase == "repeats" else contextlib.nullcontext():
            for _ in range(count):
                counter.next_generate()
                rec["samples"][phase].append(time_generate(generate_on, inputs, kwargs,
                                                           cell.new_tokens, accelerator))
                progress.update(1)
    accelerator.synchronize()
    rec["peak_memory_bytes"] = accelerator.peak_memory()
    rec["decode_bytes"], rec["decode_bytes_method"] = moe_decode_bytes(model, counter, cell.batch)
    if meter is not None:
        rec["offload"] = meter.finish()
    if stages is not None and (stats := stages.finish_steps()) is not None:
        rec["pipeline"] = stats.to_dict()
    return rec


class Prepared(NamedTuple):
    """A variant ready to time: what ``generate`` is called on, the module it runs, extra
    record fields, and the engine's offload report (None: the weights are resident)."""

    generate_on: Any
    module: Any
    extra: dict[str, Any]
    offload: Any = None
    #: the engine's pipeline report (``engine.stages``, --pp), None without stages
    stages: Any = None


def prepare_baseline(model, dtype: torch.dtype | None, accelerator: Accelerator,
                     experts: str | None = None):
    """The plain HF model on the accelerator's device in ``dtype`` (the accelerator vetoes
    dtypes it cannot run), its MoE blocks running HF's ``experts`` implementation (None: HF's
    own default; :func:`bench_model` puts the model's own back for the shardwise variants);
    returns ``(what to call generate on, module, extra record fields)``."""
    dtype = accelerator.check_dtype(dtype or model_dtype(model))
    model.to(device=accelerator.device(), dtype=dtype)
    if experts is not None:
        model.set_experts_implementation(experts)
    return Prepared(model, model, {})


#: What an experts module given an instance forward by shardwise (its MoE step) runs.
SHARDWISE_EXPERTS = "shardwise moe kernels"


def experts_implementation(module) -> str | None:
    """What the experts of an MoE ``module`` run: HF's experts implementation (its config's)
    where they are HF's modules running their own forward; :data:`SHARDWISE_EXPERTS` where
    shardwise gave them an instance forward; ``shardwise <Class>`` for a module shardwise put
    in their place (quantized experts); several joined by ``/``. None for a dense model or an
    HF one whose config does not say."""
    hf = getattr(getattr(module, "config", None), "_experts_implementation", None)
    ran = []
    for experts in expert_modules(module):
        if type(experts).__module__.startswith("transformers."):
            name = SHARDWISE_EXPERTS if "forward" in vars(experts) else hf
        else:
            name = f"shardwise {type(experts).__name__}"
        if name is not None and name not in ran:
            ran.append(name)
    return "/".join(ran) or None


def prepare_shardwise(model, plan: Plan, variant: Variant, accelerator: Accelerator):
    """``init_inference`` on ``model`` (in place) with ``variant``'s options; returns
    :class:`Prepared` ``(what generate is called on, engine.module, extra record fields,
    engine.offload)``: generate runs on the engine where it is an injected decoder (shardwise's
    decode loop, :func:`generate_target`), else on the engine's module, as a user's code does
    (the inputs are already on the device, and every rank under tensor parallelism builds the
    same ones). The engine, its graphs and its cache go with the
    module when the variant is done (``engine.close()`` would rebuild the original weights of a
    model that is dropped anyway)."""
    from ..engine import init_inference

    engine = init_inference(model, **plan.engine_kwargs(variant))
    return Prepared(generate_target(engine, variant), engine.module,
                    {"kernel_dtype": kernel_dtypes(engine)},
                    getattr(engine, "offload", None), getattr(engine, "stages", None))


class HFLoop:
    """``engine.generate`` with shardwise's own decode loop turned off (Hugging Face's
    ``generate`` loop around the engine's step): the ``hf_loop`` variant."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine.generate(*args, shardwise_fast_loop=False, **kwargs)


def generate_target(engine: Any, variant: Variant) -> Any:
    """What a shardwise variant's ``generate`` is called on: an injected decoder engine itself
    (its ``generate`` runs shardwise's decode loop; with ``variant.hf_loop`` HF's loop, through
    :class:`HFLoop`), otherwise the engine's module, as a user's code calls it (pipeline stages
    and un-injected models run HF's ``generate`` either way)."""
    if engine._stack is None or engine.stages is not None:
        return engine.module
    return HFLoop(engine) if variant.hf_loop else engine


def kernel_dtypes(engine: Any) -> str | None:
    """The activation dtypes the quantized layers' kernels run in, when the engine reports
    them (``engine.quantization``), as short names joined by ``/``; None otherwise."""
    report = getattr(engine, "quantization", None)
    return "/".join(report.kernel_dtypes()) or None if report is not None else None


def run_variant(variant: str, prepare: Callable, tokenizer, spec: ModelSpec, plan: Plan,
                accelerator: Accelerator, progress: Progress,
                rss_before_load: int | None = None) -> list[dict]:
    """All cells of one variant of one model (``prepare`` returns its :class:`Prepared`); a
    failure fails that cell (or, while preparing, every cell) and the rest go on.
    ``rss_before_load``: the process's resident set before the model was loaded, which an
    offloading variant's RSS growth is counted from."""
    steps = plan.warmup + plan.repeats
    world = _world_size()
    progress.set_description(f"{spec.name} {variant}: preparing"
                             + ("" if is_baseline(variant) else " (init_inference)"))
    try:
        generate_on, module, extra, offload, stages = prepare()
    except Exception as exc:  # the engine's or the device's error, reported per row
        progress.update(steps * len(plan.cells))
        return [record(spec, variant, c, status="failed", error=error_text(exc),
                       world_size=world) for c in plan.cells]
    facts = {"dtype": dtype_name(model_dtype(module)), "world_size": world,
             "weight_bytes": weight_bytes(module),
             "nonembedding_params": nonembedding_parameters(module),
             "active_params": active_parameters(module), **extra}
    if (ran := experts_implementation(module)) is not None:
        facts["experts_implementation"] = ran
    records = []
    for cell in plan.cells:
        progress.set_description(f"{spec.name} {variant} b{cell.batch} p{cell.prompt_len} "
                                 f"n{cell.new_tokens}")
        rec = record(spec, variant, cell, **facts)
        inputs = make_inputs(tokenizer, _vocab_size(module, tokenizer), cell, plan.seed)
        try:
            meter = OffloadMeter(offload, rss_before_load) if offload is not None else None
            measure_cell(generate_on, module, _on(inputs, accelerator), cell, plan,
                         accelerator, progress, rec, meter, stages)
        except Exception as exc:
            rec.update(status="failed", error=error_text(exc))
            progress.update(steps - len(rec["samples"]["warmup"]) - len(rec["samples"]["repeats"]))
        records.append(rec)
    return records


def bench_model(spec: ModelSpec, plan: Plan, accelerator: Accelerator, baseline: bool,
                variants: Iterable[Variant], progress: Progress) -> list[dict]:
    """Load ``spec`` once and run the HF baseline (when ``baseline``) and then ``variants`` in
    order, each shardwise variant on its own copy of the model (the last on the model itself)."""
    variants = list(variants)
    names = ([plan.baseline_name] if baseline else []) + [plan.variant_name(v) for v in variants]
    base_dtype = parse_dtype(plan.baseline_dtype)
    progress.set_description(f"loading {spec.name}")
    rss_before_load = process_memory().get("rss")
    try:
        model, tokenizer = load(spec, base_dtype, plan.seed)
    except Exception as exc:
        progress.update((plan.warmup + plan.repeats) * len(plan.cells) * len(names))
        return [record(spec, v, c, status="failed", error=f"loading failed: {error_text(exc)}")
                for v in names for c in plan.cells]
    records = []
    if baseline:
        own = experts_implementation(model)
        records += run_variant(plan.baseline_name,
                               partial(prepare_baseline, model, base_dtype, accelerator,
                                       plan.baseline_experts),
                               tokenizer, spec, plan, accelerator, progress)
        if own is not None and experts_implementation(model) != own:
            model.set_experts_implementation(own)  # the variants start from the model as loaded
    for i, variant in enumerate(variants):
        last = i == len(variants) - 1
        records += _run_on_copy(model if last else None, model, variant, tokenizer, spec, plan,
                                accelerator, progress, rss_before_load)
    del model
    release(accelerator)
    return records


def _run_on_copy(own, pristine, variant: Variant, tokenizer, spec: ModelSpec, plan: Plan,
                 accelerator: Accelerator, progress: Progress,
                 rss_before_load: int | None = None) -> list[dict]:
    """Run ``variant`` on ``own`` (the model itself, transformed in place) or, when None, on a
    deep copy of ``pristine`` that is dropped afterwards."""
    name = plan.variant_name(variant)

    def prepare():
        target = own if own is not None else copy.deepcopy(pristine)
        if variant.offload is not None:  # the baseline left it on the device: offload streams
            target.to("cpu")             # it from host memory, as a user's model loads
        return prepare_shardwise(target, plan, variant, accelerator)

    try:
        return run_variant(name, prepare, tokenizer, spec, plan, accelerator, progress,
                           rss_before_load)
    finally:
        release(accelerator)


def run_local(plan: Plan, accelerator: Accelerator, baseline: bool, variants: list[Variant],
              progress: Progress) -> list[dict]:
    """Every model of ``plan`` with the baseline (when ``baseline``) and ``variants`` in this
    process."""
    records = []
    for spec in plan.models:
        records += bench_model(spec, plan, accelerator, baseline, variants, progress)
    return records


def release(accelerator: Accelerator) -> None:
    """Return freed memory to the device so the next model starts clean."""
    gc.collect()
    empty_cache = getattr(accelerator.module, "empty_cache", None)
    if callable(empty_cache):
        empty_cache()


def _on(inputs: dict, accelerator: Accelerator) -> dict:
    device = accelerator.device()
    return {k: v.to(device) for k, v in inputs.items()}


def _vocab_size(model, tokenizer) -> int:
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocab or len(tokenizer)


def _world_size() -> int:
    """Ranks of this run: the process group's size, or torchrun's WORLD_SIZE (1 without)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))

"""shardwise's own decode loop for ``engine.generate`` on an injected decoder.

Why: Hugging Face's ``generate`` spends its own host time on every token —
``prepare_inputs_for_generation``, model-kwargs updates, output dataclasses, the shell's
forward, the cache object's bookkeeping, the stopping criteria — around a decode step that,
with graph capture, is one replay. On a fast device (or a small model on a CPU) that host work
is most of the per-token time. This loop runs the prompt through the model as ``generate``
does, then calls the injected stack's decode step directly, step after step: the captured
step (:class:`~shardwise.inject.capture.DecodeGraphs`, its logits taken from the captured
head) or, without graphs, the same eager step the stack's forward runs; inputs are
preallocated tensors advanced in place, and the next token is chosen on the device.

What it does exactly as ``generate`` does (the same tensor back, the same streamer calls, the
same random numbers drawn): greedy search and multinomial sampling (``num_beams=1``) with
``max_new_tokens``/``max_length``, ``min_new_tokens``/``min_length``, ``eos_token_id`` (one or
several), ``pad_token_id``, ``do_sample`` with ``temperature``/``top_k``/``top_p`` (transformers'
own warper classes, in ``generate``'s order; the two minimum-length processors as
:class:`EosFloor`, the same scores without their per-step vocabulary mask), a ``streamer``, ``input_ids`` with a
left-padded ``attention_mask``. The settings come from ``generate``'s own preparation
(:func:`plan_loop`: the model's ``generation_config`` merged with the call's keywords, the
special tokens, the inferred mask, the lengths), so defaults, warnings and errors are HF's.
Anything else — a setting of the merged config that differs from transformers' defaults and is
not in :data:`SUPPORTED_SETTINGS`, a model keyword, ``logits_processor``, ``stopping_criteria``,
a tokenizer, an assistant — makes :func:`plan_loop` name it, and ``engine.generate`` runs
``module.generate`` unchanged instead: nothing is ignored.
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.generation.logits_process import (LogitsProcessorList,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from .cache import DecodeRows, StaticKVCache
from .capture import output_head
from .layers import InjectedModel

log = logging.getLogger(__name__)

#: generation-config fields this loop implements exactly, whatever their value (the others
#: must keep transformers' default value, else the call runs HF's ``generate``)
SUPPORTED_SETTINGS = frozenset({
    "max_new_tokens", "max_length", "min_new_tokens", "min_length", "eos_token_id",
    "pad_token_id", "bos_token_id", "do_sample", "temperature", "top_k", "top_p",
    "use_cache", "return_dict_in_generate", "transformers_version"})

#: settings the loop implements only at one value (``use_cache=False`` recomputes the whole
#: sequence every step; ``return_dict_in_generate`` asks for an output object)
REQUIRED_VALUES = {"use_cache": True, "return_dict_in_generate": False}

#: model keywords (beside the settings) the loop takes
MODEL_INPUTS = frozenset({"attention_mask"})

#: ``generate``'s own arguments that only HF's loop implements (any given → HF's loop)
HF_ONLY_ARGUMENTS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                     "synced_gpus", "assistant_model", "negative_prompt_ids",
                     "negative_prompt_attention_mask", "custom_generate", "tokenizer",
                     "trust_remote_code", "assistant_tokenizer", "inputs_embeds")

#: model-config attributes of shells that change the logits after the output head (e.g.
#: Gemma's soft-capping): the loop takes the head's output as the logits, so such a shell runs
#: HF's loop. None of the injected families has one; the table guards plugins' families.
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                        "output_multiplier_scale")

#: HF's private preparation steps the plan calls, so that its settings are exactly the ones
#: ``generate`` would use (a transformers without one of them: HF's loop runs)
_HF_STEPS = ("_prepare_generation_config", "_prepare_special_tokens",
             "_prepare_attention_mask_for_generation", "_prepare_generated_length",
             "_validate_generated_length")


@dataclass
class LoopPlan:
    """One ``generate`` call as this loop runs it (built by :func:`plan_loop`).

    Attributes:
        input_ids: the prompt [batch, prompt_len] int64.
        attention_mask: [batch, prompt_len] (1 = real token, left padding only), or None when
            every token is real (as ``generate`` drops an all-ones mask).
        max_length: prompt plus new tokens at most (``generate``'s ``max_length``).
        processors: the logits processors and warpers ``generate`` would apply, in its order.
        do_sample: multinomial sampling (else greedy).
        eos: the end-of-sequence ids [n] int64, or None (no eos stopping, no padding).
        pad: the id finished rows continue with [] int64 (None only without eos).
        streamer: the streamer, or None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    max_length: int
    processors: LogitsProcessorList
    do_sample: bool
    eos: torch.Tensor | None
    pad: torch.Tensor | None
    streamer: Any = None


def plan_loop(module: nn.Module, stack: InjectedModel, args: tuple,
              kwargs: dict[str, Any]) -> LoopPlan | str:
    """The :class:`LoopPlan` of ``module.generate(*args, **kwargs)`` when this loop runs it
    exactly, else the reason it does not (a short phrase naming the setting or argument): the
    caller then runs ``module.generate`` itself. Nothing is changed on the model; HF's own
    preparation steps run on a copy of the settings (their warnings are the ones ``generate``
    would log)."""
    why = _structural_reason(module, stack)
    if why is not None:
        return why
    kwargs = dict(kwargs)
    if len(args) > 1:
        return "positional arguments after the inputs"
    if args:
        if "input_ids" in kwargs or "inputs" in kwargs:
            return "inputs given twice"
        kwargs["inputs"] = args[0]
    inputs = kwargs.pop("inputs", None)
    if inputs is None:
        inputs = kwargs.pop("input_ids", None)
    if not isinstance(inputs, torch.Tensor) or inputs.dim() != 2 or inputs.dtype != torch.int64 \
            or inputs.shape[0] == 0 or inputs.shape[1] == 0:
        return "inputs that are not a non-empty [batch, tokens] int64 tensor of input_ids"
    given = [name for name in HF_ONLY_ARGUMENTS if kwargs.get(name) is not None]
    if given:
        return ", ".join(given)
    streamer = kwargs.pop("streamer", None)
    generation_config = kwargs.pop("generation_config", None)
    if any(not hasattr(module, step) for step in _HF_STEPS) or not hasattr(
            GenerationConfig, "_get_default_generation_params"):
        return "a transformers version without generate's preparation steps"
    has_default_max = (kwargs.get("max_length") is None and (
        generation_config is None or generation_config.max_length is None)
        and module.generation_config.max_length is None)
    has_default_min = (kwargs.get("min_length") is None and (
        generation_config is None or generation_config.min_length is None)
        and module.generation_config.min_length is None)
    try:
        config, model_kwargs = module._prepare_generation_config(generation_config, **kwargs)
    except ValueError as exc:  # HF's loop raises the same
        return f"settings generate refuses ({exc})"
    except TypeError:  # another transformers' signature
        return "a transformers version whose generate prepares its settings otherwise"
    extra = sorted(set(model_kwargs) - MODEL_INPUTS)
    if extra:
        return ", ".join(extra)
    why = _settings_reason(module, config)
    if why is not None:
        return why
    mask = model_kwargs.get("attention_mask")
    return _finish_plan(module, config, inputs, mask, streamer, has_default_max, has_default_min)


def _structural_reason(module: nn.Module, stack: InjectedModel) -> str | None:
    """Why the model itself cannot run this loop (None: it can)."""
    if not isinstance(stack, InjectedModel):
        return "not an injected decoder"
    if stack.stage is not None:
        return "pipeline stages"
    if getattr(module.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if output_head(module) is None:
        return "a model without an output head module"
    text = module.config.get_text_config() if hasattr(module.config, "get_text_config") \
        else module.config
    post = [name for name in LOGIT_POSTPROCESSING
            if getattr(text, name, None) not in (None, 1, 1.0)]
    if post:
        return f"a shell that post-processes the logits ({', '.join(post)})"
    return None


def _settings_reason(module: nn.Module, config: GenerationConfig) -> str | None:
    """The settings of the merged config this loop does not implement (None: all are)."""
    defaults = GenerationConfig()
    defaults.update(**module.generation_config._get_default_generation_params(),
                    defaults_only=True)
    reference = defaults.to_dict()
    changed = [key for key, value in config.to_dict().items()
               if not key.startswith("_") and key not in SUPPORTED_SETTINGS
               and not _same(value, reference.get(key))]
    changed += [f"{key}={getattr(config, key)!r}" for key, value in REQUIRED_VALUES.items()
                if getattr(config, key) != value]
    return ", ".join(changed) if changed else None


def _same(value: Any, default: Any) -> bool:
    """Whether a setting keeps its default: equal, or unset either way (None or False: e.g.
    ``output_attentions`` False copied from a model config where the default is None)."""
    return value == default or (value in (None, False) and default in (None, False))


def _finish_plan(module: nn.Module, config: GenerationConfig, inputs: torch.Tensor,
                 mask: torch.Tensor | None, streamer: Any, has_default_max: bool,
                 has_default_min: bool) -> LoopPlan | str:
    """``generate``'s steps 3-8 on the merged ``config``: special tokens, the attention mask
    (inferred from padding as HF does when none is given), the lengths, the processors."""
    batch, length = inputs.shape
    device = inputs.device
    module._prepare_special_tokens(config, mask is not None, device=device, batch_size=batch)
    if mask is None:
        mask = module._prepare_attention_mask_for_generation(inputs, config, {})
    if mask.dim() != 2 or mask.shape != inputs.shape:
        return "an attention_mask that is not [batch, tokens] like the inputs"
    if bool((mask == 1).all()):
        mask = None  # generate drops an all-ones mask
    elif bool((mask[:, -1] == 0).any()):
        return "right padding"
    config = module._prepare_generated_length(
        generation_config=config, has_default_max_length=has_default_max,
        has_default_min_length=has_default_min, model_input_name="input_ids",
        inputs_tensor=inputs, input_ids_length=length)
    module._validate_generated_length(config, length, has_default_max)
    if config.max_length <= length:  # HF's loop runs (and warns or refuses) as it does
        return f"max_length {config.max_length} not above the prompt's {length} tokens"
    eos = config._eos_token_tensor
    return LoopPlan(inputs, mask, int(config.max_length), _processors(config, length, device),
                    bool(config.do_sample), eos, config._pad_token_tensor, streamer)


def _processors(config: GenerationConfig, prompt_len: int,
                device: torch.device) -> LogitsProcessorList:
    """The processors ``generate`` builds for these settings (``_get_logits_processor``'s
    order; the ones this loop's settings can enable): transformers' own warpers, the minimum
    lengths as one :class:`EosFloor`."""
    out = LogitsProcessorList()
    eos = config._eos_token_tensor
    floor = 0  # the shortest sequence (prompt included) that may end with an eos id
    if config.min_length is not None and eos is not None and config.min_length > 0:
        floor = config.min_length
    if config.min_new_tokens is not None and eos is not None and config.min_new_tokens > 0:
        floor = max(floor, prompt_len + config.min_new_tokens)
    if floor:
        out.append(EosFloor(floor, eos))
    if config.do_sample:  # num_beams is 1 here: min_tokens_to_keep 1
        if config.temperature is not None and config.temperature != 1.0:
            out.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            out.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
        if config.top_p is not None and config.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    return out


class EosFloor:
    """transformers' ``MinLengthLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor``
    (both first in ``generate``'s order, and commuting) as one: the eos ids' scores are -inf
    while the sequence (prompt included) is shorter than ``length``, the scores unchanged after.
    Theirs build a vocabulary-sized mask at every step (an ``arange`` and an ``isin`` over the
    vocabulary, a clone and a ``where``: ~0.5 ms a token at a 49k vocabulary on a CPU, 5% of a
    small model's step); this indexes the eos ids, and only while it must."""

    def __init__(self, length: int, eos: torch.Tensor) -> None:
        self.length, self.eos = length, eos.reshape(-1)
        self._ids: torch.Tensor | None = None  # the eos ids inside the vocabulary

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] >= self.length:
            return scores
        if self._ids is None:  # an id beyond the vocabulary masks nothing, as theirs
            self._ids = self.eos[(self.eos >= 0) & (self.eos < scores.shape[-1])]
        scores = scores.clone()
        scores[:, self._ids] = -math.inf
        return scores


# ----- the loop ------------------------------------------------------------------------------------

def run_loop(module: nn.Module, stack: InjectedModel, plan: LoopPlan) -> torch.Tensor:
    """Generate with ``plan`` (see the module docstring): the prompt followed by the new
    tokens, [batch, prompt_len + new] int64, rows finished early continued with the pad id —
    the tensor ``module.generate`` returns for the same call.

    Host syncs that remain, and why: with a streamer, one per step (it takes the tokens on the
    host, as in HF's loop; the eos check then reads those host tokens); without one, with eos
    ids, the all-finished flag of each step is read on the host — one step late where the
    device has events (copied without blocking, the next step already queued; the extra step's
    tokens are all padding and are cut), at once where it has none (a CPU, where the work is
    done by then anyway). Once per call, before this loop, :func:`plan_loop` reads the
    prompt's padding and the eos ids. No other step reads device values on the host."""
    streamer, ids = plan.streamer, plan.input_ids
    batch, prompt_len = ids.shape
    device = ids.device
    if streamer is not None:
        streamer.put(ids.cpu())
    # every token of the call [batch, max_length]; processors see the filled prefix
    out = torch.empty(batch, plan.max_length, dtype=torch.int64, device=device)
    out[:, :prompt_len] = ids
    logits, cache = _prefill(module, plan)
    step = _DecodeStep(module, stack, cache, plan)
    finished = _FinishedCheck(device, streamer is None and plan.eos is not None, plan.eos)
    unfinished = torch.ones(batch, dtype=torch.int64, device=device)
    length = prompt_len
    while True:
        tokens = _select(plan, out[:, :length], logits)  # [batch] on the device
        if plan.eos is not None:  # rows finished before this step continue with the pad id
            tokens = tokens * unfinished + plan.pad * (1 - unfinished)
        out[:, length] = tokens
        length += 1
        if plan.eos is not None:
            unfinished = unfinished & ~torch.isin(tokens, plan.eos)
        ended = False  # every row finished: read from host tokens, or the device flag below
        if streamer is not None:
            host = tokens.cpu()  # the step's one sync: the streamer takes host tokens
            ended = plan.eos is not None and finished.ended_on_host(host)
            streamer.put(host)
        if length >= plan.max_length or ended:
            break
        if streamer is None and plan.eos is not None and finished.all_done(
                unfinished, length, now=not step.fits()):
            break
        logits = step(tokens)
    length = finished.trim(length)
    if streamer is not None:
        streamer.end()
    return out[:, :length].contiguous()


def _select(plan: LoopPlan, seen: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The next token of each row [batch] from the logits [batch, vocab] after the tokens
    ``seen`` [batch, length], as ``generate``'s sample loop chooses it (float32 scores, the
    processors, then argmax or one multinomial draw)."""
    scores = logits.float()
    if plan.processors:
        scores = plan.processors(seen, scores)
    if plan.do_sample:
        probs = nn.functional.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    return torch.argmax(scores, dim=-1)


def _prefill(module: nn.Module, plan: LoopPlan) -> tuple[torch.Tensor, StaticKVCache]:
    """The prompt through the model's own forward, with the inputs ``generate`` gives it
    (positions counted from each row's first real token, the last position's logits only) →
    (logits [batch, vocab], the static cache it filled)."""
    params = inspect.signature(module.forward).parameters
    kwargs: dict[str, Any] = {"attention_mask": plan.attention_mask, "use_cache": True}
    if "position_ids" in params:
        kwargs["position_ids"] = _prompt_positions(plan)
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    output = module(input_ids=plan.input_ids, **kwargs)
    cache = getattr(output, "cache", None)
    if cache is None:
        cache = getattr(output, "past_key_values", None)
    if not isinstance(cache, StaticKVCache):
        raise RuntimeError(f"the injected model's prompt forward returned {type(cache).__name__} "
                           f"as its cache, not shardwise's static cache")
    return output.logits[:, -1], cache


def _prompt_positions(plan: LoopPlan) -> torch.Tensor:
    """[batch, prompt_len] positions as ``generate`` computes them: from the mask (padding at
    0), else ``0 .. prompt_len - 1``."""
    ids, mask = plan.input_ids, plan.attention_mask
    if mask is None:
        return torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
    positions = mask.long().cumsum(-1) - 1
    return positions.masked_fill(mask == 0, 0)


class _DecodeStep:
    """One decode step of the injected stack over ``cache``, its inputs preallocated and
    advanced in place: token ids [batch, 1], positions [batch, 1] (each row's real tokens so
    far, as ``generate`` counts them; or the cache length where the model takes no positions
    and does not count them from the mask), the per-row write index and lengths [batch]."""

    def __init__(self, module: nn.Module, stack: InjectedModel, cache: StaticKVCache,
                 plan: LoopPlan) -> None:
        self.stack, self.cache, self.head = stack, cache, output_head(module)
        batch, device = plan.input_ids.shape[0], plan.input_ids.device
        self.ids = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        counted = ("position_ids" in inspect.signature(module.forward).parameters
                   or stack.spec.positions.from_mask)
        if counted and plan.attention_mask is not None:
            first = plan.attention_mask.long().sum(-1, keepdim=True)  # [batch, 1] real tokens
        else:
            first = torch.full((batch, 1), cache.length, dtype=torch.int64, device=device)
        self.rows = DecodeRows(position_ids=first,
                               write_index=torch.full((batch,), cache.length, dtype=torch.int64,
                                                      device=device),
                               lengths=torch.full((batch,), cache.length + 1,
                                                  dtype=torch.int64, device=device),
                               starts=cache.starts)
        self.captured = stack.graphs is not None and cache.graph_key is not None

    def fits(self) -> bool:
        """Whether the cache holds one more token (else the next step raises, as HF's would)."""
        return self.cache.length < self.cache.buffers.max_tokens

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` [batch] → the next logits [batch, vocab]."""
        cache, stack = self.cache, self.stack
        cache.reserve(1)  # MaxTokensError at the step generate would raise it
        self.ids.copy_(tokens[:, None])
        if self.captured:
            hidden = stack.graphs.run(stack, cache, self.ids, self.rows)
        else:  # the eager step the stack's forward runs
            hidden = stack.decode_eagerly(cache, stack.parts.embed(self.ids), self.rows)
        cache.advance(1)
        for t in (self.rows.position_ids, self.rows.write_index, self.rows.lengths):
            t.add_(1)  # the next step's positions (queued after this step's reads of them)
        # the head as a module (its hooks run: the tensor-parallel vocab gather); with graphs
        # it answers from the captured head's logits (HeadFromGraph)
        return self.head(hidden)[:, -1]


class _FinishedCheck:
    """Whether every row has finished, read on the host as cheaply as the device allows: from
    the tokens a streamer already took to the host (:meth:`ended_on_host`); else, where the
    device has events and ``deferred``, each step's flag is copied without blocking and read
    after the next step is queued (so the device never waits for the host; the step run after
    the last row finished only added padding, and :meth:`trim` cuts it); else read at once."""

    def __init__(self, device: torch.device, deferred: bool,
                 eos: torch.Tensor | None = None) -> None:
        self.eos_host = eos.cpu() if eos is not None else None  # [n] int64, read once
        self.slots: list[tuple[torch.Tensor, Any]] = []
        self.pending: tuple[torch.Tensor, Any, int] | None = None
        self.done_at: int | None = None
        self.host_unfinished: torch.Tensor | None = None  # [batch] bool, from host tokens
        if deferred:
            try:
                self.slots = [(torch.zeros((), dtype=torch.bool).pin_memory(),
                               torch.Event(device=device, blocking=True)) for _ in range(2)]
            except (RuntimeError, TypeError, ValueError):  # no events (CPU) or no pinned memory
                self.slots = []

    def ended_on_host(self, tokens: torch.Tensor) -> bool:
        """With the step's tokens [batch] already on the host (a streamer took them): whether
        every row has now produced an eos id (counted on the host, no device read)."""
        ended = torch.isin(tokens, self.eos_host)
        self.host_unfinished = ~ended if self.host_unfinished is None else \
            self.host_unfinished & ~ended
        return not bool(self.host_unfinished.any())

    def all_done(self, unfinished: torch.Tensor, length: int, now: bool = False) -> bool:
        """After the step that made the sequences ``length`` long: stop now? ``now``: read
        this step's flag at once (the next step must not run unless needed: e.g. it would
        not fit the cache)."""
        done = unfinished.max() == 0
        if not self.slots or now:
            previous, self.pending = self.pending, None
            return self._read(previous) or bool(done)
        flag, event = self.slots[0]
        self.slots.reverse()
        flag.copy_(done, non_blocking=True)
        event.record()
        previous, self.pending = self.pending, (flag, event, length)
        return self._read(previous)

    def _read(self, entry: tuple | None) -> bool:
        """Whether a pending flag (None: none) says every row had finished at its length."""
        if entry is None:
            return False
        flag, event, at = entry
        event.synchronize()  # its step only: the one queued after it runs on
        if bool(flag):
            self.done_at = at
            return True
        return False

    def trim(self, length: int) -> int:
        """The length to return: where every row had finished, if a later step ran."""
        return self.done_at if self.done_at is not None else length

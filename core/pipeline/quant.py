"""Weight quantization of a pipeline stage, the output head included (``quant={"lm_head": ...}``).

Each rank quantizes the linears of its own stage (:func:`quantize_stage`; the other stages'
layers are stand-ins by then, so :func:`shardwise.quant.quantize_model` never sees them). The
output head runs on the last stage only, so ``lm_head`` is handled here:

* the **last stage** quantizes its head with the settings the whole model's head gets
  (:meth:`~shardwise.quant.QuantConfig.for_head` with the tie as planned on the whole model:
  a tied head's 8-bit default holds on the last stage although its embedding is a stand-in
  there);
* a head **tied** to the input embeddings is one table in the whole model, which a single
  process quantizes once and reads both ways (:mod:`shardwise.quant.tied`). With stages the two
  uses sit on two ranks, so each end stage holds its own copy of the table: the last stage as
  its quantized head, the **first stage** as a :class:`StageQuantEmbedding` — the table
  quantized once, exactly as the head is (same spec, same kernel packing), whose looked-up
  rows are dequantized. Why quantized and not full precision: the embedding then returns the
  very rows the single-process quantized model looks up, so the logits match it within fp32
  noise (a full-precision embedding would differ from it by the table's quantization error at
  the first layer, and that difference runs through every layer), and the first stage holds the
  quantized bytes, not the full table (its share of the balance shrinks as the head's does).

:func:`rehome_tied_table` covers ``checkpoint=``: the loader quantizes a tied table while
reading (the head's module, which the pipeline step then replaces on the first stage); the
first stage's embedding then gets the table as its own submodule.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
from torch import nn

from .. import ledger as _ledger
from ..quant import QuantConfig, QuantEmbedding, QuantLinear, Quantizer, parse_quant
from ..quant.modules import swap_quantized
from ..quant.transform import QUANT_ATTR, model_bytes, quantize_model
from .stages import StagePlan


class StageQuantEmbedding(QuantEmbedding):
    """The first pipeline stage's input embedding when the output head tied to it is quantized
    and runs on another rank: a :class:`~shardwise.quant.QuantEmbedding` that owns its table.

    ``forward(ids [...]) -> [..., embedding_dim]``: the rows ``ids`` of :attr:`table`,
    dequantized, as the single-process model's tied embedding returns them. The table is a
    :class:`~shardwise.quant.QuantLinear` registered as the submodule ``table`` (so it is moved,
    cast, counted and saved with the embedding; its matmul is never run here).
    """

    def __init__(self, table: QuantLinear, dtype: torch.dtype, padding_idx: int | None = None,
                 tied_to: str = "lm_head") -> None:
        super().__init__(table, dtype, padding_idx, tied_to)
        self.table = table  # a submodule: this rank's only holder of the table

    def extra_repr(self) -> str:
        return super().extra_repr() + ", the head runs on the last pipeline stage"


def quantize_stage(model: nn.Module, spec: QuantConfig | Mapping, accelerator: Any,
                   dtype: torch.dtype, device: torch.device, plan: Any):
    """The engine's quantization step on a pipeline stage (module docstring): this stage's
    linears as :func:`~shardwise.quant.quantize_model` picks them, plus with ``lm_head`` the
    head on the last stage and a tied table on the first. Returns the
    :class:`~shardwise.quant.QuantReport` (its config the whole ``spec``).

    The head (or tied table) is quantized from the weights as handed in, before the rest of
    the stage is cast, as :func:`~shardwise.quant.quantize_model` quantizes it without stages
    (so the packed table is bit-identical, and ``close()`` rebuilds the same dequantized
    weight in the dtype it had); it is put in place after."""
    config = spec if isinstance(spec, QuantConfig) else parse_quant(spec)
    stages: StagePlan = plan.stages
    if not config.lm_head or stages.head_name is None:
        return quantize_model(model, config, accelerator, dtype, device=device, plan=plan)
    quantizer = head_quantizer(config, accelerator, dtype, device, stages)
    end = _quantize_end(model, quantizer, stages)
    report = quantize_model(model, dataclasses.replace(config, lm_head=False), accelerator,
                            dtype, device=device, plan=plan)
    report.config = config
    if end is not None:
        _install_end(model, *end, quantizer, stages, dtype, report)
    report.bytes_after = model_bytes(model)
    return report


def head_quantizer(config: QuantConfig, accelerator: Any, dtype: torch.dtype,
                   device: torch.device, stages: StagePlan) -> Quantizer:
    """A :class:`~shardwise.quant.Quantizer` for the output head alone, with the head's
    settings as the whole model has them (tied or not: :attr:`StagePlan.tied`)."""
    head = stages.head_name
    quantizer = Quantizer(config, accelerator, dtype, device, [head], head)
    quantizer.source = "plan (pipeline stage: the output head)"
    if stages.tied:
        quantizer.tied[head] = stages.embed_name
    return quantizer


def _quantize_end(model: nn.Module, quantizer: Quantizer, stages: StagePlan):
    """(module name, the quantized table, the undo that rebuilds the replaced module's weight)
    for the part of the head this stage holds, the table not yet in place: the head on the
    last stage, the tied embedding (the same weight) on the first; None on a middle stage, or
    on the first when the head is not tied (it holds no part of it)."""
    head = stages.head_name
    if stages.last:
        name = head
        module = model.get_submodule(head)
        conv1d = not isinstance(module, nn.Linear)
        out_features, in_features = module.weight.shape[::-1] if conv1d else module.weight.shape
        bias = getattr(module, "bias", None)
    elif stages.first and stages.tied:
        name, conv1d, bias = stages.embed_name, False, None
        module = model.get_submodule(name)  # weight [vocab, hidden]: the head's
        out_features, in_features = module.weight.shape
    else:
        return None
    quantizer.check(head, in_features, out_features)
    table = quantizer.quantize_tensor_for(head, module.weight, bias, conv1d=conv1d)
    return name, table, _rebuild_weight(module, table)


def _install_end(model: nn.Module, name: str, table: QuantLinear, undo, quantizer: Quantizer,
                 stages: StagePlan, dtype: torch.dtype, report: Any) -> None:
    """Put ``table`` in place of module ``name`` (the head on the last stage; the embedding
    on the first, as a :class:`StageQuantEmbedding` over it), recorded in the active ledger
    with ``undo``, and add it to ``report``'s layers (on the first stage under the embedding's
    name, with the head's settings and kind)."""
    head = stages.head_name
    layer = quantizer.layers[head]
    new = table
    if not stages.last:
        old = model.get_submodule(name)
        new = StageQuantEmbedding(table, dtype, getattr(old, "padding_idx", None), head)
        report.notes.append(f"the input embedding {name!r} holds the table of the output head "
                            f"{head!r} tied to it, quantized as the last stage quantizes the "
                            f"head (int{layer.bits}, group size {layer.group_size})")
    swap_quantized(model, name, new, "quantized output head (pipeline stage)",
                   f"weight of {name!r} rebuilt by dequantizing its int{table.spec.bits} table "
                   f"(lossy: the float weight was not kept)", lambda _old: undo, ("weight",))
    report.layers[name] = dataclasses.replace(layer, name=name)


def _rebuild_weight(old: nn.Module, table: QuantLinear):
    """The undo of replacing ``old`` (the head, or the embedding holding its tied weight) by
    ``table``: ``old``'s weight (and bias) re-pointed at the dequantized table, in the dtype
    and on the device they have now (taken before the stage is cast: what ``close()`` gives
    back without stages too)."""
    weight, bias = old.weight, getattr(old, "bias", None)
    dtype, device, shape = weight.dtype, weight.device, tuple(weight.shape)
    bias_dtype = bias.dtype if isinstance(bias, torch.Tensor) else None

    @torch.no_grad()
    def undo() -> None:
        if device.type == "meta":
            old.weight.data = torch.empty(shape, dtype=dtype, device="meta")
            return
        w = table.dequantized_weight(dtype)  # [out, in]
        old.weight.data = (w if table.source == "linear" else w.t()).contiguous().to(device)
        if bias_dtype is not None and table.bias is not None:
            old.bias.data = table.bias.detach().to(device=device, dtype=bias_dtype)
    return undo


def rehome_tied_table(model: nn.Module, stages: StagePlan, embed: nn.Module,
                      head: nn.Module | None) -> None:
    """On the first stage, an embedding that reads a tied, quantized head's table (the loader
    quantized it while reading, :mod:`shardwise.quant.tied`) while the head is replaced by a
    stand-in: it becomes a :class:`StageQuantEmbedding` owning that table (recorded in the
    active ledger). Nothing to do otherwise."""
    if not (stages.first and not stages.last and isinstance(embed, QuantEmbedding)
            and not isinstance(embed, StageQuantEmbedding) and embed.head is head):
        return
    name = stages.embed_name
    new = StageQuantEmbedding(head, embed.weight_dtype, embed.padding_idx, embed.tied_to)
    for attr in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                 "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        setattr(new, attr, getattr(embed, attr))
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    _ledger.replace_module(parent, child, new, "pipeline: the first stage's tied table")
    report = getattr(model, QUANT_ATTR, None)  # the loader's: the table listed as this stage's
    layer = report.layers.pop(stages.head_name, None) if report is not None else None
    if layer is not None:
        report.layers[name] = dataclasses.replace(layer, name=name)


# ----- saving quantized stages (shardwise.checkpoint.saver.save_extended_stages) ----------------

def merge_manifests(infos: list[dict[str, Any] | None], plan: StagePlan
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the whole model's quantization manifest, its description entry) from every stage's
    manifest (``shardwise.quant.checkpoint.manifest``; None: a stage without quantized
    layers), for :func:`shardwise.checkpoint.saver.save_extended_stages`: the stages' layers
    together; the first stage's copy of a tied table (its :class:`StageQuantEmbedding`'s
    ``table``) left out, its tie recorded on the head's entry (the head holds the table, as
    in one process); settings, dtype and format from the stages that have them."""
    from ..quant.checkpoint import FORMAT_EXPERTS, description_entry

    merged: dict[str, Any] = {"layers": {}}
    table = f"{plan.embed_name}.table" if plan.embed_name else None
    tie = None
    for info in filter(None, infos):
        for key in ("format", "config", "dtype"):
            if info.get(key) is not None:
                merged.setdefault(key, info[key])
        for name, entry in info.get("layers", {}).items():
            if name == table:
                tie = entry.get("tied")
                continue
            merged["layers"][name] = entry
        if info.get("experts"):
            merged.setdefault("experts", {}).update(info["experts"])
    if tie is not None and plan.head_name in merged["layers"]:
        merged["layers"][plan.head_name] = {**merged["layers"][plan.head_name], "tied": tie}
    if merged.get("experts"):
        merged["format"] = FORMAT_EXPERTS
    return merged, description_entry(merged)

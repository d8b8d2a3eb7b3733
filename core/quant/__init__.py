"""Weight-only quantization (int8 / int4, group-wise, symmetric or asymmetric): ``shardwise.quant``.

``init_inference(model, quant={"weight": {"num_bits": 4}})`` (or ``dtype=torch.int8``) runs
:func:`quantize_model` after sharding and before kernel injection (which adopts the quantized
linears as they are); it can also be called alone::

    from shardwise.quant import quantize_model
    report = quantize_model(model, {"weight": {"num_bits": 8}}, accelerator, torch.bfloat16)
    print(report.summary())

``check_fits(model, quant, accelerator, dtype)`` raises whatever ``quantize_model`` would raise
(bad settings, a group size that does not fit a layer, a layer only the slow reference kernel
could run) without changing the model.

Modules: :mod:`.config` (the ``quant=`` dict, DeepSpeed MoQ mapping), :mod:`.modules`
(:class:`QuantLinear`), :mod:`.tied` (:class:`QuantEmbedding`: an output head tied to the input
embeddings, quantized with ``lm_head``, stored once), :mod:`.experts` (:class:`QuantExperts`: a Mixture-of-Experts model's
experts, quantized per expert on the grouped ``quant_moe_mlp`` kernel), :mod:`.transform`
(:func:`quantize_model`, :class:`Quantizer` and its ``reading_hook``: the per-tensor hook the
checkpoint loader calls), :mod:`.checkpoint`
(save/load without re-quantizing; the ``shardwise.quant`` checkpoint extension a quantized
engine's sharded checkpoint carries, registered on import).
"""

from .checkpoint import load_quantized, save_quantized
from .config import QuantConfig, parse_quant
from .experts import QuantExperts
from .modules import QuantLinear
from .tied import QuantEmbedding
from .transform import (AlreadyQuantizedError, QuantReport, Quantizer, check_fits, model_bytes,
                        quant_targets, quantize_model, quantize_model_experts)

__all__ = ["load_quantized", "save_quantized", "QuantConfig", "parse_quant", "QuantLinear",
           "QuantEmbedding",
           "QuantExperts", "AlreadyQuantizedError", "QuantReport", "Quantizer", "check_fits",
           "model_bytes", "quant_targets", "quantize_model", "quantize_model_experts"]

"""The model skeleton of a checkpoint: its config's architecture with parameters on the meta
device (no memory) and buffers real (rotary ``inv_freq``, masks: computed by the constructors).

A user who builds the model themselves can do the same::

    from accelerate import init_empty_weights          # parameters on meta, buffers real
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    # or: with torch.device("meta"): ...  (buffers on meta too; recomputed while loading)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .description import Description
from .errors import CheckpointError


def build_meta_model(desc: Description, dtype: torch.dtype | None = None) -> nn.Module:
    """``AutoModelForCausalLM`` (else ``AutoModel``) of the checkpoint's ``config.json``, with
    parameters on meta in ``dtype``."""
    import transformers
    from accelerate import init_empty_weights

    if desc.config_dir is None:
        raise CheckpointError(f"the checkpoint {desc.source} has no config.json next to its "
                              f"weights, so shardwise cannot know the architecture; pass the "
                              f"model (built on the meta device) as the first argument")
    config = transformers.AutoConfig.from_pretrained(Path(desc.config_dir))
    dtype = dtype or _dtype(desc.dtype) or _dtype(getattr(config, "dtype", None))
    kwargs = {"dtype": dtype} if dtype is not None else {}
    with init_empty_weights(include_buffers=False):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        except ValueError:  # not a causal LM (an encoder, …)
            model = transformers.AutoModel.from_config(config, **kwargs)
    model.tie_weights()  # accelerate's context re-wraps each Parameter, which unties them
    return model.eval()


def skeleton(model: nn.Module | None, desc: Description,
             dtype: torch.dtype | None = None) -> nn.Module:
    """The model to load ``desc`` into: ``model`` (its tied weights tied again) or, when None,
    :func:`build_meta_model`."""
    if model is None:
        return build_meta_model(desc, dtype)
    tie = getattr(model, "tie_weights", None)
    if isinstance(model, nn.Module) and callable(tie):
        tie()
    return model


def _dtype(value) -> torch.dtype | None:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        found = getattr(torch, value.removeprefix("torch."), None)
        return found if isinstance(found, torch.dtype) else None
    return None

"""The model skeleton of a checkpoint: its config's architecture with parameters on the meta
device (no memory) and buffers real (rotary ``inv_freq``, masks: computed by the constructors).

A user who builds the model themselves can do the same::

    from accelerate import init_empty_weights          # parameters on meta, buffers real
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    # or: with torch.device("meta"): ...  (buffers on meta too; recomputed while loading)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import ConfigError
from .description import Description
from .errors import CheckpointError


def build_meta_model(desc: Description, dtype: torch.dtype | None = None,
                     model_class: type | None = None) -> nn.Module:
    """The model of the checkpoint's ``config.json``, with parameters on meta in ``dtype``.

    Its class is ``model_class`` when given (a transformers model class, or an Auto class);
    else the first of the config's ``architectures`` that names a model class transformers
    exports (looked up by name among its exports only: nothing is imported, no remote code);
    else ``AutoModelForCausalLM``, then ``AutoModel``."""
    from accelerate import init_empty_weights

    config = load_config(desc)
    cls = model_class or architecture_class(config)
    dtype = dtype or _dtype(desc.dtype) or _dtype(getattr(config, "dtype", None))
    kwargs = {"dtype": dtype} if dtype is not None else {}
    with init_empty_weights(include_buffers=False):
        model = _instantiate(cls, config, kwargs)
    model.tie_weights()  # accelerate's context re-wraps each Parameter, which unties them
    return model.eval()


def load_config(desc: Description):
    """The transformers config of ``desc``'s ``config.json`` (read from inside the checkpoint's
    folder). A malformed file, or a model type this transformers does not know, is a
    :class:`CheckpointError`: custom (remote) code is never run."""
    import transformers

    if desc.config_file is None:
        raise CheckpointError(f"the checkpoint {desc.source} has no config.json next to its "
                              f"weights, so shardwise cannot know the architecture; pass the "
                              f"model (built on the meta device) as the first argument")
    where = str(desc.config_file)
    try:
        data = json.loads(Path(desc.config_file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{where} is not valid JSON ({type(exc).__name__}); the "
                              f"checkpoint's config is corrupted") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{where} must be a JSON object (a model config), got "
                              f"{type(data).__name__}")
    model_type = data.get("model_type")
    mapping = transformers.CONFIG_MAPPING
    if not isinstance(model_type, str) or model_type not in mapping:
        raise CheckpointError(f"{where} has model_type {model_type!r}, which this transformers "
                              f"({transformers.__version__}) does not know (shardwise never "
                              f"runs a checkpoint's own code); upgrade transformers, or build "
                              f"the model yourself and pass it on the meta device")
    try:
        return mapping[model_type].from_dict(data)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"{where} is not a valid {model_type} config "
                              f"({type(exc).__name__}: {exc})") from None


def architecture_class(config) -> type | None:
    """The first of ``config.architectures`` that transformers exports as a model class, None
    when none does (or the list is missing or malformed)."""
    import transformers

    names = getattr(config, "architectures", None)
    if not isinstance(names, list):
        return None
    exported = set(dir(transformers))
    for name in names:
        if isinstance(name, str) and name.isidentifier() and name in exported:
            cls = getattr(transformers, name, None)
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) \
                    and isinstance(getattr(cls, "config_class", None), type) \
                    and not name.endswith("PreTrainedModel"):  # the abstract base classes
                return cls
    return None


def check_model_class(cls: type) -> None:
    """``cls`` must be a transformers model class or an Auto class (else a ConfigError)."""
    import transformers

    if not isinstance(cls, type) or not (issubclass(cls, transformers.PreTrainedModel)
                                         or _is_auto(cls)):
        raise ConfigError(f"model class {getattr(cls, '__name__', cls)!r} is not a transformers "
                          f"model class; pass a PreTrainedModel subclass (e.g. "
                          f"transformers.BertModel), an Auto class (e.g. "
                          f"AutoModelForCausalLM), a model instance, or None")


def _is_auto(cls: type) -> bool:
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return issubclass(cls, _BaseAutoModelClass)


def _instantiate(cls: type | None, config, kwargs: dict) -> nn.Module:
    import transformers

    if cls is None:
        try:
            return transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        except ValueError:  # not a causal LM (an encoder, …)
            return transformers.AutoModel.from_config(config, **kwargs)
    if _is_auto(cls):
        try:
            return cls.from_config(config, **kwargs)
        except ValueError as exc:
            raise CheckpointError(f"{cls.__name__} has no model for the checkpoint's "
                                  f"{type(config).__name__}: {exc}") from None
    wants = getattr(cls, "config_class", None)
    if isinstance(wants, type) and not isinstance(config, wants):
        raise CheckpointError(f"{cls.__name__} is built from a {wants.__name__}, but the "
                              f"checkpoint's config.json is a {type(config).__name__}; pass the "
                              f"class of the checkpoint's architecture (or None to use its "
                              f"config's 'architectures')")
    return cls._from_config(config, **kwargs)


def skeleton(model: "nn.Module | type | None", desc: Description,
             dtype: torch.dtype | None = None) -> nn.Module:
    """The model to load ``desc`` into: ``model`` (its tied weights tied again), or when None
    :func:`build_meta_model`; a model class (``transformers.BertModel``, an Auto class) is
    built from the checkpoint's config as that class."""
    if isinstance(model, type):
        check_model_class(model)
        return build_meta_model(desc, dtype, model_class=model)
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

